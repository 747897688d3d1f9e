//! The sizes of one attention call, shared by the op (flash_attention.rs), its driver and the
//! tensor-core kernels' plans (flash_mma.rs).

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
