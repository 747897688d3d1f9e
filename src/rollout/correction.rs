//! Importance-sampling correction between the sampler and the trainer (TRL's
//! `vllm_importance_sampling_correction`, verl's rollout correction): the sampler (a server, or grpo's own
//! KV-cache sampler) reports the log-prob `s_t` of each token it drew, grpo's forward of the same
//! weights gives `b_t` (the behaviour log-probs), and each sampled token's policy loss is multiplied by
//! a weight computed from `b_t - s_t`, a constant without gradient:
//!
//! ```text
//! token level:    rho_t = exp(clamp(b_t - s_t, -20, 20))
//! sequence level: rho_t = rho_i = exp(clamp(sum_t' (b_t' - s_t'), -20, 20))   (the same for every token of i)
//! *_truncate (TIS): w_t = min(rho_t, C)
//! *_mask (MIS):     w_t = rho_t if rho_t <= C, else 0 (the token, or the whole answer, leaves the policy loss)
//! ```
//!
//! as TRL's `vllm_importance_sampling_mode` = token_truncate / token_mask / sequence_truncate /
//! sequence_mask with `vllm_importance_sampling_cap` = C. Tokens the sampler gave no log-prob for (the
//! EOS appended to a stopped server answer when the server did not report its stop token) count as
//! b_t = s_t. The weight multiplies the policy term only (not the KL term), and the aggregation's
//! normaliser is unchanged (a masked token still counts in it), as in TRL.

use serde::{Deserialize, Serialize};

use crate::objective::MAX_LOG_RATIO;

/// TRL's `vllm_importance_sampling_mode`: the level of the ratio and what happens above the cap.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum IsMode {
    /// Per-token ratio, min(rho, C) (TIS).
    #[default]
    TokenTruncate,
    /// Per-token ratio, 0 above C (MIS).
    TokenMask,
    /// One ratio per answer (the product of its tokens' ratios), min(rho, C).
    SequenceTruncate,
    /// One ratio per answer, the whole answer out of the policy loss above C.
    SequenceMask,
}

impl IsMode {
    fn sequence(self) -> bool {
        matches!(self, IsMode::SequenceTruncate | IsMode::SequenceMask)
    }

    fn mask(self) -> bool {
        matches!(self, IsMode::TokenMask | IsMode::SequenceMask)
    }
}

/// The correction of one answer: the weight of each of its tokens, and the ratios it came from (one per
/// token with a sampler log-prob, or one for the answer) with how many of them were above the cap.
#[derive(Debug, Clone, PartialEq)]
pub struct AnswerCorrection {
    pub weights: Vec<f32>,
    pub ratios: Vec<f64>,
    pub capped: usize,
}

/// The correction of an answer whose tokens have the behaviour log-probs `behaviour` and the sampler's
/// log-probs `sampler` (of its first `sampler.len()` tokens), in `mode` with cap `cap`.
pub fn answer_correction(behaviour: &[f32], sampler: &[f32], mode: IsMode, cap: f32) -> AnswerCorrection {
    let diffs: Vec<f64> = behaviour.iter().zip(sampler).map(|(&b, &s)| b as f64 - s as f64).collect();
    let bound = MAX_LOG_RATIO as f64;
    let apply = |rho: f64| -> (f32, bool) {
        let above = rho > cap as f64;
        let w = match (above, mode.mask()) {
            (false, _) => rho,
            (true, false) => cap as f64,
            (true, true) => 0.0,
        };
        (w as f32, above)
    };
    if mode.sequence() {
        let rho = diffs.iter().sum::<f64>().clamp(-bound, bound).exp();
        let (w, above) = apply(rho);
        return AnswerCorrection { weights: vec![w; behaviour.len()], ratios: vec![rho], capped: usize::from(above) };
    }
    let ratios: Vec<f64> = diffs.iter().map(|d| d.clamp(-bound, bound).exp()).collect();
    let mut weights = Vec::with_capacity(behaviour.len());
    let mut capped = 0;
    for &rho in &ratios {
        let (w, above) = apply(rho);
        weights.push(w);
        capped += usize::from(above);
    }
    // Tokens without a sampler log-prob: ratio 1.
    weights.resize(behaviour.len(), apply(1.0).0);
    AnswerCorrection { weights, ratios, capped }
}

/// The ratios of a batch of rollouts: min, mean, max and the fraction above the cap (truncated or masked).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RatioSummary {
    pub min: f64,
    pub mean: f64,
    pub max: f64,
    pub capped_fraction: f64,
}

/// The summary of `answers`' corrections (`None` when they have no ratio).
pub fn summarise(answers: &[AnswerCorrection]) -> Option<RatioSummary> {
    let all: Vec<f64> = answers.iter().flat_map(|a| a.ratios.iter().copied()).collect();
    if all.is_empty() {
        return None;
    }
    let capped: usize = answers.iter().map(|a| a.capped).sum();
    Some(RatioSummary {
        min: all.iter().copied().fold(f64::INFINITY, f64::min),
        mean: all.iter().sum::<f64>() / all.len() as f64,
        max: all.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        capped_fraction: capped as f64 / all.len() as f64,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: &[f32], b: &[f64]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (*x as f64 - y).abs() < 1e-5 * y.abs().max(1.0))
    }

    /// Hand-computed: log-ratios ln 0.5, 0, ln 2.5, ln 4 (and a token without a sampler log-prob), cap 2.
    #[test]
    fn every_mode_against_hand_computed_weights() {
        let b = [-1.0f32, -2.0, -0.5, -0.3, -0.7];
        let s = [-1.0 - 0.5f32.ln(), -2.0, -0.5 - 2.5f32.ln(), -0.3 - 4f32.ln()];
        let tt = answer_correction(&b, &s, IsMode::TokenTruncate, 2.0);
        assert!(close(&tt.weights, &[0.5, 1.0, 2.0, 2.0, 1.0]), "{tt:?}");
        assert!(close(&tt.ratios.iter().map(|&r| r as f32).collect::<Vec<_>>(), &[0.5, 1.0, 2.5, 4.0]));
        assert_eq!(tt.capped, 2);
        let tm = answer_correction(&b, &s, IsMode::TokenMask, 2.0);
        assert!(close(&tm.weights, &[0.5, 1.0, 0.0, 0.0, 1.0]), "{tm:?}");
        assert_eq!(tm.capped, 2);
        // Sequence: 0.5 * 1 * 2.5 * 4 = 5 > 2.
        let st = answer_correction(&b, &s, IsMode::SequenceTruncate, 2.0);
        assert!(close(&st.weights, &[2.0; 5]) && (st.ratios[0] - 5.0).abs() < 1e-4 && st.capped == 1, "{st:?}");
        let sm = answer_correction(&b, &s, IsMode::SequenceMask, 2.0);
        assert!(close(&sm.weights, &[0.0; 5]) && sm.capped == 1, "{sm:?}");
        // Under the cap the sequence ratio is the weight: 0.5 * 1 = 0.5.
        let under = answer_correction(&b[..2], &s[..2], IsMode::SequenceMask, 2.0);
        assert!(close(&under.weights, &[0.5, 0.5]) && under.capped == 0, "{under:?}");
        let under = answer_correction(&b[..2], &s[..2], IsMode::SequenceTruncate, 2.0);
        assert!(close(&under.weights, &[0.5, 0.5]) && under.capped == 0, "{under:?}");
    }

    #[test]
    fn huge_log_ratios_are_clamped_and_summaries_cover_every_ratio() {
        let c = answer_correction(&[0.0, -100.0], &[-100.0, 0.0], IsMode::TokenTruncate, 3.0);
        assert_eq!(c.ratios, vec![20f64.exp(), (-20f64).exp()]);
        assert!(c.weights[0] == 3.0 && c.weights.iter().all(|w| w.is_finite()));
        let d = answer_correction(&[0.0], &[0.0], IsMode::TokenTruncate, 3.0);
        let s = summarise(&[c, d]).unwrap();
        assert_eq!((s.min, s.max), ((-20f64).exp(), 20f64.exp()));
        assert!((s.mean - (20f64.exp() + (-20f64).exp() + 1.0) / 3.0).abs() < 1e-6);
        assert!((s.capped_fraction - 1.0 / 3.0).abs() < 1e-12);
        assert_eq!(summarise(&[]), None);
    }
}
