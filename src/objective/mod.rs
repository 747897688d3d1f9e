//! The losses: group-relative advantages, loss aggregation, KL estimators, and the objectives behind one
//! trait, chosen by name: `off_grpo` (the seed), `grpo` (standard clipped ratio) and `sft`.
//!
//! Every per-token quantity is f32. Aggregation is expressed as one weight per token computed from the
//! whole batch (see [`LossAgg::weights`]), so the loss is a plain weighted sum: splitting a batch into
//! micro-batches and adding their losses never changes the gradient.

use candle_core::{DType, Result, Tensor};
use serde::{Deserialize, Serialize};

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
                let k3 = ((d.exp()? - &d)? - 1.0)?;
                // Clamp like verl; outside the range the value is constant and carries no gradient.
                let v = k3.detach();
                let inside = v.ge(-10f32)?.mul(&v.le(10f32)?)?.to_dtype(DType::F32)?;
                let clamped = v.clamp(-10f32, 10f32)?;
                (k3 * &inside)? + (clamped * (1.0 - &inside)?)?
            }
        }
    }
}

/// Group-relative advantage options.
#[derive(Debug, Clone, PartialEq)]
pub struct AdvantageConfig {
    /// Divide by the group's standard deviation (unbiased, + 1e-6) as GRPO does.
    pub std_normalize: bool,
    /// The all-positive bias b: when every reward of a group is positive, A_i + b is used.
    pub bias: f32,
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

/// The advantages of one group's answers and the reward statistics they come from.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupAdvantages {
    pub advantages: Vec<f32>,
    pub rewards: RewardStats,
    /// Whether the all-positive bias was added.
    pub bias_applied: bool,
}

/// Group-relative advantages of one group's rewards: `(r_i - mean) / (std + 1e-6)` (or `r_i - mean`), plus
/// the all-positive bias b when every reward is positive.
pub fn group_advantages(rewards: &[f32], cfg: &AdvantageConfig) -> GroupAdvantages {
    let stats = RewardStats::of(rewards);
    let mut advantages: Vec<f32> = rewards
        .iter()
        .map(|&r| {
            let centred = r as f64 - stats.mean;
            (if cfg.std_normalize { centred / (stats.std + 1e-6) } else { centred }) as f32
        })
        .collect();
    let all_positive = !rewards.is_empty() && rewards.iter().all(|&r| r > 0.0);
    let bias_applied = all_positive && cfg.bias != 0.0;
    if bias_applied {
        advantages.iter_mut().for_each(|a| *a += cfg.bias);
    }
    GroupAdvantages { advantages, rewards: stats, bias_applied }
}

/// Per-token inputs of a loss for one micro-batch of `n` response tokens (all `[n]`, f32).
pub struct TokenInputs {
    /// Advantage of the token's answer.
    pub advantages: Tensor,
    /// Aggregation weight of the token (from [`LossAgg::weights`] over the whole batch).
    pub weights: Tensor,
    /// Log-probs under the frozen reference: the KL term is present exactly when they are.
    pub ref_logp: Option<Tensor>,
    /// Behaviour log-probs: the teacher's when the data has them (`off_grpo`), the policy's at the start
    /// of the step (`grpo`).
    pub behaviour_logp: Option<Tensor>,
}

/// A loss and its parts for one micro-batch. Weighted sums, so micro-batch values add up.
pub struct LossTerms {
    /// The scalar to differentiate.
    pub loss: Tensor,
    /// Weighted policy-gradient part.
    pub pg_loss: f32,
    /// Weighted KL part (before beta).
    pub kl: f32,
    /// Number of tokens whose ratio was clipped (no gradient).
    pub clipped_tokens: usize,
}

/// A training objective.
pub trait Objective: Send + Sync {
    /// The name it is chosen by.
    fn name(&self) -> &'static str;
    /// Whether the loss has a KL term to a reference model (beta > 0): the trainer then loads one and
    /// passes its log-probs.
    fn needs_reference(&self) -> bool;
    /// Advantages of a group, with its reward statistics.
    fn advantages(&self, rewards: &[f32]) -> GroupAdvantages;
    /// Which answers of a group take part in the loss.
    fn include(&self, rewards: &[f32]) -> Vec<bool> {
        vec![true; rewards.len()]
    }
    /// Whether the loss needs the policy's own log-probs from the start of the step as behaviour.
    fn needs_old_logprobs(&self) -> bool {
        false
    }
    /// The micro-batch loss from the policy's per-token log-probs `logp` (`[n]`, with a graph).
    fn loss(&self, logp: &Tensor, inputs: &TokenInputs) -> Result<LossTerms>;
}

/// `-(min(r A, clip(r, 1 - eps_low, 1 + eps_high) A))` per token, with exact gradients: where the
/// clipped branch is the minimum, the value is that constant and the gradient is zero.
fn clipped_surrogate(ratio: &Tensor, adv: &Tensor, eps_low: f32, eps_high: f32) -> Result<(Tensor, usize)> {
    let r = ratio.detach();
    let clipped_r = r.clamp(1.0 - eps_low, 1.0 + eps_high)?;
    let unclipped = (&r * adv)?;
    let clipped = (&clipped_r * adv)?;
    // The clipped branch is strictly smaller: the minimum is the constant.
    let mask = clipped.lt(&unclipped)?.to_dtype(DType::F32)?;
    let n_clipped = mask.sum_all()?.to_scalar::<f32>()? as usize;
    let keep = (1.0 - &mask)?;
    let value = ((ratio * adv)? * &keep)?.add(&(clipped * &mask)?)?;
    Ok((value.neg()?, n_clipped))
}

/// The clipped-ratio loss of `off_grpo` and `grpo` for a given log-ratio.
fn clipped_loss(cfg: &ObjectiveConfig, log_ratio: &Tensor, logp: &Tensor, inputs: &TokenInputs) -> Result<LossTerms> {
    let eps_high = cfg.eps_high.unwrap_or(cfg.eps);
    let (pg, clipped) = clipped_surrogate(&log_ratio.exp()?, &inputs.advantages, cfg.eps, eps_high)?;
    finish(pg, logp, inputs, cfg.beta, cfg.kl_estimator, clipped)
}

fn finish(
    pg: Tensor,
    logp: &Tensor,
    inputs: &TokenInputs,
    beta: f32,
    kl_est: KlEstimator,
    clipped: usize,
) -> Result<LossTerms> {
    let pg_sum = (&pg * &inputs.weights)?.sum_all()?;
    let (loss, kl) = match &inputs.ref_logp {
        Some(r) => {
            let kl = (kl_est.per_token(logp, r)? * &inputs.weights)?.sum_all()?;
            let loss = (&pg_sum + (&kl * beta as f64)?)?;
            (loss, kl.to_scalar::<f32>()?)
        }
        None => (pg_sum.clone(), 0.0),
    };
    Ok(LossTerms { pg_loss: pg_sum.to_scalar::<f32>()?, kl, loss, clipped_tokens: clipped })
}

/// The objectives, by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ObjectiveName {
    OffGrpo,
    Grpo,
    Sft,
}

/// The `[objective]` section of the training config. `name` picks the objective; options that do not
/// apply to it are rejected by [`ObjectiveConfig::validate`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ObjectiveConfig {
    pub name: ObjectiveName,
    /// Clip range below 1 (eps_low): for A < 0, tokens whose ratio is under 1 - eps get no gradient.
    pub eps: f32,
    /// Clip range above 1 (default: eps). Irrelevant for off_grpo without teacher log-probs (ratio <= 1).
    pub eps_high: Option<f32>,
    /// The all-positive bias b (off_grpo, grpo).
    pub bias: f32,
    /// Divide advantages by the group's standard deviation.
    pub std_normalize: bool,
    /// KL weight; 0 loads no reference model.
    pub beta: f32,
    pub kl_estimator: KlEstimator,
    pub loss_agg: LossAgg,
}

impl Default for ObjectiveConfig {
    fn default() -> Self {
        Self {
            name: ObjectiveName::OffGrpo,
            eps: 0.2,
            eps_high: None,
            bias: 0.0,
            std_normalize: true,
            beta: 0.0,
            kl_estimator: KlEstimator::K3,
            loss_agg: LossAgg::SeqMeanTokenMean,
        }
    }
}

impl ObjectiveConfig {
    /// Check ranges and that every option set applies to the chosen objective.
    pub fn validate(&self) -> std::result::Result<(), String> {
        if !(0.0..1.0).contains(&self.eps) {
            return Err(format!("objective.eps = {} must be in [0, 1)", self.eps));
        }
        if self.eps_high.is_some_and(|e| e < 0.0) {
            return Err("objective.eps_high must be >= 0".into());
        }
        if self.beta < 0.0 || !self.beta.is_finite() {
            return Err(format!("objective.beta = {} must be >= 0", self.beta));
        }
        if self.name == ObjectiveName::Sft && self.bias != 0.0 {
            return Err("objective.bias does not apply to sft (it trains on positive answers only)".into());
        }
        Ok(())
    }

    fn advantage(&self) -> AdvantageConfig {
        AdvantageConfig { std_normalize: self.std_normalize, bias: self.bias }
    }

    /// Build the objective.
    pub fn build(&self) -> Box<dyn Objective> {
        match self.name {
            ObjectiveName::OffGrpo => Box::new(OffGrpo(self.clone())),
            ObjectiveName::Grpo => Box::new(Grpo(self.clone())),
            ObjectiveName::Sft => Box::new(Sft(self.clone())),
        }
    }
}

/// `off_grpo`, the seed's objective. Per token of answer i with advantage A_i (plus b when the whole group
/// is positive) and behaviour log-prob beta_t (0, i.e. probability 1, unless the data carries teacher
/// log-probs):
///
/// ```text
/// r_t = exp(log pi_theta(o_t) - beta_t)
/// l_t = -min(r_t A_i, clip(r_t, 1 - eps, 1 + eps_high) A_i) + beta KL_t(pi_theta || pi_ref)
/// ```
///
/// aggregated with the configured [`LossAgg`] (the seed: seq-mean-token-mean).
pub struct OffGrpo(pub ObjectiveConfig);

impl Objective for OffGrpo {
    fn name(&self) -> &'static str {
        "off_grpo"
    }
    fn needs_reference(&self) -> bool {
        self.0.beta > 0.0
    }
    fn advantages(&self, rewards: &[f32]) -> GroupAdvantages {
        group_advantages(rewards, &self.0.advantage())
    }
    fn loss(&self, logp: &Tensor, inputs: &TokenInputs) -> Result<LossTerms> {
        let log_ratio = match &inputs.behaviour_logp {
            Some(b) => (logp - b)?,
            None => logp.clone(),
        };
        clipped_loss(&self.0, &log_ratio, logp, inputs)
    }
}

/// `grpo`: the clipped ratio against the policy's own log-probs taken at the start of the step:
///
/// ```text
/// r_t = exp(log pi_theta(o_t) - log pi_old(o_t))
/// l_t = -min(r_t A_i, clip(r_t, 1 - eps, 1 + eps_high) A_i) + beta KL_t
/// ```
pub struct Grpo(pub ObjectiveConfig);

impl Objective for Grpo {
    fn name(&self) -> &'static str {
        "grpo"
    }
    fn needs_reference(&self) -> bool {
        self.0.beta > 0.0
    }
    fn advantages(&self, rewards: &[f32]) -> GroupAdvantages {
        group_advantages(rewards, &self.0.advantage())
    }
    fn needs_old_logprobs(&self) -> bool {
        true
    }
    fn loss(&self, logp: &Tensor, inputs: &TokenInputs) -> Result<LossTerms> {
        let old =
            inputs.behaviour_logp.as_ref().ok_or_else(|| candle_core::Error::Msg("grpo needs old log-probs".into()))?;
        clipped_loss(&self.0, &(logp - old)?, logp, inputs)
    }
}

/// `sft`: negative log-likelihood of the answers with a positive reward only,
///
/// ```text
/// l_t = -log pi_theta(o_t) + beta KL_t   for answers with r_i > 0
/// ```
pub struct Sft(pub ObjectiveConfig);

impl Objective for Sft {
    fn name(&self) -> &'static str {
        "sft"
    }
    fn needs_reference(&self) -> bool {
        self.0.beta > 0.0
    }
    fn advantages(&self, rewards: &[f32]) -> GroupAdvantages {
        GroupAdvantages {
            advantages: rewards.iter().map(|&r| if r > 0.0 { 1.0 } else { 0.0 }).collect(),
            rewards: RewardStats::of(rewards),
            bias_applied: false,
        }
    }
    fn include(&self, rewards: &[f32]) -> Vec<bool> {
        rewards.iter().map(|&r| r > 0.0).collect()
    }
    fn loss(&self, logp: &Tensor, inputs: &TokenInputs) -> Result<LossTerms> {
        let pg = (logp * &inputs.advantages)?.neg()?;
        finish(pg, logp, inputs, self.0.beta, self.0.kl_estimator, 0)
    }
}

#[cfg(test)]
mod tests;
