//! Our decoder against Hugging Face transformers: per-token log-probs from `grpo logprobs` on models
//! written by `grpo init-tiny` (which transformers loaded to make the fixtures) and on SmolLM2-135M.

mod common;

use serde_json::{json, Value};
use std::path::Path;

fn fixture(name: &str) -> Value {
    let p = common::root().join("tests/fixtures/parity").join(name);
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

/// Run `grpo logprobs` on the fixture's cases and compare tokens and log-probs with the fixture's;
/// returns every signed difference (grpo - fixture).
fn check_logprobs(model: &Path, fx: &Value, tol: f64) -> Vec<f64> {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.jsonl");
    let output = dir.path().join("out.jsonl");
    let cases = fx["cases"].as_array().unwrap();
    let lines: Vec<String> = cases
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let v = if c.get("text").is_some() {
                json!({"id": i, "text": c["text"]})
            } else {
                json!({"id": i, "prompt": c["prompt"], "response": c["response"]})
            };
            v.to_string()
        })
        .collect();
    std::fs::write(&input, lines.join("\n")).unwrap();
    common::grpo()
        .args(["logprobs", "--model"])
        .arg(model)
        .arg("--input")
        .arg(&input)
        .arg("--output")
        .arg(&output)
        .assert()
        .success();
    let got = common::read_jsonl(&output);
    assert_eq!(got.len(), cases.len());
    let mut diffs = vec![];
    for (g, want) in got.iter().zip(cases) {
        assert_eq!(g["id"], json!(got.iter().position(|x| x == g).unwrap()));
        let want_tokens: Vec<u64> = want["tokens"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect();
        let want_tokens = if want.get("text").is_some() { want_tokens[1..].to_vec() } else { want_tokens };
        let got_tokens: Vec<u64> = g["tokens"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect();
        assert_eq!(got_tokens, want_tokens, "tokenisation differs from transformers");
        let (a, b) = (g["logprobs"].as_array().unwrap(), want["logprobs"].as_array().unwrap());
        assert_eq!(a.len(), b.len());
        let d: Vec<f64> = a.iter().zip(b).map(|(x, y)| x.as_f64().unwrap() - y.as_f64().unwrap()).collect();
        let diff = d.iter().fold(0.0, |m: f64, x| m.max(x.abs()));
        assert!(diff < tol, "{}: max |Δ log-prob| = {diff}", model.display());
        let sum: f64 = a.iter().map(|x| x.as_f64().unwrap()).sum();
        assert!((sum - g["sum"].as_f64().unwrap()).abs() < 1e-3);
        diffs.extend(d);
    }
    diffs
}

#[test]
fn tiny_models_match_transformers() {
    for (arch, tok) in [("qwen2", "qwen3"), ("qwen3", "qwen3"), ("llama", "llama3")] {
        let dir = tempfile::tempdir().unwrap();
        let model = dir.path().join(arch);
        common::init_tiny(arch, tok, &model);
        check_logprobs(&model, &fixture(&format!("tiny-{arch}.json")), 1e-3);
    }
}

#[test]
fn smollm2_matches_transformers() {
    let Some(model) = common::smollm2() else { return };
    check_logprobs(&model, &fixture("smollm2.json"), 1e-3);
}

/// f32 log-probs against a float64 forward of the same weights (tests/fixtures/parity/smollm2-f64.json,
/// from scripts/make_f64_logprobs.py: an independent numpy Llama forward, all in float64, itself within
/// 3.1e-5 of transformers' f32 log-probs on these texts). Measured on the 241 log-probs (x86 AVX2):
/// before the row kernels summed the log-sum-exp in f64, max |Δ| = 2.3e-4 with every case's mean Δ
/// between +6.8e-5 and +1.2e-4 (the mass rounded away grows with the vocabulary); after, max |Δ| =
/// 2.9e-5 and |mean Δ| <= 1.5e-6. transformers in f32 is off by up to 3.06e-5 (mean +6e-6) on the same
/// texts. On an AVX-512 CPU (the gemm crate's wider kernels sum the products in another order) the same
/// build gives max |Δ| = 4.1e-5 and mean Δ = +9.3e-7. Bounds: 6e-5 on the max (twice transformers' own f32
/// error: an f32 forward's rounding on any SIMD width, while the f32 log-sum-exp's 2.3e-4 fails), and 1e-5
/// on the mean, which catches a systematic error.
#[test]
fn smollm2_f32_logprobs_match_float64() {
    let Some(model) = common::smollm2() else { return };
    let diffs = check_logprobs(&model, &fixture("smollm2-f64.json"), 6e-5);
    let mean = diffs.iter().sum::<f64>() / diffs.len() as f64;
    assert!(mean.abs() < 1e-5, "mean Δ log-prob = {mean:.2e} over {} tokens: a systematic error", diffs.len());
}

#[test]
fn logprobs_reports_malformed_lines_and_keeps_going() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m");
    common::init_tiny("qwen3", "qwen3", &model);
    let input = dir.path().join("in.jsonl");
    std::fs::write(
        &input,
        b"{\"id\": 1, \"text\": \"hello world\"}\n{not json\n{\"id\": 3}\n\xff\xfe\n{\"id\": 5, \"prompt\": \"hi\", \"response\": \"there\"}\n",
    )
    .unwrap();
    let out = dir.path().join("out.jsonl");
    let assert = common::grpo()
        .args(["logprobs", "--model"])
        .arg(&model)
        .arg("--input")
        .arg(&input)
        .arg("--output")
        .arg(&out)
        .assert()
        .success();
    let stderr = String::from_utf8_lossy(&assert.get_output().stderr).to_string();
    for line in [2, 3, 4] {
        assert!(stderr.contains(&format!("in.jsonl:{line}:")), "line {line} not reported:\n{stderr}");
    }
    let got = common::read_jsonl(&out);
    assert_eq!(got.iter().map(|v| v["id"].as_u64().unwrap()).collect::<Vec<_>>(), vec![1, 5]);
    // --strict stops at the first bad line, naming it, and leaves no output behind.
    let strict_out = dir.path().join("strict.jsonl");
    let assert = common::grpo()
        .args(["logprobs", "--strict", "--model"])
        .arg(&model)
        .arg("--input")
        .arg(&input)
        .arg("--output")
        .arg(&strict_out)
        .assert()
        .failure();
    assert!(String::from_utf8_lossy(&assert.get_output().stderr).contains("in.jsonl:2:"));
    assert!(!strict_out.exists());
    // Every line malformed: nothing scored is an error, and no output is left behind.
    let bad = dir.path().join("bad.jsonl");
    std::fs::write(&bad, "{not json\n{\"id\": 3}\n").unwrap();
    let none_out = dir.path().join("none.jsonl");
    let assert = common::grpo()
        .args(["logprobs", "--model"])
        .arg(&model)
        .arg("--input")
        .arg(&bad)
        .arg("--output")
        .arg(&none_out)
        .assert()
        .failure();
    assert!(String::from_utf8_lossy(&assert.get_output().stderr).contains("nothing was scored"));
    assert!(!none_out.exists());
}
