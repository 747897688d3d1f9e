use super::*;
use candle_core::{Device, Var};

fn t(v: &[f32]) -> Tensor {
    Tensor::from_slice(v, v.len(), &Device::Cpu).unwrap()
}

fn vals(t: &Tensor) -> Vec<f32> {
    t.to_vec1::<f32>().unwrap()
}

/// Loss and d loss / d logp for one micro-batch.
fn run(
    obj: &dyn Objective,
    logp: &[f32],
    adv: &[f32],
    w: &[f32],
    ref_logp: Option<&[f32]>,
) -> (f32, Vec<f32>, LossTerms) {
    let lp = Var::from_slice(logp, logp.len(), &Device::Cpu).unwrap();
    let inputs = TokenInputs {
        advantages: t(adv),
        weights: t(w),
        ref_logp: ref_logp.map(t),
        behaviour_logp: if obj.needs_old_logprobs() { Some(lp.as_detached_tensor()) } else { None },
    };
    let terms = obj.loss(lp.as_tensor(), &inputs).unwrap();
    let g = terms.loss.backward().unwrap();
    let grad = g.get(lp.as_tensor()).map(vals).unwrap_or(vec![0.0; logp.len()]);
    (terms.loss.to_scalar::<f32>().unwrap(), grad, terms)
}

fn cfg(name: ObjectiveName, bias: f32, beta: f32) -> ObjectiveConfig {
    ObjectiveConfig { name, bias, beta, ..Default::default() }
}

#[test]
fn advantages_hand_computed() {
    let c = AdvantageConfig { std_normalize: true, bias: 0.5 };
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
    let a = group_advantages(&[1.0, 0.0], &AdvantageConfig { std_normalize: false, bias: 0.0 }).advantages;
    assert_eq!(a, vec![0.5, -0.5]);
}

#[test]
fn all_positive_group_gives_zero_gradient_without_bias_and_positive_with_it() {
    let logp = [-0.1f32, -2.0, -0.7, -0.05];
    let w = [0.25f32; 4];
    for (bias, expect_zero) in [(0.0, true), (0.5, false)] {
        let obj = cfg(ObjectiveName::OffGrpo, bias, 0.0).build();
        let adv = obj.advantages(&[1.0; 4]).advantages;
        let (_, grad, _) = run(obj.as_ref(), &logp, &adv, &w, None);
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
    let (loss, grad, terms) = run(obj.as_ref(), &logp, &[-1.0; 4], &[1.0; 4], None);
    assert_eq!(grad[0], 0.0);
    assert_eq!(grad[2], 0.0);
    assert!((grad[1] - 0.9).abs() < 1e-6 && (grad[3] - 0.81).abs() < 1e-6, "{grad:?}");
    assert_eq!(terms.clipped_tokens, 2);
    // value = -min(p A, max(p, 0.8) A) summed = 0.8 + 0.9 + 0.8 + 0.81
    assert!((loss - 3.31).abs() < 1e-5, "{loss}");
    // Positive advantages are never clipped when the behaviour probability is 1 (ratio <= 1).
    let (_, grad, terms) = run(obj.as_ref(), &logp, &[1.0; 4], &[1.0; 4], None);
    assert_eq!(terms.clipped_tokens, 0);
    assert!(grad.iter().zip([0.5f32, 0.9, 0.79, 0.81]).all(|(g, p)| (g + p).abs() < 1e-6));
}

#[test]
fn teacher_logprobs_replace_probability_one() {
    let obj = OffGrpo(cfg(ObjectiveName::OffGrpo, 0.0, 0.0));
    let lp = Var::from_slice(&[-1.0f32, -1.0], 2, &Device::Cpu).unwrap();
    // Teacher log-probs -1.0 and -2.0: ratios 1 and e (clipped at 1.2 for A > 0).
    let inputs = TokenInputs {
        advantages: t(&[1.0, 1.0]),
        weights: t(&[1.0, 1.0]),
        ref_logp: None,
        behaviour_logp: Some(t(&[-1.0, -2.0])),
    };
    let terms = obj.loss(lp.as_tensor(), &inputs).unwrap();
    assert_eq!(terms.clipped_tokens, 1);
    assert!((terms.loss.to_scalar::<f32>().unwrap() + 1.0 + 1.2).abs() < 1e-5);
    let g = vals(terms.loss.backward().unwrap().get(lp.as_tensor()).unwrap());
    assert!((g[0] + 1.0).abs() < 1e-6 && g[1] == 0.0, "{g:?}");
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
fn kl_term_pulls_towards_the_reference() {
    let obj = cfg(ObjectiveName::OffGrpo, 0.0, 0.1).build();
    let (_, grad, terms) = run(obj.as_ref(), &[-0.5, -3.0], &[0.0, 0.0], &[1.0, 1.0], Some(&[-1.0, -1.0]));
    assert!(terms.kl > 0.0);
    // Above the reference: pushed down (positive gradient of the loss); below: pushed up.
    assert!(grad[0] > 0.0 && grad[1] < 0.0, "{grad:?}");
    assert!(obj.needs_reference());
    // The KL term is present exactly when reference log-probs are.
    let no_ref = TokenInputs { advantages: t(&[1.0]), weights: t(&[1.0]), ref_logp: None, behaviour_logp: None };
    let terms = obj.loss(&t(&[-1.0]), &no_ref).unwrap();
    assert_eq!(terms.kl, 0.0);
    assert_eq!(terms.loss.to_scalar::<f32>().unwrap(), terms.pg_loss);
    assert!(!cfg(ObjectiveName::OffGrpo, 0.0, 0.0).build().needs_reference());
}

#[test]
fn grpo_ratio_starts_at_one_and_sft_uses_positive_answers() {
    let obj = cfg(ObjectiveName::Grpo, 0.0, 0.0).build();
    let (loss, grad, _) = run(obj.as_ref(), &[-0.3, -2.0], &[1.0, -1.0], &[0.5, 0.5], None);
    assert!(loss.abs() < 1e-6);
    assert!((grad[0] + 0.5).abs() < 1e-6 && (grad[1] - 0.5).abs() < 1e-6, "{grad:?}");
    let sft = cfg(ObjectiveName::Sft, 0.0, 0.0).build();
    assert_eq!(sft.include(&[1.0, 0.0, 1.0]), vec![true, false, true]);
    let adv = sft.advantages(&[1.0, 0.0]).advantages;
    let (loss, grad, _) = run(sft.as_ref(), &[-0.3, -2.0], &adv, &[1.0, 0.0], None);
    assert!((loss - 0.3).abs() < 1e-6 && grad == vec![-1.0, 0.0]);
}

#[test]
fn config_validation_names_the_field() {
    let mut c = ObjectiveConfig { eps: 1.5, ..Default::default() };
    assert!(c.validate().unwrap_err().contains("objective.eps"));
    c = ObjectiveConfig { name: ObjectiveName::Sft, bias: 0.5, ..Default::default() };
    assert!(c.validate().unwrap_err().contains("objective.bias"));
    let parsed: ObjectiveConfig =
        toml::from_str("name = \"grpo\"\neps = 0.1\neps_high = 0.28\nloss_agg = \"token-mean\"").unwrap();
    assert_eq!(parsed.name, ObjectiveName::Grpo);
    assert_eq!(parsed.loss_agg, LossAgg::TokenMean);
    let err = toml::from_str::<ObjectiveConfig>("name = \"grpo\"\nbetta = 0.1").unwrap_err().to_string();
    assert!(err.contains("betta"), "{err}");
}
