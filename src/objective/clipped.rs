//! The clipped-ratio family: `off_grpo`, `grpo`, `gspo`, `rec` and `cispo`.
//!
//! Per token t of answer i, with behaviour log-prob b_t (see [`Anchor`]) and advantage A_i (group-relative,
//! std-normalised when `std_normalize`, plus the all-positive bias b when set):
//!
//! ```text
//! token ratio     (ratio_level = "token"):    r_t = exp(clamp(log pi(o_t) - b_t, -20, 20))
//! sequence ratio  (ratio_level = "sequence"): r_t = s_i = exp(clamp(mean_t' (log pi(o_t') - b_t'), -20, 20))
//!                 with gradient s_i * grad log pi(o_t) (GSPO's token form: s_i = sg(s_i) pi / sg(pi))
//! ```
//!
//! `off_grpo`, `grpo`, `gspo` minimise PPO's clipped surrogate (its gradient is A r M grad log pi with the
//! one-side mask M below):
//!
//! ```text
//! l_t = -min(r_t A_i, clip(r_t, 1 - eps_low, 1 + eps_high) A_i) + beta KL_t
//! ```
//!
//! With dual-clip (`dual_clip = true` or `clip_ratio_c = c`, verl's dual-clip PPO), a token of a negative
//! advantage is also bounded by -c A, which stops a huge ratio from giving a huge loss:
//!
//! ```text
//! A_i < 0:  l_t = min(-c A_i, -min(r_t A_i, clip(r_t, 1 - eps_low, 1 + eps_high) A_i)) + beta KL_t
//! ```
//!
//! (where -c A_i is the minimum the value is that constant, with no gradient, and the token counts as
//! clipped).
//!
//! `cispo` (MiniMax-M1's CISPO, verl's `cispo` policy loss) weights REINFORCE by the clipped ratio with
//! its gradient stopped, so no token loses its gradient:
//!
//! ```text
//! l_t = -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) A_i log pi(o_t) + beta KL_t
//! ```
//!
//! (a token whose ratio lies outside the range counts as clipped).
//!
//! `rec` (seed 004, REC-*-IS / REC-*-NOIS) minimises a surrogate whose gradient is seed 004's
//! g = A_i (r_t if IS else 1) M_t grad log pi(o_t):
//!
//! ```text
//! IS:   l_t = -A_i M_t r_t           + beta KL_t
//! NOIS: l_t = -A_i M_t log pi(o_t)   + beta KL_t
//! one-side: M_t = 1(A_i > 0, r_t <= 1 + eps_high) + 1(A_i < 0, r_t >= 1 - eps_low)          (eq. 8)
//! two-side: M_t = 1(1 - eps_low <= r_t <= 1 + eps_high)                                     (eq. 18)
//! ring:     M_t = min(1, two-side + 1(A_i > 0, r_t <= 1 - eps_low_outer)
//!                               + 1(A_i < 0, r_t >= 1 + eps_high_outer))                  (eq. 19-21)
//! ```
//!
//! M_t is computed on the detached ratio. A token with M_t = 0 (or, for the PPO form, whose clipped branch
//! is the minimum) counts as clipped.

use candle_core::{DType, Result, Tensor};

use super::{
    count, exp_clamped, finish, group_advantages, weighted_sum, Anchor, ClipMode, GroupAdvantages, GroupKey, LossTerms,
    Objective, ObjectiveConfig, RatioLevel, TokenInputs,
};

/// The surrogate a clipped objective minimises.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Form {
    /// PPO's -min(r A, clip(r) A) (off_grpo, grpo, gspo), with the dual-clip bound c when on.
    Ppo { clip_ratio_c: Option<f32> },
    /// CISPO's -sg(clip(r)) A log pi.
    Cispo,
    /// REC's masked REINFORCE, with or without the importance weight.
    Rec { mode: ClipMode, importance_weight: bool, eps_low_outer: f32, eps_high_outer: f32 },
}

/// `off_grpo`, `grpo`, `gspo` and `rec`: see the module documentation for the formulas. Defaults:
///
/// | name | anchor (b_t) | ratio | advantage | eps / eps_high | loss_agg |
/// |---|---|---|---|---|---|
/// | off_grpo (seed 000) | teacher (probability 1 unless the data has log-probs) | token | (r - mean) / std | 0.2 / eps | seq-mean-token-mean |
/// | grpo | step (the policy at the start of the step) | token | (r - mean) / std | 0.2 / eps | seq-mean-token-mean |
/// | gspo (seed 004 B.7) | step | sequence | r - mean | 6e-4 / 8e-4 | seq-mean-token-mean |
/// | rec (seed 004) | teacher | token | r - mean | 0.2 / eps | token-mean |
/// | cispo (MiniMax-M1) | step | token | (r - mean) / std | 0.2 / eps | token-mean |
///
/// rec defaults to one-side NOIS (REC-OneSide-NOIS); the ring's outer bounds default to 0.6 / 2.0.
pub struct Clipped {
    cfg: ObjectiveConfig,
    form: Form,
}

impl Clipped {
    pub fn new(cfg: &ObjectiveConfig) -> Self {
        let form = match cfg.name() {
            super::ObjectiveName::Rec => Form::Rec {
                mode: cfg.clip_mode(),
                importance_weight: cfg.importance_weight(),
                eps_low_outer: cfg.eps_low_outer(),
                eps_high_outer: cfg.eps_high_outer(),
            },
            super::ObjectiveName::Cispo => Form::Cispo,
            _ => Form::Ppo { clip_ratio_c: cfg.clip_ratio_c() },
        };
        Self { cfg: cfg.clone(), form }
    }

    /// The per-token log-ratio whose clamped exp is r_t (token or sequence level).
    fn log_ratio(&self, logp: &Tensor, inputs: &TokenInputs) -> Result<Tensor> {
        let token = inputs.log_ratio(logp)?;
        match self.cfg.ratio_level() {
            RatioLevel::Token => Ok(token),
            RatioLevel::Sequence => {
                let mean = inputs.per_token(&inputs.seq_mean(&token.detach())?)?;
                mean + (logp - logp.detach())?
            }
        }
    }
}

/// PPO's `-(min(r A, clip(r, 1 - eps_low, 1 + eps_high) A))` per token, with exact gradients: where the
/// clipped branch is the minimum, the value is that constant and the gradient is zero. With the
/// dual-clip bound c, tokens with A < 0 whose loss exceeds -c A take that constant instead.
fn ppo_surrogate(
    ratio: &Tensor,
    adv: &Tensor,
    eps_low: f32,
    eps_high: f32,
    clip_ratio_c: Option<f32>,
) -> Result<(Tensor, Tensor)> {
    let r = ratio.detach();
    let clipped = (r.clamp(1.0 - eps_low, 1.0 + eps_high)? * adv)?;
    let unclipped = (&r * adv)?;
    // The clipped branch is strictly smaller: the minimum is the constant.
    let mask = clipped.lt(&unclipped)?;
    let value = mask.where_cond(&clipped, &(ratio * adv)?)?.neg()?;
    let Some(c) = clip_ratio_c else { return Ok((value, count(&mask)?)) };
    let bound = (adv * -(c as f64))?;
    let dual = adv.lt(0f64)?.mul(&value.detach().gt(&bound)?)?;
    let value = dual.where_cond(&bound, &value)?;
    Ok((value, (count(&mask)? + count(&dual)?)?))
}

/// CISPO's `-sg(clip(r, 1 - eps_low, 1 + eps_high)) A log pi` per token, and the number of tokens whose
/// ratio lies outside the range.
fn cispo_surrogate(
    ratio: &Tensor,
    logp: &Tensor,
    adv: &Tensor,
    eps_low: f32,
    eps_high: f32,
) -> Result<(Tensor, Tensor)> {
    let r = ratio.detach();
    let weight = r.clamp(1.0 - eps_low, 1.0 + eps_high)?;
    let outside = r.ne(&weight)?;
    Ok((((logp * adv)? * weight)?.neg()?, count(&outside)?))
}

/// REC's mask M_t (f32 0/1) from the detached ratio and the advantages.
fn rec_mask(r: &Tensor, adv: &Tensor, eps_low: f32, eps_high: f32, form: Form) -> Result<Tensor> {
    let f = |t: Tensor| t.to_dtype(DType::F32);
    let pos = f(adv.gt(0f64)?)?;
    let neg = f(adv.lt(0f64)?)?;
    let below_high = f(r.le(1.0 + eps_high as f64)?)?;
    let above_low = f(r.ge(1.0 - eps_low as f64)?)?;
    let Form::Rec { mode, eps_low_outer, eps_high_outer, .. } = form else {
        candle_core::bail!("rec_mask needs a REC form")
    };
    match mode {
        ClipMode::OneSide => (pos * below_high)? + (neg * above_low)?,
        ClipMode::TwoSide => above_low * below_high,
        ClipMode::Ring => {
            let band = (above_low * below_high)?;
            let low_outer = (pos * f(r.le(1.0 - eps_low_outer as f64)?)?)?;
            let high_outer = (neg * f(r.ge(1.0 + eps_high_outer as f64)?)?)?;
            ((band + low_outer)? + high_outer)?.clamp(0f32, 1f32)
        }
    }
}

impl Objective for Clipped {
    fn name(&self) -> &'static str {
        self.cfg.name().as_str()
    }
    fn needs_kl(&self) -> bool {
        self.cfg.beta() > 0.0
    }
    fn anchor(&self) -> Option<Anchor> {
        self.cfg.anchor()
    }
    fn advantages(&self, rewards: &[f32], key: &GroupKey) -> GroupAdvantages {
        group_advantages(rewards, &self.cfg.advantage(key))
    }
    fn loss(&self, logp: &Tensor, inputs: &TokenInputs) -> Result<LossTerms> {
        let (eps_low, eps_high) = (self.cfg.eps_low(), self.cfg.eps_high());
        let ratio = exp_clamped(&self.log_ratio(logp, inputs)?)?;
        let adv = &inputs.advantages;
        let (pg, clipped) = match self.form {
            Form::Ppo { clip_ratio_c } => ppo_surrogate(&ratio, adv, eps_low, eps_high, clip_ratio_c)?,
            Form::Cispo => cispo_surrogate(&ratio, logp, adv, eps_low, eps_high)?,
            Form::Rec { importance_weight, .. } => {
                let mask = rec_mask(&ratio.detach(), adv, eps_low, eps_high, self.form)?;
                let nonzero = adv.ne(0f64)?.to_dtype(DType::F32)?;
                let clipped = count(&((1.0 - &mask)? * nonzero)?)?;
                let factor = if importance_weight { ratio } else { logp.clone() };
                (((factor * adv)? * mask)?.neg()?, clipped)
            }
        };
        finish(weighted_sum(&pg, inputs)?, logp, inputs, self.cfg.beta(), self.cfg.kl_estimator(), Some(clipped))
    }
}
