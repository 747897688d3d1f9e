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
pub mod optim;
mod resume;
mod run_dir;
pub mod step;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::{Deserialize, Serialize};

pub use checkpoint::latest_checkpoint;
use checkpoint::Checkpointer;
pub use config::TrainConfig;
use metrics::{MetricsLog, StepMetrics};
pub use resume::RESUMABLE_KEYS;
use step::TrainStep;

use crate::data::{self, PreparedDataset};
use crate::model::{self, ChatTokenizer, Decoder, ModelError};

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
    Candle(#[from] candle_core::Error),
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{0}")]
    Stopped(String),
    #[error("{} is in use by another grpo run ({holder}); wait for it to end, or choose another train.output_dir", dir.display())]
    Busy { dir: PathBuf, holder: String },
    #[error("will not start in {}: {message}", dir.display())]
    OutputHasRun { dir: PathBuf, message: String },
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
}

/// What a run did.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub state: TrainerState,
    /// The last checkpoint written (a HF model folder).
    pub checkpoint: Option<PathBuf>,
    pub interrupted: bool,
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

/// The model folder to start from, creating the tiny model of the config when asked.
fn ensure_model(cfg: &TrainConfig) -> Result<PathBuf, TrainError> {
    let p = Path::new(&cfg.model.path);
    if let Some(spec) = &cfg.model.init_tiny {
        if !p.join("config.json").exists() {
            tracing::info!("creating a tiny {:?} model at {}", spec.arch, p.display());
            model::tiny::write_tiny_model(spec, p)?;
        }
    }
    Ok(model::resolve_model_dir(&cfg.model.path)?)
}

fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), TrainError> {
    crate::fsio::write_atomic(path, bytes).map_err(io(path))
}

/// Prepare the config's data (once: re-used while inputs, tokenizer and options are unchanged) and open it.
fn prepare_data(cfg: &TrainConfig, model_dir: &Path) -> Result<PreparedDataset, TrainError> {
    let prepared_dir = cfg.data.prepared_dir.clone().unwrap_or_else(|| cfg.train.output_dir.join("prepared"));
    let mut input = cfg.data.input.clone();
    input.group.seed = cfg.train.seed;
    let popts = data::PrepareOptions {
        input,
        sequence: cfg.data.sequence.clone(),
        model: model_dir.to_path_buf(),
        out: prepared_dir.clone(),
        ..Default::default()
    };
    let outcome = data::prepare(&popts)?;
    if outcome.skipped {
        tracing::info!("data in {} is up to date", prepared_dir.display());
    }
    let dataset = PreparedDataset::open(&prepared_dir)?;
    // An up-to-date folder's counts are in its stats.json (the message only: unreadable is no error).
    let stats = if outcome.skipped { dataset.stats().ok() } else { Some(outcome.stats) };
    let group = &cfg.data.input.group;
    if dataset.is_empty() {
        return Err(TrainError::Stopped(format!(
            "no training groups in {}: {}",
            prepared_dir.display(),
            stats.map_or("stats.json is unreadable".into(), |s| why_no_groups(&s, group))
        )));
    }
    let Some(stats) = stats else { return Ok(dataset) };
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

/// Why preparation kept no group, from its counts.
fn why_no_groups(s: &data::Stats, group: &data::GroupOptions) -> String {
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
                tracing::info!("no checkpoint in {}: starting at step 0", out.display());
            }
            ck
        }
        Resume::From(p) => {
            checkpoint::check_complete(p)?;
            Some(p.clone())
        }
    };
    from.map(|ck| checkpoint::read_state(&ck).map(|state| (ck, state))).transpose()
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
    fn new(cfg: &TrainConfig, n_groups: usize) -> Self {
        let steps_per_epoch = n_groups.div_ceil(cfg.train.batch_questions);
        let mut total_steps = steps_per_epoch * cfg.train.epochs.max(1);
        if cfg.train.max_steps > 0 {
            total_steps =
                if cfg.train.epochs == 0 { cfg.train.max_steps } else { total_steps.min(cfg.train.max_steps) };
        }
        Self { steps_per_epoch, total_steps, epochs: total_steps.div_ceil(steps_per_epoch) }
    }
}

struct Run<'a> {
    cfg: &'a TrainConfig,
    policy: Decoder,
    reference: Option<Decoder>,
    step: TrainStep,
    tok: ChatTokenizer,
    checkpoints: Checkpointer,
}

impl Run<'_> {
    fn validate(&self, step: usize) -> Result<Option<f64>, TrainError> {
        let Some(v) = &self.cfg.validation else { return Ok(None) };
        let bench = crate::eval::benchmarks::load(&v.bench)?;
        let options = crate::eval::EvalOptions { seed: v.seed.or(Some(self.cfg.train.seed)), ..v.clone() };
        let out = self.cfg.train.output_dir.join("validation");
        std::fs::create_dir_all(&out).map_err(io(&out))?;
        let mut lines = Vec::new();
        let (report, _) = crate::eval::evaluate(
            &self.policy,
            &self.tok,
            &bench,
            &options,
            &Default::default(),
            |r| {
                lines.push(serde_json::to_string(r).unwrap_or_default());
                Ok(())
            },
            |_, _| {},
        )?;
        let p = out.join(format!("step-{step:08}-{}.jsonl", v.bench));
        std::fs::write(&p, lines.join("\n") + "\n").map_err(io(&p))?;
        tracing::info!("validation on {} at step {step}: avg@{} = {:.4}", v.bench, v.n, report.avg_at_n);
        Ok(Some(report.avg_at_n))
    }

    /// Train one batch of `order`, validate when due, and log the step's metrics.
    fn train_batch(
        &mut self,
        dataset: &PreparedDataset,
        order: &[usize],
        state: &mut TrainerState,
        plan: StepPlan,
    ) -> Result<StepMetrics, TrainError> {
        let cfg = self.cfg;
        let t0 = Instant::now();
        crate::device::reset_peak_memory(self.policy.device())?;
        let bq = cfg.train.batch_questions;
        let idx = &order[state.batch_in_epoch * bq..((state.batch_in_epoch + 1) * bq).min(order.len())];
        let groups: Vec<data::Group> = idx.iter().map(|&i| dataset.group(i)).collect::<Result<_, _>>()?;
        let lr = cfg.optim.lr_at(state.step, plan.total_steps);
        let ctx = step::StepContext { seed: cfg.train.seed, epoch: state.epoch, step: state.step };
        let report = self.step.run_at(&self.policy, self.reference.as_ref(), &groups, lr, ctx)?;
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
        m.max_memory_allocated_gb =
            crate::device::memory_bytes(self.policy.device())?.map(|(_, peak)| peak as f64 / (1u64 << 30) as f64);
        Ok(m)
    }

    /// Validate after the step that `state` ends when due; a new best score saves OUTPUT/best.
    fn validate_if_due(
        &self,
        state: &mut TrainerState,
        epoch_end: bool,
        run_end: bool,
    ) -> Result<Option<f64>, TrainError> {
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
        let Some(score) = self.validate(state.step)? else { return Ok(None) };
        if state.best_score.is_none_or(|b| score > b) {
            state.best_score = Some(score);
            state.best_step = Some(state.step);
            let best = self.checkpoints.save_best(&self.policy)?;
            tracing::info!("new best validation score {score:.4} at step {}: saved {}", state.step, best.display());
        }
        Ok(Some(score))
    }

    /// The epochs from `state` on: one step per batch, checkpoints at the configured points, validation.
    fn train_epochs(
        &mut self,
        dataset: &PreparedDataset,
        mut state: TrainerState,
        metrics: &mut MetricsLog,
        mut last_ckpt: Option<PathBuf>,
        stop: &AtomicBool,
    ) -> Result<Outcome, TrainError> {
        let cfg = self.cfg;
        let plan = StepPlan::new(cfg, dataset.len());
        tracing::info!(
            "{} groups, {} steps per epoch, {} steps; objective {}",
            dataset.len(),
            plan.steps_per_epoch,
            plan.total_steps,
            self.step.objective_name()
        );
        let bar = crate::progress::progress_bar(Some(plan.total_steps as u64), "train");
        bar.set_position(state.step as u64);
        let mut bad_in_row = 0usize;
        while state.step < plan.total_steps && state.epoch < plan.epochs {
            let order = epoch_order(dataset.len(), cfg.train.seed, state.epoch, cfg.data.shuffle);
            while state.batch_in_epoch < plan.steps_per_epoch && state.step < plan.total_steps {
                if stop.load(Ordering::SeqCst) {
                    // Asked to stop before this segment's first step: nothing new to save.
                    bar.abandon_with_message("interrupted");
                    return Ok(Outcome { state, checkpoint: last_ckpt, interrupted: true });
                }
                let mut m = self.train_batch(dataset, &order, &mut state, plan)?;
                bad_in_row = if m.skipped { bad_in_row + 1 } else { 0 };
                bar.set_position(state.step as u64);
                bar.set_message(format!("loss {:.4} reward {:.3} {:.0} tok/s", m.loss, m.reward, m.tokens_per_sec));
                if bad_in_row > cfg.train.max_bad_steps {
                    bar.abandon();
                    let last = latest_checkpoint(&cfg.train.output_dir)
                        .map(|p| p.display().to_string())
                        .unwrap_or_else(|| "none".into());
                    return Err(TrainError::Stopped(format!(
                        "{bad_in_row} steps in a row had a non-finite loss or gradient (train.max_bad_steps = {}); stopping. Last good checkpoint: {last}",
                        cfg.train.max_bad_steps
                    )));
                }
                let epoch_end = state.batch_in_epoch >= plan.steps_per_epoch;
                let run_end = state.step >= plan.total_steps;
                m.validation_score = self.validate_if_due(&mut state, epoch_end, run_end)?;
                metrics.write(&m)?;
                if m.validation_score.is_some() {
                    crate::plot::refresh_run_curves(&cfg.train.output_dir);
                }
                if epoch_end {
                    state.epoch += 1;
                    state.batch_in_epoch = 0;
                }
                let stop_now = stop.load(Ordering::SeqCst);
                let periodic = cfg.train.save_every > 0 && state.step.is_multiple_of(cfg.train.save_every);
                if periodic || epoch_end || run_end || stop_now {
                    last_ckpt = Some(self.checkpoints.save(&self.policy, &self.step, &state)?);
                }
                if stop_now {
                    bar.abandon_with_message("interrupted: checkpoint written");
                    return Ok(Outcome { state, checkpoint: last_ckpt, interrupted: true });
                }
            }
        }
        bar.finish();
        Ok(Outcome { state, checkpoint: last_ckpt, interrupted: false })
    }
}

/// Load the policy (from the checkpoint when resuming), the reference when the objective needs one (its
/// KL term, or the reference as its anchor), the tokenizer and the training step.
fn load_run<'a>(cfg: &'a TrainConfig, model_dir: PathBuf, resume_from: Option<&Path>) -> Result<Run<'a>, TrainError> {
    let device = model::parse_device(&cfg.model.device)?;
    let dtype = model::parse_dtype(&cfg.model.dtype)?;
    let save_dtype = cfg.train.save_dtype.as_deref().map(model::parse_dtype).transpose()?;
    let mut policy = model::load_decoder(resume_from.unwrap_or(&model_dir), dtype, &device, true)?;
    policy.options.checkpoint_layers = cfg.model.checkpoint_layers;
    policy.options.logprob_chunk_bytes = cfg.model.logprob_chunk_mb.max(1) << 20;
    policy.options.fused_ops = cfg.model.fused_ops;
    let tok = ChatTokenizer::load(&model_dir).map_err(ModelError::from)?;
    let step = TrainStep::new(
        &cfg.objective,
        &cfg.optim,
        &policy,
        cfg.train.micro_batch_size,
        cfg.data.sequence.max_response_tokens,
        tok.pad_id(),
    )?;
    let reference = if step.needs_reference() {
        let mut r = match &cfg.model.reference {
            Some(p) => model::load_decoder(&model::resolve_model_dir(p)?, dtype, &device, false)?,
            None if resume_from.is_some() => model::load_decoder(&model_dir, dtype, &device, false)?,
            None => policy.frozen_copy()?,
        };
        r.options = policy.options.clone();
        Some(r)
    } else {
        None
    };
    let checkpoints = Checkpointer {
        output_dir: cfg.train.output_dir.clone(),
        model_dir,
        save_dtype,
        keep_last: cfg.train.keep_last,
        config_toml: cfg.to_toml(),
    };
    Ok(Run { cfg, policy, reference, step, tok, checkpoints })
}

/// Run (or resume) the training described by `cfg`. The output folder is locked for the run; a new run
/// refuses a folder that holds another run's checkpoints unless `opts.overwrite`; a resume checks the
/// checkpoint's model, tokenizer and training config first. `stop` is set by Ctrl-C or SIGTERM: the run
/// writes a checkpoint after the current step and returns with `interrupted = true`.
pub fn train(cfg: &TrainConfig, opts: &RunOptions, stop: &AtomicBool) -> Result<Outcome, TrainError> {
    cfg.validate()?;
    let out = &cfg.train.output_dir;
    std::fs::create_dir_all(out).map_err(io(out))?;
    let _lock = run_dir::lock(out)?;
    run_dir::clean_leftovers(out)?;
    let resumed = resume_point(out, &opts.resume)?;
    run_dir::claim(out, resumed.as_ref().map(|(_, s)| s.run_id.as_str()), opts.overwrite)?;
    if let Some((ck, _)) = &resumed {
        resume::check_config(ck, cfg, opts.allow_config_change)?;
    }
    let model_dir = ensure_model(cfg)?;
    if let Some((ck, _)) = &resumed {
        resume::check_model(ck, &model_dir)?;
    }
    write_config(cfg, resumed.as_ref().map(|(_, s)| s.step))?;
    let dataset = prepare_data(cfg, &model_dir)?;
    let mut run = load_run(cfg, model_dir, resumed.as_ref().map(|(ck, _)| ck.as_path()))?;
    let (resume_from, state) = match resumed {
        Some((ck, state)) => {
            checkpoint::restore(&ck, &state, &run.policy, &mut run.step)?;
            (Some(ck), state)
        }
        None => (None, TrainerState { run_id: new_run_id(), ..Default::default() }),
    };
    let mut metrics = MetricsLog::open(out, resume_from.is_some().then_some(state.step))?;
    let outcome = run.train_epochs(&dataset, state, &mut metrics, resume_from, stop)?;
    crate::plot::refresh_run_curves(out);
    Ok(outcome)
}
