//! The REINFORCE family of seed 004 (table 3) and the seed's SFT baseline. Per token t of answer i, with
//! token weight w_t from the configured [`super::LossAgg`] and sequence weight w_i (the token weight of
//! answer i's tokens):
//!
//! ```text
//! opmd:       L = -sum_t w_t A_i log pi(o_t) + sum_i w_i (tau / 2) (log pi(y_i) - log pi_old(y_i))^2
//! asymre:     L = -sum_t w_t (r_i - (mean(r) - shift)) log pi(o_t)
//! red_drop:   L = -sum_{t in S} w_t (r_i - mean_S(r)) log pi(o_t)
//! red_weight: L = -sum_t w_t exp(A_i / T) A_i log pi(o_t)
//! sft:        L = -sum_{t: r_i > 0} w_t log pi(o_t)
//! ```
//!
//! each plus beta sum_t w_t KL_t(pi || pi_ref) when beta > 0. A_i = r_i - mean(r), divided by the group's
//! standard deviation when `std_normalize`. log pi(y) = sum_t log pi(o_t) is the sequence log-prob.

use crate::checksum::splitmix64;
use candle_core::{Result, Tensor};

use super::{
    finish, group_advantages, weighted_sum, AdvantageConfig, Anchor, GroupAdvantages, GroupKey, LossTerms, Objective,
    ObjectiveConfig, RewardStats, SftAnswers, TokenInputs, MAX_LOG_RATIO,
};

/// `-sum_t w_t A_i log pi(o_t)`.
fn reinforce(logp: &Tensor, inputs: &TokenInputs) -> Result<Tensor> {
    weighted_sum(&(logp * &inputs.advantages)?.neg()?, inputs)
}

/// The advantages r_i - mean(r) (over `rewards`), divided by std + 1e-6 as `cfg.scale_rewards()` says
/// (the group's std, or the batch's from `key`).
fn centred(rewards: &[f32], cfg: &ObjectiveConfig, key: &GroupKey) -> GroupAdvantages {
    group_advantages(rewards, &AdvantageConfig { bias: 0.0, ..cfg.advantage(key) })
}

/// `opmd` (Kimi's OPMD as seed 004 writes it, table 3): REINFORCE with the group-mean baseline plus
///
/// ```text
/// (tau / 2) (log pi(y_i) - log pi_old(y_i))^2,   log pi(y) = sum_t log pi(o_t)
/// ```
///
/// per answer, weighted by its sequence weight (1/K under seq-mean-token-sum, seed 004's formula).
/// Defaults: tau 0.1 (seed 004, figure 10), A_i = r_i - mean(r), token-mean, and pi_old = the policy at
/// the start of the step (anchor = "step", the seed's on-policy form): then the squared term is 0 with zero
/// gradient within a step, and `anchor = "snapshot"` with `anchor_every = K` is seed 004's
/// sync_interval = K; `anchor = "teacher"` regresses onto the teacher's log-probs (probability 1 when the
/// data has none).
pub struct Opmd(pub ObjectiveConfig);

impl Objective for Opmd {
    fn name(&self) -> &'static str {
        "opmd"
    }
    fn needs_kl(&self) -> bool {
        self.0.beta() > 0.0
    }
    fn anchor(&self) -> Option<Anchor> {
        self.0.anchor()
    }
    fn advantages(&self, rewards: &[f32], key: &GroupKey) -> GroupAdvantages {
        centred(rewards, &self.0, key)
    }
    fn loss(&self, logp: &Tensor, inputs: &TokenInputs) -> Result<LossTerms> {
        let seq_log_ratio = inputs.seq_sum(&inputs.log_ratio(logp)?)?;
        let seq_weights = inputs.seq_mean(&inputs.weights)?;
        let reg = ((seq_log_ratio.sqr()? * seq_weights)?.sum_all()? * (self.0.tau() as f64 / 2.0))?;
        let pg = (reinforce(logp, inputs)? + reg)?;
        finish(pg, logp, inputs, self.0.beta(), self.0.kl_estimator(), None)
    }
}

/// `asymre` (Meta's AsymRE, seed 004 table 3): REINFORCE with the baseline lowered by `baseline_shift`
/// (default 0.1, seed 004 figure 10) for every group:
///
/// ```text
/// A_i = r_i - (mean(r) - shift)
/// ```
///
/// Seed 000's all-positive bias b (off_grpo's `bias`) is the same shift restricted to the groups whose
/// rewards are all positive (and added after the std normalisation). Default loss_agg token-mean.
pub struct AsymRe(pub ObjectiveConfig);

impl Objective for AsymRe {
    fn name(&self) -> &'static str {
        "asymre"
    }
    fn needs_kl(&self) -> bool {
        self.0.beta() > 0.0
    }
    fn advantages(&self, rewards: &[f32], _key: &GroupKey) -> GroupAdvantages {
        let mut g = group_advantages(rewards, &AdvantageConfig { std_normalize: false, bias: 0.0, batch_std: None });
        let shift = self.0.baseline_shift();
        g.advantages.iter_mut().for_each(|a| *a += shift);
        g
    }
    fn loss(&self, logp: &Tensor, inputs: &TokenInputs) -> Result<LossTerms> {
        finish(reinforce(logp, inputs)?, logp, inputs, self.0.beta(), self.0.kl_estimator(), None)
    }
}

/// FNV-1a of a string (stable across runs and platforms).
fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xCBF2_9CE4_8422_2325, |h, b| (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01B3))
}

/// The random draw of answer `j` of the group `key`: `splitmix64(splitmix64(splitmix64(splitmix64(seed) ^
/// fnv1a(question)) ^ epoch) ^ j)`.
fn draw(key: &GroupKey, j: usize) -> u64 {
    let k = splitmix64(splitmix64(splitmix64(key.seed) ^ fnv1a(key.question)) ^ key.epoch as u64);
    splitmix64(k ^ j as u64)
}

/// `red_drop` (seed 004, RED-Drop, B.6): when a group has more negative answers (r_i < mean(r)) than
/// positive ones (r_i > mean(r)), the excess negatives are dropped at random (the ones with the smallest
/// [`draw`], a pure function of run seed, question and epoch, so a resumed run drops the same answers)
/// and the baseline is recomputed on the kept set S:
///
/// ```text
/// L = -sum_{t in S} w_t (r_i - mean_S(r)) log pi(o_t)      (/ std_S(r) when std_normalize)
/// ```
///
/// Default loss_agg token-mean (over the kept tokens).
pub struct RedDrop(pub ObjectiveConfig);

impl RedDrop {
    /// Which answers of the group `key` are kept.
    fn keep(rewards: &[f32], key: &GroupKey) -> Vec<bool> {
        let mean = RewardStats::of(rewards).mean;
        let positives = rewards.iter().filter(|&&r| r as f64 > mean).count();
        let mut negatives: Vec<usize> = (0..rewards.len()).filter(|&j| (rewards[j] as f64) < mean).collect();
        let mut keep = vec![true; rewards.len()];
        let excess = negatives.len().saturating_sub(positives);
        negatives.sort_by_key(|&j| (draw(key, j), j));
        negatives.iter().take(excess).for_each(|&j| keep[j] = false);
        keep
    }
}

impl Objective for RedDrop {
    fn name(&self) -> &'static str {
        "red_drop"
    }
    fn needs_kl(&self) -> bool {
        self.0.beta() > 0.0
    }
    fn advantages(&self, rewards: &[f32], key: &GroupKey) -> GroupAdvantages {
        let include = Self::keep(rewards, key);
        let kept: Vec<f32> = rewards.iter().zip(&include).filter(|(_, &k)| k).map(|(&r, _)| r).collect();
        let on_kept = centred(&kept, &self.0, key);
        let mut it = on_kept.advantages.into_iter();
        let advantages = include.iter().map(|&k| if k { it.next().unwrap_or(0.0) } else { 0.0 }).collect();
        GroupAdvantages { advantages, include, rewards: RewardStats::of(rewards), bias_applied: false }
    }
    fn loss(&self, logp: &Tensor, inputs: &TokenInputs) -> Result<LossTerms> {
        finish(reinforce(logp, inputs)?, logp, inputs, self.0.beta(), self.0.kl_estimator(), None)
    }
}

/// `red_weight` (seed 004, RED-Weight, B.6): each answer's REINFORCE term weighted by
///
/// ```text
/// w_i = exp(clamp(A_i / T, -20, 20)),   L = -sum_t w_t w_i A_i log pi(o_t)
/// ```
///
/// with A_i = r_i - mean(r) (std-normalised when `std_normalize`), T = `temperature` (default 1, the
/// seed's), default loss_agg token-mean.
pub struct RedWeight(pub ObjectiveConfig);

impl Objective for RedWeight {
    fn name(&self) -> &'static str {
        "red_weight"
    }
    fn needs_kl(&self) -> bool {
        self.0.beta() > 0.0
    }
    fn advantages(&self, rewards: &[f32], key: &GroupKey) -> GroupAdvantages {
        let mut g = centred(rewards, &self.0, key);
        let t = self.0.temperature() as f64;
        for a in g.advantages.iter_mut() {
            let x = (*a as f64 / t).clamp(-MAX_LOG_RATIO as f64, MAX_LOG_RATIO as f64);
            *a = (x.exp() * *a as f64) as f32;
        }
        g
    }
    fn loss(&self, logp: &Tensor, inputs: &TokenInputs) -> Result<LossTerms> {
        finish(reinforce(logp, inputs)?, logp, inputs, self.0.beta(), self.0.kl_estimator(), None)
    }
}

/// `sft`: negative log-likelihood of the answers with a positive reward (`sft_answers = "positive"`, the
/// default) or of every answer (`"all"`),
///
/// ```text
/// l_t = -log pi_theta(o_t) + beta KL_t   for answers with r_i > 0 (positive) or all answers (all)
/// ```
pub struct Sft(pub ObjectiveConfig);

impl Objective for Sft {
    fn name(&self) -> &'static str {
        "sft"
    }
    fn needs_kl(&self) -> bool {
        self.0.beta() > 0.0
    }
    fn advantages(&self, rewards: &[f32], _key: &GroupKey) -> GroupAdvantages {
        let all = self.0.sft_answers() == SftAnswers::All;
        let trained = |r: f32| all || r > 0.0;
        GroupAdvantages {
            advantages: rewards.iter().map(|&r| if trained(r) { 1.0 } else { 0.0 }).collect(),
            include: rewards.iter().map(|&r| trained(r)).collect(),
            rewards: RewardStats::of(rewards),
            bias_applied: false,
        }
    }
    fn loss(&self, logp: &Tensor, inputs: &TokenInputs) -> Result<LossTerms> {
        finish(reinforce(logp, inputs)?, logp, inputs, self.0.beta(), self.0.kl_estimator(), None)
    }
}
