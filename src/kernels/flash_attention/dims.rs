//! The sizes of one attention call, shared by the op (flash_attention.rs), its driver and the
//! tensor-core kernels' plans (flash_mma.rs), and how those kernels split a group of query heads.

use candle_core::{Layout, Result};

/// The sizes of one attention call.
#[derive(Debug, Clone, Copy)]
pub(in crate::kernels) struct Dims {
    pub(in crate::kernels) b: usize,
    pub(in crate::kernels) h: usize,
    pub(in crate::kernels) kv: usize,
    pub(in crate::kernels) t: usize,
    pub(in crate::kernels) s: usize,
    pub(in crate::kernels) d: usize,
}

impl Dims {
    pub(in crate::kernels) fn new(q: &Layout, k: &Layout, v: &Layout, ranges: &Layout) -> Result<Self> {
        let (b, h, t, d) = q.shape().dims4()?;
        let (bk, kv, s, dk) = k.shape().dims4()?;
        if k.shape() != v.shape() || bk != b || dk != d {
            candle_core::bail!(
                "flash attention: q {:?}, k {:?}, v {:?}: expected [B, H, T, D] and two [B, KV, S, D]",
                q.shape().dims(),
                k.shape().dims(),
                v.shape().dims()
            );
        }
        if kv == 0 || h % kv != 0 {
            candle_core::bail!("flash attention: {h} query heads are not a multiple of {kv} key/value heads");
        }
        if ranges.shape().dims() != [b, t, 2] {
            candle_core::bail!("attention ranges have shape {:?}, expected [{b}, {t}, 2]", ranges.shape().dims());
        }
        if t == 0 || s == 0 || d == 0 || s.max(t) > i32::MAX as usize || (b * h).max(b * kv) > u16::MAX as usize {
            candle_core::bail!("flash attention over {t} queries, {s} keys, {b}x{h} heads of {d}: out of range");
        }
        Ok(Self { b, h, kv, t, s, d })
    }

    pub(in crate::kernels) fn group(&self) -> usize {
        self.h / self.kv
    }

    pub(in crate::kernels) fn q_len(&self) -> usize {
        self.b * self.h * self.t * self.d
    }

    pub(in crate::kernels) fn kv_len(&self) -> usize {
        self.b * self.kv * self.s * self.d
    }
}

/// Blocks the dk/dv kernels' grid aims at, about four per streaming multiprocessor of an H100 (132) or
/// five of an A100 (108): the group's query heads are split over that many blocks where the key blocks
/// of the KV heads alone are fewer ([`dkv_split`]).
pub(in crate::kernels) const DKV_BLOCKS: usize = 512;

/// The parts each KV head's group of query heads is split into over the dk/dv kernel's blocks (each
/// block sums the dk and dv of its part's heads; `bwd_dkv_sum` adds the parts in order): the fewest that
/// give [`DKV_BLOCKS`] blocks over `key_blocks` key blocks, at most one head a part, and none empty.
/// Without it, grouped-query attention at short lengths left most of the GPU idle (the 0.5B shape at
/// 4k: 64 blocks of 7 heads each, 22 TFLOP/s), and the first keys' blocks, which every query sees,
/// made the longest path.
pub(in crate::kernels) fn dkv_split(dims: &Dims, key_blocks: usize) -> usize {
    let group = (dims.h / dims.kv.max(1)).max(1);
    let blocks = (key_blocks * dims.b * dims.kv).max(1);
    let want = DKV_BLOCKS.div_ceil(blocks).clamp(1, group);
    group.div_ceil(group.div_ceil(want))
}

/// Keys per block of the warpgroup dk/dv kernel (kernels/flash_wgmma.cu's WG_DKV_BK).
pub(in crate::kernels) const WGMMA_DKV_KEYS: usize = 128;

/// Device bytes of the dk/dv kernels' f32 partial sums for `b` sequences of `t` keys, `h` query heads over
/// `kv` KV heads of dim `d` (`[split][2][B, KV, T, D]`), held through one attention backward: the larger of
/// the two kernel files' (the warpgroup kernels' 128-key blocks split a group more ways than the mma
/// kernels' 64), for the memory plan.
pub fn dkv_partial_sum_bytes(b: usize, h: usize, kv: usize, t: usize, d: usize) -> u64 {
    let dims = Dims { b, h, kv, t, s: t, d };
    let split = dkv_split(&dims, t.div_ceil(WGMMA_DKV_KEYS));
    (split * 2 * dims.kv_len() * 4) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dims(h: usize, kv: usize, len: usize) -> Dims {
        Dims { b: 1, h, kv, t: len, s: len, d: 64 }
    }

    /// The splits at the shapes the performance model prices: the 0.5B's 14 heads of 2 KV heads split
    /// one head a block at 4k (64 blocks otherwise) and in two at 16k; the 7B's 28 of 4 at 18k, and any
    /// group of one (multi-head attention), not at all; no part is left empty.
    #[test]
    fn dkv_split_fills_the_gpu_and_leaves_no_part_empty() {
        let wgmma = |h, kv, len: usize| dkv_split(&dims(h, kv, len), len.div_ceil(WGMMA_DKV_KEYS));
        assert_eq!(wgmma(14, 2, 4096), 7);
        assert_eq!(wgmma(14, 2, 16384), 2);
        assert_eq!(wgmma(28, 4, 18432), 1);
        assert_eq!(wgmma(16, 16, 1024), 1);
        assert_eq!(dkv_split(&dims(14, 2, 0), 0), 7);
        // The plan's bytes: the 7B's one part of [2, 4 KV heads, 18,432, 128] f32; the 0.5B's 7 at 4k.
        assert_eq!(dkv_partial_sum_bytes(1, 28, 4, 18432, 128), 2 * 4 * 18432 * 128 * 4);
        assert_eq!(dkv_partial_sum_bytes(1, 14, 2, 4096, 64), 7 * 2 * 2 * 4096 * 64 * 4);
        for group in 1..=16 {
            for key_blocks in 1..=600 {
                let split = dkv_split(&dims(group, 1, 64 * key_blocks), key_blocks);
                let (per, want) = (group.div_ceil(split), DKV_BLOCKS.div_ceil(key_blocks).min(group));
                assert!((1..=want).contains(&split) && per * (split - 1) < group, "{group} {key_blocks}: {split}");
                assert_eq!(per, group.div_ceil(want), "{group} {key_blocks}: {split} parts as long as {want}'s");
            }
        }
    }
}
