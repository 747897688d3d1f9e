//! Every objective against the independent float64 numpy implementation of scripts/objectives_reference.py
//! on random cases (tests/fixtures/objectives/cases.json): advantages, included answers, aggregation
//! weights, loss, its parts, the clipped-token count and d loss / d log pi of every token, including cases
//! where masks and clips switch on and off and log-ratios beyond the +-20 clamp.

use super::*;
use candle_core::{Device, Var};
use serde_json::Value;

fn floats(v: &Value) -> Vec<f64> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()
}

fn close(a: f64, b: f64, what: &str) {
    assert!((a - b).abs() <= 2e-5 + 2e-4 * b.abs(), "{what}: {a} vs {b} (numpy)");
}

/// The case's per-answer data: lengths, advantages and inclusion from the Rust objective, checked
/// against the fixture on the way.
/// The answers cut at the token limit leave the loss with `mask_truncated`, as the step's batch does.
fn answers(case: &Value, cfg: &ObjectiveConfig, obj: &dyn Objective, name: &str) -> (Vec<usize>, Vec<f32>, Vec<bool>) {
    let (mut lengths, mut adv, mut include) = (Vec::new(), Vec::new(), Vec::new());
    let groups = case["groups"].as_array().unwrap();
    let all: Vec<f32> = groups.iter().flat_map(|g| floats(&g["rewards"])).map(|r| r as f32).collect();
    let batch_reward_std = RewardStats::of(&all).std;
    for g in groups {
        let rewards: Vec<f32> = floats(&g["rewards"]).iter().map(|&r| r as f32).collect();
        let key = GroupKey {
            seed: case["seed"].as_u64().unwrap(),
            epoch: case["epoch"].as_u64().unwrap() as usize,
            question: g["question"].as_str().unwrap(),
            batch_reward_std,
        };
        let ga = obj.advantages(&rewards, &key);
        adv.extend(ga.advantages);
        let truncated = g["truncated"].as_array().map(|t| t.iter().map(|b| b.as_bool().unwrap()).collect());
        let truncated: Vec<bool> = truncated.unwrap_or(vec![false; rewards.len()]);
        include.extend(ga.include.iter().zip(truncated).map(|(&i, t)| i && !(cfg.mask_truncated() && t)));
        lengths.extend(g["lengths"].as_array().unwrap().iter().map(|l| l.as_u64().unwrap() as usize));
    }
    let e = &case["expected"];
    let want_inc: Vec<bool> = e["include"].as_array().unwrap().iter().map(|b| b.as_bool().unwrap()).collect();
    assert_eq!(include, want_inc, "{name}: included answers");
    for (i, (a, b)) in adv.iter().zip(floats(&e["advantages"])).enumerate() {
        if include[i] {
            close(*a as f64, b, &format!("{name}: advantage {i}"));
        }
    }
    (lengths, adv, include)
}

fn check_case(case: &Value) {
    let name = case["name"].as_str().unwrap();
    let cfg: ObjectiveConfig = serde_json::from_value(case["objective"].clone()).unwrap();
    cfg.validate().unwrap_or_else(|e| panic!("{name}: {e}"));
    let obj = cfg.build();
    let (lengths, adv, include) = answers(case, &cfg, obj.as_ref(), name);
    let e = &case["expected"];
    let norm_len = cfg.loss_scale_factor(case["norm_len"].as_u64().unwrap() as usize);
    let w = cfg.loss_agg().weights(&lengths, &include, norm_len);
    for (i, (a, b)) in w.iter().zip(floats(&e["weights"])).enumerate() {
        close(*a as f64, b, &format!("{name}: weight {i}"));
    }
    // The tokens of the included answers, as one micro-batch of whole sequences.
    let mut tokens = Vec::new();
    let mut start = 0;
    for (i, &l) in lengths.iter().enumerate() {
        if include[i] {
            tokens.extend(start..start + l);
        }
        start += l;
    }
    let pick = |v: &Value| -> Vec<f32> {
        let all = floats(v);
        tokens.iter().map(|&t| all[t] as f32).collect()
    };
    let kept = |v: &[usize]| -> Vec<usize> { (0..lengths.len()).filter(|&i| include[i]).map(|i| v[i]).collect() };
    let adv_in: Vec<f32> = (0..lengths.len()).filter(|&i| include[i]).map(|i| adv[i]).collect();
    let w_in: Vec<f32> = (0..lengths.len()).filter(|&i| include[i]).map(|i| w[i]).collect();
    let mut inputs = TokenInputs::for_sequences(&kept(&lengths), &adv_in, &w_in, &Device::Cpu).unwrap();
    let t = |v: Vec<f32>| Tensor::from_vec(v.clone(), v.len(), &Device::Cpu).unwrap();
    if !case["behaviour"].is_null() {
        inputs.behaviour_logp = Some(t(pick(&case["behaviour"])));
    }
    if obj.needs_kl() {
        inputs.ref_logp = Some(t(pick(&case["ref"])));
    }
    let logp = pick(&case["logp"]);
    let lp = Var::from_slice(&logp, logp.len(), &Device::Cpu).unwrap();
    let terms = obj.loss(lp.as_tensor(), &inputs).unwrap();
    let loss = terms.loss.to_scalar::<f32>().unwrap() as f64;
    let read = super::tests::read(&terms);
    close(loss, e["loss"].as_f64().unwrap(), &format!("{name}: loss"));
    close(read.pg_loss as f64, e["pg_loss"].as_f64().unwrap(), &format!("{name}: pg_loss"));
    close(read.kl as f64, e["kl"].as_f64().unwrap(), &format!("{name}: kl"));
    assert_eq!(read.clipped_tokens as u64, e["clipped"].as_u64().unwrap(), "{name}: clipped tokens");
    let grads = terms.loss.backward().unwrap();
    let g = grads.get(lp.as_tensor()).map(|g| g.to_vec1::<f32>().unwrap()).unwrap_or(vec![0.0; logp.len()]);
    let want = pick(&e["grad"]);
    for (k, (a, b)) in g.iter().zip(&want).enumerate() {
        assert!(a.is_finite(), "{name}: gradient {k} is {a}");
        close(*a as f64, *b as f64, &format!("{name}: d loss / d logp of token {k}"));
    }
}

#[test]
fn every_objective_matches_the_numpy_reference() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/objectives/cases.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (python3 scripts/objectives_reference.py writes it)", path.display()));
    let fixture: Value = serde_json::from_str(&text).unwrap();
    let cases = fixture["cases"].as_array().unwrap();
    let mut seen = std::collections::BTreeSet::new();
    for case in cases {
        check_case(case);
        seen.insert(case["objective"]["name"].as_str().unwrap().to_string());
    }
    // Every objective is covered.
    for n in ["off_grpo", "grpo", "gspo", "rec", "opmd", "asymre", "red_drop", "red_weight", "oapl", "sft", "cispo"] {
        assert!(seen.contains(n), "the fixture has no {n} case");
    }
}
