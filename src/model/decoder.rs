//! The decoder: Qwen2 / Qwen3 / Llama written from differentiable candle operations (candle's fused
//! softmax, rms_norm and rope drop gradients), with three ways to run it:
//! - training: per-token log-probs of given targets over a padded or packed batch, with gradients for
//!   every parameter, optionally recomputing each layer in the backward pass (activation checkpointing);
//! - detached: the same forward with no graph (the frozen reference, old-policy log-probs);
//! - generation: incremental forward with a KV cache over a batch of left-padded prompts.

use candle_core::{DType, Device, Tensor, Var};

use super::config::{ModelConfig, RopeScaling};
use super::lora::{self, LoraOptions};
use crate::kernels::{
    embedding, embedding_grad, embedding_grad_into, embedding_reference, flash_attention_recorded, frozen_matmul,
    logprobs_entropy_with, masked_softmax, masked_softmax_reference, matmul_accumulating, matrix_attention,
    rms_norm as fused_rms_norm, rms_norm_reference, rope_reference, swiglu_reference, AttentionRecord, GpuKernels,
    HeadBackward, Replay,
};
use crate::kernels::{lora_linear, lora_linear_reference, Dropout};

/// A parameter: trainable (a candle `Var`) or frozen (a plain tensor).
#[derive(Clone)]
pub enum Param {
    Trainable(Var),
    Frozen(Tensor),
}

impl Param {
    /// The tensor with (`graph = true`) or without gradient tracking.
    fn get(&self, graph: bool) -> Tensor {
        match self {
            Param::Trainable(v) if graph => v.as_tensor().clone(),
            Param::Trainable(v) => v.as_detached_tensor(),
            Param::Frozen(t) => t.clone(),
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct LayerIdx {
    q: usize,
    k: usize,
    v: usize,
    o: usize,
    q_bias: Option<usize>,
    k_bias: Option<usize>,
    v_bias: Option<usize>,
    o_bias: Option<usize>,
    q_norm: Option<usize>,
    k_norm: Option<usize>,
    gate: usize,
    up: usize,
    down: usize,
    gate_bias: Option<usize>,
    up_bias: Option<usize>,
    down_bias: Option<usize>,
    ln_in: usize,
    ln_post: usize,
    /// LoRA: the `(A, B)` parameters of each projection, in the order of [`lora::TARGETS`].
    adapters: [Option<(usize, usize)>; 7],
}

impl LayerIdx {
    /// The weight and bias of projection `m` (the order of [`lora::TARGETS`]).
    fn projection(&self, m: usize) -> (usize, Option<usize>) {
        match m {
            0 => (self.q, self.q_bias),
            1 => (self.k, self.k_bias),
            2 => (self.v, self.v_bias),
            3 => (self.o, self.o_bias),
            4 => (self.gate, self.gate_bias),
            5 => (self.up, self.up_bias),
            _ => (self.down, self.down_bias),
        }
    }
}

/// The projections, as indices into [`lora::TARGETS`].
const Q: usize = 0;
const K: usize = 1;
const V: usize = 2;
const O: usize = 3;
const GATE: usize = 4;
const UP: usize = 5;
const DOWN: usize = 6;

/// How a forward runs through the layers: recording a graph or not, in training the seed of LoRA's
/// dropout masks (`None`: no dropout, as in inference and the reference's forward), and where the
/// projections' weight gradients go.
#[derive(Debug, Clone, Copy)]
struct Mode<'a> {
    graph: bool,
    dropout_seed: Option<u64>,
    /// The trainable parameters' f32 gradient accumulators by slot ([`Grads`]): where given, a recorded
    /// projection adds its weight's gradient straight into its accumulator in the backward
    /// ([`matmul_accumulating`]) instead of handing it to candle's gradient store.
    accumulators: Option<&'a [Option<Tensor>]>,
}

impl<'a> Mode<'a> {
    /// Without dropout.
    const fn plain(graph: bool) -> Self {
        Mode { graph, dropout_seed: None, accumulators: None }
    }

    /// A training forward of `batch` (its dropout seed).
    fn training(batch: &TokenBatch, graph: bool) -> Self {
        Mode { graph, dropout_seed: batch.dropout_seed, accumulators: None }
    }

    /// The same, the projections' weight gradients added into `accumulators`.
    fn accumulating(self, accumulators: &'a [Option<Tensor>]) -> Self {
        Mode { accumulators: Some(accumulators), ..self }
    }

    /// The accumulator of the parameter in trainable slot `slot`, where this forward adds into one.
    fn accumulator(&self, slot: Option<usize>) -> Option<&'a Tensor> {
        self.accumulators?.get(slot?)?.as_ref()
    }

    /// The seed of projection `m` of layer `l`: every adapter draws its own mask.
    fn dropout_seed(&self, l: usize, m: usize) -> Option<u64> {
        use crate::checksum::splitmix64;
        self.dropout_seed.map(|s| splitmix64(s ^ splitmix64((l as u64) << 3 | m as u64)))
    }
}

/// How the decoder computes attention (the same values either way, up to rounding).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Attention {
    /// Block by block with an online softmax and its own backward (flash attention): O(T) memory per
    /// head, forward and backward.
    Flash,
    /// Through the `[T, S]` score matrix of each head and the fused masked softmax: O(T x S) memory.
    Matrix,
    /// As `flash`, but on a GPU, for bf16 and f16 weights with a head dim of 64 or 128, through the
    /// tensor-core kernels of kernels/flash_mma.cu (FlashAttention-2's design: `mma.sync` block products
    /// with the scores in registers) instead of cuBLAS GEMMs over blocks in device memory. Tested on the
    /// host emulator, not yet on a GPU; elsewhere the same as `flash`.
    Mma,
    /// As `mma`, but on a GPU of compute capability 9.0 (H100, H200) through the warpgroup tensor-core
    /// kernels of kernels/flash_wgmma.cu (`wgmma.mma_async` on 64-row tiles in swizzled shared memory,
    /// `deterministic_attention` as with `mma`); on other GPUs the same as `mma`.
    /// Tested on the host emulator, not yet on a GPU.
    Wgmma,
    /// The default: on a GPU, the fastest of `wgmma` (compute capability 9.0) and `mma` (8.x) that passes
    /// a check against the chunked path on that device the first time it attends (bf16/f16 at head dim
    /// 64 or 128; the verdict is logged), else `flash`; on the CPU `flash`.
    #[default]
    Auto,
}

/// Options that change how (not what) the decoder computes.
#[derive(Debug, Clone)]
pub struct DecoderOptions {
    /// Recompute each layer during the backward pass instead of keeping its activations.
    pub checkpoint_layers: bool,
    /// With `checkpoint_layers` and flash-kind attention: `false` keeps each layer's attention output and
    /// log-sum-exp from the forward ([B, H, T, D] + 4 B H T bytes a layer), and the recomputation runs the
    /// attention's backward without its forward (`true`: the attention is recomputed with the layer).
    pub recompute_attention: bool,
    /// Memory budget of one chunk of f32 logits in the log-prob op; 0 sizes it from the device
    /// ([`crate::kernels::logprob_chunk_bytes`]: at least 1 GiB on a GPU, 64 MiB on the CPU).
    pub logprob_chunk_bytes: usize,
    /// Keep the log-prob op's logits (`[scored tokens, vocab]` in the weight's dtype) from the forward
    /// for its backward instead of recomputing them chunk by chunk ([`HeadBackward::keep_logits`]).
    pub keep_logits: bool,
    /// Use the project's fused ops (RMSNorm, rope, attention softmax); `false` uses their composite
    /// candle references instead (slower, more memory: for checking the kernels and measuring them),
    /// attention through the score matrix whatever `attention` says.
    pub fused_ops: bool,
    /// How attention is computed (with `fused_ops`; generation's one-token steps, whose scores are
    /// linear in the cache, always go through the score matrix).
    pub attention: Attention,
    /// With `attention = "mma"` on a GPU: `false` sums the backward's dq by f32 atomics (FlashAttention-2's
    /// backward, fewer FLOPs, its rounding varying from run to run); `true` computes it in a kernel of its own,
    /// the same bits every run.
    pub deterministic_attention: bool,
}

impl DecoderOptions {
    /// Whether attention runs on the tensor-core kernels (kernels/flash_mma.cu) on a GPU for weights of
    /// `dtype` with head dim `head_dim`: `attention = "mma"` or `"wgmma"` with fused ops, where the kernels
    /// apply.
    pub fn tensor_core_attention(&self, dtype: DType, head_dim: usize) -> bool {
        self.fused_ops
            && matches!(self.attention, Attention::Mma | Attention::Wgmma | Attention::Auto)
            && crate::kernels::tensor_core_attention(dtype, head_dim)
    }

    /// The kernels flash attention runs on a GPU.
    pub fn gpu_kernels(&self) -> GpuKernels {
        match self.attention {
            Attention::Mma => GpuKernels::TensorCores { atomic_dq: !self.deterministic_attention, warpgroup: false },
            Attention::Wgmma => GpuKernels::TensorCores { atomic_dq: !self.deterministic_attention, warpgroup: true },
            // Chosen on the device by a check (`kernels::auto_kernels`); the chunked path until then.
            Attention::Flash | Attention::Matrix | Attention::Auto => GpuKernels::Chunked,
        }
    }
}

impl Default for DecoderOptions {
    fn default() -> Self {
        Self {
            checkpoint_layers: false,
            recompute_attention: true,
            logprob_chunk_bytes: 0,
            keep_logits: false,
            fused_ops: true,
            attention: Attention::Auto,
            deterministic_attention: true,
        }
    }
}

/// What a layer keeps across calls.
enum LayerState<'a> {
    None,
    /// Generation: this layer's past keys and values, extended by the call.
    Cache(&'a mut Option<LayerCache>),
    /// Training with recomputation: the attention's forward recorded, or replayed from its record.
    Attention(Replay<'a>),
    /// Generation over the paged KV cache: the step's keys and values written to their slots, the
    /// attention read through the block tables.
    Paged(super::paged::PagedLayer<'a>),
}

/// A batch of token rows for the training / scoring forward.
///
/// Rows are right-padded; a row may hold several packed sequences. `segments[b][t]` numbers the
/// sequence a token belongs to (1, 2, ...; 0 is padding): attention is causal within a segment only,
/// and position ids restart at 0 for each segment.
#[derive(Debug, Clone)]
pub struct TokenBatch {
    pub tokens: Vec<Vec<u32>>,
    pub positions: Vec<Vec<u32>>,
    pub segments: Vec<Vec<u32>>,
    /// A training batch's seed: LoRA's dropout masks ([`lora`]) are drawn from it in
    /// [`Decoder::forward_backward_into`] (and again, the same, in the layers' recomputation). `None`: no
    /// dropout.
    pub dropout_seed: Option<u64>,
}

impl TokenBatch {
    /// One sequence per row, right-padded with `pad`.
    pub fn padded(seqs: &[Vec<u32>], pad: u32) -> Self {
        Self::packed(&seqs.iter().map(|s| vec![s.clone()]).collect::<Vec<_>>(), pad)
    }

    /// Several sequences per row (packed), rows right-padded with `pad`.
    pub fn packed(rows: &[Vec<Vec<u32>>], pad: u32) -> Self {
        let width = rows.iter().map(|r| r.iter().map(Vec::len).sum::<usize>()).max().unwrap_or(0);
        let mut b = TokenBatch { tokens: vec![], positions: vec![], segments: vec![], dropout_seed: None };
        for row in rows {
            let (mut t, mut p, mut s) =
                (Vec::with_capacity(width), Vec::with_capacity(width), Vec::with_capacity(width));
            for (i, seq) in row.iter().enumerate() {
                t.extend_from_slice(seq);
                p.extend(0..seq.len() as u32);
                s.extend(std::iter::repeat_n(i as u32 + 1, seq.len()));
            }
            t.resize(width, pad);
            p.resize(width, 0);
            s.resize(width, 0);
            b.tokens.push(t);
            b.positions.push(p);
            b.segments.push(s);
        }
        b
    }

    /// The batch with LoRA's dropout masks drawn from `seed` in training.
    pub fn with_dropout_seed(mut self, seed: u64) -> Self {
        self.dropout_seed = Some(seed);
        self
    }

    pub fn rows(&self) -> usize {
        self.tokens.len()
    }

    pub fn width(&self) -> usize {
        self.tokens.first().map_or(0, Vec::len)
    }

    /// Number of non-padding tokens.
    pub fn num_tokens(&self) -> usize {
        self.segments.iter().flatten().filter(|&&s| s != 0).count()
    }

    /// The keys each query attends to, `[B, T, 2]` u32 of inclusive `(lo, hi)`: causal within its
    /// segment; a padding query sees itself only (its output is never used, but must stay finite).
    fn ranges(&self, device: &Device) -> candle_core::Result<Tensor> {
        let (b, t) = (self.rows(), self.width());
        let mut r = Vec::with_capacity(b * t * 2);
        for seg in &self.segments {
            let mut start = 0;
            for i in 0..t {
                if i == 0 || seg[i] != seg[i - 1] {
                    start = i;
                }
                r.extend_from_slice(&[if seg[i] == 0 { i as u32 } else { start as u32 }, i as u32]);
            }
        }
        crate::device::from_host(r, (b, t, 2), device)
    }
}

/// Which next-token log-probs to compute: entry n is the token at `(row, pos)` predicted from the
/// hidden state at `(row, pos - 1)`.
#[derive(Debug, Clone, Default)]
pub struct Targets {
    pub row: Vec<u32>,
    pub pos: Vec<u32>,
}

impl Targets {
    pub fn len(&self) -> usize {
        self.row.len()
    }

    pub fn is_empty(&self) -> bool {
        self.row.is_empty()
    }

    pub fn push(&mut self, row: usize, pos: usize) {
        debug_assert!(pos >= 1, "the first token of a sequence has no log-prob");
        self.row.push(row as u32);
        self.pos.push(pos as u32);
    }
}

/// Gradients of the trainable parameters (f32), in the order of [`Decoder::vars`].
pub struct Grads {
    pub grads: Vec<Option<Tensor>>,
}

impl Grads {
    /// No gradient yet for `n` trainable parameters.
    pub fn new(n: usize) -> Self {
        Self { grads: vec![None; n] }
    }

    fn add(&mut self, i: usize, g: &Tensor) -> candle_core::Result<()> {
        match &self.grads[i] {
            // The accumulator is a buffer of its own, contiguous (the cast, or a copy: candle may hand one
            // gradient tensor to several inputs); later micro-batches add into it in place.
            None => {
                let acc = if g.dtype() == DType::F32 { g.affine(1.0, 0.0)? } else { g.to_dtype(DType::F32)? };
                self.grads[i] = Some(acc.contiguous()?);
            }
            Some(acc) => crate::kernels::accumulate(acc, g)?,
        }
        Ok(())
    }
}

/// One layer's keys and values `[B, KV, capacity, D]`, written in place; the first `len` positions are used.
#[derive(Clone)]
struct LayerCache {
    k: Tensor,
    v: Tensor,
    len: usize,
}

impl LayerCache {
    /// Append `k`, `v` (`[B, KV, t, D]`, contiguous) and return views of everything cached so far.
    fn append(slot: &mut Option<LayerCache>, k: &Tensor, v: &Tensor) -> candle_core::Result<(Tensor, Tensor)> {
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
    layers: Vec<Option<LayerCache>>,
    /// Per row, whether each cached key position is a real token (false for left padding).
    valid: Vec<Vec<bool>>,
    /// Per row, the position id of the next token.
    next_pos: Vec<u32>,
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

/// The decoder with its parameters.
pub struct Decoder {
    cfg: ModelConfig,
    device: Device,
    dtype: DType,
    names: Vec<String>,
    params: Vec<Param>,
    embed: usize,
    layers: Vec<LayerIdx>,
    norm: usize,
    lm_head: usize,
    inv_freq: Vec<f32>,
    rope_tables: RopeTables,
    pub options: DecoderOptions,
    /// Per parameter, its index among the trainable ones (the index of its gradient in [`Grads`]).
    slots: Vec<Option<usize>>,
    /// LoRA ([`lora`]): the adapters' options; their parameters follow the `base` ones, which are frozen.
    lora: Option<LoraOptions>,
    /// The number of the base model's parameters (those of [`parameter_shapes`]).
    base: usize,
}

/// Per parameter, its index among the trainable ones.
fn slots_of(params: &[Param]) -> Vec<Option<usize>> {
    let mut n = 0;
    params
        .iter()
        .map(|p| {
            matches!(p, Param::Trainable(_)).then(|| {
                n += 1;
                n - 1
            })
        })
        .collect()
}

/// cos and sin of positions `0..len` (`[len, D]`, both halves equal, in the model's dtype), built on the
/// model's device at the first forward that needs them (again only for a longer position) and gathered
/// by position id in every forward, instead of being computed on the host and copied each time. A clone
/// starts empty (it may move to another device or dtype).
#[derive(Default)]
struct RopeTables(std::sync::Mutex<Option<(Tensor, Tensor)>>);

impl Clone for RopeTables {
    fn clone(&self) -> Self {
        Self::default()
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

/// Names of the parameters of `cfg`, in a fixed order, with their shapes.
pub fn parameter_shapes(cfg: &ModelConfig) -> Vec<(String, Vec<usize>)> {
    let (h, i, hd) = (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim);
    let (q, kv) = (cfg.num_heads * hd, cfg.num_kv_heads * hd);
    let mut out = vec![("model.embed_tokens.weight".to_string(), vec![cfg.vocab_size, h])];
    for l in 0..cfg.num_layers {
        let p = |s: &str| format!("model.layers.{l}.{s}");
        out.push((p("self_attn.q_proj.weight"), vec![q, h]));
        out.push((p("self_attn.k_proj.weight"), vec![kv, h]));
        out.push((p("self_attn.v_proj.weight"), vec![kv, h]));
        out.push((p("self_attn.o_proj.weight"), vec![h, q]));
        if cfg.qkv_bias {
            out.push((p("self_attn.q_proj.bias"), vec![q]));
            out.push((p("self_attn.k_proj.bias"), vec![kv]));
            out.push((p("self_attn.v_proj.bias"), vec![kv]));
        }
        if cfg.o_bias {
            out.push((p("self_attn.o_proj.bias"), vec![h]));
        }
        if cfg.qk_norm {
            out.push((p("self_attn.q_norm.weight"), vec![hd]));
            out.push((p("self_attn.k_norm.weight"), vec![hd]));
        }
        out.push((p("mlp.gate_proj.weight"), vec![i, h]));
        out.push((p("mlp.up_proj.weight"), vec![i, h]));
        out.push((p("mlp.down_proj.weight"), vec![h, i]));
        if cfg.mlp_bias {
            out.push((p("mlp.gate_proj.bias"), vec![i]));
            out.push((p("mlp.up_proj.bias"), vec![i]));
            out.push((p("mlp.down_proj.bias"), vec![h]));
        }
        out.push((p("input_layernorm.weight"), vec![h]));
        out.push((p("post_attention_layernorm.weight"), vec![h]));
    }
    out.push(("model.norm.weight".to_string(), vec![h]));
    if !cfg.tie_word_embeddings {
        out.push(("lm_head.weight".to_string(), vec![cfg.vocab_size, h]));
    }
    out
}

fn inv_freq(cfg: &ModelConfig) -> Vec<f32> {
    let d = cfg.head_dim;
    let base: Vec<f64> = (0..d / 2).map(|i| 1.0 / cfg.rope_theta.powf((2 * i) as f64 / d as f64)).collect();
    match &cfg.rope_scaling {
        RopeScaling::None => base.iter().map(|&f| f as f32).collect(),
        RopeScaling::Linear { factor } => base.iter().map(|&f| (f / factor) as f32).collect(),
        RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
            let low_wavelen = original_max_position_embeddings / low_freq_factor;
            let high_wavelen = original_max_position_embeddings / high_freq_factor;
            base.iter()
                .map(|&f| {
                    let wavelen = 2.0 * std::f64::consts::PI / f;
                    let scaled = if wavelen > low_wavelen {
                        f / factor
                    } else if wavelen < high_wavelen {
                        f
                    } else {
                        let smooth = (original_max_position_embeddings / wavelen - low_freq_factor)
                            / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * f / factor + smooth * f
                    };
                    scaled as f32
                })
                .collect()
        }
    }
}

/// RMSNorm as transformers computes it: normalised in f32, rounded to the input dtype, times the weight.
fn rms_norm(x: &Tensor, w: &Tensor, eps: f64, fused: bool) -> candle_core::Result<Tensor> {
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
    /// Build a decoder from named tensors; `trainable` makes every parameter a `Var`.
    /// Missing tensors are reported by name. Tensors are converted to `dtype` on `device`.
    pub fn from_tensors(
        cfg: ModelConfig,
        mut get: impl FnMut(&str, &[usize]) -> Result<Tensor, super::ModelError>,
        dtype: DType,
        device: &Device,
        trainable: bool,
    ) -> Result<Self, super::ModelError> {
        let shapes = parameter_shapes(&cfg);
        let mut names = Vec::with_capacity(shapes.len());
        let mut params = Vec::with_capacity(shapes.len());
        for (name, shape) in &shapes {
            let t = get(name, shape)?;
            if t.dims() != shape.as_slice() {
                return Err(super::ModelError::Shape {
                    name: name.clone(),
                    expected: shape.clone(),
                    found: t.dims().to_vec(),
                });
            }
            let t = t.to_dtype(dtype)?.to_device(device)?;
            params.push(if trainable { Param::Trainable(Var::from_tensor(&t)?) } else { Param::Frozen(t) });
            names.push(name.clone());
        }
        let find = |n: &str| names.iter().position(|x| x == n);
        let req = |n: String| find(&n).ok_or_else(|| super::ModelError::Missing(n));
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for l in 0..cfg.num_layers {
            let p = |s: &str| format!("model.layers.{l}.{s}");
            layers.push(LayerIdx {
                q: req(p("self_attn.q_proj.weight"))?,
                k: req(p("self_attn.k_proj.weight"))?,
                v: req(p("self_attn.v_proj.weight"))?,
                o: req(p("self_attn.o_proj.weight"))?,
                q_bias: find(&p("self_attn.q_proj.bias")),
                k_bias: find(&p("self_attn.k_proj.bias")),
                v_bias: find(&p("self_attn.v_proj.bias")),
                o_bias: find(&p("self_attn.o_proj.bias")),
                q_norm: find(&p("self_attn.q_norm.weight")),
                k_norm: find(&p("self_attn.k_norm.weight")),
                gate: req(p("mlp.gate_proj.weight"))?,
                up: req(p("mlp.up_proj.weight"))?,
                down: req(p("mlp.down_proj.weight"))?,
                gate_bias: find(&p("mlp.gate_proj.bias")),
                up_bias: find(&p("mlp.up_proj.bias")),
                down_bias: find(&p("mlp.down_proj.bias")),
                ln_in: req(p("input_layernorm.weight"))?,
                ln_post: req(p("post_attention_layernorm.weight"))?,
                adapters: [None; 7],
            });
        }
        let embed = req("model.embed_tokens.weight".into())?;
        let norm = req("model.norm.weight".into())?;
        let lm_head = if cfg.tie_word_embeddings { embed } else { req("lm_head.weight".into())? };
        let inv_freq = inv_freq(&cfg);
        Ok(Self {
            cfg,
            device: device.clone(),
            dtype,
            names,
            slots: slots_of(&params),
            base: params.len(),
            params,
            embed,
            layers,
            norm,
            lm_head,
            inv_freq,
            rope_tables: RopeTables::default(),
            options: DecoderOptions::default(),
            lora: None,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Parameter names (Hugging Face names; with LoRA, the adapters' names follow), in parameter order.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// The parameters, in the order of [`Decoder::names`].
    pub fn params(&self) -> &[Param] {
        &self.params
    }

    /// The trainable variables, in parameter order (empty for a frozen model; with LoRA, the adapters).
    pub fn vars(&self) -> Vec<&Var> {
        self.params.iter().filter_map(|p| if let Param::Trainable(v) = p { Some(v) } else { None }).collect()
    }

    /// The names of [`Decoder::vars`].
    pub fn trainable_names(&self) -> Vec<String> {
        self.names.iter().zip(&self.slots).filter(|(_, s)| s.is_some()).map(|(n, _)| n.clone()).collect()
    }

    /// No gradient yet for each trainable parameter.
    pub fn new_grads(&self) -> Grads {
        Grads::new(self.vars().len())
    }

    /// Detached copies of the base model's parameters by name, in its dtype (the Hugging Face weights; with
    /// LoRA, without the adapters: see [`Decoder::adapter_tensors`] and [`Decoder::merged`]).
    pub fn named_tensors(&self) -> Vec<(String, Tensor)> {
        self.names.iter().cloned().zip(self.params.iter().map(|p| p.get(false))).take(self.base).collect()
    }

    /// What this model adds to its base model: every parameter, or with LoRA the adapters only (what a
    /// checkpoint stores of a frozen copy: the swapped reference, the anchor snapshot, the lagged sampler).
    pub fn state_tensors(&self) -> Vec<(String, Tensor)> {
        match self.lora {
            Some(_) => self.adapter_tensors(),
            None => self.named_tensors(),
        }
    }

    /// A frozen model shaped like this one with the parameters `tensors` ([`Decoder::state_tensors`] of a
    /// model shaped like this one): with LoRA, this model's base weights (shared) and those adapters.
    pub fn frozen_with(
        &self,
        mut get: impl FnMut(&str, &[usize]) -> Result<Tensor, super::ModelError>,
    ) -> Result<Self, super::ModelError> {
        let mut model = match &self.lora {
            Some(opts) => {
                let mut adapters = Vec::new();
                for (name, shape) in lora::adapter_shapes(&self.cfg, opts) {
                    adapters.push((name.clone(), get(&name, &shape)?));
                }
                self.without_adapters().with_adapters(opts, adapters, false)?
            }
            None => Self::from_tensors(self.cfg.clone(), get, self.dtype, &self.device, false)?,
        };
        model.options = self.options.clone();
        Ok(model)
    }

    /// The LoRA options, when the model has adapters.
    pub fn lora(&self) -> Option<&LoraOptions> {
        self.lora.as_ref()
    }

    /// The adapters by name ([`lora::adapter_shapes`]), detached, f32 (empty without LoRA).
    pub fn adapter_tensors(&self) -> Vec<(String, Tensor)> {
        self.names.iter().cloned().zip(self.params.iter().map(|p| p.get(false))).skip(self.base).collect()
    }

    /// This model with LoRA adapters `adapters` (named and shaped as [`lora::adapter_shapes`] says) on the
    /// projections `opts` targets, trainable or frozen; the base weights become frozen (their storage
    /// shared, not copied). The adapters are kept in f32 ([`lora`]).
    pub fn with_adapters(
        mut self,
        opts: &LoraOptions,
        adapters: Vec<(String, Tensor)>,
        trainable: bool,
    ) -> Result<Self, super::ModelError> {
        if self.lora.is_some() {
            return Err(super::ModelError::Invalid("the model already has adapters".into()));
        }
        opts.validate().map_err(super::ModelError::Invalid)?;
        for p in &mut self.params {
            if let Param::Trainable(v) = p {
                *p = Param::Frozen(v.as_detached_tensor());
            }
        }
        let mut given: std::collections::HashMap<String, Tensor> = adapters.into_iter().collect();
        for (name, shape) in lora::adapter_shapes(&self.cfg, opts) {
            let t = given.remove(&name).ok_or_else(|| super::ModelError::Missing(name.clone()))?;
            if t.dims() != shape.as_slice() {
                return Err(super::ModelError::Shape { name, expected: shape, found: t.dims().to_vec() });
            }
            let t = t.to_dtype(DType::F32)?.to_device(&self.device)?;
            let i = self.params.len();
            self.params.push(if trainable { Param::Trainable(Var::from_tensor(&t)?) } else { Param::Frozen(t) });
            let (l, module) = Self::adapter_place(&name);
            let m = lora::TARGETS.iter().position(|(t, _)| *t == module).unwrap_or(0);
            let slot = &mut self.layers[l].adapters[m];
            *slot = match (name.ends_with("lora_A.weight"), *slot) {
                (true, _) => Some((i, usize::MAX)),
                (false, Some((a, _))) => Some((a, i)),
                (false, None) => Some((usize::MAX, i)),
            };
            self.names.push(name);
        }
        if let Some(extra) = given.keys().next() {
            return Err(super::ModelError::Invalid(format!(
                "adapter tensor `{extra}` is not one of the adapters the options describe"
            )));
        }
        self.slots = slots_of(&self.params);
        self.lora = Some(opts.clone());
        Ok(self)
    }

    /// The layer and projection of an adapter's name (`model.layers.L.BLOCK.MODULE.lora_X.weight`).
    fn adapter_place(name: &str) -> (usize, &str) {
        let parts: Vec<&str> = name.split('.').collect();
        (parts.get(2).and_then(|l| l.parse().ok()).unwrap_or(0), parts.get(4).copied().unwrap_or(""))
    }

    /// The base model of a LoRA model: the same (shared, frozen) base weights without the adapters (the
    /// reference of the KL term). Without LoRA, a frozen copy sharing the weights.
    pub fn without_adapters(&self) -> Self {
        let params: Vec<Param> = self.params[..self.base].iter().map(|p| Param::Frozen(p.get(false))).collect();
        let mut layers = self.layers.clone();
        for l in &mut layers {
            l.adapters = [None; 7];
        }
        Self {
            cfg: self.cfg.clone(),
            device: self.device.clone(),
            dtype: self.dtype,
            names: self.names[..self.base].to_vec(),
            slots: vec![None; self.base],
            base: self.base,
            params,
            embed: self.embed,
            layers,
            norm: self.norm,
            lm_head: self.lm_head,
            inv_freq: self.inv_freq.clone(),
            rope_tables: RopeTables::default(),
            options: self.options.clone(),
            lora: None,
        }
    }

    /// The base model with the adapters merged into its weights (`W + B A alpha / r`, in f32, rounded to
    /// the model's dtype): a frozen model without LoRA that computes what this one does (up to rounding).
    pub fn merged(&self) -> candle_core::Result<Self> {
        let mut out = self.without_adapters();
        let Some(opts) = &self.lora else { return Ok(out) };
        for li in &self.layers {
            for (m, adapter) in li.adapters.iter().enumerate() {
                let Some((a, b)) = *adapter else { continue };
                let (w, _) = li.projection(m);
                let delta = self.w(b, false).matmul(&self.w(a, false))?.affine(opts.scale(), 0.0)?;
                let merged = (self.w(w, false).to_dtype(DType::F32)? + delta)?.to_dtype(self.dtype)?;
                out.params[w] = Param::Frozen(merged);
            }
        }
        Ok(out)
    }

    /// A frozen (no-`Var`) copy of this model: the reference model, the anchor snapshot, the sampler. Its
    /// parameters are copies of this model's, but for LoRA's frozen base weights, which are shared.
    pub fn frozen_copy(&self) -> candle_core::Result<Self> {
        let lora = self.lora.is_some();
        let params = self
            .params
            .iter()
            .map(|p| match p {
                Param::Frozen(t) if lora => Ok(Param::Frozen(t.clone())),
                p => Ok(Param::Frozen(p.get(false).copy()?)),
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Self {
            cfg: self.cfg.clone(),
            device: self.device.clone(),
            dtype: self.dtype,
            names: self.names.clone(),
            slots: vec![None; params.len()],
            base: self.base,
            params,
            embed: self.embed,
            layers: self.layers.clone(),
            norm: self.norm,
            lm_head: self.lm_head,
            inv_freq: self.inv_freq.clone(),
            rope_tables: RopeTables::default(),
            options: self.options.clone(),
            lora: self.lora.clone(),
        })
    }

    /// Projection `m` of layer `li` of `x` (`[..., in]`): `x W^T + b`, plus with an adapter
    /// `(x A^T) B^T alpha / r` in f32 ([`lora`]). A frozen weight in a graph goes through
    /// [`frozen_matmul`], which gives it no gradient.
    fn project(&self, l: usize, m: usize, x: &Tensor, mode: Mode) -> candle_core::Result<Tensor> {
        let li = &self.layers[l];
        let graph = mode.graph;
        let (w, bias) = li.projection(m);
        let (Some((a, b)), Some(opts)) = (li.adapters[m], &self.lora) else {
            let grad = match (&self.params[w], mode.accumulator(self.slots[w])) {
                (Param::Frozen(_), _) if graph => WeightGrad::Frozen,
                (Param::Trainable(_), Some(acc)) if graph => WeightGrad::Into(acc),
                _ => WeightGrad::Store,
            };
            let fused = self.options.fused_ops;
            return linear(x, &self.w(w, graph), self.wo(bias, graph).as_ref(), grad, fused);
        };
        let _phase = crate::profile::phase("lora");
        let dropout = match mode.dropout_seed(l, m) {
            Some(seed) if opts.dropout > 0.0 => Some(Dropout { p: opts.dropout, seed }),
            _ => None,
        };
        let op = if self.options.fused_ops { lora_linear } else { lora_linear_reference };
        let dims = x.dims().to_vec();
        let (inner, out) = (*dims.last().unwrap_or(&0), self.params[w].get(false).dim(0)?);
        let x2 = x.reshape((x.elem_count() / inner.max(1), inner))?;
        let (bias, (a, b)) = (self.wo(bias, graph), (self.w(a, graph), self.w(b, graph)));
        let y = op(&x2, (&self.w(w, graph), bias.as_ref()), (&a, &b), opts.scale(), dropout)?;
        let mut shape = dims;
        *shape.last_mut().expect("a projection's input has a feature dim") = out;
        y.reshape(shape)
    }

    fn w(&self, i: usize, graph: bool) -> Tensor {
        self.params[i].get(graph)
    }

    fn wo(&self, i: Option<usize>, graph: bool) -> Option<Tensor> {
        i.map(|i| self.params[i].get(graph))
    }

    /// The cos and sin tables of `batch`'s positions ([`Decoder::rope`]), a phase of the profile.
    fn rope_of(&self, batch: &TokenBatch) -> candle_core::Result<(Tensor, Tensor)> {
        let _phase = crate::profile::phase("rope");
        self.rope(&batch.positions)
    }

    /// cos and sin tables `[B, 1, T, D]` for the given position ids, gathered from [`RopeTables`].
    fn rope(&self, positions: &[Vec<u32>]) -> candle_core::Result<(Tensor, Tensor)> {
        let (b, t) = (positions.len(), positions.first().map_or(0, Vec::len));
        let need = positions.iter().flatten().max().map_or(0, |&p| p as usize + 1);
        let (cos, sin) = self.rope_tables(need)?;
        let ids: Vec<u32> = positions.iter().flatten().copied().collect();
        let ids = crate::device::from_host(ids, b * t, &self.device)?;
        let shape = (b, 1, t, 2 * self.inv_freq.len());
        Ok((cos.index_select(&ids, 0)?.reshape(shape)?, sin.index_select(&ids, 0)?.reshape(shape)?))
    }

    /// The cos and sin tables of at least `len` positions: the cached ones, or new ones of the next power
    /// of two (at least 256), computed on the device as transformers does, angle = f32(pos) * inv_freq in
    /// f32, then cos and sin in f32, cast to the model's dtype.
    fn rope_tables(&self, len: usize) -> candle_core::Result<(Tensor, Tensor)> {
        let mut slot = self.rope_tables.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((c, s)) = slot.as_ref().filter(|(c, _)| c.dim(0).is_ok_and(|n| n >= len)) {
            return Ok((c.clone(), s.clone()));
        }
        let len = len.next_power_of_two().max(256);
        let pos = Tensor::arange(0u32, len as u32, &self.device)?.to_dtype(DType::F32)?;
        let freq = Tensor::new(self.inv_freq.as_slice(), &self.device)?;
        let angles = pos.unsqueeze(1)?.broadcast_mul(&freq.unsqueeze(0)?)?;
        let angles = Tensor::cat(&[&angles, &angles], 1)?;
        let tables = (angles.cos()?.to_dtype(self.dtype)?, angles.sin()?.to_dtype(self.dtype)?);
        *slot = Some(tables.clone());
        Ok(tables)
    }

    /// One decoder layer, keeping what `state` says.
    fn layer(
        &self,
        l: usize,
        x: &Tensor,
        rope: &(Tensor, Tensor),
        ranges: &Tensor,
        state: LayerState,
        mode: Mode,
    ) -> candle_core::Result<Tensor> {
        let x = self.attention_block(l, x, rope, ranges, state, mode)?;
        self.mlp_block(l, &x, mode)
    }

    /// A layer's first half: `x` plus the attention of its normalised input.
    fn attention_block(
        &self,
        l: usize,
        x: &Tensor,
        rope: &(Tensor, Tensor),
        ranges: &Tensor,
        state: LayerState,
        mode: Mode,
    ) -> candle_core::Result<Tensor> {
        let _phase = crate::profile::phase("attention");
        let graph = mode.graph;
        let li = self.layers[l];
        let cfg = &self.cfg;
        let (b, t, _) = x.dims3()?;
        let (nh, nkv, hd) = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
        let eps = cfg.rms_norm_eps;

        let fused = self.options.fused_ops;
        let norm = crate::profile::phase("norm");
        let h = rms_norm(x, &self.w(li.ln_in, graph), eps, fused)?;
        drop(norm);
        let q = self.project(l, Q, &h, mode)?.reshape((b, t, nh, hd))?;
        let k = self.project(l, K, &h, mode)?.reshape((b, t, nkv, hd))?;
        let v = self.project(l, V, &h, mode)?.reshape((b, t, nkv, hd))?;
        let (q, k) = match (li.q_norm, li.k_norm) {
            (Some(qn), Some(kn)) => {
                let _norm = crate::profile::phase("norm");
                (rms_norm(&q, &self.w(qn, graph), eps, fused)?, rms_norm(&k, &self.w(kn, graph), eps, fused)?)
            }
            _ => (q, k),
        };
        let (cos, sin) = rope;
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
            return x + self.project(l, O, &attn.reshape((b, t, nh * hd))?, mode)?;
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
        x + self.project(l, O, &attn, mode)?
    }

    /// A layer's second half: `x` plus the MLP of its normalised input.
    fn mlp_block(&self, l: usize, x: &Tensor, mode: Mode) -> candle_core::Result<Tensor> {
        let _phase = crate::profile::phase("mlp");
        let act = self.mlp_activation(l, x, mode)?;
        let mlp = self.project(l, DOWN, &act, mode)?;
        x + mlp
    }

    /// The MLP's `silu(gate) * up` on the post-attention norm of `x`: what its down projection reads.
    fn mlp_activation(&self, l: usize, x: &Tensor, mode: Mode) -> candle_core::Result<Tensor> {
        let li = self.layers[l];
        let norm = crate::profile::phase("norm");
        let h = rms_norm(x, &self.w(li.ln_post, mode.graph), self.cfg.rms_norm_eps, self.options.fused_ops)?;
        drop(norm);
        let gate = self.project(l, GATE, &h, mode)?;
        let up = self.project(l, UP, &h, mode)?;
        if self.options.fused_ops {
            crate::kernels::swiglu(&gate, &up)
        } else {
            swiglu_reference(&gate, &up)
        }
    }

    fn embed(&self, tokens: &[Vec<u32>], graph: bool) -> candle_core::Result<Tensor> {
        let _phase = crate::profile::phase("embedding");
        self.embed_ids(&self.token_ids(tokens)?, graph)?.reshape((tokens.len(), (), self.cfg.hidden_size))
    }

    /// The `[B x T]` ids of `tokens`, row after row, on the model's device.
    fn token_ids(&self, tokens: &[Vec<u32>]) -> candle_core::Result<Tensor> {
        let flat: Vec<u32> = tokens.iter().flatten().copied().collect();
        let n = flat.len();
        crate::device::from_host(flat, n, &self.device)
    }

    /// The embedding rows `[N, hidden]` of `ids`.
    fn embed_ids(&self, ids: &Tensor, graph: bool) -> candle_core::Result<Tensor> {
        let lookup = if self.options.fused_ops { embedding } else { embedding_reference };
        lookup(&self.w(self.embed, graph), ids)
    }

    /// The embedding's gradient from `g`, the gradient of its output rows (`[B, T, hidden]`), added into
    /// `grads` (when the embedding is trainable): each token's rows summed in f32 and added into the f32
    /// accumulator in place ([`embedding_grad_into`]; [`embedding_grad`] and an add where it has none yet);
    /// with `fused_ops = false`, candle's `index_add` in the weight's dtype, as its own backward does.
    fn embed_backward(&self, ids: &Tensor, g: Option<&Tensor>, grads: &mut Grads) -> candle_core::Result<()> {
        let _phase = crate::profile::phase("embedding");
        let (Param::Trainable(w), Some(g)) = (&self.params[self.embed], g) else { return Ok(()) };
        let g = g.reshape((ids.dim(0)?, self.cfg.hidden_size))?;
        let slot = self.slots[self.embed].unwrap_or_default();
        let dw = match (self.options.fused_ops, &grads.grads[slot]) {
            // Summed straight into the accumulator: no [V, hidden] gradient of its own.
            (true, Some(acc)) => return embedding_grad_into(acc, ids, &g),
            (true, None) => embedding_grad(ids, &g, self.cfg.vocab_size)?,
            (false, _) => w.zeros_like()?.index_add(ids, &g.to_dtype(w.dtype())?, 0)?,
        };
        grads.add(slot, &dw)
    }

    /// Hidden states of the target rows' predecessors, gathered as `[N, hidden]`, after the final norm.
    fn select_hidden(&self, x: &Tensor, targets: &Targets, graph: bool) -> candle_core::Result<Tensor> {
        let (_, t, h) = x.dims3()?;
        let idx: Vec<u32> = targets.row.iter().zip(&targets.pos).map(|(&r, &p)| r * t as u32 + p - 1).collect();
        let idx = crate::device::from_host(idx, targets.len(), &self.device)?;
        let sel = x.reshape(((), h))?.index_select(&idx, 0)?;
        rms_norm(&sel, &self.w(self.norm, graph), self.cfg.rms_norm_eps, self.options.fused_ops)
    }

    fn target_ids(&self, batch: &TokenBatch, targets: &Targets) -> candle_core::Result<Tensor> {
        let ids: Vec<u32> =
            targets.row.iter().zip(&targets.pos).map(|(&r, &p)| batch.tokens[r as usize][p as usize]).collect();
        crate::device::from_host(ids, targets.len(), &self.device)
    }

    fn check(&self, batch: &TokenBatch, targets: &Targets) -> candle_core::Result<()> {
        for (&r, &p) in targets.row.iter().zip(&targets.pos) {
            if r as usize >= batch.rows() || p == 0 || p as usize >= batch.width() {
                candle_core::bail!("target (row {r}, pos {p}) outside a batch of {}x{}", batch.rows(), batch.width());
            }
        }
        if let Some(&bad) = batch.tokens.iter().flatten().find(|&&t| t as usize >= self.cfg.vocab_size) {
            candle_core::bail!("token id {bad} is outside the vocabulary of {}", self.cfg.vocab_size);
        }
        Ok(())
    }

    /// `[N, 2]` f32: log-prob of each target token and the entropy of its predictive distribution.
    /// With `graph = false` nothing is recorded (reference model, old-policy log-probs, scoring).
    pub fn token_logprobs(&self, batch: &TokenBatch, targets: &Targets, graph: bool) -> candle_core::Result<Tensor> {
        self.check(batch, targets)?;
        self.logprobs_checked(batch, targets, graph)
    }

    /// The last layer's output `[B, T, hidden]` (before the final norm), without a cache.
    fn run_layers(&self, batch: &TokenBatch, graph: bool) -> candle_core::Result<Tensor> {
        self.layers_from(batch, self.embed(&batch.tokens, graph)?, Mode::plain(graph))
    }

    /// The layers over the embedded batch `x` (`[B, T, hidden]`).
    fn layers_from(&self, batch: &TokenBatch, mut x: Tensor, mode: Mode) -> candle_core::Result<Tensor> {
        let rope = self.rope_of(batch)?;
        let ranges = batch.ranges(&self.device)?;
        for l in 0..self.cfg.num_layers {
            x = self.layer(l, &x, &rope, &ranges, LayerState::None, mode)?;
        }
        Ok(x)
    }

    fn logprobs_checked(&self, batch: &TokenBatch, targets: &Targets, graph: bool) -> candle_core::Result<Tensor> {
        let x = self.run_layers(batch, graph)?;
        self.head(&x, batch, targets, Mode::plain(graph))
    }

    /// Log-probs and entropies `[N, 2]` of the targets from the last layer's output `x` (the lm_head's
    /// gradient added into its accumulator where `mode` has one).
    fn head(&self, x: &Tensor, batch: &TokenBatch, targets: &Targets, mode: Mode) -> candle_core::Result<Tensor> {
        let _phase = crate::profile::coarse("log-prob head")?;
        let graph = mode.graph;
        let h = self.select_hidden(x, targets, graph)?;
        let budget = match self.options.logprob_chunk_bytes {
            0 => crate::kernels::logprob_chunk_bytes(&self.device)?,
            b => b,
        };
        let (w, ids) = (self.w(self.lm_head, graph), self.target_ids(batch, targets)?);
        // Both apply only to a recorded op (logprobs_entropy_with): nothing is kept or added without a graph.
        let backward = HeadBackward {
            accumulator: mode.accumulator(self.slots[self.lm_head]),
            keep_logits: self.options.keep_logits,
        };
        logprobs_entropy_with(&h, &w, &ids, budget, backward)
    }

    /// The f32 accumulators of `grads` by slot, each made (zeros) where it has none yet, for the forward
    /// to add the projections' and the lm_head's weight gradients into (with `fused_ops`; `None`
    /// otherwise: candle's matmul backward and [`Grads::add`]).
    fn accumulators(&self, grads: &mut Grads) -> candle_core::Result<Option<Vec<Option<Tensor>>>> {
        if !self.options.fused_ops {
            return Ok(None);
        }
        for (p, slot) in self.params.iter().zip(&self.slots) {
            if let (Param::Trainable(v), Some(slot)) = (p, *slot) {
                if grads.grads[slot].is_none() {
                    grads.grads[slot] = Some(Tensor::zeros(v.shape(), DType::F32, v.device())?);
                }
            }
        }
        Ok(Some(grads.grads.clone()))
    }

    fn collect(&self, store: &candle_core::backprop::GradStore, grads: &mut Grads) -> candle_core::Result<()> {
        let _phase = crate::profile::phase("gradient accumulation");
        for (p, slot) in self.params.iter().zip(&self.slots) {
            if let (Param::Trainable(v), Some(slot)) = (p, slot) {
                if let Some(g) = store.get(v.as_tensor()) {
                    grads.add(*slot, g)?;
                }
            }
        }
        Ok(())
    }

    /// Forward and backward: `loss_fn` turns the `[N, 2]` log-prob/entropy tensor into a scalar loss;
    /// returns the loss value and the gradients of every trainable parameter. With
    /// `options.checkpoint_layers`, layer activations are recomputed one layer at a time in the backward.
    pub fn forward_backward(
        &self,
        batch: &TokenBatch,
        targets: &Targets,
        loss_fn: &mut dyn FnMut(&Tensor) -> candle_core::Result<Tensor>,
    ) -> candle_core::Result<(f32, Grads)> {
        let mut grads = self.new_grads();
        let loss = self.forward_backward_into(batch, targets, loss_fn, &mut grads)?;
        Ok((loss, grads))
    }

    /// [`Decoder::forward_backward`] adding the gradients into `grads` (gradient accumulation without a
    /// second full set of f32 gradients); returns the loss value.
    pub fn forward_backward_into(
        &self,
        batch: &TokenBatch,
        targets: &Targets,
        loss_fn: &mut dyn FnMut(&Tensor) -> candle_core::Result<Tensor>,
        grads: &mut Grads,
    ) -> candle_core::Result<f32> {
        self.check(batch, targets)?;
        let trainable = self.vars().len();
        if grads.grads.len() != trainable {
            candle_core::bail!("{} gradients for {trainable} trainable parameters", grads.grads.len());
        }
        // The embedding's output is a leaf of the graph: its gradient is summed per token in f32 by
        // `embed_backward`, not by candle's index_add in the weight's dtype.
        let forward = crate::profile::coarse("forward")?;
        let accumulators = self.accumulators(grads)?;
        let training = |graph| match &accumulators {
            Some(a) if graph => Mode::training(batch, graph).accumulating(a),
            _ => Mode::training(batch, graph),
        };
        let embedding = crate::profile::phase("embedding");
        let ids = self.token_ids(&batch.tokens)?;
        let shape = (batch.rows(), batch.width(), self.cfg.hidden_size);
        let e = self.embed_ids(&ids, false)?.reshape(shape)?;
        drop(embedding);
        if !self.options.checkpoint_layers {
            let e = Var::from_tensor(&e)?;
            let x = self.layers_from(batch, e.as_tensor().clone(), training(true))?;
            let loss = self.loss(&self.head(&x, batch, targets, training(true))?, loss_fn)?;
            forward.end();
            let _backward = crate::profile::coarse("backward")?;
            let store = {
                // candle's backward runs the whole graph at once: the layers' attention and MLP and the
                // head are not told apart.
                let _phase = crate::profile::phase("layers and head (one autograd pass)");
                loss.backward()?
            };
            self.collect(&store, grads)?;
            self.embed_backward(&ids, store.get(e.as_tensor()), grads)?;
            return crate::device::to_host_scalar::<f32>(&loss.to_dtype(DType::F32)?);
        }
        let rope = self.rope_of(batch)?;
        let ranges = batch.ranges(&self.device)?;
        let (inputs, mut records, x) = self.forward_kept(batch, e, (&rope, &ranges))?;
        // Head: gradient of the loss with respect to the last hidden state.
        let xv = Var::from_tensor(&x)?;
        let loss = self.loss(&self.head(xv.as_tensor(), batch, targets, training(true))?, loss_fn)?;
        forward.end();
        let _backward = crate::profile::coarse("backward")?;
        let head = crate::profile::coarse("log-prob head")?;
        let store = loss.backward()?;
        self.collect(&store, grads)?;
        let mut g = match store.get(xv.as_tensor()) {
            Some(g) => g.clone(),
            None => x.zeros_like()?,
        };
        head.end();
        // Layers in reverse: recompute with a graph, backprop the incoming gradient.
        for l in (0..self.cfg.num_layers).rev() {
            // This layer's record is released with its backward.
            let record = records.pop().flatten();
            let state = record.as_ref().map_or(LayerState::None, |r| LayerState::Attention(Replay::From(r)));
            g = self.layer_backward(l, &inputs[l], (&rope, &ranges, training(true)), state, &g, grads)?;
        }
        // Embedding: its gradient is the gradient of its output rows.
        self.embed_backward(&ids, Some(&g), grads)?;
        crate::device::to_host_scalar::<f32>(&loss.to_dtype(DType::F32)?)
    }

    /// The layers' forward without a graph from the embeddings `x`, keeping only each layer's input (and,
    /// unless the attention is recomputed, its attention's output and log-sum-exp): the inputs, the
    /// records and the last layer's output.
    fn forward_kept(
        &self,
        batch: &TokenBatch,
        mut x: Tensor,
        (rope, ranges): (&(Tensor, Tensor), &Tensor),
    ) -> candle_core::Result<(Vec<Tensor>, Vec<Option<AttentionRecord>>, Tensor)> {
        let keep = !self.options.recompute_attention;
        let mut inputs = Vec::with_capacity(self.cfg.num_layers + 1);
        let mut records: Vec<Option<AttentionRecord>> = Vec::with_capacity(self.cfg.num_layers);
        for l in 0..self.cfg.num_layers {
            let mut record = None;
            let state = if keep { LayerState::Attention(Replay::Record(&mut record)) } else { LayerState::None };
            let next = self.layer(l, &x, rope, ranges, state, Mode::training(batch, false))?;
            inputs.push(x);
            records.push(record);
            x = next;
        }
        Ok((inputs, records, x))
    }

    /// The loss of the head's log-probs `lp` (a phase of the profile).
    fn loss(
        &self,
        lp: &Tensor,
        loss_fn: &mut dyn FnMut(&Tensor) -> candle_core::Result<Tensor>,
    ) -> candle_core::Result<Tensor> {
        let _phase = crate::profile::phase("loss");
        loss_fn(lp)
    }

    /// The backward of layer `l` (input `input`, the gradient of its output `g`), recomputed with a graph:
    /// its MLP's backward, then its attention's, their parameters' gradients added into `grads`; returns
    /// the gradient of its input.
    fn layer_backward(
        &self,
        l: usize,
        input: &Tensor,
        (rope, ranges, mode): (&(Tensor, Tensor), &Tensor, Mode),
        state: LayerState,
        g: &Tensor,
        grads: &mut Grads,
    ) -> candle_core::Result<Tensor> {
        let grad_of = |store: &candle_core::backprop::GradStore, v: &Var| match store.get(v.as_tensor()) {
            Some(g) => Ok(g.clone()),
            None => v.as_tensor().zeros_like(),
        };
        let recompute = crate::profile::phase("recompute");
        let xin = Var::from_tensor(input)?;
        let mid = self.attention_block(l, xin.as_tensor(), rope, ranges, state, mode)?;
        let mid_in = Var::from_tensor(&mid.detach())?;
        // The layer's output `mid + down(act)` is not formed: its backward reads neither it nor the down
        // projection's output, so the residual's gradient is added below. The projection itself is run:
        // recorded instead as a node of zeros carrying the product's backward (a GEMM less a layer), it kept
        // about a layer's activations alive per recomputed layer through the rest of the backward (the 7B
        // step ran out of memory on 2026-11-27; reproduced on the CPU, benches/results/
        // recompute-memory-cpu-2026-11-27.txt), for a reason not found; that op is gone.
        let down = {
            let _mlp = crate::profile::phase("mlp");
            let act = self.mlp_activation(l, mid_in.as_tensor(), mode)?;
            self.project(l, DOWN, &act, mode)?
        };
        drop(recompute);
        let g_mid = {
            // The MLP's graph and gradients are released before the attention's backward.
            let _mlp = crate::profile::phase("mlp");
            let store = down.backward_from(&g.reshape(down.shape())?)?;
            self.collect(&store, grads)?;
            (grad_of(&store, &mid_in)? + g)?
        };
        let _attention = crate::profile::phase("attention");
        let store = mid.backward_from(&g_mid)?;
        self.collect(&store, grads)?;
        grad_of(&store, &xin)
    }

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
        let mut positions = Vec::with_capacity(b);
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
            positions.push(pos);
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
        let rope = self.rope(&positions)?;
        let mut x = self.embed(tokens, false)?;
        for l in 0..self.cfg.num_layers {
            x = self.layer(l, &x, &rope, &ranges, LayerState::Cache(&mut cache.layers[l]), Mode::plain(false))?;
        }
        let last = x.narrow(1, t - 1, 1)?.squeeze(1)?;
        let h = rms_norm(&last, &self.w(self.norm, false), self.cfg.rms_norm_eps, self.options.fused_ops)?;
        h.matmul(&self.w(self.lm_head, false).t()?)?.to_dtype(DType::F32)
    }

    /// One step of paged generation: `batch`'s tokens run as one row through the layers, each writing its
    /// keys and values into its slot of `kv` and attending to its sequence's positions there; returns the
    /// next-token logits `[logit_rows, V]` (f32) of the rows `batch.logit_rows` names.
    pub fn forward_paged(&self, batch: &super::PagedBatch, kv: &super::PagedKv) -> candle_core::Result<Tensor> {
        let t = batch.tokens.len();
        if t == 0 || batch.positions.len() != t || batch.slots.len() != t {
            candle_core::bail!(
                "a paged step of {t} tokens, {} positions and {} slots",
                batch.positions.len(),
                batch.slots.len()
            );
        }
        let index = super::paged::slot_index(&batch.slots, self.cfg.num_kv_heads, self.cfg.head_dim, &self.device)?;
        let rope = self.rope(std::slice::from_ref(&batch.positions))?;
        let no_ranges = Tensor::zeros((1, t, 2), DType::U32, &self.device)?;
        let mut x = self.embed(std::slice::from_ref(&batch.tokens), false)?;
        for (l, layer_kv) in kv.layers.iter().enumerate() {
            let paged = super::paged::PagedLayer { kv: layer_kv, index: &index, layout: &batch.layout };
            x = self.layer(l, &x, &rope, &no_ranges, LayerState::Paged(paged), Mode::plain(false))?;
        }
        if batch.logit_rows.is_empty() {
            return Tensor::zeros((0, self.cfg.vocab_size), DType::F32, &self.device);
        }
        let rows = crate::device::from_host(batch.logit_rows.clone(), batch.logit_rows.len(), &self.device)?;
        let last = x.squeeze(0)?.index_select(&rows, 0)?;
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
    use super::*;
    use crate::model::tiny::TinyShape;
    use crate::model::{random_decoder, Arch};

    fn tiny(arch: Arch, tied: bool, trainable: bool) -> Decoder {
        let mut cfg = TinyShape { layers: 2, hidden: 16, heads: 4, kv_heads: 2, intermediate: 24 }
            .config(arch, 97, None, None)
            .unwrap();
        cfg.tie_word_embeddings = tied;
        cfg.raw["tie_word_embeddings"] = tied.into();
        let mut m = random_decoder(cfg, 3, DType::F32, &Device::Cpu, trainable).unwrap();
        // Larger than the usual 0.02 init so that every path carries a visible gradient.
        // Seeded (not candle's unseeded randn) so that the tests are deterministic.
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        for p in &m.params {
            if let Param::Trainable(v) = p {
                let t = v.as_tensor();
                let noise: Vec<f32> = (0..t.elem_count()).map(|_| rng.gen_range(-0.5f32..0.5)).collect();
                let noise = Tensor::from_vec(noise, t.shape(), t.device()).unwrap();
                v.set(&(t + noise).unwrap()).unwrap();
            }
        }
        m.options.logprob_chunk_bytes = 97 * 4 * 5; // 5 rows per chunk: exercise chunking
        m
    }

    fn batch() -> (TokenBatch, Targets) {
        let seqs = vec![vec![5u32, 17, 3, 88, 41, 9, 60], vec![11, 2, 90, 33]];
        let b = TokenBatch::padded(&seqs, 0);
        let mut t = Targets::default();
        for (r, s) in seqs.iter().enumerate() {
            for p in 1..s.len() {
                t.push(r, p);
            }
        }
        (b, t)
    }

    fn weighted_loss(lp: &Tensor) -> candle_core::Result<Tensor> {
        let n = lp.dim(0)?;
        let w = Tensor::arange(0f32, n as f32, lp.device())?.affine(0.1, 0.5)?.sin()?;
        lp.narrow(1, 0, 1)?.squeeze(1)?.mul(&w)?.sum_all()
    }

    fn values(t: &Tensor) -> Vec<f32> {
        t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
    }

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

    #[test]
    fn every_parameter_gets_a_finite_nonzero_gradient() {
        for (arch, tied) in [(Arch::Qwen2, false), (Arch::Qwen3, false), (Arch::Llama, true), (Arch::Llama, false)] {
            let m = tiny(arch, tied, true);
            let (b, t) = batch();
            let (_, grads) = m.forward_backward(&b, &t, &mut weighted_loss).unwrap();
            for (name, g) in m.names().iter().zip(&grads.grads) {
                let g = g.as_ref().unwrap_or_else(|| panic!("{arch:?}: no gradient for {name}"));
                let v = values(g);
                assert!(v.iter().all(|x| x.is_finite()), "{arch:?}: non-finite gradient for {name}");
                assert!(v.iter().any(|&x| x != 0.0), "{arch:?}: zero gradient for {name}");
            }
        }
    }

    /// Through the default attention (auto: flash on the CPU, with its own backward).
    #[test]
    fn finite_differences_agree_with_autograd() {
        for arch in [Arch::Qwen2, Arch::Qwen3, Arch::Llama] {
            let m = tiny(arch, arch == Arch::Llama, true);
            assert_eq!(m.options.attention, Attention::Auto);
            let (b, t) = batch();
            let (_, grads) = m.forward_backward(&b, &t, &mut weighted_loss).unwrap();
            let eval = |m: &Decoder| -> f64 {
                let lp = m.token_logprobs(&b, &t, false).unwrap();
                weighted_loss(&lp).unwrap().to_scalar::<f32>().unwrap() as f64
            };
            // A few parameters of different kinds: embedding, attention, norm, MLP, q/k norm or bias.
            let picks: Vec<usize> = m
                .names()
                .iter()
                .enumerate()
                .filter(|(_, n)| {
                    n.contains("embed")
                        || n.contains("layers.1.self_attn.k_proj")
                        || n.contains("layers.0.input_layernorm")
                        || n.contains("layers.1.mlp.down_proj")
                        || n.contains("q_norm")
                        || n.ends_with("q_proj.bias")
                })
                .map(|(i, _)| i)
                .collect();
            assert!(picks.len() >= 4, "{arch:?}: {picks:?}");
            for i in picks {
                let Param::Trainable(var) = &m.params[i] else { unreachable!() };
                let what = format!("{arch:?} {}", m.names()[i]);
                largest_gradient_agrees(&m, var, grads.grads[i].as_ref().unwrap(), &eval, &what);
            }
        }
    }

    /// A tiny model (frozen base) with LoRA adapters of rank 3 on `targets`, B made non-zero (seeded) so
    /// that every adapter carries a gradient.
    fn tiny_lora(arch: Arch, targets: &[&str]) -> Decoder {
        use rand::{Rng, SeedableRng};
        let base = tiny(arch, false, true);
        let opts = LoraOptions {
            r: 3,
            alpha: 6.0,
            target_modules: targets.iter().map(|t| t.to_string()).collect(),
            ..Default::default()
        };
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        let adapters = lora::init_adapters(base.config(), &opts, 7, &Device::Cpu)
            .unwrap()
            .into_iter()
            .map(|(n, t)| {
                let noise: Vec<f32> = (0..t.elem_count()).map(|_| rng.gen_range(-0.3f32..0.3)).collect();
                (n, (&t + Tensor::from_vec(noise, t.shape(), &Device::Cpu).unwrap()).unwrap())
            })
            .collect();
        base.with_adapters(&opts, adapters, true).unwrap()
    }

    /// Only the adapters are trainable and get gradients, which agree with finite differences, with and
    /// without layer recomputation (the same values either way).
    #[test]
    fn lora_gradients_agree_with_finite_differences() {
        let all = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"];
        for (arch, targets) in [(Arch::Qwen2, &all[..]), (Arch::Qwen3, &["v_proj", "down_proj"][..])] {
            let mut m = tiny_lora(arch, targets);
            let names = m.trainable_names();
            assert_eq!(names.len(), 2 * 2 * targets.len(), "{names:?}");
            assert!(names.iter().all(|n| n.contains(".lora_")), "{names:?}");
            let (b, t) = batch();
            let (l1, grads) = m.forward_backward(&b, &t, &mut weighted_loss).unwrap();
            m.options.checkpoint_layers = true;
            let (l2, g2) = m.forward_backward(&b, &t, &mut weighted_loss).unwrap();
            assert!((l1 - l2).abs() < 1e-5);
            for (name, (a, c)) in names.iter().zip(grads.grads.iter().zip(&g2.grads)) {
                let (a, c) = (values(a.as_ref().unwrap()), values(c.as_ref().unwrap()));
                let d = crate::kernels::testing::abs_diff(&a, &c);
                assert!(d < 1e-5, "{arch:?} {name}: recomputed gradient differs by {d}");
                assert!(a.iter().any(|&x| x != 0.0), "{arch:?} {name}: zero gradient");
            }
            let eval = |m: &Decoder| -> f64 {
                let lp = m.token_logprobs(&b, &t, false).unwrap();
                weighted_loss(&lp).unwrap().to_scalar::<f32>().unwrap() as f64
            };
            largest_gradients_agree(&m, &grads, eval, &format!("{arch:?}"));
        }
    }

    /// Central differences of `loss` at each trainable variable's largest gradient element agree with
    /// `grads` within 2%.
    fn largest_gradients_agree(m: &Decoder, grads: &Grads, loss: impl Fn(&Decoder) -> f64, what: &str) {
        let names = m.trainable_names();
        for (k, var) in m.vars().into_iter().enumerate() {
            let g = grads.grads[k].as_ref().unwrap();
            largest_gradient_agrees(m, var, g, &loss, &format!("{what} {}", names[k]));
        }
    }

    /// The central difference of `loss` at `var`'s element of largest gradient `g` (a well-conditioned
    /// check) agrees with it within 2%; `var` is put back as it was.
    fn largest_gradient_agrees(m: &Decoder, var: &Var, g: &Tensor, loss: &impl Fn(&Decoder) -> f64, what: &str) {
        let orig = var.as_tensor().copy().unwrap();
        let flat = values(&orig);
        let g = values(g);
        let (j, _) = g.iter().enumerate().max_by(|a, b| a.1.abs().total_cmp(&b.1.abs())).unwrap();
        let eps = 1e-3f32;
        let shifted = |delta: f32| {
            let mut v = flat.clone();
            v[j] += delta;
            var.set(&Tensor::from_vec(v, orig.shape(), &Device::Cpu).unwrap()).unwrap();
            loss(m)
        };
        let fd = (shifted(eps) - shifted(-eps)) / (2.0 * eps as f64);
        var.set(&orig).unwrap();
        let rel = (fd - g[j] as f64).abs() / (g[j].abs() as f64).max(1e-3);
        assert!(rel < 2e-2, "{what}[{j}]: finite difference {fd} vs autograd {}", g[j]);
    }

    /// LoRA's dropout: a training batch's seed draws the mask, the same one in the layers' recomputation
    /// (equal losses and gradients with and without `checkpoint_layers`) and for the same seed, another for
    /// another seed; the gradients are those of the masked loss (finite differences); a batch without a
    /// seed (evaluation, the reference, rollouts) has no dropout.
    #[test]
    fn lora_dropout_is_drawn_from_the_batch_seed_and_recomputed_the_same() {
        let mut m = tiny_lora(Arch::Qwen2, &["q_proj", "v_proj", "up_proj", "down_proj"]);
        let (b, t) = batch();
        let (plain, _) = m.forward_backward(&b, &t, &mut weighted_loss).unwrap();
        m.lora.as_mut().unwrap().dropout = 0.3;
        let seeded = b.clone().with_dropout_seed(42);
        assert_eq!(m.forward_backward(&b, &t, &mut weighted_loss).unwrap().0, plain);
        let inference = weighted_loss(&m.token_logprobs(&seeded, &t, false).unwrap()).unwrap();
        assert_eq!(inference.to_scalar::<f32>().unwrap(), plain);
        let (l1, g1) = m.forward_backward(&seeded, &t, &mut weighted_loss).unwrap();
        assert!((l1 - plain).abs() > 1e-4, "dropout left the loss at {l1}");
        assert_eq!(m.forward_backward(&seeded, &t, &mut weighted_loss).unwrap().0, l1);
        let other = m.forward_backward(&b.clone().with_dropout_seed(43), &t, &mut weighted_loss).unwrap().0;
        assert!((other - l1).abs() > 1e-6, "seeds 42 and 43 drew the same masks");
        m.options.checkpoint_layers = true;
        let (l2, g2) = m.forward_backward(&seeded, &t, &mut weighted_loss).unwrap();
        assert!((l1 - l2).abs() < 1e-5, "{l1} vs recomputed {l2}");
        for (a, c) in g1.grads.iter().zip(&g2.grads) {
            let (a, c) = (values(a.as_ref().unwrap()), values(c.as_ref().unwrap()));
            let d = crate::kernels::testing::abs_diff(&a, &c);
            assert!(d < 1e-5, "recomputed gradient differs by {d}");
        }
        let masked = |m: &Decoder| m.forward_backward(&seeded, &t, &mut weighted_loss).unwrap().0 as f64;
        largest_gradients_agree(&m, &g1, masked, "dropout");
    }

    /// Fresh adapters (B = 0) give the base model's log-probs exactly; the base model without the adapters
    /// shares the weights; merging the adapters into the weights gives the adapter model's log-probs.
    #[test]
    fn lora_starts_at_the_base_model_and_merges_into_it() {
        let base = tiny(Arch::Qwen2, false, false);
        let (b, t) = batch();
        let want = values(&base.token_logprobs(&b, &t, false).unwrap());
        let opts = LoraOptions { r: 2, ..Default::default() };
        let fresh = lora::init_adapters(base.config(), &opts, 1, &Device::Cpu).unwrap();
        let m = base.frozen_copy().unwrap().with_adapters(&opts, fresh, true).unwrap();
        assert_eq!(values(&m.token_logprobs(&b, &t, false).unwrap()), want);
        let m = tiny_lora(Arch::Qwen2, &["q_proj", "o_proj", "up_proj"]);
        let off = m.without_adapters();
        assert!(off.vars().is_empty() && off.names().len() == off.params().len());
        let w = |d: &Decoder| d.named_tensors()[1].1.clone();
        assert_eq!(values(&w(&off)), values(&w(&m)));
        let adapted = values(&m.token_logprobs(&b, &t, false).unwrap());
        assert_ne!(adapted, values(&off.token_logprobs(&b, &t, false).unwrap()));
        let merged = values(&m.merged().unwrap().token_logprobs(&b, &t, false).unwrap());
        let d = crate::kernels::testing::abs_diff(&adapted, &merged);
        assert!(d < 1e-5, "merged log-probs differ by {d}");
        // A frozen copy (the reference swap, the snapshot) computes the same, sharing the base weights.
        let copy = m.frozen_copy().unwrap();
        assert_eq!(values(&copy.token_logprobs(&b, &t, false).unwrap()), adapted);
        assert!(copy.vars().is_empty());
    }

    /// The recomputed layers' backward (the layer's output not formed, the residual's gradient added by hand)
    /// gives the whole graph's gradients bit for bit: a Llama MLP with biases, Qwen3's, and LoRA with the
    /// down projection frozen (no adapter) and adapted.
    #[test]
    fn recomputed_layers_give_the_whole_graphs_gradients_bit_for_bit() {
        let mut llama = tiny(Arch::Llama, false, true);
        llama.cfg.mlp_bias = true;
        let mut biased = random_decoder(llama.cfg.clone(), 3, DType::F32, &Device::Cpu, true).unwrap();
        biased.options = llama.options.clone();
        assert!(biased.trainable_names().iter().any(|n| n.ends_with("mlp.down_proj.bias")));
        let models = [
            biased,
            tiny(Arch::Qwen3, false, true),
            tiny_lora(Arch::Qwen2, &["q_proj", "up_proj"]),
            tiny_lora(Arch::Qwen2, &["v_proj", "down_proj"]),
        ];
        let (b, t) = batch();
        for (k, mut m) in models.into_iter().enumerate() {
            m.options.checkpoint_layers = false;
            let (l1, g1) = m.forward_backward(&b, &t, &mut weighted_loss).unwrap();
            m.options.checkpoint_layers = true;
            let (l2, g2) = m.forward_backward(&b, &t, &mut weighted_loss).unwrap();
            assert_eq!(l1, l2, "model {k}");
            for (name, (a, c)) in m.trainable_names().iter().zip(g1.grads.iter().zip(&g2.grads)) {
                let (a, c) = (values(a.as_ref().unwrap()), values(c.as_ref().unwrap()));
                assert!(a.iter().any(|&x| x != 0.0), "model {k} {name}: zero gradient");
                assert_eq!(a, c, "model {k} {name}");
            }
        }
    }

    #[test]
    fn layer_recomputation_gives_the_same_gradients() {
        let mut m = tiny(Arch::Qwen3, false, true);
        let (b, t) = batch();
        let (l1, g1) = m.forward_backward(&b, &t, &mut weighted_loss).unwrap();
        m.options.checkpoint_layers = true;
        let (l2, g2) = m.forward_backward(&b, &t, &mut weighted_loss).unwrap();
        assert!((l1 - l2).abs() < 1e-5);
        for (name, (a, b)) in m.names().iter().zip(g1.grads.iter().zip(&g2.grads)) {
            let (a, b) = (values(a.as_ref().unwrap()), values(b.as_ref().unwrap()));
            let d = crate::kernels::testing::abs_diff(&a, &b);
            assert!(d < 1e-5, "{name}: recomputed gradient differs by {d}");
        }
        // The attention's forward kept rather than recomputed: the same arithmetic, the same gradients.
        m.options.recompute_attention = false;
        let (l3, g3) = m.forward_backward(&b, &t, &mut weighted_loss).unwrap();
        assert_eq!(l2, l3);
        for (name, (a, b)) in m.names().iter().zip(g2.grads.iter().zip(&g3.grads)) {
            assert_eq!(values(a.as_ref().unwrap()), values(b.as_ref().unwrap()), "{name}");
        }
    }

    /// The fused kernels and their composite references give the same loss and gradients, padded and
    /// packed, with q/k norms (Qwen3) and without (Llama).
    #[test]
    fn fused_ops_match_their_composite_references() {
        for arch in [Arch::Qwen3, Arch::Llama] {
            let mut m = tiny(arch, false, true);
            let (b, t) = batch();
            let packed = TokenBatch::packed(&[vec![vec![5, 17, 3], vec![88, 41, 9, 60]]], 0);
            let mut pt = Targets::default();
            for p in [1, 2, 4, 5, 6] {
                pt.push(0, p);
            }
            for (batch, targets) in [(&b, &t), (&packed, &pt)] {
                m.options.fused_ops = true;
                let (l1, g1) = m.forward_backward(batch, targets, &mut weighted_loss).unwrap();
                m.options.fused_ops = false;
                let (l2, g2) = m.forward_backward(batch, targets, &mut weighted_loss).unwrap();
                assert!((l1 - l2).abs() < 1e-5, "{arch:?}: loss {l1} vs {l2}");
                for (name, (a, b)) in m.names().iter().zip(g1.grads.iter().zip(&g2.grads)) {
                    let (a, b) = (values(a.as_ref().unwrap()), values(b.as_ref().unwrap()));
                    let d = crate::kernels::testing::abs_diff(&a, &b);
                    // f32 sums in different orders (the embedding gradient's per-token sums, the
                    // attention's GEMM blocking): a few units in the fifth decimal.
                    assert!(d < 5e-5, "{arch:?} {name}: fused gradient differs by {d}");
                }
            }
        }
    }

    /// Two micro-batches added into one set of gradients: with `fused_ops` the projections' and the
    /// lm_head's weight gradients go straight into the f32 accumulators (made before the first forward),
    /// and the sums equal the composite path's two gradients added, tied embeddings (the lm_head's and the
    /// embedding's gradients in one accumulator) and layer recomputation included.
    #[test]
    fn micro_batches_accumulate_into_the_same_gradients_as_the_composite() {
        let (b, t) = batch();
        let packed = TokenBatch::packed(&[vec![vec![5, 17, 3], vec![88, 41, 9, 60]]], 0);
        let mut pt = Targets::default();
        for p in [1, 2, 4, 5, 6] {
            pt.push(0, p);
        }
        for (arch, tied, checkpoint) in
            [(Arch::Qwen2, true, false), (Arch::Llama, false, true), (Arch::Qwen3, true, true)]
        {
            let mut m = tiny(arch, tied, true);
            m.options.checkpoint_layers = checkpoint;
            m.options.fused_ops = false;
            let (_, g1) = m.forward_backward(&b, &t, &mut weighted_loss).unwrap();
            let (_, g2) = m.forward_backward(&packed, &pt, &mut weighted_loss).unwrap();
            m.options.fused_ops = true;
            let mut fused = m.new_grads();
            m.forward_backward_into(&b, &t, &mut weighted_loss, &mut fused).unwrap();
            m.forward_backward_into(&packed, &pt, &mut weighted_loss, &mut fused).unwrap();
            for (i, name) in m.names().iter().enumerate() {
                let want = (g1.grads[i].as_ref().unwrap() + g2.grads[i].as_ref().unwrap()).unwrap();
                let got = fused.grads[i].as_ref().unwrap();
                let (a, w) = (values(got), values(&want));
                let d = crate::kernels::testing::abs_diff(&a, &w);
                assert!(d < 5e-5, "{arch:?} tied {tied} checkpoint {checkpoint} {name}: differs by {d}");
            }
        }
    }

    /// Keeping the head's logits for the backward changes no gradient: bit for bit the recomputed ones,
    /// over several log-prob chunks, with and without layer recomputation.
    #[test]
    fn kept_logits_give_the_same_gradients_bit_for_bit() {
        let (b, t) = batch();
        for checkpoint in [false, true] {
            let mut m = tiny(Arch::Qwen2, true, true);
            m.options.checkpoint_layers = checkpoint;
            m.options.logprob_chunk_bytes = 97 * 4 * 3; // 3 rows a chunk
            let (l1, g1) = m.forward_backward(&b, &t, &mut weighted_loss).unwrap();
            m.options.keep_logits = true;
            let (l2, g2) = m.forward_backward(&b, &t, &mut weighted_loss).unwrap();
            assert_eq!(l1, l2);
            for (name, (a, k)) in m.names().iter().zip(g1.grads.iter().zip(&g2.grads)) {
                assert_eq!(values(a.as_ref().unwrap()), values(k.as_ref().unwrap()), "checkpoint {checkpoint} {name}");
            }
        }
    }

    /// Flash attention and the score-matrix path give the same loss and gradients, padded and packed,
    /// with and without layer recomputation.
    #[test]
    fn flash_and_matrix_attention_give_the_same_gradients() {
        for arch in [Arch::Qwen3, Arch::Llama] {
            let mut m = tiny(arch, false, true);
            let (b, t) = batch();
            let packed = TokenBatch::packed(&[vec![vec![5, 17, 3], vec![88, 41, 9, 60]], vec![vec![7, 8]]], 0);
            let mut pt = Targets::default();
            for (r, p) in [(0, 1), (0, 2), (0, 4), (0, 5), (0, 6), (1, 1)] {
                pt.push(r, p);
            }
            for (batch, targets) in [(&b, &t), (&packed, &pt)] {
                for (checkpoint, recompute_attention) in [(false, true), (true, true), (true, false)] {
                    m.options.checkpoint_layers = checkpoint;
                    m.options.recompute_attention = recompute_attention;
                    m.options.attention = Attention::Flash;
                    let (l1, g1) = m.forward_backward(batch, targets, &mut weighted_loss).unwrap();
                    m.options.attention = Attention::Matrix;
                    let (l2, g2) = m.forward_backward(batch, targets, &mut weighted_loss).unwrap();
                    assert!((l1 - l2).abs() < 1e-5, "{arch:?}: loss {l1} vs {l2}");
                    for (name, (a, b)) in m.names().iter().zip(g1.grads.iter().zip(&g2.grads)) {
                        let (a, b) = (values(a.as_ref().unwrap()), values(b.as_ref().unwrap()));
                        let d = crate::kernels::testing::abs_diff(&a, &b);
                        let size = b.iter().map(|x| x.abs()).fold(1f32, f32::max);
                        assert!(d < 1e-5 * size, "{arch:?} {name}: flash gradient differs by {d} (of {size})");
                    }
                }
            }
        }
    }

    #[test]
    fn padding_and_packing_do_not_change_logprobs() {
        let m = tiny(Arch::Qwen2, false, false);
        let a = vec![5u32, 17, 3, 88, 41, 9, 60];
        let b = vec![11u32, 2, 90, 33];
        let single = |s: &Vec<u32>| {
            let batch = TokenBatch::padded(std::slice::from_ref(s), 0);
            let mut t = Targets::default();
            (1..s.len()).for_each(|p| t.push(0, p));
            values(&m.token_logprobs(&batch, &t, false).unwrap().narrow(1, 0, 1).unwrap())
        };
        let (la, lb) = (single(&a), single(&b));
        let (pb, pt) = batch();
        let padded = values(&m.token_logprobs(&pb, &pt, false).unwrap().narrow(1, 0, 1).unwrap());
        let packed_batch = TokenBatch::packed(&[vec![a.clone(), b.clone()]], 0);
        let mut t = Targets::default();
        (1..a.len()).for_each(|p| t.push(0, p));
        (a.len() + 1..a.len() + b.len()).for_each(|p| t.push(0, p));
        let packed = values(&m.token_logprobs(&packed_batch, &t, false).unwrap().narrow(1, 0, 1).unwrap());
        let want: Vec<f32> = la.iter().chain(&lb).copied().collect();
        for got in [padded, packed] {
            let d = crate::kernels::testing::abs_diff(&want, &got);
            assert!(d < 1e-5, "differs by {d}");
        }
    }

    /// The device-built tables give the values of the host formula they replace, bit for bit, and are
    /// built once for the longest position seen.
    #[test]
    fn rope_tables_match_the_host_formula_and_are_built_once() {
        let m = tiny(Arch::Qwen2, false, false);
        let positions = vec![vec![0u32, 1, 2, 300], vec![5, 6, 7, 8]];
        let (cos, sin) = m.rope(&positions).unwrap();
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
        let table = |m: &Decoder| m.rope_tables.0.lock().unwrap().as_ref().unwrap().0.clone();
        let first = table(&m);
        assert_eq!(first.dim(0).unwrap(), 512);
        m.rope(&[vec![3, 4]]).unwrap();
        assert_eq!(table(&m).id(), first.id());
        m.rope(&[vec![600]]).unwrap();
        assert_eq!(table(&m).dim(0).unwrap(), 1024);
    }

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
