//! Batched generation with a KV cache: greedy or sampled (temperature, top-k, top-p), stopping at EOS;
//! finished sequences leave the batch so the rest keeps going. Each sequence draws from its own RNG,
//! seeded from (seed, sequence index), so results do not depend on batch composition.

use rayon::prelude::*;

use super::sampler::sample_rows;
use crate::model::Decoder;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

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

/// Pick the next token from one row of f32 logits on the host: what generation on the CPU device uses,
/// where the logits are already in host memory (on a GPU, [`sample_rows`] picks without copying them).
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

/// The choice that [`sample_rows`] makes on the device, on the host by sorting every candidate: the
/// reference it is tested and benchmarked (`grpo bench sample`) against. Slow on large vocabularies.
///
/// `u` (in [0, 1)) is the draw's uniform; with temperature 0 (or no finite logit) the pick is the argmax.
pub fn sample_token_reference(logits: &[f32], params: &SamplingParams, u: f64) -> u32 {
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
    let mut u = u;
    for (i, p) in probs.iter().enumerate() {
        if u < *p {
            return cand[i].0;
        }
        u -= p;
    }
    cand[probs.len() - 1].0
}

/// The log-prob (f32 `[rows]`) of `picks[r]` (u32 `[rows]`) in row r of `logits` (`[rows, vocab]`).
fn picked_logprobs(
    logits: &candle_core::Tensor,
    picks: &candle_core::Tensor,
) -> candle_core::Result<candle_core::Tensor> {
    let lp = candle_nn::ops::log_softmax(&logits.to_dtype(candle_core::DType::F32)?, candle_core::D::Minus1)?;
    lp.gather(&picks.unsqueeze(1)?, 1)?.squeeze(1)
}

/// The next token of each row of `logits` and its log-prob, copied to the host in one read. Each row
/// draws one uniform of `rngs[r]`, its sequence's stream, when sampling. `on_device`: chosen on the
/// logits' device ([`sample_rows`], only the ids and log-probs come back); else on the host from the
/// copied logits ([`sample_token`], the faster choice when the device is the CPU).
fn pick(
    logits: &candle_core::Tensor,
    params: &SamplingParams,
    rngs: &mut [&mut ChaCha8Rng],
    on_device: bool,
) -> candle_core::Result<(Vec<u32>, Vec<f32>)> {
    if !on_device && params.temperature > 0.0 {
        let vocab = logits.dim(1)?;
        let flat = crate::device::to_host::<f32>(&logits.to_dtype(candle_core::DType::F32)?)?;
        return Ok(flat
            .par_chunks(vocab.max(1))
            .zip(rngs.par_iter_mut())
            .map(|(row, rng)| {
                let tok = sample_token(row, params, *rng);
                (tok, host_logprob(row, tok))
            })
            .unzip());
    }
    let uniforms: Vec<f32> =
        if params.temperature > 0.0 { rngs.iter_mut().map(|r| r.gen::<f64>() as f32).collect() } else { vec![] };
    let picks = sample_rows(logits, params, &uniforms)?;
    let lp = picked_logprobs(logits, &picks)?;
    // Ids below 2^24 are exact in f32: ids and log-probs travel together.
    let both =
        crate::device::to_host::<f32>(&candle_core::Tensor::cat(&[picks.to_dtype(candle_core::DType::F32)?, lp], 0)?)?;
    let (ids, lps) = both.split_at(both.len() / 2);
    Ok((ids.iter().map(|&i| i as u32).collect(), lps.to_vec()))
}

/// The log-softmax of `row` at `tok`, in f64 rounded to f32.
fn host_logprob(row: &[f32], tok: u32) -> f32 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = row.iter().map(|&l| (l as f64 - max).exp()).sum();
    (row[tok as usize] as f64 - max - sum.ln()) as f32
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
    on_tokens: impl FnMut(usize),
) -> candle_core::Result<Vec<Generation>> {
    let on_device = !model.device().is_cpu();
    generate_on(model, prompts, ids, params, (stop, pad), on_tokens, on_device)
}

/// [`generate`], choosing the tokens on the device or on the host ([`pick`]).
fn generate_on(
    model: &Decoder,
    prompts: &[Vec<u32>],
    ids: &[u64],
    params: &SamplingParams,
    (stop, pad): (&[u32], u32),
    mut on_tokens: impl FnMut(usize),
    on_device: bool,
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
        let on_device = generate_on(&model, &prompts, &[0, 1, 2], &params, (&[], 0), |_| {}, true).unwrap();
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

    /// With top-k or top-p the host sampler walks the kept candidates in the same order as the full sort,
    /// so the same uniform picks the same token.
    #[test]
    fn the_host_sampler_picks_the_tokens_of_the_full_sort_reference() {
        let mut rng = ChaCha8Rng::seed_from_u64(2);
        let logits: Vec<f32> = (0..5000).map(|_| rng.gen_range(-6.0f32..6.0)).collect();
        for params in [
            SamplingParams { temperature: 0.6, top_p: 0.95, ..Default::default() },
            SamplingParams { temperature: 1.0, top_p: 0.5, top_k: 100, ..Default::default() },
            SamplingParams { temperature: 0.8, top_k: 20, ..Default::default() },
            SamplingParams { temperature: 1.0, top_k: 1, ..Default::default() },
        ] {
            let (mut a, mut b) = (ChaCha8Rng::seed_from_u64(3), ChaCha8Rng::seed_from_u64(3));
            for i in 0..200 {
                let (x, y) =
                    (sample_token(&logits, &params, &mut a), sample_token_reference(&logits, &params, b.gen()));
                assert_eq!(x, y, "draw {i} with {params:?}");
            }
        }
    }
}
