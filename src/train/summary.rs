//! `summary.json`: what a run did, written at its end (also when it is stopped on request) and printed by
//! `grpo train`: its steps and epochs, time and tokens, its final and best metrics (from the whole of
//! metrics.jsonl, so a resumed run's summary covers every segment), its best validation score, and where
//! its files are.

use std::fmt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::{write_atomic, Outcome, TrainError};

/// The file name of the summary in the output folder.
pub const SUMMARY_FILE: &str = "summary.json";

/// How a run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RunStatus {
    /// Every step was taken.
    Complete,
    /// Stopped on request (Ctrl-C, SIGTERM, SIGHUP) after a checkpoint: continue with `--resume auto`.
    Stopped,
}

/// A metric's value at a step.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct AtStep {
    pub value: f64,
    pub step: usize,
}

/// The metrics of one step, as read back from metrics.jsonl.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StepValues {
    pub step: usize,
    pub loss: Option<f64>,
    pub reward: Option<f64>,
    pub kl: Option<f64>,
    pub clip_ratio: Option<f64>,
    pub entropy: Option<f64>,
    pub grad_norm: Option<f64>,
    pub tokens_per_sec: Option<f64>,
}

/// The best value of a metric over the run, and its step.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct BestMetrics {
    /// The lowest loss.
    pub loss: Option<AtStep>,
    /// The highest mean reward.
    pub reward: Option<AtStep>,
}

/// Where the run's files are.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RunFiles {
    pub run_dir: PathBuf,
    pub metrics: PathBuf,
    /// Absent when it could not be drawn.
    pub curves: Option<PathBuf>,
    /// The best validation model (absent without validation).
    pub best: Option<PathBuf>,
    /// The last checkpoint (continue from it with `--resume auto`).
    pub last_checkpoint: Option<PathBuf>,
    pub summary: PathBuf,
}

/// summary.json.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RunSummary {
    pub status: RunStatus,
    /// Steps taken (the run's, over all its segments).
    pub steps: usize,
    /// The run's length in steps.
    pub total_steps: usize,
    /// Epochs done (fractional).
    pub epochs: f64,
    /// Wall time of this segment of the run (since its start or resume), in seconds.
    pub wall_time_s: f64,
    /// The step this segment resumed from (absent for a run from step 0).
    pub resumed_from_step: Option<usize>,
    /// Tokens trained on (prompt and answer tokens of every step).
    pub tokens_trained: u64,
    /// Steps whose update was skipped (non-finite loss or gradient).
    pub nonfinite_steps: u64,
    /// The last step's metrics.
    pub final_metrics: Option<StepValues>,
    pub best_metrics: BestMetrics,
    /// The best validation score (avg@n) and its step.
    pub best_validation: Option<AtStep>,
    pub files: RunFiles,
}

/// The lines of `metrics` that parse (a torn last line is left out).
fn read_steps(metrics: &Path) -> Vec<StepValues> {
    let text = std::fs::read_to_string(metrics).unwrap_or_default();
    text.lines().filter_map(|l| serde_json::from_str(l).ok()).collect()
}

/// The best (by `better`) finite value of `get` over `steps`.
fn best_of(steps: &[StepValues], get: fn(&StepValues) -> Option<f64>, better: fn(f64, f64) -> bool) -> Option<AtStep> {
    let mut best: Option<AtStep> = None;
    for s in steps {
        if let Some(v) = get(s).filter(|v| v.is_finite()) {
            if best.is_none_or(|b| better(v, b.value)) {
                best = Some(AtStep { value: v, step: s.step });
            }
        }
    }
    best
}

/// What the run sees at its end, for its summary.
pub(super) struct RunEnd<'a> {
    pub out: &'a Path,
    pub outcome: &'a Outcome,
    pub total_steps: usize,
    pub steps_per_epoch: usize,
    pub wall_time_s: f64,
    pub resumed_from_step: Option<usize>,
}

impl RunSummary {
    /// The summary of a run that ended as `end` says, from its output folder.
    pub(super) fn new(end: &RunEnd<'_>) -> Self {
        let out = end.out;
        let state = &end.outcome.state;
        let metrics = out.join("metrics.jsonl");
        let steps = read_steps(&metrics);
        let existing = |p: PathBuf| p.exists().then_some(p);
        Self {
            status: if end.outcome.interrupted { RunStatus::Stopped } else { RunStatus::Complete },
            steps: state.step,
            total_steps: end.total_steps,
            epochs: state.epoch as f64 + state.batch_in_epoch as f64 / end.steps_per_epoch.max(1) as f64,
            wall_time_s: end.wall_time_s,
            resumed_from_step: end.resumed_from_step,
            tokens_trained: state.total_tokens,
            nonfinite_steps: state.nonfinite_steps,
            final_metrics: steps.last().cloned(),
            best_metrics: BestMetrics {
                loss: best_of(&steps, |s| s.loss, |a, b| a < b),
                reward: best_of(&steps, |s| s.reward, |a, b| a > b),
            },
            best_validation: state.best_score.zip(state.best_step).map(|(value, step)| AtStep { value, step }),
            files: RunFiles {
                run_dir: out.to_path_buf(),
                metrics,
                curves: existing(out.join("curves.png")),
                best: existing(out.join("best")),
                last_checkpoint: end.outcome.checkpoint.clone(),
                summary: out.join(SUMMARY_FILE),
            },
        }
    }

    /// Write it as OUTPUT/summary.json.
    pub(super) fn write(&self) -> Result<(), TrainError> {
        let text = serde_json::to_string_pretty(self).map_err(|e| super::io(&self.files.summary)(e.into()))?;
        write_atomic(&self.files.summary, (text + "\n").as_bytes())
    }
}

fn opt(v: Option<f64>, digits: usize) -> String {
    // + 0.0 shows -0 as 0.
    v.map_or_else(|| "-".into(), |v| format!("{:.digits$}", v + 0.0))
}

impl RunSummary {
    /// The last line of a run's log: how it ended, and where its files are (the log of a run whose stdout
    /// is elsewhere, under a scheduler, says it too).
    pub fn last_line(&self) -> String {
        let f = &self.files;
        let ck = f.last_checkpoint.as_ref().map_or_else(|| "none".into(), |p| p.display().to_string());
        let curves = f.curves.as_ref().map_or(String::new(), |p| format!(", curves {}", p.display()));
        let files =
            format!("last checkpoint {ck}, metrics {}{curves}, summary {}", f.metrics.display(), f.summary.display());
        let took = crate::progress::duration(self.wall_time_s);
        match self.status {
            RunStatus::Complete => {
                format!("run complete: {} of {} steps in {took}; {files}", self.steps, self.total_steps)
            }
            RunStatus::Stopped => format!(
                "run stopped on request (Ctrl-C, SIGTERM or SIGHUP) at step {} of {} after {took}; {files}; \
                 continue with --resume auto",
                self.steps, self.total_steps
            ),
        }
    }
}

impl fmt::Display for RunSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = match self.status {
            RunStatus::Complete => "run complete",
            RunStatus::Stopped => "run stopped",
        };
        let resumed = self.resumed_from_step.map_or(String::new(), |s| format!(", resumed at step {s}"));
        writeln!(
            f,
            "{what}: {} of {} steps ({:.2} epochs) in {}{resumed}; {} tokens trained",
            self.steps,
            self.total_steps,
            self.epochs,
            crate::progress::duration(self.wall_time_s),
            self.tokens_trained
        )?;
        if let Some(m) = &self.final_metrics {
            writeln!(
                f,
                "  final (step {}): loss {}, reward {}, kl {}, clip ratio {}, entropy {}",
                m.step,
                m.loss.map_or_else(|| "-".into(), super::metrics::small),
                opt(m.reward, 3),
                m.kl.map_or_else(|| "-".into(), super::metrics::small),
                opt(m.clip_ratio, 3),
                opt(m.entropy, 3)
            )?;
        }
        let best = |b: &Option<AtStep>, show: &dyn Fn(f64) -> String| {
            b.map_or_else(|| "-".into(), |b| format!("{} (step {})", show(b.value), b.step))
        };
        writeln!(
            f,
            "  best: loss {}, reward {}",
            best(&self.best_metrics.loss, &super::metrics::small),
            best(&self.best_metrics.reward, &|v| format!("{:.3}", v + 0.0))
        )?;
        if let Some(v) = &self.best_validation {
            writeln!(f, "  best validation score: {:.4} at step {}", v.value, v.step)?;
        }
        if self.nonfinite_steps > 0 {
            writeln!(f, "  {} steps skipped (non-finite loss or gradient)", self.nonfinite_steps)?;
        }
        let files = &self.files;
        writeln!(f, "  metrics:         {}", files.metrics.display())?;
        if let Some(p) = &files.curves {
            writeln!(f, "  curves:          {}", p.display())?;
        }
        if let Some(p) = &files.best {
            writeln!(f, "  best model:      {}", p.display())?;
        }
        match &files.last_checkpoint {
            Some(p) if self.status == RunStatus::Stopped => {
                writeln!(f, "  last checkpoint: {} (continue with --resume auto)", p.display())?
            }
            Some(p) => writeln!(f, "  last checkpoint: {}", p.display())?,
            None => writeln!(f, "  last checkpoint: none")?,
        }
        writeln!(f, "  summary:         {}", files.summary.display())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::TrainerState;

    #[test]
    fn final_and_best_come_from_every_line_of_metrics() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path();
        let lines = [
            r#"{"step":1,"loss":0.5,"reward":0.25,"kl":0.0,"clip_ratio":0.0}"#,
            r#"{"step":2,"loss":0.2,"reward":0.75,"kl":0.01,"clip_ratio":0.1}"#,
            r#"{"step":3,"loss":null,"reward":0.5,"kl":0.02,"clip_ratio":0.2}"#,
            r#"{"step":4,"loss":"#,
        ];
        std::fs::write(out.join("metrics.jsonl"), lines.join("\n")).unwrap();
        std::fs::create_dir(out.join("best")).unwrap();
        let state = TrainerState {
            step: 3,
            epoch: 0,
            batch_in_epoch: 3,
            total_tokens: 1234,
            best_score: Some(0.5),
            best_step: Some(2),
            ..Default::default()
        };
        let ck = out.join("checkpoints/step-00000003");
        let outcome = Outcome::new(state, Some(ck.clone()), true);
        let end = RunEnd {
            out,
            outcome: &outcome,
            total_steps: 6,
            steps_per_epoch: 6,
            wall_time_s: 61.0,
            resumed_from_step: None,
        };
        let s = RunSummary::new(&end);
        assert_eq!(s.status, RunStatus::Stopped);
        assert_eq!((s.steps, s.total_steps, s.epochs, s.tokens_trained), (3, 6, 0.5, 1234));
        assert_eq!(s.final_metrics.as_ref().map(|m| (m.step, m.loss)), Some((3, None)));
        assert_eq!(s.best_metrics.loss, Some(AtStep { value: 0.2, step: 2 }));
        assert_eq!(s.best_metrics.reward, Some(AtStep { value: 0.75, step: 2 }));
        assert_eq!(s.best_validation, Some(AtStep { value: 0.5, step: 2 }));
        assert_eq!((s.files.best.is_some(), s.files.curves.is_none()), (true, true));
        s.write().unwrap();
        let back: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join(SUMMARY_FILE)).unwrap()).unwrap();
        assert_eq!(back["status"], "stopped");
        assert_eq!(back["files"]["last_checkpoint"], ck.display().to_string());
        let text = s.to_string();
        assert!(text.starts_with("run stopped: 3 of 6 steps (0.50 epochs) in 1m01s"), "{text}");
        assert!(text.contains("best validation score: 0.5000 at step 2") && text.contains("--resume auto"), "{text}");
    }
}
