//! The Hugging Face cache as huggingface_hub lays it out: `<cache>/models--org--name/` (datasets:
//! `datasets--org--name/`) with `blobs/<etag>` (the files, named by their ETag: an LFS file's sha256, a
//! git blob's sha1), `snapshots/<commit>/<file>` (relative symlinks into `blobs/`), `refs/<branch or tag>`
//! (the commit, no newline); partial downloads are `blobs/<etag>.incomplete`, and the lock of a blob is
//! `<cache>/.locks/models--org--name/<etag>.lock`.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Component, Path, PathBuf};

use super::{io_err, HubError, RepoRef, Snapshot};

/// `$HF_HOME`, else `$XDG_CACHE_HOME/huggingface`, else `~/.cache/huggingface` (None without a home).
pub fn hf_home() -> Option<PathBuf> {
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    var("HF_HOME")
        .or_else(|| var("XDG_CACHE_HOME").map(|x| x.join("huggingface")))
        .or_else(|| var("HOME").map(|h| h.join(".cache").join("huggingface")))
}

/// The hub cache: `$HF_HUB_CACHE`, else `<HF home>/hub` ([`hf_home`]), else `.cache/huggingface/hub` here.
pub fn cache_dir() -> PathBuf {
    match std::env::var_os("HF_HUB_CACHE").filter(|v| !v.is_empty()) {
        Some(p) => PathBuf::from(p),
        None => hf_home().unwrap_or_else(|| Path::new(".cache").join("huggingface")).join("hub"),
    }
}

/// Whether `path` is a file of a snapshot in the hub cache ([`cache_dir`]): its path names the commit.
pub fn is_snapshot_file(path: &Path) -> bool {
    path.strip_prefix(cache_dir())
        .is_ok_and(|rel| rel.components().nth(1).is_some_and(|c| c.as_os_str() == "snapshots"))
}

/// One repo's folder in the cache.
#[derive(Debug, Clone)]
pub struct RepoCache {
    cache: PathBuf,
    hf: hf_hub::Repo,
    folder: String,
    revision: String,
}

impl RepoCache {
    pub fn new(cache: &Path, repo: &RepoRef) -> Self {
        let hf = repo.hf();
        RepoCache { cache: cache.to_path_buf(), folder: hf.folder_name(), hf, revision: repo.revision.clone() }
    }

    fn root(&self) -> PathBuf {
        self.cache.join(&self.folder)
    }

    pub fn snapshot_dir(&self, commit: &str) -> PathBuf {
        hf_hub::Cache::new(self.cache.clone()).repo(self.hf.clone()).pointer_path(commit)
    }

    pub fn blob(&self, etag: &str) -> PathBuf {
        self.root().join("blobs").join(etag)
    }

    pub fn incomplete(&self, etag: &str) -> PathBuf {
        self.root().join("blobs").join(format!("{etag}.incomplete"))
    }

    fn lock_path(&self, etag: &str) -> PathBuf {
        self.cache.join(".locks").join(&self.folder).join(format!("{etag}.lock"))
    }

    /// The commit the revision names here: `refs/<revision>` for a branch or tag, else the revision itself
    /// when a snapshot has that name (a commit).
    pub fn local_commit(&self) -> Option<String> {
        let refs = std::fs::read_to_string(self.root().join("refs").join(&self.revision)).ok();
        match refs.map(|t| t.trim().to_string()).filter(|c| !c.is_empty()) {
            Some(c) => Some(c),
            None => Some(self.revision.clone()).filter(|c| self.snapshot_dir(c).is_dir()),
        }
    }

    /// The cached snapshot of the revision when it holds every file `needs` lists, else the first missing
    /// file (`needs` also says which, for a snapshot that does not exist).
    pub fn complete_snapshot(&self, needs: &dyn Fn(&Path) -> Result<Vec<String>, String>) -> Result<Snapshot, String> {
        let commit = self.local_commit().unwrap_or_default();
        let dir =
            if commit.is_empty() { self.root().join("snapshots").join("none") } else { self.snapshot_dir(&commit) };
        let files = needs(&dir)?;
        match files.iter().find(|f| !dir.join(f).is_file()) {
            Some(missing) => Err(missing.clone()),
            None => Ok(Snapshot { dir, commit, files }),
        }
    }

    /// Point `refs/<revision>` at `commit` (not for a revision that is the commit itself), atomically.
    pub fn write_ref(&self, revision: &str, commit: &str) -> Result<(), HubError> {
        if revision == commit {
            return Ok(());
        }
        let path = self.root().join("refs").join(revision);
        if std::fs::read_to_string(&path).is_ok_and(|c| c == commit) {
            return Ok(());
        }
        let dir = path.parent().unwrap_or(&path);
        std::fs::create_dir_all(dir).map_err(io_err(dir))?;
        let mut tmp = tempfile::NamedTempFile::new_in(dir).map_err(io_err(dir))?;
        std::io::Write::write_all(&mut tmp, commit.as_bytes()).map_err(io_err(&path))?;
        tmp.persist(&path).map_err(|e| io_err(&path)(e.error))?;
        Ok(())
    }

    /// Make `snapshots/<commit>/<file>` a relative symlink to `blobs/<etag>` (as huggingface_hub does:
    /// `../../blobs/<etag>`, one more `..` per folder of `file`).
    pub fn link(&self, commit: &str, file: &str, etag: &str) -> Result<PathBuf, HubError> {
        let pointer = self.snapshot_dir(commit).join(file);
        let depth = Path::new(file).components().filter(|c| matches!(c, Component::Normal(_))).count();
        let mut target = PathBuf::new();
        for _ in 0..depth + 1 {
            target.push("..");
        }
        target.push("blobs");
        target.push(etag);
        let dir = pointer.parent().unwrap_or(&pointer);
        std::fs::create_dir_all(dir).map_err(io_err(dir))?;
        if std::fs::read_link(&pointer).is_ok_and(|t| t == target) {
            return Ok(pointer);
        }
        let _ = std::fs::remove_file(&pointer);
        match std::os::unix::fs::symlink(&target, &pointer) {
            // Another process made the same link meanwhile.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && pointer.is_file() => Ok(pointer),
            other => other.map(|()| pointer.clone()).map_err(io_err(&pointer)),
        }
    }

    /// Hold the lock of blob `etag`, waiting (with a log line) while another process holds it.
    pub fn lock(&self, etag: &str, file: &str) -> Result<BlobLock, HubError> {
        let path = self.lock_path(etag);
        let dir = path.parent().unwrap_or(&path);
        std::fs::create_dir_all(dir).map_err(io_err(dir))?;
        let f = File::options().create(true).truncate(false).write(true).open(&path).map_err(io_err(&path))?;
        // SAFETY: flock on a descriptor this function owns.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            tracing::info!("waiting for another process downloading {file} (lock {})", path.display());
            // SAFETY: as above; this call blocks until the holder releases it.
            if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } != 0 {
                return Err(io_err(&path)(std::io::Error::last_os_error()));
            }
        }
        Ok(BlobLock { _file: f })
    }
}

/// A held blob lock: released when dropped (closing the file releases its flock).
#[derive(Debug)]
pub struct BlobLock {
    _file: File,
}

#[cfg(test)]
mod tests {
    use super::super::Kind;
    use super::*;

    fn repo(revision: &str) -> RepoRef {
        RepoRef { kind: Kind::Model, id: "org/tiny".into(), revision: revision.into() }
    }

    #[test]
    fn paths_follow_the_huggingface_hub_layout() {
        let c = RepoCache::new(Path::new("/c"), &repo("main"));
        assert_eq!(c.snapshot_dir("abc"), Path::new("/c/models--org--tiny/snapshots/abc"));
        assert_eq!(c.blob("e1"), Path::new("/c/models--org--tiny/blobs/e1"));
        assert_eq!(c.incomplete("e1"), Path::new("/c/models--org--tiny/blobs/e1.incomplete"));
        assert_eq!(c.lock_path("e1"), Path::new("/c/.locks/models--org--tiny/e1.lock"));
    }

    #[test]
    fn links_refs_and_complete_snapshots() {
        let dir = tempfile::tempdir().unwrap();
        let c = RepoCache::new(dir.path(), &repo("main"));
        let needs = |_: &Path| Ok::<_, String>(vec!["config.json".to_string(), "sub/x.bin".to_string()]);
        assert_eq!(c.complete_snapshot(&needs).unwrap_err(), "config.json");
        std::fs::create_dir_all(dir.path().join("models--org--tiny/blobs")).unwrap();
        std::fs::write(c.blob("b1"), "{}").unwrap();
        std::fs::write(c.blob("b2"), "x").unwrap();
        let p = c.link("c0mmit", "config.json", "b1").unwrap();
        assert_eq!(std::fs::read_link(&p).unwrap(), Path::new("../../blobs/b1"));
        assert_eq!(
            std::fs::read_link(c.link("c0mmit", "sub/x.bin", "b2").unwrap()).unwrap(),
            Path::new("../../../blobs/b2")
        );
        // Linking again (another process did) is not an error.
        c.link("c0mmit", "config.json", "b1").unwrap();
        c.write_ref("main", "c0mmit").unwrap();
        assert_eq!(std::fs::read_to_string(dir.path().join("models--org--tiny/refs/main")).unwrap(), "c0mmit");
        let s = c.complete_snapshot(&needs).unwrap();
        assert_eq!((s.commit.as_str(), s.dir), ("c0mmit", c.snapshot_dir("c0mmit")));
        // A commit names its snapshot without a ref; refs are not written for it.
        let sha = "0123456789abcdef0123456789abcdef01234567";
        c.write_ref(sha, sha).unwrap();
        assert!(!dir.path().join(format!("models--org--tiny/refs/{sha}")).exists());
    }

    #[test]
    fn a_held_lock_is_waited_for() {
        let dir = tempfile::tempdir().unwrap();
        let c = RepoCache::new(dir.path(), &repo("main"));
        let held = c.lock("e", "f").unwrap();
        let c2 = c.clone();
        let t = std::thread::spawn(move || {
            let start = std::time::Instant::now();
            drop(c2.lock("e", "f").unwrap());
            start.elapsed()
        });
        std::thread::sleep(std::time::Duration::from_millis(300));
        drop(held);
        assert!(t.join().unwrap() >= std::time::Duration::from_millis(250));
    }
}
