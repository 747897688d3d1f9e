//! Generation: the per-layer cache of keys and values, and the decode path (prefill of left-padded
//! prompts, one token per row a step); the cache-less logits it is tested against.

use candle_core::{DType, Tensor};

use super::cache::KvCache;
use super::layer::{rms_norm, LayerState, Mode, Pass, Positions};
use super::{Decoder, TokenBatch};

impl Decoder {
    /// Start generation: run left-padded prompts and return the last position's logits `[B, V]` (f32)
    /// and the cache.
    pub fn prefill(&self, prompts: &[Vec<u32>], pad: u32) -> candle_core::Result<(Tensor, KvCache)> {
        let width = prompts.iter().map(Vec::len).max().unwrap_or(0);
        if width == 0 {
            candle_core::bail!("prefill needs at least one prompt token");
        }
        let mut cache = KvCache {
            layers: vec![None; self.cfg.num_layers],
            valid: prompts
                .iter()
                .map(|p| {
                    let mut v = vec![false; width - p.len()];
                    v.extend(std::iter::repeat_n(true, p.len()));
                    v
                })
                .collect(),
            next_pos: vec![0; prompts.len()],
        };
        let tokens: Vec<Vec<u32>> = prompts
            .iter()
            .map(|p| {
                let mut v = vec![pad; width - p.len()];
                v.extend_from_slice(p);
                v
            })
            .collect();
        let logits = self.extend(&tokens, &mut cache)?;
        Ok((logits, cache))
    }

    /// Append one token per row and return the next logits `[B, V]` (f32).
    pub fn step(&self, next: &[u32], cache: &mut KvCache) -> candle_core::Result<Tensor> {
        if next.len() != cache.rows() {
            candle_core::bail!("step got {} tokens for {} rows", next.len(), cache.rows());
        }
        for v in cache.valid.iter_mut() {
            v.push(true);
        }
        let tokens: Vec<Vec<u32>> = next.iter().map(|&t| vec![t]).collect();
        self.extend(&tokens, cache)
    }

    /// Run `tokens` (`[B, t]`, already accounted for in `cache.valid`) through the layers with the cache.
    fn extend(&self, tokens: &[Vec<u32>], cache: &mut KvCache) -> candle_core::Result<Tensor> {
        let (b, t) = (tokens.len(), tokens[0].len());
        let s = cache.len();
        let past = s - t;
        // Position ids count only real tokens of each row.
        let mut position_ids = Vec::with_capacity(b);
        for r in 0..b {
            let mut pos = Vec::with_capacity(t);
            let mut next = cache.next_pos[r];
            for j in 0..t {
                pos.push(next);
                if cache.valid[r][past + j] {
                    next += 1;
                }
            }
            cache.next_pos[r] = next;
            position_ids.push(pos);
        }
        // Each row's valid keys are contiguous: left padding, then the prompt and what was generated.
        let mut r = Vec::with_capacity(b * t * 2);
        for valid in &cache.valid {
            let first = valid.iter().position(|&v| v).unwrap_or(valid.len());
            if valid[first..].iter().any(|&v| !v) {
                candle_core::bail!("KV cache row with padding after its first token");
            }
            for i in 0..t {
                let q = past + i;
                r.extend_from_slice(&[if valid[q] { first as u32 } else { q as u32 }, q as u32]);
            }
        }
        let ranges = crate::device::from_host(r, (b, t, 2), &self.device)?;
        let positions = Positions { rope: self.rope(&position_ids)?, ranges };
        let pass = Pass { positions: &positions, mode: Mode::plain(false) };
        let mut x = self.embed(tokens, false)?;
        for l in 0..self.cfg.num_layers {
            x = self.layer(l, &x, pass, LayerState::Cache(&mut cache.layers[l]))?;
        }
        let last = x.narrow(1, t - 1, 1)?.squeeze(1)?;
        let h = rms_norm(&last, &self.w(self.norm, false), self.cfg.rms_norm_eps, self.options.fused_ops)?;
        h.matmul(&self.w(self.lm_head, false).t()?)?.to_dtype(DType::F32)
    }

    /// Logits of every position `[B, T, V]` (f32) without a cache: the reference that cached generation
    /// is tested against. Memory grows with T x V: meant for short inputs.
    pub fn full_logits(&self, batch: &TokenBatch) -> candle_core::Result<Tensor> {
        let logits = batch.rows() * batch.width() * self.cfg.vocab_size;
        crate::device::check_elements(&self.device, "the logits [rows, tokens, vocab]", logits, "score fewer tokens")?;
        let x = self.run_layers(batch, false)?;
        let h = rms_norm(&x, &self.w(self.norm, false), self.cfg.rms_norm_eps, self.options.fused_ops)?;
        let (b, t, hs) = h.dims3()?;
        h.reshape((b * t, hs))?.matmul(&self.w(self.lm_head, false).t()?)?.to_dtype(DType::F32)?.reshape((b, t, ()))
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{tiny, values};
    use super::super::Attention;
    use super::*;
    use crate::model::Arch;

    #[test]
    fn kv_cache_generation_matches_full_forward() {
        for (arch, attention) in
            [(Arch::Qwen2, Attention::Flash), (Arch::Qwen3, Attention::Flash), (Arch::Llama, Attention::Matrix)]
        {
            let mut m = tiny(arch, false, false);
            m.options.attention = attention;
            let prompts = vec![vec![5u32, 17, 3, 88, 41], vec![11u32, 2], vec![7u32, 7, 7]];
            let (mut logits, mut cache) = m.prefill(&prompts, 0).unwrap();
            let mut seqs = prompts.clone();
            // Past 64 positions: the cache grows (reallocates) on the way.
            for _ in 0..70 {
                let next: Vec<u32> = logits.argmax(1).unwrap().to_vec1::<u32>().unwrap();
                // The full forward over each sequence alone predicts the same next token, with the same logits.
                for (r, s) in seqs.iter().enumerate() {
                    let full = m.full_logits(&TokenBatch::padded(std::slice::from_ref(s), 0)).unwrap();
                    let last = full.get(0).unwrap().get(s.len() - 1).unwrap();
                    let d = crate::kernels::testing::abs_diff(&values(&last), &values(&logits.get(r).unwrap()));
                    assert!(d < 1e-4, "{arch:?} row {r}: cached logits differ by {d}");
                    assert_eq!(last.argmax(0).unwrap().to_scalar::<u32>().unwrap(), next[r]);
                }
                for (s, &t) in seqs.iter_mut().zip(&next) {
                    s.push(t);
                }
                logits = m.step(&next, &mut cache).unwrap();
            }
            // Dropping a finished row keeps the others' logits.
            let keep = logits.get(2).unwrap();
            cache.retain(&[0, 2]).unwrap();
            let _ = keep;
            assert_eq!(cache.rows(), 2);
        }
    }
}
