//! Generation over a paged KV cache: the pool's storage (per layer, keys and values of every block) and
//! the decoder's forward of one continuous-batching step, whose tokens (decode tokens of some sequences,
//! prefill chunks of others) run as one row, each writing its keys and values into its pool slot and
//! attending through its sequence's block table ([`crate::kernels::paged_attention`]).

use candle_core::{DType, Device, Tensor};

use super::layer::{rms_norm, LayerState, Pass, Positions};
use super::train::Mode;
use super::Decoder;
use crate::kernels::PagedLayout;

/// The pool's storage: per layer a `[2 KV, blocks * block_size, D]` tensor (keys in heads `0..KV`, values
/// in `KV..2 KV`), allocated once; the scheduler decides which slots a sequence uses.
pub struct PagedKv {
    pub(super) layers: Vec<Tensor>,
    block_size: usize,
}

impl PagedKv {
    /// A pool of `blocks` blocks of `block_size` positions for `model` (zeros, on its device, in its dtype).
    pub fn new(model: &Decoder, blocks: usize, block_size: usize) -> candle_core::Result<Self> {
        let cfg = model.config();
        let shape = (2 * cfg.num_kv_heads, blocks * block_size, cfg.head_dim);
        let n = 2 * cfg.num_kv_heads * blocks * block_size * cfg.head_dim;
        crate::device::check_elements(model.device(), "a layer of the KV pool", n, "set generation.kv_blocks lower")?;
        let layers = (0..cfg.num_layers)
            .map(|_| Tensor::zeros(shape, model.dtype(), model.device()))
            .collect::<Result<_, _>>()?;
        Ok(PagedKv { layers, block_size })
    }

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

impl Decoder {
    /// One step of paged generation: `batch`'s tokens run as one row through the layers, each writing its
    /// keys and values into its slot of `kv` and attending to its sequence's positions there; returns the
    /// next-token logits `[logit_rows, V]` (f32) of the rows `batch.logit_rows` names.
    pub fn forward_paged(&self, batch: &PagedBatch, kv: &PagedKv) -> candle_core::Result<Tensor> {
        let t = batch.tokens.len();
        if t == 0 || batch.positions.len() != t || batch.slots.len() != t {
            candle_core::bail!(
                "a paged step of {t} tokens, {} positions and {} slots",
                batch.positions.len(),
                batch.slots.len()
            );
        }
        let index = slot_index(&batch.slots, self.cfg.num_kv_heads, self.cfg.head_dim, &self.device)?;
        let rope = self.rope(std::slice::from_ref(&batch.positions))?;
        let ranges = Tensor::zeros((1, t, 2), DType::U32, &self.device)?;
        let positions = Positions { rope, ranges };
        let pass = Pass { positions: &positions, mode: Mode::plain(false) };
        let mut x = self.embed(std::slice::from_ref(&batch.tokens), false)?;
        for (l, layer_kv) in kv.layers.iter().enumerate() {
            let paged = PagedLayer { kv: layer_kv, index: &index, layout: &batch.layout };
            x = self.layer(l, &x, pass, LayerState::Paged(paged))?;
        }
        if batch.logit_rows.is_empty() {
            return Tensor::zeros((0, self.cfg.vocab_size), DType::F32, &self.device);
        }
        let rows = crate::device::from_host(batch.logit_rows.clone(), batch.logit_rows.len(), &self.device)?;
        let last = x.squeeze(0)?.index_select(&rows, 0)?;
        let h = rms_norm(&last, &self.w(self.norm, false), self.cfg.rms_norm_eps, self.options.fused_ops)?;
        h.matmul(&self.w(self.lm_head, false).t()?)?.to_dtype(DType::F32)
    }
}
