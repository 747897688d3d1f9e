//! On-policy and lagged rollouts in the training loop (`[rollout]`).
//!
//! Each step takes the batch's questions, samples `n - teacher_answers` answers per question from the
//! sampling policy with the KV-cache sampler, scores them with the reward module (against the question's
//! label, or by majority vote over the group without one), records the log-prob of every sampled token
//! under the sampling weights (f32, a forward of those weights, not the sampler's temperature-scaled
//! logits), and makes `updates_per_batch` optimiser updates on these groups.
//!
//! The behaviour log-probs travel as each answer's `teacher_logprobs`: for the objectives whose anchor
//! is `teacher` (alias `behaviour`: the policy that wrote each answer) the ratio is
//! pi_theta / pi_sampling on sampled answers and pi_theta / pi_teacher on mixed-in teacher answers
//! (probability 1 where the data has no teacher log-probs), as LUFFY mixes them.
//!
//! The sampling policy is the trained policy itself (`sync_every = 1`) or a frozen copy refreshed at
//! every multiple of `sync_every` steps. Sampling streams are a pure function of (train.seed, step,
//! question index, answer index), so a resumed run regenerates a step's rollouts exactly once the sampling
//! copy is restored (checkpoints hold it when it is not the checkpoint's own weights).
//!
//! With `[rollout.server] engine = "openai"` the answers come from an OpenAI-compatible server (see
//! [`server`]), told to load the sampling weights at each refresh; the scoring and the behaviour forward
//! are the same.

mod options;
mod questions;
mod sample;
mod server;

pub use options::RolloutOptions;
pub use questions::{load_questions, GroupSource};
pub use sample::{behaviour_logprobs, sample_groups, RolloutMetrics};
pub use server::Reload;

use std::path::PathBuf;
use std::time::Instant;

use crate::data::Group;
use crate::model::checkpoint::SaveOptions;
use crate::model::{save_checkpoint, ChatTokenizer, Decoder, ModelError};
use crate::train::step::{StepContext, StepReport, TrainStep};

/// Errors of sampling and scoring rollouts.
#[derive(Debug, thiserror::Error)]
pub enum RolloutError {
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[error(transparent)]
    Tokenizer(#[from] crate::model::tokenizer::TokenizerError),
    #[error(transparent)]
    Questions(#[from] crate::eval::EvalError),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("{0}")]
    Invalid(String),
}

/// The rollout side of a run: its options, the tokenizer that decodes answers for scoring, and the
/// sampling policy's copy when it lags.
pub struct Rollouts {
    options: RolloutOptions,
    tok: ChatTokenizer,
    seed: u64,
    /// Sequences per behaviour forward.
    micro: usize,
    /// The policy at step floor(step / sync_every) * sync_every (sync_every > 1 only).
    sampler: Option<Decoder>,
    /// openai engine with a reload: where the sampling weights are saved for the server, and how.
    serving: Option<(PathBuf, SaveOptions)>,
    /// Whether the server was told to load the current sampling weights.
    server_synced: bool,
}

impl Rollouts {
    /// Rollouts of a run seeded `seed` with the policy's tokenizer `tok`, `micro` sequences per behaviour
    /// forward.
    pub fn new(options: RolloutOptions, tok: ChatTokenizer, seed: u64, micro: usize) -> Self {
        Self { options, tok, seed, micro: micro.max(1), sampler: None, serving: None, server_synced: false }
    }

    /// Save the sampling weights to `dir` (with `save`) for the server to reload at each refresh; used
    /// only with an openai engine whose reload is not `none`.
    pub fn serve_weights_from(&mut self, dir: PathBuf, save: SaveOptions) {
        self.serving = Some((dir, save));
    }

    pub fn options(&self) -> &RolloutOptions {
        &self.options
    }

    /// Whether a checkpoint written after `step` steps must hold the sampling copy: it lags and was not
    /// taken at that step.
    pub fn stores_sampler(&self, step: usize) -> bool {
        let every = self.options.refresh_every();
        every > 1 && !step.is_multiple_of(every)
    }

    /// The lagged sampling copy, once taken.
    pub fn sampler(&self) -> Option<&Decoder> {
        self.sampler.as_ref()
    }

    /// Restore the sampling copy of a resumed run.
    pub fn set_sampler(&mut self, sampler: Decoder) {
        self.sampler = Some(sampler);
        self.server_synced = false;
    }

    /// Step `ctx.step`: refresh the sampling copy when due, sample and score the rollouts of `questions`,
    /// and make `updates_per_batch` updates of `policy` on them. Returns the updates' combined report and
    /// the rollouts' metrics.
    pub fn step(
        &mut self,
        policy: &Decoder,
        reference: Option<&Decoder>,
        train: &mut TrainStep,
        questions: &[Group],
        lr: f64,
        ctx: StepContext,
    ) -> Result<(StepReport, RolloutMetrics), RolloutError> {
        let (groups, mut metrics) = self.sample(policy, questions, ctx.step)?;
        let reports = self.train_on(train, policy, reference, &groups, lr, ctx)?;
        metrics.updates = reports.len();
        Ok((combine(reports), metrics))
    }

    /// The rollouts of step `step` from the sampling policy (refreshed first when due).
    fn sample(
        &mut self,
        policy: &Decoder,
        questions: &[Group],
        step: usize,
    ) -> Result<(Vec<Group>, RolloutMetrics), RolloutError> {
        let every = self.options.refresh_every();
        if every > 1 {
            if step.is_multiple_of(every) {
                self.sampler = None; // free the old copy first
                let mut copy = policy.frozen_copy()?;
                copy.options = policy.options.clone();
                self.sampler = Some(copy);
                self.server_synced = false;
            } else if self.sampler.is_none() {
                return Err(RolloutError::Invalid(format!(
                    "no sampling policy at step {step} (refreshed every rollout.sync_every = {every} steps)"
                )));
            }
        } else {
            self.server_synced = false; // on-policy: the weights changed since the last step
        }
        let sampler = self.sampler.as_ref().unwrap_or(policy);
        let params = self.options.sampling(self.seed, step);
        if !self.options.uses_server() {
            return sample_groups(sampler, &self.tok, questions, &self.options, &params, self.micro);
        }
        if !self.server_synced {
            if let Some((dir, save)) = &self.serving {
                sync_server(&self.options, sampler, dir, save)?;
            }
            self.server_synced = true;
        }
        let start = Instant::now();
        let bar = crate::progress::progress_bar(None, "rollout");
        bar.set_message("tokens generated (server)");
        let counts = (self.options.sampled(), self.options.n);
        let (samples, cut) = server::server_samples(&self.options.server, &self.tok, questions, counts, &params, &bar)?;
        bar.finish_and_clear();
        let (groups, mut metrics) =
            sample::score_groups(sampler, &self.tok, questions, &self.options, samples, self.micro, start)?;
        metrics.server_cut = cut;
        Ok((groups, metrics))
    }

    /// `updates_per_batch` updates of `policy` on the same groups and behaviour log-probs.
    fn train_on(
        &self,
        train: &mut TrainStep,
        policy: &Decoder,
        reference: Option<&Decoder>,
        groups: &[Group],
        lr: f64,
        ctx: StepContext,
    ) -> candle_core::Result<Vec<StepReport>> {
        (0..self.options.updates_per_batch).map(|_| train.run_at(policy, reference, groups, lr, ctx)).collect()
    }
}

/// Save `sampler` to `dir` and tell the server to load it.
fn sync_server(
    options: &RolloutOptions,
    sampler: &Decoder,
    dir: &std::path::Path,
    save: &SaveOptions,
) -> Result<(), RolloutError> {
    let base = options.server.base_url.as_deref().unwrap_or_default();
    let Some(req) = server::reload_request(options.reload, base, dir) else { return Ok(()) };
    save_checkpoint(sampler, dir, save, |_| Ok(()))?;
    tracing::info!("rollout server: loading {} ({})", dir.display(), req.url);
    server::send_reload(&req, &options.server)
}

/// One report for several updates on the same groups: loss terms and the gradient norm averaged, token
/// and clip counts summed (so the clip fraction is over every update's tokens), ratio extremes over all,
/// applied only when every update was.
fn combine(reports: Vec<StepReport>) -> StepReport {
    let k = reports.len().max(1) as f64;
    let mut it = reports.into_iter();
    let Some(mut out) = it.next() else { return StepReport::default() };
    for r in it {
        out.stats.merge(&r.stats);
        out.grad_norm += r.grad_norm;
        out.applied &= r.applied;
    }
    out.stats.loss /= k;
    out.stats.pg_loss /= k;
    out.stats.kl /= k;
    out.grad_norm /= k;
    out
}

#[cfg(test)]
mod tests;
