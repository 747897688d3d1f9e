//! The losses: group-relative advantages, loss aggregation, KL estimators, and the objectives behind one
//! trait, chosen by `objective.name`:
//!
//! | name | seed | family | file |
//! |---|---|---|---|
//! | `off_grpo` | 000 | clipped ratio to the teacher (probability 1) | [`clipped`] |
//! | `grpo` | 000 (baseline) | clipped ratio to the policy at the start of the step (1 on teacher data: group-relative REINFORCE on teacher answers); on-policy GRPO with `anchor = "behaviour"` and `[rollout]` | [`clipped`] |
//! | `gspo` | 004 (B.7) | clipped sequence-level ratio | [`clipped`] |
//! | `rec` | 004 | REINFORCE with one-side / two-side / ring clipping masks, IS or NOIS | [`clipped`] |
//! | `opmd` | 004 | REINFORCE + (tau / 2) squared sequence log-ratio | [`reinforce`] |
//! | `asymre` | 004 | REINFORCE with the baseline mean(r) - shift | [`reinforce`] |
//! | `red_drop` | 004 | REINFORCE on the group with its excess negatives dropped | [`reinforce`] |
//! | `red_weight` | 004 | REINFORCE with weights exp(A / T) | [`reinforce`] |
//! | `sft` | 000 (baseline) | log-likelihood of the positive answers | [`reinforce`] |
//! | `oapl` | 003 | squared regression of the sequence log-ratio onto r - V* | [`oapl`] |
//! | `cispo` | MiniMax-M1 | REINFORCE weighted by the clipped, gradient-stopped ratio | [`clipped`] |
//!
//! Every per-token quantity is f32. Aggregation is expressed as one weight per token computed from the
//! whole batch (see [`LossAgg::weights`]), so the loss is a plain weighted sum: splitting a batch into
//! micro-batches and adding their losses never changes the gradient. Sequence-level terms (sums or means
//! of a sequence's tokens: GSPO's ratio, OPMD's and OAPL's squared terms) are exact too, because a
//! micro-batch holds whole sequences; each such term is weighted by its sequence's token weight.
//!
//! Every `exp` of a log-ratio (or of A / T) first clamps its argument to [-20, 20] (as verl does): a large
//! log-prob gap gives a clipped, finite value with no gradient instead of inf or NaN.

pub mod clipped;
mod config;
mod mask;
pub mod oapl;
mod options;
pub mod reinforce;

use candle_core::{DType, Device, Result, Tensor};
use serde::{Deserialize, Serialize};

pub use config::ObjectiveConfig;
pub use options::{
    Anchor, AsymReOptions, CispoOptions, ClipMode, CommonOptions, OaplOptions, ObjectiveKind, ObjectiveName,
    OpmdOptions, PpoOptions, RatioLevel, RecOptions, RedDropOptions, RedWeightOptions, ScaleRewards, SftAnswers,
    SftOptions,
};

/// The bound of every log-ratio before `exp` (verl's clamp).
pub const MAX_LOG_RATIO: f32 = 20.0;

/// `exp(clamp(x, -20, 20))`: where `|x| > 20` the value is that of the bound and carries no gradient;
/// elsewhere the gradient is the usual `exp(x)`.
pub fn exp_clamped(x: &Tensor) -> Result<Tensor> {
    let v = x.detach();
    let inside = v.abs()?.le(MAX_LOG_RATIO as f64)?;
    let bounded = v.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)?;
    inside.where_cond(x, &bounded)?.exp()
}

/// How per-token losses are averaged into the batch loss (verl's `loss_agg_mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LossAgg {
    /// Mean over all response tokens of the batch.
    TokenMean,
    /// Mean over answers of each answer's token mean (the seed's 1/G sum_i 1/|o_i| sum_t).
    SeqMeanTokenMean,
    /// Mean over answers of each answer's token sum.
    SeqMeanTokenSum,
    /// Mean over answers of the token sum divided by a constant length (Dr. GRPO).
    SeqMeanTokenSumNorm,
}

impl LossAgg {
    /// The weight of each token of each answer: `lengths[i]` tokens for answer i, answers with
    /// `include[i] = false` get weight 0 and are not counted. `norm_len` is the constant of
    /// seq-mean-token-sum-norm (the maximum response length).
    pub fn weights(self, lengths: &[usize], include: &[bool], norm_len: usize) -> Vec<f32> {
        let seqs = include.iter().filter(|&&b| b).count().max(1) as f64;
        let tokens: usize = lengths.iter().zip(include).filter(|(_, &b)| b).map(|(l, _)| l).sum();
        lengths
            .iter()
            .zip(include)
            .map(|(&l, &inc)| {
                if !inc || l == 0 {
                    return 0.0;
                }
                (match self {
                    LossAgg::TokenMean => 1.0 / tokens.max(1) as f64,
                    LossAgg::SeqMeanTokenMean => 1.0 / (seqs * l as f64),
                    LossAgg::SeqMeanTokenSum => 1.0 / seqs,
                    LossAgg::SeqMeanTokenSumNorm => 1.0 / (seqs * norm_len.max(1) as f64),
                }) as f32
            })
            .collect()
    }
}

/// KL(pi_theta || pi_ref) estimators on the sampled token (Schulman's k1, k2, k3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KlEstimator {
    /// k1 = log p - log p_ref
    K1,
    /// k2 = (log p - log p_ref)^2 / 2
    K2,
    /// k3 = p_ref/p - log(p_ref/p) - 1, clamped to [-10, 10] as in verl
    K3,
}

impl KlEstimator {
    /// Per-token KL estimate (differentiable in `logp`).
    pub fn per_token(self, logp: &Tensor, ref_logp: &Tensor) -> Result<Tensor> {
        let diff = (logp - ref_logp)?; // log p - log p_ref
        match self {
            KlEstimator::K1 => Ok(diff),
            KlEstimator::K2 => diff.sqr()? * 0.5,
            KlEstimator::K3 => {
                let d = diff.neg()?; // log(p_ref / p)
                let k3 = ((exp_clamped(&d)? - &d)? - 1.0)?;
                // Clamp like verl; outside the range the value is constant and carries no gradient.
                let v = k3.detach();
                let inside = v.abs()?.le(10f64)?;
                inside.where_cond(&k3, &v.clamp(-10f32, 10f32)?)
            }
        }
    }
}

/// Group-relative advantage options.
#[derive(Debug, Clone, PartialEq)]
pub struct AdvantageConfig {
    /// Divide by a standard deviation (unbiased, + 1e-6): the group's as GRPO does, or `batch_std`.
    pub std_normalize: bool,
    /// The all-positive bias b: when every reward of a group is positive, A_i + b is used.
    pub bias: f32,
    /// With `std_normalize`, divide by this (the standard deviation of the step's rewards: TRL's
    /// `scale_rewards = "batch"`) instead of the group's.
    pub batch_std: Option<f64>,
}

/// Reward statistics of one group: the mean and the unbiased standard deviation (0 for one answer).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RewardStats {
    pub mean: f64,
    pub std: f64,
}

impl RewardStats {
    pub fn of(rewards: &[f32]) -> Self {
        let n = rewards.len();
        if n == 0 {
            return Self { mean: 0.0, std: 0.0 };
        }
        let mean = rewards.iter().map(|&r| r as f64).sum::<f64>() / n as f64;
        let var =
            if n > 1 { rewards.iter().map(|&r| (r as f64 - mean).powi(2)).sum::<f64>() / (n - 1) as f64 } else { 0.0 };
        Self { mean, std: var.sqrt() }
    }
}

/// Where a group is within a run: what identifies it (the source of RED-Drop's seeded random choice, so a
/// resumed run drops the same answers) and the statistics of the step's batch it belongs to.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct GroupKey<'a> {
    /// The run's seed (`train.seed`).
    pub seed: u64,
    pub epoch: usize,
    /// The question's id.
    pub question: &'a str,
    /// The unbiased standard deviation of every reward of the step's batch (`scale_rewards = "batch"`).
    pub batch_reward_std: f64,
}

/// The advantages of one group's answers, which answers take part in the loss, and the reward statistics
/// they come from.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupAdvantages {
    /// Per answer: the factor of its log-prob gradient (OAPL: its regression target r_i - V*).
    pub advantages: Vec<f32>,
    /// Per answer: whether it is in the loss (`sft`: the positive answers; `red_drop`: the kept ones).
    pub include: Vec<bool>,
    pub rewards: RewardStats,
    /// Whether the all-positive bias was added.
    pub bias_applied: bool,
}

/// Group-relative advantages of one group's rewards: `(r_i - mean) / (std + 1e-6)` (or `r_i - mean`; std the
/// group's, or the batch's with `cfg.batch_std`), plus
/// the all-positive bias b when every reward is positive. Every answer is included.
pub fn group_advantages(rewards: &[f32], cfg: &AdvantageConfig) -> GroupAdvantages {
    let stats = RewardStats::of(rewards);
    let mut advantages: Vec<f32> = rewards
        .iter()
        .map(|&r| {
            let centred = r as f64 - stats.mean;
            let std = cfg.batch_std.unwrap_or(stats.std);
            (if cfg.std_normalize { centred / (std + 1e-6) } else { centred }) as f32
        })
        .collect();
    let all_positive = !rewards.is_empty() && rewards.iter().all(|&r| r > 0.0);
    let bias_applied = all_positive && cfg.bias != 0.0;
    if bias_applied {
        advantages.iter_mut().for_each(|a| *a += cfg.bias);
    }
    GroupAdvantages { advantages, include: vec![true; rewards.len()], rewards: stats, bias_applied }
}

/// Per-token inputs of a loss for one micro-batch of `n` response tokens in `m` whole sequences.
pub struct TokenInputs {
    /// `[n]` f32: advantage of the token's answer.
    pub advantages: Tensor,
    /// `[n]` f32: aggregation weight of the token (from [`LossAgg::weights`] over the whole batch).
    pub weights: Tensor,
    /// `[n]` u32: index (0..m) of the token's sequence in the micro-batch.
    pub seq: Tensor,
    /// `[m]` f32: number of tokens of each sequence.
    pub seq_lengths: Tensor,
    /// `[n]` log-probs under the frozen reference: the KL term is present exactly when they are.
    pub ref_logp: Option<Tensor>,
    /// `[n]` behaviour (anchor) log-probs, as the objective's [`Anchor`] says; `None` is the teacher's
    /// probability 1 (log-prob 0).
    pub behaviour_logp: Option<Tensor>,
    /// `[n]` f32: the sampler correction's weight of each token's policy term (TIS / MIS, see
    /// `rollout.importance_sampling_correction`), a constant; `None`: 1. It multiplies the per-token
    /// policy losses summed by every objective (not the KL term, nor OPMD's and OAPL's squared
    /// sequence terms).
    pub is_weights: Option<Tensor>,
}

impl TokenInputs {
    /// Inputs for whole sequences of `lengths` tokens, each with one advantage and one token weight; no
    /// reference and probability-1 behaviour (set those fields afterwards).
    pub fn for_sequences(lengths: &[usize], advantages: &[f32], weights: &[f32], device: &Device) -> Result<Self> {
        let n: usize = lengths.iter().sum();
        let mut seq = Vec::with_capacity(n);
        let (mut adv, mut w) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for (i, &l) in lengths.iter().enumerate() {
            seq.extend(std::iter::repeat_n(i as u32, l));
            adv.extend(std::iter::repeat_n(advantages[i], l));
            w.extend(std::iter::repeat_n(weights[i], l));
        }
        let m = lengths.len();
        Ok(Self {
            advantages: crate::device::from_host(adv, n, device)?,
            weights: crate::device::from_host(w, n, device)?,
            seq: crate::device::from_host(seq, n, device)?,
            seq_lengths: crate::device::from_host(lengths.iter().map(|&l| l as f32).collect::<Vec<_>>(), m, device)?,
            ref_logp: None,
            behaviour_logp: None,
            is_weights: None,
        })
    }

    /// Per-sequence sums `[m]` of a per-token tensor `[n]` (differentiable).
    pub fn seq_sum(&self, x: &Tensor) -> Result<Tensor> {
        self.seq_lengths.zeros_like()?.index_add(&self.seq, &x.contiguous()?, 0)
    }

    /// Per-sequence means `[m]` of a per-token tensor `[n]` (differentiable).
    pub fn seq_mean(&self, x: &Tensor) -> Result<Tensor> {
        self.seq_sum(x)?.div(&self.seq_lengths.clamp(1f32, f32::MAX)?)
    }

    /// A per-sequence tensor `[m]` repeated on each of its tokens `[n]`.
    pub fn per_token(&self, x: &Tensor) -> Result<Tensor> {
        x.index_select(&self.seq, 0)
    }

    /// The log-ratio `log pi_theta - log pi_behaviour` per token (the policy's log-prob itself when the
    /// behaviour is the teacher's probability 1).
    pub fn log_ratio(&self, logp: &Tensor) -> Result<Tensor> {
        match &self.behaviour_logp {
            Some(b) => logp - b,
            None => Ok(logp.clone()),
        }
    }
}

/// A loss and its parts for one micro-batch. Weighted sums, so micro-batch values add up. Every part is
/// an f32 scalar on the loss's device, never read here: the step adds them up on the device and reads them
/// once, at its end.
pub struct LossTerms {
    /// The scalar to differentiate.
    pub loss: Tensor,
    /// Weighted policy part (everything but the KL term), detached.
    pub pg_loss: Tensor,
    /// Weighted KL part (before beta), detached; `None` without a KL term (0).
    pub kl: Option<Tensor>,
    /// Number of tokens whose ratio was clipped or masked (no gradient); `None`: none can be.
    pub clipped_tokens: Option<Tensor>,
}

/// A training objective.
pub trait Objective: Send + Sync {
    /// The name it is chosen by.
    fn name(&self) -> &'static str;
    /// Whether the loss has a KL term to the frozen reference (beta > 0).
    fn needs_kl(&self) -> bool;
    /// Where its behaviour log-probs come from (`None`: the loss reads none).
    fn anchor(&self) -> Option<Anchor> {
        None
    }
    /// Whether the trainer must load the frozen reference: for the KL term or as the anchor.
    fn needs_reference(&self) -> bool {
        self.needs_kl() || self.anchor() == Some(Anchor::Reference)
    }
    /// Advantages of a group and which of its answers are in the loss, with its reward statistics.
    fn advantages(&self, rewards: &[f32], key: &GroupKey) -> GroupAdvantages;
    /// The micro-batch loss from the policy's per-token log-probs `logp` (`[n]`, with a graph).
    fn loss(&self, logp: &Tensor, inputs: &TokenInputs) -> Result<LossTerms>;
}

/// Add `beta * sum_t w_t KL_t` to the weighted policy part `pg_sum` when reference log-probs are given.
fn finish(
    pg_sum: Tensor,
    logp: &Tensor,
    inputs: &TokenInputs,
    beta: f32,
    kl_est: KlEstimator,
    clipped: Option<Tensor>,
) -> Result<LossTerms> {
    let (loss, kl) = match &inputs.ref_logp {
        Some(r) => {
            let kl = (kl_est.per_token(logp, r)? * &inputs.weights)?.sum_all()?;
            let loss = (&pg_sum + (&kl * beta as f64)?)?;
            (loss, Some(kl.detach()))
        }
        None => (pg_sum.clone(), None),
    };
    Ok(LossTerms { pg_loss: pg_sum.detach(), kl, loss, clipped_tokens: clipped })
}

/// The entropy bonus `-coeff sum_t w_t H_t` of the per-token entropies `entropy` (`[n]`, with a graph):
/// the objective's aggregation of the entropy, to add to its loss (verl's `entropy_coeff`).
pub fn entropy_bonus(entropy: &Tensor, inputs: &TokenInputs, coeff: f32) -> Result<Tensor> {
    (entropy * &inputs.weights)?.sum_all()? * -(coeff as f64)
}

/// TRL's high-entropy token mask, per answer: 1 for the tokens of each answer (`lengths[i]` consecutive
/// values of `entropy`) whose entropy is at or above the answer's `1 - q` quantile (linear interpolation
/// between order statistics, as torch.quantile), 0 for the others. `q = 1` keeps every token.
pub fn top_entropy_mask(entropy: &[f32], lengths: &[usize], q: f32) -> Vec<f32> {
    let mut out = Vec::with_capacity(entropy.len());
    let mut at = 0;
    for &len in lengths {
        let answer = &entropy[at..at + len];
        at += len;
        let mut sorted = answer.to_vec();
        sorted.sort_by(f32::total_cmp);
        let threshold = match sorted.len() {
            0 => 0.0,
            n => {
                let pos = (1.0 - q as f64).clamp(0.0, 1.0) * (n - 1) as f64;
                let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
                sorted[lo] as f64 + (sorted[hi] as f64 - sorted[lo] as f64) * (pos - lo as f64)
            }
        };
        out.extend(answer.iter().map(|&h| if h as f64 >= threshold { 1.0 } else { 0.0 }));
    }
    out
}

/// The weighted sum `sum_t w_t c_t l_t` of per-token policy losses (`c_t` the sampler correction's
/// weight, 1 without one).
fn weighted_sum(per_token: &Tensor, inputs: &TokenInputs) -> Result<Tensor> {
    let weighted = (per_token * &inputs.weights)?;
    match &inputs.is_weights {
        Some(c) => (weighted * c)?.sum_all(),
        None => weighted.sum_all(),
    }
}

/// The number of ones in a 0/1 mask, as an f32 scalar on its device.
fn count(mask: &Tensor) -> Result<Tensor> {
    mask.to_dtype(DType::F32)?.sum_all()
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_fixture;
