//! The off-policy GRPO trainer: `grpo train --config FILE`.
//!
//! A step takes N questions with their G teacher answers, computes group-relative advantages (with the
//! all-positive bias), accumulates the objective's gradient over micro-batches, clips the global norm
//! and applies AdamW (or SGD) with f32 master weights. Data order is a pure function of (seed, epoch),
//! and checkpoints hold the model (HF format), the optimiser state and the data position, so a resumed
//! run continues exactly where it stopped.

pub mod checkpoint;
pub mod config;
mod dataset;
mod load;
mod metrics;
pub mod offload;
mod oom;
pub mod optim;
pub mod pack;
mod plan;
mod profiling;
mod ratio;
pub mod refcache;
mod reference_swap;
mod refshare;
mod resume;
mod run_dir;
pub mod step;
mod summary;
pub mod tensorboard;
mod validation;
mod zero;

use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::{Deserialize, Serialize};

pub use checkpoint::latest_checkpoint;
use checkpoint::Checkpointer;
pub use config::TrainConfig;
use dataset::{open_groups, prepared_dir};
use load::{check_weights, load_policy, load_run};
use metrics::{MetricsLog, StepMetrics};
pub use plan::model_config;
pub use reference_swap::ReferenceSwap;
pub use resume::RESUMABLE_KEYS;
use step::TrainStep;
pub use summary::{RunStatus, RunSummary, SUMMARY_FILE};

use crate::data::{self, PreparedDataset};
use crate::device::DTypeName;
use crate::dist::World;
use crate::model::{self, ChatTokenizer, Decoder, ModelError};
use crate::rollout::{GroupSource, Rollouts};

/// Errors of a training run.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error(transparent)]
    Config(#[from] config::ConfigError),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Data(#[from] data::DataError),
    #[error(transparent)]
    Eval(#[from] crate::eval::EvalError),
    #[error(transparent)]
    Rollout(#[from] crate::rollout::RolloutError),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[error(transparent)]
    Dist(#[from] crate::dist::DistError),
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{0}")]
    Stopped(String),
    /// A stop request (Ctrl-C, SIGTERM) honoured during a long pass before the first step.
    #[error("stopped on request {0}")]
    Interrupted(String),
    #[error("reference log-prob cache {}: {message}", path.display())]
    ReferenceCache { path: PathBuf, message: String },
    #[error("the run does not fit its device's memory:\n{plan}\nTo fit, {advice}.")]
    DoesNotFit { plan: String, advice: String },
    /// An allocation failed during the run (the driver's `CUDA_ERROR_OUT_OF_MEMORY`, [`oom::classify`]).
    #[error(transparent)]
    OutOfMemory(Box<oom::OutOfMemory>),
    #[error("{} is in use by another grpo run ({holder}); wait for it to end, or choose another train.output_dir", dir.display())]
    Busy { dir: PathBuf, holder: String },
    #[error("will not start in {}: {message}", dir.display())]
    OutputHasRun { dir: PathBuf, message: String },
    #[error(
        "no space left on the device writing checkpoint {} (about {need} needed, {free} free); {last}",
        ck.display()
    )]
    DiskFull { ck: PathBuf, need: String, free: String, last: String },
    #[error("damaged checkpoint {}: {message}", ck.display())]
    Damaged { ck: PathBuf, message: String },
    #[error("cannot resume from {}: {message}", ck.display())]
    Incompatible { ck: PathBuf, message: String },
    #[error(
        "cannot resume from {}: the training config differs from the checkpoint's (pass --allow-config-change \
         to resume with the new values):\n{changes}",
        ck.display()
    )]
    ConfigChanged { ck: PathBuf, changes: String },
}

impl TrainError {
    /// What was stopped, when this is a stop request honoured during a long pass (data preparation, the
    /// reference pass) rather than a failure.
    pub fn interrupted(&self) -> Option<&str> {
        match self {
            TrainError::Interrupted(what) | TrainError::Data(data::DataError::Interrupted(what)) => Some(what),
            _ => None,
        }
    }
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> TrainError + '_ {
    move |source| TrainError::Io { path: path.to_path_buf(), source }
}

/// Where a run is in its data, and its counters (trainer_state.json in each checkpoint).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    /// Optimiser steps taken (= index of the next step).
    pub step: usize,
    pub epoch: usize,
    /// Batches of the current epoch already consumed.
    pub batch_in_epoch: usize,
    pub total_tokens: u64,
    pub nonfinite_steps: u64,
    pub best_score: Option<f64>,
    pub best_step: Option<usize>,
    /// Identifies the run (kept across resumes): pruning only ever deletes this run's checkpoints.
    #[serde(default)]
    pub run_id: String,
    /// The frozen reference has been swapped for a copy of the policy (train.reference_swap_every): the
    /// checkpoint holds it, and a resume without it is refused.
    #[serde(default)]
    pub reference_swapped: bool,
    /// A fingerprint of the data trained on ([`PreparedDataset::fingerprint`]): a resume on other data
    /// is refused, or restarts the epoch with [`RunOptions::allow_data_change`]. None: not recorded
    /// (questions of `rollout.questions`, or an older checkpoint).
    #[serde(default)]
    pub data: Option<String>,
    /// Updates the optimiser applied (Adam's bias correction counts them): fewer than the steps when a
    /// non-finite step was skipped, more with several updates per batch. None in older checkpoints.
    #[serde(default)]
    pub optimizer_updates: Option<u64>,
    /// Non-finite (skipped) steps in a row up to this one, against train.max_bad_steps.
    #[serde(default)]
    pub bad_in_row: usize,
}

/// How to start.
#[derive(Debug, Clone, PartialEq)]
pub enum Resume {
    /// Start from the model in the config.
    No,
    /// Continue from OUTPUT/checkpoints/latest when there is one.
    Auto,
    /// Continue from this checkpoint folder.
    From(PathBuf),
}

/// How a run starts in its output folder.
#[derive(Debug, Clone, PartialEq)]
pub struct RunOptions {
    pub resume: Resume,
    /// A new run in a folder that holds another run's checkpoints deletes that run's results (without it, the
    /// run is refused).
    pub overwrite: bool,
    /// Resume even when the training config differs from the checkpoint's in keys outside
    /// [`RESUMABLE_KEYS`].
    pub allow_config_change: bool,
    /// Resume on data other than the checkpoint's (another prepared version): the checkpoint's epoch
    /// restarts at its first batch of the new data (without it, or `allow_config_change`, the resume is
    /// refused).
    pub allow_data_change: bool,
    /// The device's memory for the plan's check (default: the device's total).
    pub device_memory: Option<u64>,
}

/// What a run did.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub state: TrainerState,
    /// The last checkpoint written (a HF model folder).
    pub checkpoint: Option<PathBuf>,
    pub interrupted: bool,
    /// A resume found the run already complete: nothing was trained or written.
    pub already_complete: bool,
    /// What the run did (also in OUTPUT/summary.json); absent when it was already complete.
    pub summary: Option<RunSummary>,
}

impl Outcome {
    fn new(state: TrainerState, checkpoint: Option<PathBuf>, interrupted: bool) -> Self {
        Self { state, checkpoint, interrupted, already_complete: false, summary: None }
    }
}

/// The permutation of group indices of an epoch: a pure function of (seed, epoch).
pub fn epoch_order(n: usize, seed: u64, epoch: usize, shuffle: bool) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    if shuffle {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed ^ (epoch as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        order.shuffle(&mut rng);
    }
    order
}

/// Dynamic sampling's `k`-th batch of new questions at step `step` (rollout.filter_groups): `n` groups
/// drawn at random from the whole source, a pure function of (seed, step, k), so a resumed run draws
/// the same ones.
fn refill(
    dataset: &GroupSource,
    n: usize,
    seed: u64,
    step: usize,
    k: usize,
) -> Result<Vec<data::Group>, crate::rollout::RolloutError> {
    let mix = (step as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (k as u64).wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed ^ mix);
    let picks = rand::seq::index::sample(&mut rng, dataset.len(), n.min(dataset.len()));
    picks
        .into_iter()
        .map(|i| dataset.group(i).map_err(|e| crate::rollout::RolloutError::Invalid(e.to_string())))
        .collect()
}

/// The questions of step `s` of a run at step `at.0` (epoch `at.1`, batch `at.2` of it): the batch
/// `s - at.0` batches on in the epochs' orders, as [`Run::train_batch`] will take it.
fn questions_at(
    dataset: &GroupSource,
    cfg: &TrainConfig,
    steps_per_epoch: usize,
    at: (usize, usize, usize),
    s: usize,
) -> Result<Vec<data::Group>, crate::rollout::RolloutError> {
    let (step, epoch, batch) = at;
    let b = batch + s.saturating_sub(step);
    let (epoch, b) = (epoch + b / steps_per_epoch.max(1), b % steps_per_epoch.max(1));
    let order = epoch_order(dataset.len(), cfg.train.seed, epoch, cfg.data.shuffle);
    let bq = cfg.train.batch_questions;
    order[(b * bq).min(order.len())..((b + 1) * bq).min(order.len())]
        .iter()
        .map(|&i| dataset.group(i).map_err(|e| crate::rollout::RolloutError::Invalid(e.to_string())))
        .collect()
}

/// The model folder to start from, creating the tiny model of the config when asked.
fn ensure_model(cfg: &TrainConfig) -> Result<PathBuf, TrainError> {
    let p = Path::new(&cfg.model.path);
    if let Some(spec) = &cfg.model.init_tiny {
        if !p.join("config.json").exists() {
            tracing::info!("creating a tiny {:?} model at {}", spec.arch, p.display());
            model::tiny::write_tiny_model(spec, p)?;
        }
    }
    Ok(model::resolve_model_dir(&cfg.model.source()?)?)
}

fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), TrainError> {
    crate::fsio::write_atomic(path, bytes).map_err(io(path))
}

/// The checkpoint to resume from, if any, with its trainer state.
fn resume_point(out: &Path, resume: &Resume) -> Result<Option<(PathBuf, TrainerState)>, TrainError> {
    let from = match resume {
        Resume::No => None,
        Resume::Auto => {
            let ck = checkpoint::auto_resume_point(out)?;
            if ck.is_none() {
                tracing::info!("--resume auto: no checkpoint in {}, starting a new run at step 0", out.display());
            }
            ck
        }
        Resume::From(p) => {
            checkpoint::check_complete(p)?;
            Some(p.clone())
        }
    };
    let resumed = from.map(|ck| checkpoint::read_state(&ck).map(|state| (ck, state))).transpose()?;
    if let Some((ck, state)) = &resumed {
        tracing::info!("resuming from {} at step {} (epoch {})", ck.display(), state.step, state.epoch);
    }
    Ok(resumed)
}

/// Whether a run at `state` has taken all its steps under `cfg` (its epochs, or train.max_steps).
fn is_complete(cfg: &TrainConfig, state: &TrainerState) -> bool {
    let t = &cfg.train;
    (t.max_steps > 0 && state.step >= t.max_steps) || (t.epochs > 0 && state.epoch >= t.epochs)
}

/// A new run's id: unique enough to tell runs of one folder apart.
fn new_run_id() -> String {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    format!("{nanos:x}-{}", std::process::id())
}

/// Write the configuration of this run segment: OUTPUT/config.toml for a run from step 0 (which removes the
/// resumed segments' configs of an earlier run), OUTPUT/config-resume-step-N.toml for a segment resumed at
/// step N (earlier segments' files are kept).
fn write_config(cfg: &TrainConfig, resumed_at: Option<usize>) -> Result<(), TrainError> {
    let out = &cfg.train.output_dir;
    let name = match resumed_at {
        None => {
            for p in std::fs::read_dir(out).map_err(io(out))?.filter_map(|e| e.ok().map(|e| e.path())) {
                if p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("config-resume-step-")) {
                    std::fs::remove_file(&p).map_err(io(&p))?;
                }
            }
            "config.toml".to_string()
        }
        Some(step) => format!("config-resume-step-{step:08}.toml"),
    };
    write_atomic(&out.join(name), cfg.to_toml().as_bytes())
}

/// The number of steps of a run over `n_groups` groups.
#[derive(Debug, Clone, Copy)]
struct StepPlan {
    steps_per_epoch: usize,
    total_steps: usize,
    epochs: usize,
}

impl StepPlan {
    /// The plan of a run at `state`. Its epochs are counted from the step its current epoch began at,
    /// `epoch × steps_per_epoch` unless a resume on changed data (`--allow-data-change`) restarted the epoch
    /// at a later step: the remaining epochs are then the new data's.
    fn new(cfg: &TrainConfig, n_groups: usize, state: &TrainerState) -> Self {
        let t = &cfg.train;
        let steps_per_epoch = n_groups.div_ceil(t.batch_questions);
        if t.epochs == 0 {
            return Self { steps_per_epoch, total_steps: t.max_steps, epochs: usize::MAX };
        }
        let epoch_start = state.step.saturating_sub(state.batch_in_epoch);
        let mut total_steps = epoch_start + t.epochs.saturating_sub(state.epoch) * steps_per_epoch;
        if t.max_steps > 0 {
            total_steps = total_steps.min(t.max_steps);
        }
        Self { steps_per_epoch, total_steps, epochs: t.epochs }
    }
}

struct Run<'a> {
    cfg: &'a TrainConfig,
    policy: Decoder,
    reference: Option<Decoder>,
    /// The reference's log-probs computed beforehand (then no reference model is loaded).
    ref_cache: Option<refcache::ReferenceCache>,
    /// The reference is a swapped-in copy of the policy (train.reference_swap_every): checkpoints hold it.
    reference_swapped: bool,
    /// `[rollout]`: sampling, scoring and the sampling policy's copy.
    rollouts: Option<Rollouts>,
    step: TrainStep,
    tok: ChatTokenizer,
    checkpoints: Checkpointer,
    /// The ranks of a data-parallel run ([`crate::dist`]); rank 0 writes the run's files.
    world: Rc<World>,
    /// The memory plan checked before the weights loaded: what an out-of-memory error says was expected.
    memory_plan: Option<crate::cost::memory::Plan>,
}

impl Run<'_> {
    /// Train one batch of `order`, validate when due, and log the step's metrics.
    fn train_batch(
        &mut self,
        dataset: &GroupSource,
        order: &[usize],
        state: &mut TrainerState,
        plan: StepPlan,
    ) -> Result<StepMetrics, TrainError> {
        let cfg = self.cfg;
        let t0 = Instant::now();
        crate::profile::set_step(state.step as u64 + 1);
        crate::device::reset_peak_memory(self.policy.device())?;
        let bq = cfg.train.batch_questions;
        let idx = &order[state.batch_in_epoch * bq..((state.batch_in_epoch + 1) * bq).min(order.len())];
        let groups: Vec<data::Group> = idx.iter().map(|&i| dataset.group(i)).collect::<Result<_, _>>()?;
        let lr = cfg.optim.lr_at(state.step, plan.total_steps);
        let ctx = step::StepContext { seed: cfg.train.seed, epoch: state.epoch, step: state.step };
        let profiler = profiling::start(&cfg.train, state.step + 1, self.policy.device(), self.world.is_primary());
        let mut more = |k: usize| refill(dataset, bq, cfg.train.seed, state.step, k);
        let at = (state.step, state.epoch, state.batch_in_epoch);
        let mut ahead = |s: usize| questions_at(dataset, cfg, plan.steps_per_epoch, at, s);
        let (groups, mut rollout) = match &mut self.rollouts {
            Some(r) => {
                let (sampled, m) = r.answers(&self.policy, &groups, &mut more, &mut ahead, state.step)?;
                (sampled, Some(m))
            }
            None => (groups, None),
        };
        let updates = self.rollouts.as_ref().map_or(1, |r| r.options().updates_per_batch);
        let t = Instant::now();
        let cached = self.ref_cache.as_ref().map(|c| c.logprobs(&groups)).transpose()?;
        let reference = match &cached {
            Some(lp) => step::Reference::Logprobs(lp),
            None => self.reference.as_ref().into(),
        };
        let report = self.step.run_updates(&self.policy, reference, &groups, lr, ctx, updates)?;
        if let (Some(r), Some(m)) = (&mut self.rollouts, rollout.as_mut()) {
            r.updated(&self.policy, state.step, &mut ahead, t.elapsed().as_secs_f64(), m)?;
            m.updates = updates;
        }
        if let Some(p) = profiler {
            profiling::record(&cfg.train.output_dir, state.step + 1, &p.finish())?;
        }
        if !report.applied {
            state.nonfinite_steps += 1;
            tracing::warn!(
                "step {}: non-finite loss ({}) or gradient norm ({}); update skipped",
                state.step,
                report.stats.loss,
                report.grad_norm
            );
        }
        state.step += 1;
        state.batch_in_epoch += 1;
        state.total_tokens += report.stats.tokens as u64;
        let epoch = state.epoch as f64 + state.batch_in_epoch as f64 / plan.steps_per_epoch as f64;
        let mut m = StepMetrics::new(state, epoch, &report, lr, t0.elapsed().as_secs_f64());
        m.rollout = rollout;
        let peak = crate::device::memory_bytes(self.policy.device())?.map(|(_, peak)| peak);
        m.max_memory_allocated_gb = peak.map(|p| p as f64 / (1u64 << 30) as f64);
        m.device_peak_bytes = peak;
        Ok(m)
    }

    /// Validate after the step that `state` ends when due (its score and device peak, [`Run::validate`]);
    /// a new best score saves OUTPUT/best.
    fn validate_if_due(
        &self,
        state: &mut TrainerState,
        epoch_end: bool,
        run_end: bool,
        stop: &AtomicBool,
    ) -> Result<Option<(f64, Option<u64>)>, TrainError> {
        let due = self.cfg.validation.as_ref().is_some_and(|v| {
            if v.every_steps > 0 {
                state.step.is_multiple_of(v.every_steps)
            } else {
                epoch_end || run_end
            }
        });
        if !due {
            return Ok(None);
        }
        // Every rank validates its share and gets the same score, so that every rank's state agrees.
        let Some((score, peak)) = self.validate(state.step, stop)? else { return Ok(None) };
        if state.best_score.is_none_or(|b| score > b) {
            state.best_score = Some(score);
            state.best_step = Some(state.step);
            if !self.world.is_primary() {
                return Ok(Some((score, peak)));
            }
            let best = self.checkpoints.save_best(&self.policy)?;
            tracing::info!("new best validation score {score:.4} at step {}: saved {}", state.step, best.display());
        }
        Ok(Some((score, peak)))
    }

    /// Make the reference a copy of the policy when train.reference_swap_every says so.
    fn swap_reference_if_due(&mut self, steps_done: usize, epoch_end: bool) -> Result<(), TrainError> {
        let Some(swap) = self.cfg.train.reference_swap_every else { return Ok(()) };
        if swap.due(steps_done, epoch_end) {
            self.reference = None; // free the old copy first
            let mut r = self.policy.frozen_copy()?;
            r.options = self.policy.options.clone();
            self.reference = Some(r);
            self.reference_swapped = true;
            tracing::info!("step {steps_done}: the reference is now a copy of the policy");
        }
        Ok(())
    }

    /// The frozen models a checkpoint of `state` must hold besides the policy: the swapped reference, and
    /// the lagged sampling policy when it is not the checkpoint's own weights.
    fn frozen_to_save(&self, state: &TrainerState) -> Vec<(&'static str, &Decoder)> {
        let mut out = Vec::new();
        if let (true, Some(r)) = (self.reference_swapped, &self.reference) {
            out.push((checkpoint::REFERENCE_FILE, r));
        }
        if let Some(s) = self.rollouts.as_ref().filter(|r| r.stores_sampler(state.step)).and_then(|r| r.sampler()) {
            out.push((checkpoint::SAMPLER_FILE, s));
        }
        out
    }

    /// The epochs from `state` on: one step per batch, checkpoints at the configured points, validation.
    fn train_epochs(
        &mut self,
        dataset: &GroupSource,
        mut state: TrainerState,
        mut metrics: Option<&mut MetricsLog>,
        mut last_ckpt: Option<PathBuf>,
        stop: &AtomicBool,
    ) -> Result<Outcome, TrainError> {
        let cfg = self.cfg;
        let plan = StepPlan::new(cfg, dataset.len(), &state);
        tracing::info!(
            "{} groups, {} steps per epoch, {} steps; objective {}",
            dataset.len(),
            plan.steps_per_epoch,
            plan.total_steps,
            self.step.objective_name()
        );
        // A bar on a terminal; elsewhere one log line every train.log_every steps.
        let bar = crate::progress::terminal_bar(Some(plan.total_steps as u64), "train");
        bar.set_position(state.step as u64);
        let log_lines = !crate::progress::on_terminal();
        let segment = (Instant::now(), state.step);
        // The step the last checkpoint holds (where this segment started: a resumed checkpoint or step 0).
        let mut saved_at = state.step;
        let mut zero_gradients = ZeroGradients::default();
        while state.step < plan.total_steps && state.epoch < plan.epochs {
            if state.batch_in_epoch >= plan.steps_per_epoch {
                // Only a state from other data can be past its epoch's end (refused by the resume's check).
                return Err(TrainError::Stopped(format!(
                    "batch {} of epoch {} is past the data's {} steps per epoch",
                    state.batch_in_epoch, state.epoch, plan.steps_per_epoch
                )));
            }
            let order = epoch_order(dataset.len(), cfg.train.seed, state.epoch, cfg.data.shuffle);
            while state.batch_in_epoch < plan.steps_per_epoch && state.step < plan.total_steps {
                if self.world.any(stop.load(Ordering::SeqCst)) {
                    // Asked to stop after the last step's own check: its steps since the last checkpoint
                    // are saved (nothing when it holds them all, as before this segment's first step).
                    if state.step != saved_at {
                        if let Some(m) = metrics.as_deref() {
                            m.sync()?;
                        }
                        let frozen = self.frozen_to_save(&state);
                        last_ckpt =
                            Some(self.checkpoints.save(&self.world, &self.policy, &self.step, &state, &frozen)?);
                    }
                    bar.abandon_with_message("interrupted");
                    return Ok(Outcome::new(state, last_ckpt, true));
                }
                let mut m = self.train_batch(dataset, &order, &mut state, plan)?;
                state.bad_in_row = if m.skipped { state.bad_in_row + 1 } else { 0 };
                if let Some(w) = zero_gradients.observe(state.step, m.grad_norm) {
                    tracing::warn!("{w}");
                }
                bar.set_position(state.step as u64);
                bar.set_message(format!(
                    "loss {} reward {:.3} {:.0} tok/s",
                    metrics::small(m.loss),
                    m.reward,
                    m.tokens_per_sec
                ));
                let last = state.step >= plan.total_steps;
                if log_lines && (last || state.step.is_multiple_of(cfg.train.log_every.max(1))) {
                    tracing::info!("{}", m.log_line(plan.total_steps, segment));
                }
                if let Err(e) = self.check_bad_steps(&state) {
                    bar.abandon();
                    return Err(e);
                }
                let epoch_end = state.batch_in_epoch >= plan.steps_per_epoch;
                let run_end = state.step >= plan.total_steps;
                self.after_batch(&mut state, &mut m, metrics.as_deref_mut(), (epoch_end, run_end), stop)?;
                let stop_now = self.world.any(stop.load(Ordering::SeqCst));
                let periodic = cfg.train.save_every > 0 && state.step.is_multiple_of(cfg.train.save_every);
                if periodic || epoch_end || run_end || stop_now {
                    if let Some(m) = metrics.as_deref() {
                        m.sync()?;
                    }
                    let frozen = self.frozen_to_save(&state);
                    last_ckpt = Some(self.checkpoints.save(&self.world, &self.policy, &self.step, &state, &frozen)?);
                    saved_at = state.step;
                }
                if stop_now {
                    bar.abandon_with_message("interrupted: checkpoint written");
                    return Ok(Outcome::new(state, last_ckpt, true));
                }
                if epoch_end {
                    break; // the next epoch has its own order
                }
            }
        }
        bar.finish();
        Ok(Outcome::new(state, last_ckpt, false))
    }

    /// An error when more steps in a row than `train.max_bad_steps` had a non-finite loss or gradient.
    fn check_bad_steps(&self, state: &TrainerState) -> Result<(), TrainError> {
        let cfg = self.cfg;
        if state.bad_in_row <= cfg.train.max_bad_steps {
            return Ok(());
        }
        let last =
            latest_checkpoint(&cfg.train.output_dir).map(|p| p.display().to_string()).unwrap_or_else(|| "none".into());
        Err(TrainError::Stopped(format!(
            "{} steps in a row had a non-finite loss or gradient (train.max_bad_steps = {}); stopping. Last good checkpoint: {last}",
            state.bad_in_row, cfg.train.max_bad_steps
        )))
    }

    /// What follows a batch's step: validation where due (its score into the step's metrics), the metrics
    /// line, the reference swap where due, the curves after a validation, and the next epoch at an epoch's
    /// end.
    fn after_batch(
        &mut self,
        state: &mut TrainerState,
        m: &mut StepMetrics,
        metrics: Option<&mut MetricsLog>,
        (epoch_end, run_end): (bool, bool),
        stop: &AtomicBool,
    ) -> Result<(), TrainError> {
        if let Some((score, peak)) = self.validate_if_due(state, epoch_end, run_end, stop)? {
            m.validation_score = Some(score);
            m.validation_device_peak_bytes = Some(peak);
        }
        if let Some(metrics) = metrics {
            metrics.write(m)?;
        }
        self.swap_reference_if_due(state.step, epoch_end)?;
        state.reference_swapped |= self.reference_swapped;
        if m.validation_score.is_some() && self.world.is_primary() {
            crate::plot::refresh_run_curves(&self.cfg.train.output_dir);
        }
        if epoch_end {
            state.epoch += 1;
            state.batch_in_epoch = 0;
        }
        Ok(())
    }
}

impl Run<'_> {
    /// The state the run starts from: the resumed checkpoint's, restored into the policy, the step and the
    /// frozen models, or a new run's on `dataset`.
    fn start_state(
        &mut self,
        resumed: Option<(PathBuf, TrainerState)>,
        dataset: &GroupSource,
    ) -> Result<(Option<PathBuf>, TrainerState), TrainError> {
        Ok(match resumed {
            Some((ck, state)) => {
                checkpoint::restore(&ck, &state, &self.policy, &mut self.step)?;
                self.restore_frozen(&ck, &state)?;
                (Some(ck), state)
            }
            None => {
                let data = resume::data_fingerprint(dataset);
                (None, TrainerState { run_id: new_run_id(), data, ..Default::default() })
            }
        })
    }

    /// Restore, from the checkpoint `ck` of `state`, the swapped reference, the lagged sampling policy and
    /// the optimiser's update count with several updates per step.
    fn restore_frozen(&mut self, ck: &Path, state: &TrainerState) -> Result<(), TrainError> {
        match checkpoint::read_frozen(ck, checkpoint::REFERENCE_FILE, &self.policy)? {
            Some(r) => {
                self.reference = Some(r);
                self.reference_swapped = true;
            }
            None if state.reference_swapped => {
                return Err(TrainError::Damaged {
                    ck: ck.to_path_buf(),
                    message: format!(
                        "missing {}: the run swapped its reference (train.reference_swap_every), and the swapped \
                         reference cannot be restored",
                        checkpoint::REFERENCE_FILE
                    ),
                })
            }
            None => {}
        }
        if let (Some(r), None) = (&self.rollouts, state.optimizer_updates) {
            // An older checkpoint: each step made updates_per_batch optimiser updates (Adam's bias correction
            // counts them all).
            self.step.optimizer_mut().steps = (state.step * r.options().updates_per_batch) as u64;
        }
        if let Some(rollouts) = self.rollouts.as_mut().filter(|r| r.stores_sampler(state.step)) {
            let sampler = checkpoint::read_frozen(ck, checkpoint::SAMPLER_FILE, &self.policy)?.ok_or_else(|| {
                TrainError::Damaged {
                    ck: ck.to_path_buf(),
                    message: format!(
                        "missing {}: the lagged sampling policy cannot be restored",
                        checkpoint::SAMPLER_FILE
                    ),
                }
            })?;
            rollouts.set_sampler(sampler);
        }
        Ok(())
    }
}

/// Run (or resume) the training described by `cfg`. The output folder is locked for the run; a new run
/// refuses a folder that holds another run's checkpoints unless `opts.overwrite`; a resume checks the
/// checkpoint's model, tokenizer and training config first. `stop` is set by Ctrl-C or SIGTERM: the run
/// writes a checkpoint after the current step and returns with `interrupted = true`.
pub fn train(cfg: &TrainConfig, opts: &RunOptions, stop: &AtomicBool) -> Result<Outcome, TrainError> {
    let world = Rc::new(World::from_env(cfg.model.device.is_cuda())?);
    let generators = cfg.rollout.as_ref().map_or(0, |r| r.generation_ranks);
    let result = match generators {
        0 => train_in(cfg, opts, stop, world.clone(), None),
        n => with_generation_ranks(cfg, opts, stop, &world, n),
    };
    if let Err(e) = &result {
        if e.interrupted().is_none() {
            world.abort_on_error(e);
        }
    }
    result
}

/// [`train`] in a job whose last `generators` ranks generate the rollouts (rollout.generation_ranks): the
/// world split into trainers, which train as a job of their own, and generation ranks, which answer
/// trainer rank 0's requests ([`crate::rollout::serve_generation`]).
fn with_generation_ranks(
    cfg: &TrainConfig,
    opts: &RunOptions,
    stop: &AtomicBool,
    world: &Rc<World>,
    generators: usize,
) -> Result<Outcome, TrainError> {
    let roles = crate::dist::Roles::new(world.size(), generators)?;
    if let Some(i) = roles.generator_index(world.rank()) {
        let _group = world.split(&roles.generators)?;
        tracing::debug!("rank {}: generation rank {i}", world.rank());
        return generate_in(cfg, world, &roles);
    }
    let trainers = Rc::new(world.split(&roles.trainers)?);
    let outcome = train_in(cfg, opts, stop, trainers, Some((world.clone(), roles.clone())))?;
    if outcome.already_complete {
        crate::rollout::stop_generation(world, &roles)?;
    }
    Ok(outcome)
}

/// A generation rank: the sampling policy loaded as the trainers load the policy, then every request of
/// trainer rank 0 answered with the weights it last sent, until the run ends.
fn generate_in(cfg: &TrainConfig, world: &World, roles: &crate::dist::Roles) -> Result<Outcome, TrainError> {
    let cfg = &cfg.for_rank(world)?;
    cfg.validate()?;
    let r = cfg.rollout.as_ref().ok_or_else(|| TrainError::Stopped("generation ranks need [rollout]".into()))?;
    let device = model::open_device(cfg.model.device)?;
    let dtype = cfg.model.dtype.dtype();
    let load = |dir: &Path| {
        let invalid = |e: TrainError| crate::rollout::RolloutError::Invalid(e.to_string());
        let mut policy = load_policy(cfg, dir, None, (dtype, &device)).map_err(invalid)?;
        policy.options = cfg.model.decoder_options();
        let head_dim = policy.config().head_dim;
        policy.options.resolve_attention(&device, dtype, head_dim).map_err(|e| invalid(e.into()))?;
        let tok = ChatTokenizer::load(dir).map_err(ModelError::from)?;
        Ok((policy, tok))
    };
    let batches = crate::rollout::serve_generation(world, roles, r, cfg.train.seed, cfg.train.micro_batch_size, load)?;
    tracing::info!("generation rank {}: answered {batches} batches", world.rank());
    Ok(Outcome::new(TrainerState::default(), None, false))
}

/// [`train`] as one rank of `world`: rank 0 holds the output folder's lock and writes the run's files; every
/// rank prepares (or waits for) the data and the reference cache and trains on its share of each batch.
fn train_in(
    cfg: &TrainConfig,
    opts: &RunOptions,
    stop: &AtomicBool,
    world: Rc<World>,
    generation: Option<(Rc<World>, crate::dist::Roles)>,
) -> Result<Outcome, TrainError> {
    let cfg = &cfg.for_rank(&world)?;
    let primary = world.is_primary();
    cfg.validate()?;
    cfg.check_paths()?;
    for w in cfg.rollout.iter().flat_map(|r| r.warnings()) {
        tracing::warn!("{w}");
    }
    let started = Instant::now();
    let out = &cfg.train.output_dir;
    let (_lock, resumed) = open_output(cfg, opts, primary)?;
    if let Some((ck, state)) = &resumed {
        if is_complete(cfg, state) {
            let outcome = Outcome { already_complete: true, ..Outcome::new(state.clone(), Some(ck.clone()), false) };
            return Ok(outcome);
        }
    }
    // Rank 0 creates a `model.init_tiny` model; the others wait for it.
    let model_dir = if primary { Some(ensure_model(cfg)?) } else { None };
    world.barrier();
    let model_dir = match model_dir {
        Some(d) => d,
        None => ensure_model(cfg)?,
    };
    if let Some((ck, _)) = &resumed {
        resume::check_model(ck, &model_dir)?;
    }
    check_weights(cfg, &model_dir)?;
    let memory_plan = plan::check_plan(cfg, &model_dir, opts.device_memory, world.size() as u64)?;
    let decoder = plan::decoder_options(cfg, &memory_plan)?;
    if primary {
        write_config(cfg, resumed.as_ref().map(|(_, s)| s.step))?;
    }
    // The checkpoint's prepared version is held while the data is prepared and checked: a resume refused
    // because the data changed leaves it (and its reference log-prob cache) for a run on the undone edit.
    let checkpoint_data = resumed.as_ref().and_then(|(_, s)| s.data.as_deref());
    let checkpoint_hold = checkpoint_data.and_then(|f| data::shards::hold_fingerprint(&prepared_dir(cfg), f));
    let dataset = open_groups(cfg, &model_dir, stop, &world)?;
    let steps_per_epoch = dataset.len().div_ceil(cfg.train.batch_questions);
    let resumed = match resumed {
        Some((ck, state)) => {
            // A changed config may change the data (data.*, train.seed): allowed, it allows that too.
            let allow = opts.allow_data_change || opts.allow_config_change;
            let state = resume::check_data(&ck, state, &dataset, steps_per_epoch, allow)?;
            Some((ck, state))
        }
        None => None,
    };
    drop(checkpoint_hold);
    let ref_cache = match &dataset {
        GroupSource::Prepared(prepared) => refcache::for_run(cfg, &model_dir, prepared, &decoder, stop, &world)?,
        GroupSource::Questions(_) => None,
    };
    let resume_from = resumed.as_ref().map(|(ck, _)| ck.as_path());
    let mut run = load_run(cfg, model_dir, resume_from, ref_cache, memory_plan, decoder)?;
    run.step.share_with(world.clone())?;
    if let Some(r) = &mut run.rollouts {
        r.share_with(world.clone());
        let at = resumed.as_ref().map(|(_, s)| s.clone()).unwrap_or_default();
        r.run_for(StepPlan::new(cfg, dataset.len(), &at).total_steps);
        if let Some((job, roles)) = generation {
            r.generate_on(job, roles, &run.checkpoints.model_dir)?;
        }
    }
    run.world = world;
    if primary {
        let need = run.checkpoints.checkpoint_bytes(&run.policy, &[]);
        if let Some(w) = run.checkpoints.space_warning(need) {
            tracing::warn!("{w}");
        }
    }
    let (resume_from, state) = run.start_state(resumed, &dataset)?;
    let resumed_from_step = resume_from.is_some().then_some(state.step);
    let tensorboard = cfg.train.report_to.contains(&config::ReportTo::Tensorboard);
    let mut metrics = if primary { Some(MetricsLog::open(out, resumed_from_step, tensorboard)?) } else { None };
    let mut outcome = run
        .train_epochs(&dataset, state, metrics.as_mut(), resume_from, stop)
        .map_err(|e| oom::classify(e, run.memory_plan.as_ref(), cfg, run.policy.device()))?;
    if let Some(r) = &mut run.rollouts {
        r.finish()?;
    }
    if primary {
        outcome.summary = Some(write_summary(cfg, &outcome, dataset.len(), started, resumed_from_step)?);
    }
    // No rank ends before rank 0 has written the summary: under mpirun the first rank to exit with a stop
    // status ends the job, and would kill rank 0 while it writes.
    run.world.barrier();
    Ok(outcome)
}

/// Steps in a row with a gradient norm of exactly 0 after which a run says that it learns nothing.
const ZERO_GRADIENT_STEPS: usize = 3;

/// Counts the steps in a row whose gradient norm is 0: every ratio at its clip (teacher log-probs that are
/// not log-probabilities), no advantage in any group, or a loss that does not depend on the weights.
#[derive(Debug, Default)]
struct ZeroGradients {
    in_row: usize,
}

impl ZeroGradients {
    /// The warning to give after step `step` (1-based) of gradient norm `grad_norm`: once, when the
    /// [`ZERO_GRADIENT_STEPS`]-th zero in a row is seen.
    fn observe(&mut self, step: usize, grad_norm: f64) -> Option<String> {
        self.in_row = if grad_norm == 0.0 { self.in_row + 1 } else { 0 };
        (self.in_row == ZERO_GRADIENT_STEPS).then(|| {
            format!(
                "steps {}-{step}: the gradient norm is 0 for {ZERO_GRADIENT_STEPS} steps in a row, so the model is not \
                 learning: look at the clip ratio and the advantages in metrics.jsonl (all rewards of each group \
                 equal? teacher log-probs far from the policy's?)",
                step + 1 - ZERO_GRADIENT_STEPS
            )
        })
    }
}

/// A checkpoint to resume from and its trainer state.
type ResumePoint = (PathBuf, TrainerState);

/// The run's output folder made and (rank 0) locked, cleaned of a killed run's leftovers and claimed for
/// this run; the checkpoint to resume from (`--resume`), checked against its checksums and this config.
fn open_output(
    cfg: &TrainConfig,
    opts: &RunOptions,
    primary: bool,
) -> Result<(Option<run_dir::FolderLock>, Option<ResumePoint>), TrainError> {
    let out = &cfg.train.output_dir;
    crate::fsio::create_folder(out).map_err(io(out))?;
    let lock = if primary { Some(run_dir::lock(out)?) } else { None };
    if primary {
        run_dir::clean_leftovers(out)?;
    }
    let resumed = resume_point(out, &opts.resume)?;
    if primary {
        run_dir::claim(out, resumed.as_ref().map(|(_, s)| s.run_id.as_str()), opts.overwrite)?;
    }
    if let Some((ck, _)) = &resumed {
        checkpoint::verify_checksums(ck)?;
        resume::check_config(ck, cfg, opts.allow_config_change)?;
    }
    Ok((lock, resumed))
}

/// Rank 0's end of a run: the curves, and the summary written (OUTPUT/summary.json).
fn write_summary(
    cfg: &TrainConfig,
    outcome: &Outcome,
    groups: usize,
    started: Instant,
    resumed_from_step: Option<usize>,
) -> Result<RunSummary, TrainError> {
    let out = Path::new(&cfg.train.output_dir);
    crate::plot::refresh_run_curves(out);
    let plan = StepPlan::new(cfg, groups, &outcome.state);
    let end = summary::RunEnd {
        out,
        outcome,
        total_steps: plan.total_steps,
        steps_per_epoch: plan.steps_per_epoch,
        wall_time_s: started.elapsed().as_secs_f64(),
        resumed_from_step,
    };
    let summary = RunSummary::new(&end);
    summary.write()?;
    Ok(summary)
}

#[cfg(test)]
mod tests;
