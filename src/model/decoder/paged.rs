//! Generation over a paged KV cache: the pool's storage (per layer, keys and values of every block) and
//! the decoder's forward of one continuous-batching step, whose tokens (decode tokens of some sequences,
//! prefill chunks of others) run as one row, each writing its keys and values into its pool slot and
//! attending through its sequence's block table ([`crate::kernels::paged_attention`]).

use candle_core::{DType, Tensor};

use super::layer::{rms_norm, LayerState, Mode, Pass, Positions};
use super::pool::{slot_index, PagedBatch, PagedKv, PagedLayer};
use super::Decoder;

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
