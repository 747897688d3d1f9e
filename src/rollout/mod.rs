//! On-policy and lagged rollouts in the training loop (`[rollout]`).
//!
//! Each step takes the batch's questions, samples `n - teacher_answers` answers per question from the
//! sampling policy with the KV-cache sampler, scores them with the reward module (against the question's
//! label, or by majority vote over the group without one), records the log-prob of every sampled token
//! under the sampling weights (f32, a forward of those weights, not the sampler's temperature-scaled
//! logits); the training loop then makes `updates_per_batch` optimiser updates on these groups.
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
//! With `filter_groups` (DAPO's dynamic sampling) the groups whose rewards all agree are dropped and more
//! questions are sampled, batch after batch, until the step has as many groups as questions it was given
//! or `max_num_gen_batches` batches were sampled (see [`fill_batch`]). The refill questions come from
//! the caller (the trainer draws them at random from the run's questions, seeded by the step and the
//! batch), and each batch samples from its own streams.
//!
//! With `[rollout.server] engine = "openai"` the answers come from an OpenAI-compatible server (see
//! [`server`]), told to load the sampling weights at each refresh; the scoring and the behaviour forward
//! are the same.
//!
//! With `importance_sampling_correction` the sampler's own log-prob of each token (the server's, or the
//! KV-cache sampler's) is compared with the behaviour forward's, and each sampled token's policy loss
//! is weighted by the truncated or masked ratio (TIS / MIS, see [`correction`]).

mod ahead;
mod correction;
mod options;
mod questions;
mod remote;
mod sample;
mod server;
mod share;

pub use correction::IsMode;
pub use options::RolloutOptions;
pub use questions::{load_questions, GroupSource};
pub use remote::{serve_generation, stop_generation, OverlapMetrics};
pub use sample::{behaviour_logprobs, sample_groups, RolloutMetrics};
pub use server::Reload;

use std::path::PathBuf;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Instant;

use crate::data::Group;
use crate::dist::World;
use crate::model::checkpoint::SaveOptions;
use crate::model::{save_checkpoint, ChatTokenizer, Decoder, ModelError};

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
    #[error("rollout generation: {0}")]
    Generation(String),
}

impl From<crate::generate::GenerateError> for RolloutError {
    fn from(e: crate::generate::GenerateError) -> Self {
        match e {
            crate::generate::GenerateError::Candle(e) => RolloutError::Candle(e),
            crate::generate::GenerateError::Options(m) => RolloutError::Generation(m),
        }
    }
}

/// The rollout side of a run: its options, the tokenizer that decodes answers for scoring, and the
/// sampling policy's copy when it lags.
pub struct Rollouts {
    options: RolloutOptions,
    tok: Arc<ChatTokenizer>,
    seed: u64,
    /// Sequences per behaviour forward.
    micro: usize,
    /// The policy at step floor(step / sync_every) * sync_every (sync_every > 1 only).
    sampler: Option<Decoder>,
    /// openai engine with a reload: where the sampling weights are saved for the server, and how.
    serving: Option<(PathBuf, SaveOptions)>,
    /// Whether the server was told to load the current sampling weights.
    server_synced: bool,
    /// The ranks that share each batch's questions (see [`share`]).
    world: Rc<World>,
    /// rollout.generation_ranks: the trainers' end of the ranks that generate (see [`remote`]).
    remote: Option<remote::Remote>,
    /// A server with rollout.max_staleness >= 1: the requests in flight (see [`ahead`]).
    ahead: ahead::Ahead,
    /// The run's steps: no step at or past it is asked for ahead of time.
    total_steps: usize,
}

impl Rollouts {
    /// Rollouts of a run seeded `seed` with the policy's tokenizer `tok`, `micro` sequences per behaviour
    /// forward.
    pub fn new(options: RolloutOptions, tok: ChatTokenizer, seed: u64, micro: usize) -> Self {
        let world = Rc::new(World::single());
        Self {
            options,
            tok: Arc::new(tok),
            seed,
            micro: micro.max(1),
            sampler: None,
            serving: None,
            server_synced: false,
            world,
            remote: None,
            ahead: ahead::Ahead::default(),
            total_steps: usize::MAX,
        }
    }

    /// The run has `total_steps` steps: what is asked for ahead of time (rollout.max_staleness) stops there.
    pub fn run_for(&mut self, total_steps: usize) {
        self.total_steps = total_steps;
    }

    /// Take the answers from the generation ranks of `job` (split into trainers and generators by
    /// `roles`) for the run's steps ([`Rollouts::run_for`]) of the model in `model_dir`, which they are told
    /// to load.
    pub fn generate_on(
        &mut self,
        job: Rc<World>,
        roles: crate::dist::Roles,
        model_dir: &std::path::Path,
    ) -> Result<(), RolloutError> {
        let remote = remote::Remote::new(job, roles, &self.options, self.total_steps);
        remote.announce(model_dir)?;
        self.remote = Some(remote);
        Ok(())
    }

    /// The end of the run's steps (or of this segment of them): the generation ranks' answers still in
    /// flight taken in, and the ranks told to stop.
    pub fn finish(&mut self) -> Result<(), RolloutError> {
        match &mut self.remote {
            Some(r) => r.finish(),
            None => Ok(()),
        }
    }

    /// Sample as one rank of `world`: this rank's share of each batch's questions, from its own server
    /// (the `world.rank() mod k`-th of rollout.server.base_url's k servers), the answers then gathered.
    pub fn share_with(&mut self, world: Rc<World>) {
        self.world = world;
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

    /// Step `step`'s rollouts to train on: the sampling copy refreshed when due, the answers to
    /// `questions` sampled and scored (with `filter_groups`, refilled from `more(k)`, the k-th batch of new
    /// questions). With generation ranks or a server asked ahead of time (rollout.max_staleness) the answers
    /// come from them, `ahead(s)` giving the questions of step s. Returns the groups and their metrics; the
    /// caller makes the step's updates, then calls [`Rollouts::updated`].
    pub fn answers(
        &mut self,
        policy: &Decoder,
        questions: &[Group],
        more: &mut dyn FnMut(usize) -> Result<Vec<Group>, RolloutError>,
        ahead: &mut dyn FnMut(usize) -> Result<Vec<Group>, RolloutError>,
        step: usize,
    ) -> Result<(Vec<Group>, RolloutMetrics), RolloutError> {
        if let Some(mut remote) = self.remote.take() {
            let out = self.answers_remote(&mut remote, policy, ahead, step);
            self.remote = Some(remote);
            return out;
        }
        if self.asks_ahead() {
            return self.answers_ahead(policy, questions, ahead, step);
        }
        if self.options.filter_groups {
            self.refresh(policy, step)?;
            let max = self.options.max_num_gen_batches;
            fill_batch(questions.len(), max, |k| {
                let batch = if k == 0 { questions.to_vec() } else { more(k)? };
                self.draw(policy, &batch, step, k)
            })
        } else {
            self.sample(policy, questions, step)
        }
    }

    /// After step `step`'s updates of `policy` on its [`Rollouts::answers`], which took `train_time`
    /// seconds: with generation ranks the new weights and the next questions sent, with a server asked
    /// ahead of time its weights reloaded when the sampling policy refreshes and the next step asked for.
    /// `metrics` are the step's rollout metrics, whose overlap times this completes.
    pub fn updated(
        &mut self,
        policy: &Decoder,
        step: usize,
        ahead: &mut dyn FnMut(usize) -> Result<Vec<Group>, RolloutError>,
        train_time: f64,
        metrics: &mut RolloutMetrics,
    ) -> Result<(), RolloutError> {
        if let Some(overlap) = metrics.overlap.as_mut() {
            overlap.train_time = train_time;
        }
        let version = step + 1;
        if let Some(mut remote) = self.remote.take() {
            let refreshed = version.is_multiple_of(self.options.refresh_every()).then_some(policy);
            let out = remote.updated(version, refreshed, ahead);
            self.remote = Some(remote);
            return out;
        }
        if !self.asks_ahead() {
            return Ok(());
        }
        let (t, next) = (Instant::now(), version + self.options.max_staleness);
        if next < self.total_steps && next >= self.ahead.next {
            self.refresh(policy, version)?;
            if !self.server_synced {
                self.sync_server(policy)?;
                self.ahead.version = version;
            }
            self.ask(next, ahead(next)?);
        }
        if let Some(overlap) = metrics.overlap.as_mut() {
            overlap.weight_sync_time += t.elapsed().as_secs_f64();
        }
        Ok(())
    }

    /// Whether a server's requests run ahead of the steps (rollout.max_staleness >= 1).
    fn asks_ahead(&self) -> bool {
        self.remote.is_none() && self.options.uses_server() && self.options.max_staleness > 0
    }

    /// [`Rollouts::answers`] from the generation ranks: this step's taken, waiting for them when they are
    /// not in yet.
    fn answers_remote(
        &mut self,
        remote: &mut remote::Remote,
        policy: &Decoder,
        ahead: &mut dyn FnMut(usize) -> Result<Vec<Group>, RolloutError>,
        step: usize,
    ) -> Result<(Vec<Group>, RolloutMetrics), RolloutError> {
        self.refresh(policy, step)?;
        let sampler = self.sampler.as_ref().unwrap_or(policy);
        let (groups, mut metrics, overlap) = remote.take(step, sampler, ahead)?;
        metrics.overlap = Some(overlap);
        Ok((groups, metrics))
    }

    /// [`Rollouts::answers`] with the server's requests of the next rollout.max_staleness steps in flight
    /// (see [`ahead`]): the first step sends the weights and asks for its own and the next steps' answers;
    /// this step's are taken (waiting for them when they are not in yet) and scored.
    fn answers_ahead(
        &mut self,
        policy: &Decoder,
        questions: &[Group],
        ahead: &mut dyn FnMut(usize) -> Result<Vec<Group>, RolloutError>,
        step: usize,
    ) -> Result<(Vec<Group>, RolloutMetrics), RolloutError> {
        let k = self.options.max_staleness;
        let mut sync_time = 0.0;
        if !self.ahead.started {
            let t = Instant::now();
            self.ahead.started = true;
            self.ahead.next = step;
            self.refresh(policy, step)?;
            self.sync_server(policy)?;
            let every = self.options.refresh_every();
            self.ahead.version = if every > 1 { step - step % every } else { step };
            sync_time = t.elapsed().as_secs_f64();
            for s in step..=(step + k).min(self.total_steps.saturating_sub(1)) {
                let qs = if s == step { questions.to_vec() } else { ahead(s)? };
                self.ask(s, qs);
            }
        }
        let (groups, mut metrics, mut overlap) = self.take_ahead(policy, step)?;
        overlap.weight_sync_time = sync_time;
        metrics.overlap = Some(overlap);
        Ok((groups, metrics))
    }

    /// Ask this rank's server for step `step`'s answers to this rank's share of `questions` (see [`ahead`]).
    fn ask(&mut self, step: usize, questions: Vec<Group>) {
        let mine = Arc::new(share::mine(&self.world, &questions).into_owned());
        let server = self.options.server.for_rank(self.world.rank());
        let counts = (self.options.sampled(), self.options.n, self.options.importance_sampling_correction);
        let params = self.options.sampling(self.seed, step);
        self.ahead.ask(server, self.tok.clone(), step, mine, questions, counts, params);
    }

    /// Step `step`'s answers from the server, waited for in rounds with the other ranks, scored with the
    /// step's sampling policy, gathered from every rank, and those older than the staleness bound dropped.
    fn take_ahead(
        &mut self,
        policy: &Decoder,
        step: usize,
    ) -> Result<(Vec<Group>, RolloutMetrics, OverlapMetrics), RolloutError> {
        let waited = Instant::now();
        let mut apart = crate::dist::Apart::begin(&self.world, None);
        while !self.ahead.ready(step) {
            apart.tick();
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        apart.finish();
        let answered = self.ahead.take(step)?;
        let trainer_idle = waited.elapsed().as_secs_f64();
        let phase = crate::profile::coarse("rollouts")?;
        let sampler = self.sampler.as_ref().unwrap_or(policy);
        let (samples, asked) = (answered.batch.samples, answered.asked);
        let (groups, mut metrics) =
            sample::score_groups(sampler, &self.tok, &answered.mine, &self.options, samples, self.micro, asked)?;
        metrics.server_cut = answered.batch.cut;
        metrics.server_unaligned = answered.batch.unaligned;
        let (groups, metrics) = generated(phase, policy, (groups, metrics))?;
        let (groups, metrics) = share::gather(&self.world, &answered.questions, groups, metrics)?;
        let versions: Vec<Vec<usize>> = groups.iter().map(|_| vec![answered.version; self.options.sampled()]).collect();
        let bound = k_bound(&self.options);
        let (groups, staleness, dropped) = remote::keep_fresh(step, groups, &versions, bound);
        let overlap =
            OverlapMetrics::new(staleness, dropped, trainer_idle, std::mem::take(&mut self.ahead.server_idle));
        Ok((groups, metrics, overlap))
    }

    /// The rollouts of step `step` from the sampling policy (refreshed first when due).
    fn sample(
        &mut self,
        policy: &Decoder,
        questions: &[Group],
        step: usize,
    ) -> Result<(Vec<Group>, RolloutMetrics), RolloutError> {
        self.refresh(policy, step)?;
        self.draw(policy, questions, step, 0)
    }

    /// Refresh the sampling copy when step `step` is due for it.
    fn refresh(&mut self, policy: &Decoder, step: usize) -> Result<(), RolloutError> {
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
        Ok(())
    }

    /// Batch `batch` (0 the step's own questions, then dynamic sampling's refills) of step `step`'s
    /// rollouts from the sampling policy, each batch from its own streams: this rank's share of the
    /// questions sampled here, every rank's answers gathered.
    fn draw(
        &mut self,
        policy: &Decoder,
        questions: &[Group],
        step: usize,
        batch: usize,
    ) -> Result<(Vec<Group>, RolloutMetrics), RolloutError> {
        let mut params = self.options.sampling(self.seed, step);
        if batch > 0 {
            params.seed = self.options.sampling(params.seed ^ batch as u64, step).seed;
        }
        if self.options.uses_server() && !self.server_synced {
            self.sync_server(policy)?;
        }
        let mine = share::mine(&self.world, questions);
        tracing::debug!(
            "rollout: rank {} samples {} of the batch's {} questions",
            self.world.rank(),
            mine.len(),
            questions.len()
        );
        // The ranks whose share is done wait for the others in rounds, with no bound while a server answers.
        let mut apart = crate::dist::Apart::begin(&self.world, None);
        let (groups, metrics) = if mine.is_empty() {
            (Vec::new(), RolloutMetrics::default())
        } else {
            self.sample_share(policy, &mine, &params, &mut apart)?
        };
        apart.finish();
        share::gather(&self.world, questions, groups, metrics)
    }

    /// This rank's questions' rollouts, from the native sampler or the server.
    fn sample_share(
        &self,
        policy: &Decoder,
        questions: &[Group],
        params: &crate::eval::SamplingParams,
        apart: &mut crate::dist::Apart,
    ) -> Result<(Vec<Group>, RolloutMetrics), RolloutError> {
        let phase = crate::profile::coarse("rollouts")?;
        let sampler = self.sampler.as_ref().unwrap_or(policy);
        if !self.options.uses_server() {
            // Each decode step keeps this rank's place in the rounds the ranks that are done wait in.
            let mut tick = || {
                apart.tick();
            };
            let (tok, options) = (&self.tok, &self.options);
            let sampled =
                sample::sample_groups_ticking(sampler, tok, questions, options, params, self.micro, &mut tick)?;
            return generated(phase, policy, sampled);
        }
        let start = Instant::now();
        let bar = crate::progress::progress_bar(None, "rollout");
        bar.set_message("tokens generated (server)");
        let counts = (self.options.sampled(), self.options.n, self.options.importance_sampling_correction);
        let server = self.options.server.for_rank(self.world.rank());
        // The requests run on a thread of their own while this one keeps the rounds with the other ranks.
        let (tok, bar_ref) = (&self.tok, &bar);
        let batch = std::thread::scope(|s| {
            let asked = s.spawn(move || server::server_samples(&server, tok, questions, counts, params, bar_ref));
            while !asked.is_finished() {
                apart.tick();
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            asked.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic))
        })?;
        bar.finish_and_clear();
        let (groups, mut metrics) =
            sample::score_groups(sampler, &self.tok, questions, &self.options, batch.samples, self.micro, start)?;
        metrics.server_cut = batch.cut;
        metrics.server_unaligned = batch.unaligned;
        generated(phase, policy, (groups, metrics))
    }

    /// Tell the servers to load the current sampling weights (when they can): rank 0 saves them to
    /// OUTPUT/rollout-policy, then each server's first rank (rank i for the i-th server) sends the reload,
    /// and no rank samples before every server has the new weights.
    fn sync_server(&mut self, policy: &Decoder) -> Result<(), RolloutError> {
        let sampler = self.sampler.as_ref().unwrap_or(policy);
        if let Some((dir, save)) = &self.serving {
            let server = self.options.server.for_rank(self.world.rank());
            let base = server.base_url.as_deref().unwrap_or_default();
            let reload = self.options.reload;
            let name = server.served_model.as_deref().unwrap_or_default();
            // (request, whether its failure is expected): the adapter's unload fails when none is loaded yet.
            let requests: Vec<(server::ReloadRequest, bool)> = match server::lora_requests(reload, base, dir, name) {
                Some([unload, load]) => vec![(unload, true), (load, false)],
                None => server::reload_request(reload, base, dir).into_iter().map(|r| (r, false)).collect(),
            };
            if !requests.is_empty() {
                if self.world.is_primary() {
                    // A LoRA policy goes to the server as its adapter, or merged (a whole model its reload
                    // reads).
                    let merged = sampler.lora().filter(|_| !reload.adapter()).map(|_| sampler.merged()).transpose()?;
                    save_checkpoint(merged.as_ref().unwrap_or(sampler), dir, save, |_| Ok(()))?;
                }
                self.world.barrier();
                if self.world.rank() < self.options.server.base_urls().len() {
                    for (req, may_fail) in &requests {
                        tracing::info!("rollout server: loading {} ({})", dir.display(), req.url);
                        match server::send_reload(req, &server) {
                            Err(e) if *may_fail => tracing::debug!("{e}"),
                            r => r?,
                        }
                    }
                }
                self.world.barrier();
            }
        }
        self.server_synced = true;
        Ok(())
    }
}

/// DAPO's dynamic sampling: batches `draw(0)`, `draw(1)`, ... of scored groups, keeping the groups whose
/// rewards differ, until `target` are kept or `max_batches` were drawn. Returns the first `target` kept
/// groups (all of them when fewer; the last batch's groups when none was kept, so that the step still
/// trains, on zero advantages) and the merged metrics with the batches drawn and the groups dropped.
fn fill_batch(
    target: usize,
    max_batches: usize,
    mut draw: impl FnMut(usize) -> Result<(Vec<Group>, RolloutMetrics), RolloutError>,
) -> Result<(Vec<Group>, RolloutMetrics), RolloutError> {
    let mut kept = Vec::with_capacity(target);
    let mut metrics: Option<RolloutMetrics> = None;
    let mut last = Vec::new();
    for k in 0..max_batches.max(1) {
        let (groups, mut m) = draw(k)?;
        let before = kept.len();
        kept.extend(groups.iter().filter(|g| varied(g)).cloned());
        m.groups_dropped = groups.len() - (kept.len() - before);
        match &mut metrics {
            Some(all) => all.merge(&m),
            None => metrics = Some(m),
        }
        last = groups;
        if kept.len() >= target {
            break;
        }
    }
    let metrics = metrics.unwrap_or_default();
    if kept.is_empty() {
        tracing::warn!(
            "rollout.filter_groups: every group of {} batches had rewards that all agree; training on the last one",
            metrics.gen_batches
        );
        return Ok((last, metrics));
    }
    if kept.len() < target {
        tracing::warn!(
            "rollout.filter_groups: {} of {target} groups with differing rewards after {} batches \
             (rollout.max_num_gen_batches)",
            kept.len(),
            metrics.gen_batches
        );
    }
    kept.truncate(target);
    Ok((kept, metrics))
}

/// The largest lag an answer may have: rollout.max_staleness, plus the lag sync_every adds by design.
fn k_bound(options: &RolloutOptions) -> usize {
    k_bound_of(options.max_staleness, options.refresh_every())
}

/// [`k_bound`] of staleness `k` and a refresh every `every` steps.
fn k_bound_of(k: usize, every: usize) -> usize {
    k + if every == usize::MAX { 0 } else { every.saturating_sub(1) }
}

/// Whether a group's rewards differ.
fn varied(g: &Group) -> bool {
    g.responses.windows(2).any(|w| w[0].reward != w[1].reward)
}

/// The end of a step's rollouts: their phase closed and the generation's memory (its KV cache) returned
/// to the device, so that the training step's peak does not add to it.
fn generated<T>(phase: crate::profile::Phase, policy: &Decoder, out: T) -> Result<T, RolloutError> {
    phase.end();
    crate::device::release_pool(policy.device())?;
    Ok(out)
}

#[cfg(test)]
mod tests;
