//! One decoder layer: the attention block (norm, q/k/v projections, q/k norms, rope, attention, output
//! projection) and the MLP (SwiGLU), each projection with its LoRA adapter where it has one; the rope
//! tables and the embedding lookup.

use candle_core::{DType, Tensor};

use super::cache::LayerCache;
use super::params::{Adapter, Linear, Param, ParamId, Projection, QkNorm};
use super::pool::PagedLayer;
use super::rope::Rope;
use super::{Attention, Decoder, TokenBatch};
use crate::kernels::{
    embedding, embedding_reference, flash_attention_recorded, frozen_matmul, masked_softmax, masked_softmax_reference,
    matmul_accumulating, matrix_attention, rms_norm as fused_rms_norm, rms_norm_reference, rope_reference,
    swiglu_reference, Replay,
};
use crate::kernels::{lora_linear, lora_linear_reference, Dropout};
use crate::model::config::ModelConfig;

/// What a layer keeps across calls.
pub(super) enum LayerState<'a> {
    None,
    /// Generation: this layer's past keys and values, extended by the call.
    Cache(&'a mut Option<LayerCache>),
    /// Training with recomputation: the attention's forward recorded, or replayed from its record.
    Attention(Replay<'a>),
    /// Generation over the paged KV cache: the step's keys and values written to their slots, the
    /// attention read through the block tables.
    Paged(PagedLayer<'a>),
}

/// Where a forward's tokens are, as every layer reads it: the rope tables of their position ids
/// (`[B, 1, T, D]`) and the keys each query attends to (`[B, T, 2]`, [`TokenBatch`]'s ranges).
pub(super) struct Positions {
    pub(super) rope: Rope,
    pub(super) ranges: Tensor,
}

/// One run through the layers: what each layer reads besides its input and its state.
#[derive(Clone, Copy)]
pub(super) struct Pass<'a> {
    pub(super) positions: &'a Positions,
    pub(super) mode: Mode<'a>,
}

/// How a forward runs through the layers: recording a graph or not, in training the seed of LoRA's
/// dropout masks (`None`: no dropout, as in inference and the reference's forward), and where the
/// projections' weight gradients go.
#[derive(Debug, Clone, Copy)]
pub(super) struct Mode<'a> {
    pub(super) graph: bool,
    dropout_seed: Option<u64>,
    /// The trainable parameters' f32 gradient accumulators by slot ([`Grads`]): where given, a recorded
    /// projection adds its weight's gradient straight into its accumulator in the backward
    /// ([`matmul_accumulating`]) instead of handing it to candle's gradient store.
    accumulators: Option<&'a [Option<Tensor>]>,
}

impl<'a> Mode<'a> {
    /// Without dropout.
    pub(super) const fn plain(graph: bool) -> Self {
        Mode { graph, dropout_seed: None, accumulators: None }
    }

    /// A training forward of `batch` (its dropout seed).
    pub(super) fn training(batch: &TokenBatch, graph: bool) -> Self {
        Mode { graph, dropout_seed: batch.dropout_seed, accumulators: None }
    }

    /// The same, the projections' weight gradients added into `accumulators`.
    pub(super) fn accumulating(self, accumulators: &'a [Option<Tensor>]) -> Self {
        Mode { accumulators: Some(accumulators), ..self }
    }

    /// The accumulator of the parameter in trainable slot `slot`, where this forward adds into one.
    pub(super) fn accumulator(&self, slot: Option<usize>) -> Option<&'a Tensor> {
        self.accumulators?.get(slot?)?.as_ref()
    }

    /// The seed of projection `p` of layer `l`: every adapter draws its own mask.
    pub(super) fn dropout_seed(&self, l: usize, p: Projection) -> Option<u64> {
        use crate::checksum::splitmix64;
        self.dropout_seed.map(|s| splitmix64(s ^ splitmix64((l as u64) << 3 | p.number())))
    }
}

/// The largest tensors one layer makes for `b` rows of `t` new tokens over `s` keys, with how to make
/// them smaller: `(what, elements, hint)`. On CUDA each must stay within what candle's kernels index
/// ([`crate::device::CUDA_MAX_ELEMENTS`]); the `[B, H, T, S]` scores exist only without flash attention.
fn layer_sizes(
    cfg: &ModelConfig,
    b: usize,
    t: usize,
    s: usize,
    flash: bool,
) -> Vec<(&'static str, usize, &'static str)> {
    let width = cfg.intermediate_size.max(cfg.hidden_size).max(cfg.num_heads * cfg.head_dim);
    let mut out = vec![(
        "a layer's activations [rows, tokens, intermediate]",
        b * t * width,
        "put fewer tokens in one forward (a smaller micro-batch, shorter sequences or fewer generated rows)",
    )];
    if !flash {
        out.push((
            "the attention scores [rows, heads, tokens, keys]",
            b * cfg.num_heads * t * s,
            "use flash attention (model.attention = \"flash\" with fused ops) or fewer tokens per forward",
        ));
    }
    out
}

/// RMSNorm as transformers computes it: normalised in f32, rounded to the input dtype, times the weight.
pub(super) fn rms_norm(x: &Tensor, w: &Tensor, eps: f64, fused: bool) -> candle_core::Result<Tensor> {
    if fused {
        fused_rms_norm(x, w, eps)
    } else {
        rms_norm_reference(x, w, eps)
    }
}

/// Where a projection's weight gradient goes.
#[derive(Clone, Copy)]
enum WeightGrad<'a> {
    /// candle's matmul: into the gradient store (or nowhere, for a weight without a graph).
    Store,
    /// None ([`frozen_matmul`]).
    Frozen,
    /// Added into this f32 accumulator ([`matmul_accumulating`]).
    Into(&'a Tensor),
}

/// `x W^T + b` over the last dim of `x`, `w`'s gradient as `grad` says; `fused`: the bias through
/// [`crate::kernels::bias_add`] (its gradient summed in f32), else candle's broadcast add.
fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>, grad: WeightGrad, fused: bool) -> candle_core::Result<Tensor> {
    let dims = x.dims().to_vec();
    let inner = *dims.last().unwrap_or(&0);
    let rows = x.elem_count() / inner.max(1);
    let x = x.reshape((rows, inner))?;
    let y = match grad {
        WeightGrad::Frozen => frozen_matmul(&x, w)?,
        // An input without a graph records nothing: candle's matmul gives the weight its gradient.
        WeightGrad::Into(acc) if x.track_op() => matmul_accumulating(&x, w, acc)?,
        _ => x.matmul(&w.t()?)?,
    };
    let y = match b {
        Some(b) if fused => crate::kernels::bias_add(&y, b)?,
        Some(b) => y.broadcast_add(b)?,
        None => y,
    };
    let mut out = dims;
    *out.last_mut().unwrap() = w.dim(0)?;
    y.reshape(out)
}

impl Decoder {
    /// Projection `p` of layer `l` of `x` (`[..., in]`): `x W^T + b`, plus with an adapter
    /// `(x A^T) B^T alpha / r` in f32 ([`crate::model::lora`]). A frozen weight in a graph goes through
    /// [`frozen_matmul`], which gives it no gradient.
    pub(super) fn project(&self, l: usize, p: Projection, x: &Tensor, mode: Mode) -> candle_core::Result<Tensor> {
        let graph = mode.graph;
        let &Linear { weight: w, bias, adapter } = self.layers[l].linear(p);
        let (Some(Adapter { a, b }), Some(opts)) = (adapter, &self.lora) else {
            let grad = match (self.param(w), mode.accumulator(self.slot(w))) {
                (Param::Frozen(_), _) if graph => WeightGrad::Frozen,
                (Param::Trainable(_), Some(acc)) if graph => WeightGrad::Into(acc),
                _ => WeightGrad::Store,
            };
            let fused = self.options.fused_ops;
            return linear(x, &self.w(w, graph), self.wo(bias, graph).as_ref(), grad, fused);
        };
        let _phase = crate::profile::phase("lora");
        let dropout = match mode.dropout_seed(l, p) {
            Some(seed) if opts.dropout > 0.0 => Some(Dropout { p: opts.dropout, seed }),
            _ => None,
        };
        let op = if self.options.fused_ops { lora_linear } else { lora_linear_reference };
        let dims = x.dims().to_vec();
        let (inner, out) = (*dims.last().unwrap_or(&0), self.param(w).get(false).dim(0)?);
        let x2 = x.reshape((x.elem_count() / inner.max(1), inner))?;
        let (bias, (a, b)) = (self.wo(bias, graph), (self.w(a, graph), self.w(b, graph)));
        let y = op(&x2, (&self.w(w, graph), bias.as_ref()), (&a, &b), opts.scale(), dropout)?;
        let mut shape = dims;
        *shape.last_mut().expect("a projection's input has a feature dim") = out;
        y.reshape(shape)
    }

    /// Parameter `id`, with (`graph`) or without gradient tracking.
    pub(super) fn w(&self, id: ParamId, graph: bool) -> Tensor {
        self.param(id).get(graph)
    }

    fn wo(&self, id: Option<ParamId>, graph: bool) -> Option<Tensor> {
        id.map(|id| self.w(id, graph))
    }

    /// Where `batch`'s tokens are: the rope tables of its positions ([`Decoder::rope`], a phase of the
    /// profile) and the keys each query attends to.
    pub(super) fn positions(&self, batch: &TokenBatch) -> candle_core::Result<Positions> {
        let rope = {
            let _phase = crate::profile::phase("rope");
            self.rope(&batch.positions)?
        };
        Ok(Positions { rope, ranges: batch.ranges(&self.device)? })
    }

    /// cos and sin tables `[B, 1, T, D]` for the given position ids, gathered from [`RopeTables`].
    pub(super) fn rope(&self, positions: &[Vec<u32>]) -> candle_core::Result<Rope> {
        let (b, t) = (positions.len(), positions.first().map_or(0, Vec::len));
        let need = positions.iter().flatten().max().map_or(0, |&p| p as usize + 1);
        let Rope { cos, sin } = self.rope_tables(need)?;
        let ids: Vec<u32> = positions.iter().flatten().copied().collect();
        let ids = crate::device::from_host(ids, b * t, &self.device)?;
        let shape = (b, 1, t, 2 * self.inv_freq.len());
        Ok(Rope { cos: cos.index_select(&ids, 0)?.reshape(shape)?, sin: sin.index_select(&ids, 0)?.reshape(shape)? })
    }

    /// The cos and sin tables of at least `len` positions: the cached ones, or new ones of the next power
    /// of two (at least 256), computed on the device as transformers does, angle = f32(pos) * inv_freq in
    /// f32, then cos and sin in f32, cast to the model's dtype.
    fn rope_tables(&self, len: usize) -> candle_core::Result<Rope> {
        let mut slot = self.rope_tables.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(tables) = slot.as_ref().filter(|r| r.cos.dim(0).is_ok_and(|n| n >= len)) {
            return Ok(tables.clone());
        }
        let len = len.next_power_of_two().max(256);
        let pos = Tensor::arange(0u32, len as u32, &self.device)?.to_dtype(DType::F32)?;
        let freq = Tensor::new(self.inv_freq.as_slice(), &self.device)?;
        let angles = pos.unsqueeze(1)?.broadcast_mul(&freq.unsqueeze(0)?)?;
        let angles = Tensor::cat(&[&angles, &angles], 1)?;
        let tables = Rope { cos: angles.cos()?.to_dtype(self.dtype)?, sin: angles.sin()?.to_dtype(self.dtype)? };
        *slot = Some(tables.clone());
        Ok(tables)
    }

    /// One decoder layer, keeping what `state` says.
    pub(super) fn layer(&self, l: usize, x: &Tensor, pass: Pass, state: LayerState) -> candle_core::Result<Tensor> {
        let x = self.attention_block(l, x, pass, state)?;
        self.mlp_block(l, &x, pass.mode)
    }

    /// A layer's first half: `x` plus the attention of its normalised input.
    pub(super) fn attention_block(
        &self,
        l: usize,
        x: &Tensor,
        pass: Pass,
        state: LayerState,
    ) -> candle_core::Result<Tensor> {
        let _phase = crate::profile::phase("attention");
        let (mode, Positions { rope: Rope { cos, sin }, ranges }) = (pass.mode, pass.positions);
        let graph = mode.graph;
        let layer = self.layers[l];
        let cfg = &self.cfg;
        let (b, t, _) = x.dims3()?;
        let (nh, nkv, hd) = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
        let eps = cfg.rms_norm_eps;

        let fused = self.options.fused_ops;
        let norm = crate::profile::phase("norm");
        let h = rms_norm(x, &self.w(layer.input_norm, graph), eps, fused)?;
        drop(norm);
        let q = self.project(l, Projection::Q, &h, mode)?.reshape((b, t, nh, hd))?;
        let k = self.project(l, Projection::K, &h, mode)?.reshape((b, t, nkv, hd))?;
        let v = self.project(l, Projection::V, &h, mode)?.reshape((b, t, nkv, hd))?;
        let (q, k) = match layer.qk_norm {
            Some(QkNorm { q: qn, k: kn }) => {
                let _norm = crate::profile::phase("norm");
                (rms_norm(&q, &self.w(qn, graph), eps, fused)?, rms_norm(&k, &self.w(kn, graph), eps, fused)?)
            }
            None => (q, k),
        };
        // [B, T, heads, D] -> [B, heads, T, D], rotated.
        let rotate = if fused { crate::kernels::rope } else { rope_reference };
        let rotation = crate::profile::phase("rope");
        let q = rotate(&q, cos, sin)?;
        let mut k = rotate(&k, cos, sin)?;
        drop(rotation);
        let mut v = if fused { crate::kernels::to_heads(&v)? } else { v.transpose(1, 2)?.contiguous()? };
        let scale = 1.0 / (hd as f64).sqrt();
        if let LayerState::Paged(paged) = &state {
            paged.write(&k, &v)?;
            let attn = crate::kernels::paged_attention(&q.squeeze(0)?, paged.kv, paged.layout, scale as f32)?;
            let attn = attn.unsqueeze(0)?;
            let attn = if fused { crate::kernels::from_heads(&attn)? } else { attn.transpose(1, 2)? };
            return x + self.project(l, Projection::O, &attn.reshape((b, t, nh * hd))?, mode)?;
        }
        let replay = match state {
            LayerState::Cache(cache) => {
                (k, v) = LayerCache::append(cache, &k, &v)?;
                None
            }
            LayerState::Attention(replay) => Some(replay),
            LayerState::None | LayerState::Paged(_) => None,
        };
        // Grouped-query attention without repeating K/V (both paths read KV head h / (H / KV)).
        // A decode step (one query per row) has scores linear in the cache: the matrix path reads the
        // cache views as they are, where flash attention would copy them into contiguous tensors.
        let flash = self.options.attention != Attention::Matrix && t > 1;
        for (what, n, hint) in layer_sizes(cfg, b, t, k.dim(2)?, fused && flash) {
            crate::device::check_elements(&self.device, what, n, hint)?;
        }
        let kernels = match self.options.attention {
            Attention::Auto => {
                crate::kernels::auto_kernels(q.device(), q.dtype(), hd, !self.options.deterministic_attention)?
            }
            _ => self.options.gpu_kernels(),
        };
        let attn = match (fused, flash) {
            (true, true) => flash_attention_recorded(&q, &k, &v, ranges, scale, kernels, replay)?,
            (true, false) => matrix_attention(&q, &k, &v, |x| masked_softmax(x, ranges, scale))?,
            (false, _) => matrix_attention(&q, &k, &v, |x| masked_softmax_reference(x, ranges, scale))?,
        };
        let attn = match fused {
            true => crate::kernels::from_heads(&attn)?,
            false => attn.transpose(1, 2)?,
        };
        let attn = attn.reshape((b, t, nh * hd))?;
        x + self.project(l, Projection::O, &attn, mode)?
    }

    /// A layer's second half: `x` plus the MLP of its normalised input.
    fn mlp_block(&self, l: usize, x: &Tensor, mode: Mode) -> candle_core::Result<Tensor> {
        let _phase = crate::profile::phase("mlp");
        let act = self.mlp_activation(l, x, mode)?;
        let mlp = self.project(l, Projection::Down, &act, mode)?;
        x + mlp
    }

    /// The MLP's `silu(gate) * up` on the post-attention norm of `x`: what its down projection reads.
    pub(super) fn mlp_activation(&self, l: usize, x: &Tensor, mode: Mode) -> candle_core::Result<Tensor> {
        let norm = crate::profile::phase("norm");
        let weight = self.w(self.layers[l].post_attention_norm, mode.graph);
        let h = rms_norm(x, &weight, self.cfg.rms_norm_eps, self.options.fused_ops)?;
        drop(norm);
        let gate = self.project(l, Projection::Gate, &h, mode)?;
        let up = self.project(l, Projection::Up, &h, mode)?;
        if self.options.fused_ops {
            crate::kernels::swiglu(&gate, &up)
        } else {
            swiglu_reference(&gate, &up)
        }
    }

    pub(super) fn embed(&self, tokens: &[Vec<u32>], graph: bool) -> candle_core::Result<Tensor> {
        let _phase = crate::profile::phase("embedding");
        self.embed_ids(&self.token_ids(tokens)?, graph)?.reshape((tokens.len(), (), self.cfg.hidden_size))
    }

    /// The `[B x T]` ids of `tokens`, row after row, on the model's device.
    pub(super) fn token_ids(&self, tokens: &[Vec<u32>]) -> candle_core::Result<Tensor> {
        let flat: Vec<u32> = tokens.iter().flatten().copied().collect();
        let n = flat.len();
        crate::device::from_host(flat, n, &self.device)
    }

    /// The embedding rows `[N, hidden]` of `ids`.
    pub(super) fn embed_ids(&self, ids: &Tensor, graph: bool) -> candle_core::Result<Tensor> {
        let lookup = if self.options.fused_ops { embedding } else { embedding_reference };
        lookup(&self.w(self.embed, graph), ids)
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::tiny;
    use super::*;
    use crate::model::Arch;

    #[test]
    fn layer_sizes_flag_what_candle_cannot_index_on_cuda() {
        use crate::device::CUDA_MAX_ELEMENTS;
        let cfg =
            ModelConfig::from_file(std::path::Path::new("configs/models/qwen2.5-7b-instruct.config.json")).unwrap();
        let over = |b, t, s, flash| -> Vec<&str> {
            layer_sizes(&cfg, b, t, s, flash).into_iter().filter(|x| x.1 > CUDA_MAX_ELEMENTS).map(|x| x.0).collect()
        };
        // 7B (28 heads, intermediate 18,944) at 16k tokens: flash fits; the score matrix (7.5e9) does not.
        assert!(over(1, 16_384, 16_384, true).is_empty());
        assert_eq!(over(1, 16_384, 16_384, false), ["the attention scores [rows, heads, tokens, keys]"]);
        // 128 prompts of 2048 tokens in one prefill: 5e9 MLP activations.
        assert_eq!(over(128, 2048, 2048, true), ["a layer's activations [rows, tokens, intermediate]"]);
        // A decode step over a long cache stays small.
        assert!(over(256, 1, 32_768, false).is_empty());
    }

    /// The device-built tables give the values of the host formula they replace, bit for bit, and are
    /// built once for the longest position seen.
    #[test]
    fn rope_tables_match_the_host_formula_and_are_built_once() {
        let m = tiny(Arch::Qwen2, false, false);
        let positions = vec![vec![0u32, 1, 2, 300], vec![5, 6, 7, 8]];
        let Rope { cos, sin } = m.rope(&positions).unwrap();
        let half = m.inv_freq.len();
        assert_eq!(cos.dims(), [2, 1, 4, 2 * half]);
        for (r, row) in positions.iter().enumerate() {
            for (j, &p) in row.iter().enumerate() {
                let c: Vec<f32> = cos.get(r).unwrap().get(0).unwrap().get(j).unwrap().to_vec1().unwrap();
                let s: Vec<f32> = sin.get(r).unwrap().get(0).unwrap().get(j).unwrap().to_vec1().unwrap();
                for (i, &f) in m.inv_freq.iter().enumerate() {
                    let a = p as f32 * f;
                    assert_eq!((c[i], c[half + i], s[i], s[half + i]), (a.cos(), a.cos(), a.sin(), a.sin()));
                }
            }
        }
        let table = |m: &Decoder| m.rope_tables.0.lock().unwrap().as_ref().unwrap().cos.clone();
        let first = table(&m);
        assert_eq!(first.dim(0).unwrap(), 512);
        m.rope(&[vec![3, 4]]).unwrap();
        assert_eq!(table(&m).id(), first.id());
        m.rope(&[vec![600]]).unwrap();
        assert_eq!(table(&m).dim(0).unwrap(), 1024);
    }
}
