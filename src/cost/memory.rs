//! The memory plan of a training run: what each component of a step needs at its peak, derived from the
//! configuration and the model's shape (its `config.json`; no weights are loaded), where it lives (the
//! device or host memory) and whether the total fits the device.
//!
//! Notation: P parameters (of which `P_layer` in the largest decoder layer and `P_max` in the largest
//! single tensor), d bytes per weight element (4 for f32, 2 for bf16/f16), L layers, hidden h, query width
//! q = heads x head_dim, key/value width kv = kv_heads x head_dim, MLP width i, vocabulary V. A micro-batch
//! is B = `train.micro_batch_size` sequences of T = `max_prompt_tokens + max_response_tokens` tokens
//! (the largest the data allows; with `[rollout]` the answers are the sampled ones, of at most
//! `rollout.max_new_tokens` + 1 tokens, see [`sequence_tokens`]), N = B T tokens, of which
//! n = B `max_response_tokens` are scored; with packed micro-batches (`train.micro_batch_tokens` = M > 0)
//! a micro-batch is one row, B = 1, of T = max(M, prompt + answer) tokens, all of which may be scored
//! (n = T; see [`micro_batch_shape`]). Sizes are computed in f64 and saturate: an absurd
//! configuration plans u64::MAX bytes (it does not fit) rather than wrapping around.
//!
//! The run's peak is `resident + max(step + max(backward, update), validation, rollouts)`:
//! - resident: the weights (P d), the optimiser state when it is on the device (AdamW: f32 master
//!   weights and two moments, 12 P; SGD: 4 P), the frozen reference (P d) unless its log-probs are cached,
//!   a snapshot anchor (P d), and the process's own memory (see [`CPU_PROCESS_BYTES`],
//!   [`CUDA_CONTEXT_BYTES`]);
//! - step: the f32 gradient accumulator (4 P: every micro-batch's gradients are added into it as they are
//!   collected), alive from the first backward to the end of the update;
//! - backward: the activations the forward keeps for the backward plus the larger of the log-prob head's
//!   backward and one layer's backward (its workspace, the parameter gradients it holds before they are
//!   added to the accumulator, and the attention workspace) — see [`Activations`];
//! - update: the temporaries of the optimiser update, which runs in place (kernels::adamw): the new weights
//!   in the model's dtype of the largest tensor (on the device without offload), or in host memory with
//!   offload the two staging slots the gradients and new weights go through (at most
//!   [`crate::device::staging::staging_bytes`] of `optim.offload_chunk_mb`, page-locked on a GPU);
//! - validation: the generation KV cache of `validation.batch_size` sequences of `max_prompt_tokens +
//!   validation.max_new_tokens` tokens, 2 L kv d bytes per token: the paged pool
//!   ([`crate::generate::GenerationOptions::pool_blocks`] blocks), or with `generation.schedule = "static"`
//!   a contiguous cache counted twice because it grows by doubling its capacity;
//! - rollouts (`[rollout]` with grpo's own sampler): the same KV cache for `rollout.batch_size` sequences
//!   of `max_prompt_tokens + rollout.max_new_tokens` tokens; a lagged sampling policy
//!   (`rollout.sync_every > 1`) is one more resident copy of the weights (P d).

pub use input::{GenerationLoad, PlanInput, RolloutLoad};

use super::time;
use crate::device::staging::{chunk_len, staging_bytes};
use crate::generate::GenerationOptions;
use crate::model::{Attention, ModelConfig};

/// Memory of the process itself on the CPU, beyond its tensors: the binary's mapped code, the tokenizer
/// (a BPE vocabulary of ~150k entries with its merges), the data reader, rayon's threads, the final
/// checkpoint's write (safetensors takes a copy of each tensor's bytes in turn) and what the allocator
/// keeps. Measured (tests/plan_cli.rs's tiny model, 2026-11-27): the process peaks at its last checkpoint
/// write, 101 or 121 MiB above the plan's tensors from one run to the next (glibc keeps freed heap up to
/// twice its dynamic mmap threshold, which the order of large frees moves); the middle of the two.
pub const CPU_PROCESS_BYTES: u64 = 112 << 20;

/// Device memory outside candle's allocation pool on a GPU: the CUDA context, the kernels' modules and
/// cuBLAS's workspaces. Assumed (a CUDA 13 context on an H100 holds about half a GiB before any module is
/// loaded); the pool's own overheads are measured ([`POOL_OVERHEAD`]).
pub const CUDA_CONTEXT_BYTES: u64 = 768 << 20;

/// What candle's memory pool holds on a GPU beyond the tensors the plan itemises, as fractions.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PoolOverhead {
    /// The pool's peak of memory in use over the plan's tensors: what the plan does not itemise (a
    /// candle op's temporaries, its gradients' copies).
    pub unitemised: f64,
    /// The pool's reserve over its peak in use: memory it keeps for reuse (`cuMemPoolTrimTo` returns
    /// it) and loses to fragmentation, which nvidia-smi counts as used.
    pub reserve: f64,
    /// Where it was measured.
    pub measured: &'static str,
}

/// Measured at the seed's 7B step (8 x (2,048 + 16,384) tokens, micro-batch 1, layers recomputed,
/// optimiser offloaded) on the H100 of benches/results/gpu-2026-11-26-h100.*: the plan's tensors 59.62
/// GiB, the pool's peak in use 62.51 GiB (x 1.0485), nvidia-smi's peak 71.33 GiB, of which 0.75 GiB
/// context ([`CUDA_CONTEXT_BYTES`]): the pool held 70.58 GiB, 1.1290 x its peak in use. At micro-batch 2
/// the plan with these fractions is 79.8 GiB of the card's 79.65 (81,559 MiB), and the run ran out of
/// memory with nvidia-smi at 79.17 GiB.
pub const POOL_OVERHEAD: PoolOverhead =
    PoolOverhead { unitemised: 0.0485, reserve: 0.1290, measured: "H100 80GB HBM3, 2026-11-26" };

/// The fraction of a GPU's memory a plan leaves free: its pool overheads were measured at one step
/// ([`POOL_OVERHEAD`]); the seed's step at micro-batch 2, planned within 1% of the card, ran out of memory.
pub const GPU_HEADROOM: f64 = 0.03;

impl PoolOverhead {
    /// The pool's size when its tensors reach `tensors` bytes of the plan.
    pub fn pooled(&self, tensors: u64) -> u64 {
        to_bytes(tensors as f64 * (1.0 + self.unitemised) * (1.0 + self.reserve))
    }
}

/// Where a component lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place {
    Device,
    Host,
}

/// When a component is alive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// The whole run.
    Resident,
    /// A training step (its forward/backward passes and the update).
    Step,
    /// The forward and backward of a micro-batch.
    Backward,
    /// The optimiser update.
    Update,
    /// Validation (generation).
    Validation,
    /// A step's rollouts (`[rollout]`: generation before the step's forward/backward).
    Rollout,
    /// Shown for comparison, not counted (the other setting of a switch).
    Alternative,
}

/// One line of the plan.
#[derive(Debug, Clone)]
pub struct Component {
    pub name: String,
    pub bytes: u64,
    pub place: Place,
    pub phase: Phase,
    /// How it is computed, in words.
    pub formula: String,
}

/// The memory plan of a run.
#[derive(Debug, Clone)]
pub struct Plan {
    pub components: Vec<Component>,
    /// What it was planned from.
    pub input: PlanInput,
    /// Model and micro-batch, for the heading.
    pub summary: String,
    /// Bytes of the log-prob op's logits chunk the run uses (as the device sizes it when not set).
    pub logprob_chunk_bytes: u64,
    /// Whether the log-prob head keeps its logits for the backward: `model.keep_logits`, or where that is
    /// "auto" the plan's choice ([`run_plan`]).
    pub keep_logits: bool,
    /// That choice and why, where "auto" made it on a GPU.
    pub keep_logits_note: Option<String>,
}

/// The activations of one micro-batch kept for (and made during) the backward, in bytes.
///
/// Per layer, the forward keeps (counted from `Decoder::layer`, each tensor once): the layer input, the
/// two RMSNorm outputs and their weighted copies, the attention output projection, the residual sum and
/// the MLP down projection (8 x [N, h], plus one per o_proj / down_proj bias); the q projection, its
/// bias sum, its rotated copy, the attention output and its transposed copy (4 x [N, q] plus one with
/// q/k/v biases); k and v with their bias sums, rotated k and transposed v (4 x [N, kv], plus two with
/// biases); q/k norms (2 x [N, q] + 2 x [N, kv] when present); gate, up, silu(gate) and the product
/// (4 x [N, i], plus two with MLP biases); and the attention: scores and probabilities (2 B heads T^2)
/// for the matrix kind, one f32 log-sum-exp per query and head (4 B heads T bytes) for flash.
///
/// With `checkpoint_layers`, the forward keeps only the L + 1 layer inputs / final output ([N, h] each)
/// and recomputes one layer at a time in the backward, so one layer's saved tensors are alive at once;
/// without it all L layers' are, plus the final output.
///
/// A layer's backward workspace is about 3 [N, i] + 3 [N, h] + 2 [N, q] of gradients, plus (matrix
/// attention) the gradients of the probabilities and scores (2 B heads T^2); flash attention works in
/// blocks (O(T)). The log-prob head keeps its gathered, normed inputs (3 [n, h]) and its backward
/// accumulates the lm_head gradient in f32 chunk by chunk (accumulator, chunk gradient and their sum:
/// 12 V h bytes; one chunk: its f32 gradient, 4 V h, and its d-byte original when d < 4) beside one
/// chunk of logits and their gradient (2 rows V d, rows = logprob_chunk_mb / (4 V))
#[derive(Debug, Clone, Copy)]
pub struct Activations {
    pub saved_full: u64,
    pub saved_checkpointed: u64,
    pub layer_backward: u64,
    pub attention_workspace: u64,
    /// With `checkpoint_layers` and `recompute_attention = false`: every layer's attention output and
    /// log-sum-exp (flash kinds).
    pub kept_attention: u64,
    pub head: u64,
    pub head_backward: u64,
    pub logprob_chunk: u64,
}

/// LoRA's sizes ([`crate::model::lora`]): the adapters' parameters, in all, in the largest layer and the
/// largest tensor, the bytes per token a layer's adapters keep for the backward (each adapted projection's
/// `[N, r]` f32 product with A, for B's gradient: `lora_linear` keeps nothing else), and the f32 buffers per
/// token of the largest adapted projection's backward (the input again with its mask and the input's
/// gradient through the adapters, `[N, in]` each, and the scaled output gradient, `[N, out]`).
struct Lora {
    params: u64,
    layer: u64,
    largest: u64,
    saved_per_token: f64,
    backward_per_token: f64,
}

impl Lora {
    fn of(m: &ModelConfig, opts: &crate::model::LoraOptions) -> Self {
        let one_layer = ModelConfig { num_layers: 1, ..m.clone() };
        let shapes = crate::model::lora::adapter_shapes(&one_layer, opts);
        let size = |s: &[usize]| s.iter().product::<usize>() as u64;
        let layer: u64 = shapes.iter().map(|(_, s)| size(s)).sum();
        let largest = shapes.iter().map(|(_, s)| size(s)).max().unwrap_or(0);
        let targets = crate::model::lora::TARGETS.iter().filter(|(t, _)| opts.targets(t));
        let saved_per_token = targets.clone().map(|_| 4.0 * opts.r as f64).sum();
        let backward_per_token = targets
            .map(|(t, _)| crate::model::lora::features(m, t))
            .map(|(i, o)| 4.0 * (2 * i + o + opts.r) as f64)
            .fold(0.0, f64::max);
        let params = layer.saturating_mul(m.num_layers as u64);
        Self { params, layer, largest, saved_per_token, backward_per_token }
    }
}

/// Sequence shape of the largest micro-batch.
struct Shape {
    b: u64,
    t: u64,
    n_scored: u64,
}

/// Bytes of a size computed in f64: exact below 2^53 (8 PiB, any real size), and an absurd
/// configuration saturates at u64::MAX (it does not fit) instead of wrapping around to a small number.
fn to_bytes(x: f64) -> u64 {
    if x.is_nan() {
        u64::MAX
    } else {
        x as u64 // saturating
    }
}

/// The largest decoder layer's and the largest tensor's parameter counts (from a one-layer copy of the
/// shape: every layer has the same tensors, and a config's layer count may be large).
fn largest_params(m: &ModelConfig) -> (u64, u64) {
    let one_layer = ModelConfig { num_layers: 1, ..m.clone() };
    let shapes = crate::model::decoder::parameter_shapes(&one_layer);
    let size = |s: &[usize]| to_bytes(s.iter().map(|&x| x as f64).product());
    let largest = shapes.iter().map(|(_, s)| size(s)).max().unwrap_or(0);
    let layer0 = shapes.iter().filter(|(n, _)| n.starts_with("model.layers.0.")).map(|(_, s)| size(s));
    (layer0.fold(0, u64::saturating_add), largest)
}

impl Activations {
    /// `lora`: per token, the bytes each layer's adapters keep for the backward (their f32 inputs).
    fn new(m: &ModelConfig, s: &Shape, d: u64, attention: Attention, chunk_bytes: u64, lora: f64) -> Self {
        let f = |x: usize| x as f64;
        let (h, i, v) = (f(m.hidden_size), f(m.intermediate_size), f(m.vocab_size));
        let q = f(m.num_heads) * f(m.head_dim);
        let kv = f(m.num_kv_heads) * f(m.head_dim);
        let (heads, l) = (f(m.num_heads), f(m.num_layers));
        let (b, t, n_scored, d) = (s.b as f64, s.t as f64, s.n_scored as f64, d as f64);
        let n = b * t;
        let flag = |x: bool| if x { 1.0 } else { 0.0 };
        let (qkv_b, o_b, mlp_b, qk_n) = (flag(m.qkv_bias), flag(m.o_bias), flag(m.mlp_bias), flag(m.qk_norm));
        let width = (8.0 + o_b + mlp_b) * h
            + (4.0 + qkv_b + 2.0 * qk_n) * q
            + (4.0 + 2.0 * qkv_b + 2.0 * qk_n) * kv
            + (4.0 + 2.0 * mlp_b) * i;
        let matrix = 2.0 * b * heads * t * t * d;
        let (attn_saved, attn_work) = match attention {
            Attention::Matrix => (matrix, matrix),
            Attention::Flash | Attention::Mma | Attention::Wgmma | Attention::Auto => {
                (4.0 * b * heads * t, 8.0 * b * heads * t)
            }
        };
        let layer = n * (width * d + lora) + attn_saved;
        let rows = (chunk_bytes as f64 / (4.0 * v).max(1.0)).floor().clamp(1.0, 65536.0).min(n_scored.max(1.0));
        let one_chunk = n_scored <= rows;
        let head_backward = match (one_chunk, d >= 4.0) {
            (true, true) => 4.0 * v * h,
            (true, false) => (4.0 + d) * v * h,
            (false, _) => 12.0 * v * h,
        };
        Self {
            saved_full: to_bytes(l * layer + n * h * d),
            saved_checkpointed: to_bytes((l + 1.0) * n * h * d + layer),
            layer_backward: to_bytes(n * (3.0 * i + 3.0 * h + 2.0 * q) * d),
            attention_workspace: to_bytes(attn_work),
            kept_attention: match attention {
                Attention::Matrix => 0,
                Attention::Flash | Attention::Mma | Attention::Wgmma | Attention::Auto => {
                    to_bytes(l * (n * q * d + 4.0 * b * heads * t))
                }
            },
            head: to_bytes(3.0 * n_scored * h * d + 16.0 * n_scored),
            head_backward: to_bytes(head_backward),
            logprob_chunk: to_bytes(2.0 * rows * v * d),
        }
    }
}

pub(super) fn gib(bytes: u64) -> String {
    format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
}

/// The plan of `input`, `model.keep_logits = "auto"` planned as not kept ([`run_plan`] decides it).
pub fn plan(input: &PlanInput) -> Plan {
    let first = plan_with_chunk(input, logprob_chunk_bytes(input, None));
    if input.decoder.logprob_chunk_bytes > 0 || input.on_cpu {
        return first;
    }
    // Left to the device, the chunk is an eighth of the memory free when the head runs (everything else
    // of the step allocated), within 1..=8 GiB: sized from the plan with the smallest chunk.
    // The pool holds the other tensors with its overheads, beside the context (as the device's free
    // memory, which the run sizes the chunk from, sees them).
    let chunk = first.components.iter().filter(|c| c.name.starts_with("log-prob chunk")).map(|c| c.bytes).max();
    let others = first.peak(Place::Device).saturating_sub(POOL_OVERHEAD.pooled(chunk.unwrap_or(0)));
    let free = input.device_memory.unwrap_or(DEFAULT_GPU_MEMORY).saturating_sub(others);
    plan_with_chunk(input, logprob_chunk_bytes(input, Some(free)))
}

/// Device memory assumed for sizing a device-sized log-prob chunk when the plan is given none (80 GB).
const DEFAULT_GPU_MEMORY: u64 = 80_000_000_000;

/// The bytes of the log-prob op's logits chunk of a run of `input`: `model.logprob_chunk_mb` when set;
/// otherwise as [`crate::kernels::logprob_chunk_bytes`] sizes it: 64 MiB on the CPU, on a GPU an eighth of
/// `free` (unknown: the 1 GiB minimum) within 1..=8 GiB.
fn logprob_chunk_bytes(input: &PlanInput, free: Option<u64>) -> u64 {
    match input.decoder.logprob_chunk_bytes {
        0 if input.on_cpu => crate::kernels::LOGPROB_CHUNK_BYTES as u64,
        0 => crate::kernels::gpu_chunk_bytes(free.unwrap_or(0)) as u64,
        bytes => bytes as u64,
    }
}

fn plan_with_chunk(input: &PlanInput, chunk_bytes: u64) -> Plan {
    let basis = Basis::of(input);
    let act = basis.activations(chunk_bytes);
    let mut c = Components::default();
    basis.resident(&mut c);
    basis.saved(&mut c, &act);
    basis.backward_peak(&mut c, &act);
    basis.update(&mut c);
    c.0.extend(generation_components(input, basis.d, basis.prompt));
    let mut summary = summary(input, &basis.shape, basis.prompt, basis.response);
    if basis.world > 1 {
        summary.push_str(&format!("; per rank of {} (ZeRO-1: the optimizer state sharded)", basis.world));
    }
    Plan {
        components: c.0,
        input: input.clone(),
        summary,
        logprob_chunk_bytes: chunk_bytes,
        keep_logits: input.keep_logits == Some(true),
        keep_logits_note: None,
    }
}

/// A plan's components in the order they are added.
#[derive(Default)]
struct Components(Vec<Component>);

impl Components {
    fn add(&mut self, name: &str, bytes: u64, place: Place, phase: Phase, formula: impl Into<String>) {
        self.0.push(Component { name: name.into(), bytes, place, phase, formula: formula.into() });
    }
}

/// What the plan's parts are computed from: the input, and what follows from it.
struct Basis<'a> {
    input: &'a PlanInput,
    model: &'a ModelConfig,
    /// Bytes of an element of the model's dtype.
    d: u64,
    /// The model's parameters.
    p: u64,
    /// The longest prompt and answer, and the largest micro-batch.
    prompt: u64,
    response: u64,
    shape: Shape,
    lora: Option<Lora>,
    /// What is trained (every weight, or the LoRA adapters): in all, in a layer, the largest tensor.
    p_train: u64,
    p_layer: u64,
    p_max: u64,
    /// Data-parallel ranks (at least 1).
    world: u64,
    /// The tensor-core backward sums dq by f32 atomics (`model.deterministic_attention = false`).
    atomic_dq: bool,
}

impl<'a> Basis<'a> {
    fn of(input: &'a PlanInput) -> Self {
        let model = &input.model;
        let p = model.num_parameters() as u64;
        let (prompt, response) = sequence_tokens(input);
        let lora = input.lora.as_ref().map(|o| Lora::of(model, o));
        let (p_train, p_layer, p_max) = match &lora {
            Some(l) => (l.params, l.layer, l.largest),
            None => {
                let (layer, largest) = largest_params(model);
                (p, layer, largest)
            }
        };
        let atomic_dq = tensor_core_backward(input) && !input.decoder.deterministic_attention;
        Basis {
            input,
            model,
            d: input.dtype.size_in_bytes() as u64,
            p,
            prompt,
            response,
            shape: micro_batch_shape(input, prompt, response),
            lora,
            p_train,
            p_layer,
            p_max,
            world: input.world_size.max(1),
            atomic_dq,
        }
    }

    /// The micro-batch's activations, with the head's and the attention's workspaces as this run has them.
    fn activations(&self, chunk_bytes: u64) -> Activations {
        let (input, model, shape) = (self.input, self.model, &self.shape);
        let lora_bytes = self.lora.as_ref().map_or(0.0, |l| l.saved_per_token);
        let mut act = Activations::new(model, shape, self.d, input.attention, chunk_bytes, lora_bytes);
        if input.decoder.fused_ops {
            // The lm_head's gradient goes chunk by chunk straight into the step's f32 accumulator
            // (kernels::wgrad_accumulate): no buffer of the head's own.
            act.head_backward = 0;
        }
        if let Some(l) = &self.lora {
            // The frozen lm_head gets no gradient (src/kernels/logprob.rs).
            act.head_backward = 0;
            act.layer_backward += to_bytes(shape.b as f64 * shape.t as f64 * l.backward_per_token);
        }
        if self.atomic_dq {
            // The tensor-core backward with dq by atomics sums dq in an f32 accumulator, [N, q] f32.
            let q = (model.num_heads as u64).saturating_mul(model.head_dim as u64);
            let accumulator = shape.b.saturating_mul(shape.t).saturating_mul(q).saturating_mul(4);
            act.attention_workspace = act.attention_workspace.saturating_add(accumulator);
        }
        if tensor_core_backward(self.input) {
            // The tensor-core backward's dk/dv partial sums (each KV head's group split over the kernel's blocks).
            let (b, t) = (shape.b as usize, shape.t as usize);
            let parts =
                crate::kernels::dkv_partial_sum_bytes(b, model.num_heads, model.num_kv_heads, t, model.head_dim);
            act.attention_workspace = act.attention_workspace.saturating_add(parts);
        }
        act
    }

    /// "P_lora" or "P": the trained parameters in the formulas.
    fn pn(&self) -> &'static str {
        if self.lora.is_some() {
            "P_lora"
        } else {
            "P"
        }
    }

    /// What the run holds throughout: weights, adapters, gradients, optimizer state, the reference and the
    /// anchor, and the process or the CUDA context.
    fn resident(&self, c: &mut Components) {
        use Phase::*;
        use Place::*;
        let (input, d, p, pn) = (self.input, self.d, self.p, self.pn());
        c.add("weights", p.saturating_mul(d), Device, Resident, format!("P x {d} B"));
        if let Some(l) = &self.lora {
            c.add("LoRA adapters (f32)", l.params.saturating_mul(4), Device, Resident, "P_lora x 4 B");
        }
        c.add("gradients (f32 accumulator)", self.p_train.saturating_mul(4), Device, Step, format!("{pn} x 4 B"));
        self.optimizer_state(c);
        if input.needs_reference {
            if input.reference_cached() {
                let bytes = self.shape.n_scored.saturating_mul(4);
                c.add("reference log-probs (cached)", bytes, Device, Backward, "4 B x scored tokens of a micro-batch");
            } else if self.lora.is_some() && !input.own_reference {
                // The base model: the policy's own frozen weights with the adapters off.
                c.add("reference model", 0, Device, Resident, "the policy's base weights (LoRA)");
            } else {
                c.add("reference model", p.saturating_mul(d), Device, Resident, format!("P x {d} B"));
            }
        }
        if input.snapshot_anchor {
            match &self.lora {
                // A frozen copy of the adapters, sharing the base weights.
                Some(l) => c.add("anchor snapshot", l.params.saturating_mul(4), Device, Resident, "P_lora x 4 B"),
                None => c.add("anchor snapshot", p.saturating_mul(d), Device, Resident, format!("P x {d} B")),
            }
        }
        if input.on_cpu {
            c.add("process (binary, tokenizer, data, allocator)", CPU_PROCESS_BYTES, Device, Resident, "measured");
        } else {
            c.add(
                "CUDA context, modules and cuBLAS workspaces",
                CUDA_CONTEXT_BYTES,
                Device,
                Resident,
                "outside the pool",
            );
        }
    }

    /// The optimizer's state: its f32 master copy and moments, on the device or (offload) the host, sharded
    /// over the ranks.
    fn optimizer_state(&self, c: &mut Components) {
        let (input, pn) = (self.input, self.pn());
        let adamw = input.adamw;
        let state = if adamw { 12 } else { 4 };
        let place = if input.offload { Place::Host } else { Place::Device };
        let what = if adamw { "f32 master + 2 moments" } else { "f32 master" };
        let off = if input.offload { "host: optim.offload" } else { "device" };
        let (bytes, shard) = match self.world {
            1 => (self.p_train.saturating_mul(state), String::new()),
            n => (self.p_train.saturating_mul(state).div_ceil(n), format!(" / {n} ranks (ZeRO-1)")),
        };
        let formula = format!("{pn} x {state} B{shard} ({what}; {off})");
        c.add("optimizer state", bytes, place, Phase::Resident, formula);
    }

    /// What the forward keeps for the backward: the layers' activations (either setting of
    /// `checkpoint_layers`, the other shown), the kept attention outputs, the head's inputs, kept logits.
    fn saved(&self, c: &mut Components, act: &Activations) {
        use Phase::*;
        use Place::*;
        let input = self.input;
        let ckpt = input.decoder.checkpoint_layers;
        let (used, other) = if ckpt { (Backward, Alternative) } else { (Alternative, Backward) };
        let formula = "(L+1) [N,h] + one layer";
        c.add("activations, checkpoint_layers = true", act.saved_checkpointed, Device, used, formula);
        c.add("activations, checkpoint_layers = false", act.saved_full, Device, other, "L layers + [N,h]");
        if ckpt && act.kept_attention > 0 {
            let when = if input.decoder.recompute_attention { Alternative } else { Backward };
            let formula = "L ([N,q] d + 4 B heads T)";
            c.add("attention outputs kept (recompute_attention = false)", act.kept_attention, Device, when, formula);
        }
        c.add("log-prob head inputs", act.head, Device, Backward, "3 [n,h] + 16 B n");
        if input.keep_logits == Some(true) {
            // The forward's logits, alive until the head's backward has read them.
            let kept = to_bytes(self.shape.n_scored as f64 * self.model.vocab_size as f64 * self.d as f64);
            c.add("logits kept (model.keep_logits)", kept, Device, Backward, "n V d");
        }
    }

    /// The backward's larger part: the head's f32 lm_head gradient, or one layer's backward with the
    /// parameter gradients held before they are added to the accumulator (the other shown).
    fn backward_peak(&self, c: &mut Components, act: &Activations) {
        use Phase::*;
        use Place::*;
        let grad_store = self.gradients_in_flight();
        let layer_part = act.layer_backward.saturating_add(act.attention_workspace).saturating_add(grad_store);
        let head_part = act.head_backward.saturating_add(act.logprob_chunk);
        let kind = attention_workspace_kind(self.input.attention, self.atomic_dq);
        let chunk = "2 rows V d";
        if head_part >= layer_part {
            let formula = "12 V h B (1 chunk: 4+d)";
            c.add("log-prob head backward (f32 lm_head grad)", act.head_backward, Device, Backward, formula);
            c.add("log-prob chunk (logprob_chunk_mb)", act.logprob_chunk, Device, Backward, chunk);
            c.add("attention workspace", act.attention_workspace, Device, Alternative, kind);
        } else {
            c.add("layer backward workspace", act.layer_backward, Device, Backward, "(3i+3h+2q) N d");
            c.add("attention workspace", act.attention_workspace, Device, Backward, kind);
            let what = if self.input.decoder.checkpoint_layers {
                "largest layer or tensor x d"
            } else {
                "P x d: all, until collected"
            };
            c.add("parameter gradients in flight", grad_store, Device, Backward, what);
            c.add("log-prob chunk (logprob_chunk_mb)", act.logprob_chunk, Device, Alternative, chunk);
        }
    }

    /// The parameter gradients a layer's backward holds before they are added to the accumulator. With f32
    /// weights and the whole step in one micro-batch, they become the accumulator (no copy): counted once.
    fn gradients_in_flight(&self) -> u64 {
        let input = self.input;
        let answers = input.batch_questions.saturating_mul(input.group_size) as u64;
        let seq = self.prompt.saturating_add(self.response);
        let shared = self.d == 4 && answers > 0 && answers <= answers_per_micro_batch(input, seq);
        // LoRA's gradients are f32 (the adapters' dtype).
        let gd = if self.lora.is_some() { 4 } else { self.d };
        match (input.decoder.checkpoint_layers, shared && self.lora.is_none()) {
            (_, true) => 0,
            (true, false) => self.p_layer.max(self.p_max).saturating_mul(gd),
            (false, false) => self.p_train.saturating_mul(gd),
        }
    }

    /// The update's temporaries (in place: the new weights in the model's dtype, or with offload the
    /// staging of f32 gradients), and the collectives' buffers of several ranks.
    fn update(&self, c: &mut Components) {
        use Phase::*;
        use Place::*;
        let (input, p_train, world) = (self.input, self.p_train, self.world);
        if input.offload {
            // Two slots of f32 gradients and as many four-byte words of weights (device::staging).
            let bytes = staging_bytes(chunk_len(p_train as usize, input.offload_chunk_mb)) as u64;
            c.add("optimizer update temporaries", bytes, Host, Update, "staging: 2 slots of f32 gradients and weights");
        } else {
            let bytes = self.p_max.saturating_mul(self.d);
            c.add("optimizer update temporaries", bytes, Device, Update, "the largest tensor's new weights x d");
        }
        if world > 1 {
            // The collectives take host buffers (src/train/zero.rs): the flat f32 gradients and this rank's
            // block of their sum, then the gathered f32 weights (one after the other).
            let staging = p_train.saturating_mul(4).saturating_add(p_train.saturating_mul(4) / world);
            let place = if input.on_cpu { Device } else { Host };
            c.add("collective staging (f32 gradients / weights)", staging, place, Update, "P x 4 B (1 + 1/N)");
        }
        if world > 1 && !input.on_cpu {
            // A piece of the reduce-scatter (the ranks' blocks of it) and the share it reduces into, or of the
            // all-gather: NCCL's device buffers (dist::COLLECTIVE_CHUNK_VALUES f32 values and one rank's share).
            let values = (crate::dist::COLLECTIVE_CHUNK_VALUES as u64).min(p_train);
            let bytes = 4 * (values + values / world);
            c.add("collective buffers (NCCL, per piece)", bytes, Device, Update, "<= 256 MiB + a rank's share");
        }
    }
}

/// The run's attention backward runs on the tensor-core kernels (their dk/dv partial sums, and with
/// atomics their dq accumulator): the GPU kinds but the matrix and flash ones.
fn tensor_core_backward(input: &PlanInput) -> bool {
    matches!(input.attention, Attention::Mma | Attention::Wgmma | Attention::Auto) && !input.on_cpu
}

/// The attention workspace's formula.
fn attention_workspace_kind(attention: Attention, atomic_dq: bool) -> &'static str {
    match attention {
        Attention::Flash => "flash: O(T)",
        Attention::Mma if atomic_dq => "mma: O(T) + dk/dv parts + [N,q] 4 B dq accumulator",
        Attention::Mma => "mma: O(T) + dk/dv parts (split x 2 [N,kv] 4 B)",
        Attention::Wgmma if atomic_dq => "wgmma: O(T) + dk/dv parts + [N,q] 4 B dq accumulator",
        Attention::Wgmma => "wgmma: O(T) + dk/dv parts (split x 2 [N,kv] 4 B)",
        Attention::Auto if atomic_dq => "auto (tensor cores): O(T) + dk/dv parts + [N,q] 4 B dq accumulator",
        Attention::Auto => "auto (tensor cores): O(T) + dk/dv parts (split x 2 [N,kv] 4 B)",
        Attention::Matrix => "matrix: 2 B heads T^2 d",
    }
}

/// The largest micro-batch: `train.micro_batch_size` rows of the longest prompt + answer, or with
/// `train.micro_batch_tokens` one packed row of the budget (or of the longest answer, which runs alone when
/// it is longer), every token of which but the first may be a scored answer token (short answers).
fn micro_batch_shape(input: &PlanInput, prompt: u64, response: u64) -> Shape {
    let seq = prompt.saturating_add(response);
    match input.micro_batch_tokens as u64 {
        0 => {
            let b = input.micro_batch_size.max(1) as u64;
            Shape { b, t: seq, n_scored: b.saturating_mul(response) }
        }
        budget => {
            let t = budget.max(seq);
            Shape { b: 1, t, n_scored: t }
        }
    }
}

/// Answers of `seq` tokens (the longest) in one micro-batch: `train.micro_batch_size`, or as many as
/// the token budget of `train.micro_batch_tokens` holds (at least one).
fn answers_per_micro_batch(input: &PlanInput, seq: u64) -> u64 {
    match input.micro_batch_tokens as u64 {
        0 => input.micro_batch_size.max(1) as u64,
        budget => (budget / seq.max(1)).max(1),
    }
}

/// The tokens of the longest prompt and answer of a micro-batch: `data.max_prompt_tokens` and, for
/// answers, `data.max_response_tokens` (the model's context where either is 0: no limit), or with
/// `[rollout]` the sampled answers' `rollout.max_new_tokens` + 1 (the EOS), and the teacher answers'
/// limit when some are mixed in (`rollout.teacher_answers`).
pub(super) fn sequence_tokens(input: &PlanInput) -> (u64, u64) {
    let max_pos = input.model.max_position_embeddings;
    let or_max = |x: usize| if x == 0 { max_pos } else { x } as u64;
    let teacher = or_max(input.max_response_tokens);
    let response = match &input.rollout {
        None => teacher,
        Some(r) => {
            let sampled = (r.sampling.max_new_tokens as u64).saturating_add(1);
            if r.teacher_answers > 0 {
                sampled.max(teacher)
            } else {
                sampled
            }
        }
    };
    (or_max(input.max_prompt_tokens), response)
}

/// The KV caches of generation: validation's, and with `[rollout]` grpo's sampler's (a server's rollouts
/// use the server's memory) and a lagged sampling policy's copy of the weights.
fn generation_components(input: &PlanInput, d: u64, prompt: u64) -> Vec<Component> {
    use Phase::*;
    use Place::*;
    let model = &input.model;
    let mut c = Components::default();
    // A generation's KV cache for `batch` sequences of `tokens` tokens, 2 L kv d bytes per token: the paged
    // pool of `generation.pool_blocks` blocks, or with static batches a contiguous cache counted twice
    // because it grows by doubling; plus two rows of f32 logits per sequence.
    let kv_cache = |batch: usize, tokens: u64, g: &GenerationOptions| {
        let per_token = 2.0 * model.num_layers as f64 * (model.num_kv_heads * model.head_dim) as f64 * d as f64;
        let batch_f = batch as f64;
        let logits = 2.0 * batch_f * model.vocab_size as f64 * 4.0;
        if g.schedule == crate::generate::Schedule::Static {
            let bytes = 2.0 * batch_f * tokens as f64 * per_token + logits;
            return (to_bytes(bytes), format!("2 x batch {batch} x {tokens} tokens x {per_token} B + logits"));
        }
        let blocks = g.pool_blocks(batch, tokens as usize);
        let bytes = (blocks * g.block_size) as f64 * per_token + logits;
        (to_bytes(bytes), format!("pool of {blocks} blocks x {} positions x {per_token} B + logits", g.block_size))
    };
    if let Some(v) = &input.validation {
        let (bytes, f) = kv_cache(v.batch_size, prompt.saturating_add(v.max_new_tokens as u64), &v.generation);
        c.add("validation KV cache", bytes, Device, Validation, f);
    }
    if let Some(r) = &input.rollout {
        if r.sync_every > 1 {
            let f = format!("P x {d} B (the policy of the last refresh, rollout.sync_every = {})", r.sync_every);
            c.add(
                "rollout sampling policy copy",
                (model.num_parameters() as u64).saturating_mul(d),
                Device,
                Resident,
                f,
            );
        }
        if r.native {
            let s = &r.sampling;
            let (bytes, f) = kv_cache(s.batch_size, prompt.saturating_add(s.max_new_tokens as u64), &s.generation);
            c.add("rollout KV cache", bytes, Device, Rollout, f);
        }
    }
    c.0
}

/// The plan's first line: the model's shape and the micro-batch.
fn summary(input: &PlanInput, shape: &Shape, prompt: u64, response: u64) -> String {
    let model = &input.model;
    format!(
        "{} layers, hidden {}, {} heads / {} KV heads, intermediate {}, vocab {}: {:.2}B parameters, {}; \
         micro-batch {} x {} tokens ({}{} + {})",
        model.num_layers,
        model.hidden_size,
        model.num_heads,
        model.num_kv_heads,
        model.intermediate_size,
        model.vocab_size,
        model.num_parameters() as f64 / 1e9,
        input.dtype,
        shape.b,
        shape.t,
        if input.micro_batch_tokens > 0 { "packed: train.micro_batch_tokens; answers of up to " } else { "" },
        prompt,
        response
    )
}

impl Plan {
    /// The bytes of one phase in one place.
    fn sum(&self, phase: Phase, place: Place) -> u64 {
        let parts = self.components.iter().filter(|c| c.phase == phase && self.counts_in(c.place, place));
        parts.map(|c| c.bytes).fold(0, u64::saturating_add)
    }

    /// On the CPU the host is the device: host components count in its total too.
    fn counts_in(&self, of: Place, place: Place) -> bool {
        of == place || (self.input.on_cpu && place == Place::Device)
    }

    /// The expected peak in `place`: resident + the largest of a training step, validation and rollouts
    /// (the pool is trimmed between them: their peaks do not add up), on a GPU's device memory with the
    /// pool's overheads ([`POOL_OVERHEAD`]) on the tensors and the context beside them.
    pub fn peak(&self, place: Place) -> u64 {
        let tensors = self.tensor_peak(place);
        match self.gpu_device(place) {
            true => POOL_OVERHEAD.pooled(tensors).saturating_add(CUDA_CONTEXT_BYTES),
            false => tensors,
        }
    }

    /// The peak of the plan's own components in `place` (the context not counted on a GPU).
    fn tensor_peak(&self, place: Place) -> u64 {
        let generation = self.sum(Phase::Validation, place).max(self.sum(Phase::Rollout, place));
        let resident = self.sum(Phase::Resident, place);
        let resident = if self.gpu_device(place) { resident.saturating_sub(CUDA_CONTEXT_BYTES) } else { resident };
        resident.saturating_add(self.step_peak(place).max(generation))
    }

    /// Whether `place` is a GPU's device memory (where the pool's overheads apply).
    pub(super) fn gpu_device(&self, place: Place) -> bool {
        place == Place::Device && !self.input.on_cpu
    }

    /// A training step's part of the peak: the gradients and the larger of the backward and the update.
    fn step_peak(&self, place: Place) -> u64 {
        self.sum(Phase::Step, place)
            .saturating_add(self.sum(Phase::Backward, place).max(self.sum(Phase::Update, place)))
    }

    /// Whether the device's peak fits its memory (`None`: the memory is unknown): on a GPU with
    /// [`GPU_HEADROOM`] of it to spare.
    pub fn fits(&self) -> Option<bool> {
        self.input.device_memory.map(|m| self.peak(Place::Device) <= self.usable(m))
    }

    /// The part of `memory` bytes of device memory a plan may fill.
    fn usable(&self, memory: u64) -> u64 {
        match self.gpu_device(Place::Device) {
            true => to_bytes(memory as f64 * (1.0 - GPU_HEADROOM)),
            false => memory,
        }
    }
}

/// Parse a memory size: a number with an optional suffix GiB, GB, MiB, MB, KiB, KB or B (no suffix:
/// bytes), e.g. `80GiB`, `80 GB`, `512MiB`.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(t.len());
    let (num, unit) = (t[..split].trim(), t[split..].trim().to_ascii_lowercase());
    let value: f64 = num.parse().map_err(|_| format!("`{s}`: expected a number with GiB, GB, MiB or MB"))?;
    let scale: f64 = match unit.as_str() {
        "" | "b" => 1.0,
        "kib" => 1024.0,
        "kb" => 1e3,
        "mib" => (1u64 << 20) as f64,
        "mb" => 1e6,
        "gib" => (1u64 << 30) as f64,
        "gb" => 1e9,
        "tib" => (1u64 << 40) as f64,
        "tb" => 1e12,
        _ => return Err(format!("`{s}`: unknown unit `{unit}` (GiB, GB, MiB, MB, KiB, KB)")),
    };
    if !(value.is_finite() && value > 0.0) {
        return Err(format!("`{s}`: must be a positive size"));
    }
    Ok((value * scale) as u64)
}

/// With `model.keep_logits = "auto"`, the share of the memory a plan may use ([`Plan::fits`]) that the
/// plan with the logits kept may fill for the run to keep them. Kept logits save one lm_head GEMM a
/// log-prob chunk, 1-2% of a 16k step; running out of memory loses the run, the pool's overheads
/// ([`POOL_OVERHEAD`]) were measured at one step, and the 2026-11-27b build ran out of memory at a 7B step
/// its plan said fit (a recomputation bug the plan could not see): so only with room to spare. The seed's
/// 7B step (74.8 GiB with them, of 77.3 usable on an H100) does not keep them; a 0.5B-1.5B model's does.
pub const AUTO_KEEP_LOGITS_SHARE: f64 = 0.9;

/// The plan of `input` with `model.keep_logits = "auto"` decided: the logits are kept on a GPU of known
/// memory when the plan with them fills at most [`AUTO_KEEP_LOGITS_SHARE`] of what it may use, else not.
pub fn run_plan(input: &PlanInput) -> Plan {
    if input.keep_logits.is_some() {
        return plan(input);
    }
    let with = |keep: bool| plan(&PlanInput { keep_logits: Some(keep), ..input.clone() });
    let kept = with(true);
    let (peak, usable) = match (kept.gpu_device(Place::Device), input.device_memory) {
        (true, Some(m)) => (kept.peak(Place::Device), kept.usable(m)),
        _ => return with(false),
    };
    let room = peak as f64 <= AUTO_KEEP_LOGITS_SHARE * usable as f64;
    let mut chosen = if room { kept } else { with(false) };
    chosen.keep_logits_note = Some(format!(
        "model.keep_logits = \"auto\": {} (the device peak with them {} of the {} a plan may use; kept up to {:.0}%)",
        if room { "kept" } else { "recomputed" },
        gib(peak),
        gib(usable),
        100.0 * AUTO_KEEP_LOGITS_SHARE
    ));
    chosen
}

impl Plan {
    /// The shape of one rank's training step for the performance model: its share of the step's questions
    /// (whole groups: rank i takes groups i, i + N, ...) at the plan's micro-batch shape, the attention's
    /// blocking the op's own (GPU) choice.
    pub fn step_shape(&self) -> time::StepShape {
        let input = &self.input;
        let (model, world_size) = (&input.model, input.world_size);
        let (prompt, response) = sequence_tokens(input);
        let questions = (input.batch_questions as u64).div_ceil(world_size.max(1));
        let seq_tokens = prompt.saturating_add(response).max(1);
        let d = &input.decoder;
        time::StepShape {
            answers: questions.saturating_mul(input.group_size as u64).max(1),
            // A packed row of the budget holds budget / T answers of the longest: the work of that many padded.
            micro_batch: answers_per_micro_batch(input, seq_tokens),
            seq_tokens,
            scored_tokens: response,
            dtype_bytes: input.dtype.size_in_bytes() as u64,
            checkpoint_layers: d.checkpoint_layers,
            recompute_attention: d.recompute_attention,
            reference_forward: input.needs_reference && !input.reference_cached(),
            offload: input.offload,
            build: time::Build::CURRENT,
            logprob_chunk_bytes: self.logprob_chunk_bytes,
            optimizer_shards: world_size.max(1),
            blocks: time::driver_blocks(model, seq_tokens),
            tensor_cores: d.tensor_core_attention(input.dtype.dtype(), model.head_dim),
            atomic_dq: !d.deterministic_attention,
            warpgroup: matches!(d.attention, Attention::Wgmma | Attention::Auto),
            // The model counts adapters on every projection (the default target_modules).
            lora_rank: input.lora.as_ref().map_or(0, |l| l.r as u64),
            keep_logits: self.keep_logits,
        }
    }
}

mod display;
mod input;
#[cfg(test)]
mod tests;
