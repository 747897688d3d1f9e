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

pub use super::calibration::{
    Calibration, Gpu, KernelRates, MeasuredBuild, RateAt, TensorOps, A100_80GB, GPUS, H100_SXM, TENSOR_OPS,
};

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
    pub build: MeasuredBuild,
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
    /// The build's own element-wise kernels move 16-byte packs ([`MeasuredBuild::packed_kernels`]).
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
    s.build.tensor_ops()
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

/// The tensor-core attention backward's `delta = rowsum(dO O)` over `rows` query rows of `hd` elements of
/// `d` bytes, and its concatenation with the log-sum-exp (a row's 4 + 4 bytes read and written). This
/// build: one pass reading both inputs in 16-byte runs (kernels::row_dot). Before: candle's casts to f32,
/// product and sum (about 28 bytes an element at bf16, in four ops) and the output's cast and copy.
fn attention_delta(o: &mut Ops, rows: f64, hd: f64, d: f64) {
    let cat = rows * 16.0;
    if o.packed {
        o.elementwise("attention element-wise (backward)", rows * (hd * 2.0 * d + 4.0), 1.0, true);
        o.push("attention element-wise (backward)", OpKind::Elementwise, 0.0, cat, 1.0);
    } else {
        o.push("attention element-wise (backward)", OpKind::Elementwise, 0.0, rows * hd * (2.0 * d + 24.0), 6.0);
    }
}

/// The (query, key) score elements and block pairs the dk/dv kernel of kernels/flash_mma.cu computes for
/// one causal sequence and one query head: each block of `bk` keys against the blocks of `bq` queries
/// from the one holding its first key on.
fn computed_scores_by_keys(t: u64, bk: u64, bq: u64) -> (f64, f64) {
    let (mut scores, mut pairs) = (0f64, 0f64);
    let mut j0 = 0;
    while j0 < t {
        let keys = bk.min(t - j0);
        let first = j0 / bq * bq;
        scores += keys as f64 * (t - first) as f64;
        pairs += (t - first).div_ceil(bq) as f64;
        j0 += keys;
    }
    (scores, pairs)
}

/// The bytes of one head's K and V (or Q and dO) the tensor-core kernels may stream from the L2 cache
/// rather than device memory: under half the L2 of an A100 (40 MB) or an H100 (50 MB).
const L2_RESIDENT_BYTES: f64 = 20e6;

/// One layer's attention on the tensor-core kernels (kernels/flash_mma.cu) on `b` sequences of `t`
/// tokens. Forward: 64 queries against blocks of 32 keys, S = Q K^T and O += P V (4 hd FLOPs per score).
/// Backward: the dq kernel (64 queries, blocks of 32 keys: S, dP and dQ, 6 hd per score) and the dk/dv
/// kernel (64 keys, blocks of 16 queries of each head of the group: S^T, dP^T, dV and dK, 8 hd per score;
/// it reads every query block's key span, written by the dq kernel, to find those that see its keys),
/// after `D = rowsum(dO O)` by
/// candle's element-wise ops. Device-memory bytes: each block's own rows once (Q and O; Q, dO and dQ; K,
/// V, dK and dV) and the streamed operand (K and V; Q and dO) once per head when one head's fits in
/// [`L2_RESIDENT_BYTES`] (the blocks of a head run together and re-read it from L2), else once per
/// block pair.
fn layer_attention_mma(o: &mut Ops, m: &ModelConfig, b: f64, t: u64, d: f64, (backward, atomic_dq): (bool, bool)) {
    layer_attention_tiles(o, m, (b, t, d), &MMA_TILES, (backward, atomic_dq));
}

/// The blocks of the tensor-core attention kernels and the kinds of their ops.
struct Tiles {
    /// The forward's kind, and the backward's.
    forward: OpKind,
    kind: OpKind,
    /// Queries per block and keys per step of the forward and the dq kernel.
    rows: u64,
    keys: u64,
    /// Keys per block and queries per step of the dk/dv kernel.
    dkv_keys: u64,
    dkv_queries: u64,
}

/// kernels/flash_mma.cu's.
const MMA_TILES: Tiles = Tiles {
    forward: OpKind::AttentionMmaForward,
    kind: OpKind::AttentionMma,
    rows: 64,
    keys: 32,
    dkv_keys: 64,
    dkv_queries: 16,
};
/// kernels/flash_wgmma.cu's: 128-row blocks (two warpgroups of 64), 64-row steps.
const WGMMA_TILES: Tiles = Tiles {
    forward: OpKind::AttentionWgmmaForward,
    kind: OpKind::AttentionWgmma,
    rows: 128,
    keys: 64,
    dkv_keys: 128,
    dkv_queries: 64,
};

/// [`layer_attention_mma`] for the blocks of `tiles`: the same products, bytes and launches per block
/// (the warpgroup kernels, kernels/flash_wgmma.cu, have the same kernels and both backwards).
fn layer_attention_tiles(
    o: &mut Ops,
    m: &ModelConfig,
    (b, t, d): (f64, u64, f64),
    tiles: &Tiles,
    (backward, atomic_dq): (bool, bool),
) {
    let (heads, hd) = (m.num_heads as f64, m.head_dim as f64);
    let bh = b * heads;
    let tokens = t as f64;
    let row_stats = 4.0 + 8.0; // a query's log-sum-exp (or delta) and its key range
    let resident = 2.0 * tokens * hd * d <= L2_RESIDENT_BYTES;
    // The streamed pair of [rows, hd] operands: once per head, or `rows` per block pair.
    let streamed = |pairs: f64, rows: f64| if resident { 2.0 * tokens * hd * d } else { pairs * 2.0 * rows * hd * d };
    let blocks = AttentionBlocks { query: tiles.rows, key: tiles.keys };
    let step_keys = tiles.keys as f64;
    if !backward {
        let (scores, pairs) = computed_scores(t, blocks);
        let bytes = tokens * (2.0 * hd * d + row_stats) + streamed(pairs, step_keys);
        let work = (bh * 4.0 * hd * scores, bh * 4.0 * hd * causal_pairs(t));
        o.attention_kernel(
            "attention kernels (forward)",
            tiles.forward,
            work,
            (bh * bytes, 1.0),
            (t, m.head_dim as u64),
        );
        return;
    }
    attention_delta(o, bh * tokens, hd, d);
    if atomic_dq {
        return layer_attention_atomic(o, m, (b, t, d), tiles);
    }
    let (scores, pairs) = computed_scores(t, blocks);
    let dq_bytes = tokens * (3.0 * hd * d + 2.0 * row_stats) + streamed(pairs, step_keys);
    let (kv_scores, kv_pairs) = computed_scores_by_keys(t, tiles.dkv_keys, tiles.dkv_queries);
    let step_queries = tiles.dkv_queries as f64;
    let key_blocks = t.div_ceil(tiles.dkv_keys) as f64;
    let spans = tokens.div_euclid(16.0).max(1.0) * 8.0; // each 16 queries' key span, read per key block
    let ranges_scan = tokens * 8.0 + if resident { spans } else { key_blocks * spans };
    let kv_bytes = tokens * 4.0 * hd * d / heads * m.num_kv_heads as f64
        + streamed(kv_pairs, step_queries)
        + kv_pairs * step_queries * 2.0 * row_stats
        + ranges_scan;
    let work = (bh * (6.0 * hd * scores + 8.0 * hd * kv_scores), bh * 10.0 * hd * causal_pairs(t));
    // Three launches: the dq kernel, the dk/dv kernel, and the sum of its groups' parts (bwd_dkv_sum; its
    // bytes are in the kernels' measured rates, as is every byte here).
    let io = (bh * (dq_bytes + kv_bytes), 3.0);
    o.attention_kernel("attention kernels (backward)", tiles.kind, work, io, (t, m.head_dim as u64));
}

/// The backward of [`layer_attention_tiles`] with dq summed by atomics (kernels/flash_mma.cu's
/// `bwd_prep` and `bwd_dq_out` around the file's `bwd_dkvq`): the dk/dv kernel's S^T, dP^T, dV, dK and dQ,
/// 10 hd FLOPs per score of its key blocks against its query steps; each pair adds its [step, hd] dQ into
/// the f32 accumulator.
/// Device-memory bytes: the dk/dv kernel's as in the two-kernel backward; the accumulator zeroed and read
/// once; and the atomics, absorbed by the L2 cache while one head's accumulator fits in
/// [`L2_RESIDENT_BYTES`] (their rate there is not modelled), else 8 B each at device memory.
fn layer_attention_atomic(o: &mut Ops, m: &ModelConfig, (b, t, d): (f64, u64, f64), tiles: &Tiles) {
    let (heads, hd) = (m.num_heads as f64, m.head_dim as f64);
    let (bh, tokens) = (b * heads, t as f64);
    let row_stats = 4.0 + 8.0;
    let step = tiles.dkv_queries as f64;
    let (kv_scores, kv_pairs) = computed_scores_by_keys(t, tiles.dkv_keys, tiles.dkv_queries);
    let resident = 2.0 * tokens * hd * d <= L2_RESIDENT_BYTES;
    let streamed = if resident { 2.0 * tokens * hd * d } else { kv_pairs * 2.0 * step * hd * d };
    let accumulator = tokens * hd * 4.0;
    let atomics = if accumulator <= L2_RESIDENT_BYTES { 0.0 } else { kv_pairs * step * hd * 8.0 };
    let spans = tokens.div_euclid(16.0).max(1.0) * 8.0;
    let kv_bytes = tokens * 4.0 * hd * d / heads * m.num_kv_heads as f64
        + streamed
        + kv_pairs * step * 2.0 * row_stats
        + tokens * 8.0
        + if resident { spans } else { t.div_ceil(tiles.dkv_keys) as f64 * spans };
    // Zeroed (prep), read and written as dq (dq_out).
    let accumulator_bytes = accumulator * 2.0 + tokens * hd * d + tokens * 8.0;
    let work = (bh * 10.0 * hd * kv_scores, bh * 10.0 * hd * causal_pairs(t));
    let bytes = bh * (kv_bytes + atomics + accumulator_bytes);
    let kind = if tiles.kind == OpKind::AttentionWgmma { OpKind::AttentionWgmmaAtomic } else { tiles.kind };
    // Four launches: bwd_prep, the dk/dv kernel, the sum of its groups' parts and bwd_dq_out.
    o.attention_kernel("attention kernels (backward)", kind, work, (bytes, 4.0), (t, m.head_dim as u64));
}

/// One layer's attention on `b` sequences of `t` tokens (`backward`: with its recomputation): chunked
/// GEMMs in `blocks`, or the tensor-core kernels with `tensor_cores`.
fn layer_attention(
    o: &mut Ops,
    m: &ModelConfig,
    b: f64,
    t: u64,
    (blocks, tensor_cores): (AttentionBlocks, Option<TensorCoreKernels>),
    d: f64,
    backward: bool,
) {
    match tensor_cores {
        Some(TensorCoreKernels::Mma(atomic_dq)) => return layer_attention_mma(o, m, b, t, d, (backward, atomic_dq)),
        Some(TensorCoreKernels::Wgmma(atomic_dq)) => {
            return layer_attention_tiles(o, m, (b, t, d), &WGMMA_TILES, (backward, atomic_dq))
        }
        None => {}
    }
    let (heads, hd) = (m.num_heads as f64, m.head_dim as f64);
    let (scores, pairs) = computed_scores(t, blocks);
    let q_blocks = t.div_ceil(blocks.query.max(1)) as f64;
    let (bq, bk) = ((blocks.query.min(t)) as f64, (blocks.key.min(t)) as f64);
    let bh = b * heads;
    // Per score: the GEMM FLOPs and the f32 / d-byte block products through memory. Per pair: the Q
    // (and dO, dQ) rows and K, V (and dK, dV) columns each GEMM reads or accumulates (per head).
    let (gemms, flops_per_score, score_bytes, row_vectors, col_vectors, ew, ew_per_qblock) = if backward {
        (5.0, 10.0 * hd, 16.0 + 4.0 * d, 4.0 * d + 8.0, 2.0 * d + 8.0, 2.0, 1.0)
    } else {
        (2.0, 4.0 * hd, 8.0 + 2.0 * d, d + 8.0, 2.0 * d, 2.0, 1.0)
    };
    // The G query heads of a KV group are stacked in one GEMM's rows: K, V (dK, dV) move once per group.
    let group = (m.num_heads / m.num_kv_heads.max(1)).max(1) as f64;
    let vector_bytes = pairs * hd * (bq * row_vectors + bk * col_vectors / group);
    let gemm_bytes = scores * 4.0 + vector_bytes; // S (and dP) written in f32 by the GEMMs
    let name = if backward { "attention GEMMs (backward)" } else { "attention GEMMs (forward)" };
    o.push(name, OpKind::AttentionGemm, bh * flops_per_score * scores, bh * gemm_bytes, gemms * pairs);
    let ew_bytes = scores * (score_bytes - 4.0) + q_blocks * bq * hd * 2.0 * d;
    let name = if backward { "attention element-wise (backward)" } else { "attention element-wise (forward)" };
    o.push(name, OpKind::Elementwise, 0.0, bh * ew_bytes, ew * pairs + ew_per_qblock * q_blocks);
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
    let (times, counts, packed) = (s.micro_batches(), counts(s), s.build.packed_kernels());
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
    if s.build.reads_loss_per_micro_batch() {
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
            if s.build.composite_update() { gpu.composite_host_update_bandwidth } else { gpu.host_update_bandwidth };
    } else {
        let update = o.counts.update_per_tensor * tensors;
        // The fused update keeps several f32 streams in flight per thread (the parameter, both moments, the
        // gradient), as a packed kernel does; the composite one was candle's ops one by one.
        let streams = !s.build.composite_update();
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
                serial_pcie_bytes: match s.build.composite_update() {
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
    let (counts, packed) = (counts(&shape), shape.build.packed_kernels());
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

/// Communication of one ZeRO-1 data-parallel step on `world` ranks, as src/train/zero.rs and the NCCL
/// backend run it: the ring reduce-scatter of the f32 gradients and the ring all-gather of the updated f32
/// weights, each moving (N - 1) / N of the buffer through every rank's link (NVLink within one node of
/// `gpus_per_node`, the rank's InfiniBand NIC beyond: a ring through every rank runs at its slowest link),
/// and the copies through host memory around them over PCIe: the f32 gradients to the host (flattened)
/// and to the collective's device buffers, the rank's block back and its new weights out, the gathered
/// f32 weights to the host and into the model (4 (4 + 2 / N) B per parameter).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Zero1Comms {
    /// Bytes through the rank's link.
    pub link_bytes: f64,
    pub link_s: f64,
    /// Bytes between the rank's GPU and host memory.
    pub pcie_bytes: f64,
    pub pcie_s: f64,
}

impl Zero1Comms {
    pub fn seconds(&self) -> f64 {
        self.link_s + self.pcie_s
    }
}

pub fn zero1_comms(params: u64, world: u64, gpus_per_node: u64, gpu: &Gpu) -> Zero1Comms {
    if world <= 1 {
        return Zero1Comms { link_bytes: 0.0, link_s: 0.0, pcie_bytes: 0.0, pcie_s: 0.0 };
    }
    let (n, p) = (world as f64, params as f64);
    let link_bytes = (n - 1.0) / n * p * 8.0;
    let link = if world <= gpus_per_node { gpu.nvlink_bandwidth } else { gpu.network_bandwidth };
    let pcie_bytes = p * 4.0 * (4.0 + 2.0 / n);
    Zero1Comms {
        link_bytes,
        link_s: link_bytes / (link * COLLECTIVE_EFFICIENCY),
        pcie_bytes,
        pcie_s: pcie_bytes / gpu.pcie_bandwidth,
    }
}

/// Where `gpu`'s rates come from, for the reader of a prediction.
pub fn calibration_note(gpu: &Gpu) -> String {
    match gpu.calibration {
        Some(c) => format!("calibrated on {}, {}", c.card, c.date),
        None => "assumed rates: no such card has run grpo".to_string(),
    }
}

/// GPUs per node in the scaling estimate (an HGX / DGX H100 or A100 node).
pub const GPUS_PER_NODE: u64 = 8;

/// The lines `grpo train --plan` prints: one rank's step `s` of a step of `global_answers` sequences on
/// `world_size` ranks, and for each of [`GPUS`] its predicted time, throughput and efficiency.
pub fn report(m: &ModelConfig, s: &StepShape, global_answers: u64, world_size: u64) -> String {
    let world = world_size.max(1);
    let attention = match (s.tensor_cores, s.warpgroup, s.atomic_dq) {
        (true, true, true) => "attention on the warpgroup kernels (elsewhere tensor-core, dq by atomics)".to_string(),
        (true, true, false) => "attention on the warpgroup kernels (elsewhere tensor-core)".to_string(),
        (true, false, true) => "attention on the tensor-core kernels (dq by atomics)".to_string(),
        (true, false, false) => "attention on the tensor-core kernels".to_string(),
        (false, ..) => format!("attention in {} x {} blocks", s.blocks.query, s.blocks.key),
    };
    let recompute = match (s.checkpoint_layers, s.recompute_attention) {
        (true, true) => "layers recomputed",
        (true, false) => "layers recomputed but their attention's forward (kept)",
        (false, _) => "no recomputation",
    };
    let mut out = format!(
        "performance model (src/cost/time.rs): {} answers x {} tokens{}, micro-batch {}, {attention}, {}, {}\n",
        s.answers,
        s.seq_tokens,
        if world > 1 { " per rank" } else { "" },
        s.micro_batch,
        recompute,
        if s.reference_forward { "a reference forward" } else { "no reference forward (cached or beta 0)" },
    );
    let tokens = global_answers as f64 * s.seq_tokens as f64;
    // Ranks take whole groups: past one group per rank, the others wait.
    let busy = global_answers.div_ceil(s.answers.max(1)).clamp(1, world);
    if busy < world {
        out.push_str(&format!("  only {busy} of {world} ranks have a group to train on (groups are not split)\n"));
    }
    for gpu in &GPUS {
        let p = predict(m, s, gpu);
        let comms = zero1_comms(m.num_parameters() as u64, world, GPUS_PER_NODE, gpu);
        let step = p.step_s + comms.seconds();
        out.push_str(&format!(
            "predicted on {} ({}): step {:.1} s, {:.0} tokens/s{}; MFU {:.1}%, attention at {:.1}% of peak (device: \
             GEMMs {:.1} s, attention {:.1} s, element-wise {:.1} s; waiting for the host {:.1} s; {:.3e} tensor ops \
             and launches, {})\n",
            gpu.name,
            calibration_note(gpu),
            step,
            tokens / step,
            if world > 1 { format!(" on {world} GPUs") } else { String::new() },
            100.0 * p.mfu * p.step_s / step * busy as f64 / world as f64,
            100.0 * p.attention_of_peak,
            p.gemm_s,
            p.attention_s,
            p.elementwise_s,
            p.host_s,
            p.launches,
            crate::progress::count(p.syncs.round() as u64, "host sync"),
        ));
        out.push_str(&format!("  longest ops (their share of the step): {}\n", longest_ops(&p.ops, p.step_s, 4)));
        if world > 1 {
            let link = if world <= GPUS_PER_NODE { "NVLink" } else { "InfiniBand" };
            out.push_str(&format!(
                "  {} ranks: ZeRO-1 reduce-scatter + all-gather {:.1} GB per rank, {:.2} s over {link}, and {:.1} GB \
                 through host memory, {:.2} s over PCIe; {:.0} tokens/s per GPU\n",
                world,
                comms.link_bytes / 1e9,
                comms.link_s,
                comms.pcie_bytes / 1e9,
                comms.pcie_s,
                tokens / step / world as f64
            ));
        }
    }
    out
}

/// The `n` longest of `ops` as "window op share-of-`step_s`", joined (an op named for its window, such as
/// "attention kernels (backward)", without the repeat).
fn longest_ops(ops: &[OpTime], step_s: f64, n: usize) -> String {
    let line = |o: &OpTime| {
        let name = o.op.strip_suffix(&format!(" ({})", o.window)).unwrap_or(o.op);
        format!("{} {name} {:.0}%", o.window, 100.0 * o.device_s / step_s)
    };
    ops.iter().take(n).map(line).collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    /// h 8, 2 heads / 1 KV head of dim 4, i 16, V 32, 3 layers, untied, no biases.
    fn tiny() -> ModelConfig {
        let raw = serde_json::json!({"model_type": "llama", "vocab_size": 32, "hidden_size": 8,
            "intermediate_size": 16, "num_hidden_layers": 3, "num_attention_heads": 2, "num_key_value_heads": 1,
            "tie_word_embeddings": false});
        ModelConfig::from_json(raw, Path::new("test")).unwrap()
    }

    fn seven_b() -> ModelConfig {
        let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/models/qwen2.5-7b-instruct.config.json");
        ModelConfig::from_file(&p).unwrap()
    }

    fn shape(answers: u64, t: u64, scored: u64) -> StepShape {
        StepShape {
            answers,
            micro_batch: 1,
            seq_tokens: t,
            scored_tokens: scored,
            dtype_bytes: 2,
            checkpoint_layers: false,
            recompute_attention: true,
            reference_forward: false,
            offload: false,
            build: MeasuredBuild::Current,
            logprob_chunk_bytes: 1 << 30,
            optimizer_shards: 1,
            tensor_cores: false,
            atomic_dq: false,
            warpgroup: false,
            lora_rank: 0,
            keep_logits: false,
            blocks: AttentionBlocks { query: 4, key: 4 },
        }
    }

    fn flops(ops: &[OpCost], keep: impl Fn(&OpCost) -> bool) -> f64 {
        ops.iter().filter(|o| keep(o)).map(|o| o.flops).sum()
    }

    #[test]
    fn dense_flops_are_six_times_the_matrix_parameters_per_token() {
        let m = tiny();
        // Layer matrices: q 8x8, k, v 8x4, o 8x8, MLP 3 x 8x16 = 64 + 64 + 64 + 384 = 576 per layer.
        let (layer, lm_head) = (576.0, 32.0 * 8.0);
        let s = shape(3, 16, 16);
        let ops = step_costs(&m, &s, &H100_SXM);
        let tokens = 3.0 * 16.0;
        let dense = flops(&ops, |o| o.kind == OpKind::Gemm);
        // The head's backward recomputes the logits: 8 flops per lm_head parameter per scored token.
        assert_eq!(dense, 6.0 * 3.0 * layer * tokens + 8.0 * lm_head * tokens);
        // Checkpointing recomputes the layers' forward (2 flops per matrix parameter per token), not the head.
        let ckpt = step_costs(&m, &StepShape { checkpoint_layers: true, ..s }, &H100_SXM);
        assert_eq!(flops(&ckpt, |o| o.kind == OpKind::Gemm), dense + 2.0 * 3.0 * layer * tokens);
        // A reference forward adds one forward of everything; only 10 scored tokens shrink the head.
        let reference = step_costs(&m, &StepShape { reference_forward: true, ..s }, &H100_SXM);
        assert_eq!(flops(&reference, |o| o.kind == OpKind::Gemm), dense + 2.0 * (3.0 * layer + lm_head) * tokens);
        let scored = step_costs(&m, &StepShape { scored_tokens: 10, ..s }, &H100_SXM);
        assert_eq!(flops(&scored, |o| o.kind == OpKind::Gemm), dense - 8.0 * lm_head * 3.0 * 6.0);
    }

    #[test]
    fn lora_drops_the_weight_gradients_and_adds_the_adapters() {
        let m = tiny();
        let (layer, lm_head) = (576.0, 32.0 * 8.0);
        // Rank-2 adapters: 2 x ((8 + 8) + 2 (8 + 4) + (8 + 8) + 2 (8 + 16) + (16 + 8)) = 256 per layer.
        let adapters = 256.0;
        let s = StepShape { lora_rank: 2, ..shape(3, 16, 16) };
        let ops = step_costs(&m, &s, &H100_SXM);
        let tokens = 3.0 * 16.0;
        // The frozen weights: forward and the input's gradient (4 flops per parameter per token; the head's
        // 6 with its recomputed logits); the adapters: forward and both gradients (6).
        let want = 4.0 * 3.0 * layer * tokens + 6.0 * lm_head * tokens + 6.0 * 3.0 * adapters * tokens;
        assert_eq!(flops(&ops, |o| o.kind == OpKind::Gemm), want);
        // The gradients and the update are the adapters' (f32).
        let update = ops.iter().find(|o| o.name == "AdamW update (device)").unwrap();
        assert_eq!(update.bytes, 36.0 * 3.0 * adapters);
        // kernels/lora.cu's element-wise steps run in 16-byte packs where the build's kernels do.
        for build in [MeasuredBuild::Current, MeasuredBuild::H100Nov27b] {
            let ops = step_costs(&m, &StepShape { build, ..s }, &H100_SXM);
            let lora: Vec<_> = ops.iter().filter(|o| o.name == "LoRA element-wise").collect();
            assert_eq!(lora.len(), 7 * 2, "7 projections (all layers in one), forward and backward");
            assert!(lora.iter().all(|o| o.packed == build.packed_kernels()), "{build:?}");
        }
    }

    #[test]
    fn attention_flops_follow_the_causal_blocks() {
        let m = tiny();
        // T = 10, blocks of 4: query blocks of 4, 4, 2 rows see 4, 8, 10 keys: 16 + 32 + 20 = 68 scores.
        assert_eq!(computed_scores(10, AttentionBlocks { query: 4, key: 4 }), (68.0, 6.0));
        // Blocks of 1 compute exactly the lower triangle, T (T + 1) / 2.
        assert_eq!(computed_scores(10, AttentionBlocks { query: 1, key: 1 }).0, 55.0);
        // One block holding everything computes the full square.
        assert_eq!(computed_scores(10, AttentionBlocks { query: 16, key: 16 }).0, 100.0);
        let ops = step_costs(&m, &shape(2, 10, 10), &H100_SXM);
        let fwd = flops(&ops, |o| o.name == "attention GEMMs (forward)");
        let bwd = flops(&ops, |o| o.name == "attention GEMMs (backward)");
        // 2 answers x 3 layers x 2 heads x 4 head_dim per score, 2 GEMMs of 2 flops forward.
        assert_eq!(fwd, 2.0 * 3.0 * 2.0 * 4.0 * 4.0 * 68.0);
        assert_eq!(bwd, 2.5 * fwd);
        // Recomputed layers run the attention's forward twice; with its output kept, once, and copy the
        // kept output ([N, heads x head_dim] read and written, 2 B each) once per layer and micro-batch
        // instead (2 micro-batches x 3 layers).
        let ckpt = StepShape { checkpoint_layers: true, ..shape(2, 10, 10) };
        let fwd_of = |s: StepShape| flops(&step_costs(&m, &s, &H100_SXM), |o| o.name == "attention GEMMs (forward)");
        assert_eq!(fwd_of(ckpt), 2.0 * fwd);
        let kept = StepShape { recompute_attention: false, ..ckpt };
        assert_eq!(fwd_of(kept), fwd);
        let copy = step_costs(&m, &kept, &H100_SXM);
        let copy = copy.iter().find(|o| o.name.starts_with("attention output copy")).expect("the copy");
        assert_eq!((copy.bytes, copy.launches, copy.attention), (6.0 * 2.0 * 10.0 * 8.0 * 2.0, 6.0, true));
        // Useful attention work no longer counts a recomputation.
        let (with, without) = (predict(&m, &ckpt, &H100_SXM), predict(&m, &kept, &H100_SXM));
        assert!(without.step_s < with.step_s && without.mfu > with.mfu, "{without:?} vs {with:?}");
    }

    /// The tensor-core kernels' counts: 4 hd FLOPs per score of the forward's 64 x 32 causal blocks, 6 hd
    /// per score of the dq kernel's 64 x 32 blocks and 8 hd per score of the dk/dv kernel's 64-key blocks
    /// against the 16-query blocks from their first key on; one launch forward, two backward (plus
    /// delta's element-wise ops), and on the 7B recipe a shorter attention than the chunked GEMMs'.
    #[test]
    fn tensor_core_attention_follows_its_kernels() {
        let m = tiny();
        // T = 100, 64-key blocks from query blocks of 16: keys 0..63 see queries 0..99 (7 blocks), keys
        // 64..99 queries 64..99 (3 blocks).
        assert_eq!(computed_scores_by_keys(100, 64, 16), (64.0 * 100.0 + 36.0 * 36.0, 10.0));
        let s = StepShape { tensor_cores: true, ..shape(2, 100, 100) };
        let ops = step_costs(&m, &s, &H100_SXM);
        let (fwd_scores, _) = computed_scores(100, AttentionBlocks { query: 64, key: 32 });
        let (dq_scores, _) = computed_scores(100, AttentionBlocks { query: 64, key: 32 });
        let bh = 2.0 * 2.0 * 3.0; // answers x heads x layers
        assert_eq!(flops(&ops, |o| o.name == "attention kernels (forward)"), bh * 4.0 * 4.0 * fwd_scores);
        let bwd = bh * 4.0 * (6.0 * dq_scores + 8.0 * (64.0 * 100.0 + 36.0 * 36.0));
        assert_eq!(flops(&ops, |o| o.name == "attention kernels (backward)"), bwd);
        let launches =
            |ops: &[OpCost]| ops.iter().filter(|o| o.kind.tensor_core_attention()).map(|o| o.launches).sum::<f64>();
        // Per layer and micro-batch: the forward and the backward's three (dq, dk/dv, the parts' sum).
        assert_eq!(launches(&ops), 2.0 * 3.0 * 4.0);
        assert!(ops.iter().all(|o| o.kind != OpKind::AttentionGemm));
        let seven = StepShape {
            answers: 16,
            micro_batch: 2,
            seq_tokens: 18432,
            scored_tokens: 16384,
            blocks: driver_blocks(&seven_b(), 18432),
            ..shape(1, 1, 1)
        };
        // dq by atomics: the dk/dv kernel's 10 hd FLOPs per score, four launches.
        let atomic = step_costs(&m, &StepShape { atomic_dq: true, ..s }, &H100_SXM);
        let bwd = bh * 4.0 * 10.0 * (64.0 * 100.0 + 36.0 * 36.0);
        assert_eq!(flops(&atomic, |o| o.name == "attention kernels (backward)"), bwd);
        assert_eq!(launches(&atomic), 2.0 * 3.0 * 5.0);
        for gpu in &GPUS {
            let chunked = predict(&seven_b(), &seven, gpu);
            let mma = predict(&seven_b(), &StepShape { tensor_cores: true, ..seven }, gpu);
            let atomic = predict(&seven_b(), &StepShape { tensor_cores: true, atomic_dq: true, ..seven }, gpu);
            // The mma kernels' atomic backward was not measured: it stands at their two-kernel rate.
            assert!((atomic.attention_s - mma.attention_s).abs() < 1e-9 * mma.attention_s, "{}", gpu.name);
            assert!(mma.attention_s < 0.7 * chunked.attention_s, "{}: {mma:?} vs {chunked:?}", gpu.name);
            assert!(mma.launches < chunked.launches / 10.0, "{}", gpu.name);
        }
    }

    /// The warpgroup kernels' counts: the same products per score as the tensor-core kernels' over their
    /// 128 x 64 blocks (forward and dq kernel) and 128-key blocks against 64-query steps (dk/dv kernel),
    /// both backwards, at their own efficiency on the H100; on the A100, which has no wgmma, the
    /// tensor-core kernels' prediction exactly.
    #[test]
    fn warpgroup_attention_follows_its_kernels_where_the_gpu_has_wgmma() {
        let m = tiny();
        let s = StepShape { tensor_cores: true, warpgroup: true, ..shape(2, 100, 100) };
        let ops = step_costs(&m, &s, &H100_SXM);
        let (scores, _) = computed_scores(100, AttentionBlocks { query: 128, key: 64 });
        // T = 100 in one 128-key block against query steps of 64: keys 0..99 see queries 0..99 (2 steps).
        assert_eq!(computed_scores_by_keys(100, 128, 64), (100.0 * 100.0, 2.0));
        let bh = 2.0 * 2.0 * 3.0; // answers x heads x layers
        assert_eq!(flops(&ops, |o| o.name == "attention kernels (forward)"), bh * 4.0 * 4.0 * scores);
        let bwd = bh * 4.0 * (6.0 * scores + 8.0 * 100.0 * 100.0);
        assert_eq!(flops(&ops, |o| o.name == "attention kernels (backward)"), bwd);
        // The forward at its own efficiency (ping-pong and pipelining), the backward at the backward's.
        let kinds = |name: &str| ops.iter().filter(|o| o.name == name).map(|o| o.kind).collect::<Vec<_>>();
        assert!(kinds("attention kernels (forward)").iter().all(|k| *k == OpKind::AttentionWgmmaForward));
        assert!(kinds("attention kernels (backward)").iter().all(|k| *k == OpKind::AttentionWgmma));
        assert!(ops.iter().all(|o| o.kind != OpKind::AttentionMma && o.kind != OpKind::AttentionGemm));
        // dq by atomics: the dk/dv kernel's 10 hd FLOPs per score of its 128-key blocks, four launches.
        let atomic = step_costs(&m, &StepShape { atomic_dq: true, ..s }, &H100_SXM);
        assert_eq!(flops(&atomic, |o| o.name == "attention kernels (backward)"), bh * 4.0 * 10.0 * 100.0 * 100.0);
        let wgmma = |k: OpKind| k.tensor_core_attention();
        let launches = |ops: &[OpCost]| ops.iter().filter(|o| wgmma(o.kind)).map(|o| o.launches).sum::<f64>();
        assert_eq!((launches(&ops), launches(&atomic)), (2.0 * 3.0 * 4.0, 2.0 * 3.0 * 5.0));
        let seven = StepShape {
            answers: 16,
            micro_batch: 2,
            seq_tokens: 18432,
            scored_tokens: 16384,
            tensor_cores: true,
            ..shape(1, 1, 1)
        };
        let wgmma = StepShape { warpgroup: true, ..seven };
        let (h_mma, h_wg) = (predict(&seven_b(), &seven, &H100_SXM), predict(&seven_b(), &wgmma, &H100_SXM));
        assert!(h_wg.attention_s < 0.8 * h_mma.attention_s, "{h_wg:?} vs {h_mma:?}");
        let (a_mma, a_wg) = (predict(&seven_b(), &seven, &A100_80GB), predict(&seven_b(), &wgmma, &A100_80GB));
        assert_eq!((a_wg.step_s, a_wg.flops, a_wg.launches), (a_mma.step_s, a_mma.flops, a_mma.launches));
        // Measured on the H100 (2026-11-27b, head dim 128): the backward with dq by atomics 3% slower than
        // the two-kernel one at 16k tokens, 1% at 4k; the forwards alike.
        let measured = StepShape { build: MeasuredBuild::H100Nov27b, ..wgmma };
        let two = predict(&seven_b(), &measured, &H100_SXM);
        let atomic = predict(&seven_b(), &StepShape { atomic_dq: true, ..measured }, &H100_SXM);
        assert!((atomic.attention_s / two.attention_s - 1.025).abs() < 0.01, "{atomic:?} vs {two:?}");
        // This build's projection: the two-kernel backward's leaner dk/dv loop gains more than the atomic
        // one's two stages at 128; both faster than measured: the attention (its kernels, calibration's
        // Leaner, and the backward's delta in one pass) by 10-20%.
        let atomic_now = predict(&seven_b(), &StepShape { atomic_dq: true, ..wgmma }, &H100_SXM);
        assert!(h_wg.attention_s < atomic_now.attention_s && atomic_now.attention_s < atomic.attention_s);
        let gain = h_wg.attention_s / two.attention_s;
        assert!(gain > 0.8 && gain < 0.9, "{gain}");
    }

    /// This build's layers' element-wise kernels move 16-byte packs, at the packed efficiency; the builds the
    /// H100 runs measured moved the same bytes one element at a time, but for candle's residual adds.
    #[test]
    fn packed_kernels_run_at_their_own_efficiency() {
        let (m, s) = (seven_b(), shape(8, 4096, 3072));
        let now = step_costs(&m, &s, &H100_SXM);
        let then = step_costs(&m, &StepShape { build: MeasuredBuild::H100Nov27b, ..s }, &H100_SXM);
        let ew = |ops: &[OpCost], packed: bool, f: &dyn Fn(&OpCost) -> f64| {
            let layer = |o: &&OpCost| o.name == "layer element-wise" && o.packed == packed;
            ops.iter().filter(layer).map(f).sum::<f64>()
        };
        let bytes = |ops: &[OpCost], packed| ew(ops, packed, &|o| o.bytes);
        let total = bytes(&now, true) + bytes(&now, false);
        assert!((total / (bytes(&then, true) + bytes(&then, false)) - 1.0).abs() < 1e-12);
        let share = |ops: &[OpCost]| bytes(ops, true) / total;
        assert!(share(&now) == 1.0 && share(&then) < 0.2, "{} {}", share(&now), share(&then));
        let time = |ops: &[OpCost], packed| ew(ops, packed, &|o| device_time(o, &H100_SXM));
        let hbm = H100_SXM.memory_bandwidth;
        let (packed, single) = (H100_SXM.packed_memory_efficiency, H100_SXM.memory_efficiency);
        assert!((time(&now, true) * hbm * packed / bytes(&now, true) - 1.0).abs() < 1e-9);
        assert!((time(&then, false) * hbm * single / bytes(&then, false) - 1.0).abs() < 1e-9);
    }

    #[test]
    fn the_seven_b_step_is_about_its_hand_count() {
        let m = seven_b();
        let s = StepShape {
            answers: 256,
            micro_batch: 2,
            seq_tokens: 18432,
            scored_tokens: 16384,
            blocks: AttentionBlocks { query: 1024, key: 1024 },
            checkpoint_layers: true,
            recompute_attention: true,
            ..shape(1, 1, 1)
        };
        let ops = step_costs(&m, &s, &H100_SXM);
        // Dense GEMMs: 8 flops per matrix parameter per token with recomputation (the head: 8 per scored).
        let p = m.num_parameters() as f64;
        let embed = (m.vocab_size * m.hidden_size) as f64;
        let layers = p - 2.0 * embed;
        let tokens = 256.0 * 18432.0;
        let expected = 8.0 * layers * tokens + 8.0 * embed * 256.0 * 16384.0;
        let dense = flops(&ops, |o| o.kind == OpKind::Gemm);
        assert!((dense / expected - 1.0).abs() < 1e-3, "{dense:e} vs {expected:e}");
        // Attention: the causal half of 4 T^2 hd heads per layer forward, x 3.5 for the backward plus 1
        // recomputed, within the diagonal blocks' waste (half a block row per query block: ~5%).
        let causal = 256.0 * 28.0 * 4.0 * 18432f64.powi(2) * 128.0 * 28.0 / 2.0;
        let attention = flops(&ops, |o| o.kind == OpKind::AttentionGemm);
        let ratio = attention / (4.5 * causal);
        assert!((1.0..1.07).contains(&ratio), "{ratio}");
    }

    #[test]
    fn predicted_time_grows_with_the_work_and_shrinks_with_the_gpu() {
        let m = seven_b();
        let base = StepShape {
            answers: 16,
            micro_batch: 2,
            seq_tokens: 4096,
            scored_tokens: 3072,
            blocks: AttentionBlocks { query: 512, key: 512 },
            ..shape(1, 1, 1)
        };
        let t = |s: &StepShape, g: &Gpu| predict(&m, s, g).step_s;
        assert!(t(&base, &H100_SXM) < t(&base, &A100_80GB));
        for more in [
            StepShape { answers: 32, ..base },
            StepShape { seq_tokens: 8192, ..base },
            StepShape { checkpoint_layers: true, ..base },
            StepShape { reference_forward: true, ..base },
            StepShape { offload: true, ..base },
            StepShape { logprob_chunk_bytes: 64 << 20, ..base },
        ] {
            assert!(t(&more, &H100_SXM) > t(&base, &H100_SXM), "{more:?}");
        }
        // Attention's share of the time grows with the length (quadratic against linear).
        let share = |s: &StepShape| {
            let p = predict(&m, s, &H100_SXM);
            p.attention_s / p.step_s
        };
        assert!(share(&StepShape { seq_tokens: 16384, ..base }) > share(&base));
        let p = predict(&m, &base, &H100_SXM);
        assert!(p.mfu > 0.0 && p.mfu < 1.0 && p.attention_of_peak < 1.0, "{p:?}");
        assert!((p.gemm_s + p.attention_s + p.elementwise_s + p.host_s + p.sync_s - p.step_s).abs() < 1e-9);
        // The ops' breakdown holds the device's time, longest first; at 16k the attention's backward leads.
        let device: f64 = p.ops.iter().map(|o| o.device_s).sum();
        assert!((device - (p.gemm_s + p.attention_s + p.elementwise_s)).abs() < 1e-9 * p.step_s.max(1.0));
        assert!(p.ops.windows(2).all(|w| w[0].device_s >= w[1].device_s));
        let long =
            predict(&m, &StepShape { seq_tokens: 16384, tensor_cores: true, warpgroup: true, ..base }, &H100_SXM);
        assert_eq!((long.ops[0].op, long.ops[0].window), ("attention kernels (backward)", "backward"));
        let line = longest_ops(&long.ops, long.step_s, 2);
        assert!(line.starts_with("backward attention kernels ") && line.matches('%').count() == 2, "{line}");
        assert!(p.syncs == 1.0, "one per step: {}", p.syncs);
        let measured = predict(&m, &StepShape { build: MeasuredBuild::H100Nov27b, ..base }, &H100_SXM);
        assert!(measured.syncs == 9.0, "the H100 runs' builds: one per micro-batch and one per step");
    }

    /// The offloaded update of this build hides all but one chunk's copies behind the host's update; the
    /// H100 run's build paid the copies and the update one after the other.
    #[test]
    fn offloaded_copies_overlap_the_host_update_but_one_chunk() {
        let m = seven_b();
        let s = StepShape { offload: true, ..shape(8, 4096, 3072) };
        let update = |s: &StepShape| {
            let p = predict(&m, s, &H100_SXM);
            let w = p.windows.iter().find(|w| w.window == "update").expect("an update window").clone();
            (p.offload_update_s, w)
        };
        let (overlapped, w) = update(&s);
        let (serial, w_run) = update(&StepShape { build: MeasuredBuild::H100Nov26, ..s });
        let pcie = H100_SXM.pcie_bandwidth;
        let chunk = offload_chunk_bytes(1e10, 2.0);
        assert!(w.pcie_bytes > 10.0 * chunk, "{w:?}");
        assert_eq!((w.serial_pcie_bytes, w_run.serial_pcie_bytes), (chunk, w_run.pcie_bytes));
        let hidden = ((w.pcie_bytes - chunk) / pcie).max(w.host_update_s);
        assert!((overlapped - (chunk / pcie + hidden)).abs() < 1e-9, "{overlapped} {w:?}");
        assert!((serial - (w_run.pcie_bytes / pcie + w_run.host_update_s)).abs() < 1e-9, "{serial} {w_run:?}");
        // The update alone (`grpo bench optimizer`'s prediction) is the step's update window.
        let params = w.pcie_bytes / 6.0;
        assert!((offload_update_s(params, 2.0, &H100_SXM) - overlapped).abs() < 1e-9);
        // The same host work for both builds' counts aside, the overlap saves the hidden copies.
        let run_with_fused_rate = w_run.pcie_bytes / pcie + w.host_update_s;
        assert!(
            overlapped < run_with_fused_rate - 0.5 * (w.pcie_bytes - chunk) / pcie,
            "{overlapped} {run_with_fused_rate}"
        );
    }

    #[test]
    fn block_choice_and_comms() {
        let m = seven_b();
        let s = StepShape { answers: 2, micro_batch: 2, seq_tokens: 16384, scored_tokens: 16000, ..shape(1, 1, 1) };
        let b = best_blocks(&m, &s, &H100_SXM);
        assert!(BLOCK_CANDIDATES.contains(&b.query) && b.query >= 256, "{b:?}");
        // The op's own GPU blocks are within 15% of the model's best square blocks at the seed's shape (the
        // calibrated launch cost favours larger blocks than the driver's 146 x 2048: 12% slower than
        // 1024 x 1024 in the model).
        let driver = driver_blocks(&m, s.seq_tokens);
        let (ours, best) = (attention_time(&m, &s, driver, &H100_SXM), attention_time(&m, &s, b, &H100_SXM));
        assert!(ours <= 1.15 * best, "driver {driver:?}: {ours} s, model's best {b:?}: {best} s");
        // One rank moves nothing; 8 ranks in a node move 7/8 of 8 B per parameter (f32 gradients, f32
        // weights) over NVLink, and 4 (4 + 2 / 8) B per parameter over PCIe.
        assert_eq!(zero1_comms(1000, 1, 8, &H100_SXM).seconds(), 0.0);
        let c8 = zero1_comms(8_000, 8, 8, &H100_SXM);
        assert_eq!((c8.link_bytes, c8.pcie_bytes), (7.0 / 8.0 * 8_000.0 * 8.0, 8_000.0 * 17.0));
        assert!((c8.link_s - c8.link_bytes / (450e9 * COLLECTIVE_EFFICIENCY)).abs() < 1e-18);
        assert!((c8.pcie_s - c8.pcie_bytes / 50e9).abs() < 1e-18);
        let c64 = zero1_comms(8_000, 64, 8, &H100_SXM);
        assert!(c64.link_s > 8.0 * c8.link_s, "InfiniBand is 9x slower than NVLink per GPU");
    }
}
