//! Checkpoints of a run: OUTPUT/checkpoints/step-N (the HF model, `optimizer.safetensors` and
//! `trainer_state.json`), the `latest` pointer, keep-last pruning, and reading them back to resume.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};

use super::optim::Optimizer;
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
    pub fn save(&self, policy: &Decoder, optimizer: &Optimizer, state: &TrainerState) -> Result<PathBuf, TrainError> {
        let dir = self.output_dir.join("checkpoints");
        let name = format!("step-{:08}", state.step);
        let path = dir.join(&name);
        save_checkpoint(policy, &path, &self.options(), |tmp| write_trainer_files(tmp, optimizer, state))?;
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

/// The optimiser state and the trainer state, written into a checkpoint's temporary folder.
fn write_trainer_files(tmp: &Path, optimizer: &Optimizer, state: &TrainerState) -> Result<(), ModelError> {
    let tensors: Vec<(String, Tensor)> = optimizer
        .state_tensors()
        .into_iter()
        .map(|(n, t)| Ok((n, t.to_device(&Device::Cpu)?)))
        .collect::<candle_core::Result<_>>()?;
    let p = tmp.join("optimizer.safetensors");
    safetensors::serialize_to_file(tensors.iter().map(|(n, t)| (n.as_str(), t)), None, &p)
        .map_err(|e| ModelError::Files { path: p.clone(), message: e.to_string() })?;
    let s = tmp.join("trainer_state.json");
    std::fs::write(&s, serde_json::to_vec_pretty(state).unwrap_or_default())
        .map_err(|source| ModelError::Io { path: s, source })
}

/// Read a checkpoint's trainer state and restore the optimiser from it.
pub(super) fn restore(ck: &Path, optimizer: &mut Optimizer) -> Result<TrainerState, TrainError> {
    let s = ck.join("trainer_state.json");
    let state: TrainerState = serde_json::from_slice(&std::fs::read(&s).map_err(io(&s))?)
        .map_err(|e| TrainError::Stopped(format!("{}: {e}", s.display())))?;
    let opt_path = ck.join("optimizer.safetensors");
    let st = candle_core::safetensors::load(&opt_path, &Device::Cpu)?;
    optimizer.load_state(|n| st.get(n).cloned(), state.step as u64)?;
    tracing::info!(
        "resumed from {} at step {} (epoch {}, batch {})",
        ck.display(),
        state.step,
        state.epoch,
        state.batch_in_epoch
    );
    Ok(state)
}
