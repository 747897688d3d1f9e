//! One optimisation step: groups -> advantages and aggregation weights over the whole batch -> micro-batches
//! of sequences -> forward/backward with the objective -> accumulated gradients -> clipped update.
//!
//! [`TrainStep`] is the step as `grpo train`, `grpo bench train-step` and the tests run it.

use crate::checksum::splitmix64;
use candle_core::Tensor;

use super::optim::{clip_scale, OptimConfig, Optimizer};
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
        let (grads, mut stats) = compute_gradients(
            policy,
            anchor,
            self.objective.as_ref(),
            self.entropy,
            &batch,
            (self.batching, self.pad),
        )?;
        if self.world.size() > 1 {
            sum_stats_over_ranks(&self.world, &mut stats);
        }
        // Summed over the ranks (reduce-scatter when the state is sharded): the norm is the global one.
        let optimizer = crate::profile::coarse("optimizer")?;
        let norm_phase = crate::profile::phase("gradient norm and clip");
        let (grads, norm) = self.optimizer.reduce(grads)?;
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
    /// 1 without) times each answer's high-entropy mask from the detached entropies `h`.
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
/// (detached), the reference's or the snapshot's.
fn compute_gradients(
    policy: &Decoder,
    anchors: Anchors,
    objective: &dyn Objective,
    entropy: EntropyTerms,
    batch: &StepBatch,
    (batching, pad): (Batching, u32),
) -> candle_core::Result<(Grads, StepStats)> {
    let device = policy.device().clone();
    // One f32 accumulator: each micro-batch's gradients are added into it as they are collected.
    let mut total = policy.new_grads();
    let mut stats = StepStats::default();
    let logprobs = |m: Option<&Decoder>, tb: &TokenBatch, t: &Targets| -> candle_core::Result<Option<Tensor>> {
        m.map(|m| m.token_logprobs(tb, t, false)?.narrow(1, 0, 1)?.squeeze(1)).transpose()
    };
    for micro in batching.micro_batches(&answer_lengths(&batch.seqs)) {
        let phase = crate::profile::phase("inputs");
        let rows: Vec<Vec<&Sequence>> = micro.iter().map(|row| row.iter().map(|&i| &batch.seqs[i]).collect()).collect();
        let chunk: Vec<&Sequence> = rows.iter().flatten().copied().collect();
        let (tb, targets, mut inputs, teacher) = micro_inputs(&rows, pad, &device)?;
        let (g, a) = chunk.first().map_or((0, 0), |s| s.origin);
        let tb = tb.with_dropout_seed(splitmix64(batch.dropout_seed ^ splitmix64((g as u64) << 20 ^ a as u64)));
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
        let (mut pg, mut kl, mut clipped, mut ent) = (0f64, 0f64, 0usize, 0f64);
        let mut ratio = RatioStats::default();
        let lengths: Vec<usize> = chunk.iter().map(|s| s.response.len()).collect();
        let base_weights = inputs.is_weights.clone();
        let mut loss_fn = |lp: &Tensor| -> candle_core::Result<Tensor> {
            let logp = lp.narrow(1, 0, 1)?.squeeze(1)?;
            let h = lp.narrow(1, 1, 1)?.squeeze(1)?;
            ent += crate::device::to_host_scalar::<f32>(&h.sum_all()?)? as f64;
            inputs.is_weights = entropy.mask(&h.detach(), &lengths, base_weights.as_ref())?;
            if anchor == Some(Anchor::Step) {
                inputs.behaviour_logp = Some(logp.detach());
            }
            match (&inputs.behaviour_logp, anchor) {
                (Some(b), _) => ratio.add(&(logp.detach() - b)?)?,
                // Teacher answers without log-probs: probability 1.
                (None, Some(Anchor::Teacher)) => ratio.add(&logp.detach())?,
                _ => {}
            }
            let mut terms = objective.loss(&logp, &inputs)?;
            if entropy.coeff != 0.0 {
                terms.loss = (terms.loss + entropy_bonus(&h, &inputs, entropy.coeff)?)?;
            }
            pg += terms.pg_loss as f64;
            kl += terms.kl as f64;
            clipped += terms.clipped_tokens;
            Ok(terms.loss)
        };
        let loss = policy.forward_backward_into(&tb, &targets, &mut loss_fn, &mut total)?;
        stats.loss += loss as f64;
        stats.pg_loss += pg;
        stats.kl += kl;
        stats.clipped_tokens += clipped;
        stats.entropy_sum += ent;
        stats.ratio.merge(&ratio);
    }
    Ok((total, stats))
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
mod tests {
    use super::*;
    use crate::data::Response;
    use crate::model::tiny::TinyShape;
    use crate::model::{random_decoder, Arch};
    use crate::objective::{ObjectiveConfig, ObjectiveName};
    use candle_core::{DType, Device};

    fn group(i: usize, rewards: &[f32]) -> Group {
        Group {
            index: i,
            question_id: format!("q{i}"),
            domain: None,
            source: None,
            prompt_tokens: vec![1, 5 + i as u32, 7, 9],
            responses: rewards
                .iter()
                .enumerate()
                .map(|(j, &r)| Response {
                    tokens: (0..(3 + 2 * j + i) as u32).map(|t| (t * 7 + j as u32 * 3 + i as u32) % 60 + 2).collect(),
                    reward: r,
                    answer: None,
                    truncated: false,
                    teacher_logprobs: None,
                    is_weights: None,
                })
                .collect(),
            majority: None,
            majority_count: 0,
            vote_margin: 0,
        }
    }

    fn values(t: &Tensor) -> Vec<f32> {
        t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
    }

    /// Gives answer j of every group teacher log-probs when j is odd (a mix of data with and without).
    fn with_teacher(mut groups: Vec<Group>) -> Vec<Group> {
        for g in &mut groups {
            for (j, r) in g.responses.iter_mut().enumerate().filter(|(j, _)| j % 2 == 1) {
                r.teacher_logprobs = Some((0..r.tokens.len()).map(|t| -0.2 - 0.7 * ((t + j) % 5) as f32).collect());
            }
        }
        groups
    }

    fn oc(name: ObjectiveName) -> ObjectiveConfig {
        ObjectiveConfig { name, ..Default::default() }
    }

    /// One configuration of every objective (and of the anchors and clipping modes), with a KL term where
    /// the objective takes one.
    fn every_objective() -> Vec<ObjectiveConfig> {
        use crate::objective::{Anchor, ClipMode, RatioLevel};
        let kl = |c: ObjectiveConfig| ObjectiveConfig { beta: 0.1, ..c };
        vec![
            kl(ObjectiveConfig { bias: 0.5, ..oc(ObjectiveName::OffGrpo) }),
            kl(ObjectiveConfig {
                bias: 0.5,
                eps: Some(0.1),
                eps_high: Some(0.3),
                anchor: Some(Anchor::Reference),
                loss_agg: Some(LossAgg::TokenMean),
                ..oc(ObjectiveName::Grpo)
            }),
            ObjectiveConfig { anchor: Some(Anchor::Snapshot), eps: Some(0.05), ..oc(ObjectiveName::Gspo) },
            kl(ObjectiveConfig {
                clip_mode: Some(ClipMode::Ring),
                importance_weight: Some(true),
                anchor: Some(Anchor::Reference),
                ..oc(ObjectiveName::Rec)
            }),
            ObjectiveConfig {
                clip_mode: Some(ClipMode::TwoSide),
                anchor: Some(Anchor::Snapshot),
                ratio_level: Some(RatioLevel::Sequence),
                ..oc(ObjectiveName::Rec)
            },
            ObjectiveConfig { eps: Some(0.6), eps_high: Some(2.0), ..oc(ObjectiveName::Rec) },
            kl(ObjectiveConfig { anchor: Some(Anchor::Snapshot), tau: Some(0.5), ..oc(ObjectiveName::Opmd) }),
            kl(oc(ObjectiveName::Asymre)),
            ObjectiveConfig { loss_agg: Some(LossAgg::SeqMeanTokenSum), ..oc(ObjectiveName::RedDrop) },
            kl(ObjectiveConfig { std_normalize: Some(true), ..oc(ObjectiveName::RedWeight) }),
            ObjectiveConfig { beta2: Some(0.05), ..oc(ObjectiveName::Oapl) },
            ObjectiveConfig { anchor: Some(Anchor::Teacher), ..oc(ObjectiveName::Oapl) },
            kl(ObjectiveConfig { loss_agg: Some(LossAgg::SeqMeanTokenSumNorm), ..oc(ObjectiveName::Sft) }),
            kl(ObjectiveConfig { anchor: Some(Anchor::Reference), ..oc(ObjectiveName::Cispo) }),
            ObjectiveConfig {
                anchor: Some(Anchor::Snapshot),
                clip_ratio_c: Some(1.5),
                scale_rewards: Some(crate::objective::ScaleRewards::Batch),
                ..oc(ObjectiveName::Grpo)
            },
        ]
    }

    /// A tiny trainable policy, and a reference and a snapshot that differ from it (so ratios, masks and
    /// KL are not trivial).
    fn tiny_models() -> [Decoder; 3] {
        let cfg = TinyShape { layers: 2, hidden: 16, heads: 4, kv_heads: 2, intermediate: 24 }
            .config(Arch::Qwen2, 64, None, None)
            .unwrap();
        [(5, true), (6, false), (7, false)]
            .map(|(seed, trainable)| random_decoder(cfg.clone(), seed, DType::F32, &Device::Cpu, trainable).unwrap())
    }

    #[test]
    fn micro_batch_split_never_changes_the_gradient() {
        let [policy, reference, snapshot] = tiny_models();
        let anchors = Anchors { reference: Reference::Model(&reference), snapshot: Some(&snapshot) };
        let groups = with_teacher(vec![
            group(0, &[1.0, 0.0, 1.0, 0.0]),
            group(1, &[1.0, 1.0, 1.0, 1.0]),
            group(2, &[0.0, 1.0, 0.0, 0.0]),
        ]);
        let ctx = StepContext { seed: 3, epoch: 1, step: 0 };
        for oc in every_objective() {
            oc.validate().unwrap();
            let obj = oc.build();
            let name = format!("{oc:?}");
            let batch = build_batch(&groups, obj.as_ref(), Aggregation::of(&oc, 32), ctx);
            let (g1, s1) = compute_gradients(
                &policy,
                anchors,
                obj.as_ref(),
                EntropyTerms::NONE,
                &batch,
                (Batching::Answers(usize::MAX), 0),
            )
            .unwrap();
            assert!(s1.loss.is_finite() && s1.loss != 0.0, "{name}: loss {}", s1.loss);
            for micro in [1, 2, 4] {
                let (g, s) = compute_gradients(
                    &policy,
                    anchors,
                    obj.as_ref(),
                    EntropyTerms::NONE,
                    &batch,
                    (Batching::Answers(micro), 0),
                )
                .unwrap();
                assert!(
                    (s.loss - s1.loss).abs() < 1e-5 * s1.loss.abs().max(1.0),
                    "{name} micro {micro}: loss {} vs {}",
                    s.loss,
                    s1.loss
                );
                assert_eq!(s.clipped_tokens, s1.clipped_tokens, "{name} micro {micro}");
                for (a, b) in g.grads.iter().zip(&g1.grads) {
                    let (a, b) = (values(a.as_ref().unwrap()), values(b.as_ref().unwrap()));
                    let scale = b.iter().map(|x| x.abs()).fold(1e-3f32, f32::max);
                    let d = crate::kernels::testing::abs_diff(&a, &b);
                    assert!(d < 1e-5 * scale.max(1.0), "{name} micro {micro}: gradient differs by {d}");
                }
            }
        }
    }

    /// Gradients equal within `tol` relative to the largest of each tensor (at least 1).
    fn assert_same_gradients(a: &Grads, b: &Grads, tol: f32, name: &str) {
        for (a, b) in a.grads.iter().zip(&b.grads) {
            let (a, b) = (values(a.as_ref().unwrap()), values(b.as_ref().unwrap()));
            let scale = b.iter().map(|x| x.abs()).fold(1e-3f32, f32::max).max(1.0);
            let d = crate::kernels::testing::abs_diff(&a, &b);
            assert!(d < tol * scale, "{name}: gradient differs by {d}");
        }
    }

    /// Packed micro-batches (answers one after the other in rows of a token budget, over several
    /// micro-batches, an answer longer than the budget alone) give the loss, statistics and gradients of
    /// padded ones: for every objective, with the reference model run or its log-probs cached, with layers
    /// recomputed or not, and with the entropy bonus and mask.
    #[test]
    fn packed_micro_batches_give_the_padded_loss_and_gradients() {
        let [mut policy, reference, snapshot] = tiny_models();
        let groups = with_teacher(vec![
            group(0, &[1.0, 0.0, 1.0, 0.0]),
            group(1, &[1.0, 1.0, 1.0, 1.0]),
            group(2, &[0.0, 1.0, 0.0, 0.0, 1.0, 0.0]),
        ]);
        let cached = reference_alone(&reference, &groups);
        let ctx = StepContext { seed: 3, epoch: 1, step: 0 };
        let full = build_batch(&groups, oc(ObjectiveName::Grpo).build().as_ref(), plain(LossAgg::TokenMean), ctx);
        let lengths = answer_lengths(&full.seqs);
        assert_eq!((lengths.len(), *lengths.iter().max().unwrap()), (14, 19));
        let (small, large) = (Batching::Tokens(16), Batching::Tokens(40));
        let rows = small.micro_batches(&lengths);
        assert!(rows.iter().any(|mb| mb[0].len() > 1) && rows.iter().any(|mb| lengths[mb[0][0]] > 16), "{rows:?}");
        assert!(large.micro_batches(&lengths).len() > 2);
        let entropy = EntropyTerms { coeff: 0.05, top_quantile: 0.5 };
        let on_the_fly = Anchors { reference: Reference::Model(&reference), snapshot: Some(&snapshot) };
        let from_cache = Anchors { reference: Reference::Logprobs(&cached), snapshot: Some(&snapshot) };
        for (i, oc) in every_objective().into_iter().enumerate() {
            let obj = oc.build();
            let batch = build_batch(&groups, obj.as_ref(), Aggregation::of(&oc, 32), ctx);
            let anchors = if i % 2 == 0 || !obj.needs_reference() { on_the_fly } else { from_cache };
            let terms = if i % 3 == 0 { entropy } else { EntropyTerms::NONE };
            policy.options.checkpoint_layers = i % 2 == 1;
            let run = |b: Batching| compute_gradients(&policy, anchors, obj.as_ref(), terms, &batch, (b, 0)).unwrap();
            let (g0, s0) = run(Batching::Answers(3));
            assert!(s0.loss.is_finite() && s0.loss != 0.0, "{oc:?}: loss {}", s0.loss);
            for packed in [small, large] {
                let name = format!("{oc:?} {packed:?}");
                let (g, s) = run(packed);
                assert!((s.loss - s0.loss).abs() < 1e-5 * s0.loss.abs().max(1.0), "{name}: {} vs {}", s.loss, s0.loss);
                assert!((s.kl - s0.kl).abs() < 1e-5 * s0.kl.abs().max(1.0), "{name}: kl {} vs {}", s.kl, s0.kl);
                assert!((s.entropy_sum - s0.entropy_sum).abs() < 1e-4 * s0.entropy_sum.abs(), "{name}");
                assert_eq!(
                    (s.clipped_tokens, s.response_tokens, s.tokens, s.ratio.tokens),
                    (s0.clipped_tokens, s0.response_tokens, s0.tokens, s0.ratio.tokens),
                    "{name}"
                );
                assert_same_gradients(&g, &g0, 1e-5, &name);
            }
        }
    }

    /// A whole step with packed micro-batches updates the policy as with padded ones (SGD: the update is
    /// the gradient's, so the weights' difference is the gradients').
    #[test]
    fn a_packed_step_updates_the_weights_as_a_padded_one() {
        let cfg = TinyShape { layers: 2, hidden: 16, heads: 4, kv_heads: 2, intermediate: 24 }
            .config(Arch::Qwen2, 64, None, None)
            .unwrap();
        let make = || random_decoder(cfg.clone(), 5, DType::F32, &Device::Cpu, true).unwrap();
        let (a, mut b, before) = (make(), make(), params(&make()));
        b.options.checkpoint_layers = true;
        let groups = vec![group(0, &[1.0, 0.0, 1.0, 0.0, 1.0]), group(1, &[0.0, 1.0, 1.0])];
        let obj = ObjectiveConfig { loss_agg: Some(LossAgg::SeqMeanTokenMean), beta: 0.1, ..oc(ObjectiveName::Grpo) };
        let optim = crate::train::optim::OptimConfig {
            name: crate::train::optim::OptimName::Sgd,
            lr: 0.5,
            ..Default::default()
        };
        let reference = random_decoder(cfg.clone(), 6, DType::F32, &Device::Cpu, false).unwrap();
        let mut padded = TrainStep::new(&obj, &optim, &a, 2, 32, 0).unwrap();
        let mut packed = TrainStep::new(&obj, &optim, &b, 2, 32, 0).unwrap();
        packed.set_batching(Batching::of(2, 24));
        let ra = padded.run(&a, Some(&reference), &groups, 0.5).unwrap();
        let rb = packed.run(&b, Some(&reference), &groups, 0.5).unwrap();
        assert!(ra.applied && rb.applied && (ra.stats.loss - rb.stats.loss).abs() < 1e-6, "{ra:?} vs {rb:?}");
        assert!((ra.grad_norm - rb.grad_norm).abs() < 1e-5 * ra.grad_norm, "{} vs {}", ra.grad_norm, rb.grad_norm);
        let mut moved = 0f32;
        for ((x, y), x0) in params(&a).iter().zip(params(&b)).zip(&before) {
            moved = x.iter().zip(x0).map(|(p, q)| (p - q).abs()).fold(moved, f32::max);
            let d = crate::kernels::testing::abs_diff(x, &y);
            assert!(d <= 1e-6, "the weights differ by {d}");
        }
        assert!(moved > 1e-3, "the step moved the weights by {moved} at most");
    }

    /// The reference's log-probs of every answer of `groups`, each answer scored alone.
    fn reference_alone(reference: &Decoder, groups: &[Group]) -> Vec<Vec<Vec<f32>>> {
        let alone = |g: &Group, r: &Response| {
            let full = [g.prompt_tokens.as_slice(), &r.tokens].concat();
            let mut t = Targets::default();
            (0..r.tokens.len()).for_each(|j| t.push(0, g.prompt_tokens.len() + j));
            values(
                &reference.token_logprobs(&TokenBatch::padded(&[full], 0), &t, false).unwrap().narrow(1, 0, 1).unwrap(),
            )
        };
        groups.iter().map(|g| g.responses.iter().map(|r| alone(g, r)).collect()).collect()
    }

    /// Cached reference log-probs (each answer scored alone, plus values past its end as an answer cut
    /// shorter than the cache would have) give the loss and gradients of the reference model run on each
    /// micro-batch: bitwise with one sequence per micro-batch (the same forward), within 1e-5 (relative)
    /// when a micro-batch pads several sequences together.
    #[test]
    fn cached_reference_logprobs_give_the_reference_models_loss_and_gradients() {
        let [policy, reference, snapshot] = tiny_models();
        let groups = with_teacher(vec![group(0, &[1.0, 0.0, 1.0, 0.0]), group(1, &[0.0, 1.0, 0.0, 0.0])]);
        let mut cached = reference_alone(&reference, &groups);
        cached.iter_mut().flatten().for_each(|a| a.extend([-1.5, -2.5]));
        let on_the_fly = Anchors { reference: Reference::Model(&reference), snapshot: Some(&snapshot) };
        let from_cache = Anchors { reference: Reference::Logprobs(&cached), snapshot: Some(&snapshot) };
        let ctx = StepContext { seed: 3, epoch: 0, step: 0 };
        let mut checked = 0;
        for oc in every_objective().into_iter().filter(|o| o.build().needs_reference()) {
            let obj = oc.build();
            let batch = build_batch(&groups, obj.as_ref(), Aggregation::of(&oc, 32), ctx);
            for (micro, tol) in [(1, 0.0), (3, 1e-5)] {
                let (ga, sa) = compute_gradients(
                    &policy,
                    on_the_fly,
                    obj.as_ref(),
                    EntropyTerms::NONE,
                    &batch,
                    (Batching::Answers(micro), 0),
                )
                .unwrap();
                let (gb, sb) = compute_gradients(
                    &policy,
                    from_cache,
                    obj.as_ref(),
                    EntropyTerms::NONE,
                    &batch,
                    (Batching::Answers(micro), 0),
                )
                .unwrap();
                let name = format!("{oc:?} micro {micro}");
                let close = |a: f64, b: f64| (a - b).abs() <= tol * a.abs().max(1.0);
                assert!(close(sa.loss, sb.loss) && close(sa.kl, sb.kl), "{name}: {sa:?} vs {sb:?}");
                assert!(sa.loss != 0.0 && (oc.beta == 0.0 || sa.kl != 0.0), "{name}: trivial loss {sa:?}");
                for (a, b) in ga.grads.iter().zip(&gb.grads) {
                    let (a, b) = (values(a.as_ref().unwrap()), values(b.as_ref().unwrap()));
                    let scale = a.iter().map(|x| x.abs()).fold(1e-3f32, f32::max).max(1.0);
                    let d = crate::kernels::testing::abs_diff(&a, &b);
                    assert!(d <= tol as f32 * scale, "{name}: gradients differ by {d}");
                }
            }
            checked += 1;
        }
        assert!(checked >= 4, "only {checked} objectives read the reference");
        // Fewer cached values than answer tokens is an error, not a silent zero.
        let short: Vec<Vec<Vec<f32>>> = vec![vec![vec![-1.0]; 4]; 2];
        let anchors = Anchors { reference: Reference::Logprobs(&short), snapshot: None };
        let kl = ObjectiveConfig { beta: 0.1, ..Default::default() };
        let batch = build_batch(&groups, kl.build().as_ref(), Aggregation::of(&kl, 32), ctx);
        let e = compute_gradients(
            &policy,
            anchors,
            kl.build().as_ref(),
            EntropyTerms::NONE,
            &batch,
            (Batching::Answers(2), 0),
        )
        .err()
        .map(|e| e.to_string());
        assert!(e.as_ref().is_some_and(|e| e.contains("1 values for")), "{e:?}");
    }

    #[test]
    fn a_step_updates_the_policy_and_needs_a_reference_exactly_with_kl() {
        let cfg = TinyShape { layers: 1, hidden: 16, heads: 4, kv_heads: 2, intermediate: 24 }
            .config(Arch::Llama, 64, None, None)
            .unwrap();
        let policy = random_decoder(cfg, 3, DType::F32, &Device::Cpu, true).unwrap();
        let reference = policy.frozen_copy().unwrap();
        let groups = vec![group(0, &[1.0, 0.0, 1.0, 0.0])];
        let with_kl = ObjectiveConfig { beta: 0.1, ..Default::default() };
        let optim = crate::train::optim::OptimConfig { lr: 1e-2, ..Default::default() };
        let mut step = TrainStep::new(&with_kl, &optim, &policy, 2, 32, 0).unwrap();
        assert!(step.needs_reference());
        assert!(step.run(&policy, None, &groups, 1e-2).unwrap_err().to_string().contains("reference"));
        let before = values(policy.vars()[0].as_tensor());
        let report = step.run(&policy, Some(&reference), &groups, 1e-2).unwrap();
        assert!(report.applied && report.grad_norm > 0.0 && report.stats.kl.abs() < 1e-6);
        assert_eq!(report.rewards.questions, 1);
        assert_ne!(values(policy.vars()[0].as_tensor()), before, "the update changed nothing");
        let mut no_kl = TrainStep::new(&ObjectiveConfig::default(), &optim, &policy, 2, 32, 0).unwrap();
        assert!(!no_kl.needs_reference());
        assert!(no_kl.run(&policy, Some(&reference), &groups, 1e-2).is_err());
        assert_eq!(no_kl.run(&policy, None, &groups, 1e-2).unwrap().stats.kl, 0.0);
        // The reference as anchor, without a KL term: loaded, but no KL.
        let anchored = ObjectiveConfig { anchor: Some(crate::objective::Anchor::Reference), ..oc(ObjectiveName::Oapl) };
        let mut step = TrainStep::new(&anchored, &optim, &policy, 2, 32, 0).unwrap();
        assert!(step.needs_reference());
        let report = step.run(&policy, Some(&reference), &groups, 1e-2).unwrap();
        assert!(report.applied && report.stats.kl == 0.0 && report.stats.loss > 0.0);
    }

    /// The entropy bonus's gradient, -coeff d/dtheta sum_t w_t H_t, against central finite differences
    /// of the aggregated entropy on a tiny model (through the fused log-prob op's entropy backward).
    #[test]
    fn the_entropy_bonus_gradient_agrees_with_finite_differences() {
        let [policy, _, _] = tiny_models();
        let groups = vec![group(0, &[1.0, 0.0, 1.0]), group(1, &[0.0, 1.0])];
        let cfg = ObjectiveConfig { entropy_coeff: 0.5, ..oc(ObjectiveName::Grpo) };
        assert_eq!(cfg.validate(), Ok(()));
        let obj = cfg.build();
        let batch = build_batch(&groups, obj.as_ref(), Aggregation::of(&cfg, 32), StepContext::default());
        let none = Anchors { reference: Reference::None, snapshot: None };
        let (g0, s0) =
            compute_gradients(&policy, none, obj.as_ref(), EntropyTerms::NONE, &batch, (Batching::Answers(2), 0))
                .unwrap();
        let (g1, s1) =
            compute_gradients(&policy, none, obj.as_ref(), EntropyTerms::of(&cfg), &batch, (Batching::Answers(2), 0))
                .unwrap();
        // The aggregated entropy sum_t w_t H_t of the batch.
        let aggregated = || -> f64 {
            let mut total = 0f64;
            for chunk in batch.seqs.chunks(2) {
                let (tb, targets, inputs, _) =
                    micro_inputs(&chunk.iter().map(|s| vec![s]).collect::<Vec<_>>(), 0, &Device::Cpu).unwrap();
                let lp = policy.token_logprobs(&tb, &targets, false).unwrap();
                let h = lp.narrow(1, 1, 1).unwrap().squeeze(1).unwrap();
                total += (h * &inputs.weights).unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap() as f64;
            }
            total
        };
        assert!((s1.loss - (s0.loss - 0.5 * aggregated())).abs() < 1e-5, "{} vs {}", s1.loss, s0.loss);
        let eps = 1e-2f32;
        let mut checked = 0;
        for (pi, param) in policy.params().iter().enumerate() {
            let crate::model::Param::Trainable(var) = param else { continue };
            let diff = values(&(g1.grads[pi].as_ref().unwrap() - g0.grads[pi].as_ref().unwrap()).unwrap());
            let x0 = values(var.as_tensor());
            let idx = (pi * 7) % x0.len();
            let at = |d: f32| {
                let mut x = x0.clone();
                x[idx] += d;
                var.set(&Tensor::from_vec(x, var.shape(), &Device::Cpu).unwrap()).unwrap();
                aggregated()
            };
            let fd = (at(eps) - at(-eps)) / (2.0 * eps as f64);
            var.set(&Tensor::from_vec(x0, var.shape(), &Device::Cpu).unwrap()).unwrap();
            let want = -0.5 * fd;
            assert!(
                (diff[idx] as f64 - want).abs() < 2e-3 * want.abs().max(0.05),
                "parameter {pi}[{idx}]: backward {} vs finite differences {want}",
                diff[idx]
            );
            checked += usize::from(want.abs() > 1e-4);
        }
        assert!(checked >= 3, "only {checked} parameters had a measurable entropy gradient");
    }

    /// top_entropy_quantile: the step's gradient is that of the same batch whose answers carry, as their
    /// policy-term weights, each answer's high-entropy mask from the policy's own entropies.
    #[test]
    fn the_high_entropy_mask_keeps_each_answers_top_tokens_in_the_policy_loss() {
        let [policy, reference, _] = tiny_models();
        let groups = vec![group(0, &[1.0, 0.0, 1.0]), group(1, &[0.0, 1.0])];
        let cfg = ObjectiveConfig { top_entropy_quantile: Some(0.3), beta: 0.1, ..oc(ObjectiveName::Grpo) };
        let obj = cfg.build();
        let mut batch = build_batch(&groups, obj.as_ref(), Aggregation::of(&cfg, 32), StepContext::default());
        let anchors = Anchors { reference: Reference::Model(&reference), snapshot: None };
        let (g, s) = compute_gradients(
            &policy,
            anchors,
            obj.as_ref(),
            EntropyTerms::of(&cfg),
            &batch,
            (Batching::Answers(2), 0),
        )
        .unwrap();
        let mut kept = 0f32;
        for seq in batch.seqs.iter_mut() {
            let (tb, targets, _, _) = micro_inputs(&[vec![&*seq]], 0, &Device::Cpu).unwrap();
            let lp = policy.token_logprobs(&tb, &targets, false).unwrap();
            let h = values(&lp.narrow(1, 1, 1).unwrap().squeeze(1).unwrap());
            let mask = crate::objective::top_entropy_mask(&h, &[h.len()], 0.3);
            kept += mask.iter().sum::<f32>();
            seq.is_weights = Some(mask);
        }
        let total: usize = batch.seqs.iter().map(|s| s.response.len()).sum();
        assert!(kept > 0.0 && (kept as usize) < total / 2, "{kept} of {total} tokens kept");
        let (g_ref, s_ref) =
            compute_gradients(&policy, anchors, obj.as_ref(), EntropyTerms::NONE, &batch, (Batching::Answers(3), 0))
                .unwrap();
        assert!((s.loss - s_ref.loss).abs() < 1e-6 && (s.kl - s_ref.kl).abs() < 1e-7, "{s:?} vs {s_ref:?}");
        for (a, b) in g.grads.iter().zip(&g_ref.grads) {
            if let (Some(a), Some(b)) = (a, b) {
                let d = (a - b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
                assert!(d < 1e-6, "gradient differs by {d}");
            }
        }
    }

    fn plain(agg: LossAgg) -> Aggregation {
        Aggregation { agg, norm_len: 0, mask_truncated: false }
    }

    fn params(m: &Decoder) -> Vec<Vec<f32>> {
        m.named_tensors().iter().map(|(_, t)| values(t)).collect()
    }

    #[test]
    fn the_snapshot_anchor_is_the_policy_at_the_last_multiple_of_anchor_every() {
        let cfg = TinyShape { layers: 1, hidden: 16, heads: 4, kv_heads: 2, intermediate: 24 }
            .config(Arch::Llama, 64, None, None)
            .unwrap();
        let policy = random_decoder(cfg, 4, DType::F32, &Device::Cpu, true).unwrap();
        let groups = vec![group(0, &[1.0, 0.0, 1.0, 0.0])];
        let oapl = ObjectiveConfig { anchor_every: Some(2), beta2: Some(0.1), ..oc(ObjectiveName::Oapl) };
        let optim = crate::train::optim::OptimConfig { lr: 1e-2, ..Default::default() };
        let mut step = TrainStep::new(&oapl, &optim, &policy, 2, 32, 0).unwrap();
        assert_eq!(step.snapshot_every(), Some(2));
        let ctx = |step| StepContext { seed: 0, epoch: 0, step };
        // A run resumed at step 1 with no snapshot restored must not invent one.
        assert!(step.run_at(&policy, None, &groups, 1e-2, ctx(1)).unwrap_err().to_string().contains("snapshot"));
        let at0 = params(&policy);
        let r0 = step.run_at(&policy, None, &groups, 1e-2, ctx(0)).unwrap();
        // At the refresh the anchor is the policy itself: the log-ratio is 0, the loss sum_i w_i A_i^2.
        assert!(r0.applied && r0.stats.loss > 0.0);
        assert_eq!(params(step.snapshot().unwrap()), at0);
        let r1 = step.run_at(&policy, None, &groups, 1e-2, ctx(1)).unwrap();
        assert_eq!(params(step.snapshot().unwrap()), at0, "refreshed before anchor_every steps");
        assert_ne!(r1.stats.loss, r0.stats.loss);
        let at2 = params(&policy);
        assert_ne!(at2, at0);
        step.run_at(&policy, None, &groups, 1e-2, ctx(2)).unwrap();
        assert_eq!(params(step.snapshot().unwrap()), at2);
        assert!(TrainStep::new(&oc(ObjectiveName::Grpo), &optim, &policy, 2, 32, 0)
            .unwrap()
            .snapshot_every()
            .is_none());
    }

    #[test]
    fn red_drop_keeps_balanced_groups_chosen_by_seed_question_and_epoch() {
        let obj = oc(ObjectiveName::RedDrop).build();
        let groups = vec![group(0, &[1.0, 0.0, 0.0, 0.0, 0.0, 0.0]), group(1, &[1.0, 1.0, 0.0, 1.0])];
        let kept = |ctx: StepContext| {
            let b = build_batch(&groups, obj.as_ref(), plain(LossAgg::TokenMean), ctx);
            b.seqs.iter().map(|s| (s.response.clone(), s.advantage)).collect::<Vec<_>>()
        };
        let a = kept(StepContext { seed: 1, epoch: 0, step: 0 });
        // Group 0: one positive and one of the five negatives; group 1 (more positives) keeps all four.
        assert_eq!(a.len(), 2 + 4);
        assert_eq!(a[0].1, 0.5);
        assert_eq!(a[1].1, -0.5);
        assert_eq!(a, kept(StepContext { seed: 1, epoch: 0, step: 5 }), "the choice must not depend on the step");
        let choices: std::collections::BTreeSet<Vec<u32>> = (0..8)
            .flat_map(|e| (0..4).map(move |s| StepContext { seed: s, epoch: e, step: 0 }))
            .map(|c| kept(c)[1].0.clone())
            .collect();
        assert!(choices.len() > 2, "the dropped answers do not vary with seed and epoch: {choices:?}");
    }

    #[test]
    fn mask_truncated_and_batch_scaling_act_on_the_whole_batch() {
        let mut groups = vec![group(0, &[1.0, 0.0, 1.0, 0.0]), group(1, &[1.0, 1.0, 1.0, 0.0])];
        groups[0].responses[0].truncated = true;
        groups[1].responses[3].truncated = true;
        let cfg = ObjectiveConfig {
            mask_truncated: Some(true),
            scale_rewards: Some(crate::objective::ScaleRewards::Batch),
            loss_agg: Some(LossAgg::TokenMean),
            ..oc(ObjectiveName::Grpo)
        };
        let b = build_batch(&groups, cfg.build().as_ref(), Aggregation::of(&cfg, 32), StepContext::default());
        assert_eq!((b.seqs.len(), b.rewards.masked_truncated), (6, 2));
        assert!(b.seqs.iter().all(|s| s.origin != (0, 0) && s.origin != (1, 3)));
        // The cut answers still count in their group's advantages: group 1's mean is 0.75, and the std is
        // that of all 8 rewards (5 ones, 3 zeros).
        let batch_std = (5.0f64 * 0.375f64.powi(2) + 3.0 * 0.625f64.powi(2)) / 7.0;
        let a = b.seqs.iter().find(|s| s.origin == (1, 0)).unwrap().advantage as f64;
        assert!((a - 0.25 / (batch_std.sqrt() + 1e-6)).abs() < 1e-5, "{a}");
        // Token-mean over the kept answers' tokens only.
        let tokens: usize = b.seqs.iter().map(|s| s.response.len()).sum();
        assert!(b.seqs.iter().all(|s| (s.weight - 1.0 / tokens as f32).abs() < 1e-9));
        let off = ObjectiveConfig { loss_agg: Some(LossAgg::TokenMean), ..oc(ObjectiveName::Grpo) };
        let b = build_batch(&groups, off.build().as_ref(), Aggregation::of(&off, 32), StepContext::default());
        assert_eq!((b.seqs.len(), b.rewards.masked_truncated), (8, 0));
    }

    #[test]
    fn batch_statistics_and_weights() {
        let oc = ObjectiveConfig { bias: 0.5, ..Default::default() };
        let obj = oc.build();
        let groups = vec![group(0, &[1.0, 0.0, 1.0, 0.0]), group(1, &[1.0; 4])];
        let b = build_batch(&groups, obj.as_ref(), plain(LossAgg::SeqMeanTokenMean), StepContext::default());
        assert_eq!(b.seqs.len(), 8);
        assert!((b.rewards.reward_mean - 0.75).abs() < 1e-6);
        assert_eq!(b.rewards.frac_bias_applied, 0.5);
        assert_eq!(b.rewards.frac_reward_zero_std, 0.5);
        // Each answer's weights sum to 1/8.
        for s in &b.seqs {
            assert!((s.weight * s.response.len() as f32 - 0.125).abs() < 1e-6);
        }
        assert!(b.seqs[4..].iter().all(|s| s.advantage == 0.5));
    }
}
