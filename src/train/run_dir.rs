//! The output folder of a run: one run at a time (an OS lock on OUTPUT/.lock), no leftovers of a killed
//! run, and no run writing over another run's checkpoints.

use std::path::{Path, PathBuf};

use super::checkpoint::{run_of, step_dirs};
use super::{io, TrainError};
use crate::model::checkpoint::{remove_checkpoint, remove_leftovers};

pub(super) use crate::fsio::FolderLock;

/// Take OUTPUT/.lock ([`crate::fsio::lock_folder`]), or fail naming the process that holds it.
pub(super) fn lock(out: &Path) -> Result<FolderLock, TrainError> {
    crate::fsio::lock_folder(out).map_err(|e| match e {
        crate::fsio::LockError::Busy { dir, holder } => TrainError::Busy { dir, holder },
        crate::fsio::LockError::Io { path, source } => TrainError::Io { path, source },
    })
}

/// Remove what a killed run left half-written or half-deleted, by one rule ([`remove_leftovers`]): in
/// OUTPUT/checkpoints and in OUTPUT every temporary file or folder of an atomic write (a checkpoint, its
/// staging folder, `latest`, `best/`, the rollout policy served to a sampling server, `curves.png`, an
/// interrupted `--overwrite`...). The folder is this
/// run's (it holds the lock), so nothing else is writing them. Needs the lock.
pub(super) fn clean_leftovers(out: &Path) -> Result<(), TrainError> {
    let mut removed = remove_leftovers(&out.join("checkpoints"), |_| true)?;
    removed.extend(remove_leftovers(out, |_| true)?);
    for p in removed {
        tracing::warn!("removed {} (left by an interrupted run)", p.display());
    }
    Ok(())
}

/// What a previous run wrote into an output folder (`prepared/` and the model are kept: they are inputs).
fn previous_run_files(out: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> =
        ["checkpoints", "best", "validation", "metrics.jsonl", "config.toml", "curves.png", "summary.json"]
            .iter()
            .map(|n| out.join(n))
            .collect();
    if let Ok(entries) = std::fs::read_dir(out) {
        files.extend(
            entries
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("config-resume-"))),
        );
    }
    files.retain(|p| p.exists());
    files
}

/// Make sure OUTPUT/checkpoints holds no checkpoint of a run other than `run` (the run id of the
/// checkpoint being resumed; None for a new run). A new run given `overwrite` deletes the previous run's
/// results instead; otherwise it is refused, as is a resume into a folder that holds another run.
pub(super) fn claim(out: &Path, run: Option<&str>, overwrite: bool) -> Result<(), TrainError> {
    let ckdir = out.join("checkpoints");
    let foreign: Vec<PathBuf> =
        step_dirs(&ckdir)?.into_iter().filter(|p| run.is_none() || run_of(p).as_deref() != run).collect();
    if foreign.is_empty() {
        return Ok(());
    }
    let names = foreign.iter().map(|p| p.file_name().unwrap_or_default().to_string_lossy()).collect::<Vec<_>>();
    let names = names.join(", ");
    if run.is_some() {
        let message = format!(
            "it holds checkpoints of another run ({names}); resume into another train.output_dir, or remove them"
        );
        return Err(TrainError::OutputHasRun { dir: out.to_path_buf(), message });
    }
    if !overwrite {
        let message = format!(
            "it holds the checkpoints of a previous run ({names}); continue that run with --resume auto, start \
             over with --overwrite (deletes its checkpoints, best model and metrics), or choose another \
             train.output_dir"
        );
        return Err(TrainError::OutputHasRun { dir: out.to_path_buf(), message });
    }
    for p in previous_run_files(out) {
        tracing::warn!("--overwrite: deleting {} of the previous run", p.display());
        if p.is_dir() {
            remove_checkpoint(&p)?;
        } else {
            std::fs::remove_file(&p).map_err(io(&p))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_leftovers_of_killed_runs_are_removed_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path();
        let keep = ["best/model.safetensors", "rollout-policy/model.safetensors", "metrics.jsonl", "prepared/CURRENT"];
        let gone = [
            ".rollout-policy.Ab12Cd.tmp/model.safetensors",
            ".best.x1y2z3.tmp/config.json",
            ".curves.png.q9w8e7.tmp",
            "checkpoints/.latest.Zx81Qa.tmp",
            "checkpoints/.step-00000004.shards.tmp/optimizer-00000-of-00002.safetensors",
        ];
        for f in keep.iter().chain(&gone) {
            let p = out.join(f);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(&p, b"x").unwrap();
        }
        clean_leftovers(out).unwrap();
        for f in keep {
            assert!(out.join(f).exists(), "{f} was removed");
        }
        for f in gone {
            let top = if f.starts_with("checkpoints/") {
                f.split('/').take(2).collect::<Vec<_>>().join("/")
            } else {
                f.split('/').next().unwrap().to_string()
            };
            assert!(!out.join(&top).exists(), "{top} was kept");
        }
    }
}
