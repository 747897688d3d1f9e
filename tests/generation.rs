//! Sampled generation independent of the batch, and SmolLM2's greedy answers against transformers'
//! generate (fixture). Batched, cached greedy decoding against full recompute: unit test in
//! src/eval/generate.rs.

mod common;

use grpo::eval::{generate, SamplingParams};
use grpo::model::{load_decoder, ChatTokenizer};

#[test]
fn sampled_generation_is_reproducible_and_batch_independent() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m");
    common::init_tiny("llama", "llama3", &path);
    let model = load_decoder(&path, candle_core::DType::F32, &candle_core::Device::Cpu, false).unwrap();
    let prompts = vec![vec![128000u32, 9906, 1917], vec![128000u32, 791, 4320, 374]];
    let params = SamplingParams { temperature: 0.8, top_p: 0.95, top_k: 50, max_new_tokens: 8, seed: 11 };
    let a = generate(&model, &prompts, &[0, 1], &params, &[], 0, |_| {}).unwrap();
    let b = generate(&model, &prompts, &[0, 1], &params, &[], 0, |_| {}).unwrap();
    assert_eq!(a, b);
    let alone = generate(&model, &prompts[1..], &[1], &params, &[], 0, |_| {}).unwrap();
    // The same tokens; their log-probs to float rounding (a batch of one pads and reduces differently).
    assert_eq!((&alone[0].tokens, alone[0].finish), (&a[1].tokens, a[1].finish));
    assert_eq!(alone[0].logprobs.len(), a[1].logprobs.len());
    for (x, y) in alone[0].logprobs.iter().zip(&a[1].logprobs) {
        assert!((x - y).abs() < 1e-4, "{x} vs {y}");
    }
}

#[test]
fn smollm2_greedy_matches_transformers() {
    let Some(path) = common::smollm2() else { return };
    let fx: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(common::root().join("tests/fixtures/parity/smollm2.json")).unwrap(),
    )
    .unwrap();
    let model = load_decoder(&path, candle_core::DType::F32, &candle_core::Device::Cpu, false).unwrap();
    let tok = ChatTokenizer::load(&path).unwrap();
    let gens = fx["generations"].as_array().unwrap();
    let prompts: Vec<Vec<u32>> = gens
        .iter()
        .map(|g| tok.encode(&tok.render_prompt(None, g["prompt"].as_str().unwrap()).unwrap(), false).unwrap())
        .collect();
    for (p, g) in prompts.iter().zip(gens) {
        let want: Vec<u32> =
            g["prompt_tokens"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
        assert_eq!(p, &want, "chat template + tokenizer differ from transformers");
    }
    let params = SamplingParams { max_new_tokens: 24, ..Default::default() };
    let out = generate(&model, &prompts, &[0, 1], &params, tok.eos_ids(), tok.pad_id(), |_| {}).unwrap();
    for (o, g) in out.iter().zip(gens) {
        let want: Vec<u32> = g["tokens"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
        // transformers includes the EOS token in its output; we report it as the finish reason.
        let want_trimmed: Vec<u32> = want.iter().copied().take_while(|t| !tok.eos_ids().contains(t)).collect();
        assert_eq!(o.tokens, want_trimmed, "prompt {:?}", g["prompt"]);
    }
    assert_eq!(tok.decode(&out[0].tokens, true).unwrap(), "The capital of France is Paris.");
}
