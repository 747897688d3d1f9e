//! The paged KV pool's storage and a continuous-batching step's batch: per layer the keys and values of
//! every block, and the slots a step's tokens write.

use candle_core::{DType, Device, Tensor};

use crate::kernels::PagedLayout;

/// The pool's storage: per layer a `[2 KV, blocks * block_size, D]` tensor (keys in heads `0..KV`, values
/// in `KV..2 KV`), allocated once; the scheduler decides which slots a sequence uses.
pub struct PagedKv {
    pub(super) layers: Vec<Tensor>,
    pub(super) block_size: usize,
}

impl PagedKv {
    /// The pool's bytes on its device.
    pub fn bytes(&self) -> usize {
        self.layers.iter().map(|t| t.elem_count() * t.dtype().size_in_bytes()).sum()
    }

    /// Copy the first `len` positions of block `from` into block `to`, in every layer (copy on write).
    pub fn copy_block(&self, from: u32, to: u32, len: usize) -> candle_core::Result<()> {
        let bs = self.block_size;
        for layer in &self.layers {
            let src = layer.narrow(1, from as usize * bs, len)?.force_contiguous()?;
            layer.slice_set(&src, 1, to as usize * bs)?;
        }
        Ok(())
    }
}

/// One step's tokens in the order they run: their ids and positions, the pool slot each writes, where
/// each one's keys are ([`PagedLayout`]), and the tokens whose next-token logits are wanted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PagedBatch {
    pub tokens: Vec<u32>,
    pub positions: Vec<u32>,
    pub slots: Vec<u32>,
    pub layout: PagedLayout,
    pub logit_rows: Vec<u32>,
}

/// A layer's view of the pool during a step: its storage, the scatter index of the step's slots, and the
/// layout the attention reads through.
pub(super) struct PagedLayer<'a> {
    pub kv: &'a Tensor,
    pub index: &'a Tensor,
    pub layout: &'a PagedLayout,
}

impl PagedLayer<'_> {
    /// Write the step's keys and values (`[1, KV, T, D]` each) into their slots.
    pub fn write(&self, k: &Tensor, v: &Tensor) -> candle_core::Result<()> {
        let kv = Tensor::cat(&[k, v], 1)?.squeeze(0)?;
        self.kv.scatter_set(self.index, &kv.contiguous()?, 1)
    }
}

/// The scatter index `[2 KV, T, D]` of `slots`: every element of a token's keys and values goes to its slot.
pub(super) fn slot_index(
    slots: &[u32],
    kv_heads: usize,
    head_dim: usize,
    device: &Device,
) -> candle_core::Result<Tensor> {
    let t = slots.len();
    let s = crate::device::from_host(slots.to_vec(), (1, t, 1), device)?;
    s.broadcast_as((2 * kv_heads, t, head_dim))?.contiguous()?.to_dtype(DType::U32)
}
