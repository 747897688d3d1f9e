//! The next-token choice: sampling settings, the host sampler and its full-sort reference, and the pick of
//! a batch of logits rows with each sequence's own random stream ([`sequence_rng`]: seeded from (seed,
//! sequence index), so a sequence's tokens do not depend on the batch it runs in).

use rayon::prelude::*;

use super::device_sampler::sample_rows;
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
pub(crate) fn picked_logprobs(
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
pub(crate) fn pick(
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

/// The random stream of sequence `id` under `seed`: one uniform is drawn from it per sampled token.
pub fn sequence_rng(seed: u64, id: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ id)
}

/// The log-softmax of `row` at `tok`, in f64 rounded to f32.
fn host_logprob(row: &[f32], tok: u32) -> f32 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = row.iter().map(|&l| (l as f64 - max).exp()).sum();
    (row[tok as usize] as f64 - max - sum.ln()) as f32
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

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
