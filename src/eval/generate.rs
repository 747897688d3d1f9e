//! Batched generation with a KV cache: greedy or sampled (temperature, top-k, top-p), stopping at EOS;
//! finished sequences leave the batch so the rest keeps going. Each sequence draws from its own RNG,
//! seeded from (seed, sequence index), so results do not depend on batch composition.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

use crate::model::Decoder;

/// Sampling settings.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// Nucleus sampling mass (1 disables).
    pub top_p: f32,
    /// Keep the k most likely tokens (0 disables).
    pub top_k: usize,
    pub max_new_tokens: usize,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self { temperature: 0.0, top_p: 1.0, top_k: 0, max_new_tokens: 256, seed: 0 }
    }
}

impl SamplingParams {
    /// Check the ranges of temperature (finite, >= 0) and top_p (in (0, 1]); `name` gives a field's name as
    /// the user wrote it (a flag or a config key).
    pub fn validate(&self, name: impl Fn(&str) -> String) -> Result<(), String> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(format!("{} = {} must be >= 0 (0: greedy)", name("temperature"), self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("{} = {} must be in (0, 1]", name("top_p"), self.top_p));
        }
        Ok(())
    }
}

/// Why a sequence stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// An end-of-sequence token was produced (it is not included in `tokens`).
    Stop,
    /// `max_new_tokens` was reached.
    Length,
}

/// One generated continuation.
#[derive(Debug, Clone, PartialEq)]
pub struct Generation {
    pub tokens: Vec<u32>,
    pub finish: FinishReason,
    /// The log-prob of each generated token under the model's own distribution (before temperature, top-k
    /// and top-p), from the logits it was sampled from; one more, the stop token's, when it stopped.
    pub logprobs: Vec<f32>,
}

/// The finite logits as `(token, logit / temperature)`, or `Err` with the greedy choice when there is
/// nothing to sample (temperature 0, or no finite logit).
fn candidates(logits: &[f32], params: &SamplingParams) -> Result<Vec<(u32, f32)>, u32> {
    let argmax = || logits.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map_or(0, |(i, _)| i as u32);
    if params.temperature <= 0.0 {
        return Err(argmax());
    }
    let cand: Vec<(u32, f32)> = logits
        .iter()
        .enumerate()
        .filter(|(_, l)| l.is_finite())
        .map(|(i, &l)| (i as u32, l / params.temperature))
        .collect();
    if cand.is_empty() {
        return Err(argmax());
    }
    Ok(cand)
}

/// Pick the next token from one row of f32 logits.
///
/// Candidates are ordered by probability, ties by token id; top-k keeps the k first, top-p the shortest
/// prefix whose mass reaches p (after top-k). Only that prefix is ever sorted: it is found by partial
/// selection of a growing candidate set, so a 150k vocabulary costs a linear pass, not a sort.
pub fn sample_token(logits: &[f32], params: &SamplingParams, rng: &mut impl Rng) -> u32 {
    let mut cand = match candidates(logits, params) {
        Ok(c) => c,
        Err(token) => return token,
    };
    let order = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    // Move the `k` first candidates (in `order`) to the front, sorted.
    let front = |cand: &mut [(u32, f32)], k: usize| {
        if k < cand.len() {
            cand.select_nth_unstable_by(k, order);
        }
        let k = k.min(cand.len());
        cand[..k].sort_unstable_by(order);
    };
    if params.top_k > 0 && params.top_k < cand.len() {
        front(&mut cand[..], params.top_k);
        cand.truncate(params.top_k);
    }
    let max = cand.iter().map(|c| c.1).fold(f32::NEG_INFINITY, f32::max);
    let weight = |l: f32| ((l - max) as f64).exp();
    let total: f64 = cand.iter().map(|c| weight(c.1)).sum();
    let mut keep = cand.len();
    if params.top_p < 1.0 {
        let target = params.top_p as f64 * total;
        // Search first among the candidates within e^30 of the top: the others hold under 1e-8 of the mass
        // at any vocabulary size, so they enter a nucleus only when nothing else reaches p.
        let mut limit = 0;
        for i in 0..cand.len() {
            if cand[i].1 >= max - 30.0 {
                cand.swap(i, limit);
                limit += 1;
            }
        }
        let mut k = 64.min(limit);
        loop {
            front(&mut cand[..limit], k);
            let mut acc = 0.0;
            let reached = cand[..k].iter().position(|c| {
                acc += weight(c.1);
                acc >= target
            });
            if let Some(i) = reached {
                keep = i + 1;
                break;
            }
            if k == cand.len() {
                break;
            }
            if k == limit {
                limit = cand.len();
            }
            k = (k * 4).min(limit);
        }
    }
    let kept = &cand[..keep];
    let mass: f64 = if keep == cand.len() { total } else { kept.iter().map(|c| weight(c.1)).sum() };
    let mut u: f64 = rng.gen::<f64>() * mass;
    for c in kept {
        let w = weight(c.1);
        if u < w {
            return c.0;
        }
        u -= w;
    }
    kept[keep - 1].0
}

/// The same choice as [`sample_token`] by sorting every candidate: the reference it is tested and
/// benchmarked (`grpo bench sample`) against. Slow on large vocabularies.
pub fn sample_token_reference(logits: &[f32], params: &SamplingParams, rng: &mut impl Rng) -> u32 {
    let mut cand = match candidates(logits, params) {
        Ok(c) => c,
        Err(token) => return token,
    };
    cand.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    if params.top_k > 0 && params.top_k < cand.len() {
        cand.truncate(params.top_k);
    }
    let max = cand[0].1;
    let mut probs: Vec<f64> = cand.iter().map(|(_, l)| ((l - max) as f64).exp()).collect();
    let total: f64 = probs.iter().sum();
    probs.iter_mut().for_each(|p| *p /= total);
    if params.top_p < 1.0 {
        let mut acc = 0.0;
        let mut keep = probs.len();
        for (i, p) in probs.iter().enumerate() {
            acc += p;
            if acc >= params.top_p as f64 {
                keep = i + 1;
                break;
            }
        }
        probs.truncate(keep);
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= total);
    }
    let mut u: f64 = rng.gen();
    for (i, p) in probs.iter().enumerate() {
        if u < *p {
            return cand[i].0;
        }
        u -= p;
    }
    cand[probs.len() - 1].0
}

/// The log-prob of `picks[r]` in row r of `logits` (`[rows, vocab]`), f32.
fn picked_logprobs(logits: &candle_core::Tensor, picks: &[u32]) -> candle_core::Result<Vec<f32>> {
    let lp = candle_nn::ops::log_softmax(&logits.to_dtype(candle_core::DType::F32)?, candle_core::D::Minus1)?;
    let idx = candle_core::Tensor::new(picks, logits.device())?.unsqueeze(1)?;
    lp.gather(&idx, 1)?.squeeze(1)?.to_vec1::<f32>()
}

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
    mut on_tokens: impl FnMut(usize),
) -> candle_core::Result<Vec<Generation>> {
    assert_eq!(prompts.len(), ids.len(), "one id per prompt");
    let mut out: Vec<Option<Generation>> = vec![None; prompts.len()];
    if prompts.is_empty() {
        return Ok(vec![]);
    }
    let mut rngs: Vec<ChaCha8Rng> =
        ids.iter().map(|&i| ChaCha8Rng::seed_from_u64(params.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ i)).collect();
    let mut produced: Vec<Vec<u32>> = vec![Vec::new(); prompts.len()];
    let mut produced_lp: Vec<Vec<f32>> = vec![Vec::new(); prompts.len()];
    let mut active: Vec<usize> = (0..prompts.len()).collect();
    if params.max_new_tokens == 0 {
        let empty = Generation { tokens: vec![], finish: FinishReason::Length, logprobs: vec![] };
        return Ok(vec![empty; prompts.len()]);
    }
    // Greedy on a GPU: take the argmax there instead of copying [rows, vocab] logits to the host.
    let device_argmax = params.temperature <= 0.0 && !model.device().is_cpu();
    let (mut logits, mut cache) = model.prefill(prompts, pad)?;
    loop {
        let picks: Vec<u32> = if device_argmax {
            logits.argmax(candle_core::D::Minus1)?.to_vec1::<u32>()?
        } else {
            let rows: Vec<Vec<f32>> = logits.to_vec2::<f32>()?;
            // Rows sample in parallel, each with its own sequence's RNG (`active` is increasing).
            let mut mine: Vec<&mut ChaCha8Rng> = Vec::with_capacity(active.len());
            let mut wanted = active.iter().peekable();
            for (seq, rng) in rngs.iter_mut().enumerate() {
                if wanted.next_if(|&&a| a == seq).is_some() {
                    mine.push(rng);
                }
            }
            rows.par_iter().zip(mine.par_iter_mut()).map(|(row, rng)| sample_token(row, params, *rng)).collect()
        };
        let picked_lp = picked_logprobs(&logits, &picks)?;
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
                (produced[seq].len() >= params.max_new_tokens).then_some(FinishReason::Length)
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
            logprobs.push(picked_logprobs(&last.unsqueeze(0)?, &[tok])?[0]);
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

    #[test]
    fn sampling_respects_top_k_top_p_and_seed() {
        let logits = vec![0.0f32, 3.0, 2.9, -1.0, f32::NEG_INFINITY];
        let greedy = SamplingParams::default();
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        assert_eq!(sample_token(&logits, &greedy, &mut rng), 1);
        let k2 = SamplingParams { temperature: 1.0, top_k: 2, ..Default::default() };
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..200 {
            seen.insert(sample_token(&logits, &k2, &mut rng));
        }
        assert_eq!(seen.into_iter().collect::<Vec<_>>(), vec![1, 2]);
        let p = SamplingParams { temperature: 1.0, top_p: 0.3, ..Default::default() };
        for _ in 0..50 {
            assert_eq!(sample_token(&logits, &p, &mut rng), 1);
        }
        let hot = SamplingParams { temperature: 1.0, ..Default::default() };
        let draw = |seed| {
            let mut r = ChaCha8Rng::seed_from_u64(seed);
            (0..20).map(|_| sample_token(&logits, &hot, &mut r)).collect::<Vec<_>>()
        };
        assert_eq!(draw(5), draw(5));
        assert_ne!(draw(5), draw(6));
    }

    /// With top-k or top-p the kept candidates are walked in the same order as the full sort walks them,
    /// so the same random draw picks the same token.
    #[test]
    fn the_same_tokens_as_the_full_sort_reference() {
        let mut rng = ChaCha8Rng::seed_from_u64(2);
        let logits: Vec<f32> = (0..5000).map(|_| rng.gen_range(-6.0f32..6.0)).collect();
        for params in [
            SamplingParams { temperature: 0.6, top_p: 0.95, ..Default::default() },
            SamplingParams { temperature: 1.0, top_p: 0.5, top_k: 100, ..Default::default() },
            SamplingParams { temperature: 0.8, top_k: 20, ..Default::default() },
        ] {
            let (mut a, mut b) = (ChaCha8Rng::seed_from_u64(3), ChaCha8Rng::seed_from_u64(3));
            for i in 0..200 {
                let (x, y) = (sample_token(&logits, &params, &mut a), sample_token_reference(&logits, &params, &mut b));
                assert_eq!(x, y, "draw {i} with {params:?}");
            }
        }
    }

    /// The nucleus found by partial selection is the one a full sort gives, at vocabulary size.
    #[test]
    fn top_p_over_a_large_vocabulary_keeps_exactly_the_nucleus() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let logits: Vec<f32> = (0..151_936).map(|_| rng.gen_range(-8.0f32..8.0)).collect();
        let p = SamplingParams { temperature: 0.6, top_p: 0.95, ..Default::default() };
        // The nucleus by a full sort.
        let mut sorted: Vec<(usize, f64)> = logits.iter().map(|&l| (l / 0.6) as f64).enumerate().collect();
        sorted.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        let max = sorted[0].1;
        let total: f64 = sorted.iter().map(|c| (c.1 - max).exp()).sum();
        let mut acc = 0.0;
        let n = sorted.iter().position(|c| {
            acc += (c.1 - max).exp();
            acc >= 0.95 * total
        });
        let nucleus: std::collections::HashSet<u32> = sorted[..n.unwrap() + 1].iter().map(|c| c.0 as u32).collect();
        assert!(nucleus.len() > 1000, "the test needs a nucleus larger than the first selection");
        let mut seen = std::collections::HashSet::new();
        for _ in 0..100 {
            let t = sample_token(&logits, &p, &mut rng);
            assert!(nucleus.contains(&t), "token {t} is outside the nucleus");
            seen.insert(t);
        }
        assert!(seen.len() > 50, "samples spread over the nucleus: {}", seen.len());
    }
}
