//! Reference log-probs shared between runs.
//!
//! A run's reference cache lives in its prepared folder, which is by default in its output folder, so a new
//! run on the same data would compute the same values again. Each cache a run computes is therefore also
//! kept in a shared folder, `$GRPO_CACHE_DIR/reference-logprobs/ID` (else `$XDG_CACHE_HOME/grpo/...`, else
//! `~/.cache/grpo/...`), where ID is a hash of what the values depend on: the reference's weights, the
//! prepared data's contents (not its folder) and the dtype. A later run with the same ID takes the values
//! from there instead of running the reference pass, and checks them as it checks its own cache.
//!
//! The shared folder holds hard links to the runs' files, so it costs no space while a run's folder holds
//! them; it is never written to when it is on another file system (the run says so). Deleting it, or any
//! entry of it, is always safe. `GRPO_CACHE_DIR=off` shares nothing.

use std::io;
use std::path::{Path, PathBuf};

/// The shared folder of reference caches, or `None` when sharing is off or there is no home. The unit
/// tests share nothing: each computes what it checks (the CLI's tests set `GRPO_CACHE_DIR`).
fn root() -> Option<PathBuf> {
    if cfg!(test) {
        return None;
    }
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    let base = match var("GRPO_CACHE_DIR") {
        Some(p) if p.as_os_str() == "off" => return None,
        Some(p) => p,
        None => var("XDG_CACHE_HOME").or_else(|| var("HOME").map(|h| h.join(".cache")))?.join("grpo"),
    };
    Some(base.join("reference-logprobs"))
}

/// The shared entry of values identified by `id` (a hash of what they depend on).
pub(super) fn entry(id: &str) -> Option<PathBuf> {
    root().map(|r| r.join(id))
}

/// Put `from` at `to` as a hard link, or as a copy when `copy` and the link is not possible (another file
/// system): through a temporary name beside `to`, so that `to` is either the old file or the new one.
fn link(from: &Path, to: &Path, copy: bool) -> io::Result<()> {
    let tmp = crate::fsio::temp_file(to)?.into_temp_path();
    std::fs::remove_file(&tmp)?;
    if let Err(e) = std::fs::hard_link(from, &tmp) {
        if !copy || e.raw_os_error() != Some(libc::EXDEV) {
            return Err(e);
        }
        std::fs::copy(from, &tmp)?;
    }
    std::fs::rename(&tmp, to)?;
    let _ = tmp.keep(); // renamed away: nothing left to remove
    Ok(())
}

/// Take the shared values of entry `from` into `dir` as `values` (a hard link, else a copy), and return the
/// text of the entry's manifest `manifest` for the caller to check and write; `None` when the entry is
/// missing or unreadable.
pub(super) fn take(from: &Path, dir: &Path, values: &str, manifest: &str) -> Option<String> {
    let text = std::fs::read_to_string(from.join(manifest)).ok()?;
    match link(&from.join(values), &dir.join(values), true) {
        Ok(()) => Some(text),
        Err(e) => {
            tracing::warn!("cannot take the shared reference log-probs of {}: {e}", from.display());
            None
        }
    }
}

/// Keep the files `names` of `dir` (a computed cache, its manifest last) as the shared entry `to`,
/// replacing what is there. Best effort: a failure is logged and changes nothing for the run.
pub(super) fn keep(dir: &Path, to: &Path, names: &[&str]) {
    let result = (|| -> io::Result<()> {
        let tmp = crate::fsio::temp_dir(to)?;
        for n in names {
            link(&dir.join(n), &tmp.path().join(n), false)?;
        }
        if to.exists() {
            std::fs::remove_dir_all(to)?;
        }
        std::fs::rename(tmp.path(), to)?;
        let _ = tmp.keep();
        Ok(())
    })();
    match result {
        Ok(()) => tracing::info!(
            "reference log-probs shared with later runs on the same data and reference as {} (hard links: no \
             extra space while this folder holds them; GRPO_CACHE_DIR sets where, =off shares nothing)",
            to.display()
        ),
        Err(e) if e.raw_os_error() == Some(libc::EXDEV) => tracing::info!(
            "reference log-probs not shared with later runs: {} is on another file system than {} (set \
             GRPO_CACHE_DIR to a folder on this one to share them)",
            to.display(),
            dir.display()
        ),
        Err(e) => tracing::warn!("cannot share the reference log-probs as {}: {e}", to.display()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kept_entry_is_taken_back_as_a_hard_link_and_replaced_whole() {
        let tmp = tempfile::tempdir().unwrap();
        let (run, other, shared) = (tmp.path().join("run"), tmp.path().join("other"), tmp.path().join("shared/id"));
        std::fs::create_dir_all(&run).unwrap();
        std::fs::create_dir_all(&other).unwrap();
        std::fs::write(run.join("v.f32"), [1u8, 2, 3, 4]).unwrap();
        std::fs::write(run.join("m.json"), "{}").unwrap();
        keep(&run, &shared, &["v.f32", "m.json"]);
        assert_eq!(take(&shared, &other, "v.f32", "m.json").as_deref(), Some("{}"));
        assert_eq!(std::fs::read(other.join("v.f32")).unwrap(), [1, 2, 3, 4]);
        use std::os::unix::fs::MetadataExt;
        let ino = |p: &Path| std::fs::metadata(p).unwrap().ino();
        assert_eq!(ino(&other.join("v.f32")), ino(&run.join("v.f32")), "a hard link, not a copy");
        // A new computation replaces the entry (its files renamed in, never written in place).
        std::fs::remove_file(run.join("v.f32")).unwrap();
        std::fs::write(run.join("v.f32"), [9u8; 4]).unwrap();
        keep(&run, &shared, &["v.f32", "m.json"]);
        assert_eq!(std::fs::read(shared.join("v.f32")).unwrap(), [9; 4]);
        assert_eq!(std::fs::read(other.join("v.f32")).unwrap(), [1, 2, 3, 4], "a taken file keeps its values");
        let names: Vec<_> =
            std::fs::read_dir(shared.parent().unwrap()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, ["id"], "no temporary folder left");
        assert!(take(&tmp.path().join("shared/none"), &other, "v.f32", "m.json").is_none());
    }
}
