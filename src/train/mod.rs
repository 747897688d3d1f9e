//! The off-policy GRPO trainer: `grpo train --config FILE`.
//!
//! A step takes N questions with their G teacher answers, computes group-relative advantages (with the
//! all-positive bias), accumulates the objective's gradient over micro-batches, clips the global norm
//! and applies AdamW (or SGD) with f32 master weights. Data order is a pure function of (seed, epoch),
//! and checkpoints hold the model (HF format), the optimiser state and the data position, so a resumed
//! run continues exactly where it stopped.

pub mod checkpoint;
pub mod config;
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

/// Where the config's data is prepared.
fn prepared_dir(cfg: &TrainConfig) -> PathBuf {
    cfg.data.prepared_dir.clone().unwrap_or_else(|| cfg.train.output_dir.join("prepared"))
}

/// Open, on every rank of `world`, the prepared version that rank 0 prepared or found up to date (`version`
/// on rank 0), whatever `CURRENT` names by the time a rank reads it: the ranks of a run never read different
/// versions.
fn open_chosen(prepared_dir: &Path, version: &Path, world: &World) -> Result<PreparedDataset, TrainError> {
    let mine = if world.is_primary() { Some(PreparedDataset::open_version(version)?) } else { None };
    // Its name in the prepared folder ("" for the folder itself, in the single-version layout).
    let name = mine.as_ref().and_then(|d| d.dir().strip_prefix(prepared_dir).ok()).map(|p| p.to_path_buf());
    let name = name.unwrap_or_default().to_string_lossy().into_owned();
    let chosen = String::from_utf8_lossy(&world.all_gather_bytes(name.as_bytes())[0]).into_owned();
    match mine {
        Some(d) => Ok(d),
        None => Ok(PreparedDataset::open_version(&prepared_dir.join(chosen))?),
    }
}

/// Prepare the config's data (once: re-used while inputs, tokenizer and options are unchanged) and open it.
fn prepare_data(
    cfg: &TrainConfig,
    model_dir: &Path,
    stop: &AtomicBool,
    world: &World,
) -> Result<PreparedDataset, TrainError> {
    let prepared_dir = prepared_dir(cfg);
    let mut input = cfg.data.input.clone();
    input.group.seed = cfg.train.seed;
    let popts = data::PrepareOptions {
        input,
        sequence: cfg.data.sequence.clone(),
        model: model_dir.to_path_buf(),
        out: prepared_dir.clone(),
        ..Default::default()
    };
    let outcome = data::prepare::prepare_with(&popts, &mut |bad| tracing::warn!("skipped {bad}"), Some(stop))?;
    if outcome.skipped {
        tracing::info!("data in {} is up to date", prepared_dir.display());
    }
    let dataset = open_chosen(&prepared_dir, &outcome.out, world)?;
    // An up-to-date folder's counts are in its stats.json (the message only: unreadable is no error).
    let stats = if outcome.skipped { dataset.stats().ok() } else { Some(outcome.stats) };
    let group = &cfg.data.input.group;
    if dataset.is_empty() {
        return Err(TrainError::Stopped(format!(
            "no training groups in {}: {}",
            prepared_dir.display(),
            stats.map_or("stats.json is unreadable".into(), |s| data_counts(&s, group))
        )));
    }
    let Some(stats) = stats else { return Ok(dataset) };
    tracing::info!("data: {} -> {} training groups", data_counts(&stats, group), stats.groups);
    let small: u64 = stats.group_size_histogram.range(..group.group_size as u64).map(|(_, n)| n).sum();
    if group.group_size > 0 && small > 0 {
        tracing::warn!(
            "{small} of {} groups have fewer than data.group_size = {} answers and are trained on as they are \
             (only groups under data.min_group_size = {} are dropped)",
            stats.groups,
            group.group_size,
            group.min_group_size
        );
    }
    Ok(dataset)
}

/// The groups the run's batches come from: the prepared teacher data, or the questions of
/// `rollout.questions`.
fn open_groups(
    cfg: &TrainConfig,
    model_dir: &Path,
    stop: &AtomicBool,
    world: &World,
) -> Result<GroupSource, TrainError> {
    match cfg.rollout.as_ref().and_then(|r| r.questions.as_ref().map(|q| (r, q))) {
        Some((r, path)) => {
            let tok = ChatTokenizer::load(model_dir).map_err(ModelError::from)?;
            let seq = &cfg.data.sequence;
            let system = seq.system_prompt.as_deref();
            let questions =
                crate::rollout::load_questions(path, &r.prompt_template, &tok, system, seq.max_prompt_tokens)?;
            Ok(GroupSource::Questions(questions))
        }
        None => Ok(GroupSource::Prepared(prepare_data(cfg, model_dir, stop, world)?)),
    }
}

/// What preparation read and what each of its rules left out, from its counts (why N questions became M
/// groups, or none).
fn data_counts(s: &data::Stats, group: &data::GroupOptions) -> String {
    if s.rows_read == 0 {
        return "the inputs have no rows".into();
    }
    let mut why = vec![format!("{} rows read", s.rows_read)];
    let add = |why: &mut Vec<String>, n: u64, what: String| {
        if n > 0 {
            why.push(format!("{n} {what}"));
        }
    };
    let reasons: Vec<String> = s.skipped_by_reason.iter().map(|(r, n)| format!("{r}: {n}")).collect();
    add(&mut why, s.rows_skipped, format!("skipped ({})", reasons.join(", ")));
    add(&mut why, s.rows_filtered, "left out by data.domains / data.sources".into());
    why.push(format!("{} questions", s.questions));
    let min = group.min_group_size.max(1);
    add(&mut why, s.groups_dropped_small, format!("with fewer than data.min_group_size = {min} answers"));
    add(&mut why, s.groups_dropped_long_prompt, "with a prompt over data.max_prompt_tokens".into());
    add(&mut why, s.groups_dropped_tie, "with a tied vote (data.ties = \"drop\")".into());
    let margin = format!("with a vote margin under data.min_vote_margin = {}", group.min_vote_margin);
    add(&mut why, s.groups_dropped_margin, margin);
    add(&mut why, s.groups_not_sampled, "left out of the data.max_questions sample".into());
    why.join(", ")
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
    /// Validate the policy at `step`, every rank generating its share of the problems (problem i on rank
    /// i mod N, as `grpo eval` splits them): the ranks that finish first wait in short rounds
    /// ([`crate::dist::Apart`]), not in a bounded collective, however long the others take. Every rank gets
    /// the score, and its device's peak memory in the validation (None on the CPU); rank 0 writes the
    /// results.
    fn validate(&self, step: usize, stop: &AtomicBool) -> Result<Option<(f64, Option<u64>)>, TrainError> {
        let Some(v) = &self.cfg.validation else { return Ok(None) };
        let device = self.policy.device();
        crate::device::reset_peak_memory(device)?;
        let phase = crate::profile::coarse("validation")?;
        let bench = crate::eval::benchmarks::load(&v.bench)?;
        let options = crate::eval::EvalOptions { seed: v.seed.or(Some(self.cfg.train.seed)), ..v.clone() };
        let out = self.cfg.train.output_dir.join("validation");
        let bar = crate::progress::log_only_bar(Some(0), &format!("validation on {}", v.bench));
        let started = Instant::now();
        let engine = crate::eval::engine::Native {
            model: &self.policy,
            tok: &self.tok,
            batch_size: options.batch_size,
            generation: &options.generation,
        };
        let share = crate::eval::Share { index: self.world.rank(), of: self.world.size() };
        let mut apart = crate::dist::Apart::begin(&self.world, Some(stop));
        let part = crate::eval::evaluate_share(
            &engine,
            &self.tok,
            &bench,
            &options,
            &Default::default(),
            share,
            |_| Ok(()),
            |p| {
                apart.tick();
                p.show(&bar, started)
            },
        )?;
        apart.finish();
        bar.finish_and_clear();
        phase.end();
        let peak = crate::device::memory_bytes(device)?.map(|(_, peak)| peak);
        // The KV cache's memory goes back to the device before the training step needs it.
        crate::device::release_pool(device)?;
        let parts = self.gather_validation(&part)?;
        let (report, results) = crate::eval::merge_shares(&bench, &options, parts, started.elapsed().as_secs_f64());
        if self.world.is_primary() {
            std::fs::create_dir_all(&out).map_err(io(&out))?;
            let lines: Vec<String> = results.iter().map(|r| serde_json::to_string(r).unwrap_or_default()).collect();
            let p = out.join(format!("step-{step:08}-{}.jsonl", v.bench));
            std::fs::write(&p, lines.join("\n") + "\n").map_err(io(&p))?;
            let secs = started.elapsed().as_secs_f64();
            tracing::info!(
                "validation on {} at step {step}: avg@{} = {:.4} ({secs:.1} s)",
                v.bench,
                v.n,
                report.avg_at_n
            );
        }
        Ok(Some((report.avg_at_n, peak)))
    }

    /// Every rank's share of a validation, in rank order.
    fn gather_validation(
        &self,
        part: &crate::eval::ShareResults,
    ) -> Result<Vec<crate::eval::ShareResults>, TrainError> {
        if self.world.size() == 1 {
            return Ok(vec![part.clone()]);
        }
        let bytes = serde_json::to_vec(part).map_err(|e| TrainError::Stopped(format!("validation results: {e}")))?;
        let parts = self.world.all_gather_bytes(&bytes);
        let read = |(rank, b): (usize, &Vec<u8>)| {
            serde_json::from_slice(b)
                .map_err(|e| TrainError::Stopped(format!("the validation results of rank {rank}: {e}")))
        };
        parts.iter().enumerate().map(read).collect()
    }

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

/// Load the policy (from the checkpoint when resuming), the reference when the objective needs one (its
/// KL term, or the reference as its anchor) unless its log-probs are in `ref_cache`, the tokenizer and the
/// training step. The policy computes with the decoder options `memory_plan` resolved.
fn load_run<'a>(
    cfg: &'a TrainConfig,
    model_dir: PathBuf,
    resume_from: Option<&Path>,
    ref_cache: Option<refcache::ReferenceCache>,
    memory_plan: crate::cost::memory::Plan,
) -> Result<Run<'a>, TrainError> {
    let device = model::open_device(cfg.model.device)?;
    let dtype = cfg.model.dtype.dtype();
    let save_dtype = cfg.train.save_dtype.map(DTypeName::dtype);
    let mut policy = load_policy(cfg, &model_dir, resume_from, (dtype, &device))?;
    policy.options = plan::decoder_options(cfg, &memory_plan);
    log_attention_fallback(&policy, dtype, &device);
    log_lora(&policy);
    let tok = ChatTokenizer::load(&model_dir).map_err(ModelError::from)?;
    let mut step = TrainStep::new(
        &cfg.objective,
        &cfg.optim,
        &policy,
        cfg.train.micro_batch_size,
        cfg.data.sequence.max_response_tokens,
        tok.pad_id(),
    )?;
    step.set_batching(pack::Batching::of(cfg.train.micro_batch_size, cfg.train.micro_batch_tokens));
    let reference = match step.needs_reference() && ref_cache.is_none() {
        true => Some(load_reference(cfg, &policy, &model_dir, resume_from, (dtype, &device))?),
        false => None,
    };
    let checkpoints = Checkpointer {
        output_dir: cfg.train.output_dir.clone(),
        model_dir,
        save_dtype,
        keep_last: cfg.train.keep_last,
        config_toml: cfg.to_toml(),
    };
    let rollouts = cfg.rollout.as_ref().map(|r| new_rollouts(cfg, r, &checkpoints)).transpose()?;
    let world = Rc::new(World::single());
    Ok(Run {
        cfg,
        policy,
        reference,
        ref_cache,
        reference_swapped: false,
        rollouts,
        step,
        tok,
        checkpoints,
        world,
        memory_plan: Some(memory_plan),
    })
}

/// A log line where `model.attention` names tensor-core kernels this run cannot use (the chunked path runs).
fn log_attention_fallback(policy: &Decoder, dtype: candle_core::DType, device: &candle_core::Device) {
    let o = &policy.options;
    if matches!(o.attention, model::Attention::Mma | model::Attention::Wgmma)
        && !(device.is_cuda() && o.tensor_core_attention(dtype, policy.config().head_dim))
    {
        tracing::info!(
            "model.attention = {:?}: the tensor-core kernels take bf16/f16 at head dim 64 or 128 on a GPU; \
             this run ({:?}, head dim {}, {}) uses flash attention's chunked path",
            o.attention,
            dtype,
            policy.config().head_dim,
            if device.is_cuda() { "GPU" } else { "CPU" }
        );
    }
}

/// The frozen reference, with the policy's options: `model.reference`, or the policy's base model (LoRA,
/// its weights shared), or the model of `model_dir` (resumed: the policy has moved), or a copy of the policy.
fn load_reference(
    cfg: &TrainConfig,
    policy: &Decoder,
    model_dir: &Path,
    resume_from: Option<&Path>,
    (dtype, device): (candle_core::DType, &candle_core::Device),
) -> Result<Decoder, TrainError> {
    let mut r = match &cfg.model.reference {
        Some(p) => model::load_decoder(&model::resolve_model_dir(p)?, dtype, device, false)?,
        // LoRA: the base model, its weights shared with the policy (no copy).
        None if policy.lora().is_some() => policy.without_adapters(),
        None if resume_from.is_some() => model::load_decoder(model_dir, dtype, device, false)?,
        None => policy.frozen_copy()?,
    };
    r.options = policy.options.clone();
    Ok(r)
}

/// `[rollout]`'s sampler, serving the policy's weights from OUTPUT/rollout-policy to a server.
fn new_rollouts(
    cfg: &TrainConfig,
    r: &crate::rollout::RolloutOptions,
    checkpoints: &Checkpointer,
) -> Result<Rollouts, TrainError> {
    let tok = ChatTokenizer::load(&checkpoints.model_dir).map_err(ModelError::from)?;
    let mut rollouts = Rollouts::new(r.clone(), tok, cfg.train.seed, cfg.train.micro_batch_size);
    let save = model::checkpoint::SaveOptions {
        dtype: checkpoints.save_dtype,
        tokenizer_dir: Some(checkpoints.model_dir.clone()),
        ..Default::default()
    };
    rollouts.serve_weights_from(cfg.train.output_dir.join("rollout-policy"), save);
    Ok(rollouts)
}

/// The policy: the model of `model_dir` (or of the checkpoint `resume_from`), trainable; with `[model.lora]`,
/// the base model of `model_dir`, frozen, with the checkpoint's adapters or fresh ones (from `train.seed`).
fn load_policy(
    cfg: &TrainConfig,
    model_dir: &Path,
    resume_from: Option<&Path>,
    (dtype, device): (candle_core::DType, &candle_core::Device),
) -> Result<Decoder, TrainError> {
    if let Some(ck) = resume_from {
        checkpoint_holds(ck, cfg.model.lora.is_some())?;
    }
    let Some(lora) = &cfg.model.lora else {
        return Ok(model::load_decoder(resume_from.unwrap_or(model_dir), dtype, device, true)?);
    };
    if let Some(ck) = resume_from {
        return Ok(model::lora::load_with_adapter(model_dir, ck, Some(lora), (dtype, device), true)?);
    }
    let base = model::load_decoder(model_dir, dtype, device, false)?;
    let adapters = model::lora::init_adapters(base.config(), lora, cfg.train.seed, device)?;
    Ok(base.with_adapters(lora, adapters, true)?)
}

/// Check that checkpoint `ck` holds what the run trains: LoRA adapters when `lora`, whole weights otherwise.
fn checkpoint_holds(ck: &Path, lora: bool) -> Result<(), TrainError> {
    let adapters = model::lora::is_adapter_dir(ck);
    let message = match (lora, adapters) {
        (false, true) => {
            "it holds LoRA adapters (adapter_model.safetensors), written by a run with [model.lora]; \
                          resume it with that [model.lora] section, or start a new run (--overwrite)"
        }
        (true, false) => {
            "it holds whole weights, written by a run without [model.lora]; resume it without \
                          [model.lora], or start a new run (--overwrite)"
        }
        _ => return Ok(()),
    };
    Err(TrainError::Incompatible { ck: ck.to_path_buf(), message: message.into() })
}

/// The log line of a LoRA policy: its adapters and how much of the model they train.
fn log_lora(policy: &Decoder) {
    let Some(lora) = policy.lora() else { return };
    let count = |ts: Vec<(String, candle_core::Tensor)>| ts.iter().map(|(_, t)| t.elem_count()).sum::<usize>();
    let (trained, base) = (count(policy.adapter_tensors()), count(policy.named_tensors()));
    tracing::info!(
        "LoRA: rank {}, alpha {}, on {} of each layer: {trained} trainable parameters, {:.3}% of the base's {base}",
        lora.r,
        lora.alpha,
        lora.target_modules.join(", "),
        100.0 * trained as f64 / base.max(1) as f64
    );
}

/// Check the names and shapes of the model's weights (and of `model.reference`'s) against their
/// config.json from the files' headers, before the data is prepared or any weight is read: a config that
/// does not match its weights fails here, naming the folder and file ([`model::load::check_weights`]).
fn check_weights(cfg: &TrainConfig, model_dir: &Path) -> Result<(), TrainError> {
    let reference = cfg.model.reference.as_deref().map(model::resolve_model_dir).transpose()?;
    for dir in std::iter::once(model_dir).chain(reference.as_deref()) {
        let shape = model::ModelConfig::from_file(&dir.join("config.json")).map_err(ModelError::from)?;
        model::load::check_weights(dir, &shape)?;
    }
    Ok(())
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
        GroupSource::Prepared(prepared) => refcache::for_run(cfg, &model_dir, prepared, stop, &world)?,
        GroupSource::Questions(_) => None,
    };
    let resume_from = resumed.as_ref().map(|(ck, _)| ck.as_path());
    let mut run = load_run(cfg, model_dir, resume_from, ref_cache, memory_plan)?;
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
mod tests {
    use super::*;
    use std::sync::Mutex;
    use tracing_subscriber::layer::SubscriberExt;

    fn root() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
    }

    #[test]
    fn a_gradient_norm_of_zero_for_several_steps_in_a_row_is_said_once() {
        let mut z = ZeroGradients::default();
        let said: Vec<Option<String>> =
            [0.0, 0.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0].iter().enumerate().map(|(i, g)| z.observe(i + 1, *g)).collect();
        let at: Vec<usize> = said.iter().enumerate().filter(|(_, w)| w.is_some()).map(|(i, _)| i + 1).collect();
        assert_eq!(at, vec![6]);
        let w = said[5].as_deref().unwrap();
        assert!(w.starts_with("steps 4-6: the gradient norm is 0 for 3 steps in a row"), "{w}");
    }

    /// A run's length: its epochs (or train.max_steps), counted from its state; after a resume on other data
    /// restarted an epoch, the remaining epochs are the new data's.
    #[test]
    fn the_step_plan_counts_the_remaining_epochs_from_the_state() {
        let mut cfg = TrainConfig::parse(
            "[model]\npath = \"m\"\n[data]\ninputs = [\"x.jsonl\"]\n[train]\nbatch_questions = 2\nepochs = 2\n",
            Path::new("c.toml"),
            &[],
        )
        .unwrap();
        let at = |step, epoch, batch_in_epoch| TrainerState { step, epoch, batch_in_epoch, ..Default::default() };
        let plan = |cfg: &TrainConfig, n, s: &TrainerState| {
            let p = StepPlan::new(cfg, n, s);
            (p.steps_per_epoch, p.total_steps)
        };
        assert_eq!(plan(&cfg, 10, &at(0, 0, 0)), (5, 10));
        assert_eq!(plan(&cfg, 10, &at(7, 1, 2)), (5, 10), "a state on the same data changes nothing");
        // 4 steps into epoch 0, resumed on 6 groups with epoch 0 restarted: 4 + 2 epochs of 3 steps.
        assert_eq!(plan(&cfg, 6, &at(4, 0, 0)), (3, 10));
        assert_eq!(plan(&cfg, 6, &at(8, 1, 1)), (3, 10), "and so on its later resumes");
        cfg.train.max_steps = 8;
        assert_eq!(plan(&cfg, 6, &at(4, 0, 0)), (3, 8));
        cfg.train.epochs = 0;
        assert_eq!(plan(&cfg, 6, &at(4, 3, 0)), (3, 8));
    }

    /// A run's config on the bundled data, prepared into `prepared` with answers cut to `max_response` tokens.
    fn config(prepared: &Path, max_response: usize) -> TrainConfig {
        let data = root().join("data/trajectories/ot3_math_x8_dev.jsonl");
        let text = format!(
            "[model]\npath = \"m\"\n[data]\ninputs = [\"{}\"]\nmax_response_tokens = {max_response}\nprepared_dir = \"{}\"\n",
            data.display(),
            prepared.display()
        );
        TrainConfig::parse(&text, Path::new("c.toml"), &[]).unwrap()
    }

    /// The version `CURRENT` names in `prepared`.
    fn current(prepared: &Path) -> PathBuf {
        prepared.join(std::fs::read_to_string(prepared.join(data::versions::CURRENT)).unwrap().trim())
    }

    /// Wait until `prepared` has a current version that a reader holds; that version.
    fn wait_for_reader(prepared: &Path) -> PathBuf {
        let t = Instant::now();
        loop {
            if prepared.join(data::versions::CURRENT).exists() {
                let v = current(prepared);
                let readers =
                    std::fs::File::options().read(true).write(true).open(v.join(data::versions::READERS_LOCK));
                if readers.is_ok_and(|f| matches!(f.try_lock(), Err(std::fs::TryLockError::WouldBlock))) {
                    return v;
                }
            }
            assert!(t.elapsed().as_secs() < 300, "rank 0 never read a prepared version");
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }

    /// A tracing layer that calls `hook` at the first event whose message `when` accepts (on the threads
    /// whose subscriber it is part of).
    struct OnEvent<F> {
        when: fn(&str) -> bool,
        hook: Mutex<Option<F>>,
    }

    impl<S: tracing::Subscriber, F: FnOnce() + Send + 'static> tracing_subscriber::Layer<S> for OnEvent<F> {
        fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
            struct Message(String);
            impl tracing::field::Visit for Message {
                fn record_debug(&mut self, f: &tracing::field::Field, v: &dyn std::fmt::Debug) {
                    if f.name() == "message" {
                        self.0 = format!("{v:?}");
                    }
                }
            }
            let mut m = Message(String::new());
            event.record(&mut m);
            if (self.when)(&m.0) {
                if let Some(hook) = self.hook.lock().unwrap().take() {
                    hook();
                }
            }
        }
    }

    /// Two ranks of a run on one prepared folder: rank 0 prepares it; rank 1 finds that version up to date,
    /// and just then (before it opens the data) another run's preparation, with other options, makes its own
    /// version current. Rank 1 still reads rank 0's version.
    #[test]
    fn every_rank_reads_the_version_rank_0_prepared_whatever_current_names_by_then() {
        let dir = tempfile::tempdir().unwrap();
        let prepared = dir.path().join("prepared");
        let model = root().join("data/tokenizers/smollm2");
        let mut ranks = crate::dist::threads::ranks(2).into_iter();
        let (r0, r1) = (ranks.next().unwrap(), ranks.next().unwrap());
        let (cfg, m) = (config(&prepared, 16), model.clone());
        let zero = std::thread::spawn(move || prepare_data(&cfg, &m, &AtomicBool::new(false), &r0.world()).unwrap());
        // Rank 1 starts once rank 0's version is current and read.
        let chosen = wait_for_reader(&prepared);
        let (cfg, m) = (config(&prepared, 16), model.clone());
        let (other, m2) = (config(&prepared, 24), model);
        let one = std::thread::spawn(move || {
            let other_run = move || drop(prepare_data(&other, &m2, &AtomicBool::new(false), &World::single()).unwrap());
            let layer = OnEvent {
                when: |m: &str| m.starts_with("data in ") && m.ends_with(" is up to date"),
                hook: Mutex::new(Some(other_run)),
            };
            let subscriber = tracing_subscriber::registry().with(layer);
            tracing::subscriber::with_default(subscriber, || {
                prepare_data(&cfg, &m, &AtomicBool::new(false), &r1.world()).unwrap()
            })
        });
        let (d1, d0) = (one.join().unwrap(), zero.join().unwrap());
        assert_ne!(current(&prepared), chosen, "the other run's preparation did not make its version current");
        assert_eq!(d0.dir(), chosen);
        assert_eq!(d1.dir(), chosen, "rank 1 read another version than rank 0's");
        assert_eq!(d1.fingerprint(), d0.fingerprint());
    }
}
