//! `oapl` (seed 003, OAPL): squared regression of the scaled sequence log-ratio to a lagged anchor onto
//! the optimal advantage, without clipping, importance ratio or reference KL.

use candle_core::{Result, Tensor};

use super::{Anchor, GroupAdvantages, GroupKey, LossTerms, Objective, ObjectiveConfig, RewardStats, TokenInputs};

/// `oapl`. For a group of answers y_1..y_G of a question x with rewards r_i,
///
/// ```text
/// V*(x) = beta1 * log( (1/G) sum_i exp(r_i / beta1) )                     (seed 003, eq. 2)
/// L     = sum_i w_i ( beta2 * sum_t (log pi(o_t) - log pi_anchor(o_t)) - (r_i - V*(x)) )^2   (eq. 3)
/// ```
///
/// with w_i the sequence weight (1/N over the batch's N answers under the default loss_agg,
/// seq-mean-token-sum). The anchor pi_anchor is the lagged inference policy: by default a snapshot of the
/// policy refreshed every `anchor_every` = 50 steps (seed 003's L for math); `anchor = "teacher"` uses the
/// data's teacher log-probs (probability 1 when absent), `"reference"` the frozen reference, `"step"`
/// the policy at the start of the step. Defaults beta1 = 1 (seed 003, table 2) and beta2 = 1e-3 (the
/// seed's table lost this value in extraction; 1e-3 is A*-PO's, Brantley et al. 2025, which OAPL follows).
/// No reference KL (`beta` is rejected). The "advantage" reported per answer is its target r_i - V*.
pub struct Oapl(pub ObjectiveConfig);

impl Oapl {
    /// V* = beta1 log mean exp(r / beta1), computed stably in f64.
    fn v_star(&self, rewards: &[f32]) -> f64 {
        let b1 = self.0.beta1() as f64;
        let scaled: Vec<f64> = rewards.iter().map(|&r| r as f64 / b1).collect();
        let max = scaled.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        if !max.is_finite() {
            return 0.0;
        }
        let mean = scaled.iter().map(|s| (s - max).exp()).sum::<f64>() / scaled.len() as f64;
        b1 * (max + mean.ln())
    }
}

impl Objective for Oapl {
    fn name(&self) -> &'static str {
        "oapl"
    }
    fn needs_kl(&self) -> bool {
        false
    }
    fn anchor(&self) -> Option<Anchor> {
        self.0.anchor()
    }
    fn advantages(&self, rewards: &[f32], _key: &GroupKey) -> GroupAdvantages {
        let v = self.v_star(rewards);
        GroupAdvantages {
            advantages: rewards.iter().map(|&r| (r as f64 - v) as f32).collect(),
            include: vec![true; rewards.len()],
            rewards: RewardStats::of(rewards),
            bias_applied: false,
        }
    }
    fn loss(&self, logp: &Tensor, inputs: &TokenInputs) -> Result<LossTerms> {
        let seq_log_ratio = inputs.seq_sum(&inputs.log_ratio(logp)?)?;
        let target = inputs.seq_mean(&inputs.advantages)?;
        let seq_weights = inputs.seq_mean(&inputs.weights)?;
        let residual = ((seq_log_ratio * self.0.beta2() as f64)? - target)?;
        let loss = (residual.sqr()? * seq_weights)?.sum_all()?;
        Ok(LossTerms { pg_loss: loss.detach(), kl: None, loss, clipped_tokens: None })
    }
}
