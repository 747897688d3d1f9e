//! Hand-computed losses and gradients of every objective, the KL estimators, the log-ratio clamp and the
//! option validation.

use super::*;
use candle_core::{Device, Var};

fn t(v: &[f32]) -> Tensor {
    Tensor::from_slice(v, v.len(), &Device::Cpu).unwrap()
}

fn vals(t: &Tensor) -> Vec<f32> {
    t.to_vec1::<f32>().unwrap()
}

fn near(a: f32, b: f32) -> bool {
    (a - b).abs() <= 1e-5 * b.abs().max(1.0)
}

fn assert_all_near(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (g, w) in got.iter().zip(want) {
        assert!(near(*g, *w), "{what}: {got:?} vs {want:?}");
    }
}

/// One micro-batch of whole sequences: `lengths`, a per-sequence advantage and token weight, per-token
/// behaviour (anchor) and reference log-probs.
struct Case<'a> {
    lengths: &'a [usize],
    adv: &'a [f32],
    w: &'a [f32],
    behaviour: Option<&'a [f32]>,
    reference: Option<&'a [f32]>,
}

impl<'a> Case<'a> {
    fn tokens(adv: &'a [f32], w: &'a [f32]) -> Self {
        // One-token sequences: per-token advantages and weights.
        const ONES: [usize; 16] = [1; 16];
        Case { lengths: &ONES[..adv.len()], adv, w, behaviour: None, reference: None }
    }
}

/// A micro-batch's loss terms, read.
pub(super) struct Terms {
    pub pg_loss: f32,
    pub kl: f32,
    pub clipped_tokens: usize,
}

pub(super) fn read(terms: &LossTerms) -> Terms {
    let scalar = |t: &Tensor| t.to_scalar::<f32>().unwrap();
    Terms {
        pg_loss: scalar(&terms.pg_loss),
        kl: terms.kl.as_ref().map_or(0.0, scalar),
        clipped_tokens: terms.clipped_tokens.as_ref().map_or(0, |c| scalar(c) as usize),
    }
}

/// Loss, d loss / d logp and the loss terms.
fn run(obj: &dyn Objective, logp: &[f32], case: &Case) -> (f32, Vec<f32>, Terms) {
    let lp = Var::from_slice(logp, logp.len(), &Device::Cpu).unwrap();
    let mut inputs = TokenInputs::for_sequences(case.lengths, case.adv, case.w, &Device::Cpu).unwrap();
    inputs.ref_logp = case.reference.map(t);
    inputs.behaviour_logp = match obj.anchor() {
        Some(Anchor::Step) => Some(lp.as_detached_tensor()),
        _ => case.behaviour.map(t),
    };
    let terms = obj.loss(lp.as_tensor(), &inputs).unwrap();
    let g = terms.loss.backward().unwrap();
    let grad = g.get(lp.as_tensor()).map(vals).unwrap_or(vec![0.0; logp.len()]);
    (terms.loss.to_scalar::<f32>().unwrap(), grad, read(&terms))
}

/// The objective `name` with `options` (TOML lines), read as a config's `[objective]` section is.
fn try_with(name: ObjectiveName, options: &str) -> std::result::Result<ObjectiveConfig, String> {
    toml::from_str(&format!("name = \"{}\"\n{options}", name.as_str())).map_err(|e| e.message().to_string())
}

fn with(name: ObjectiveName, options: &str) -> ObjectiveConfig {
    try_with(name, options).unwrap_or_else(|e| panic!("{}: {options}: {e}", name.as_str()))
}

/// `name` with `bias` and `beta` (0 is accepted by the objectives without them).
fn cfg(name: ObjectiveName, bias: f32, beta: f32) -> ObjectiveConfig {
    with(name, &format!("bias = {bias:?}\nbeta = {beta:?}"))
}

fn advantages(obj: &dyn Objective, rewards: &[f32]) -> GroupAdvantages {
    obj.advantages(rewards, &GroupKey::default())
}

#[test]
fn advantages_hand_computed() {
    let c = AdvantageConfig { std_normalize: true, bias: 0.5, batch_std: None };
    let g = group_advantages(&[1.0, 0.0, 0.0, 1.0], &c);
    let (a, applied) = (g.advantages, g.bias_applied);
    assert!((g.rewards.mean - 0.5).abs() < 1e-12 && (g.rewards.std - (1.0f64 / 3.0).sqrt()).abs() < 1e-12);
    // mean 0.5, unbiased std sqrt(1/3)
    let want = 0.5 / (1.0f64 / 3.0).sqrt();
    assert!(!applied);
    for (x, s) in a.iter().zip([1.0, -1.0, -1.0, 1.0]) {
        assert!((*x as f64 - s * want).abs() < 1e-5, "{a:?}");
    }
    let GroupAdvantages { advantages: a, bias_applied: applied, .. } = group_advantages(&[1.0; 4], &c);
    assert!(applied);
    assert_eq!(a, vec![0.5; 4]);
    let GroupAdvantages { advantages: a, bias_applied: applied, .. } = group_advantages(&[0.0; 4], &c);
    assert!(!applied && a == vec![0.0; 4], "all-negative groups get no bias");
    let a =
        group_advantages(&[1.0, 0.0], &AdvantageConfig { std_normalize: false, bias: 0.0, batch_std: None }).advantages;
    assert_eq!(a, vec![0.5, -0.5]);
}

#[test]
fn seed_004_advantages_hand_computed() {
    let r = [1.0f32, 0.0, 0.0, 1.0];
    // rec, opmd: r - mean, no std.
    for name in [ObjectiveName::Rec, ObjectiveName::Opmd] {
        assert_eq!(advantages(cfg(name, 0.0, 0.0).build().as_ref(), &r).advantages, vec![0.5, -0.5, -0.5, 0.5]);
    }
    // asymre: r - (mean - 0.1), for every group, all-positive ones included.
    let asym = cfg(ObjectiveName::Asymre, 0.0, 0.0).build();
    assert_all_near(&advantages(asym.as_ref(), &r).advantages, &[0.6, -0.4, -0.4, 0.6], "asymre");
    assert_all_near(&advantages(asym.as_ref(), &[1.0; 3]).advantages, &[0.1; 3], "asymre all positive");
    // red_weight: exp(A / T) A.
    let red = with(ObjectiveName::RedWeight, "temperature = 0.5").build();
    let (e1, em1) = (1f32.exp(), (-1f32).exp());
    assert_all_near(&advantages(red.as_ref(), &r).advantages, &[0.5 * e1, -0.5 * em1, -0.5 * em1, 0.5 * e1], "red");
    // oapl: r - V*, V* = log((e + e + 1 + 1) / 4) with beta1 = 1; with a tiny beta1 V* tends to max(r).
    let oapl = cfg(ObjectiveName::Oapl, 0.0, 0.0).build();
    let v = ((2.0 * 1f64.exp() + 2.0) / 4.0).ln() as f32;
    assert_all_near(&advantages(oapl.as_ref(), &r).advantages, &[1.0 - v, -v, -v, 1.0 - v], "oapl");
    let sharp = with(ObjectiveName::Oapl, "beta1 = 1e-3").build();
    let a = advantages(sharp.as_ref(), &r).advantages;
    assert!(a[0].abs() < 1e-2 && (a[1] + 1.0).abs() < 1e-2, "{a:?}");
    // red_drop: 1 positive, 5 negatives: 4 negatives dropped, the baseline recomputed on the kept two.
    let drop = cfg(ObjectiveName::RedDrop, 0.0, 0.0).build();
    let key = GroupKey { seed: 9, epoch: 3, question: "q", ..Default::default() };
    let g = drop.advantages(&[0.0, 1.0, 0.0, 0.0, 0.0, 0.0], &key);
    assert_eq!(g.include.iter().filter(|&&k| k).count(), 2);
    assert!(g.include[1] && g.advantages[1] == 0.5);
    let kept_negative = (0..6).find(|&j| j != 1 && g.include[j]).unwrap();
    assert_eq!(g.advantages[kept_negative], -0.5);
    assert!(g.include.iter().zip(&g.advantages).all(|(&k, &a)| k || a == 0.0));
    assert_eq!(g, drop.advantages(&[0.0, 1.0, 0.0, 0.0, 0.0, 0.0], &key), "the choice is a pure function of the key");
    // Balanced or positive-heavy groups are kept whole.
    assert!(drop.advantages(&[1.0, 1.0, 0.0], &key).include.iter().all(|&k| k));
}

#[test]
fn all_positive_group_gives_zero_gradient_without_bias_and_positive_with_it() {
    let logp = [-0.1f32, -2.0, -0.7, -0.05];
    let w = [0.25f32; 4];
    for (bias, expect_zero) in [(0.0, true), (0.5, false)] {
        let obj = cfg(ObjectiveName::OffGrpo, bias, 0.0).build();
        let adv = advantages(obj.as_ref(), &[1.0; 4]).advantages;
        let (_, grad, _) = run(obj.as_ref(), &logp, &Case::tokens(&adv, &w));
        if expect_zero {
            assert!(grad.iter().all(|&g| g == 0.0), "{grad:?}");
        } else {
            // Minimising the loss raises every token's log-prob: d loss / d logp = -w * b * p < 0.
            for (g, lp) in grad.iter().zip(logp) {
                let want = -0.25 * 0.5 * lp.exp();
                assert!((g - want).abs() < 1e-6, "{g} vs {want}");
            }
        }
    }
}

#[test]
fn negative_advantage_tokens_below_one_minus_eps_get_no_gradient() {
    let obj = cfg(ObjectiveName::OffGrpo, 0.0, 0.0).build();
    // p = 0.5 (< 0.8), p = 0.9 (>= 0.8), p = 0.79 (< 0.8), p = 0.81
    let logp: Vec<f32> = [0.5f32, 0.9, 0.79, 0.81].iter().map(|p| p.ln()).collect();
    let (loss, grad, terms) = run(obj.as_ref(), &logp, &Case::tokens(&[-1.0; 4], &[1.0; 4]));
    assert_eq!(grad[0], 0.0);
    assert_eq!(grad[2], 0.0);
    assert!((grad[1] - 0.9).abs() < 1e-6 && (grad[3] - 0.81).abs() < 1e-6, "{grad:?}");
    assert_eq!(terms.clipped_tokens, 2);
    // value = -min(p A, max(p, 0.8) A) summed = 0.8 + 0.9 + 0.8 + 0.81
    assert!((loss - 3.31).abs() < 1e-5, "{loss}");
    // Positive advantages are never clipped when the behaviour probability is 1 (ratio <= 1).
    let (_, grad, terms) = run(obj.as_ref(), &logp, &Case::tokens(&[1.0; 4], &[1.0; 4]));
    assert_eq!(terms.clipped_tokens, 0);
    assert!(grad.iter().zip([0.5f32, 0.9, 0.79, 0.81]).all(|(g, p)| (g + p).abs() < 1e-6));
}

#[test]
fn teacher_logprobs_replace_probability_one() {
    let obj = cfg(ObjectiveName::OffGrpo, 0.0, 0.0).build();
    // Teacher log-probs -1.0 and -2.0: ratios 1 and e (clipped at 1.2 for A > 0).
    let case = Case { behaviour: Some(&[-1.0, -2.0]), ..Case::tokens(&[1.0, 1.0], &[1.0, 1.0]) };
    let (loss, g, terms) = run(obj.as_ref(), &[-1.0, -1.0], &case);
    assert_eq!(terms.clipped_tokens, 1);
    assert!((loss + 1.0 + 1.2).abs() < 1e-5);
    assert!((g[0] + 1.0).abs() < 1e-6 && g[1] == 0.0, "{g:?}");
}

/// Ratios r = exp(logp - behaviour) of the given values, with behaviour 0.
fn logp_of(ratios: &[f32]) -> Vec<f32> {
    ratios.iter().map(|r| r.ln()).collect()
}

#[test]
fn grpo_clips_at_different_eps_and_eps_high_and_never_clips_a_negative_advantage_above_one_plus_eps() {
    // eps = 0.1, eps_high = 0.3: the band is [0.9, 1.3]. Behaviour log-probs 0 (the reference as anchor).
    let c = with(ObjectiveName::Grpo, "eps = 0.1\neps_high = 0.3\nanchor = \"reference\"");
    let obj = c.build();
    let r = [1.4f32, 1.25, 0.85, 0.95, 1.6, 1.25];
    let adv = [1.0f32, 1.0, -1.0, -1.0, -1.0, -2.0];
    let w = [0.5f32; 6];
    let case = Case { behaviour: Some(&[0.0; 6]), ..Case::tokens(&adv, &w) };
    let (loss, grad, terms) = run(obj.as_ref(), &logp_of(&r), &case);
    // 1.4 with A > 0: clipped at 1 + eps_high = 1.3 (not at 1.1); 0.85 with A < 0: clipped at 0.9 (not 0.7).
    // 1.6 with A < 0 is above 1 + eps_high: min(r A, clip(r) A) = r A, not clipped: the gradient flows.
    assert_eq!(terms.clipped_tokens, 2);
    let want_grad = [0.0, -0.5 * 1.25, 0.0, 0.5 * 0.95, 0.5 * 1.6, 0.5 * 2.0 * 1.25];
    assert_all_near(&grad, &want_grad, "grpo gradient");
    let want_loss = -0.5 * (1.3 + 1.25 - 0.9 - 0.95 - 1.6 - 2.0 * 1.25);
    assert!(near(loss, want_loss), "{loss} vs {want_loss}");
    assert_eq!(c.eps_low(), 0.1);
    assert_eq!(c.eps_high(), 0.3);
}

#[test]
fn rec_masks_hand_computed() {
    // Band [0.8, 1.2], ring outer bounds 1 - 0.6 = 0.4 and 1 + 2.0 = 3.0.
    let r = [1.1f32, 1.3, 0.5, 0.3, 0.9, 0.7, 1.5, 3.5];
    let adv = [1.0f32, 1.0, 1.0, 1.0, -1.0, -1.0, -1.0, -1.0];
    let w = [1.0f32; 8];
    let case = Case { behaviour: Some(&[0.0; 8]), ..Case::tokens(&adv, &w) };
    let masks: [(ClipMode, [f32; 8]); 3] = [
        // one-side: A > 0 while r <= 1.2, A < 0 while r >= 0.8.
        (ClipMode::OneSide, [1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0]),
        // two-side: 0.8 <= r <= 1.2 only.
        (ClipMode::TwoSide, [1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]),
        // ring: the band, A > 0 below 0.4, A < 0 above 3.0.
        (ClipMode::Ring, [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0]),
    ];
    let logp = logp_of(&r);
    for (mode, m) in masks {
        for is in [false, true] {
            let mode_name = serde_json::to_value(mode).unwrap();
            let c = with(ObjectiveName::Rec, &format!("clip_mode = {mode_name}\nimportance_weight = {is}"));
            c.validate().unwrap();
            let (loss, grad, terms) = run(c.build().as_ref(), &logp, &case);
            let factor = |i: usize| if is { r[i] } else { 1.0 };
            let want_grad: Vec<f32> = (0..8).map(|i| -adv[i] * m[i] * factor(i)).collect();
            assert_all_near(&grad, &want_grad, &format!("{mode:?} IS={is}"));
            let value = |i: usize| if is { r[i] } else { logp[i] };
            let want_loss: f32 = (0..8).map(|i| -adv[i] * m[i] * value(i)).sum();
            assert!(near(loss, want_loss), "{mode:?} IS={is}: {loss} vs {want_loss}");
            assert_eq!(terms.clipped_tokens, m.iter().filter(|&&x| x == 0.0).count());
        }
    }
}

#[test]
fn gspo_uses_the_sequence_ratio_and_clips_whole_sequences() {
    // Two answers of 2 and 3 tokens; token log-ratios (behaviour log-probs given) average to
    // log s_1 = 0.1 and log s_2 = -0.3; A = (+1, -1); eps = 0.2.
    let logp = [-1.0f32, -2.0, -0.5, -0.5, -0.5];
    let behaviour = [-1.05f32, -2.15, -0.3, -0.1, -0.2];
    let c = with(ObjectiveName::Gspo, "eps = 0.2\nanchor = \"reference\"");
    let case = Case {
        lengths: &[2, 3],
        adv: &[1.0, -1.0],
        w: &[0.25, 1.0 / 6.0],
        behaviour: Some(&behaviour),
        reference: None,
    };
    let (loss, grad, terms) = run(c.build().as_ref(), &logp, &case);
    let (s1, s2) = (0.1f32.exp(), (-0.3f32).exp());
    // s_1 = 1.105 inside the band: gradient -w A s_1 on each token; s_2 = 0.741 < 0.8 with A < 0: clipped.
    assert!(s1 < 1.2 && s2 < 0.8);
    assert_all_near(&grad, &[-0.25 * s1, -0.25 * s1, 0.0, 0.0, 0.0], "gspo gradient");
    assert_eq!(terms.clipped_tokens, 3);
    let want = -(0.5 * s1) - 3.0 / 6.0 * (-0.8);
    assert!(near(loss, want), "{loss} vs {want}");
    // The seed's defaults: sequence ratio, eps 6e-4 / 8e-4, no std normalisation, the policy at the step start.
    let d = cfg(ObjectiveName::Gspo, 0.0, 0.0);
    assert_eq!(
        (d.ratio_level(), d.eps_low(), d.eps_high(), d.std_normalize()),
        (RatioLevel::Sequence, 6e-4, 8e-4, false)
    );
    assert_eq!(d.anchor(), Some(Anchor::Step));
}

#[test]
fn opmd_adds_half_tau_squared_sequence_log_ratio() {
    // Two answers (2 and 1 tokens) with snapshot log-probs; sequence log-ratios S = (0.3, -0.2).
    let logp = [-1.0f32, -0.5, -2.0];
    let behaviour = [-1.1f32, -0.7, -1.8];
    let c = with(ObjectiveName::Opmd, "tau = 0.5\nanchor = \"snapshot\"");
    let case =
        Case { lengths: &[2, 1], adv: &[0.5, -0.5], w: &[0.5, 0.5], behaviour: Some(&behaviour), reference: None };
    let (loss, grad, _) = run(c.build().as_ref(), &logp, &case);
    let (s1, s2) = (0.3f32, -0.2f32);
    // -sum_t w_t A_i log p_t = -(0.5 * 0.5 * -1.5) - (0.5 * -0.5 * -2) = 0.375 - 0.5.
    let pg = 0.375 - 0.5;
    let want = pg + 0.5 * 0.25 * (s1 * s1 + s2 * s2);
    assert!(near(loss, want), "{loss} vs {want}");
    // d/dlogp_t = -w A + w_i tau S_i.
    let want_grad = [-0.25 + 0.5 * 0.5 * s1, -0.25 + 0.5 * 0.5 * s1, 0.25 + 0.5 * 0.5 * s2];
    assert_all_near(&grad, &want_grad, "opmd gradient");
    // With the default anchor (the policy at the start of the step) the squared term vanishes.
    let (loss, grad, _) = run(cfg(ObjectiveName::Opmd, 0.0, 0.0).build().as_ref(), &logp, &case);
    assert!(near(loss, pg), "{loss} vs {pg}");
    assert_all_near(&grad, &[-0.25, -0.25, 0.25], "opmd at the step start");
}

#[test]
fn reinforce_family_losses_hand_computed() {
    let logp = [-1.0f32, -0.5, -2.0];
    let case = Case { lengths: &[2, 1], adv: &[0.6, -0.4], w: &[0.25, 0.5], behaviour: None, reference: None };
    for name in [ObjectiveName::Asymre, ObjectiveName::RedDrop, ObjectiveName::RedWeight, ObjectiveName::Sft] {
        let (loss, grad, terms) = run(cfg(name, 0.0, 0.0).build().as_ref(), &logp, &case);
        // -sum_t w_t A_i log p_t = -(0.25 * 0.6 * -1.5) - (0.5 * -0.4 * -2.0)
        assert!(near(loss, 0.225 - 0.4), "{name:?}: {loss}");
        assert_all_near(&grad, &[-0.15, -0.15, 0.2], &format!("{name:?}"));
        assert_eq!((terms.kl, terms.clipped_tokens), (0.0, 0));
    }
}

#[test]
fn oapl_regresses_the_scaled_sequence_log_ratio_onto_the_optimal_advantage() {
    // Two answers (1 and 2 tokens), anchor log-probs given, targets A = r - V* = (0.4, -0.6), beta2 = 0.5.
    let logp = [-1.0f32, -0.5, -0.5];
    let anchor = [-1.2f32, -0.4, -0.2];
    let c = with(ObjectiveName::Oapl, "beta2 = 0.5\nanchor = \"reference\"");
    let case = Case { lengths: &[1, 2], adv: &[0.4, -0.6], w: &[0.5, 0.5], behaviour: Some(&anchor), reference: None };
    let (loss, grad, terms) = run(c.build().as_ref(), &logp, &case);
    // S = (0.2, -0.4); residuals 0.5 S - A = (-0.3, 0.4); L = 0.5 (0.09 + 0.16).
    assert!(near(loss, 0.125), "{loss}");
    assert!(near(terms.pg_loss, 0.125) && terms.kl == 0.0);
    // d/dlogp_t = 2 w_i beta2 (beta2 S_i - A_i).
    assert_all_near(&grad, &[2.0 * 0.5 * 0.5 * -0.3, 0.2, 0.2], "oapl gradient");
    // No clip, no importance ratio: a log-ratio of 30 gives a quadratic, finite loss.
    let far = Case { behaviour: Some(&[-31.0, -0.5, -0.5]), ..case };
    let (loss, grad, _) = run(c.build().as_ref(), &logp, &far);
    assert!(near(loss, 0.5 * (15.0f32 - 0.4).powi(2) + 0.5 * 0.36), "{loss}");
    assert!(near(grad[0], 14.6 * 0.5));
    let d = cfg(ObjectiveName::Oapl, 0.0, 0.0);
    assert_eq!((d.beta1(), d.beta2(), d.anchor(), d.anchor_every()), (1.0, 1e-3, Some(Anchor::Snapshot), 50));
    assert!(!d.build().needs_kl() && !d.build().needs_reference());
}

#[test]
fn seq_mean_token_mean_weights_each_answer_equally() {
    let w = LossAgg::SeqMeanTokenMean.weights(&[2, 8], &[true, true], 0);
    let per_answer = [w[0] * 2.0, w[1] * 8.0];
    assert!((per_answer[0] - 0.5).abs() < 1e-7 && (per_answer[1] - 0.5).abs() < 1e-7);
    // token-mean: every token the same weight; longer answers weigh more.
    let w = LossAgg::TokenMean.weights(&[2, 8], &[true, true], 0);
    assert!((w[0] - 0.1).abs() < 1e-7 && (w[1] - 0.1).abs() < 1e-7);
    let w = LossAgg::SeqMeanTokenSumNorm.weights(&[2, 8], &[true, true], 16);
    assert!((w[0] - 1.0 / 32.0).abs() < 1e-7);
    let w = LossAgg::SeqMeanTokenSum.weights(&[2, 8], &[true, false], 0);
    assert_eq!(w, vec![1.0, 0.0]);
}

#[test]
fn kl_estimators() {
    let lp = t(&[-1.0, -0.5]);
    let r = t(&[-1.5, -0.5]);
    let k1 = vals(&KlEstimator::K1.per_token(&lp, &r).unwrap());
    let k2 = vals(&KlEstimator::K2.per_token(&lp, &r).unwrap());
    let k3 = vals(&KlEstimator::K3.per_token(&lp, &r).unwrap());
    assert!((k1[0] - 0.5).abs() < 1e-6 && k1[1] == 0.0);
    assert!((k2[0] - 0.125).abs() < 1e-6);
    assert!((k3[0] - ((-0.5f32).exp() + 0.5 - 1.0)).abs() < 1e-6 && k3[1].abs() < 1e-7);
    // k3 is clamped at 10 and carries no gradient there.
    let lpv = Var::from_slice(&[-20.0f32], 1, &Device::Cpu).unwrap();
    let k = KlEstimator::K3.per_token(lpv.as_tensor(), &t(&[0.0])).unwrap();
    assert_eq!(vals(&k), vec![10.0]);
    let g = k.sum_all().unwrap().backward().unwrap();
    assert_eq!(vals(g.get(lpv.as_tensor()).unwrap()), vec![0.0]);
}

#[test]
fn k2_and_k3_gradients_inside_the_clamp_range() {
    let logp = [-1.0f32, -0.5, -3.0, -0.2];
    let reference = [-1.5f32, -0.5, -1.0, -2.5];
    for est in [KlEstimator::K1, KlEstimator::K2, KlEstimator::K3] {
        let lp = Var::from_slice(&logp, 4, &Device::Cpu).unwrap();
        let k = est.per_token(lp.as_tensor(), &t(&reference)).unwrap();
        let g = vals(k.sum_all().unwrap().backward().unwrap().get(lp.as_tensor()).unwrap());
        let want: Vec<f32> = logp
            .iter()
            .zip(reference)
            .map(|(&l, r)| match est {
                KlEstimator::K1 => 1.0,
                KlEstimator::K2 => l - r,
                KlEstimator::K3 => 1.0 - (r - l).exp(), // d/dlogp of p_ref/p - log(p_ref/p) - 1
            })
            .collect();
        assert!(vals(&k).iter().all(|v| v.abs() < 10.0), "{est:?}: outside the clamp");
        assert_all_near(&g, &want, &format!("{est:?} gradient"));
    }
}

#[test]
fn loss_is_pg_plus_beta_times_kl() {
    let logp = [-0.5f32, -3.0, -1.0];
    let reference = [-1.0f32, -1.0, -1.2];
    let w = [0.2f32, 0.3, 0.5];
    let adv = [1.0f32, -1.0, 0.5];
    let k3: Vec<f32> = logp.iter().zip(reference).map(|(&l, r)| (r - l).exp() - (r - l) - 1.0).collect();
    let kl: f32 = k3.iter().zip(w).map(|(k, w)| k * w).sum();
    for name in [
        ObjectiveName::OffGrpo,
        ObjectiveName::Grpo,
        ObjectiveName::Rec,
        ObjectiveName::Opmd,
        ObjectiveName::Asymre,
        ObjectiveName::Sft,
        ObjectiveName::Cispo,
    ] {
        let obj = cfg(name, 0.0, 0.3).build();
        let case = Case { reference: Some(&reference), ..Case::tokens(&adv, &w) };
        let (loss, grad, terms) = run(obj.as_ref(), &logp, &case);
        assert!(near(terms.kl, kl), "{name:?}: kl {} vs {kl}", terms.kl);
        assert!(near(loss, terms.pg_loss + 0.3 * kl), "{name:?}: {loss} vs {} + 0.3 {kl}", terms.pg_loss);
        // The KL part of the gradient: beta w_t (1 - p_ref / p), on top of the policy part.
        let (_, pg_grad, _) = run(obj.as_ref(), &logp, &Case::tokens(&adv, &w));
        for i in 0..3 {
            let kl_grad = 0.3 * w[i] * (1.0 - (reference[i] - logp[i]).exp());
            assert!(near(grad[i], pg_grad[i] + kl_grad), "{name:?} token {i}: {} vs {}", grad[i], pg_grad[i] + kl_grad);
        }
    }
}

#[test]
fn kl_term_pulls_towards_the_reference() {
    let obj = cfg(ObjectiveName::OffGrpo, 0.0, 0.1).build();
    let case = Case { reference: Some(&[-1.0, -1.0]), ..Case::tokens(&[0.0, 0.0], &[1.0, 1.0]) };
    let (_, grad, terms) = run(obj.as_ref(), &[-0.5, -3.0], &case);
    assert!(terms.kl > 0.0);
    // Above the reference: pushed down (positive gradient of the loss); below: pushed up.
    assert!(grad[0] > 0.0 && grad[1] < 0.0, "{grad:?}");
    assert!(obj.needs_kl() && obj.needs_reference());
    // The KL term is present exactly when reference log-probs are.
    let (loss, _, terms) = run(obj.as_ref(), &[-1.0], &Case::tokens(&[1.0], &[1.0]));
    assert_eq!(terms.kl, 0.0);
    assert_eq!(loss, terms.pg_loss);
    assert!(!cfg(ObjectiveName::OffGrpo, 0.0, 0.0).build().needs_reference());
    let anchored = with(ObjectiveName::Rec, "anchor = \"reference\"").build();
    assert!(!anchored.needs_kl() && anchored.needs_reference());
}

#[test]
fn a_large_log_prob_gap_gives_clipped_finite_values_never_inf_or_nan() {
    // Teacher log-probs 60 below the policy's: the ratio exp(60) would overflow f32; clamped at exp(20).
    let logp = [-0.1f32, -0.2, -0.3, -0.4];
    let teacher = [-60.1f32, -60.2, -0.3, -0.4];
    let reference = [-90.0f32, -0.2, 50.0, -0.4];
    let adv = [1.0f32, -1.0, 1.0, -1.0];
    let w = [0.25f32; 4];
    let x = Var::from_slice(&[-30.0f32, -19.0, 0.0, 25.0], 4, &Device::Cpu).unwrap();
    let e = exp_clamped(x.as_tensor()).unwrap();
    assert_all_near(&vals(&e), &[(-20f32).exp(), (-19f32).exp(), 1.0, 20f32.exp()], "exp_clamped");
    let g = vals(e.sum_all().unwrap().backward().unwrap().get(x.as_tensor()).unwrap());
    assert_all_near(&g, &[0.0, (-19f32).exp(), 1.0, 0.0], "exp_clamped gradient");
    let configs = [
        cfg(ObjectiveName::OffGrpo, 0.0, 0.1),
        with(ObjectiveName::Rec, "importance_weight = true\nclip_mode = \"ring\"\nbeta = 0.1"),
        with(ObjectiveName::Gspo, "eps = 0.2\nanchor = \"teacher\"\nbeta = 0.1"),
        with(ObjectiveName::Opmd, "anchor = \"teacher\"\nbeta = 0.1"),
        with(ObjectiveName::Oapl, "anchor = \"teacher\""),
    ];
    for c in configs {
        let case = Case { behaviour: Some(&teacher), reference: Some(&reference), ..Case::tokens(&adv, &w) };
        let (loss, grad, terms) = run(c.build().as_ref(), &logp, &case);
        assert!(loss.is_finite() && terms.kl.is_finite(), "{:?}: loss {loss}", c.name());
        assert!(grad.iter().all(|g| g.is_finite()), "{:?}: {grad:?}", c.name());
    }
    // off_grpo: token 0 (A > 0, ratio e^20 clipped at 1.2), token 1 (A < 0: -r A = e^20, no gradient).
    let case = Case { behaviour: Some(&teacher), ..Case::tokens(&adv, &w) };
    let (loss, grad, _) = run(cfg(ObjectiveName::OffGrpo, 0.0, 0.0).build().as_ref(), &logp, &case);
    let want = 0.25 * (-1.2 + 20f32.exp() - 1.0 + 1.0);
    assert!(near(loss, want), "{loss} vs {want}");
    assert_eq!(&grad[..2], &[0.0, 0.0]);
}

#[test]
fn grpo_ratio_starts_at_one_and_sft_uses_positive_answers() {
    let obj = cfg(ObjectiveName::Grpo, 0.0, 0.0).build();
    let (loss, grad, _) = run(obj.as_ref(), &[-0.3, -2.0], &Case::tokens(&[1.0, -1.0], &[0.5, 0.5]));
    assert!(loss.abs() < 1e-6);
    assert!((grad[0] + 0.5).abs() < 1e-6 && (grad[1] - 0.5).abs() < 1e-6, "{grad:?}");
    let sft = cfg(ObjectiveName::Sft, 0.0, 0.0).build();
    let g = advantages(sft.as_ref(), &[1.0, 0.0, 1.0]);
    assert_eq!(g.include, vec![true, false, true]);
    let adv = advantages(sft.as_ref(), &[1.0, 0.0]).advantages;
    let (loss, grad, _) = run(sft.as_ref(), &[-0.3, -2.0], &Case::tokens(&adv, &[1.0, 0.0]));
    assert!((loss - 0.3).abs() < 1e-6 && grad == vec![-1.0, 0.0]);
    // sft_answers = "all": every teacher answer is a positive sample.
    let all = with(ObjectiveName::Sft, "sft_answers = \"all\"");
    all.validate().unwrap();
    let g = advantages(all.build().as_ref(), &[1.0, 0.0, 1.0]);
    assert_eq!((g.include, g.advantages), (vec![true; 3], vec![1.0; 3]));
    let wrong = try_with(ObjectiveName::Grpo, "sft_answers = \"all\"").unwrap_err();
    assert!(wrong.contains("objective.sft_answers"), "{wrong}");
}

#[test]
fn options_that_do_not_apply_are_rejected_by_name() {
    let bad = |c: std::result::Result<ObjectiveConfig, String>, key: &str| {
        let e = c.and_then(|c| c.validate()).unwrap_err();
        assert!(e.contains(&format!("objective.{key}")), "{key}: {e}");
    };
    bad(try_with(ObjectiveName::OffGrpo, "eps = 1.5"), "eps");
    bad(try_with(ObjectiveName::Sft, "bias = 0.5"), "bias");
    bad(try_with(ObjectiveName::Sft, "eps = 0.2"), "eps");
    bad(try_with(ObjectiveName::Oapl, "beta = 0.1"), "beta");
    bad(try_with(ObjectiveName::Oapl, "kl_estimator = \"k2\""), "kl_estimator");
    bad(try_with(ObjectiveName::Grpo, "clip_mode = \"ring\""), "clip_mode");
    bad(try_with(ObjectiveName::OffGrpo, "importance_weight = true"), "importance_weight");
    bad(try_with(ObjectiveName::Rec, "tau = 0.1"), "tau");
    bad(try_with(ObjectiveName::Opmd, "baseline_shift = 0.1"), "baseline_shift");
    bad(try_with(ObjectiveName::Asymre, "std_normalize = true"), "std_normalize");
    bad(try_with(ObjectiveName::RedDrop, "temperature = 2.0"), "temperature");
    bad(try_with(ObjectiveName::Grpo, "beta1 = 1.0"), "beta1");
    bad(try_with(ObjectiveName::Asymre, "anchor = \"snapshot\""), "anchor");
    bad(try_with(ObjectiveName::Opmd, "ratio_level = \"sequence\""), "ratio_level");
    bad(try_with(ObjectiveName::Rec, "eps_low_outer = 0.6"), "eps_low_outer");
    bad(try_with(ObjectiveName::Grpo, "anchor_every = 10"), "anchor_every");
    bad(try_with(ObjectiveName::Oapl, "anchor_every = 0"), "anchor_every");
    bad(try_with(ObjectiveName::RedWeight, "temperature = 0.0"), "temperature");
    bad(try_with(ObjectiveName::Rec, "clip_mode = \"ring\"\neps_high_outer = 0.1"), "eps_high_outer");
    // What applies passes.
    let ok = [
        with(ObjectiveName::Rec, "eps = 0.6\neps_high = 2.0"),
        with(ObjectiveName::Rec, "clip_mode = \"ring\"\neps_low_outer = 0.6"),
        with(ObjectiveName::Opmd, "anchor = \"snapshot\"\nanchor_every = 20\ntau = 0.1"),
        with(ObjectiveName::Oapl, "beta1 = 1.0\nbeta2 = 1e-3\nanchor_every = 50"),
        with(ObjectiveName::Grpo, "ratio_level = \"sequence\"\nbias = 0.5\nbeta = 0.1"),
        with(ObjectiveName::Sft, "loss_agg = \"token-mean\"\nbeta = 0.1"),
    ];
    for c in ok {
        c.validate().unwrap_or_else(|e| panic!("{c:?}: {e}"));
    }
}

#[test]
fn config_parses_and_names_unknown_keys() {
    let parsed: ObjectiveConfig =
        toml::from_str("name = \"grpo\"\neps = 0.1\neps_high = 0.28\nloss_agg = \"token-mean\"").unwrap();
    assert_eq!(parsed.name(), ObjectiveName::Grpo);
    assert_eq!(parsed.loss_agg(), LossAgg::TokenMean);
    let parsed: ObjectiveConfig =
        toml::from_str("name = \"rec\"\nclip_mode = \"ring\"\nimportance_weight = true\nanchor = \"snapshot\"")
            .unwrap();
    assert_eq!(
        (parsed.clip_mode(), parsed.importance_weight(), parsed.anchor()),
        (ClipMode::Ring, true, Some(Anchor::Snapshot))
    );
    let err = toml::from_str::<ObjectiveConfig>("name = \"grpo\"\nbetta = 0.1").unwrap_err().to_string();
    assert!(err.contains("betta"), "{err}");
    // Unset options are not written back, so a resolved config validates again.
    let text = toml::to_string(&cfg(ObjectiveName::Oapl, 0.0, 0.0)).unwrap();
    let back: ObjectiveConfig = toml::from_str(&text).unwrap();
    back.validate().unwrap();
    assert!(!text.contains("eps"), "{text}");
}

#[test]
fn dual_clip_and_cispo_hand_computed() {
    // One-token answers, teacher probability 1 (behaviour log-prob 0): r = exp(logp).
    let logp = [4f32.ln(), 4f32.ln(), 0.5f32.ln(), 2f32.ln()];
    let adv = [-1.0f32, 1.0, -1.0, -1.0];
    let w = [0.25f32; 4];
    let dual = with(ObjectiveName::OffGrpo, "dual_clip = true");
    dual.validate().unwrap();
    assert_eq!(dual.clip_ratio_c(), Some(3.0));
    let (loss, grad, terms) = run(dual.build().as_ref(), &logp, &Case::tokens(&adv, &w));
    // r = 4, A = -1: PPO's loss 4 exceeds -c A = 3, so it is 3 with no gradient (dual-clipped);
    // r = 4, A = 1: clipped at 1.2 (loss -1.2, no gradient); r = 0.5, A = -1: clipped at 0.8 (loss 0.8);
    // r = 2, A = -1: unclipped, loss r = 2 under the bound 3, gradient r.
    assert!((loss - 0.25 * (3.0 - 1.2 + 0.8 + 2.0)).abs() < 1e-6, "{loss}");
    assert!(grad.iter().zip([0.0, 0.0, 0.0, 0.5]).all(|(a, b)| (a - b).abs() < 1e-6), "{grad:?}");
    assert_eq!(terms.clipped_tokens, 3);
    // Without dual-clip the first token's loss is 4 with gradient r / 4.
    let (loss, grad, _) = run(cfg(ObjectiveName::OffGrpo, 0.0, 0.0).build().as_ref(), &logp, &Case::tokens(&adv, &w));
    assert!((loss - 0.25 * (4.0 - 1.2 + 0.8 + 2.0)).abs() < 1e-6 && (grad[0] - 1.0).abs() < 1e-6);
    // CISPO: -sg(clip(r, 0.8, 1.2)) A log pi, every token keeps its gradient -w clip(r) A.
    let cispo = with(ObjectiveName::Cispo, "anchor = \"teacher\"");
    let (loss, grad, terms) = run(cispo.build().as_ref(), &logp, &Case::tokens(&adv, &w));
    let clipped = [1.2f32, 1.2, 0.8, 1.2];
    let want: f32 = (0..4).map(|i| -0.25 * clipped[i] * adv[i] * logp[i]).sum();
    assert!((loss - want).abs() < 1e-6, "{loss} vs {want}");
    for i in 0..4 {
        assert!((grad[i] + 0.25 * clipped[i] * adv[i]).abs() < 1e-6, "{grad:?}");
    }
    assert_eq!(terms.clipped_tokens, 4);
}

#[test]
fn scale_rewards_group_batch_and_none() {
    let r = [1.0f32, 0.0, 0.0, 0.0];
    let key = GroupKey { batch_reward_std: 2.0, ..Default::default() };
    let scaled = |s: &str| with(ObjectiveName::Grpo, &format!("scale_rewards = \"{s}\"")).build();
    let group_std = 0.5f64; // unbiased std of [1, 0, 0, 0]
    let a = scaled("group").advantages(&r, &key).advantages;
    assert!((a[0] as f64 - 0.75 / (group_std + 1e-6)).abs() < 1e-5, "{a:?}");
    let a = scaled("batch").advantages(&r, &key).advantages;
    assert!((a[0] as f64 - 0.75 / (2.0 + 1e-6)).abs() < 1e-6 && (a[1] as f64 + 0.25 / 2.0).abs() < 1e-6, "{a:?}");
    assert_eq!(scaled("none").advantages(&r, &key).advantages, vec![0.75, -0.25, -0.25, -0.25]);
    // std_normalize is scale_rewards' older name: true is "group", false "none".
    let old = with(ObjectiveName::Grpo, "std_normalize = false");
    assert_eq!(old.scale_rewards(), ScaleRewards::None);
    assert_eq!(cfg(ObjectiveName::Cispo, 0.0, 0.0).scale_rewards(), ScaleRewards::Group);
    assert_eq!(cfg(ObjectiveName::Rec, 0.0, 0.0).scale_rewards(), ScaleRewards::None);
}

#[test]
fn peer_options_are_checked() {
    let c = |name| cfg(name, 0.0, 0.0);
    let err = |o: ObjectiveConfig| o.validate().unwrap_err();
    let refused = |name, options| try_with(name, options).unwrap_err();
    assert!(refused(ObjectiveName::Rec, "clip_ratio_c = 3.0").contains("objective.clip_ratio_c"));
    assert!(refused(ObjectiveName::Cispo, "dual_clip = true").contains("objective.dual_clip"));
    assert!(err(with(ObjectiveName::Grpo, "clip_ratio_c = 1.0")).contains("must be > 1"));
    let both = with(ObjectiveName::Grpo, "dual_clip = false\nclip_ratio_c = 2.0");
    assert!(err(both).contains("dual_clip = false"));
    let twice = with(ObjectiveName::Grpo, "std_normalize = true\nscale_rewards = \"batch\"");
    assert!(err(twice).contains("set one"));
    assert!(refused(ObjectiveName::Asymre, "scale_rewards = \"batch\"").contains("objective.scale_rewards"));
    let not_norm = with(ObjectiveName::Grpo, "loss_scale_factor = 512");
    assert!(err(not_norm).contains("seq-mean-token-sum-norm"));
    let dr_grpo = with(ObjectiveName::Grpo, "loss_agg = \"seq-mean-token-sum-norm\"\nloss_scale_factor = 512\nscale_rewards = \"none\"\nmask_truncated = true");
    dr_grpo.validate().unwrap();
    assert_eq!((dr_grpo.loss_scale_factor(1024), c(ObjectiveName::Grpo).loss_scale_factor(1024)), (512, 1024));
    let parsed: ObjectiveConfig =
        toml::from_str("name = \"cispo\"\neps_high = 0.28\nscale_rewards = \"batch\"\nmask_truncated = true").unwrap();
    parsed.validate().unwrap();
    assert_eq!(
        (parsed.name(), parsed.anchor(), parsed.loss_agg()),
        (ObjectiveName::Cispo, Some(Anchor::Step), LossAgg::TokenMean)
    );
    let dual: ObjectiveConfig = toml::from_str("name = \"gspo\"\nclip_ratio_c = 10.0").unwrap();
    assert_eq!((dual.validate(), dual.clip_ratio_c()), (Ok(()), Some(10.0)));
}

/// The sampler correction's weights c_t multiply each token's policy term, as if its aggregation weight
/// were w_t c_t, and leave the KL term alone.
#[test]
fn sampler_correction_weights_scale_the_policy_term_only() {
    let logp = [-0.5f32, -3.0, -1.0];
    let reference = [-1.0f32, -1.0, -1.2];
    let (w, adv, c) = ([0.2f32, 0.3, 0.5], [1.0f32, -1.0, 0.5], [0.5f32, 2.0, 0.0]);
    let wc: Vec<f32> = w.iter().zip(c).map(|(w, c)| w * c).collect();
    let run_with = |obj: &dyn Objective, weights: &[f32], correction: Option<&[f32]>| {
        let lp = Var::from_slice(&logp, 3, &Device::Cpu).unwrap();
        let mut inputs = TokenInputs::for_sequences(&[1, 1, 1], &adv, weights, &Device::Cpu).unwrap();
        inputs.ref_logp = Some(t(&reference));
        inputs.behaviour_logp = Some(t(&[-0.7, -2.5, -1.1]));
        inputs.is_weights = correction.map(t);
        let terms = obj.loss(lp.as_tensor(), &inputs).unwrap();
        let grad = vals(terms.loss.backward().unwrap().get(lp.as_tensor()).unwrap());
        let read = read(&terms);
        (read.pg_loss, read.kl, grad)
    };
    for name in [ObjectiveName::Grpo, ObjectiveName::Rec, ObjectiveName::Asymre, ObjectiveName::Cispo] {
        let asymre = name == ObjectiveName::Asymre;
        let obj = if asymre { cfg(name, 0.0, 0.3) } else { with(name, "anchor = \"teacher\"\nbeta = 0.3") }.build();
        let (pg, kl, grad) = run_with(obj.as_ref(), &w, Some(&c));
        let (pg_want, _, _) = run_with(obj.as_ref(), &wc, None);
        let (_, kl_want, _) = run_with(obj.as_ref(), &w, None);
        assert!(near(pg, pg_want) && near(kl, kl_want), "{name:?}: pg {pg} vs {pg_want}, kl {kl} vs {kl_want}");
        // Gradient: the policy part as with weights w c, plus the unchanged KL part beta w (1 - p_ref / p).
        let obj_pg = if asymre { cfg(name, 0.0, 0.0) } else { with(name, "anchor = \"teacher\"") }.build();
        let lp = Var::from_slice(&logp, 3, &Device::Cpu).unwrap();
        let mut inputs = TokenInputs::for_sequences(&[1, 1, 1], &adv, &wc, &Device::Cpu).unwrap();
        inputs.behaviour_logp = Some(t(&[-0.7, -2.5, -1.1]));
        let pg_grad =
            vals(obj_pg.loss(lp.as_tensor(), &inputs).unwrap().loss.backward().unwrap().get(lp.as_tensor()).unwrap());
        for i in 0..3 {
            let want = pg_grad[i] + 0.3 * w[i] * (1.0 - (reference[i] - logp[i]).exp());
            assert!(near(grad[i], want), "{name:?} token {i}: {} vs {want}", grad[i]);
        }
    }
}

/// The entropy bonus: -c sum_t w_t H_t, its gradient -c w_t on each token's entropy; negative
/// coefficients are refused.
#[test]
fn entropy_bonus_hand_computed() {
    let h = Var::from_slice(&[1.5f32, 0.2, 3.0], 3, &Device::Cpu).unwrap();
    let inputs = TokenInputs::for_sequences(&[2, 1], &[1.0, -1.0], &[0.25, 0.5], &Device::Cpu).unwrap();
    let bonus = entropy_bonus(h.as_tensor(), &inputs, 0.1).unwrap();
    assert!(near(bonus.to_scalar::<f32>().unwrap(), -0.1 * (0.25 * 1.5 + 0.25 * 0.2 + 0.5 * 3.0)));
    let g = vals(bonus.backward().unwrap().get(h.as_tensor()).unwrap());
    assert_all_near(&g, &[-0.025, -0.025, -0.05], "d bonus / d H");
    let bad = with(ObjectiveName::OffGrpo, "entropy_coeff = -0.1").validate().unwrap_err();
    assert!(bad.starts_with("objective.entropy_coeff = -0.1"), "{bad}");
    let cfg: ObjectiveConfig = toml::from_str("name = \"oapl\"\nentropy_coeff = 0.01").unwrap();
    assert_eq!((cfg.validate(), cfg.entropy_coeff()), (Ok(()), 0.01));
}

/// The high-entropy mask per answer, against torch.quantile's linear interpolation by hand: answer 0
/// has entropies [0.5, 2.0, 1.0, 3.0] (sorted 0.5, 1.0, 2.0, 3.0); with q = 0.5 the 0.5 quantile sits at
/// position 1.5, threshold 1.5, so 2.0 and 3.0 are kept; q = 0.2: position 2.4, threshold 2.4, 3.0 kept.
/// Answer 1 ([0.7]) keeps its one token; q = 1 keeps every token; ties at the threshold are kept.
#[test]
fn top_entropy_mask_hand_computed() {
    let h = [0.5f32, 2.0, 1.0, 3.0, 0.7];
    assert_eq!(top_entropy_mask(&h, &[4, 1], 0.5), [0.0, 1.0, 0.0, 1.0, 1.0]);
    assert_eq!(top_entropy_mask(&h, &[4, 1], 0.2), [0.0, 0.0, 0.0, 1.0, 1.0]);
    assert_eq!(top_entropy_mask(&h, &[4, 1], 1.0), [1.0; 5]);
    assert_eq!(top_entropy_mask(&[1.0, 1.0, 2.0], &[3], 0.1), [0.0, 0.0, 1.0]);
    assert_eq!(top_entropy_mask(&[1.0, 1.0, 1.0], &[3], 0.1), [1.0; 3]);
    assert_eq!(top_entropy_mask(&[], &[0], 0.5), Vec::<f32>::new());
    for q in [0.0f32, 1.5, f32::NAN] {
        let common = CommonOptions { top_entropy_quantile: Some(q), ..Default::default() };
        let bad = ObjectiveConfig { common, ..Default::default() }.validate().unwrap_err();
        assert!(bad.starts_with("objective.top_entropy_quantile"), "{bad}");
    }
}

/// Each objective refuses an option that only other objectives take, naming the option, the objective
/// and its options; `bias = 0` and `beta = 0` ("off") are read for every objective.
#[test]
fn an_option_of_another_objective_names_the_objective_and_its_options() {
    let common = options::fields::<CommonOptions>();
    for name in ObjectiveName::ALL {
        let own = name.options();
        let others = ObjectiveName::ALL.iter().flat_map(|n| n.options().iter());
        for key in others.filter(|k| !own.contains(k)) {
            let e = try_with(name, &format!("{key} = 1")).unwrap_err();
            let head = format!("objective.{key} does not apply to objective `{}` (its options: ", name.as_str());
            assert!(e.starts_with(&head), "{e}");
            assert!(own.iter().chain(common).all(|k| e.contains(k)), "{e}");
        }
        let off = with(name, "bias = 0.0\nbeta = 0");
        assert_eq!(off, ObjectiveConfig::of(name), "{}", name.as_str());
    }
    assert_eq!(
        try_with(ObjectiveName::Sft, "eps = 0.2").unwrap_err(),
        "objective.eps does not apply to objective `sft` (its options: beta, kl_estimator, sft_answers, \
         loss_scale_factor, mask_truncated, loss_agg, mask_zero_std, entropy_coeff, top_entropy_quantile)"
    );
    assert!(try_with(ObjectiveName::Oapl, "beta = 0.1").unwrap_err().contains("objective.beta does not apply"));
    let e = try_with(ObjectiveName::Grpo, "epss = 0.1").unwrap_err();
    assert!(e.starts_with("unknown field `epss`, expected one of `name`, `eps`, `eps_high`"), "{e}");
}

/// A config of every objective, with every option it takes set, reads back as it was written, in TOML and
/// in JSON; so does each objective's default.
#[test]
fn a_config_of_every_objective_round_trips() {
    let example = |key: &str| match key {
        "eps" => "0.1",
        "eps_high" => "0.3",
        "bias" => "0.5",
        "std_normalize" => "true",
        "scale_rewards" => "\"batch\"",
        "dual_clip" => "true",
        "clip_ratio_c" => "2.0",
        "beta" => "0.1",
        "kl_estimator" => "\"k2\"",
        "ratio_level" => "\"sequence\"",
        "clip_mode" => "\"ring\"",
        "importance_weight" => "true",
        "eps_low_outer" => "0.6",
        "eps_high_outer" => "2.5",
        "tau" => "0.2",
        "baseline_shift" => "0.2",
        "temperature" => "0.5",
        "beta1" => "0.5",
        "beta2" => "0.01",
        "anchor" => "\"snapshot\"",
        "anchor_every" => "3",
        "sft_answers" => "\"all\"",
        "loss_scale_factor" => "64",
        "mask_truncated" => "true",
        "loss_agg" => "\"seq-mean-token-sum-norm\"",
        "mask_zero_std" => "true",
        "entropy_coeff" => "0.01",
        "top_entropy_quantile" => "0.5",
        other => panic!("no example value for {other}"),
    };
    let common = options::fields::<CommonOptions>();
    for name in ObjectiveName::ALL {
        let keys: Vec<&str> = name.options().iter().chain(common).copied().collect();
        let text: Vec<String> = keys.iter().map(|k| format!("{k} = {}", example(k))).collect();
        let full = with(name, &text.join("\n"));
        for c in [full, ObjectiveConfig::of(name)] {
            let written = toml::to_string(&c).unwrap();
            assert_eq!(toml::from_str::<ObjectiveConfig>(&written).unwrap(), c, "{written}");
            let json = serde_json::to_value(&c).unwrap();
            assert_eq!(serde_json::from_value::<ObjectiveConfig>(json).unwrap(), c);
        }
        let written = toml::to_string(&with(name, &text.join("\n"))).unwrap();
        assert!(keys.iter().all(|k| written.contains(&format!("\n{k} = "))), "{written}");
    }
}
