//! Atomic output: a file or folder is written under a hidden temporary name next to its target, synced,
//! and renamed into place only once complete, so a crash never leaves a half-written file under the
//! final name and an error leaves any previous file untouched. A temporary that is dropped before it is
//! persisted is removed. Files and folders get the modes the process's umask gives a new file or folder
//! (0644 and 0755 under the usual `umask 022`), not a temporary file's owner-only 0600.

use std::fs::Permissions;
use std::io::{self, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use tempfile::{Builder, NamedTempFile, TempDir};

/// The process's umask, read once (from /proc/self/status where there is one, else from `umask(2)`).
fn umask() -> u32 {
    static UMASK: OnceLock<u32> = OnceLock::new();
    *UMASK.get_or_init(|| {
        let from_proc = std::fs::read_to_string("/proc/self/status").ok().and_then(|s| {
            s.lines().find_map(|l| l.strip_prefix("Umask:")).and_then(|v| u32::from_str_radix(v.trim(), 8).ok())
        });
        from_proc.unwrap_or_else(|| {
            // SAFETY: umask only swaps the process's file mode mask; the old one is put back at once.
            let old = unsafe { libc::umask(0o022) };
            unsafe { libc::umask(old) };
            old as u32
        })
    })
}

/// The mode of a new file under the process's umask (0644 under `umask 022`).
pub fn file_mode() -> u32 {
    0o666 & !umask()
}

/// The mode of a new folder under the process's umask (0755 under `umask 022`).
pub fn dir_mode() -> u32 {
    0o777 & !umask()
}

/// The folder that holds `target` (`.` for a bare name), created if missing, and `target`'s file name.
fn split(target: &Path) -> io::Result<(&Path, String)> {
    let name = target
        .file_name()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, format!("{} names no file", target.display())))?;
    let parent = target.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent)?;
    Ok((parent, format!(".{}.", name.to_string_lossy())))
}

/// A new temporary file in `target`'s folder (created if missing); finish it with [`persist`].
pub fn temp_file(target: &Path) -> io::Result<NamedTempFile> {
    let (parent, prefix) = split(target)?;
    Builder::new().prefix(&prefix).suffix(".tmp").tempfile_in(parent)
}

/// Give `tmp` a new file's mode ([`file_mode`]), sync it and rename it to `target`, replacing any file there.
pub fn persist(tmp: NamedTempFile, target: &Path) -> io::Result<()> {
    tmp.as_file().set_permissions(Permissions::from_mode(file_mode()))?;
    tmp.as_file().sync_all()?;
    tmp.persist(target)?;
    sync_parent(target);
    Ok(())
}

/// Sync the folder that holds `target`, so that a rename into it survives a crash of the machine (the
/// rename is in the folder's data, which a file's sync does not write). Best effort: some filesystems
/// cannot sync a folder.
fn sync_parent(target: &Path) {
    sync_dir(target.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new(".")));
}

/// Sync the folder `dir` (the names in it). Best effort, as [`sync_parent`].
fn sync_dir(dir: &Path) {
    match std::fs::File::open(dir).and_then(|d| d.sync_all()) {
        #[cfg(test)]
        Ok(()) => SYNCED.with(|s| s.borrow_mut().push(dir.to_path_buf())),
        #[cfg(not(test))]
        Ok(()) => {}
        Err(e) => tracing::debug!("cannot sync the folder {}: {e}", dir.display()),
    }
}

/// Sync `file` (at `path`)'s data to the device: an appended log made durable at a checkpoint.
pub fn sync_file(file: &std::fs::File, path: &Path) -> io::Result<()> {
    file.sync_data()?;
    #[cfg(test)]
    SYNCED.with(|s| s.borrow_mut().push(path.to_path_buf()));
    #[cfg(not(test))]
    let _ = path;
    Ok(())
}

#[cfg(test)]
thread_local! {
    /// The folders [`sync_dir`] synced on this thread (and the files [`sync_file`] synced): what the tests of
    /// a rename's durability read.
    pub(crate) static SYNCED: std::cell::RefCell<Vec<PathBuf>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The folders synced on this thread since the last call (tests).
#[cfg(test)]
pub(crate) fn take_synced() -> Vec<PathBuf> {
    SYNCED.with(|s| std::mem::take(&mut *s.borrow_mut()))
}

/// Bytes free to an unprivileged writer on the file system of `path` (or of its nearest existing
/// ancestor); None where statvfs fails.
pub fn free_bytes(path: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let existing = path.ancestors().find(|p| p.exists())?;
    let c = std::ffi::CString::new(existing.as_os_str().as_bytes()).ok()?;
    // SAFETY: statvfs is plain data, written whole by the call below.
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated path and `s` a valid place for the result.
    let rc = unsafe { libc::statvfs(c.as_ptr(), &mut s) };
    (rc == 0).then(|| s.f_bavail as u64 * s.f_frsize as u64)
}

/// Whether `e` (or what it wraps, as its message says) is "no space left on device".
pub fn is_disk_full(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(e);
    while let Some(err) = cur {
        let full = err.downcast_ref::<io::Error>().is_some_and(|io| io.raw_os_error() == Some(libc::ENOSPC));
        if full || err.to_string().contains("(os error 28)") {
            return true;
        }
        cur = err.source();
    }
    false
}

/// Write `bytes` to `path` atomically (see the module documentation).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let mut tmp = temp_file(path)?;
    tmp.write_all(bytes)?;
    persist(tmp, path)
}

/// A new, empty temporary folder (with a new folder's mode, [`dir_mode`]) in `target`'s parent (created if missing); fill it, then
/// finish it with [`persist_dir`].
pub fn temp_dir(target: &Path) -> io::Result<TempDir> {
    let (parent, prefix) = split(target)?;
    let dir = Builder::new().prefix(&prefix).suffix(".tmp").tempdir_in(parent)?;
    std::fs::set_permissions(dir.path(), Permissions::from_mode(dir_mode()))?;
    Ok(dir)
}

/// What an atomic write that was killed can leave in a folder, recognised by its name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Leftover {
    /// `.NAME.XXXXXX.tmp`: a file or folder that was being written.
    Writing,
    /// `.NAME.XXXXXX.tmp.old`: the previous version of `NAME`, moved aside while the new one was renamed
    /// in; when `NAME` is missing the swap was cut short and this is the version to put back.
    Aside { target: String },
}

/// The kind of leftover `name` is, if it is one of the temporary names this module makes.
pub fn leftover(name: &str) -> Option<Leftover> {
    let rest = name.strip_prefix('.')?;
    if let Some(tmp) = rest.strip_suffix(".tmp.old") {
        let (target, _) = tmp.rsplit_once('.')?;
        return Some(Leftover::Aside { target: target.to_string() });
    }
    let tmp = rest.strip_suffix(".tmp")?;
    tmp.rsplit_once('.').map(|_| Leftover::Writing)
}

/// Remove from `dir` what interrupted atomic writes left there (`.NAME.XXXXXX.tmp` files and folders, see
/// [`leftover`]) whose name `which` accepts; each removal's path and outcome. Call it only while no other
/// process writes into `dir` (under the lock that guards it).
pub fn remove_unfinished(dir: &Path, which: impl Fn(&str) -> bool) -> Vec<(PathBuf, io::Result<()>)> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    entries
        .flatten()
        .filter(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            leftover(&name) == Some(Leftover::Writing) && which(&name)
        })
        .map(|e| {
            let p = e.path();
            let removed = if p.is_dir() { std::fs::remove_dir_all(&p) } else { std::fs::remove_file(&p) };
            (p, removed)
        })
        .collect()
}

/// Give the files of `tmp` a new file's mode, sync them and swap `tmp` in as folder `target`: a previous `target` is moved aside, `tmp`
/// renamed in, and the previous one removed. If the rename fails, the previous `target` is put back.
pub fn persist_dir(tmp: TempDir, target: &Path) -> io::Result<()> {
    for entry in std::fs::read_dir(tmp.path())? {
        let p = entry?.path();
        if p.is_file() {
            // Some writers (safetensors) create owner-only files, which other users could not load.
            std::fs::set_permissions(&p, Permissions::from_mode(file_mode()))?;
            std::fs::File::open(&p)?.sync_all()?;
        }
    }
    // The names of its files, which are in the folder's data.
    sync_dir(tmp.path());
    // The temporary name is unique in the folder, so this one is free too.
    let aside = PathBuf::from(format!("{}.old", tmp.path().display()));
    let replaced = target.exists();
    if replaced {
        std::fs::rename(target, &aside)?;
    }
    if let Err(e) = std::fs::rename(tmp.path(), target) {
        if replaced {
            std::fs::rename(&aside, target)?;
        }
        return Err(e);
    }
    // Renamed away: nothing is left for the TempDir to remove.
    let _ = tmp.keep();
    sync_parent(target);
    // `target` is in place: removing what was set aside (this one, and those earlier swaps could not
    // remove) is cleanup, whose failure (ENOTEMPTY from NFS's `.nfsXXXX` files while a reader has a file open)
    // is a warning; the next swap of `target` tries again.
    remove_set_aside(target);
    Ok(())
}

/// Remove the previous versions of folder `target` that swaps set aside (`.NAME.XXXXXX.tmp.old`), warning
/// about those that cannot be removed yet.
fn remove_set_aside(target: &Path) {
    let (Some(parent), Some(name)) = (target.parent(), target.file_name()) else { return };
    let name = name.to_string_lossy();
    let parent = if parent.as_os_str().is_empty() { Path::new(".") } else { parent };
    let Ok(entries) = std::fs::read_dir(parent) else { return };
    for e in entries.flatten() {
        let aside = leftover(&e.file_name().to_string_lossy())
            .is_some_and(|l| l == Leftover::Aside { target: name.to_string() });
        if aside {
            if let Err(err) = std::fs::remove_dir_all(e.path()) {
                tracing::warn!("cannot remove {} yet (retried at the next save): {err}", e.path().display());
            }
        }
    }
}

/// Create folder `dir` (and its parents) unless it exists; a path that exists but is not a folder is an
/// error saying so, rather than `File exists (os error 17)`.
pub fn create_folder(dir: &Path) -> io::Result<()> {
    match std::fs::metadata(dir) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(_) => Err(io::Error::new(
            io::ErrorKind::NotADirectory,
            "exists and is not a folder (an output folder must be a folder, not a file)",
        )),
        Err(_) => std::fs::create_dir_all(dir),
    }
}

/// The exclusive lock of an output folder (`DIR/.lock`), held as long as this value lives. It is an OS file
/// lock (`flock`), so the OS releases it when the process ends, however it ends: there are no stale locks.
#[derive(Debug)]
pub struct FolderLock {
    _file: std::fs::File,
}

/// Why an output folder could not be locked.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    /// Another process holds the lock; `holder` describes it (`pid N on HOST`).
    #[error("{} is in use by another grpo process ({holder})", dir.display())]
    Busy { dir: PathBuf, holder: String },
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: io::Error },
}

/// This machine's host name (part of the lock holder's description).
fn host_name() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most `buf.len()` bytes into the buffer it is given.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    if rc == 0 {
        String::from_utf8_lossy(&buf[..end]).into_owned()
    } else {
        "unknown host".into()
    }
}

/// Create folder `dir` if missing ([`create_folder`]) and take `dir/.lock`, or fail naming the process that
/// holds it. The file holds the holder's pid and host. On a file system that cannot lock, the lock is
/// taken with a warning that nothing guards the folder.
pub fn lock_folder(dir: &Path) -> Result<FolderLock, LockError> {
    create_folder(dir).map_err(|source| LockError::Io { path: dir.to_path_buf(), source })?;
    let path = dir.join(".lock");
    let io_err = |source| LockError::Io { path: path.clone(), source };
    let mut file =
        std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(false).open(&path).map_err(io_err)?;
    match file.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            let holder = match text.split_whitespace().collect::<Vec<_>>()[..] {
                [pid, host, ..] => format!("pid {pid} on {host}"),
                [pid] => format!("pid {pid}"),
                [] => "pid unknown".into(),
            };
            return Err(LockError::Busy { dir: dir.to_path_buf(), holder });
        }
        Err(std::fs::TryLockError::Error(e)) => {
            // A file system without locks (some network mounts): go on, but say that nothing guards the folder.
            tracing::warn!("cannot lock {}: {e}; another process on this folder would not be stopped", path.display());
        }
    }
    file.set_len(0)
        .and_then(|()| writeln!(file, "{} {}", std::process::id(), host_name()))
        .and_then(|()| file.flush())
        .map_err(io_err)?;
    Ok(FolderLock { _file: file })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mode(p: &Path) -> u32 {
        std::fs::metadata(p).unwrap().permissions().mode() & 0o777
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> =
            std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        v.sort();
        v
    }

    #[test]
    fn modes_follow_the_umask() {
        // The process's umask as the kernel reports it, against what a plain create makes.
        let dir = tempfile::tempdir().unwrap();
        let plain = dir.path().join("plain");
        std::fs::write(&plain, "x").unwrap();
        assert_eq!(mode(&plain), file_mode());
        std::fs::create_dir(dir.path().join("d")).unwrap();
        assert_eq!(mode(&dir.path().join("d")), dir_mode());
    }

    #[test]
    fn leftovers_are_recognised_by_the_names_this_module_makes() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("step-00000002");
        let tmp = temp_dir(&target).unwrap();
        let name = tmp.path().file_name().unwrap().to_string_lossy().into_owned();
        assert_eq!(leftover(&name), Some(Leftover::Writing), "{name}");
        let aside = format!("{name}.old");
        assert_eq!(leftover(&aside), Some(Leftover::Aside { target: "step-00000002".into() }));
        for other in ["step-00000002", "best", ".hidden", "x.tmp", ".tmp"] {
            assert_eq!(leftover(other), None, "{other}");
        }
    }

    /// A rename is in its folder's data, which syncing the file does not write: after each rename into place
    /// (a file's, a folder's swap) the folder is synced.
    #[test]
    fn the_folder_of_each_rename_is_synced() {
        let dir = tempfile::tempdir().unwrap();
        let sub = dir.path().join("sub");
        take_synced();
        write_atomic(&sub.join("latest"), b"step-00000002").unwrap();
        assert_eq!(take_synced(), std::slice::from_ref(&sub));
        let tmp = temp_dir(&sub.join("step-00000002")).unwrap();
        std::fs::write(tmp.path().join("weights"), "w").unwrap();
        let staged = tmp.path().to_path_buf();
        persist_dir(tmp, &sub.join("step-00000002")).unwrap();
        assert_eq!(take_synced(), [staged, sub.clone()], "the folder's own names, then its rename");
        // Over a folder already there (the previous version set aside, then removed).
        let tmp = temp_dir(&sub.join("step-00000002")).unwrap();
        let staged = tmp.path().to_path_buf();
        persist_dir(tmp, &sub.join("step-00000002")).unwrap();
        assert_eq!(take_synced(), [staged, sub]);
    }

    /// Set (or clear) the immutable flag of file `p` (`chattr +i`): false where this process may not
    /// (it needs CAP_LINUX_IMMUTABLE) or the filesystem has no such flag.
    fn set_immutable(p: &Path, on: bool) -> bool {
        use std::os::fd::AsRawFd;
        const FS_IMMUTABLE_FL: libc::c_long = 0x10;
        let Ok(f) = std::fs::File::open(p) else { return false };
        let mut flags: libc::c_long = 0;
        // SAFETY: the flags ioctls read and write one long through the pointer, on a descriptor we own.
        unsafe {
            if libc::ioctl(f.as_raw_fd(), libc::FS_IOC_GETFLAGS, &mut flags) != 0 {
                return false;
            }
            flags = if on { flags | FS_IMMUTABLE_FL } else { flags & !FS_IMMUTABLE_FL };
            libc::ioctl(f.as_raw_fd(), libc::FS_IOC_SETFLAGS, &flags) == 0
        }
    }

    /// Once the new folder is in place, a previous version that cannot be removed yet (a file in it that
    /// cannot go, as NFS's `.nfsXXXX` files while a reader has one open) is a warning, not an error, and
    /// goes at the next swap.
    #[test]
    fn a_previous_version_that_cannot_be_removed_yet_is_no_error() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("rollout-policy");
        let tmp = temp_dir(&out).unwrap();
        std::fs::write(tmp.path().join("weights"), "first").unwrap();
        persist_dir(tmp, &out).unwrap();
        if !set_immutable(&out.join("weights"), true) {
            eprintln!("SKIPPED: cannot make a file immutable here (needs CAP_LINUX_IMMUTABLE on ext4, xfs, ...)");
            return;
        }
        let tmp = temp_dir(&out).unwrap();
        std::fs::write(tmp.path().join("weights"), "second").unwrap();
        let swapped = persist_dir(tmp, &out);
        let aside: Vec<PathBuf> =
            names(dir.path()).iter().filter(|n| n.ends_with(".old")).map(|n| dir.path().join(n)).collect();
        for a in &aside {
            set_immutable(&a.join("weights"), false);
        }
        swapped.unwrap();
        assert_eq!(std::fs::read_to_string(out.join("weights")).unwrap(), "second");
        assert_eq!(aside.len(), 1, "the previous version is kept aside until it can go");
        let tmp = temp_dir(&out).unwrap();
        persist_dir(tmp, &out).unwrap();
        assert_eq!(names(dir.path()), ["rollout-policy"]);
    }

    #[test]
    fn files_are_replaced_whole_with_the_umasks_mode() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("sub/state.json");
        write_atomic(&p, b"first").unwrap();
        write_atomic(&p, b"second").unwrap();
        assert_eq!(std::fs::read_to_string(&p).unwrap(), "second");
        assert_eq!(mode(&p), file_mode());
        assert_eq!(names(&dir.path().join("sub")), ["state.json"]);
        // A temporary dropped before it is persisted leaves nothing behind and the target as it was.
        let mut tmp = temp_file(&p).unwrap();
        tmp.write_all(b"third").unwrap();
        drop(tmp);
        assert_eq!(std::fs::read_to_string(&p).unwrap(), "second");
        assert_eq!(names(&dir.path().join("sub")), ["state.json"]);
    }

    #[test]
    fn folders_are_swapped_whole_with_the_umasks_mode() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("ckpt");
        for content in ["first", "second"] {
            let tmp = temp_dir(&out).unwrap();
            std::fs::write(tmp.path().join("weights"), content).unwrap();
            persist_dir(tmp, &out).unwrap();
        }
        assert_eq!(std::fs::read_to_string(out.join("weights")).unwrap(), "second");
        assert_eq!(mode(&out), dir_mode());
        assert_eq!(mode(&out.join("weights")), file_mode());
        assert_eq!(names(dir.path()), ["ckpt"]);
        // A previous version that an earlier swap could not remove (NFS's `.nfsXXXX` files) goes at the next.
        let stale = dir.path().join(".ckpt.Qw12Er.tmp.old");
        std::fs::create_dir_all(&stale).unwrap();
        std::fs::write(stale.join(".nfs000123"), "x").unwrap();
        let tmp = temp_dir(&out).unwrap();
        std::fs::write(tmp.path().join("weights"), "second").unwrap();
        persist_dir(tmp, &out).unwrap();
        assert_eq!(names(dir.path()), ["ckpt"]);
        let tmp = temp_dir(&out).unwrap();
        std::fs::write(tmp.path().join("weights"), "third").unwrap();
        drop(tmp);
        assert_eq!(std::fs::read_to_string(out.join("weights")).unwrap(), "second");
        assert_eq!(names(dir.path()), ["ckpt"]);
    }
}
