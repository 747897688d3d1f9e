//! One optimisation step: groups -> advantages and aggregation weights over the whole batch -> micro-batches
//! of sequences -> forward/backward with the objective -> accumulated gradients -> clipped update.
//!
//! [`TrainStep`] is the step as `grpo train`, `grpo bench train-step` and the tests run it.

use crate::checksum::splitmix64;
use candle_core::{DType, Tensor};

use super::optim::{clip_scale, norm_of_square_sums, GradNorm, OptimConfig, Optimizer};
use super::pack::{Batching, Padding};
pub use super::ratio::RatioStats;
use crate::data::Group;
use crate::dist::World;
use crate::model::{Decoder, Grads, Targets, TokenBatch};
use crate::objective::{
    entropy_bonus, top_entropy_mask, Anchor, GroupKey, LossAgg, Objective, ObjectiveConfig, TokenInputs,
};
use crate::progress::count;

/// One training step's objective, batching and optimiser; the optimiser state and the anchor snapshot
/// live here between steps.
pub struct TrainStep {
    objective: Box<dyn Objective>,
    aggregation: Aggregation,
    /// The entropy bonus and the high-entropy token mask.
    entropy: EntropyTerms,
    /// How the answers are grouped into micro-batches.
    batching: Batching,
    /// Whether the first batch's padding has been logged.
    padding_logged: bool,
    pad: u32,
    grad_clip: f64,
    optimizer: Optimizer,
    /// Steps between refreshes of the anchor snapshot (anchor = snapshot).
    anchor_every: usize,
    /// The policy at step floor(step / anchor_every) * anchor_every (anchor = snapshot).
    snapshot: Option<Decoder>,
    /// The step [`TrainStep::run`] takes next.
    next_step: usize,
    /// The ranks the batch is shared with (data parallelism, [`crate::dist`]).
    world: std::rc::Rc<World>,
}

/// Where a step takes the frozen reference's log-probs from (the KL term, anchor = reference).
#[derive(Clone, Copy)]
pub enum Reference<'a> {
    /// The objective reads no reference.
    None,
    /// The reference model, run on each micro-batch.
    Model(&'a Decoder),
    /// Computed beforehand (the reference cache, [`super::refcache`]): for each group of the step, for each
    /// of its answers, the reference's log-prob of each answer token (at least as many as the answer has).
    Logprobs(&'a [Vec<Vec<f32>>]),
}

impl<'a> From<Option<&'a Decoder>> for Reference<'a> {
    fn from(m: Option<&'a Decoder>) -> Self {
        m.map_or(Reference::None, Reference::Model)
    }
}

/// Where a step is in its run: the snapshot refresh and RED-Drop's random choice depend on it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepContext {
    /// The run's seed (`train.seed`).
    pub seed: u64,
    pub epoch: usize,
    /// Steps taken before this one.
    pub step: usize,
}

/// What one step did.
#[derive(Debug, Clone, Default)]
pub struct StepReport {
    /// The reward statistics of the step's groups.
    pub rewards: RewardSummary,
    /// Loss terms and token counts, summed over the micro-batches.
    pub stats: StepStats,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// False when the loss or the gradient was not finite: the update was skipped.
    pub applied: bool,
}

impl StepReport {
    /// One report for several updates on the same groups: loss terms and the gradient norm averaged,
    /// token and clip counts summed (so the clip fraction is over every update's tokens), ratio extremes
    /// over all, applied only when every update was.
    pub fn combine(reports: Vec<StepReport>) -> StepReport {
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
}

impl TrainStep {
    /// A step of `objective` for `policy`'s parameters: `micro_batch` sequences per forward/backward,
    /// `norm_len` the response-token limit, `pad` the padding token.
    pub fn new(
        objective: &ObjectiveConfig,
        optim: &OptimConfig,
        policy: &Decoder,
        micro_batch: usize,
        norm_len: usize,
        pad: u32,
    ) -> candle_core::Result<Self> {
        Ok(Self {
            objective: objective.build(),
            aggregation: Aggregation::of(objective, norm_len),
            entropy: EntropyTerms::of(objective),
            batching: Batching::Answers(micro_batch.max(1)),
            padding_logged: false,
            pad,
            grad_clip: optim.grad_clip,
            optimizer: Optimizer::new(optim.clone(), &policy.trainable_names(), &policy.vars())?,
            anchor_every: objective.anchor_every().max(1),
            snapshot: None,
            next_step: 0,
            world: std::rc::Rc::new(World::single()),
        })
    }

    /// Share each step's batch with the other ranks of `world`: this rank trains on its groups, the
    /// gradients and statistics are summed over the ranks and the optimiser state is sharded over them
    /// (see [`crate::dist`]). Before the first step.
    pub fn share_with(&mut self, world: std::rc::Rc<World>) -> candle_core::Result<()> {
        self.optimizer.shard_over(world.clone())?;
        self.world = world;
        Ok(())
    }

    /// Group the answers into micro-batches as `batching` says (`new` takes `micro_batch` answers each).
    pub fn set_batching(&mut self, batching: Batching) {
        self.batching = batching;
    }

    /// The objective's name.
    pub fn objective_name(&self) -> &'static str {
        self.objective.name()
    }

    /// Whether the objective needs the frozen reference model (its KL term, or as its anchor).
    pub fn needs_reference(&self) -> bool {
        self.objective.needs_reference()
    }

    /// The optimiser (its state is saved with each checkpoint).
    pub fn optimizer(&self) -> &Optimizer {
        &self.optimizer
    }

    pub fn optimizer_mut(&mut self) -> &mut Optimizer {
        &mut self.optimizer
    }

    /// Steps between anchor snapshots when the objective's anchor is a policy snapshot, else `None`.
    pub fn snapshot_every(&self) -> Option<usize> {
        (self.objective.anchor() == Some(Anchor::Snapshot)).then_some(self.anchor_every)
    }

    /// The anchor snapshot, once taken.
    pub fn snapshot(&self) -> Option<&Decoder> {
        self.snapshot.as_ref()
    }

    /// Restore the anchor snapshot of a resumed run (the policy at its last refresh).
    pub fn set_snapshot(&mut self, snapshot: Decoder) {
        self.snapshot = Some(snapshot);
    }

    /// Train `policy` on `groups` at learning rate `lr`, as the step after the previous call (the first
    /// is step 0 of epoch 0, seed 0). `reference` must be given exactly when
    /// [`TrainStep::needs_reference`] says so.
    pub fn run(
        &mut self,
        policy: &Decoder,
        reference: Option<&Decoder>,
        groups: &[Group],
        lr: f64,
    ) -> candle_core::Result<StepReport> {
        let ctx = StepContext { step: self.next_step, ..Default::default() };
        self.run_at(policy, reference, groups, lr, ctx)
    }

    /// Train `policy` on `groups` at learning rate `lr` as step `ctx.step` of a run. With a snapshot
    /// anchor, the snapshot is refreshed to the current policy when `ctx.step` is a multiple of
    /// `anchor_every`.
    pub fn run_at(
        &mut self,
        policy: &Decoder,
        reference: Option<&Decoder>,
        groups: &[Group],
        lr: f64,
        ctx: StepContext,
    ) -> candle_core::Result<StepReport> {
        self.run_with(policy, reference.into(), groups, lr, ctx)
    }

    /// `updates` updates of `policy` on the same groups (`rollout.updates_per_batch`; on-policy GRPO's
    /// mu), each a [`TrainStep::run_with`], in one report ([`StepReport::combine`]).
    pub fn run_updates(
        &mut self,
        policy: &Decoder,
        reference: Reference,
        groups: &[Group],
        lr: f64,
        ctx: StepContext,
        updates: usize,
    ) -> candle_core::Result<StepReport> {
        let reports = (0..updates).map(|_| self.run_with(policy, reference, groups, lr, ctx));
        Ok(StepReport::combine(reports.collect::<candle_core::Result<_>>()?))
    }

    /// [`TrainStep::run_at`] with the reference's log-probs from `reference`: the model, or log-probs
    /// computed beforehand. It must be [`Reference::None`] exactly when the objective reads no reference.
    pub fn run_with(
        &mut self,
        policy: &Decoder,
        reference: Reference,
        groups: &[Group],
        lr: f64,
        ctx: StepContext,
    ) -> candle_core::Result<StepReport> {
        let name = self.objective.name();
        match (&reference, self.needs_reference()) {
            (Reference::None, true) => {
                candle_core::bail!("{name} needs a reference model (beta > 0 or anchor = reference)")
            }
            (Reference::Model(_) | Reference::Logprobs(_), false) => {
                candle_core::bail!("{name} uses no reference model: pass none")
            }
            (Reference::Logprobs(lp), true) if lp.len() != groups.len() => {
                candle_core::bail!("reference log-probs for {} groups, the step has {}", lp.len(), groups.len())
            }
            _ => {}
        }
        if let Some(every) = self.snapshot_every() {
            if ctx.step.is_multiple_of(every) {
                self.snapshot = None; // free the old copy first: one model less at the peak
                self.snapshot = Some(policy.frozen_copy()?);
            } else if self.snapshot.is_none() {
                candle_core::bail!("{name}: no anchor snapshot at step {} (taken every {every} steps)", ctx.step);
            }
        }
        let anchor = Anchors { reference, snapshot: self.snapshot.as_ref() };
        let mut batch = build_batch(groups, self.objective.as_ref(), self.aggregation, ctx);
        // The weights carry the global batch's normaliser: each rank keeps its groups' answers.
        batch.seqs.retain(|s| self.world.owns_group(s.origin.0));
        if !self.padding_logged {
            self.padding_logged = true;
            log_padding(&batch.seqs, self.batching);
        }
        let (grads, pending) = accumulate_gradients(
            policy,
            anchor,
            self.objective.as_ref(),
            self.entropy,
            &batch,
            (self.batching, self.pad),
        )?;
        // Summed over the ranks (reduce-scatter when the state is sharded): the norm is the global one.
        let optimizer = crate::profile::coarse("optimizer")?;
        let norm_phase = crate::profile::phase("gradient norm and clip");
        let (grads, norm) = self.optimizer.reduce(grads)?;
        // The step's one read of the device: its statistics with the gradient's sums of squares.
        let (mut stats, norm) = match norm {
            GradNorm::Device(sums) => {
                let (stats, sums) = pending.read(sums.as_ref())?;
                (stats, norm_of_square_sums(&sums))
            }
            GradNorm::Host(norm) => (pending.read(None)?.0, norm),
        };
        if self.world.size() > 1 {
            sum_stats_over_ranks(&self.world, &mut stats);
        }
        let applied = stats.loss.is_finite() && norm.is_finite();
        let scale = clip_scale(norm, self.grad_clip);
        drop(norm_phase);
        if applied {
            let _update = crate::profile::phase("update");
            self.optimizer.update(&grads, lr, scale)?;
        }
        optimizer.end();
        self.next_step = ctx.step + 1;
        Ok(StepReport { rewards: batch.rewards, stats, grad_norm: norm, applied })
    }
}

/// Each answer's tokens, prompt included: what a row holds of it.
fn answer_lengths(seqs: &[Sequence]) -> Vec<usize> {
    seqs.iter().map(|s| s.prompt.len() + s.response.len()).collect()
}

/// Log the padding of (this rank's share of) the first batch as `batching` groups it, beside that of
/// the other grouping (one answer per row, or packed into rows of the longest answer's tokens).
fn log_padding(seqs: &[Sequence], batching: Batching) {
    let lengths = answer_lengths(seqs);
    let here = Padding::of(&batching.micro_batches(&lengths), &lengths);
    let (other, what) = match batching {
        Batching::Answers(n) => {
            let budget = lengths.iter().copied().max().unwrap_or(0).max(1).saturating_mul(n);
            (Batching::Tokens(budget), format!("packed into rows of {budget} tokens"))
        }
        Batching::Tokens(_) => (Batching::Answers(1), "one answer per micro-batch".to_string()),
    };
    let there = Padding::of(&other.micro_batches(&lengths), &lengths);
    tracing::info!(
        "first batch: {}, {} tokens in {} ({}), {:.1}% padding, largest micro-batch {} tokens ({}: {}, \
         {:.1}% padding)",
        count(lengths.len() as u64, "answer"),
        here.tokens,
        count(here.micro_batches as u64, "micro-batch"),
        batching,
        100.0 * here.fraction(),
        here.max_slots,
        what,
        count(there.micro_batches as u64, "micro-batch"),
        100.0 * there.fraction()
    );
}

/// The objective's uses of the policy's token entropy besides the metric.
#[derive(Debug, Clone, Copy, PartialEq)]
struct EntropyTerms {
    /// `objective.entropy_coeff` (0: no bonus).
    coeff: f32,
    /// `objective.top_entropy_quantile` (1: every token in the policy loss).
    top_quantile: f32,
}

impl EntropyTerms {
    fn of(cfg: &ObjectiveConfig) -> Self {
        Self { coeff: cfg.entropy_coeff(), top_quantile: cfg.top_entropy_quantile() }
    }

    #[cfg(test)]
    const NONE: EntropyTerms = EntropyTerms { coeff: 0.0, top_quantile: 1.0 };

    /// With `top_quantile < 1`, the micro-batch's policy-term weights: `base` (the sampler correction's,
    /// 1 without) times each answer's high-entropy mask from the detached entropies `h`. The quantiles are
    /// taken on the host: with the mask on, a step reads the device once more per micro-batch.
    fn mask(&self, h: &Tensor, lengths: &[usize], base: Option<&Tensor>) -> candle_core::Result<Option<Tensor>> {
        if self.top_quantile >= 1.0 {
            return Ok(base.cloned());
        }
        let mask = top_entropy_mask(&crate::device::to_host::<f32>(h)?, lengths, self.top_quantile);
        let mask = crate::device::from_host(mask, h.dims1()?, h.device())?;
        Ok(Some(match base {
            Some(c) => (c * mask)?,
            None => mask,
        }))
    }
}

/// The frozen models a step reads log-probs from.
#[derive(Clone, Copy)]
struct Anchors<'a> {
    /// The frozen reference (KL term, or anchor = reference).
    reference: Reference<'a>,
    /// The policy snapshot (anchor = snapshot).
    snapshot: Option<&'a Decoder>,
}

/// One answer to train on.
#[derive(Debug, Clone)]
struct Sequence {
    prompt: std::sync::Arc<Vec<u32>>,
    response: Vec<u32>,
    /// (group in the step, answer in the group): where its cached reference log-probs are.
    origin: (usize, usize),
    teacher_logprobs: Option<Vec<f32>>,
    /// The sampler correction's weight of each token (rollouts with importance_sampling_correction).
    is_weights: Option<Vec<f32>>,
    advantage: f32,
    /// Aggregation weight of each of its tokens.
    weight: f32,
}

/// Reward statistics of a step's groups.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RewardSummary {
    pub questions: usize,
    pub responses: usize,
    pub reward_mean: f32,
    /// Mean over groups of the within-group standard deviation of rewards.
    pub reward_std: f32,
    pub frac_reward_zero_std: f32,
    pub frac_bias_applied: f32,
    pub mean_response_length: f32,
    /// Answers left out of the loss for being cut at the token limit (`mask_truncated`).
    pub masked_truncated: usize,
}

/// The sequences of a step and the reward statistics of its groups.
#[derive(Debug, Clone, Default)]
struct StepBatch {
    seqs: Vec<Sequence>,
    rewards: RewardSummary,
    /// The step's seed of LoRA's dropout masks (from the run's seed and the step): each micro-batch draws
    /// its own from it and the origin of its first answer, the same on every rank layout and on resume.
    dropout_seed: u64,
}

/// How a batch's per-token losses are aggregated, and which answers take part.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Aggregation {
    agg: LossAgg,
    /// The constant of `seq-mean-token-sum-norm`.
    norm_len: usize,
    /// Answers cut at the token limit are left out of the loss.
    mask_truncated: bool,
}

impl Aggregation {
    /// `cfg`'s aggregation, `norm_len` the run's response-token limit (seq-mean-token-sum-norm's
    /// constant unless `loss_scale_factor` says otherwise).
    fn of(cfg: &ObjectiveConfig, norm_len: usize) -> Self {
        Self { agg: cfg.loss_agg(), norm_len: cfg.loss_scale_factor(norm_len), mask_truncated: cfg.mask_truncated() }
    }
}

/// Turn groups into sequences with advantages and batch-wide aggregation weights.
fn build_batch(groups: &[Group], objective: &dyn Objective, aggregation: Aggregation, ctx: StepContext) -> StepBatch {
    let mut seqs = Vec::new();
    let mut include = Vec::new();
    let (mut reward_sum, mut std_sum, mut zero_std, mut biased) = (0f64, 0f64, 0usize, 0usize);
    let all_rewards: Vec<f32> = groups.iter().flat_map(|g| g.responses.iter().map(|r| r.reward)).collect();
    let batch_reward_std = crate::objective::RewardStats::of(&all_rewards).std;
    let mut masked_truncated = 0usize;
    for (gi, g) in groups.iter().enumerate() {
        let rewards: Vec<f32> = g.responses.iter().map(|r| r.reward).collect();
        let key = GroupKey { seed: ctx.seed, epoch: ctx.epoch, question: &g.question_id, batch_reward_std };
        let adv = objective.advantages(&rewards, &key);
        std_sum += adv.rewards.std;
        zero_std += usize::from(adv.rewards.std == 0.0);
        biased += usize::from(adv.bias_applied);
        reward_sum += rewards.iter().map(|&r| r as f64).sum::<f64>();
        let prompt = std::sync::Arc::new(g.prompt_tokens.clone());
        for (j, ((r, a), i)) in g.responses.iter().zip(adv.advantages).zip(adv.include).enumerate() {
            seqs.push(Sequence {
                prompt: prompt.clone(),
                response: r.tokens.clone(),
                origin: (gi, j),
                teacher_logprobs: r.teacher_logprobs.clone(),
                is_weights: r.is_weights.clone(),
                advantage: a,
                weight: 0.0,
            });
            let masked = aggregation.mask_truncated && r.truncated;
            masked_truncated += usize::from(masked);
            include.push(i && !r.tokens.is_empty() && !masked);
        }
    }
    let lengths: Vec<usize> = seqs.iter().map(|s| s.response.len()).collect();
    let weights = aggregation.agg.weights(&lengths, &include, aggregation.norm_len);
    for (s, w) in seqs.iter_mut().zip(weights) {
        s.weight = w;
    }
    let q = groups.len().max(1) as f32;
    let responses = seqs.len();
    let rewards = RewardSummary {
        questions: groups.len(),
        responses,
        reward_mean: (reward_sum / responses.max(1) as f64) as f32,
        reward_std: (std_sum / q as f64) as f32,
        frac_reward_zero_std: zero_std as f32 / q,
        frac_bias_applied: biased as f32 / q,
        mean_response_length: lengths.iter().sum::<usize>() as f32 / responses.max(1) as f32,
        masked_truncated,
    };
    let seqs = seqs.into_iter().zip(include).filter(|(_, i)| *i).map(|(s, _)| s).collect();
    let dropout_seed = splitmix64(splitmix64(ctx.seed) ^ ctx.step as u64);
    StepBatch { seqs, rewards, dropout_seed }
}

/// Sums over a step's micro-batches.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepStats {
    pub loss: f64,
    pub pg_loss: f64,
    pub kl: f64,
    pub clipped_tokens: usize,
    pub response_tokens: usize,
    pub entropy_sum: f64,
    /// Prompt + response tokens processed (policy forward).
    pub tokens: usize,
    /// The ratio pi_theta / pi_behaviour of the objectives that have one (an anchor): its sum, extremes
    /// and token count (0: no ratio).
    pub ratio: RatioStats,
}

impl StepStats {
    /// Add another computation's sums (another update on the same batch).
    pub fn merge(&mut self, o: &StepStats) {
        self.loss += o.loss;
        self.pg_loss += o.pg_loss;
        self.kl += o.kl;
        self.clipped_tokens += o.clipped_tokens;
        self.response_tokens += o.response_tokens;
        self.entropy_sum += o.entropy_sum;
        self.tokens += o.tokens;
        self.ratio.merge(&o.ratio);
    }
}

/// One micro-batch of `rows` (each the answers it holds, packed one after the other): its tokens,
/// targets, per-token loss inputs (without behaviour log-probs) and the teacher's log-probs (`None` when
/// no sequence has them: probability 1). Targets, loss inputs and teacher log-probs follow the answers in
/// row order, answer after answer.
fn micro_inputs(
    rows: &[Vec<&Sequence>],
    pad: u32,
    device: &candle_core::Device,
) -> candle_core::Result<(TokenBatch, Targets, TokenInputs, Option<Tensor>)> {
    let full: Vec<Vec<Vec<u32>>> =
        rows.iter().map(|row| row.iter().map(|s| [s.prompt.as_slice(), &s.response].concat()).collect()).collect();
    let tb = TokenBatch::packed(&full, pad);
    let mut targets = Targets::default();
    let (mut teacher, mut correction) = (Vec::new(), Vec::new());
    for (r, row) in rows.iter().enumerate() {
        let mut start = 0;
        for s in row {
            let p = s.prompt.len();
            if p == 0 {
                // Its first token would be predicted from the row's previous answer.
                candle_core::bail!("answer {} of group {}: an empty prompt", s.origin.1, s.origin.0);
            }
            for j in 0..s.response.len() {
                targets.push(r, start + p + j);
                // Rows without teacher log-probs keep the probability-1 assumption (log-prob 0).
                teacher.push(s.teacher_logprobs.as_ref().and_then(|t| t.get(j).copied()).unwrap_or(0.0));
                correction.push(s.is_weights.as_ref().and_then(|c| c.get(j).copied()).unwrap_or(1.0));
            }
            start += p + s.response.len();
        }
    }
    let chunk: Vec<&Sequence> = rows.iter().flatten().copied().collect();
    let lengths: Vec<usize> = chunk.iter().map(|s| s.response.len()).collect();
    let adv: Vec<f32> = chunk.iter().map(|s| s.advantage).collect();
    let w: Vec<f32> = chunk.iter().map(|s| s.weight).collect();
    let mut inputs = TokenInputs::for_sequences(&lengths, &adv, &w, device)?;
    if chunk.iter().any(|s| s.is_weights.is_some()) {
        inputs.is_weights = Some(crate::device::from_host(correction, targets.len(), device)?);
    }
    let any_teacher = chunk.iter().any(|s| s.teacher_logprobs.is_some());
    let teacher = if any_teacher { Some(crate::device::from_host(teacher, targets.len(), device)?) } else { None };
    Ok((tb, targets, inputs, teacher))
}

/// The reference's log-probs of a micro-batch's targets: from the model, or the cached log-probs of each
/// sequence's answer (its first tokens when the answer was cut shorter than the cached one).
fn reference_logprobs(
    reference: Reference,
    chunk: &[&Sequence],
    tb: &TokenBatch,
    targets: &Targets,
    device: &candle_core::Device,
) -> candle_core::Result<Option<Tensor>> {
    let cached = match reference {
        Reference::None => return Ok(None),
        Reference::Model(m) => return Ok(Some(m.token_logprobs(tb, targets, false)?.narrow(1, 0, 1)?.squeeze(1)?)),
        Reference::Logprobs(lp) => lp,
    };
    let mut values = Vec::with_capacity(targets.len());
    for s in chunk {
        let (g, a) = s.origin;
        let lp = cached.get(g).and_then(|answers| answers.get(a)).map_or(&[][..], Vec::as_slice);
        if lp.len() < s.response.len() {
            candle_core::bail!(
                "reference log-probs of answer {a} of group {g}: {} values for {} tokens",
                lp.len(),
                s.response.len()
            );
        }
        values.extend_from_slice(&lp[..s.response.len()]);
    }
    Ok(Some(crate::device::from_host(values, targets.len(), device)?))
}

/// The gradient of the whole batch, computed one micro-batch at a time as `batching` groups the
/// answers. The reference's log-probs give the KL term when the objective has one; the behaviour
/// log-probs come from the objective's anchor: the teacher's, the policy's own at the start of the step
/// (detached), the reference's or the snapshot's. The statistics stay on the device ([`PendingStats`]).
fn accumulate_gradients(
    policy: &Decoder,
    anchors: Anchors,
    objective: &dyn Objective,
    entropy: EntropyTerms,
    batch: &StepBatch,
    (batching, pad): (Batching, u32),
) -> candle_core::Result<(Grads, PendingStats)> {
    let device = policy.device().clone();
    // One f32 accumulator: each micro-batch's gradients are added into it as they are collected.
    let mut total = policy.new_grads();
    let mut stats = PendingStats::default();
    let logprobs = |m: Option<&Decoder>, tb: &TokenBatch, t: &Targets| -> candle_core::Result<Option<Tensor>> {
        m.map(|m| m.token_logprobs(tb, t, false)?.narrow(1, 0, 1)?.squeeze(1)).transpose()
    };
    for micro in batching.micro_batches(&answer_lengths(&batch.seqs)) {
        let phase = crate::profile::phase("inputs");
        let rows: Vec<Vec<&Sequence>> = micro.iter().map(|row| row.iter().map(|&i| &batch.seqs[i]).collect()).collect();
        let chunk: Vec<&Sequence> = rows.iter().flatten().copied().collect();
        let (tb, targets, mut inputs, teacher) = micro_inputs(&rows, pad, &device)?;
        let (g, a) = chunk.first().map_or((0, 0), |s| s.origin);
        let tb = tb
            .with_dropout_seed(splitmix64(batch.dropout_seed ^ splitmix64((g as u64) << 20 ^ a as u64)))
            .with_entropy_gradient(entropy.coeff != 0.0);
        drop(phase);
        stats.response_tokens += targets.len();
        stats.tokens += tb.num_tokens();
        let phase = crate::profile::coarse("reference")?;
        let ref_logp = reference_logprobs(anchors.reference, &chunk, &tb, &targets, &device)?;
        phase.end();
        let anchor = objective.anchor();
        let missing = |what: &str| candle_core::Error::Msg(format!("{}: no {what} model", objective.name()));
        inputs.behaviour_logp = match anchor {
            Some(Anchor::Teacher) => teacher,
            Some(Anchor::Reference) => Some(ref_logp.clone().ok_or_else(|| missing("reference"))?),
            Some(Anchor::Snapshot) => {
                let _phase = crate::profile::phase("snapshot");
                Some(logprobs(anchors.snapshot, &tb, &targets)?.ok_or_else(|| missing("snapshot"))?)
            }
            Some(Anchor::Step) | None => None,
        };
        inputs.ref_logp = if objective.needs_kl() { ref_logp } else { None };
        let lengths: Vec<usize> = chunk.iter().map(|s| s.response.len()).collect();
        let base_weights = inputs.is_weights.clone();
        // Reads nothing from the device: its statistics are added to `stats` as tensors.
        let mut loss_fn = |lp: &Tensor| -> candle_core::Result<Tensor> {
            let logp = lp.narrow(1, 0, 1)?.squeeze(1)?;
            let h = lp.narrow(1, 1, 1)?.squeeze(1)?;
            stats.entropy.add(h.detach().sum_all()?)?;
            inputs.is_weights = entropy.mask(&h.detach(), &lengths, base_weights.as_ref())?;
            if anchor == Some(Anchor::Step) {
                inputs.behaviour_logp = Some(logp.detach());
            }
            match (&inputs.behaviour_logp, anchor) {
                (Some(b), _) => stats.add_ratio(&(logp.detach() - b)?)?,
                // Teacher answers without log-probs: probability 1.
                (None, Some(Anchor::Teacher)) => stats.add_ratio(&logp.detach())?,
                _ => {}
            }
            let mut terms = objective.loss(&logp, &inputs)?;
            if entropy.coeff != 0.0 {
                terms.loss = (terms.loss + entropy_bonus(&h, &inputs, entropy.coeff)?)?;
            }
            stats.pg_loss.add(terms.pg_loss)?;
            stats.kl.add_some(terms.kl)?;
            stats.clipped_tokens.add_some(terms.clipped_tokens)?;
            Ok(terms.loss)
        };
        let loss = policy.forward_backward_into(&tb, &targets, &mut loss_fn, &mut total)?;
        stats.loss.add(loss)?;
    }
    Ok((total, stats))
}

/// [`accumulate_gradients`] with its statistics read.
#[cfg(test)]
fn compute_gradients(
    policy: &Decoder,
    anchors: Anchors,
    objective: &dyn Objective,
    entropy: EntropyTerms,
    batch: &StepBatch,
    batching: (Batching, u32),
) -> candle_core::Result<(Grads, StepStats)> {
    let (grads, pending) = accumulate_gradients(policy, anchors, objective, entropy, batch, batching)?;
    Ok((grads, pending.read(None)?.0))
}

/// A scalar summed on the device in f64 (`None`: nothing added, 0). Each value is added in f64 in the order
/// it comes, as the host would: on the CPU the sums are those of an f64 sum of the values read one by one.
#[derive(Default)]
struct DeviceSum(Option<Tensor>);

impl DeviceSum {
    fn add(&mut self, t: Tensor) -> candle_core::Result<()> {
        let t = t.to_dtype(DType::F64)?;
        self.0 = Some(match self.0.take() {
            Some(a) => (a + t)?,
            None => t,
        });
        Ok(())
    }

    fn add_some(&mut self, t: Option<Tensor>) -> candle_core::Result<()> {
        t.map_or(Ok(()), |t| self.add(t))
    }

    /// Add the elements of `xs` (`[n]`) one after the other: the running sum and the values summed as
    /// one vector, in order.
    fn add_each(&mut self, xs: &Tensor) -> candle_core::Result<()> {
        let xs = xs.to_dtype(DType::F64)?;
        let all = match self.0.take() {
            Some(a) => Tensor::cat(&[&a.reshape(1)?, &xs], 0)?,
            None => xs,
        };
        self.0 = Some(all.sum_all()?);
        Ok(())
    }
}

/// A step's statistics while its micro-batches run: the sums and the ratio's extremes stay scalars on the
/// device, the token counts (known on the host) are counted here, and [`PendingStats::read`] reads the
/// scalars with the gradients' sums of squares in one transfer at the end of the step.
#[derive(Default)]
struct PendingStats {
    loss: DeviceSum,
    pg_loss: DeviceSum,
    kl: DeviceSum,
    clipped_tokens: DeviceSum,
    entropy: DeviceSum,
    ratio_sum: DeviceSum,
    /// The ratio's minimum and maximum so far.
    ratio_extremes: Option<(Tensor, Tensor)>,
    ratio_tokens: usize,
    response_tokens: usize,
    tokens: usize,
}

impl PendingStats {
    /// Add the ratios exp(`log_ratio`) (`[n]`, detached) of a micro-batch.
    fn add_ratio(&mut self, log_ratio: &Tensor) -> candle_core::Result<()> {
        let n = log_ratio.elem_count();
        if n == 0 {
            return Ok(());
        }
        let r = crate::objective::exp_clamped(log_ratio)?.to_dtype(DType::F32)?.flatten_all()?;
        self.ratio_sum.add_each(&r)?;
        let (lo, hi) = (r.min(0)?, r.max(0)?);
        self.ratio_extremes = Some(match self.ratio_extremes.take() {
            Some((a, b)) => (a.minimum(&lo)?, b.maximum(&hi)?),
            None => (lo, hi),
        });
        self.ratio_tokens += n;
        Ok(())
    }

    /// The statistics, and the values of `with` (the gradients' sums of squares), read in one transfer.
    fn read(self, with: Option<&Tensor>) -> candle_core::Result<(StepStats, Vec<f64>)> {
        let (lo, hi) = self.ratio_extremes.unzip();
        let sums = [self.loss, self.pg_loss, self.kl, self.clipped_tokens, self.entropy, self.ratio_sum];
        let scalars: Vec<Option<Tensor>> = sums.into_iter().map(|s| s.0).chain([lo, hi]).collect();
        let mut parts: Vec<Tensor> =
            scalars.iter().flatten().map(|t| t.to_dtype(DType::F64)?.reshape(1)).collect::<candle_core::Result<_>>()?;
        parts.extend(with.map(|w| w.to_dtype(DType::F64)).transpose()?);
        let values: Vec<f64> =
            if parts.is_empty() { Vec::new() } else { crate::device::to_host(&Tensor::cat(&parts, 0)?)? };
        let mut at = 0;
        let mut read: Vec<f64> = Vec::with_capacity(scalars.len());
        for t in &scalars {
            read.push(match t {
                Some(_) => {
                    at += 1;
                    values[at - 1]
                }
                None => 0.0,
            });
        }
        let [loss, pg_loss, kl, clipped, entropy_sum, ratio_sum, min, max] = read[..] else {
            unreachable!("eight statistics")
        };
        let stats = StepStats {
            loss,
            pg_loss,
            kl,
            clipped_tokens: clipped as usize,
            response_tokens: self.response_tokens,
            entropy_sum,
            tokens: self.tokens,
            ratio: RatioStats { sum: ratio_sum, min, max, tokens: self.ratio_tokens },
        };
        Ok((stats, values[at..].to_vec()))
    }
}

/// Sum the statistics of every rank, so that each rank holds those of the global batch.
fn sum_stats_over_ranks(world: &World, stats: &mut StepStats) {
    let r = &stats.ratio;
    let mut sums = [
        stats.loss,
        stats.pg_loss,
        stats.kl,
        stats.clipped_tokens as f64,
        stats.response_tokens as f64,
        stats.entropy_sum,
        stats.tokens as f64,
        r.sum,
        r.tokens as f64,
    ];
    world.sum_f64(&mut sums);
    let mut extremes = if r.tokens > 0 { [-r.min, r.max] } else { [f64::NEG_INFINITY; 2] };
    world.max_f64(&mut extremes);
    let [loss, pg_loss, kl, clipped, response, entropy, tokens, ratio_sum, ratio_tokens] = sums;
    *stats = StepStats {
        loss,
        pg_loss,
        kl,
        clipped_tokens: clipped as usize,
        response_tokens: response as usize,
        entropy_sum: entropy,
        tokens: tokens as usize,
        ratio: RatioStats { sum: ratio_sum, min: -extremes[0], max: extremes[1], tokens: ratio_tokens as usize },
    };
    if stats.ratio.tokens == 0 {
        stats.ratio = RatioStats::default();
    }
}

#[cfg(test)]
mod tests;
