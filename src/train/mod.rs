//! The off-policy GRPO trainer: `grpo train --config FILE`.
//!
//! A step takes N questions with their G teacher answers, computes group-relative advantages (with the
//! all-positive bias), accumulates the objective's gradient over micro-batches, clips the global norm
//! and applies AdamW (or SGD) with f32 master weights. Data order is a pure function of (seed, epoch),
//! and checkpoints hold the model (HF format), the optimiser state and the data position, so a resumed
//! run continues exactly where it stopped.

pub mod config;
pub mod optim;
pub mod step;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::{Deserialize, Serialize};

pub use config::TrainConfig;
use optim::{grad_norm, Optimizer};

use crate::data::{self, PreparedDataset};
use crate::model::checkpoint::SaveOptions;
use crate::model::{self, save_checkpoint, ChatTokenizer, Decoder, ModelError};

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
            let shape = model::tiny::TinyShape {
                layers: spec.layers,
                hidden: spec.hidden,
                heads: spec.heads,
                kv_heads: spec.kv_heads,
                intermediate: spec.intermediate,
            };
            model::tiny::write_tiny_model(spec.arch, &spec.tokenizer, p, &shape, spec.seed)?;
        }
    }
    Ok(model::resolve_model_dir(&cfg.model.path)?)
}

fn checkpoints_dir(cfg: &TrainConfig) -> PathBuf {
    cfg.train.output_dir.join("checkpoints")
}

/// The checkpoint named by OUTPUT/checkpoints/latest.
pub fn latest_checkpoint(output_dir: &Path) -> Option<PathBuf> {
    let dir = output_dir.join("checkpoints");
    let name = std::fs::read_to_string(dir.join("latest")).ok()?;
    let p = dir.join(name.trim());
    p.join("trainer_state.json").exists().then_some(p)
}

fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), TrainError> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes).map_err(io(&tmp))?;
    std::fs::rename(&tmp, path).map_err(io(path))
}

struct Run<'a> {
    cfg: &'a TrainConfig,
    model_dir: PathBuf,
    policy: Decoder,
    reference: Option<Decoder>,
    optimizer: Optimizer,
    tok: ChatTokenizer,
    save_dtype: Option<DType>,
}

impl Run<'_> {
    fn save(&self, state: &TrainerState) -> Result<PathBuf, TrainError> {
        let dir = checkpoints_dir(self.cfg);
        let name = format!("step-{:08}", state.step);
        let path = dir.join(&name);
        let opts =
            SaveOptions { dtype: self.save_dtype, tokenizer_dir: Some(self.model_dir.clone()), ..Default::default() };
        save_checkpoint(&self.policy, &path, &opts, |tmp| {
            let tensors: Vec<(String, Tensor)> = self
                .optimizer
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
        })?;
        write_atomic(&dir.join("latest"), name.as_bytes())?;
        // Keep the newest `keep_last` checkpoints.
        let mut steps: Vec<PathBuf> = std::fs::read_dir(&dir)
            .map_err(io(&dir))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.is_dir() && p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("step-")))
            .collect();
        steps.sort();
        let keep = self.cfg.train.keep_last.max(1);
        if steps.len() > keep {
            for old in &steps[..steps.len() - keep] {
                std::fs::remove_dir_all(old).map_err(io(old))?;
            }
        }
        Ok(path)
    }

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
}

/// Run (or resume) the training described by `cfg`. `stop` is set by Ctrl-C: the run writes a checkpoint
/// after the current step and returns with `interrupted = true`.
pub fn train(cfg: &TrainConfig, resume: Resume, stop: &AtomicBool) -> Result<Outcome, TrainError> {
    cfg.validate()?;
    let out = &cfg.train.output_dir;
    std::fs::create_dir_all(out).map_err(io(out))?;
    write_atomic(&out.join("config.toml"), cfg.to_toml().as_bytes())?;

    let model_dir = ensure_model(cfg)?;
    let device = model::parse_device(&cfg.model.device)?;
    let dtype = model::parse_dtype(&cfg.model.dtype)?;
    let save_dtype = cfg.train.save_dtype.as_deref().map(model::parse_dtype).transpose()?;

    // Data: prepared once, re-used while inputs, tokenizer and options are unchanged.
    let prepared_dir = cfg.data.prepared_dir.clone().unwrap_or_else(|| out.join("prepared"));
    let popts = data::PrepareOptions {
        inputs: cfg.data.inputs.clone(),
        model: model_dir.clone(),
        out: prepared_dir.clone(),
        group: data::GroupOptions {
            group_size: cfg.data.group_size,
            min_group_size: cfg.data.min_group_size,
            seed: cfg.train.seed,
            domains: cfg.data.domains.clone(),
            sources: cfg.data.sources.clone(),
            extract: Default::default(),
        },
        max_prompt_tokens: cfg.data.max_prompt_tokens,
        max_response_tokens: cfg.data.max_response_tokens,
        overlong: cfg.data.overlong,
        system_prompt: cfg.data.system_prompt.clone(),
        strict: cfg.data.strict,
        ..Default::default()
    };
    let outcome = data::prepare(&popts)?;
    if outcome.skipped {
        tracing::info!("data in {} is up to date", prepared_dir.display());
    }
    let dataset = PreparedDataset::open(&prepared_dir)?;
    if dataset.is_empty() {
        return Err(TrainError::Stopped(format!("no training groups in {}", prepared_dir.display())));
    }

    // Resume point.
    let resume_from = match &resume {
        Resume::No => None,
        Resume::Auto => latest_checkpoint(out),
        Resume::From(p) => {
            if !p.join("trainer_state.json").exists() {
                return Err(TrainError::Stopped(format!(
                    "{} is not a grpo checkpoint (no trainer_state.json)",
                    p.display()
                )));
            }
            Some(p.clone())
        }
    };
    if resume_from.is_none() && latest_checkpoint(out).is_some() {
        tracing::warn!(
            "{} already has checkpoints; starting a new run from step 0 (use --resume auto to continue it)",
            out.display()
        );
    }
    let policy_dir = resume_from.clone().unwrap_or_else(|| model_dir.clone());
    let mut policy = model::load_decoder(&policy_dir, dtype, &device, true)?;
    policy.options.checkpoint_layers = cfg.model.checkpoint_layers;
    policy.options.logprob_chunk_bytes = cfg.model.logprob_chunk_mb.max(1) << 20;
    policy.options.fused_ops = cfg.model.fused_ops;
    let objective = cfg.objective.build();
    let reference = if objective.beta() > 0.0 {
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
    let names = policy.names().to_vec();
    let vars: Vec<&candle_core::Var> = policy.vars();
    let optimizer = Optimizer::new(cfg.optim.clone(), &names, &vars)?;
    let tok = ChatTokenizer::load(&model_dir).map_err(ModelError::from)?;
    let mut run = Run { cfg, model_dir, policy, reference, optimizer, tok, save_dtype };
    let mut state = TrainerState::default();
    if let Some(ck) = &resume_from {
        let s = ck.join("trainer_state.json");
        state = serde_json::from_slice(&std::fs::read(&s).map_err(io(&s))?)
            .map_err(|e| TrainError::Stopped(format!("{}: {e}", s.display())))?;
        let opt_path = ck.join("optimizer.safetensors");
        let st = candle_core::safetensors::load(&opt_path, &Device::Cpu)?;
        run.optimizer.load_state(|n| st.get(n).cloned(), state.step as u64)?;
        tracing::info!(
            "resumed from {} at step {} (epoch {}, batch {})",
            ck.display(),
            state.step,
            state.epoch,
            state.batch_in_epoch
        );
    }

    // metrics.jsonl: keep what the resumed checkpoint had seen.
    let metrics_path = out.join("metrics.jsonl");
    let kept: Vec<String> = std::fs::read_to_string(&metrics_path)
        .unwrap_or_default()
        .lines()
        .filter(|l| {
            resume_from.is_some()
                && serde_json::from_str::<serde_json::Value>(l)
                    .ok()
                    .and_then(|v| v.get("step").and_then(|s| s.as_u64()))
                    .is_some_and(|s| (s as usize) <= state.step)
        })
        .map(str::to_string)
        .collect();
    write_atomic(&metrics_path, kept.iter().map(|l| format!("{l}\n")).collect::<String>().as_bytes())?;
    let mut metrics = std::fs::OpenOptions::new().append(true).open(&metrics_path).map_err(io(&metrics_path))?;

    let n_groups = dataset.len();
    let bq = cfg.train.batch_questions;
    let steps_per_epoch = n_groups.div_ceil(bq);
    let mut total_steps = steps_per_epoch * cfg.train.epochs.max(1);
    if cfg.train.max_steps > 0 {
        total_steps = if cfg.train.epochs == 0 { cfg.train.max_steps } else { total_steps.min(cfg.train.max_steps) };
    }
    let epochs = total_steps.div_ceil(steps_per_epoch);
    tracing::info!(
        "{n_groups} groups, {steps_per_epoch} steps per epoch, {total_steps} steps; objective {}",
        objective.name()
    );
    let bar = crate::cli::progress_bar(Some(total_steps as u64), "train");
    bar.set_position(state.step as u64);
    let pad = run.tok.pad_id();
    let norm_len = cfg.data.max_response_tokens;
    let mut bad_in_row = 0usize;
    let mut last_ckpt = resume_from.clone();
    let mut interrupted = false;
    'epochs: while state.step < total_steps && state.epoch < epochs {
        let order = epoch_order(n_groups, cfg.train.seed, state.epoch, cfg.data.shuffle);
        while state.batch_in_epoch < steps_per_epoch && state.step < total_steps {
            let t0 = Instant::now();
            crate::device::reset_peak_memory(run.policy.device())?;
            let idx = &order[state.batch_in_epoch * bq..((state.batch_in_epoch + 1) * bq).min(n_groups)];
            let groups: Vec<data::Group> = idx.iter().map(|&i| dataset.group(i)).collect::<Result<_, _>>()?;
            let batch = step::build_batch(&groups, objective.as_ref(), cfg.objective.loss_agg, norm_len);
            let (grads, stats) = step::compute_gradients(
                &run.policy,
                run.reference.as_ref(),
                objective.as_ref(),
                &batch,
                cfg.train.micro_batch_size,
                pad,
            )?;
            let norm = grad_norm(&grads)?;
            let lr = cfg.optim.lr_at(state.step, total_steps);
            let finite = stats.loss.is_finite() && norm.is_finite();
            if finite {
                let scale = optim::clip_scale(norm, cfg.optim.grad_clip);
                run.optimizer.step(&grads, lr, scale)?;
                bad_in_row = 0;
            } else {
                bad_in_row += 1;
                state.nonfinite_steps += 1;
                tracing::warn!(
                    "step {}: non-finite loss ({}) or gradient norm ({norm}); update skipped",
                    state.step,
                    stats.loss
                );
            }
            state.step += 1;
            state.batch_in_epoch += 1;
            state.total_tokens += stats.tokens as u64;
            let dt = t0.elapsed().as_secs_f64();
            let rt = stats.response_tokens.max(1) as f64;
            let mut line = serde_json::json!({
                "step": state.step,
                "epoch": state.epoch as f64 + state.batch_in_epoch as f64 / steps_per_epoch as f64,
                "loss": stats.loss,
                "pg_loss": stats.pg_loss,
                "kl": stats.kl,
                "grad_norm": norm,
                "learning_rate": lr,
                "reward": batch.reward_mean,
                "reward_std": batch.reward_std,
                "frac_reward_zero_std": batch.frac_reward_zero_std,
                "frac_bias_applied": batch.frac_bias_applied,
                "clip_ratio": stats.clipped_tokens as f64 / rt,
                "entropy": stats.entropy_sum / rt,
                "completions/mean_length": batch.mean_response_length,
                "num_tokens": stats.tokens,
                "total_tokens": state.total_tokens,
                "skipped": !finite,
                "nonfinite_steps": state.nonfinite_steps,
                "step_time": dt,
                "tokens_per_sec": stats.tokens as f64 / dt.max(1e-9),
            });
            // Peak GPU memory of the step (as verl's perf/max_memory_allocated_gb); absent on the CPU.
            if let Some((_, peak)) = crate::device::memory_bytes(run.policy.device())? {
                line["max_memory_allocated_gb"] = (peak as f64 / (1u64 << 30) as f64).into();
            }
            bar.set_position(state.step as u64);
            bar.set_message(format!(
                "loss {:.4} reward {:.3} {:.0} tok/s",
                stats.loss,
                batch.reward_mean,
                stats.tokens as f64 / dt.max(1e-9)
            ));
            if bad_in_row > cfg.train.max_bad_steps {
                bar.abandon();
                let last = latest_checkpoint(out).map(|p| p.display().to_string()).unwrap_or_else(|| "none".into());
                return Err(TrainError::Stopped(format!(
                    "{bad_in_row} steps in a row had a non-finite loss or gradient (train.max_bad_steps = {}); stopping. Last good checkpoint: {last}",
                    cfg.train.max_bad_steps
                )));
            }
            let epoch_end = state.batch_in_epoch >= steps_per_epoch;
            let run_end = state.step >= total_steps;
            let val_now = cfg.validation.as_ref().is_some_and(|v| {
                if v.every_steps > 0 {
                    state.step % v.every_steps == 0
                } else {
                    epoch_end || run_end
                }
            });
            if val_now {
                if let Some(score) = run.validate(state.step)? {
                    line["validation/score"] = score.into();
                    if state.best_score.is_none_or(|b| score > b) {
                        state.best_score = Some(score);
                        state.best_step = Some(state.step);
                        let opts = SaveOptions {
                            dtype: run.save_dtype,
                            tokenizer_dir: Some(run.model_dir.clone()),
                            ..Default::default()
                        };
                        save_checkpoint(&run.policy, &out.join("best"), &opts, |_| Ok(()))?;
                        tracing::info!(
                            "new best validation score {score:.4} at step {}: saved {}",
                            state.step,
                            out.join("best").display()
                        );
                    }
                }
            }
            use std::io::Write;
            writeln!(metrics, "{line}").and_then(|()| metrics.flush()).map_err(io(&metrics_path))?;
            if epoch_end {
                state.epoch += 1;
                state.batch_in_epoch = 0;
            }
            let stop_now = stop.load(Ordering::SeqCst);
            let periodic = cfg.train.save_every > 0 && state.step % cfg.train.save_every == 0;
            if periodic || epoch_end || run_end || stop_now {
                last_ckpt = Some(run.save(&state)?);
            }
            if stop_now {
                interrupted = true;
                bar.abandon_with_message("interrupted: checkpoint written");
                break 'epochs;
            }
            if epoch_end {
                continue 'epochs;
            }
        }
    }
    bar.finish();
    Ok(Outcome { state, checkpoint: last_ckpt, interrupted })
}
