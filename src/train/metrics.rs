//! `metrics.jsonl`: one [`StepMetrics`] line per optimiser step, TRL's metric names where they exist.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::Serialize;

use super::step::StepReport;
use super::tensorboard::{scalars_of, EventWriter};
use super::{io, write_atomic, TrainError, TrainerState};

/// One line of metrics.jsonl.
#[derive(Debug, Clone, Serialize)]
pub struct StepMetrics {
    pub step: usize,
    /// Fractional epoch at the end of the step.
    pub epoch: f64,
    pub loss: f64,
    pub pg_loss: f64,
    pub kl: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    pub learning_rate: f64,
    pub reward: f32,
    pub reward_std: f32,
    pub frac_reward_zero_std: f32,
    pub frac_bias_applied: f32,
    pub clip_ratio: f64,
    pub entropy: f64,
    #[serde(rename = "completions/mean_length")]
    pub mean_length: f32,
    /// Answers left out of the loss for being cut at the token limit (objective.mask_truncated).
    #[serde(rename = "completions/masked_truncated")]
    pub masked_truncated: usize,
    pub num_tokens: usize,
    pub total_tokens: u64,
    /// The update was skipped (non-finite loss or gradient).
    pub skipped: bool,
    pub nonfinite_steps: u64,
    pub step_time: f64,
    pub tokens_per_sec: f64,
    /// Peak GPU memory of the step (verl's perf/max_memory_allocated_gb); absent on the CPU.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_memory_allocated_gb: Option<f64>,
    /// Peak bytes of the device's memory pool during the step (its training, before any validation);
    /// null on the CPU.
    pub device_peak_bytes: Option<u64>,
    /// Peak bytes of the device's memory pool during the step's validation (absent when the step did not
    /// validate; null on the CPU).
    #[serde(rename = "validation/device_peak_bytes", skip_serializing_if = "Option::is_none")]
    pub validation_device_peak_bytes: Option<Option<u64>>,
    /// Validation score (avg@n) when the step validated.
    #[serde(rename = "validation/score", skip_serializing_if = "Option::is_none")]
    pub validation_score: Option<f64>,
    /// The ratio pi_theta / pi_behaviour over the step's tokens (absent for objectives without an anchor).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ratio_mean: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ratio_min: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ratio_max: Option<f64>,
    /// `[rollout]`: the step's rollouts (`rollout/*`).
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub rollout: Option<crate::rollout::RolloutMetrics>,
}

impl StepMetrics {
    /// The metrics of a finished step: `state` is already advanced past it, `epoch` is fractional.
    pub fn new(state: &TrainerState, epoch: f64, report: &StepReport, lr: f64, step_time: f64) -> Self {
        let s = &report.stats;
        let r = &report.rewards;
        let rt = s.response_tokens.max(1) as f64;
        Self {
            step: state.step,
            epoch,
            loss: s.loss,
            pg_loss: s.pg_loss,
            kl: s.kl,
            grad_norm: report.grad_norm,
            learning_rate: lr,
            reward: r.reward_mean,
            reward_std: r.reward_std,
            frac_reward_zero_std: r.frac_reward_zero_std,
            frac_bias_applied: r.frac_bias_applied,
            clip_ratio: s.clipped_tokens as f64 / rt,
            entropy: s.entropy_sum / rt,
            mean_length: r.mean_response_length,
            masked_truncated: r.masked_truncated,
            num_tokens: s.tokens,
            total_tokens: state.total_tokens,
            skipped: !report.applied,
            nonfinite_steps: state.nonfinite_steps,
            step_time,
            tokens_per_sec: s.tokens as f64 / step_time.max(1e-9),
            max_memory_allocated_gb: None,
            device_peak_bytes: None,
            validation_device_peak_bytes: None,
            validation_score: None,
            ratio_mean: s.ratio.mean(),
            ratio_min: s.ratio.mean().map(|_| s.ratio.min),
            ratio_max: s.ratio.mean().map(|_| s.ratio.max),
            rollout: None,
        }
    }
}

impl StepMetrics {
    /// The step's log line (when no bar is drawn): step/total, the main metrics, the time since
    /// `segment.0` (the start or resume, at step `segment.1`) and the ETA at this segment's pace.
    pub fn log_line(&self, total_steps: usize, segment: (std::time::Instant, usize)) -> String {
        let elapsed = segment.0.elapsed().as_secs_f64();
        let done = self.step.saturating_sub(segment.1).max(1) as f64;
        let eta = elapsed / done * total_steps.saturating_sub(self.step) as f64;
        let skipped = if self.skipped { " (update skipped: non-finite)" } else { "" };
        format!(
            "step {}/{} epoch {:.2}: loss {} reward {:.3} kl {} clip {:.3} {:.0} tok/s{skipped} | elapsed {} ETA {}",
            self.step,
            total_steps,
            self.epoch,
            small(self.loss),
            self.reward,
            small(self.kl),
            self.clip_ratio,
            self.tokens_per_sec,
            crate::progress::duration(elapsed),
            crate::progress::duration(eta)
        )
    }
}

/// A value that is often tiny (the KL early in a run, a loss near 0): four decimals, or three significant digits in
/// scientific notation under 0.001, so that `4.12e-5` does not read `0.0000`.
pub(super) fn small(v: f64) -> String {
    if v != 0.0 && v.abs() < 1e-3 {
        format!("{v:.2e}")
    } else {
        // + 0.0 shows -0 as 0.
        format!("{:.4}", v + 0.0)
    }
}

/// metrics.jsonl of a run, opened for appending, and its TensorBoard event file when reported there.
pub struct MetricsLog {
    path: PathBuf,
    file: File,
    tensorboard: Option<EventWriter>,
}

impl MetricsLog {
    /// Open OUTPUT/metrics.jsonl keeping the lines of steps up to `resumed_step` (those the resumed checkpoint
    /// had seen; none for a fresh run), and with `tensorboard` a new event file in OUTPUT/tensorboard.
    pub fn open(out: &Path, resumed_step: Option<usize>, tensorboard: bool) -> Result<Self, TrainError> {
        let path = out.join("metrics.jsonl");
        // Missing: nothing to keep. Unreadable (or not UTF-8): an error, never an emptied file.
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(e) => return Err(io(&path)(e)),
        };
        let kept: String = text
            .lines()
            .filter(|l| {
                resumed_step.is_some_and(|step| {
                    serde_json::from_str::<serde_json::Value>(l)
                        .ok()
                        .and_then(|v| v.get("step").and_then(|s| s.as_u64()))
                        .is_some_and(|s| (s as usize) <= step)
                })
            })
            .map(|l| format!("{l}\n"))
            .collect();
        write_atomic(&path, kept.as_bytes())?;
        let file = std::fs::OpenOptions::new().append(true).open(&path).map_err(io(&path))?;
        let tb_dir = out.join("tensorboard");
        let tensorboard =
            if tensorboard { Some(EventWriter::create(&tb_dir, resumed_step).map_err(io(&tb_dir))?) } else { None };
        Ok(Self { path, file, tensorboard })
    }

    /// Append one line and flush it (and the same scalars to the event file).
    pub fn write(&mut self, m: &StepMetrics) -> Result<(), TrainError> {
        let value = serde_json::to_value(m).map_err(|e| io(&self.path)(e.into()))?;
        writeln!(self.file, "{value}").and_then(|()| self.file.flush()).map_err(io(&self.path))?;
        if let Some(tb) = &mut self.tensorboard {
            let path = tb.path().to_path_buf();
            tb.scalars(m.step, &scalars_of(&value)).map_err(io(&path))?;
        }
        Ok(())
    }

    /// Make the lines written so far durable (fsync): called before each checkpoint, so that a crash of the
    /// machine after the checkpoint cannot lose the metrics of the steps it holds.
    pub fn sync(&self) -> Result<(), TrainError> {
        crate::fsio::sync_file(&self.file, &self.path).map_err(io(&self.path))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tiny_value_keeps_its_digits_and_a_zero_its_sign_off() {
        // A loss of -3e-6 read "-0.0000" in four decimals; -0 read "-0.0000" too.
        assert_eq!(small(-3.14e-6), "-3.14e-6");
        assert_eq!(small(4.12e-5), "4.12e-5");
        assert_eq!(small(-0.0), "0.0000");
        assert_eq!(small(0.0), "0.0000");
        assert_eq!(small(-0.25), "-0.2500");
    }

    #[test]
    fn a_sync_makes_the_written_lines_durable() {
        let dir = tempfile::tempdir().unwrap();
        let log = MetricsLog::open(dir.path(), None, false).unwrap();
        crate::fsio::take_synced();
        log.sync().unwrap();
        assert!(crate::fsio::take_synced().contains(&dir.path().join("metrics.jsonl")));
    }

    #[test]
    fn an_unreadable_metrics_file_is_an_error_and_left_as_it_is() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metrics.jsonl");
        let bytes = b"{\"step\": 1}\n{\"step\": 2, \"note\": \"\xff\xfe\"}\n".to_vec();
        std::fs::write(&path, &bytes).unwrap();
        let e = MetricsLog::open(dir.path(), Some(2), false).err().expect("an error").to_string();
        assert!(e.contains("metrics.jsonl"), "{e}");
        assert_eq!(std::fs::read(&path).unwrap(), bytes, "the metrics were changed");
        // Readable, the lines past the resumed step go.
        std::fs::write(&path, "{\"step\": 1}\n{\"step\": 2}\n{\"step\": 3}\n").unwrap();
        drop(MetricsLog::open(dir.path(), Some(2), false).unwrap());
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "{\"step\": 1}\n{\"step\": 2}\n");
    }
}
