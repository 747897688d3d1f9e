//! Versions of a prepared folder, so that a preparation never rewrites files a reader has open.
//!
//! A prepared folder `D` holds:
//! - `D/v-<time>-<pid>/`: one complete preparation (the files of [`super::shards`]), never modified once
//!   written, except for the reference log-prob cache added beside its files (each of its files replaced
//!   by renaming, under the version's `.reference.lock`);
//! - `D/CURRENT`: the name of the version to read, replaced atomically (written last);
//! - `D/.prepare.lock`: held (an OS lock) by the one process preparing `D`; a second one waits for it and
//!   then re-uses its result when it is what it would have written;
//! - `D/v-.../.readers`: an OS lock each reader holds shared for as long as it has the version open. A
//!   preparation removes the versions that are no longer current and that no reader holds.
//!
//! A reader opens the version `CURRENT` names and keeps it, whatever later preparations do. A folder of the
//! earlier single-version layout (its files directly in `D`) is still read; preparing it again writes a
//! version and removes the old files (a reader that has them mapped keeps its copy: unlinking does not
//! touch an open file).

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use super::{io_err, DataError};

/// The file naming the current version.
pub(crate) const CURRENT: &str = "CURRENT";
const PREPARE_LOCK: &str = ".prepare.lock";
pub(crate) const READERS_LOCK: &str = ".readers";
/// The lock of a version's reference log-prob cache while it is being computed.
pub const REFERENCE_LOCK: &str = ".reference.lock";
/// How often a process waiting for a lock checks for a stop request, and how often it says it waits.
const POLL: Duration = Duration::from_millis(100);
const SAY_EVERY: Duration = Duration::from_secs(60);

/// The files of the single-version layout, removed when such a folder is prepared again.
const LEGACY_FILES: &[&str] =
    &["manifest.json", "stats.json", "groups.jsonl", "prompts.bin", "responses.bin", "logprobs.f32"];

/// An exclusive OS lock (`flock`) held as long as this value lives; released by the OS however the
/// process ends, so there are no stale locks.
#[derive(Debug)]
pub struct ExclusiveLock {
    _file: File,
}

/// Take the exclusive lock `path` (created if missing), waiting for its holder: a message when it has to
/// wait and once a minute after, and [`DataError::Interrupted`] when `stop` is set meanwhile.
pub fn lock_exclusive(path: &Path, what: &str, stop: Option<&AtomicBool>) -> Result<ExclusiveLock, DataError> {
    lock_exclusive_polling(path, what, || stop.is_some_and(|s| s.load(Ordering::SeqCst)))
}

/// [`lock_exclusive`], calling `stop` at each poll while it waits: true ends the wait
/// ([`DataError::Interrupted`]).
pub fn lock_exclusive_polling(
    path: &Path,
    what: &str,
    mut stop: impl FnMut() -> bool,
) -> Result<ExclusiveLock, DataError> {
    let file =
        OpenOptions::new().read(true).write(true).create(true).truncate(false).open(path).map_err(io_err(path))?;
    let started = std::time::Instant::now();
    let mut said = None;
    loop {
        match file.try_lock() {
            Ok(()) => return Ok(ExclusiveLock { _file: file }),
            Err(std::fs::TryLockError::Error(e)) => {
                tracing::warn!("cannot lock {}: {e}; nothing stops two processes from {what} at once", path.display());
                return Ok(ExclusiveLock { _file: file });
            }
            Err(std::fs::TryLockError::WouldBlock) => {}
        }
        if stop() {
            return Err(DataError::Interrupted(format!("while waiting for another process {what}")));
        }
        if said.is_none_or(|t: std::time::Instant| t.elapsed() >= SAY_EVERY) {
            tracing::info!(
                "waiting for another process {what} ({} held for {:.0} s so far)",
                path.display(),
                started.elapsed().as_secs_f64()
            );
            said = Some(std::time::Instant::now());
        }
        std::thread::sleep(POLL);
    }
}

/// The preparation lock of folder `dir`.
pub(crate) fn lock_preparation(dir: &Path, stop: Option<&AtomicBool>) -> Result<ExclusiveLock, DataError> {
    lock_exclusive(&dir.join(PREPARE_LOCK), &format!("preparing {}", dir.display()), stop)
}

/// A new version name: unique for this process and later than the versions before it.
pub(crate) fn new_version_name() -> String {
    let ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis()).unwrap_or(0);
    format!("v-{ms:015}-{}", std::process::id())
}

/// The folder of the version `dir/CURRENT` names; `None` when there is no `CURRENT` (a new folder or
/// the single-version layout).
pub(crate) fn current(dir: &Path) -> Result<Option<PathBuf>, DataError> {
    let p = dir.join(CURRENT);
    match std::fs::read_to_string(&p) {
        Ok(name) => {
            let name = name.trim();
            if name.is_empty() || name.contains('/') || name.starts_with('.') {
                return Err(DataError::Format { path: p, message: format!("names no version ({name:?})") });
            }
            Ok(Some(dir.join(name)))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io_err(&p)(e)),
    }
}

/// Create the readers' lock file of a version being written.
pub(crate) fn create_readers_lock(version: &Path) -> Result<(), DataError> {
    let p = version.join(READERS_LOCK);
    File::create(&p).map(drop).map_err(io_err(&p))
}

/// A shared hold on a version: while it lives, no preparation removes the version.
#[derive(Debug)]
pub(crate) struct ReaderLock {
    _file: Option<File>,
}

/// The version of `dir` to read and a hold on it: the current version (retrying when a preparation
/// replaced and removed it between reading `CURRENT` and taking the hold), or `dir` itself in the
/// single-version layout.
pub(crate) fn open_current(dir: &Path) -> Result<(PathBuf, ReaderLock), DataError> {
    for _ in 0..16 {
        let Some(version) = current(dir)? else { return Ok((dir.to_path_buf(), ReaderLock { _file: None })) };
        let lock = version.join(READERS_LOCK);
        let file = match File::open(&lock) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(io_err(&lock)(e)),
        };
        if let Err(e) = file.lock_shared() {
            tracing::warn!("cannot lock {}: {e}; a new preparation could remove it while it is read", lock.display());
        }
        // Removed while this process waited for the lock: read the version that replaced it.
        if version.join("manifest.json").is_file() {
            return Ok((version, ReaderLock { _file: Some(file) }));
        }
    }
    Err(DataError::Format {
        path: dir.to_path_buf(),
        message: "versions replaced faster than they can be opened".into(),
    })
}

/// A hold on the version folder `version` (one that a preparation returned, or that another rank chose),
/// whatever `CURRENT` names now: an error when it was removed meanwhile.
pub(crate) fn hold_version(version: &Path) -> Result<ReaderLock, DataError> {
    let lock = version.join(READERS_LOCK);
    let file = File::open(&lock).map_err(io_err(&lock))?;
    if let Err(e) = file.lock_shared() {
        tracing::warn!("cannot lock {}: {e}; a new preparation could remove it while it is read", lock.display());
    }
    if !version.join("manifest.json").is_file() {
        return Err(DataError::Format { path: version.to_path_buf(), message: "removed by a preparation".into() });
    }
    Ok(ReaderLock { _file: Some(file) })
}

/// Make `name` the current version of `dir` (atomically), then remove what is no longer needed: the files
/// of the single-version layout and the versions that are not current and that no reader holds.
pub(crate) fn switch_to(dir: &Path, name: &str) -> Result<(), DataError> {
    let p = dir.join(CURRENT);
    crate::fsio::write_atomic(&p, name.as_bytes()).map_err(io_err(&p))?;
    remove_unused(dir, Some(name));
    Ok(())
}

/// Remove, from `dir`, the single-version files (when it has a current version) and the versions other
/// than `current` that no reader holds. Needs the preparation lock. Failures are logged, not fatal: what
/// is left is removed by a later preparation.
pub(crate) fn remove_unused(dir: &Path, current: Option<&str>) {
    let Some(current) = current else { return };
    for f in LEGACY_FILES {
        let _ = std::fs::remove_file(dir.join(f));
    }
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with("tokens-") && name.ends_with(".u32") {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
    for old in versions(dir).into_iter().filter(|v| v.file_name().is_some_and(|n| n != current)) {
        remove_if_unread(&old);
    }
}

/// The version folders of `dir`, oldest first.
pub(crate) fn versions(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut v: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_dir() && p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("v-")))
        .collect();
    v.sort();
    v
}

/// What the exclusive try-lock of a version's `.readers` says about its readers.
#[derive(Debug)]
enum Readers {
    /// The lock was taken: nobody reads the version.
    None,
    /// A reader holds it.
    Some,
    /// The lock cannot be taken on this filesystem (NFS without a writable descriptor, Lustre without
    /// flock): whether anybody reads the version is unknown.
    Unknown(std::io::Error),
}

/// The readers of a version from the outcome of its exclusive try-lock: only a lock taken means none.
fn readers_of(attempt: Result<(), std::fs::TryLockError>) -> Readers {
    match attempt {
        Ok(()) => Readers::None,
        Err(std::fs::TryLockError::WouldBlock) => Readers::Some,
        Err(std::fs::TryLockError::Error(e)) => Readers::Unknown(e),
    }
}

/// Say once per process that replaced versions are kept because their readers cannot be known.
fn warn_unlockable(lock: &Path, e: &dyn std::fmt::Display) {
    static SAID: AtomicBool = AtomicBool::new(false);
    if !SAID.swap(true, Ordering::SeqCst) {
        tracing::warn!(
            "cannot lock {} ({e}): this filesystem does not lock files, so a running trainer may still read the \
             replaced preparation; it is kept (and so are the others this process cannot check). Remove replaced \
             v-* folders by hand once no run uses them",
            lock.display()
        );
    }
}

/// Remove the version `v` unless a reader holds it, or the hold cannot be checked (a lock error keeps it).
fn remove_if_unread(v: &Path) {
    let lock = v.join(READERS_LOCK);
    // Read-write: over NFS, flock is emulated with POSIX locks, and an exclusive one needs a writable descriptor.
    let held = match OpenOptions::new().read(true).write(true).open(&lock) {
        Ok(f) => match readers_of(f.try_lock()) {
            Readers::None => Some(f),
            Readers::Some => {
                tracing::debug!("{} is still read: kept", v.display());
                return;
            }
            Readers::Unknown(e) => {
                warn_unlockable(&lock, &e);
                return;
            }
        },
        // A version without the lock file is one that was never complete: nobody can hold it.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => {
            warn_unlockable(&lock, &e);
            return;
        }
    };
    // Removed while the lock is held: a reader waiting for it then finds the version gone and re-reads CURRENT.
    match std::fs::remove_dir_all(v) {
        Ok(()) => tracing::info!("removed the replaced preparation {}", v.display()),
        Err(e) => tracing::warn!("cannot remove the replaced preparation {}: {e}", v.display()),
    }
    drop(held);
}

/// Remove what killed preparations left in `dir` (half-written versions). Needs the preparation lock.
pub(crate) fn remove_leftovers(dir: &Path) {
    let mut outcomes = crate::fsio::remove_unfinished(dir, |_| true);
    let selection = dir.join(".selection"); // of the single-version layout
    if selection.is_dir() {
        outcomes.push((selection.clone(), std::fs::remove_dir_all(&selection)));
    }
    for (p, outcome) in outcomes {
        match outcome {
            Ok(()) => tracing::warn!("removed {} (left by an interrupted preparation)", p.display()),
            Err(e) => tracing::warn!("cannot remove {}: {e}", p.display()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_held_version_is_kept_and_an_unheld_one_removed() {
        let dir = tempfile::tempdir().unwrap();
        for v in ["v-1", "v-2", "v-3"] {
            std::fs::create_dir_all(dir.path().join(v)).unwrap();
            std::fs::write(dir.path().join(v).join("manifest.json"), "{}").unwrap();
            create_readers_lock(&dir.path().join(v)).unwrap();
        }
        std::fs::write(dir.path().join(CURRENT), "v-1").unwrap();
        let (v1, held) = open_current(dir.path()).unwrap();
        assert_eq!(v1, dir.path().join("v-1"));
        switch_to(dir.path(), "v-3").unwrap();
        assert!(dir.path().join("v-1").is_dir(), "a read version must be kept");
        assert!(!dir.path().join("v-2").exists(), "an unread, replaced version is removed");
        drop(held);
        remove_unused(dir.path(), Some("v-3"));
        assert!(!dir.path().join("v-1").exists());
        assert_eq!(open_current(dir.path()).unwrap().0, dir.path().join("v-3"));
    }

    #[test]
    fn a_version_whose_readers_cannot_be_checked_is_kept() {
        // Only a taken lock means no reader; an error (EBADF on NFS, ENOSYS on Lustre without flock) does not.
        for errno in [libc::EBADF, libc::ENOSYS, libc::ENOLCK] {
            let e = std::fs::TryLockError::Error(std::io::Error::from_raw_os_error(errno));
            assert!(matches!(readers_of(Err(e)), Readers::Unknown(_)), "errno {errno}");
        }
        assert!(matches!(readers_of(Err(std::fs::TryLockError::WouldBlock)), Readers::Some));
        assert!(matches!(readers_of(Ok(())), Readers::None));
        // A `.readers` that cannot be opened for locking (here a folder) keeps its version too.
        let dir = tempfile::tempdir().unwrap();
        for v in ["v-1", "v-2"] {
            std::fs::create_dir_all(dir.path().join(v)).unwrap();
            std::fs::write(dir.path().join(v).join("manifest.json"), "{}").unwrap();
        }
        std::fs::create_dir(dir.path().join("v-1").join(READERS_LOCK)).unwrap();
        create_readers_lock(&dir.path().join("v-2")).unwrap();
        switch_to(dir.path(), "v-2").unwrap();
        assert!(dir.path().join("v-1/manifest.json").is_file(), "a version that cannot be checked was removed");
    }

    /// `CURRENT` is replaced by a rename, which is in the folder's data: the folder is synced after it.
    #[test]
    fn switching_the_current_version_syncs_the_folder() {
        let dir = tempfile::tempdir().unwrap();
        crate::fsio::take_synced();
        switch_to(dir.path(), "v-1").unwrap();
        assert_eq!(crate::fsio::take_synced(), [dir.path().to_path_buf()]);
        assert_eq!(std::fs::read_to_string(dir.path().join(CURRENT)).unwrap(), "v-1");
    }

    #[test]
    fn a_second_locker_waits_and_can_be_stopped() {
        let dir = tempfile::tempdir().unwrap();
        let first = lock_preparation(dir.path(), None).unwrap();
        let stop = AtomicBool::new(true);
        let err = lock_preparation(dir.path(), Some(&stop)).unwrap_err();
        assert!(matches!(err, DataError::Interrupted(_)), "{err}");
        drop(first);
        lock_preparation(dir.path(), Some(&stop)).unwrap();
    }

    #[test]
    fn current_refuses_a_name_outside_the_folder() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(current(dir.path()).unwrap(), None);
        std::fs::write(dir.path().join(CURRENT), "../elsewhere").unwrap();
        assert!(current(dir.path()).is_err());
    }
}
