//! Checkpoints of a run: OUTPUT/checkpoints/step-N (the HF model, `optimizer.safetensors`,
//! `trainer_state.json`, and `anchor.safetensors` when the objective's anchor snapshot is not the
//! checkpoint itself), the `latest` pointer, keep-last pruning, and reading them back to resume.
//!
//! With N ranks the optimiser state is sharded ([`super::zero`]): each rank writes its
//! `optimizer-RRRRR-of-NNNNN.safetensors` atomically into a staging folder, and after a barrier rank 0 moves
//! them all into the checkpoint it writes (the folder appears under its name, with `checksums.json` covering
//! every shard, only once every shard is written).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use serde::{Deserialize, Serialize};

use super::step::TrainStep;
use super::{io, write_atomic, zero, TrainError, TrainerState};
use crate::dist::World;
use crate::model::checkpoint::{remove_checkpoint, SaveOptions};
use crate::model::{save_checkpoint, Decoder, ModelError};

/// The training config inside each checkpoint: the configuration of the run segment that wrote it, which a
/// resume compares with its own.
pub const CONFIG_FILE: &str = "train_config.toml";

/// The checkpoint named by OUTPUT/checkpoints/latest (a folder of checkpoints/, never a path elsewhere).
pub fn latest_checkpoint(output_dir: &Path) -> Option<PathBuf> {
    let dir = output_dir.join("checkpoints");
    let name = std::fs::read_to_string(dir.join("latest")).ok()?;
    let p = dir.join(plain_name(name.trim())?);
    p.join("trainer_state.json").exists().then_some(p)
}

/// `name` when it names an entry of its folder: no separator, not `.` or `..`.
fn plain_name(name: &str) -> Option<&str> {
    (!name.is_empty() && !name.contains(['/', '\\']) && name != "." && name != "..").then_some(name)
}

/// The checkpoint `--resume auto` continues: the one `latest` names (an error naming what is missing when it
/// is damaged), else the newest complete step folder, else none. A `latest` naming a folder that is gone
/// falls back to the newest complete one with a warning; one naming a path outside checkpoints/ is refused.
pub(super) fn auto_resume_point(output_dir: &Path) -> Result<Option<PathBuf>, TrainError> {
    let dir = output_dir.join("checkpoints");
    let latest = dir.join("latest");
    if let Ok(name) = std::fs::read_to_string(&latest) {
        let Some(name) = plain_name(name.trim()) else {
            return Err(TrainError::Damaged {
                ck: latest,
                message: format!(
                    "it names `{}`, not a checkpoint of {}: write the name of one of its step-N folders into it, \
                     or remove it to resume from the newest complete one",
                    name.trim(),
                    dir.display()
                ),
            });
        };
        let ck = dir.join(name);
        if ck.exists() {
            check_complete(&ck)?;
            return Ok(Some(ck));
        }
        tracing::warn!("{} names {name}, which is gone", latest.display());
    }
    let newest = step_dirs(&dir)?.into_iter().rev().find(|p| check_complete(p).is_ok());
    if let Some(p) = &newest {
        tracing::warn!("resuming from the newest complete checkpoint in {}, {}", dir.display(), p.display());
    }
    Ok(newest)
}

/// The step-N folders of OUTPUT/checkpoints, oldest first (none when the folder does not exist).
pub(super) fn step_dirs(dir: &Path) -> Result<Vec<PathBuf>, TrainError> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Ok(Vec::new()) };
    let mut steps = Vec::new();
    for entry in entries {
        let p = entry.map_err(io(dir))?.path();
        if p.is_dir() && p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("step-")) {
            steps.push(p);
        }
    }
    steps.sort();
    Ok(steps)
}

/// The run a checkpoint belongs to (the run id of its trainer state); None when that is unreadable.
pub(super) fn run_of(ck: &Path) -> Option<String> {
    read_state(ck).ok().map(|s| s.run_id)
}

/// Check that `ck` holds every file a resume reads, naming those that are missing.
pub(super) fn check_complete(ck: &Path) -> Result<(), TrainError> {
    let damaged = |message: String| Err(TrainError::Damaged { ck: ck.to_path_buf(), message });
    if !ck.is_dir() {
        return damaged("the folder does not exist".into());
    }
    let mut files: Vec<String> = ["config.json", "trainer_state.json"].iter().map(|f| f.to_string()).collect();
    let (optimizer, missing_shards) = zero::optimizer_files(ck);
    files.extend(optimizer.into_iter().chain(missing_shards));
    let index = ck.join("model.safetensors.index.json");
    if crate::model::lora::is_adapter_dir(ck) {
        // A LoRA run's checkpoint holds the adapter; the base model is the run's model.path.
        files.push(crate::model::lora::ADAPTER_FILE.into());
    } else if index.exists() {
        let v: serde_json::Value =
            std::fs::read(&index).ok().and_then(|b| serde_json::from_slice(&b).ok()).ok_or_else(|| {
                TrainError::Damaged { ck: ck.to_path_buf(), message: format!("{} is unreadable", index.display()) }
            })?;
        let shards = v["weight_map"].as_object().map(|m| m.values().filter_map(|f| f.as_str()).collect::<Vec<_>>());
        let mut shards: Vec<String> = shards.unwrap_or_default().into_iter().map(String::from).collect();
        shards.sort();
        shards.dedup();
        files.extend(shards);
    } else {
        files.push("model.safetensors".into());
    }
    let missing: Vec<String> = files.into_iter().filter(|f| !ck.join(f).is_file()).collect();
    if missing.is_empty() {
        Ok(())
    } else {
        damaged(format!("missing {}", missing.join(", ")))
    }
}

/// Where and how a run writes its checkpoints.
pub(super) struct Checkpointer {
    pub output_dir: PathBuf,
    /// The model folder the run started from (its tokenizer files go into every checkpoint).
    pub model_dir: PathBuf,
    pub save_dtype: Option<DType>,
    pub keep_last: usize,
    /// The run's configuration (TOML), written into every checkpoint as [`CONFIG_FILE`].
    pub config_toml: String,
}

impl Checkpointer {
    fn options(&self) -> SaveOptions {
        SaveOptions {
            dtype: self.save_dtype,
            tokenizer_dir: Some(self.model_dir.clone()),
            // Absolute, so that the adapter's base is found from anywhere (PEFT, grpo eval --model ADAPTER).
            base_model: Some(
                std::path::absolute(&self.model_dir).unwrap_or(self.model_dir.clone()).display().to_string(),
            ),
            ..Default::default()
        }
    }

    /// Write checkpoints/step-N for `state` (with the frozen models of `frozen` as `(file, model)`), point
    /// `latest` at it and prune to the newest `keep_last`. Every rank of `world` calls it: each writes its
    /// optimiser shard when the state is sharded, rank 0 the rest.
    pub fn save(
        &self,
        world: &World,
        policy: &Decoder,
        step: &TrainStep,
        state: &TrainerState,
        frozen: &[(&str, &Decoder)],
    ) -> Result<PathBuf, TrainError> {
        let need = self.checkpoint_bytes(policy, frozen);
        if world.is_primary() {
            if let Some(w) = self.space_warning(need) {
                tracing::warn!("{w}");
            }
        }
        self.write(world, policy, step, state, frozen).map_err(|e| self.disk_full(e, state.step, need))
    }

    /// [`Checkpointer::save`]'s writes.
    fn write(
        &self,
        world: &World,
        policy: &Decoder,
        step: &TrainStep,
        state: &TrainerState,
        frozen: &[(&str, &Decoder)],
    ) -> Result<PathBuf, TrainError> {
        let dir = self.output_dir.join("checkpoints");
        let name = format!("step-{:08}", state.step);
        let path = dir.join(&name);
        let staging = dir.join(format!(".{name}.shards.tmp"));
        if step.optimizer().is_sharded() {
            std::fs::create_dir_all(&staging).map_err(io(&staging))?;
            let file = staging.join(zero::shard_file(world.rank(), world.size()));
            let tmp = crate::fsio::temp_file(&file).map_err(io(&file))?;
            write_tensors(tmp.path(), step.optimizer().state_tensors()?)?;
            crate::fsio::persist(tmp, &file).map_err(io(&file))?;
            world.barrier();
        }
        if !world.is_primary() {
            return Ok(path);
        }
        save_checkpoint(policy, &path, &self.options(), |tmp| {
            write_trainer_files(tmp, step, state)?;
            if step.optimizer().is_sharded() {
                for rank in 0..world.size() {
                    let f = zero::shard_file(rank, world.size());
                    std::fs::rename(staging.join(&f), tmp.join(&f))
                        .map_err(|source| ModelError::Io { path: staging.join(&f), source })?;
                }
            }
            for (file, model) in frozen {
                write_tensors(&tmp.join(file), model.state_tensors())?;
            }
            let c = tmp.join(CONFIG_FILE);
            std::fs::write(&c, &self.config_toml).map_err(|source| ModelError::Io { path: c.clone(), source })?;
            write_checksums(tmp)
        })?;
        write_atomic(&dir.join("latest"), name.as_bytes())?;
        // The checkpoint is in place: what follows is cleanup, whose failures are warnings.
        remove_temporaries(&dir);
        prune(&dir, &state.run_id, self.keep_last, state.step)?;
        Ok(path)
    }

    /// About what a checkpoint of `policy` takes: the newest one's files when there is one, else the
    /// model's tensors in the save dtype, 12 bytes a trainable element of optimiser state (f32 master and
    /// moments) and the frozen copies.
    pub fn checkpoint_bytes(&self, policy: &Decoder, frozen: &[(&str, &Decoder)]) -> u64 {
        if let Some(last) = latest_checkpoint(&self.output_dir) {
            let files = std::fs::read_dir(&last).into_iter().flatten().flatten();
            let bytes: u64 = files.filter_map(|e| e.metadata().ok()).filter(|m| m.is_file()).map(|m| m.len()).sum();
            if bytes > 0 {
                return bytes;
            }
        }
        let elements = |m: &Decoder| m.state_tensors().iter().map(|(_, t)| t.elem_count() as u64).sum::<u64>();
        let size = self.save_dtype.unwrap_or(policy.dtype()).size_in_bytes() as u64;
        let trainable = elements(policy);
        let frozen: u64 = frozen.iter().map(|(_, m)| elements(m) * m.dtype().size_in_bytes() as u64).sum();
        trainable * size + 12 * trainable + frozen
    }

    /// A warning when the checkpoints' file system has less room than `need` bytes (and a tenth more).
    pub fn space_warning(&self, need: u64) -> Option<String> {
        let dir = self.output_dir.join("checkpoints");
        let free = crate::fsio::free_bytes(&dir)?;
        low_space(&dir, need, free)
    }

    /// `e` as [`TrainError::DiskFull`] when the device ran out of space writing checkpoint `step`: what
    /// it needs and has, and the last good checkpoint to resume from.
    fn disk_full(&self, e: TrainError, step: usize, need: u64) -> TrainError {
        if !crate::fsio::is_disk_full(&e) {
            return e;
        }
        let dir = self.output_dir.join("checkpoints");
        let free = crate::fsio::free_bytes(&dir).map_or("unknown".into(), gib);
        let last = match latest_checkpoint(&self.output_dir) {
            Some(ck) => format!(
                "the last good checkpoint is {} (checkpoints/latest): free space (or lower train.keep_last) and \
                 run again with --resume auto to continue from it",
                ck.display()
            ),
            None => "no checkpoint was written yet: free space and run again".into(),
        };
        let ck = dir.join(format!("step-{step:08}"));
        TrainError::DiskFull { ck, need: gib(need), free, last }
    }

    /// Write OUTPUT/best (the model only).
    pub fn save_best(&self, policy: &Decoder) -> Result<PathBuf, TrainError> {
        let path = self.output_dir.join("best");
        save_checkpoint(policy, &path, &self.options(), |_| Ok(()))?;
        Ok(path)
    }
}

/// The step number of a step-N folder.
fn step_of(ck: &Path) -> Option<usize> {
    ck.file_name()?.to_str()?.strip_prefix("step-")?.parse().ok()
}

/// Keep the newest `keep` checkpoints of the run `run` up to step `upto` (the one just written) in `dir`.
/// Other runs' checkpoints are never touched, nor this run's later ones (left by a continuation that a resume
/// from an earlier checkpoint abandoned; they are replaced as the run reaches them). Each deleted folder goes
/// through a temporary name, so a kill never leaves a half-deleted folder under a checkpoint's name.
fn prune(dir: &Path, run: &str, keep: usize, upto: usize) -> Result<(), TrainError> {
    if keep == 0 {
        return Ok(()); // train.keep_last = 0 keeps every checkpoint
    }
    let mine: Vec<PathBuf> = step_dirs(dir)?
        .into_iter()
        .filter(|p| step_of(p).is_some_and(|s| s <= upto) && run_of(p).as_deref() == Some(run))
        .collect();
    for old in &mine[..mine.len().saturating_sub(keep)] {
        if let Err(e) = remove_checkpoint(old) {
            tracing::warn!("cannot remove the old checkpoint {} yet (retried at the next save): {e}", old.display());
        }
    }
    Ok(())
}

fn gib(bytes: u64) -> String {
    format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
}

/// The warning for a checkpoint of `need` bytes into `dir`, which has `free`: none with a tenth to spare.
fn low_space(dir: &Path, need: u64, free: u64) -> Option<String> {
    (free < need + need / 10).then(|| {
        format!(
            "{} has {} free and a checkpoint takes about {}: the next save may fail (free space, or lower \
             train.keep_last)",
            dir.display(),
            gib(free),
            gib(need)
        )
    })
}

/// Remove, after a save, the staging folders of sharded optimiser states and the checkpoints half-deleted by
/// earlier prunes (`.step-N.del-PID`): warnings when they cannot go yet (ENOTEMPTY from NFS's `.nfsXXXX`
/// files while a reader has a file open), tried again at the next save. Only rank 0 writes into `dir` now.
fn remove_temporaries(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let staging = name.starts_with('.') && name.ends_with(".shards.tmp");
        if !(staging || (crate::model::checkpoint::is_temp_name(&name) && name.contains(".del-"))) {
            continue;
        }
        if let Err(err) = std::fs::remove_dir_all(e.path()) {
            tracing::warn!("cannot remove {} yet (retried at the next save): {err}", e.path().display());
        }
    }
}

/// Write named tensors (moved to the CPU) as one safetensors file.
fn write_tensors(path: &Path, tensors: Vec<(String, Tensor)>) -> Result<(), ModelError> {
    let tensors: Vec<(String, Tensor)> =
        tensors.into_iter().map(|(n, t)| Ok((n, t.to_device(&Device::Cpu)?))).collect::<candle_core::Result<_>>()?;
    safetensors::serialize_to_file(tensors.iter().map(|(n, t)| (n.as_str(), t)), None, path)
        .map_err(|e| ModelError::Files { path: path.to_path_buf(), message: e.to_string() })
}

/// Whether a checkpoint of `state` must hold the anchor snapshot: the snapshot is the policy at step
/// floor(step / K) * K, so a checkpoint written at a multiple of K is the snapshot itself.
fn stores_snapshot(step: &TrainStep, state: &TrainerState) -> bool {
    step.snapshot_every().is_some_and(|k| !state.step.is_multiple_of(k))
}

/// The optimiser state, the trainer state and (when [`stores_snapshot`]) the anchor snapshot, written into
/// a checkpoint's temporary folder.
fn write_trainer_files(tmp: &Path, step: &TrainStep, state: &TrainerState) -> Result<(), ModelError> {
    if !step.optimizer().is_sharded() {
        write_tensors(&tmp.join(zero::WHOLE_FILE), step.optimizer().state_tensors()?)?;
    }
    if stores_snapshot(step, state) {
        let snapshot = step.snapshot().ok_or_else(|| ModelError::Invalid("no anchor snapshot to save".into()))?;
        // In the model's own dtype, so that the resumed anchor is exactly the one the run used.
        write_tensors(&tmp.join(ANCHOR_FILE), snapshot.state_tensors())?;
    }
    // With the optimiser's own count of updates: fewer than the steps once a non-finite step was skipped.
    let state = TrainerState { optimizer_updates: Some(step.optimizer().steps), ..state.clone() };
    let s = tmp.join("trainer_state.json");
    std::fs::write(&s, serde_json::to_vec_pretty(&state).unwrap_or_default())
        .map_err(|source| ModelError::Io { path: s, source })
}

/// The checksums of a checkpoint's files, written last into it.
pub(super) const CHECKSUMS_FILE: &str = "checksums.json";

/// `checksums.json`: the [`crate::checksum`] of every other file of a checkpoint.
#[derive(Debug, Serialize, Deserialize)]
struct Checksums {
    files: BTreeMap<String, String>,
}

/// Record the checksum of every file in the checkpoint folder `dir` (being written).
fn write_checksums(dir: &Path) -> Result<(), ModelError> {
    let io_error = |source| ModelError::Io { path: dir.to_path_buf(), source };
    let mut names = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io_error)? {
        let entry = entry.map_err(io_error)?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if entry.path().is_file() && name != CHECKSUMS_FILE {
            names.push(name);
        }
    }
    let files = crate::checksum::hash_files(dir, &names)
        .map_err(|e| ModelError::Files { path: dir.to_path_buf(), message: e.to_string() })?;
    let p = dir.join(CHECKSUMS_FILE);
    let text = serde_json::to_vec_pretty(&Checksums { files }).unwrap_or_default();
    std::fs::write(&p, text).map_err(|source| ModelError::Io { path: p, source })
}

/// Check every file of checkpoint `ck` against its `checksums.json` before a resume reads it: a changed file is
/// an error naming it. A checkpoint written before checksums were recorded is resumed with a warning.
pub(super) fn verify_checksums(ck: &Path) -> Result<(), TrainError> {
    let p = ck.join(CHECKSUMS_FILE);
    let text = match std::fs::read(&p) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            tracing::warn!("{} has no {CHECKSUMS_FILE}: its files cannot be checked", ck.display());
            return Ok(());
        }
        Err(e) => return Err(io(&p)(e)),
    };
    let sums: Checksums = serde_json::from_slice(&text)
        .map_err(|e| TrainError::Damaged { ck: ck.to_path_buf(), message: format!("{CHECKSUMS_FILE}: {e}") })?;
    let started = std::time::Instant::now();
    crate::checksum::verify(ck, &sums.files, CHECKSUMS_FILE)
        .map_err(|e| TrainError::Damaged { ck: ck.to_path_buf(), message: e.to_string() })?;
    tracing::debug!(
        "checked {} files of {} in {:.1} s",
        sums.files.len(),
        ck.display(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// The anchor snapshot's file in a checkpoint.
const ANCHOR_FILE: &str = "anchor.safetensors";
/// The swapped-in reference (train.reference_swap_every), once the run has swapped it.
pub(super) const REFERENCE_FILE: &str = "reference.safetensors";
/// The lagged sampling policy (rollout.sync_every), when it is not the checkpoint's own weights.
pub(super) const SAMPLER_FILE: &str = "sampler.safetensors";

/// The frozen model (shaped like `policy`, in its dtype and on its device) that the checkpoint `ck` holds
/// as `file`, or None when it holds none.
pub(super) fn read_frozen(ck: &Path, file: &str, policy: &Decoder) -> Result<Option<Decoder>, TrainError> {
    let p = ck.join(file);
    if !p.exists() {
        return Ok(None);
    }
    let mut tensors = candle_core::safetensors::load(&p, &Device::Cpu)
        .map_err(|e| TrainError::Damaged { ck: ck.to_path_buf(), message: format!("{file}: {e}") })?;
    let get = |name: &str, _: &[usize]| tensors.remove(name).ok_or_else(|| ModelError::Missing(name.into()));
    Ok(Some(policy.frozen_with(get)?))
}

/// Read a checkpoint's trainer state.
pub(super) fn read_state(ck: &Path) -> Result<TrainerState, TrainError> {
    let s = ck.join("trainer_state.json");
    serde_json::from_slice(&std::fs::read(&s).map_err(io(&s))?)
        .map_err(|e| TrainError::Damaged { ck: ck.to_path_buf(), message: format!("trainer_state.json: {e}") })
}

/// Restore, from the checkpoint whose trainer state is `state`, the optimiser and, when the checkpoint
/// holds one, the training step's anchor snapshot (a frozen copy shaped like `policy`).
pub(super) fn restore(
    ck: &Path,
    state: &TrainerState,
    policy: &Decoder,
    step: &mut TrainStep,
) -> Result<(), TrainError> {
    let damaged = |file: &str| {
        let file = file.to_string();
        move |e: candle_core::Error| TrainError::Damaged { ck: ck.to_path_buf(), message: format!("{file}: {e}") }
    };
    // Older checkpoints did not record the count: one update per step is what they assumed.
    let updates = state.optimizer_updates.unwrap_or(state.step as u64);
    step.optimizer_mut().load_saved(ck, updates).map_err(|message| TrainError::Damaged {
        ck: ck.to_path_buf(),
        message: format!("optimizer state: {message}"),
    })?;
    if stores_snapshot(step, state) {
        let p = ck.join(ANCHOR_FILE);
        if !p.exists() {
            return Err(TrainError::Damaged {
                ck: ck.to_path_buf(),
                message: format!(
                    "missing {ANCHOR_FILE}: the objective's anchor snapshot of step {} cannot be restored",
                    state.step
                ),
            });
        }
        let mut tensors = candle_core::safetensors::load(&p, &Device::Cpu).map_err(damaged(ANCHOR_FILE))?;
        let get = |name: &str, _: &[usize]| tensors.remove(name).ok_or_else(|| ModelError::Missing(name.into()));
        step.set_snapshot(policy.frozen_with(get)?);
    }
    tracing::info!(
        "resumed from {} at step {} (epoch {}, batch {})",
        ck.display(),
        state.step,
        state.epoch,
        state.batch_in_epoch
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fake(dir: &Path, step: usize, run: &str) {
        let ck = dir.join(format!("step-{step:08}"));
        std::fs::create_dir_all(&ck).unwrap();
        let state = TrainerState { step, run_id: run.into(), ..Default::default() };
        std::fs::write(ck.join("trainer_state.json"), serde_json::to_vec(&state).unwrap()).unwrap();
    }

    #[test]
    fn pruning_deletes_only_this_runs_older_checkpoints() {
        let dir = tempfile::tempdir().unwrap();
        for (step, run) in [(2, "a"), (4, "b"), (6, "a"), (8, "a"), (10, "a")] {
            fake(dir.path(), step, run);
        }
        std::fs::create_dir_all(dir.path().join("step-unreadable")).unwrap();
        prune(dir.path(), "a", 1, 8).unwrap();
        let mut names: Vec<String> =
            std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        names.sort();
        assert_eq!(names, ["step-00000004", "step-00000008", "step-00000010", "step-unreadable"]);
        assert_eq!(step_dirs(dir.path()).unwrap().len(), 4);
        assert_eq!(run_of(&dir.path().join("step-00000004")).as_deref(), Some("b"));
        // keep_last = 0 keeps them all.
        fake(dir.path(), 12, "a");
        prune(dir.path(), "a", 0, 12).unwrap();
        assert_eq!(step_dirs(dir.path()).unwrap().len(), 5);
    }

    #[test]
    fn a_cleanup_that_fails_after_a_save_is_a_warning_and_is_retried() {
        let dir = tempfile::tempdir().unwrap();
        for step in [2, 4, 6] {
            fake(dir.path(), step, "a");
        }
        // The rename that starts step 2's removal fails (its `.del-` name is taken by a folder that is not
        // empty, as NFS's `.nfsXXXX` files keep a folder from going).
        let blocker = dir.path().join(format!(".step-00000002.del-{}", std::process::id()));
        std::fs::create_dir_all(&blocker).unwrap();
        std::fs::write(blocker.join(".nfs0000000000123"), "x").unwrap();
        // So does the staging folder of a sharded save.
        let staging = dir.path().join(".step-00000006.shards.tmp");
        std::fs::create_dir_all(&staging).unwrap();
        prune(dir.path(), "a", 1, 6).unwrap();
        assert!(dir.path().join("step-00000002").is_dir() && !dir.path().join("step-00000004").exists());
        // The next save removes what is left.
        remove_temporaries(dir.path());
        assert!(!blocker.exists() && !staging.exists());
        prune(dir.path(), "a", 1, 6).unwrap();
        let names: Vec<String> =
            std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        assert_eq!(names, ["step-00000006"]);
    }

    /// A save renames the checkpoint into `checkpoints/`, then `latest`: the folder is synced after each
    /// rename (it holds the new names), `latest`'s last.
    #[test]
    fn a_save_syncs_the_checkpoints_folder_after_each_rename() {
        let dir = tempfile::tempdir().unwrap();
        let shape = crate::model::tiny::TinyShape { layers: 1, hidden: 16, heads: 4, kv_heads: 2, intermediate: 24 };
        let cfg = shape.config(crate::model::Arch::Llama, 64, None, None).unwrap();
        let policy = crate::model::random_decoder(cfg, 3, DType::F32, &Device::Cpu, true).unwrap();
        let optim = crate::train::optim::OptimConfig::default();
        let step = TrainStep::new(&crate::objective::ObjectiveConfig::default(), &optim, &policy, 2, 32, 0).unwrap();
        let saver = Checkpointer {
            output_dir: dir.path().to_path_buf(),
            model_dir: dir.path().join("no-tokenizer"),
            save_dtype: None,
            keep_last: 2,
            config_toml: String::new(),
        };
        let state = TrainerState { step: 2, run_id: "a".into(), ..Default::default() };
        crate::fsio::take_synced();
        saver.save(&World::single(), &policy, &step, &state, &[]).unwrap();
        let synced = crate::fsio::take_synced();
        let checkpoints = dir.path().join("checkpoints");
        assert_eq!(std::fs::read_to_string(checkpoints.join("latest")).unwrap(), "step-00000002");
        assert_eq!(synced.iter().filter(|p| **p == checkpoints).count(), 2, "{synced:?}");
        assert_eq!(synced.last(), Some(&checkpoints), "{synced:?}");
    }

    /// The space check warns without a tenth to spare, a checkpoint's size is its predecessor's files
    /// (an estimate before the first), and a write that runs out of space names the last good checkpoint
    /// and how to continue; other errors pass through.
    #[test]
    fn a_full_disk_is_foreseen_and_its_failure_names_the_checkpoint_to_resume_from() {
        let dir = tempfile::tempdir().unwrap();
        assert!(low_space(dir.path(), 1000, 1100).is_none());
        let w = low_space(dir.path(), 1000, 1099).unwrap();
        assert!(w.contains("a checkpoint takes about") && w.contains("train.keep_last"), "{w}");
        let shape = crate::model::tiny::TinyShape { layers: 1, hidden: 16, heads: 4, kv_heads: 2, intermediate: 24 };
        let cfg = shape.config(crate::model::Arch::Llama, 64, None, None).unwrap();
        let policy = crate::model::random_decoder(cfg, 3, DType::F32, &Device::Cpu, true).unwrap();
        let saver = Checkpointer {
            output_dir: dir.path().to_path_buf(),
            model_dir: dir.path().join("no-tokenizer"),
            save_dtype: Some(DType::BF16),
            keep_last: 2,
            config_toml: String::new(),
        };
        let elements: u64 = policy.state_tensors().iter().map(|(_, t)| t.elem_count() as u64).sum();
        assert_eq!(saver.checkpoint_bytes(&policy, &[]), elements * (2 + 12));
        let full = TrainError::Io { path: "x".into(), source: std::io::Error::from_raw_os_error(libc::ENOSPC) };
        let e = saver.disk_full(full, 4, 1 << 30).to_string();
        assert!(e.contains("step-00000004") && e.contains("1.00 GiB needed") && e.contains("no checkpoint was"), "{e}");
        fake(&dir.path().join("checkpoints"), 2, "a");
        std::fs::write(dir.path().join("checkpoints/latest"), "step-00000002").unwrap();
        std::fs::write(dir.path().join("checkpoints/step-00000002/model.safetensors"), vec![0u8; 5000]).unwrap();
        assert!(saver.checkpoint_bytes(&policy, &[]) >= 5000);
        let model = ModelError::Files { path: "m".into(), message: "No space left on device (os error 28)".into() };
        let e = saver.disk_full(TrainError::Model(model), 4, 1 << 30).to_string();
        assert!(e.contains("step-00000002") && e.contains("--resume auto"), "{e}");
        let other = TrainError::Io { path: "x".into(), source: std::io::Error::from_raw_os_error(libc::EACCES) };
        assert!(matches!(saver.disk_full(other, 4, 1), TrainError::Io { .. }));
    }

    /// `latest` naming a folder that is gone falls back to the newest complete checkpoint; naming a path
    /// outside checkpoints/ (another run's folder) is refused.
    #[test]
    fn latest_is_followed_only_to_a_checkpoint_of_its_own_folder() {
        let dir = tempfile::tempdir().unwrap();
        let checkpoints = dir.path().join("checkpoints");
        fake(&checkpoints, 2, "a");
        let complete = |step: &str| {
            for f in ["config.json", "model.safetensors", zero::WHOLE_FILE] {
                std::fs::write(checkpoints.join(step).join(f), "x").unwrap();
            }
        };
        complete("step-00000002");
        std::fs::write(checkpoints.join("latest"), "step-00000004").unwrap();
        let ck = auto_resume_point(dir.path()).unwrap();
        assert_eq!(ck, Some(checkpoints.join("step-00000002")));
        let elsewhere = tempfile::tempdir().unwrap();
        for name in [elsewhere.path().display().to_string(), "../other/checkpoints/step-00000002".into()] {
            std::fs::write(checkpoints.join("latest"), &name).unwrap();
            let e = auto_resume_point(dir.path()).unwrap_err().to_string();
            assert!(e.contains("not a checkpoint of") && e.contains(&name), "{e}");
            assert_eq!(latest_checkpoint(dir.path()), None);
        }
    }

    #[test]
    fn a_flipped_byte_in_any_checkpoint_file_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let names = ["optimizer.safetensors", "anchor.safetensors", "sampler.safetensors", "reference.safetensors"];
        for (i, n) in names.iter().enumerate() {
            std::fs::write(dir.path().join(n), vec![i as u8; 1000 + i]).unwrap();
        }
        std::fs::write(dir.path().join("trainer_state.json"), "{}").unwrap();
        write_checksums(dir.path()).unwrap();
        verify_checksums(dir.path()).unwrap();
        for n in names.iter().chain(&["trainer_state.json"]) {
            let p = dir.path().join(n);
            let mut b = std::fs::read(&p).unwrap();
            b[1] ^= 1;
            std::fs::write(&p, &b).unwrap();
            let e = verify_checksums(dir.path()).unwrap_err().to_string();
            assert!(e.contains(n) && e.contains("changed"), "{n}: {e}");
            b[1] ^= 1;
            std::fs::write(&p, &b).unwrap();
        }
        verify_checksums(dir.path()).unwrap();
        // A missing file is named too.
        std::fs::remove_file(dir.path().join("sampler.safetensors")).unwrap();
        let e = verify_checksums(dir.path()).unwrap_err().to_string();
        assert!(e.contains("sampler.safetensors"), "{e}");
    }
}
