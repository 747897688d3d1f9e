//! A performance model of a training step, checkable without a GPU: for a model shape and a step's
//! batch, the work of every op of the step counted from its own arithmetic — FLOPs on tensor cores
//! (GEMMs) and element-wise, bytes to and from device memory, kernel launches and host syncs — and the
//! time it predicts on an H100 SXM and an A100 80GB.
//!
//! ## What is counted
//! A step is `answers` sequences of T tokens (prompt + answer, the longest the data allows: the plan's
//! micro-batch shape, an upper bound), in micro-batches of B, N = B T tokens each, n = B x answer tokens
//! of them scored. Per micro-batch and per layer, in the order `Decoder::layer` runs them:
//! - GEMMs (2 m k n FLOPs; bytes: both operands read, the product written, d bytes per element): the q,
//!   k, v and o projections and the MLP's gate, up and down. Their backward is two GEMMs of the same
//!   size (input gradient and weight gradient): twice the FLOPs, launches and bytes.
//! - attention, as chunked flash-style attention whose block products are cuBLAS GEMMs: query blocks of
//!   `q_block` rows against key blocks of `k_block` keys, batched over the micro-batch's sequences and
//!   heads (GQA reads the shared K/V, no copy), causal blocks above the diagonal skipped, a diagonal
//!   block computed whole and masked. Forward: per block pair 2 GEMMs (S = Q K^T, then P V) and 2
//!   element-wise kernels (the online softmax update: mask, row max, exp, row sum, rescale; and the
//!   accumulation of P V), plus one per query block (the final 1/l and log-sum-exp). Backward with
//!   recomputation: per block pair 5 GEMMs (S again, dP = dO V^T, dV += P^T dO, dQ += dS K,
//!   dK += dS^T Q) and 2 element-wise kernels (P from S and the log-sum-exp; dS = P (dP - D)), plus one
//!   per query block (D = rowsum(dO O)). FLOPs: 4 hd per computed score forward, 10 hd backward, so the
//!   causal half of 4 T^2 hd heads forward and 2.5x that backward. Bytes: the block products leave the
//!   GEMM through device memory — S and dP in f32 (4 B per score), P and dS in d bytes — which is what
//!   makes this design memory-bound (see docs/performance.md): about 8 + 2d bytes per
//!   score forward and 16 + 4d backward, against 4 hd and 10 hd FLOPs.
//! - element-wise ops (memory-bound; each reads its inputs and writes its output once): the two RMSNorms,
//!   the q/k/v biases, rope on q and k, the head transposes in and out of attention, the two residual
//!   adds, silu(gate) and its product with up; their backward twice the bytes and launches; with
//!   `checkpoint_layers` the layer's backward also forms (y g) and its sum.
//! - the log-prob head on the n scored tokens: per chunk of `logprob_chunk_bytes / (4 V)` rows, the
//!   lm_head GEMM (2 n h V forward; backward, the logits recomputed and two gradient GEMMs), the fused log-softmax / entropy kernel reading the
//!   logits twice (forward, backward), and the lm_head gradient of each chunk added to its f32
//!   accumulator (in place: 10 V h bytes per chunk, the product read and the accumulator read and written;
//!   the H100 run's build cast it to f32 and summed into a new buffer, 16 V h).
//! - gradient accumulation: every parameter's gradient added into the f32 accumulator once per
//!   micro-batch (read d + 4 B, write 4 B per parameter).
//! - with `checkpoint_layers`, one more forward of every layer (recomputation) per micro-batch; without a
//!   cached reference, one forward of the reference model (layers and head, no backward).
//! - host syncs: one per step, the step's statistics (loss, policy part, KL, entropy, clipped tokens, the
//!   ratio's sum and extremes) read with the gradients' sums of squares (the norm and the bad-step check)
//!   in one transfer; the measured H100 builds also read each micro-batch's loss.
//! - the AdamW update once per step: on the device 34 B per parameter (master, m, v read and written,
//!   the f32 gradient read and zeroed, the d-byte weights written); with `optim.offload` the f32
//!   gradients go to the host and the new weights come back over PCIe, and the update runs at host
//!   memory bandwidth; the copies of the neighbouring chunks overlap a chunk's update (src/train/
//!   offload.rs), so all but one chunk's copies are hidden behind the update or the update behind them.
//!
//! ## From counts to time
//! Each op's time is its roofline: the largest of its FLOPs at the device's peak times the efficiency of
//! its kind, its bytes at the memory bandwidth times the memory efficiency, and its launches times the
//! host's launch cost (launches are issued asynchronously, so they only cost time when the kernels are
//! shorter than the launch itself); plus its host syncs times the sync cost. The step's time is the sum
//! over its ops. MFU is the model FLOPs (3 x the policy's forward: its forward and backward without
//! recomputation, causal attention counted as its lower triangle) over the step's time at the peak.
//!
//! Not modelled: validation and rollouts (generation), the data loader, the L2 cache (every block product
//! is counted at device memory; a blocking whose working set stays in L2 would move less), and the
//! overlap of communication with compute across ranks.

use crate::model::ModelConfig;

pub use super::calibration::{gpus, h100, Build, Calibration, Gpu, KernelRates, RateAt, TensorOps, TENSOR_OPS};

/// The block sizes of chunked attention: query rows and keys per block product.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionBlocks {
    pub query: u64,
    pub key: u64,
}

/// The candidate block sizes [`best_blocks`] chooses from (square blocks: the backward walks the same
/// pairs by key block).
const BLOCK_CANDIDATES: [u64; 6] = [64, 128, 256, 512, 1024, 2048];

/// What kind of work an op is, for its efficiency.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpKind {
    /// A dense GEMM of the projections or the lm_head (tensor cores).
    Gemm,
    /// The block products of attention (tensor cores, small inner dimension: the head's).
    AttentionGemm,
    /// The tensor-core attention kernels (kernels/flash_mma.cu): block products and softmax on chip; the
    /// forward's and the backward's.
    AttentionMmaForward,
    AttentionMma,
    /// The warpgroup tensor-core attention kernels (kernels/flash_wgmma.cu, compute capability 9.0): the
    /// backward's.
    AttentionWgmma,
    /// The warpgroup kernels' forward, whose two warpgroups take turns (ping-pong) and pipeline the
    /// softmax with the products.
    AttentionWgmmaForward,
    /// The warpgroup kernels' backward with dq summed by atomics in the dk/dv kernel.
    AttentionWgmmaAtomic,
    /// Element-wise and reductions, memory-bound.
    Elementwise,
    /// The optimiser update in host memory (`optim.offload`): PCIe transfers and host memory bandwidth.
    Host,
}

impl OpKind {
    /// The tensor-core attention kernels (their time is their useful FLOPs at a measured rate).
    pub fn tensor_core_attention(self) -> bool {
        use OpKind::*;
        matches!(
            self,
            AttentionMmaForward | AttentionMma | AttentionWgmmaForward | AttentionWgmma | AttentionWgmmaAtomic
        )
    }
}

/// The work of one op over a whole step.
#[derive(Debug, Clone, PartialEq)]
pub struct OpCost {
    pub name: &'static str,
    pub kind: OpKind,
    pub flops: f64,
    /// Bytes read from and written to device memory (for [`OpKind::Host`]: bytes over PCIe).
    pub bytes: f64,
    /// Bytes read and written in host memory ([`OpKind::Host`] only), at `host_rate` bytes a second (the
    /// offloaded update's: fused or composite).
    pub host_bytes: f64,
    pub host_rate: f64,
    /// Ops the host issues for it: kernel launches, and for candle's element-wise work every tensor op
    /// (see [`TensorOps`]).
    pub launches: f64,
    pub syncs: f64,
    /// Part of the attention (its GEMMs and the element-wise steps between them).
    pub attention: bool,
    /// The tensor-core attention kernels: the causal attention's useful FLOPs (4 per query-key pair and
    /// head dim forward, 10 backward), which their measured rates are quoted in.
    pub useful_flops: f64,
    /// Tokens per sequence and head dim (the attention kernels' rates depend on them).
    pub seq_tokens: u64,
    pub head_dim: u64,
    /// A GEMM's product, rows by columns (its tiles fill the GPU's multiprocessors in waves:
    /// [`tile_utilization`]); 0 for other ops.
    pub product: (f64, f64),
    pub window: Window,
    /// An element-wise kernel that moves 16 bytes a thread and access (at [`Gpu::packed_memory_efficiency`];
    /// the others at [`Gpu::memory_efficiency`]).
    pub packed: bool,
}

/// The stretch of the step an op runs in. Within one, the host issues ops while the device runs those
/// issued before (kernel launches are asynchronous), so a window lasts the longer of the host's time and
/// the device's; a host sync (the step's one read, of its statistics and the gradient norm; in the
/// measured H100 builds also each micro-batch's loss) ends the overlap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Window {
    /// The frozen reference model's forward (no gradient).
    Reference,
    /// The policy's forward, with the log-prob head.
    Forward,
    /// The log-prob head's backward, the layers' backward (and their recomputation), the embedding's
    /// gradient and the gradients' accumulation.
    Backward,
    /// The gradient norm and the optimiser update.
    Update,
}

impl Window {
    fn name(self) -> &'static str {
        match self {
            Window::Reference => "reference",
            Window::Forward => "forward",
            Window::Backward => "backward",
            Window::Update => "update",
        }
    }
}

/// The head dim [`KernelRates`] are measured at (and [`Gpu::wgmma_d64`] at 64).
pub const RATES_HEAD_DIM: f64 = 128.0;

/// Rows and columns of the output tile a cuBLAS GEMM gives each thread block (the fit of
/// [`Gpu::gemm_efficiency`] took 128 x 128; 128 x 256 and 256 x 128 fit worse).
const GEMM_TILE: f64 = 128.0;

/// The share of `gpu`'s multiprocessors a GEMM with an `m` x `n` product keeps busy: its output tiles
/// ([`GEMM_TILE`] square) run in waves of one tile per multiprocessor, the last wave part-full (the 0.5B
/// shape's k and v projections over 4,096 tokens: 32 tiles on 132 multiprocessors, 0.24).
fn tile_utilization(m: f64, n: f64, gpu: &Gpu) -> f64 {
    let tiles = (m / GEMM_TILE).ceil().max(1.0) * (n / GEMM_TILE).ceil().max(1.0);
    let sms = gpu.multiprocessors as f64;
    tiles / ((tiles / sms).ceil() * sms)
}

/// The FLOP/s `gpu` gives a GEMM with an `m` x `n` product: its GEMM efficiency of the peak while the
/// tiles run, times their [`tile_utilization`].
pub fn gemm_flops_per_s(m: f64, n: f64, gpu: &Gpu) -> f64 {
    gpu.peak_flops * gpu.gemm_efficiency * tile_utilization(m, n, gpu)
}

/// Fraction of the link bandwidth NCCL's ring collectives reach (bus bandwidth / link bandwidth).
pub const COLLECTIVE_EFFICIENCY: f64 = 0.8;

/// The batch of one training step, as the model needs it.
#[derive(Debug, Clone, Copy)]
pub struct StepShape {
    /// Sequences in the step.
    pub answers: u64,
    /// Sequences per forward/backward.
    pub micro_batch: u64,
    /// Tokens per sequence (prompt + answer).
    pub seq_tokens: u64,
    /// Scored (answer) tokens per sequence.
    pub scored_tokens: u64,
    /// Bytes per weight/activation element.
    pub dtype_bytes: u64,
    pub checkpoint_layers: bool,
    /// With `checkpoint_layers`, the recomputation runs the attention's forward again (`false`: its output
    /// was kept, and is copied instead).
    pub recompute_attention: bool,
    /// A reference model's forward per micro-batch (its log-probs are not cached).
    pub reference_forward: bool,
    pub offload: bool,
    /// The build predicted: this one, or one whose steps an H100 run measured, to predict that run's
    /// records as they ran (its tensor ops, attention kernels' rates and offloaded update).
    pub build: Build,
    pub logprob_chunk_bytes: u64,
    /// Ranks sharing the optimiser state (ZeRO-1): the update and the gradient norm run on 1/N of it.
    pub optimizer_shards: u64,
    pub blocks: AttentionBlocks,
    /// Attention runs on the tensor-core kernels (`model.attention = "mma"` where they apply) rather than
    /// as chunked GEMMs in `blocks`.
    pub tensor_cores: bool,
    /// With `tensor_cores`, the backward sums dq by atomics in the dk/dv kernel
    /// (`model.deterministic_attention = false`) rather than in a dq kernel.
    pub atomic_dq: bool,
    /// With `tensor_cores`, the warpgroup kernels (`model.attention = "wgmma"`) on the GPUs that have
    /// wgmma ([`Gpu::wgmma_attention_efficiency`]).
    pub warpgroup: bool,
    /// LoRA's rank (`[model.lora]`, adapters on every projection), 0 for full fine-tuning: the base
    /// projections' backward computes the input's gradient only, the lm_head gets none, the adapters' f32
    /// products are added, and the gradients and update are the adapters'.
    pub lora_rank: u64,
    /// The log-prob head's logits kept from the forward for its backward (`model.keep_logits`): no
    /// recomputed logits GEMM.
    pub keep_logits: bool,
}

/// Which tensor-core attention kernels a step runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TensorCoreKernels {
    /// kernels/flash_mma.cu; `true`: dq summed by atomics.
    Mma(bool),
    /// kernels/flash_wgmma.cu; `true`: dq summed by atomics.
    Wgmma(bool),
}

impl StepShape {
    /// The attention's blocks, and the tensor-core kernels it runs on `gpu`, if any.
    fn attention_kernels(&self, gpu: &Gpu) -> (AttentionBlocks, Option<TensorCoreKernels>) {
        let kernels = match self.warpgroup && gpu.wgmma.is_some() {
            true => TensorCoreKernels::Wgmma(self.atomic_dq),
            false => TensorCoreKernels::Mma(self.atomic_dq),
        };
        (self.blocks, self.tensor_cores.then_some(kernels))
    }

    fn micro_batches(&self) -> f64 {
        self.answers.div_ceil(self.micro_batch.max(1)) as f64
    }

    /// Tokens the step trains on.
    pub fn tokens(&self) -> f64 {
        self.answers as f64 * self.seq_tokens as f64
    }
}

/// The score elements the blocked causal attention computes for one sequence and one head: every
/// query block against the key blocks up to (and including) the one holding its last row.
fn computed_scores(t: u64, blocks: AttentionBlocks) -> (f64, f64) {
    let (bq, bk) = (blocks.query.max(1), blocks.key.max(1));
    let (mut scores, mut pairs) = (0f64, 0f64);
    let mut start = 0;
    while start < t {
        let rows = bq.min(t - start);
        let keys = ((start + rows).div_ceil(bk) * bk).min(t);
        scores += rows as f64 * keys as f64;
        pairs += (start + rows).div_ceil(bk) as f64;
        start += rows;
    }
    (scores, pairs)
}

/// The query-key pairs of causal attention over `t` tokens, T (T + 1) / 2: the useful work per head dim.
fn causal_pairs(t: u64) -> f64 {
    t as f64 * (t as f64 + 1.0) / 2.0
}

/// A collector of op costs, each multiplied by how many times it runs in the step.
struct Ops {
    ops: Vec<OpCost>,
    times: f64,
    window: Window,
    /// The tensor ops of the build predicted.
    counts: TensorOps,
    /// The build's own element-wise kernels move 16-byte packs ([`Build::packed_kernels`]).
    packed: bool,
}

impl Ops {
    fn push(&mut self, name: &'static str, kind: OpKind, flops: f64, bytes: f64, launches: f64) {
        let t = self.times;
        let attention = kind == OpKind::AttentionGemm || kind.tensor_core_attention() || name.starts_with("attention");
        let (flops, bytes, launches) = (flops * t, bytes * t, launches * t);
        let window = self.window;
        let (useful_flops, seq_tokens, head_dim) = (0.0, 0, 0);
        let op = OpCost {
            name,
            kind,
            flops,
            bytes,
            host_bytes: 0.0,
            host_rate: f64::INFINITY,
            launches,
            syncs: 0.0,
            attention,
            useful_flops,
            seq_tokens,
            head_dim,
            product: (0.0, 0.0),
            window,
            packed: false,
        };
        self.ops.push(op);
    }

    /// An element-wise op: `bytes` read and written, `launches` tensor ops, `packed` ([`OpCost::packed`]).
    fn elementwise(&mut self, name: &'static str, bytes: f64, launches: f64, packed: bool) {
        self.push(name, OpKind::Elementwise, 0.0, bytes, launches);
        self.ops.last_mut().expect("just pushed").packed = packed;
    }

    /// A tensor-core attention kernel's op: `useful` FLOPs of causal attention over `t` tokens.
    /// `work` is (FLOPs computed, useful FLOPs), `io` (device bytes, launches), `at` (tokens, head dim).
    fn attention_kernel(&mut self, name: &'static str, kind: OpKind, work: (f64, f64), io: (f64, f64), at: (u64, u64)) {
        self.push(name, kind, work.0, io.0, io.1);
        let op = self.ops.last_mut().expect("just pushed");
        op.useful_flops = work.1 * self.times;
        (op.seq_tokens, op.head_dim) = at;
    }

    /// A GEMM of [m, k] x [k, n], d-byte operands and product, `count` of them.
    fn gemm(&mut self, name: &'static str, m: f64, k: f64, n: f64, d: f64, count: f64) {
        self.push(name, OpKind::Gemm, 2.0 * m * k * n * count, (m * k + k * n + m * n) * d * count, count);
        self.ops.last_mut().expect("just pushed").product = (m, n);
    }

    /// The backward of a GEMM: the input's gradient and the weight's, each the forward's size, their tiles
    /// counted on the forward's product `[m, n]` (an approximation: theirs are `[m, k]` and `[n, k]`).
    fn gemm_backward(&mut self, name: &'static str, m: f64, k: f64, n: f64, d: f64, count: f64) {
        self.gemm(name, m, k, n, d, 2.0 * count);
    }

    /// The backward of a product with a trained weight (`[k, n]`): the input's gradient, and the weight's
    /// as in [`Ops::gemm_backward`] (its product in the weight's dtype, which "gradient accumulation
    /// (f32)" then adds into the accumulator) or, with `fused_wgrad`, a GEMM whose f32 output is the
    /// accumulator itself, read and written (8 bytes an element where the product wrote `d`).
    fn weight_backward(&mut self, name: &'static str, m: f64, k: f64, n: f64, d: f64, count: f64) {
        if !self.counts.fused_wgrad {
            return self.gemm_backward(name, m, k, n, d, count);
        }
        self.gemm(name, m, k, n, d, count);
        self.push(name, OpKind::Gemm, 2.0 * m * k * n * count, ((m * k + m * n) * d + 8.0 * k * n) * count, count);
        self.ops.last_mut().expect("just pushed").product = (m, n);
    }
}

/// Which pass over the layers an op belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pass {
    /// The frozen reference's forward, without a graph.
    Reference,
    /// The policy's forward, recording its graph.
    Policy,
    /// The layers' forward again in the backward (`checkpoint_layers`).
    Recompute,
    Backward,
}

/// The tensor ops of the build `s` is predicted for.
fn counts(s: &StepShape) -> TensorOps {
    s.build.tensor_ops
}

/// The tensors candle makes in a step of `m` on `s` by [`TENSOR_OPS`]: what `grpo bench train-step`
/// counts on the CPU (`tensor_ops_per_step`).
pub fn tensor_ops_per_step(m: &ModelConfig, s: &StepShape) -> f64 {
    let t = counts(s);
    let layers = m.num_layers as f64;
    let tensors = parameter_tensors(m);
    let (_, added, first) = accumulated(m, s, (0.0, tensors));
    let mut per_micro_batch = layers * (t.layer_policy + t.layer_backward) + t.micro_batch;
    per_micro_batch += added * t.accumulate_per_tensor;
    if s.reference_forward {
        per_micro_batch += layers * t.layer_reference + t.micro_batch_reference;
    }
    if s.checkpoint_layers {
        per_micro_batch += layers * t.layer_recompute;
    }
    let per_step = t.step + first * t.accumulate_first_per_tensor + tensors * (t.norm_per_tensor + t.update_per_tensor);
    s.micro_batches() * per_micro_batch + per_step
}

/// The projections and element-wise ops of one layer in `pass` on N tokens.
fn layer_dense(o: &mut Ops, m: &ModelConfig, (n_tokens, d, lora_rank): (f64, f64, u64), pass: Pass) {
    let backward = pass == Pass::Backward;
    let f = |x: usize| x as f64;
    let (h, i) = (f(m.hidden_size), f(m.intermediate_size));
    let q = f(m.num_heads) * f(m.head_dim);
    let kv = f(m.num_kv_heads) * f(m.head_dim);
    // LoRA: the frozen projections' backward is the input's gradient only.
    let gemm = if backward && lora_rank == 0 { Ops::weight_backward } else { Ops::gemm };
    gemm(o, "q, k, v projections", n_tokens, h, q, d, 1.0);
    gemm(o, "q, k, v projections", n_tokens, h, kv, d, 2.0);
    gemm(o, "o projection", n_tokens, q, h, d, 1.0);
    gemm(o, "MLP gate and up", n_tokens, h, i, d, 2.0);
    gemm(o, "MLP down", n_tokens, i, h, d, 1.0);
    if lora_rank > 0 && pass != Pass::Reference {
        // x A^T then (x A) B^T of every projection, in f32, and their backward (both gradients); the
        // reference is the base model (adapters off).
        let r = lora_rank as f64;
        let gemm = if backward { Ops::gemm_backward } else { Ops::gemm };
        for (k, n) in [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)] {
            gemm(o, "LoRA adapters", n_tokens, k, r, 4.0, 1.0);
            gemm(o, "LoRA adapters", n_tokens, r, n, 4.0, 1.0);
            // kernels/lora.cu: forward, the input to f32 (masked) and the sum with the base output;
            // backward, the scaled output gradient, the input again, and the input's gradient's sum.
            // In 16-byte packs in this build.
            let (bytes, launches) = match backward {
                false => ((d + 4.0) * k + (2.0 * d + 4.0) * n, 2.0),
                true => ((d + 4.0) * n + (d + 4.0) * k + (2.0 * d + 4.0) * k, 3.0),
            };
            o.elementwise("LoRA element-wise", bytes * n_tokens, launches, o.packed);
        }
    }
    layer_elementwise(o, m, (n_tokens, d), pass);
}

/// A named element-wise op of a layer: elements read and written per token forward and backward, tensor
/// ops forward, and whether it runs packed ([`OpCost::packed`]).
struct Named {
    forward: f64,
    backward: f64,
    launches: f64,
    packed: bool,
}

/// The element-wise ops of one layer's pass of `n_tokens` tokens of `d` bytes: its named ops' bytes (each
/// reading its inputs and writing its output once), issued as the pass's counted tensor ops.
fn layer_elementwise(o: &mut Ops, m: &ModelConfig, (n_tokens, d): (f64, f64), pass: Pass) {
    let backward = pass == Pass::Backward;
    let f = |x: usize| x as f64;
    let (h, i) = (f(m.hidden_size), f(m.intermediate_size));
    let q = f(m.num_heads) * f(m.head_dim);
    let kv = f(m.num_kv_heads) * f(m.head_dim);
    // This build's kernels move 16-byte packs (kernels/common.cuh); the builds the H100 runs measured did
    // not. candle's add of two contiguous bf16 tensors always did.
    let ours = o.packed;
    let named = |forward, backward, launches, packed| Named { forward, backward, launches, packed };
    let mut ew = vec![
        // Two RMSNorms: read x, write y; backward read x and g, write dx (the weight's partials aside).
        named(4.0 * h, 6.0 * h, 2.0, ours),
        // Rope on q and k, with their transpose to heads, each way.
        named(2.0 * (q + kv), 2.0 * (q + kv), 2.0, ours),
        // v to heads and the attention's output back, each way (kernels::to_heads, from_heads; candle's
        // strided copies in the builds the H100 runs measured).
        named(2.0 * (q + kv), 2.0 * (q + kv), 2.0, ours),
        // Two residual adds, and their gradients' sums in the backward.
        named(6.0 * h, 6.0 * h, 2.0, true),
        // SwiGLU: read gate and up, write the product; backward read both and the gradient, write two.
        named(3.0 * i, 5.0 * i, 1.0, ours),
    ];
    // Biases: the add each way; backward, the bias's gradient reads the rows' (kernels::bias_add).
    if m.qkv_bias {
        ew.push(named(2.0 * (q + 2.0 * kv), q + 2.0 * kv, 3.0, ours));
    }
    if m.o_bias {
        ew.push(named(2.0 * h, h, 1.0, ours));
    }
    if m.mlp_bias {
        ew.push(named(2.0 * (2.0 * i + h), 2.0 * i + h, 3.0, ours));
    }
    if m.qk_norm {
        ew.push(named(2.0 * (q + kv), 3.0 * (q + kv), 2.0, ours));
    }
    let scale = if backward { 2.0 } else { 1.0 };
    // The pass's tensor ops but its GEMMs (7 forward, 14 backward) and the attention op: what the host
    // issues (views among them).
    let counted = match pass {
        Pass::Reference => o.counts.layer_reference,
        Pass::Policy => o.counts.layer_policy,
        Pass::Recompute => o.counts.layer_recompute,
        Pass::Backward => o.counts.layer_backward,
    };
    let launches = (counted - 7.0 * scale - 1.0).max(0.0);
    // The named ops are the layer's element-wise arithmetic. The other tensor ops are views and
    // bookkeeping that move no bytes (counted on the CPU, tests/calibration.rs: a layer's forward makes 21
    // buffers, 7 GEMMs' and the attention's among them), but in a build whose unnamed ops were passes of
    // their own (candle-core as released: each gradient added to a tensor of zeros), where each moves about
    // the named ops' mean bytes.
    let named_launches = scale * ew.iter().map(|e| e.launches).sum::<f64>();
    let passes = if o.counts.unnamed_ops_move_bytes { (launches / named_launches).max(1.0) } else { 1.0 };
    let elements = |packed: bool| {
        let of = |e: &Named| if backward { e.backward } else { e.forward };
        ew.iter().filter(|e| e.packed == packed).map(of).sum::<f64>() * n_tokens * d * passes
    };
    let share = |packed: bool| elements(packed) / (elements(true) + elements(false)).max(f64::MIN_POSITIVE);
    for packed in [false, true] {
        o.elementwise("layer element-wise", elements(packed), launches * share(packed), packed);
    }
    if backward && o.counts.seed_passes > 0.0 {
        // The backward seeded by (y g).sum_all() (the H100 run's build): read y and g, write the product,
        // sum it.
        o.push("layer element-wise", OpKind::Elementwise, 0.0, o.counts.seed_passes * h * n_tokens * d, 0.0);
    }
}

/// The log-prob head on `n` scored tokens: lm_head GEMMs, the fused log-softmax kernel, and the f32
/// lm_head gradient of each chunk into its accumulator.
fn head(o: &mut Ops, m: &ModelConfig, n: f64, chunk_bytes: u64, d: f64, (backward, frozen, kept): (bool, bool, bool)) {
    let (h, v) = (m.hidden_size as f64, m.vocab_size as f64);
    let rows = (chunk_bytes as f64 / (4.0 * v)).floor().clamp(1.0, 65536.0).min(n.max(1.0));
    let chunks = (n / rows).ceil();
    let rows = n / chunks; // the chunks' mean
    if backward {
        // The chunk's logits again (unless kept from the forward), then the two gradient GEMMs.
        if !kept {
            o.gemm("lm_head", rows, h, v, d, chunks);
        }
        if frozen {
            // LoRA: the hidden states' gradient only.
            o.gemm("lm_head", rows, h, v, d, chunks);
        } else {
            o.weight_backward("lm_head", rows, h, v, d, chunks);
        }
        // Read the logits, write their gradient.
        o.elementwise("log-softmax / entropy", 2.0 * n * v * d, chunks, o.packed);
        if !frozen && !o.counts.fused_wgrad {
            let bytes = o.counts.head_grad_bytes * v * h * chunks;
            o.elementwise("lm_head f32 gradient", bytes, chunks, o.packed);
        }
    } else {
        o.gemm("lm_head", rows, h, v, d, chunks);
        // Read the logits (the GEMM wrote them).
        o.elementwise("log-softmax / entropy", n * v * d, chunks, o.packed);
    }
    // Final RMSNorm and the gather of the scored rows.
    o.elementwise("layer element-wise", 4.0 * n * h * d, 2.0, o.packed);
}

/// One forward of every layer per micro-batch in `pass`; the reference's and the policy's with the
/// embedding and the head (the recomputation starts from the layers' kept inputs).
fn forward(o: &mut Ops, m: &ModelConfig, s: &StepShape, gpu: &Gpu, pass: Pass) {
    let (b, d) = (s.micro_batch.min(s.answers).max(1) as f64, s.dtype_bytes as f64);
    let n_tokens = b * s.seq_tokens as f64;
    let whole = pass != Pass::Recompute;
    let times = o.times;
    o.times = times * m.num_layers as f64;
    layer_dense(o, m, (n_tokens, d, s.lora_rank), pass);
    if whole || s.recompute_attention {
        layer_attention(o, m, b, s.seq_tokens, s.attention_kernels(gpu), d, false);
    } else {
        let q = (m.num_heads * m.head_dim) as f64;
        o.push("attention output copy (kept, not recomputed)", OpKind::Elementwise, 0.0, 2.0 * n_tokens * q * d, 1.0);
    }
    o.times = times;
    if whole {
        let ops = if pass == Pass::Reference { o.counts.micro_batch_reference } else { o.counts.micro_batch };
        let bytes = 2.0 * n_tokens * m.hidden_size as f64 * d;
        o.push("embedding, log-prob head and loss (tensor ops)", OpKind::Elementwise, 0.0, bytes, ops);
        head(o, m, b * s.scored_tokens as f64, s.logprob_chunk_bytes, d, (false, false, false));
    }
}

/// The work of one training step of `m` on `s`, op by op (each op's total over the step).
fn step_costs(m: &ModelConfig, s: &StepShape, gpu: &Gpu) -> Vec<OpCost> {
    let (times, counts, packed) = (s.micro_batches(), counts(s), s.build.packed_kernels);
    let mut o = Ops { ops: Vec::new(), times, window: Window::Reference, counts, packed };
    let (b, d) = (s.micro_batch.min(s.answers).max(1) as f64, s.dtype_bytes as f64);
    let n_tokens = b * s.seq_tokens as f64;
    let p = m.num_parameters() as f64;
    if s.reference_forward {
        forward(&mut o, m, s, gpu, Pass::Reference);
    }
    o.window = Window::Forward;
    forward(&mut o, m, s, gpu, Pass::Policy);
    o.window = Window::Backward;
    if s.checkpoint_layers {
        forward(&mut o, m, s, gpu, Pass::Recompute); // the recomputation, layer by layer, in the backward
    }
    head(&mut o, m, b * s.scored_tokens as f64, s.logprob_chunk_bytes, d, (true, s.lora_rank > 0, s.keep_logits));
    let times = o.times;
    o.times = times * m.num_layers as f64;
    layer_dense(&mut o, m, (n_tokens, d, s.lora_rank), Pass::Backward);
    layer_attention(&mut o, m, b, s.seq_tokens, s.attention_kernels(gpu), d, true);
    o.times = times;
    // Each row read, its f32 atomics into the table's gradient; with `fused_wgrad` that is the accumulator
    // itself (one launch), before a table of zeros cleared first (two).
    let launches = if o.counts.fused_wgrad { 1.0 } else { 2.0 };
    o.push("embedding gradient", OpKind::Elementwise, 0.0, (2.0 * d + 8.0) * n_tokens * m.hidden_size as f64, launches);
    let (p, tensors, d) = match s.lora_rank {
        0 => (p, parameter_tensors(m), d),
        // The f32 adapters of the 7 projections of every layer.
        r => (lora_parameters(m, r), 14.0 * m.num_layers as f64, 4.0),
    };
    let (added, added_tensors, first) = accumulated(m, s, (p, tensors));
    let accumulate = o.counts.accumulate_per_tensor * added_tensors
        + o.counts.accumulate_first_per_tensor * first / s.micro_batches();
    o.elementwise("gradient accumulation (f32)", (d + 8.0) * added, accumulate, o.packed);
    if o.counts.fused_wgrad {
        o.elementwise("gradient accumulators zeroed", 4.0 * p / s.micro_batches(), 0.0, o.packed);
    }
    if s.build.reads_loss_per_micro_batch {
        o.push("loss read (host sync)", OpKind::Elementwise, 0.0, 0.0, 0.0);
        o.ops.last_mut().expect("just pushed").syncs = times;
    }
    o.window = Window::Update;
    o.times = 1.0 / s.optimizer_shards.max(1) as f64;
    if s.offload {
        o.push("AdamW update (host, offload)", OpKind::Host, 0.0, (4.0 + d) * p, 2.0 * tensors);
        let op = o.ops.last_mut().expect("just pushed");
        op.host_bytes = 32.0 * p * o.times;
        op.host_rate =
            if s.build.composite_update { gpu.composite_host_update_bandwidth } else { gpu.host_update_bandwidth };
    } else {
        let update = o.counts.update_per_tensor * tensors;
        // The fused update keeps several f32 streams in flight per thread (the parameter, both moments, the
        // gradient), as a packed kernel does; the composite one was candle's ops one by one.
        let streams = !s.build.composite_update;
        o.elementwise("AdamW update (device)", (32.0 + d) * p, update, streams);
    }
    let norm = o.counts.norm_per_tensor * tensors + o.counts.step;
    o.push("gradient norm and bad-step check", OpKind::Elementwise, 0.0, 4.0 * p, norm);
    o.ops.last_mut().expect("just pushed").syncs = 1.0;
    o.ops
}

/// The parameters of rank-`r` adapters on the 7 projections of every layer of `m`.
fn lora_parameters(m: &ModelConfig, r: u64) -> f64 {
    let f = |x: usize| x as f64;
    let (h, i) = (f(m.hidden_size), f(m.intermediate_size));
    let (q, kv) = (f(m.num_heads) * f(m.head_dim), f(m.num_kv_heads) * f(m.head_dim));
    let per_layer = (h + q) + 2.0 * (h + kv) + (q + h) + 2.0 * (h + i) + (i + h);
    r as f64 * per_layer * f(m.num_layers)
}

/// Of the `(parameters, tensors)` trained on `s`: the parameters and tensors whose gradients
/// kernels::accumulate adds each micro-batch, and the tensors whose accumulators a step's first
/// micro-batch makes ([`TensorOps::accumulate_first_per_tensor`]). With `fused_wgrad` (no LoRA) the
/// projections', the lm_head's and the embedding's own kernels add their gradients into accumulators made
/// before the first micro-batch; before, every gradient was added, the first cast or copied into an
/// accumulator of its own.
fn accumulated(m: &ModelConfig, s: &StepShape, (p, tensors): (f64, f64)) -> (f64, f64, f64) {
    match counts(s).fused_wgrad && s.lora_rank == 0 {
        true => {
            let (fp, ft) = fused_gradient_parameters(m);
            (p - fp, tensors - ft, ft)
        }
        false => (p, tensors, tensors),
    }
}

/// The parameters and tensors whose gradients their own kernels add into the f32 accumulators
/// (`fused_wgrad`): the model's matrices, every layer's seven projection weights and an untied lm_head by
/// their GEMMs, the embedding by its row sums (kernels::embedding_grad_into).
fn fused_gradient_parameters(m: &ModelConfig) -> (f64, f64) {
    let shapes = crate::model::decoder::parameter_shapes(m);
    let matrices: Vec<usize> = shapes.iter().filter(|(_, s)| s.len() == 2).map(|(_, s)| s[0] * s[1]).collect();
    (matrices.iter().sum::<usize>() as f64, matrices.len() as f64)
}

/// The model's parameter tensors (each has its own gradient and update ops).
fn parameter_tensors(m: &ModelConfig) -> f64 {
    let one_layer = ModelConfig { num_layers: 1, ..m.clone() };
    let per_layer = crate::model::decoder::parameter_shapes(&one_layer).len() as f64;
    let all = crate::model::decoder::parameter_shapes(&ModelConfig { num_layers: 2, ..m.clone() }).len() as f64;
    let layer = all - per_layer;
    per_layer - layer + layer * m.num_layers as f64
}

/// The device's time for one op on `gpu`: its roofline (the tensor-core attention kernels: their useful
/// FLOPs at the kernel's rate at this length, which includes their memory traffic); 0 for the host's
/// own work ([`OpKind::Host`]).
fn device_time(op: &OpCost, gpu: &Gpu) -> f64 {
    let bw = gpu.memory_bandwidth * gpu.memory_efficiency;
    // A GEMM streams its operands as the packed kernels do (cuBLAS's tiles load 16 bytes and more at once).
    let streamed = gpu.memory_bandwidth * gpu.packed_memory_efficiency;
    let roofline = |flops_per_s: f64| (op.flops / flops_per_s).max(op.bytes / streamed);
    // Measured at head dim 128 (and the warpgroup kernels at 64, where that is the head): a smaller head
    // without rates of its own does less tensor-core work per score but the same softmax and
    // bookkeeping, so the rate in FLOPs is taken to fall with it (the time per score kept).
    let kernel = |rates: Option<KernelRates>, d64: Option<KernelRates>, backward: bool| {
        let (rates, head) = match d64 {
            Some(r) if op.head_dim == 64 => (r, 1.0),
            _ => (rates.unwrap_or(gpu.mma), (op.head_dim as f64 / RATES_HEAD_DIM).min(1.0)),
        };
        op.useful_flops / (gpu.peak_flops * rates.efficiency(op.seq_tokens, backward) * head)
    };
    match op.kind {
        OpKind::Gemm => roofline(gemm_flops_per_s(op.product.0, op.product.1, gpu)),
        OpKind::AttentionGemm => roofline(gpu.peak_flops * gpu.attention_gemm_efficiency),
        OpKind::AttentionMmaForward => kernel(None, None, false),
        OpKind::AttentionMma => kernel(None, None, true),
        OpKind::AttentionWgmmaForward => kernel(gpu.wgmma, gpu.wgmma_d64, false),
        OpKind::AttentionWgmma => kernel(gpu.wgmma, gpu.wgmma_d64, true),
        OpKind::AttentionWgmmaAtomic => {
            kernel(gpu.wgmma_atomic.or(gpu.wgmma), gpu.wgmma_atomic_d64.or(gpu.wgmma_d64), true)
        }
        OpKind::Elementwise if op.packed => op.bytes / streamed,
        OpKind::Elementwise => op.bytes / bw,
        OpKind::Host => 0.0,
    }
}

/// The host's time for one op on `gpu`: issuing its launches, and the offloaded update's transfers and
/// host work.
fn host_time(op: &OpCost, gpu: &Gpu) -> f64 {
    let own = match op.kind {
        OpKind::Host => op.bytes / gpu.pcie_bandwidth + op.host_bytes / op.host_rate,
        _ => 0.0,
    };
    let per_launch = if op.attention { gpu.kernel_launch_s } else { gpu.launch_s };
    op.launches * per_launch + own
}

/// A step's predicted time on one GPU and what it is made of: the device's time per kind of op, the time
/// the device waits for the host (a window whose ops take the host longer to issue than the device to
/// run), and the host syncs; they add up to the step.
#[derive(Debug, Clone)]
pub struct Prediction {
    pub gpu: Gpu,
    pub step_s: f64,
    pub tokens_per_s: f64,
    /// Model FLOPs per second over the peak (see the module's doc).
    pub mfu: f64,
    /// The attention's useful FLOPs per second over the peak, while it runs.
    pub attention_of_peak: f64,
    /// The device's seconds in each kind: GEMMs, attention (GEMMs, kernels and element-wise), other
    /// element-wise.
    pub gemm_s: f64,
    pub attention_s: f64,
    pub elementwise_s: f64,
    /// Seconds the device waits for the host beyond its own work: the host issuing ops (at
    /// [`Gpu::launch_s`] each) and, with `optim.offload`, the update in host memory.
    pub host_s: f64,
    /// The host syncs' time.
    pub sync_s: f64,
    /// Of `host_s`'s window, the offloaded update's own time (its transfers and host work).
    pub offload_update_s: f64,
    /// Ops the host issues (kernel launches and candle's tensor ops).
    pub launches: f64,
    pub syncs: f64,
    pub flops: f64,
    pub bytes: f64,
    /// Each window's work (what scripts/calibrate.py fits the host's constants on).
    pub windows: Vec<WindowCost>,
    /// Where the device's time goes: the step's ops by window and name, longest first.
    pub ops: Vec<OpTime>,
}

/// One named op's total over a step's window (every layer and micro-batch).
#[derive(Debug, Clone, serde::Serialize)]
pub struct OpTime {
    pub window: &'static str,
    pub op: &'static str,
    pub device_s: f64,
    pub flops: f64,
    pub bytes: f64,
    /// Tensor ops and kernel launches the host issues for it.
    pub launches: f64,
}

/// The ops of a step summed by window and name, longest first.
fn op_times(ops: &[OpCost], gpu: &Gpu) -> Vec<OpTime> {
    let mut out: Vec<OpTime> = Vec::new();
    for o in ops {
        let (window, device_s) = (o.window.name(), device_time(o, gpu));
        match out.iter_mut().find(|t| t.window == window && t.op == o.name) {
            Some(t) => {
                t.device_s += device_s;
                t.flops += o.flops;
                t.bytes += o.bytes;
                t.launches += o.launches;
            }
            None => {
                out.push(OpTime { window, op: o.name, device_s, flops: o.flops, bytes: o.bytes, launches: o.launches })
            }
        }
    }
    out.sort_by(|a, b| b.device_s.total_cmp(&a.device_s));
    out
}

/// One window's work: the device's time, and what the host does in it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct WindowCost {
    pub window: &'static str,
    pub device_s: f64,
    /// Of `device_s`, the element-wise kernels' at [`Gpu::memory_efficiency`] (not the packed ones, at their own).
    pub elementwise_s: f64,
    /// Tensor ops the host issues through candle, and the attention kernels' launches (straight from the
    /// project's own code: no tensor is made).
    pub launches: f64,
    pub kernel_launches: f64,
    /// The offloaded update's bytes over PCIe and through host memory.
    pub pcie_bytes: f64,
    pub host_bytes: f64,
    /// The host's time on those bytes (at the rate of the update that moves them).
    pub host_update_s: f64,
    /// The PCIe bytes that do not overlap the host's update: all of them where the copies and the update
    /// take turns (the H100 run's build), one chunk's download and upload where the copies of the
    /// neighbouring chunks run during a chunk's update (this build: `train::offload`).
    pub serial_pcie_bytes: f64,
}

/// The offloaded update of `params` parameters of `d`-byte weights alone on `gpu`, as this build runs it
/// (the update window of a step with `optim.offload`): one chunk's copies, then the longer of the host's
/// update and the other copies.
pub fn offload_update_s(params: f64, d: f64, gpu: &Gpu) -> f64 {
    let pcie_bytes = params * (4.0 + d);
    let w = WindowCost {
        window: "update",
        device_s: 0.0,
        elementwise_s: 0.0,
        launches: 0.0,
        kernel_launches: 0.0,
        pcie_bytes,
        host_bytes: 32.0 * params,
        host_update_s: 32.0 * params / gpu.host_update_bandwidth,
        serial_pcie_bytes: pcie_bytes.min(offload_chunk_bytes(params, d)),
    };
    w.offload_s(gpu)
}

/// One chunk's PCIe bytes in the offloaded update of `params` parameters of `d`-byte weights
/// (`optim.offload_chunk_mb` at its default): its f32 gradients down and its weights up.
fn offload_chunk_bytes(params: f64, d: f64) -> f64 {
    use crate::device::staging::{chunk_len, DEFAULT_CHUNK_MB};
    chunk_len(params as usize, DEFAULT_CHUNK_MB) as f64 * (4.0 + d)
}

/// FLOPs of the policy's forward on the step, attention counted as the causal lower triangle.
fn model_forward_flops(m: &ModelConfig, s: &StepShape) -> (f64, f64) {
    let f = |x: usize| x as f64;
    let (h, i, v) = (f(m.hidden_size), f(m.intermediate_size), f(m.vocab_size));
    let q = f(m.num_heads) * f(m.head_dim);
    let kv = f(m.num_kv_heads) * f(m.head_dim);
    let (t, answers) = (s.seq_tokens as f64, s.answers as f64);
    let per_token = 2.0 * f(m.num_layers) * (2.0 * h * q + 2.0 * h * kv + 3.0 * h * i);
    let dense = answers * (t * per_token + 2.0 * s.scored_tokens as f64 * h * v);
    let attention = answers * f(m.num_layers) * 4.0 * q * t * (t + 1.0) / 2.0;
    (dense, attention)
}

/// The prediction of a step of `m` on `s` for `gpu`.
pub fn predict(m: &ModelConfig, s: &StepShape, gpu: &Gpu) -> Prediction {
    let run_build = s.build.gpu(*gpu);
    let gpu = &run_build;
    let ops = step_costs(m, s, gpu);
    // (+ 0.0: an empty sum is -0.0)
    let sum = |f: &dyn Fn(&OpCost) -> f64, keep: &dyn Fn(&OpCost) -> bool| {
        ops.iter().filter(|o| keep(o)).map(f).sum::<f64>() + 0.0
    };
    let device = |keep: &dyn Fn(&OpCost) -> bool| sum(&|o| device_time(o, gpu), keep);
    let attention_s = device(&|o| o.attention);
    let gemm_s = device(&|o| o.kind == OpKind::Gemm);
    let elementwise_s = device(&|o| o.kind == OpKind::Elementwise && !o.attention);
    let windows: Vec<WindowCost> = [Window::Reference, Window::Forward, Window::Backward, Window::Update]
        .into_iter()
        .map(|w| {
            let host = |o: &OpCost| o.window == w && o.kind == OpKind::Host;
            let ew = |o: &OpCost| o.window == w && o.kind == OpKind::Elementwise && !o.packed;
            WindowCost {
                window: w.name(),
                device_s: sum(&|o| device_time(o, gpu), &|o| o.window == w),
                elementwise_s: sum(&|o| device_time(o, gpu), &ew),
                launches: sum(&|o| o.launches, &|o| o.window == w && !o.attention),
                kernel_launches: sum(&|o| o.launches, &|o| o.window == w && o.attention),
                pcie_bytes: sum(&|o| o.bytes, &host),
                host_bytes: sum(&|o| o.host_bytes, &host),
                host_update_s: sum(&|o| o.host_bytes / o.host_rate, &host),
                serial_pcie_bytes: match s.build.composite_update {
                    true => sum(&|o| o.bytes, &host),
                    false => {
                        let (bytes, d) = (sum(&|o| o.bytes, &host), s.dtype_bytes as f64);
                        bytes.min(offload_chunk_bytes(bytes / (4.0 + d), d))
                    }
                },
            }
        })
        .collect();
    let host_s = windows.iter().map(|w| (w.host_s(gpu) - w.device_s).max(0.0)).sum::<f64>();
    let syncs = sum(&|o| o.syncs, &|_| true);
    let step_s = attention_s + gemm_s + elementwise_s + host_s + syncs * gpu.sync_s;
    let (dense, attention) = model_forward_flops(m, s);
    // Attention's useful work: forward, backward (2.5x) and the recomputed forward.
    let recompute = if s.checkpoint_layers && s.recompute_attention { 1.0 } else { 0.0 };
    let reference = if s.reference_forward { 1.0 } else { 0.0 };
    let attention_useful = attention * (3.5 + recompute + reference);
    Prediction {
        gpu: *gpu,
        step_s,
        tokens_per_s: s.tokens() / step_s,
        mfu: 3.0 * (dense + attention) / step_s / gpu.peak_flops,
        attention_of_peak: attention_useful / attention_s.max(f64::MIN_POSITIVE) / gpu.peak_flops,
        gemm_s,
        attention_s,
        elementwise_s,
        host_s,
        sync_s: syncs * gpu.sync_s,
        offload_update_s: windows.iter().map(|w| w.offload_s(gpu)).sum(),
        launches: sum(&|o| o.launches, &|_| true),
        syncs,
        flops: sum(&|o| o.flops, &|_| true),
        bytes: sum(&|o| o.bytes, &|_| true),
        windows,
        ops: op_times(&ops, gpu),
    }
}

impl WindowCost {
    /// The host's time in the window on `gpu`.
    fn host_s(&self, gpu: &Gpu) -> f64 {
        self.launches * gpu.launch_s + self.kernel_launches * gpu.kernel_launch_s + self.offload_s(gpu)
    }

    /// The offloaded update's time in the window: the copies that do not overlap the host's update, and
    /// the longer of the update and the copies that do.
    fn offload_s(&self, gpu: &Gpu) -> f64 {
        let overlapped = (self.pcie_bytes - self.serial_pcie_bytes) / gpu.pcie_bandwidth;
        self.serial_pcie_bytes / gpu.pcie_bandwidth + self.host_update_s.max(overlapped)
    }
}

/// The predicted time of the attention (forward and backward of every layer's block products and
/// element-wise steps, one micro-batch) of `m` on `s` with `blocks` on `gpu`.
fn attention_time(m: &ModelConfig, s: &StepShape, blocks: AttentionBlocks, gpu: &Gpu) -> f64 {
    let shape = StepShape { blocks, ..*s };
    let (counts, packed) = (counts(&shape), shape.build.packed_kernels);
    let mut o = Ops { ops: Vec::new(), times: 1.0, window: Window::Forward, counts, packed };
    let b = shape.micro_batch.min(shape.answers).max(1) as f64;
    layer_attention(&mut o, m, b, shape.seq_tokens, (blocks, None), shape.dtype_bytes as f64, false);
    layer_attention(&mut o, m, b, shape.seq_tokens, (blocks, None), shape.dtype_bytes as f64, true);
    o.ops.iter().map(|op| device_time(op, gpu).max(host_time(op, gpu))).sum::<f64>()
}

/// The square block size of [`BLOCK_CANDIDATES`] that the model predicts fastest for the attention of
/// `m` on `s` on `gpu` (the smaller on a tie: less workspace).
pub fn best_blocks(m: &ModelConfig, s: &StepShape, gpu: &Gpu) -> AttentionBlocks {
    let time = |size: u64| attention_time(m, s, AttentionBlocks { query: size, key: size }, gpu);
    let best =
        BLOCK_CANDIDATES.iter().copied().min_by(|a, b| time(*a).total_cmp(&time(*b)).then(a.cmp(b))).unwrap_or(128);
    AttentionBlocks { query: best, key: best }
}

/// The blocks the attention op runs with on a GPU for `m` at `t` tokens (`kernels::causal_work`, the
/// driver's own choice): what the predictions use.
pub fn driver_blocks(m: &ModelConfig, t: u64) -> AttentionBlocks {
    let t = t.clamp(1, u32::MAX as u64) as usize;
    let dims = (1, m.num_heads, m.num_kv_heads, t, t, m.head_dim);
    let (blocks, _, _) = crate::kernels::causal_work(dims, crate::kernels::AttentionDevice::Gpu, 2);
    AttentionBlocks { query: blocks.bq as u64, key: blocks.bk as u64 }
}

mod attention;
mod plan_text;

use attention::layer_attention;
pub use plan_text::{calibration_note, report, zero1_comms, Zero1Comms, GPUS_PER_NODE};
#[cfg(test)]
mod tests;
