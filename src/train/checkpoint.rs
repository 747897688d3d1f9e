//! Checkpoints of a run: OUTPUT/checkpoints/step-N (the HF model, `optimizer.safetensors`,
//! `trainer_state.json`, and `anchor.safetensors` when the objective's anchor snapshot is not the
//! checkpoint itself), the `latest` pointer, keep-last pruning, and reading them back to resume.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};

use super::step::TrainStep;
use super::{io, write_atomic, TrainError, TrainerState};
use crate::model::checkpoint::SaveOptions;
use crate::model::{save_checkpoint, Decoder, ModelError};

/// The checkpoint named by OUTPUT/checkpoints/latest.
pub fn latest_checkpoint(output_dir: &Path) -> Option<PathBuf> {
    let dir = output_dir.join("checkpoints");
    let name = std::fs::read_to_string(dir.join("latest")).ok()?;
    let p = dir.join(name.trim());
    p.join("trainer_state.json").exists().then_some(p)
}

/// Where and how a run writes its checkpoints.
pub(super) struct Checkpointer {
    pub output_dir: PathBuf,
    /// The model folder the run started from (its tokenizer files go into every checkpoint).
    pub model_dir: PathBuf,
    pub save_dtype: Option<DType>,
    pub keep_last: usize,
}

impl Checkpointer {
    fn options(&self) -> SaveOptions {
        SaveOptions { dtype: self.save_dtype, tokenizer_dir: Some(self.model_dir.clone()), ..Default::default() }
    }

    /// Write checkpoints/step-N for `state`, point `latest` at it and prune to the newest `keep_last`.
    pub fn save(&self, policy: &Decoder, step: &TrainStep, state: &TrainerState) -> Result<PathBuf, TrainError> {
        let dir = self.output_dir.join("checkpoints");
        let name = format!("step-{:08}", state.step);
        let path = dir.join(&name);
        save_checkpoint(policy, &path, &self.options(), |tmp| write_trainer_files(tmp, step, state))?;
        write_atomic(&dir.join("latest"), name.as_bytes())?;
        self.prune(&dir)?;
        Ok(path)
    }

    /// Write OUTPUT/best (the model only).
    pub fn save_best(&self, policy: &Decoder) -> Result<PathBuf, TrainError> {
        let path = self.output_dir.join("best");
        save_checkpoint(policy, &path, &self.options(), |_| Ok(()))?;
        Ok(path)
    }

    /// Keep the newest `keep_last` step folders.
    fn prune(&self, dir: &Path) -> Result<(), TrainError> {
        let mut steps: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(io(dir))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.is_dir() && p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("step-")))
            .collect();
        steps.sort();
        let keep = self.keep_last.max(1);
        if steps.len() > keep {
            for old in &steps[..steps.len() - keep] {
                std::fs::remove_dir_all(old).map_err(io(old))?;
            }
        }
        Ok(())
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
    write_tensors(&tmp.join("optimizer.safetensors"), step.optimizer().state_tensors())?;
    if stores_snapshot(step, state) {
        let snapshot = step.snapshot().ok_or_else(|| ModelError::Invalid("no anchor snapshot to save".into()))?;
        // In the model's own dtype, so that the resumed anchor is exactly the one the run used.
        write_tensors(&tmp.join(ANCHOR_FILE), snapshot.named_tensors())?;
    }
    let s = tmp.join("trainer_state.json");
    std::fs::write(&s, serde_json::to_vec_pretty(state).unwrap_or_default())
        .map_err(|source| ModelError::Io { path: s, source })
}

/// The anchor snapshot's file in a checkpoint.
const ANCHOR_FILE: &str = "anchor.safetensors";

/// Read a checkpoint's trainer state, restore the optimiser from it and, when the checkpoint holds one,
/// the training step's anchor snapshot (a frozen copy shaped like `policy`).
pub(super) fn restore(ck: &Path, policy: &Decoder, step: &mut TrainStep) -> Result<TrainerState, TrainError> {
    let s = ck.join("trainer_state.json");
    let state: TrainerState = serde_json::from_slice(&std::fs::read(&s).map_err(io(&s))?)
        .map_err(|e| TrainError::Stopped(format!("{}: {e}", s.display())))?;
    let opt_path = ck.join("optimizer.safetensors");
    let st = candle_core::safetensors::load(&opt_path, &Device::Cpu)?;
    step.optimizer_mut().load_state(|n| st.get(n).cloned(), state.step as u64)?;
    if stores_snapshot(step, &state) {
        let p = ck.join(ANCHOR_FILE);
        if !p.exists() {
            return Err(TrainError::Stopped(format!(
                "{} has no {ANCHOR_FILE}: the objective's anchor snapshot of step {} cannot be restored",
                ck.display(),
                state.step
            )));
        }
        let mut tensors = candle_core::safetensors::load(&p, &Device::Cpu)?;
        let get = |name: &str, _: &[usize]| tensors.remove(name).ok_or_else(|| ModelError::Missing(name.into()));
        let mut snapshot = Decoder::from_tensors(policy.config().clone(), get, policy.dtype(), policy.device(), false)?;
        snapshot.options = policy.options.clone();
        step.set_snapshot(snapshot);
    }
    tracing::info!(
        "resumed from {} at step {} (epoch {}, batch {})",
        ck.display(),
        state.step,
        state.epoch,
        state.batch_in_epoch
    );
    Ok(state)
}
