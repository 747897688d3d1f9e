//! A performance model of a training step, checkable without a GPU: the FLOPs, device bytes, launches and
//! host syncs of every op of a step, counted from its own arithmetic, and the time they predict on each
//! modelled GPU (each op's roofline, summed by window). What is counted: docs/performance-model.md.

use crate::model::ModelConfig;

pub use super::calibration::{gpus, h100, Build, Calibration, Gpu, KernelRates, RateAt, TensorOps, TENSOR_OPS};

/// The block sizes of chunked attention: query rows and keys per block product.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionBlocks {
    pub query: u64,
    pub key: u64,
}

/// The square block sizes [`best_blocks`] chooses from.
const BLOCK_CANDIDATES: [u64; 6] = [64, 128, 256, 512, 1024, 2048];

/// What kind of work an op is, for its efficiency.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpKind {
    /// A projection's or the lm_head's GEMM.
    Gemm,
    /// Chunked attention's block products (cuBLAS, inner dimension the head's).
    AttentionGemm,
    /// kernels/flash_mma.cu, forward and backward.
    AttentionMmaForward,
    AttentionMma,
    /// kernels/flash_wgmma.cu (compute capability 9.0): backward, forward, backward with atomic dq.
    AttentionWgmma,
    AttentionWgmmaForward,
    AttentionWgmmaAtomic,
    /// Element-wise and reductions, memory-bound.
    Elementwise,
    /// The offloaded update (`optim.offload`): PCIe and host memory.
    Host,
}

impl OpKind {
    /// The tensor-core attention kernels, timed as their useful FLOPs at a measured rate.
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
    /// Device memory bytes (for [`OpKind::Host`]: PCIe bytes).
    pub bytes: f64,
    /// [`OpKind::Host`]: host memory bytes, at `host_rate` bytes a second.
    pub host_bytes: f64,
    pub host_rate: f64,
    /// Kernel launches and candle tensor ops the host issues.
    pub launches: f64,
    pub syncs: f64,
    pub attention: bool,
    /// Tensor-core attention: the causal useful FLOPs its measured rates are quoted in, at these tokens
    /// and head dim.
    pub useful_flops: f64,
    pub seq_tokens: u64,
    pub head_dim: u64,
    /// A GEMM's product, rows by columns ([`tile_utilization`]); 0 for other ops.
    pub product: (f64, f64),
    pub window: Window,
    /// Moves 16-byte packs (at [`Gpu::packed_memory_efficiency`]).
    pub packed: bool,
}

/// The stretch of the step an op runs in: the host issues ops while the device runs those issued before,
/// so a window lasts the longer of the two; a host sync ends it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Window {
    Reference,
    Forward,
    /// With the recomputation, the embedding's gradient and the accumulation.
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

/// A cuBLAS GEMM's output tile per thread block (the fit of [`Gpu::gemm_efficiency`] took 128 x 128).
const GEMM_TILE: f64 = 128.0;

/// The share of `gpu`'s multiprocessors an `m` x `n` product keeps busy: its tiles run in waves of one
/// per multiprocessor, the last part-full.
fn tile_utilization(m: f64, n: f64, gpu: &Gpu) -> f64 {
    let tiles = (m / GEMM_TILE).ceil().max(1.0) * (n / GEMM_TILE).ceil().max(1.0);
    let sms = gpu.multiprocessors as f64;
    tiles / ((tiles / sms).ceil() * sms)
}

/// The FLOP/s `gpu` gives a GEMM with an `m` x `n` product.
pub fn gemm_flops_per_s(m: f64, n: f64, gpu: &Gpu) -> f64 {
    gpu.peak_flops * gpu.gemm_efficiency * tile_utilization(m, n, gpu)
}

/// Fraction of the link bandwidth NCCL's ring collectives reach (bus bandwidth / link bandwidth).
pub const COLLECTIVE_EFFICIENCY: f64 = 0.8;

/// The batch of one training step, as the model needs it.
#[derive(Debug, Clone, Copy)]
pub struct StepShape {
    /// Sequences in the step, and per forward/backward.
    pub answers: u64,
    pub micro_batch: u64,
    /// Tokens per sequence (prompt + answer), of which scored.
    pub seq_tokens: u64,
    pub scored_tokens: u64,
    pub dtype_bytes: u64,
    pub checkpoint_layers: bool,
    /// With `checkpoint_layers`: the attention's forward recomputed (else its kept output copied).
    pub recompute_attention: bool,
    /// A reference forward per micro-batch (its log-probs not cached).
    pub reference_forward: bool,
    pub offload: bool,
    /// This build, or one a GPU run measured (benches/results/builds/).
    pub build: Build,
    pub logprob_chunk_bytes: u64,
    /// ZeRO-1 ranks sharing the optimiser state.
    pub optimizer_shards: u64,
    pub blocks: AttentionBlocks,
    /// The tensor-core kernels (else chunked GEMMs in `blocks`); dq by atomics; the warpgroup kernels
    /// where the GPU has them.
    pub tensor_cores: bool,
    pub atomic_dq: bool,
    pub warpgroup: bool,
    /// LoRA's rank, 0 for full fine-tuning.
    pub lora_rank: u64,
    /// `model.keep_logits`: no recomputed logits GEMM in the head's backward.
    pub keep_logits: bool,
}

/// The tensor-core attention kernels a step runs (kernels/flash_mma.cu, flash_wgmma.cu); `true`: dq
/// summed by atomics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TensorCoreKernels {
    Mma(bool),
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

/// The scores (and block pairs) blocked causal attention computes for one sequence and head.
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

/// The query-key pairs of causal attention over `t` tokens.
fn causal_pairs(t: u64) -> f64 {
    t as f64 * (t as f64 + 1.0) / 2.0
}

/// A collector of op costs, each multiplied by how many times it runs in the step.
struct Ops {
    ops: Vec<OpCost>,
    times: f64,
    window: Window,
    counts: TensorOps,
    /// [`Build::packed_kernels`].
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

    /// An element-wise op.
    fn elementwise(&mut self, name: &'static str, bytes: f64, launches: f64, packed: bool) {
        self.push(name, OpKind::Elementwise, 0.0, bytes, launches);
        self.ops.last_mut().expect("just pushed").packed = packed;
    }

    /// A tensor-core attention kernel: `work` (FLOPs, useful FLOPs), `io` (bytes, launches), `at`
    /// (tokens, head dim).
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

    /// A GEMM's backward: two of the forward's size, tiles counted on its product.
    fn gemm_backward(&mut self, name: &'static str, m: f64, k: f64, n: f64, d: f64, count: f64) {
        self.gemm(name, m, k, n, d, 2.0 * count);
    }

    /// The backward of a product with a trained `[k, n]` weight; with `fused_wgrad` the weight's gradient
    /// GEMM reads and writes the f32 accumulator itself.
    fn weight_backward(&mut self, name: &'static str, m: f64, k: f64, n: f64, d: f64, count: f64) {
        if !self.counts.fused_wgrad {
            return self.gemm_backward(name, m, k, n, d, count);
        }
        self.gemm(name, m, k, n, d, count);
        self.push(name, OpKind::Gemm, 2.0 * m * k * n * count, ((m * k + m * n) * d + 8.0 * k * n) * count, count);
        self.ops.last_mut().expect("just pushed").product = (m, n);
    }
}

/// Which pass over the layers an op belongs to (`Recompute`: `checkpoint_layers`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pass {
    Reference,
    Policy,
    Recompute,
    Backward,
}

/// The tensor ops of the build `s` is predicted for.
fn counts(s: &StepShape) -> TensorOps {
    s.build.tensor_ops
}

/// The tensors candle makes in a step of `m` on `s` (what `grpo bench train-step` counts).
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
        // x A^T then (x A) B^T of every projection, in f32; the reference has none.
        let r = lora_rank as f64;
        let gemm = if backward { Ops::gemm_backward } else { Ops::gemm };
        for (k, n) in [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)] {
            gemm(o, "LoRA adapters", n_tokens, k, r, 4.0, 1.0);
            gemm(o, "LoRA adapters", n_tokens, r, n, 4.0, 1.0);
            // kernels/lora.cu's element-wise steps around them.
            let (bytes, launches) = match backward {
                false => ((d + 4.0) * k + (2.0 * d + 4.0) * n, 2.0),
                true => ((d + 4.0) * n + (d + 4.0) * k + (2.0 * d + 4.0) * k, 3.0),
            };
            o.elementwise("LoRA element-wise", bytes * n_tokens, launches, o.packed);
        }
    }
    layer_elementwise(o, m, (n_tokens, d), pass);
}

/// A layer's element-wise op: elements moved per token forward and backward, tensor ops, packed.
struct Named {
    forward: f64,
    backward: f64,
    launches: f64,
    packed: bool,
}

/// The element-wise ops of one layer's pass: the named ops' bytes over the pass's counted tensor ops.
fn layer_elementwise(o: &mut Ops, m: &ModelConfig, (n_tokens, d): (f64, f64), pass: Pass) {
    let backward = pass == Pass::Backward;
    let f = |x: usize| x as f64;
    let (h, i) = (f(m.hidden_size), f(m.intermediate_size));
    let q = f(m.num_heads) * f(m.head_dim);
    let kv = f(m.num_kv_heads) * f(m.head_dim);
    // candle's add of two contiguous tensors is packed in every build.
    let ours = o.packed;
    let named = |forward, backward, launches, packed| Named { forward, backward, launches, packed };
    let mut ew = vec![
        // Two RMSNorms: read x, write y; backward read x and g, write dx (the weight's partials aside).
        named(4.0 * h, 6.0 * h, 2.0, ours),
        // Rope on q and k, with their transpose to heads, each way.
        named(2.0 * (q + kv), 2.0 * (q + kv), 2.0, ours),
        // v to heads and the attention's output back, each way.
        named(2.0 * (q + kv), 2.0 * (q + kv), 2.0, ours),
        // Two residual adds, and their gradients' sums in the backward.
        named(6.0 * h, 6.0 * h, 2.0, true),
        // SwiGLU: read gate and up, write the product; backward read both and the gradient, write two.
        named(3.0 * i, 5.0 * i, 1.0, ours),
    ];
    // Biases: the add; backward, the bias's gradient.
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
    // The pass's tensor ops but its GEMMs (7 forward, 14 backward) and the attention op.
    let counted = match pass {
        Pass::Reference => o.counts.layer_reference,
        Pass::Policy => o.counts.layer_policy,
        Pass::Recompute => o.counts.layer_recompute,
        Pass::Backward => o.counts.layer_backward,
    };
    let launches = (counted - 7.0 * scale - 1.0).max(0.0);
    // The other tensor ops are views that move no bytes, but in a build whose unnamed ops were passes of
    // their own (`unnamed_ops_move_bytes`), each moving the named ops' mean bytes.
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
        // A backward seeded by (y g).sum_all().
        o.push("layer element-wise", OpKind::Elementwise, 0.0, o.counts.seed_passes * h * n_tokens * d, 0.0);
    }
}

/// The log-prob head on `n` scored tokens, chunk by chunk.
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

/// One forward of every layer per micro-batch in `pass`, with the embedding and head but in recomputation.
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
    // f32 atomics into the table's gradient: the accumulator with `fused_wgrad`, else a zeroed table.
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
        // The fused update streams as a packed kernel does; the composite one does not.
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

/// Of the `(parameters, tensors)` trained: those kernels::accumulate adds each micro-batch, and the
/// tensors whose accumulators the first micro-batch makes (with `fused_wgrad` the matrices' own kernels add
/// into accumulators made before).
fn accumulated(m: &ModelConfig, s: &StepShape, (p, tensors): (f64, f64)) -> (f64, f64, f64) {
    match counts(s).fused_wgrad && s.lora_rank == 0 {
        true => {
            let (fp, ft) = fused_gradient_parameters(m);
            (p - fp, tensors - ft, ft)
        }
        false => (p, tensors, tensors),
    }
}

/// The parameters and tensors of the matrices, whose kernels add their gradients (`fused_wgrad`).
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

/// The device's time for one op on `gpu`: its roofline, or a tensor-core attention kernel's useful FLOPs
/// at its measured rate.
fn device_time(op: &OpCost, gpu: &Gpu) -> f64 {
    let bw = gpu.memory_bandwidth * gpu.memory_efficiency;
    // A GEMM streams its operands as the packed kernels do.
    let streamed = gpu.memory_bandwidth * gpu.packed_memory_efficiency;
    let roofline = |flops_per_s: f64| (op.flops / flops_per_s).max(op.bytes / streamed);
    // Rates are measured at head dim 128 (and 64 for wgmma); a smaller head keeps the time per score.
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

/// The host's time for one op on `gpu`: its launches, and the offloaded update's work.
fn host_time(op: &OpCost, gpu: &Gpu) -> f64 {
    let own = match op.kind {
        OpKind::Host => op.bytes / gpu.pcie_bandwidth + op.host_bytes / op.host_rate,
        _ => 0.0,
    };
    let per_launch = if op.attention { gpu.kernel_launch_s } else { gpu.launch_s };
    op.launches * per_launch + own
}

/// A step's predicted time on one GPU: the device's time per kind of op, its waits for the host, and the
/// host syncs, which add up to the step.
#[derive(Debug, Clone)]
pub struct Prediction {
    pub gpu: Gpu,
    pub step_s: f64,
    pub tokens_per_s: f64,
    pub mfu: f64,
    /// The attention's useful FLOPs per second over the peak, while it runs.
    pub attention_of_peak: f64,
    pub gemm_s: f64,
    pub attention_s: f64,
    pub elementwise_s: f64,
    /// The device's waits for the host (issuing ops; the offloaded update).
    pub host_s: f64,
    pub sync_s: f64,
    pub offload_update_s: f64,
    pub launches: f64,
    pub syncs: f64,
    pub flops: f64,
    pub bytes: f64,
    /// Each window's work (what scripts/calibrate.py fits on).
    pub windows: Vec<WindowCost>,
    /// The ops by window and name, longest first.
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
    /// Of `device_s`, the unpacked element-wise kernels'.
    pub elementwise_s: f64,
    /// candle's tensor ops, and the attention kernels' own launches.
    pub launches: f64,
    pub kernel_launches: f64,
    /// The offloaded update's PCIe and host bytes, and the host's time on them.
    pub pcie_bytes: f64,
    pub host_bytes: f64,
    pub host_update_s: f64,
    /// The PCIe bytes that do not overlap the update: all where they take turns, else one chunk's.
    pub serial_pcie_bytes: f64,
}

/// This build's offloaded update of `params` parameters of `d`-byte weights on `gpu`.
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

/// One default chunk's PCIe bytes in the offloaded update.
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

    /// The offloaded update's time: the serial copies, then the longer of the update and the others.
    fn offload_s(&self, gpu: &Gpu) -> f64 {
        let overlapped = (self.pcie_bytes - self.serial_pcie_bytes) / gpu.pcie_bandwidth;
        self.serial_pcie_bytes / gpu.pcie_bandwidth + self.host_update_s.max(overlapped)
    }
}

/// The predicted time of one layer's attention, forward and backward, of a micro-batch with `blocks`.
fn attention_time(m: &ModelConfig, s: &StepShape, blocks: AttentionBlocks, gpu: &Gpu) -> f64 {
    let shape = StepShape { blocks, ..*s };
    let (counts, packed) = (counts(&shape), shape.build.packed_kernels);
    let mut o = Ops { ops: Vec::new(), times: 1.0, window: Window::Forward, counts, packed };
    let b = shape.micro_batch.min(shape.answers).max(1) as f64;
    layer_attention(&mut o, m, b, shape.seq_tokens, (blocks, None), shape.dtype_bytes as f64, false);
    layer_attention(&mut o, m, b, shape.seq_tokens, (blocks, None), shape.dtype_bytes as f64, true);
    o.ops.iter().map(|op| device_time(op, gpu).max(host_time(op, gpu))).sum::<f64>()
}

/// The fastest of [`BLOCK_CANDIDATES`] for the attention of `m` on `s` (the smaller on a tie).
pub fn best_blocks(m: &ModelConfig, s: &StepShape, gpu: &Gpu) -> AttentionBlocks {
    let time = |size: u64| attention_time(m, s, AttentionBlocks { query: size, key: size }, gpu);
    let best =
        BLOCK_CANDIDATES.iter().copied().min_by(|a, b| time(*a).total_cmp(&time(*b)).then(a.cmp(b))).unwrap_or(128);
    AttentionBlocks { query: best, key: best }
}

/// The blocks the attention op runs with on a GPU for `m` at `t` tokens (`kernels::causal_work`).
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
