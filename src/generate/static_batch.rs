//! Static batches: a batch of prompts prefilled together into a contiguous KV cache and decoded until its
//! last sequence ends; finished sequences leave the batch so the rest keeps going. The scheduling policy
//! `static` of [`super::GenerationOptions`], kept as the reference the paged engine is compared with.

use super::sampling::{pick, sequence_rng, FinishReason, Generation, SamplingParams};
use crate::model::Decoder;
use rand_chacha::ChaCha8Rng;

/// Generate a continuation for each prompt (token ids) in one batch. `ids` numbers the sequences for
/// their RNG streams (pass the global sample index so that batching never changes a sample);
/// `on_tokens(n)` is called after each step with the number of tokens produced (stop tokens excluded).
pub fn generate(
    model: &Decoder,
    prompts: &[Vec<u32>],
    ids: &[u64],
    params: &SamplingParams,
    stop: &[u32],
    pad: u32,
    on_tokens: impl FnMut(usize),
) -> candle_core::Result<Vec<Generation>> {
    generate_limited(model, prompts, (ids, &[]), params, stop, pad, on_tokens)
}

/// [`generate`] with a limit on new tokens per prompt (`limits`, below `params.max_new_tokens`; empty:
/// none), as a server's per-request `max_tokens`.
pub fn generate_limited(
    model: &Decoder,
    prompts: &[Vec<u32>],
    (ids, limits): (&[u64], &[usize]),
    params: &SamplingParams,
    stop: &[u32],
    pad: u32,
    on_tokens: impl FnMut(usize),
) -> candle_core::Result<Vec<Generation>> {
    let on_device = !model.device().is_cpu();
    generate_on(model, prompts, (ids, limits), params, (stop, pad), on_tokens, on_device)
}

/// [`generate_limited`], choosing the tokens on the device or on the host ([`pick`]).
fn generate_on(
    model: &Decoder,
    prompts: &[Vec<u32>],
    (ids, limits): (&[u64], &[usize]),
    params: &SamplingParams,
    (stop, pad): (&[u32], u32),
    mut on_tokens: impl FnMut(usize),
    on_device: bool,
) -> candle_core::Result<Vec<Generation>> {
    assert_eq!(prompts.len(), ids.len(), "one id per prompt");
    assert!(limits.is_empty() || limits.len() == prompts.len(), "one limit per prompt, or none");
    assert!(!limits.contains(&0), "limits on new tokens are at least 1");
    let limit = |seq: usize| limits.get(seq).map_or(params.max_new_tokens, |&m| m.min(params.max_new_tokens));
    let mut out: Vec<Option<Generation>> = vec![None; prompts.len()];
    if prompts.is_empty() {
        return Ok(vec![]);
    }
    let mut rngs: Vec<ChaCha8Rng> = ids.iter().map(|&i| sequence_rng(params.seed, i)).collect();
    let mut produced: Vec<Vec<u32>> = vec![Vec::new(); prompts.len()];
    let mut produced_lp: Vec<Vec<f32>> = vec![Vec::new(); prompts.len()];
    let mut active: Vec<usize> = (0..prompts.len()).collect();
    if params.max_new_tokens == 0 {
        let empty = Generation { tokens: vec![], finish: FinishReason::Length, logprobs: vec![] };
        return Ok(vec![empty; prompts.len()]);
    }
    let context = model.config().max_position_embeddings;
    if let Some(p) = prompts.iter().find(|p| p.len() >= context) {
        candle_core::bail!(
            "a prompt of {} tokens fills the model's context of {context} positions (max_position_embeddings in \
             its config.json): no room for an answer",
            p.len()
        );
    }
    let (mut logits, mut cache) = model.prefill(prompts, pad)?;
    loop {
        // The streams of the active sequences, in row order (`active` is increasing).
        let mut mine: Vec<&mut ChaCha8Rng> = Vec::with_capacity(active.len());
        let mut wanted = active.iter().peekable();
        for (seq, rng) in rngs.iter_mut().enumerate() {
            if wanted.next_if(|&&a| a == seq).is_some() {
                mine.push(rng);
            }
        }
        let (picks, picked_lp) = pick(&logits, params, &mut mine, on_device)?;
        let mut next = Vec::with_capacity(active.len());
        let mut keep = Vec::with_capacity(active.len());
        let mut new_tokens = 0;
        for (r, &seq) in active.iter().enumerate() {
            let tok = picks[r];
            produced_lp[seq].push(picked_lp[r]);
            let finish = if stop.contains(&tok) {
                Some(FinishReason::Stop)
            } else {
                produced[seq].push(tok);
                new_tokens += 1;
                // An answer ends at max_new_tokens, or where the sequence fills the model's context.
                let full = prompts[seq].len() + produced[seq].len() >= context;
                (produced[seq].len() >= limit(seq) || full).then_some(FinishReason::Length)
            };
            if let Some(finish) = finish {
                let (tokens, logprobs) = (std::mem::take(&mut produced[seq]), std::mem::take(&mut produced_lp[seq]));
                out[seq] = Some(Generation { tokens, finish, logprobs });
                continue;
            }
            keep.push(r);
            next.push(tok);
        }
        on_tokens(new_tokens);
        if keep.is_empty() {
            break;
        }
        cache.retain(&keep)?;
        active = keep.iter().map(|&r| active[r]).collect();
        logits = model.step(&next, &mut cache)?;
    }
    Ok(out.into_iter().map(|g| g.expect("every sequence finishes")).collect())
}

#[cfg(test)]
mod tests {
    use super::super::sampling::picked_logprobs;
    use super::*;
    use crate::model::{random_decoder, Arch};
    use candle_core::Tensor;

    /// Greedy-decode one sequence by recomputing the full forward at every step (no cache): the reference
    /// that cached, batched generation is tested against. Quadratic: for tests on short outputs only.
    fn greedy_reference(
        model: &Decoder,
        prompt: &[u32],
        max_new_tokens: usize,
        stop: &[u32],
    ) -> candle_core::Result<Generation> {
        let mut seq = prompt.to_vec();
        let (mut tokens, mut logprobs) = (Vec::new(), Vec::new());
        for _ in 0..max_new_tokens {
            let logits = model.full_logits(&crate::model::TokenBatch::padded(std::slice::from_ref(&seq), 0))?;
            let last: Tensor = logits.get(0)?.get(seq.len() - 1)?;
            let tok = last.argmax(0)?.to_scalar::<u32>()?;
            let idx = Tensor::new(&[tok], last.device())?;
            logprobs.push(picked_logprobs(&last.unsqueeze(0)?, &idx)?.to_vec1::<f32>()?[0]);
            if stop.contains(&tok) {
                return Ok(Generation { tokens, finish: FinishReason::Stop, logprobs });
            }
            tokens.push(tok);
            seq.push(tok);
        }
        Ok(Generation { tokens, finish: FinishReason::Length, logprobs })
    }

    #[test]
    fn batched_greedy_equals_single_and_full_recompute() {
        let shape = crate::model::tiny::TinyShape { layers: 2, hidden: 64, heads: 4, kv_heads: 2, intermediate: 128 };
        let cfg = shape.config(Arch::Qwen3, 128, None, None).unwrap();
        let model = random_decoder(cfg, 7, candle_core::DType::F32, &candle_core::Device::Cpu, false).unwrap();
        let prompts: Vec<Vec<u32>> =
            vec![vec![1, 5, 9, 33, 2], vec![2, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41], vec![3]];
        let params = SamplingParams { max_new_tokens: 12, ..Default::default() };
        let single = |p: &Vec<u32>, i: usize, stop: &[u32]| {
            generate(&model, std::slice::from_ref(p), &[i as u64], &params, stop, 0, |_| {}).unwrap().remove(0)
        };
        // A stop token that the random model emits sometimes, so rows leave the batch at different steps.
        let stop = vec![single(&prompts[0], 0, &[]).tokens[3]];
        let batched = generate(&model, &prompts, &[0, 1, 2], &params, &stop, 0, |_| {}).unwrap();
        for (i, p) in prompts.iter().enumerate() {
            let one = single(p, i, &stop);
            let reference = greedy_reference(&model, p, 12, &stop).unwrap();
            let same = |a: &Generation, b: &Generation, what: &str| {
                assert_eq!((&a.tokens, a.finish), (&b.tokens, b.finish), "prompt {i}: {what}");
                assert_eq!(a.logprobs.len(), a.tokens.len() + usize::from(a.finish == FinishReason::Stop));
                let d = a.logprobs.iter().zip(&b.logprobs).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
                assert!(d < 1e-4, "prompt {i}: {what}: log-probs differ by {d}");
            };
            same(&batched[i], &one, "batched != single");
            same(&one, &reference, "cached != full recompute");
        }
        assert_eq!(batched[0].finish, FinishReason::Stop);
    }

    /// Sampled generation reads the device once per step for the whole batch (the ids and their
    /// log-probs), and a sequence's tokens depend on its seed and id only, not on its batch.
    #[test]
    fn sampled_generation_reads_once_per_step_and_keeps_its_streams() {
        let shape = crate::model::tiny::TinyShape { layers: 1, hidden: 32, heads: 2, kv_heads: 1, intermediate: 64 };
        let cfg = shape.config(Arch::Qwen3, 64, None, None).unwrap();
        let model = random_decoder(cfg, 3, candle_core::DType::F32, &candle_core::Device::Cpu, false).unwrap();
        let prompts: Vec<Vec<u32>> = vec![vec![1, 5, 9], vec![2, 7], vec![3, 4, 6, 8]];
        let params = SamplingParams { temperature: 1.0, top_p: 0.9, top_k: 40, max_new_tokens: 9, seed: 11 };
        let before = crate::device::host_reads();
        let on_device = generate_on(&model, &prompts, (&[0, 1, 2], &[]), &params, (&[], 0), |_| {}, true).unwrap();
        assert_eq!(crate::device::host_reads() - before, 9, "one read per step of 9");
        // The host sampler (used on the CPU device) picks the same tokens from the same streams.
        let batched = generate(&model, &prompts, &[0, 1, 2], &params, &[], 0, |_| {}).unwrap();
        for (d, h) in on_device.iter().zip(&batched) {
            assert_eq!(d.tokens, h.tokens);
            let diff = d.logprobs.iter().zip(&h.logprobs).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
            assert!(diff < 1e-4, "log-probs differ by {diff}");
        }
        for (i, p) in prompts.iter().enumerate() {
            let one = generate(&model, std::slice::from_ref(p), &[i as u64], &params, &[], 0, |_| {}).unwrap();
            assert_eq!(one[0].tokens, batched[i].tokens, "prompt {i}: batched != single");
            assert_eq!(one[0].logprobs.len(), 9);
        }
        let other = SamplingParams { seed: 12, ..params.clone() };
        let reseeded = generate(&model, &prompts, &[0, 1, 2], &other, &[], 0, |_| {}).unwrap();
        assert_ne!(
            reseeded.iter().map(|g| &g.tokens).collect::<Vec<_>>(),
            batched.iter().map(|g| &g.tokens).collect::<Vec<_>>()
        );
    }
}
