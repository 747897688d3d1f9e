//! The KV cache of generation with static batches: per layer, keys and values written in place.

use candle_core::{Device, Tensor};

/// One layer's keys and values `[B, KV, capacity, D]`, written in place; the first `len` positions are used.
#[derive(Clone)]
pub(super) struct LayerCache {
    k: Tensor,
    v: Tensor,
    len: usize,
}

impl LayerCache {
    /// Append `k`, `v` (`[B, KV, t, D]`, contiguous) and return views of everything cached so far.
    pub(super) fn append(
        slot: &mut Option<LayerCache>,
        k: &Tensor,
        v: &Tensor,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        let (b, kv, t, d) = k.dims4()?;
        let mut c = match slot.take() {
            Some(c) => c,
            None => {
                let cap = (2 * t).max(64);
                let z = Tensor::zeros((b, kv, cap, d), k.dtype(), k.device())?;
                LayerCache { k: z.clone(), v: z.zeros_like()?, len: 0 }
            }
        };
        let cap = c.k.dim(2)?;
        if c.len + t > cap {
            let new_cap = (2 * cap).max(c.len + t);
            let grow = |old: &Tensor| -> candle_core::Result<Tensor> {
                let z = Tensor::zeros((b, kv, new_cap, d), old.dtype(), old.device())?;
                z.slice_set(&old.narrow(2, 0, c.len)?.contiguous()?, 2, 0)?;
                Ok(z)
            };
            c = LayerCache { k: grow(&c.k)?, v: grow(&c.v)?, len: c.len };
        }
        c.k.slice_set(k, 2, c.len)?;
        c.v.slice_set(v, 2, c.len)?;
        c.len += t;
        let views = (c.k.narrow(2, 0, c.len)?, c.v.narrow(2, 0, c.len)?);
        *slot = Some(c);
        Ok(views)
    }
}

/// The per-layer cache of keys and values for generation, for a batch of rows.
pub struct KvCache {
    pub(super) layers: Vec<Option<LayerCache>>,
    /// Per row, whether each cached key position is a real token (false for left padding).
    pub(super) valid: Vec<Vec<bool>>,
    /// Per row, the position id of the next token.
    pub(super) next_pos: Vec<u32>,
}

impl KvCache {
    /// Number of rows in the batch.
    pub fn rows(&self) -> usize {
        self.valid.len()
    }

    /// Number of cached positions (including padding).
    pub fn len(&self) -> usize {
        self.valid.first().map_or(0, Vec::len)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Keep only the given rows (finished sequences leave the batch).
    pub fn retain(&mut self, rows: &[usize]) -> candle_core::Result<()> {
        if rows.len() == self.rows() {
            return Ok(());
        }
        let device = match self.layers.iter().flatten().next() {
            Some(c) => c.k.device().clone(),
            None => Device::Cpu,
        };
        let idx = crate::device::from_host(rows.iter().map(|&r| r as u32).collect::<Vec<_>>(), rows.len(), &device)?;
        for layer in self.layers.iter_mut().flatten() {
            layer.k = layer.k.index_select(&idx, 0)?;
            layer.v = layer.v.index_select(&idx, 0)?;
        }
        self.valid = rows.iter().map(|&r| self.valid[r].clone()).collect();
        self.next_pos = rows.iter().map(|&r| self.next_pos[r]).collect();
        Ok(())
    }
}
