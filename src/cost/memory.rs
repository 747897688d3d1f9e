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
//!   [`crate::train::offload::staging_bytes`] of `optim.offload_chunk_mb`, page-locked on a GPU);
//! - validation: the generation KV cache of `validation.batch_size` sequences of `max_prompt_tokens +
//!   validation.max_new_tokens` tokens, 2 L kv d bytes per token: the paged pool
//!   ([`crate::generate::GenerationOptions::pool_blocks`] blocks), or with `generation.schedule = "static"`
//!   a contiguous cache counted twice because it grows by doubling its capacity;
//! - rollouts (`[rollout]` with grpo's own sampler): the same KV cache for `rollout.batch_size` sequences
//!   of `max_prompt_tokens + rollout.max_new_tokens` tokens; a lagged sampling policy
//!   (`rollout.sync_every > 1`) is one more resident copy of the weights (P d).

use std::fmt;

use super::time;
use crate::model::{Attention, ChatTokenizer, ModelConfig, ModelError};
use crate::objective::Anchor;
use crate::train::config::TrainConfig;
use crate::train::offload::{chunk_len, staging_bytes};
use crate::train::optim::OptimName;

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

/// What the plan needs besides the two configurations.
#[derive(Debug, Clone, Copy)]
pub struct PlanInputs {
    pub attention: Attention,
    /// The reference model's log-probs are read from a file instead of computed by a loaded reference.
    pub reference_cached: bool,
    /// The model runs on the CPU: the device is host memory and the process counts in it.
    pub on_cpu: bool,
    /// Bytes of device memory (`None`: unknown).
    pub device_memory: Option<u64>,
    /// Data-parallel ranks sharing the optimiser state (ZeRO-1): each rank holds 1/N of it.
    pub world_size: u64,
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
    pub inputs: PlanInputs,
    /// Model and micro-batch, for the heading.
    pub summary: String,
    /// Bytes of the log-prob op's logits chunk the run uses (as the device sizes it when not set).
    pub logprob_chunk_bytes: u64,
    /// The model's shape (the advice plans the settings it suggests).
    pub model: ModelConfig,
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

fn gib(bytes: u64) -> String {
    format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
}

/// Build the plan of `cfg` for a model of shape `model`.
pub fn plan(cfg: &TrainConfig, model: &ModelConfig, inputs: PlanInputs) -> Plan {
    let first = plan_with_chunk(cfg, model, inputs, logprob_chunk_bytes(cfg, &inputs, None));
    if cfg.model.logprob_chunk_mb > 0 || inputs.on_cpu {
        return first;
    }
    // Left to the device, the chunk is an eighth of the memory free when the head runs (everything else
    // of the step allocated), within 1..=8 GiB: sized from the plan with the smallest chunk.
    // The pool holds the other tensors with its overheads, beside the context (as the device's free
    // memory, which the run sizes the chunk from, sees them).
    let chunk = first.components.iter().filter(|c| c.name.starts_with("log-prob chunk")).map(|c| c.bytes).max();
    let others = first.peak(Place::Device).saturating_sub(POOL_OVERHEAD.pooled(chunk.unwrap_or(0)));
    let free = inputs.device_memory.unwrap_or(DEFAULT_GPU_MEMORY).saturating_sub(others);
    plan_with_chunk(cfg, model, inputs, logprob_chunk_bytes(cfg, &inputs, Some(free)))
}

/// Device memory assumed for sizing a device-sized log-prob chunk when the plan is given none (80 GB).
const DEFAULT_GPU_MEMORY: u64 = 80_000_000_000;

/// The bytes of the log-prob op's logits chunk of a run of `cfg`: `model.logprob_chunk_mb` when set;
/// otherwise as [`crate::kernels::logprob_chunk_bytes`] sizes it: 64 MiB on the CPU, on a GPU an eighth of
/// `free` (unknown: the 1 GiB minimum) within 1..=8 GiB.
fn logprob_chunk_bytes(cfg: &TrainConfig, inputs: &PlanInputs, free: Option<u64>) -> u64 {
    match cfg.model.logprob_chunk_mb {
        0 if inputs.on_cpu => crate::kernels::LOGPROB_CHUNK_BYTES as u64,
        0 => crate::kernels::gpu_chunk_bytes(free.unwrap_or(0)) as u64,
        mb => (mb as u64) << 20,
    }
}

fn plan_with_chunk(cfg: &TrainConfig, model: &ModelConfig, inputs: PlanInputs, chunk_bytes: u64) -> Plan {
    let basis = Basis::of(cfg, model, inputs);
    let act = basis.activations(chunk_bytes);
    let mut c = Components::default();
    basis.resident(&mut c);
    basis.saved(&mut c, &act);
    basis.backward_peak(&mut c, &act);
    basis.update(&mut c);
    c.0.extend(generation_components(cfg, model, basis.d, basis.prompt));
    let mut summary = summary(cfg, model, &basis.shape, basis.prompt, basis.response);
    if basis.world > 1 {
        summary.push_str(&format!("; per rank of {} (ZeRO-1: the optimizer state sharded)", basis.world));
    }
    Plan {
        components: c.0,
        inputs,
        summary,
        logprob_chunk_bytes: chunk_bytes,
        model: model.clone(),
        keep_logits: cfg.model.keep_logits == Some(true),
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

/// What the plan's parts are computed from: the two configurations, the inputs, and what follows from them.
struct Basis<'a> {
    cfg: &'a TrainConfig,
    model: &'a ModelConfig,
    inputs: PlanInputs,
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
    fn of(cfg: &'a TrainConfig, model: &'a ModelConfig, inputs: PlanInputs) -> Self {
        let p = model.num_parameters() as u64;
        let (prompt, response) = sequence_tokens(cfg, model);
        let lora = cfg.model.lora.as_ref().map(|o| Lora::of(model, o));
        let (p_train, p_layer, p_max) = match &lora {
            Some(l) => (l.params, l.layer, l.largest),
            None => {
                let (layer, largest) = largest_params(model);
                (p, layer, largest)
            }
        };
        let atomic_dq = tensor_core_backward(&inputs) && !cfg.model.deterministic_attention;
        Basis {
            cfg,
            model,
            inputs,
            d: cfg.model.dtype.size_in_bytes() as u64,
            p,
            prompt,
            response,
            shape: micro_batch_shape(cfg, prompt, response),
            lora,
            p_train,
            p_layer,
            p_max,
            world: inputs.world_size.max(1),
            atomic_dq,
        }
    }

    /// The micro-batch's activations, with the head's and the attention's workspaces as this run has them.
    fn activations(&self, chunk_bytes: u64) -> Activations {
        let (cfg, model, shape) = (self.cfg, self.model, &self.shape);
        let lora_bytes = self.lora.as_ref().map_or(0.0, |l| l.saved_per_token);
        let mut act = Activations::new(model, shape, self.d, self.inputs.attention, chunk_bytes, lora_bytes);
        if cfg.model.fused_ops {
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
        if tensor_core_backward(&self.inputs) {
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
        let (cfg, d, p, pn) = (self.cfg, self.d, self.p, self.pn());
        c.add("weights", p.saturating_mul(d), Device, Resident, format!("P x {d} B"));
        if let Some(l) = &self.lora {
            c.add("LoRA adapters (f32)", l.params.saturating_mul(4), Device, Resident, "P_lora x 4 B");
        }
        c.add("gradients (f32 accumulator)", self.p_train.saturating_mul(4), Device, Step, format!("{pn} x 4 B"));
        self.optimizer_state(c);
        let objective = cfg.objective.build();
        if objective.needs_reference() {
            if self.inputs.reference_cached {
                let bytes = self.shape.n_scored.saturating_mul(4);
                c.add("reference log-probs (cached)", bytes, Device, Backward, "4 B x scored tokens of a micro-batch");
            } else if self.lora.is_some() && cfg.model.reference.is_none() {
                // The base model: the policy's own frozen weights with the adapters off.
                c.add("reference model", 0, Device, Resident, "the policy's base weights (LoRA)");
            } else {
                c.add("reference model", p.saturating_mul(d), Device, Resident, format!("P x {d} B"));
            }
        }
        if objective.anchor() == Some(Anchor::Snapshot) {
            match &self.lora {
                // A frozen copy of the adapters, sharing the base weights.
                Some(l) => c.add("anchor snapshot", l.params.saturating_mul(4), Device, Resident, "P_lora x 4 B"),
                None => c.add("anchor snapshot", p.saturating_mul(d), Device, Resident, format!("P x {d} B")),
            }
        }
        if self.inputs.on_cpu {
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
        let (cfg, pn) = (self.cfg, self.pn());
        let adamw = cfg.optim.name == OptimName::Adamw;
        let state = if adamw { 12 } else { 4 };
        let place = if cfg.optim.offload { Place::Host } else { Place::Device };
        let what = if adamw { "f32 master + 2 moments" } else { "f32 master" };
        let off = if cfg.optim.offload { "host: optim.offload" } else { "device" };
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
        let cfg = self.cfg;
        let ckpt = cfg.model.checkpoint_layers;
        let (used, other) = if ckpt { (Backward, Alternative) } else { (Alternative, Backward) };
        let formula = "(L+1) [N,h] + one layer";
        c.add("activations, checkpoint_layers = true", act.saved_checkpointed, Device, used, formula);
        c.add("activations, checkpoint_layers = false", act.saved_full, Device, other, "L layers + [N,h]");
        if ckpt && act.kept_attention > 0 {
            let when = if cfg.model.recompute_attention { Alternative } else { Backward };
            let formula = "L ([N,q] d + 4 B heads T)";
            c.add("attention outputs kept (recompute_attention = false)", act.kept_attention, Device, when, formula);
        }
        c.add("log-prob head inputs", act.head, Device, Backward, "3 [n,h] + 16 B n");
        if cfg.model.keep_logits == Some(true) {
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
        let kind = attention_workspace_kind(self.inputs.attention, self.atomic_dq);
        let chunk = "2 rows V d";
        if head_part >= layer_part {
            let formula = "12 V h B (1 chunk: 4+d)";
            c.add("log-prob head backward (f32 lm_head grad)", act.head_backward, Device, Backward, formula);
            c.add("log-prob chunk (logprob_chunk_mb)", act.logprob_chunk, Device, Backward, chunk);
            c.add("attention workspace", act.attention_workspace, Device, Alternative, kind);
        } else {
            c.add("layer backward workspace", act.layer_backward, Device, Backward, "(3i+3h+2q) N d");
            c.add("attention workspace", act.attention_workspace, Device, Backward, kind);
            let what = if self.cfg.model.checkpoint_layers {
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
        let cfg = self.cfg;
        let group = cfg.rollout.as_ref().map_or(cfg.data.input.group.group_size, |r| r.n);
        let answers = cfg.train.batch_questions.saturating_mul(group) as u64;
        let seq = self.prompt.saturating_add(self.response);
        let shared = self.d == 4 && answers > 0 && answers <= answers_per_micro_batch(cfg, seq);
        // LoRA's gradients are f32 (the adapters' dtype).
        let gd = if self.lora.is_some() { 4 } else { self.d };
        match (cfg.model.checkpoint_layers, shared && self.lora.is_none()) {
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
        let (cfg, p_train, world) = (self.cfg, self.p_train, self.world);
        if cfg.optim.offload {
            // Two slots of f32 gradients and as many four-byte words of weights (offload.rs).
            let bytes = staging_bytes(chunk_len(p_train as usize, cfg.optim.offload_chunk_mb)) as u64;
            c.add("optimizer update temporaries", bytes, Host, Update, "staging: 2 slots of f32 gradients and weights");
        } else {
            let bytes = self.p_max.saturating_mul(self.d);
            c.add("optimizer update temporaries", bytes, Device, Update, "the largest tensor's new weights x d");
        }
        if world > 1 {
            // The collectives take host buffers (src/train/zero.rs): the flat f32 gradients and this rank's
            // block of their sum, then the gathered f32 weights (one after the other).
            let staging = p_train.saturating_mul(4).saturating_add(p_train.saturating_mul(4) / world);
            let place = if self.inputs.on_cpu { Device } else { Host };
            c.add("collective staging (f32 gradients / weights)", staging, place, Update, "P x 4 B (1 + 1/N)");
        }
        if world > 1 && !self.inputs.on_cpu {
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
fn tensor_core_backward(inputs: &PlanInputs) -> bool {
    matches!(inputs.attention, Attention::Mma | Attention::Wgmma | Attention::Auto) && !inputs.on_cpu
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
fn micro_batch_shape(cfg: &TrainConfig, prompt: u64, response: u64) -> Shape {
    let seq = prompt.saturating_add(response);
    match cfg.train.micro_batch_tokens as u64 {
        0 => {
            let b = cfg.train.micro_batch_size.max(1) as u64;
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
fn answers_per_micro_batch(cfg: &TrainConfig, seq: u64) -> u64 {
    match cfg.train.micro_batch_tokens as u64 {
        0 => cfg.train.micro_batch_size.max(1) as u64,
        budget => (budget / seq.max(1)).max(1),
    }
}

/// The tokens of the longest prompt and answer of a micro-batch: `data.max_prompt_tokens` and, for
/// answers, `data.max_response_tokens` (the model's context where either is 0: no limit), or with
/// `[rollout]` the sampled answers' `rollout.max_new_tokens` + 1 (the EOS), and the teacher answers'
/// limit when some are mixed in (`rollout.teacher_answers`).
fn sequence_tokens(cfg: &TrainConfig, model: &ModelConfig) -> (u64, u64) {
    let seq = &cfg.data.sequence;
    let max_pos = model.max_position_embeddings;
    let or_max = |x: usize| if x == 0 { max_pos } else { x } as u64;
    let teacher = or_max(seq.max_response_tokens);
    let response = match &cfg.rollout {
        None => teacher,
        Some(r) => {
            let sampled = (r.max_new_tokens as u64).saturating_add(1);
            if r.teacher_answers > 0 {
                sampled.max(teacher)
            } else {
                sampled
            }
        }
    };
    (or_max(seq.max_prompt_tokens), response)
}

/// The KV caches of generation: validation's, and with `[rollout]` grpo's sampler's (a server's rollouts
/// use the server's memory) and a lagged sampling policy's copy of the weights.
fn generation_components(cfg: &TrainConfig, model: &ModelConfig, d: u64, prompt: u64) -> Vec<Component> {
    use Phase::*;
    use Place::*;
    let mut c = Components::default();
    // A generation's KV cache for `batch` sequences of `tokens` tokens, 2 L kv d bytes per token: the paged
    // pool of `generation.pool_blocks` blocks, or with static batches a contiguous cache counted twice
    // because it grows by doubling; plus two rows of f32 logits per sequence.
    let kv_cache = |batch: usize, tokens: u64, g: &crate::generate::GenerationOptions| {
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
    if let Some(v) = &cfg.validation {
        let (bytes, f) = kv_cache(v.batch_size, prompt.saturating_add(v.max_new_tokens as u64), &v.generation);
        c.add("validation KV cache", bytes, Device, Validation, f);
    }
    if let Some(r) = &cfg.rollout {
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
        if r.server.engine == crate::eval::EngineKind::Native {
            let (bytes, f) = kv_cache(r.batch_size, prompt.saturating_add(r.max_new_tokens as u64), &r.generation);
            c.add("rollout KV cache", bytes, Device, Rollout, f);
        }
    }
    c.0
}

/// The plan's first line: the model's shape and the micro-batch.
fn summary(cfg: &TrainConfig, model: &ModelConfig, shape: &Shape, prompt: u64, response: u64) -> String {
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
        cfg.model.dtype,
        shape.b,
        shape.t,
        if cfg.train.micro_batch_tokens > 0 { "packed: train.micro_batch_tokens; answers of up to " } else { "" },
        prompt,
        response
    )
}

/// Carry into `floor` the one setting `changed` has changed from `cfg` (the settings the advice lowers).
fn apply(floor: &mut TrainConfig, changed: &TrainConfig, cfg: &TrainConfig) {
    let pick = |a: usize, b: usize, c: usize| if a != c { a } else { b };
    floor.model.checkpoint_layers |= changed.model.checkpoint_layers;
    floor.model.recompute_attention |= changed.model.recompute_attention;
    floor.model.cache_reference |= changed.model.cache_reference;
    if changed.model.keep_logits == Some(false) {
        floor.model.keep_logits = Some(false);
    }
    floor.optim.offload |= changed.optim.offload;
    if changed.model.attention != cfg.model.attention || changed.model.fused_ops != cfg.model.fused_ops {
        (floor.model.attention, floor.model.fused_ops) = (changed.model.attention, changed.model.fused_ops);
    }
    let (a, b) = (&changed.train, &cfg.train);
    floor.train.micro_batch_size = pick(a.micro_batch_size, floor.train.micro_batch_size, b.micro_batch_size);
    floor.train.micro_batch_tokens = pick(a.micro_batch_tokens, floor.train.micro_batch_tokens, b.micro_batch_tokens);
    let (a, b) = (&changed.data.sequence, &cfg.data.sequence);
    floor.data.sequence.max_response_tokens =
        pick(a.max_response_tokens, floor.data.sequence.max_response_tokens, b.max_response_tokens);
    if let (Some(f), Some(c), Some(o)) = (floor.validation.as_mut(), &changed.validation, &cfg.validation) {
        f.batch_size = pick(c.batch_size, f.batch_size, o.batch_size);
    }
    if let (Some(f), Some(c), Some(o)) = (floor.rollout.as_mut(), &changed.rollout, &cfg.rollout) {
        f.batch_size = pick(c.batch_size, f.batch_size, o.batch_size);
        f.max_new_tokens = pick(c.max_new_tokens, f.max_new_tokens, o.max_new_tokens);
    }
}

impl Plan {
    /// The bytes of one phase in one place.
    fn sum(&self, phase: Phase, place: Place) -> u64 {
        let parts = self.components.iter().filter(|c| c.phase == phase && self.counts_in(c.place, place));
        parts.map(|c| c.bytes).fold(0, u64::saturating_add)
    }

    /// On the CPU the host is the device: host components count in its total too.
    fn counts_in(&self, of: Place, place: Place) -> bool {
        of == place || (self.inputs.on_cpu && place == Place::Device)
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
    fn gpu_device(&self, place: Place) -> bool {
        place == Place::Device && !self.inputs.on_cpu
    }

    /// A training step's part of the peak: the gradients and the larger of the backward and the update.
    fn step_peak(&self, place: Place) -> u64 {
        self.sum(Phase::Step, place)
            .saturating_add(self.sum(Phase::Backward, place).max(self.sum(Phase::Update, place)))
    }

    /// Whether the device's peak fits its memory (`None`: the memory is unknown): on a GPU with
    /// [`GPU_HEADROOM`] of it to spare.
    pub fn fits(&self) -> Option<bool> {
        self.inputs.device_memory.map(|m| self.peak(Place::Device) <= self.usable(m))
    }

    /// The part of `memory` bytes of device memory a plan may fill.
    fn usable(&self, memory: u64) -> u64 {
        match self.gpu_device(Place::Device) {
            true => to_bytes(memory as f64 * (1.0 - GPU_HEADROOM)),
            false => memory,
        }
    }

    /// What to change in `cfg` when the plan does not fit: each setting it can still change, planned, with
    /// the value that fits where one does (never a value the plan shows cannot fit); when no such setting
    /// fits alone, all of them together; when not even that fits, the part no such setting changes and
    /// what can.
    pub fn advice(&self, cfg: &TrainConfig) -> String {
        // The other settings are planned with the logits as this plan has them ("auto" resolved).
        let mut resolved = cfg.clone();
        resolved.model.keep_logits = Some(self.keep_logits);
        let cfg = &resolved;
        let mut fitting = Vec::new();
        let mut floor = cfg.clone();
        let candidates = self.candidates(cfg);
        for (what, changed) in &candidates {
            apply(&mut floor, changed, cfg);
            if let Some(peak) = self.fits_with(changed) {
                fitting.push(format!("{what} (peak {})", gib(peak)));
            }
        }
        if !fitting.is_empty() {
            return format!("reduce the peak with {}; or give a device with more memory", fitting.join(", or "));
        }
        if let Some(peak) = self.fits_with(&floor) {
            return format!(
                "no one setting is enough: together, {} (peak {}); or give a device with more memory",
                candidates.iter().map(|(w, _)| w.as_str()).collect::<Vec<_>>().join(", "),
                gib(peak)
            );
        }
        self.fixed_part_advice(&floor)
    }

    /// The plan of `cfg` on this plan's model and inputs, when it fits: its device peak.
    fn fits_with(&self, cfg: &TrainConfig) -> Option<u64> {
        let p = plan(cfg, &self.model, self.inputs_for(cfg));
        (p.fits() == Some(true)).then(|| p.peak(Place::Device))
    }

    /// This plan's inputs for a changed `cfg` (its attention and reference cache follow the config).
    fn inputs_for(&self, cfg: &TrainConfig) -> PlanInputs {
        let attention = if cfg.model.fused_ops { cfg.model.attention } else { Attention::Matrix };
        let reference_cached = self.inputs.reference_cached || crate::train::refcache::reference_is_cacheable(cfg);
        PlanInputs { attention, reference_cached, ..self.inputs }
    }

    /// The settings that bring the peak down, each with the config it makes: the largest value that fits
    /// where there is one, else the least.
    fn candidates(&self, cfg: &TrainConfig) -> Vec<(String, TrainConfig)> {
        let mut out = Vec::new();
        let mut with = |what: String, f: &dyn Fn(&mut TrainConfig)| {
            let mut c = cfg.clone();
            f(&mut c);
            out.push((what, c));
        };
        if self.keep_logits {
            with("model.keep_logits = false".into(), &|c| c.model.keep_logits = Some(false));
        }
        if !cfg.model.checkpoint_layers {
            with("model.checkpoint_layers = true".into(), &|c| c.model.checkpoint_layers = true);
        } else if !cfg.model.recompute_attention && self.inputs.attention != Attention::Matrix {
            with("model.recompute_attention = true".into(), &|c| c.model.recompute_attention = true);
        }
        if !cfg.optim.offload && !self.inputs.on_cpu {
            with("optim.offload = true (optimizer state in host memory)".into(), &|c| c.optim.offload = true);
        }
        if self.inputs.attention == Attention::Matrix {
            let flash = "flash attention (model.fused_ops = true, model.attention = \"flash\")";
            with(flash.into(), &|c| (c.model.fused_ops, c.model.attention) = (true, Attention::Flash));
        }
        if cfg.objective.build().needs_reference() && !self.inputs.reference_cached {
            with("cached reference log-probs (model.cache_reference = true)".into(), &|c| {
                c.model.cache_reference = true
            });
        }
        let (mb, budget) = (cfg.train.micro_batch_size, cfg.train.micro_batch_tokens);
        let (prompt, response) = sequence_tokens(cfg, &self.model);
        let seq = prompt.saturating_add(response) as usize;
        if budget > seq {
            // Below the longest answer the budget changes nothing: that answer runs alone.
            let n = self.largest(cfg, (seq, budget - 1), &|c, n| c.train.micro_batch_tokens = n);
            with(format!("train.micro_batch_tokens = {n}"), &|c| c.train.micro_batch_tokens = n);
        }
        if mb > 1 && budget == 0 {
            let n = self.largest(cfg, (1, mb - 1), &|c, n| c.train.micro_batch_size = n);
            with(format!("train.micro_batch_size = {n}"), &|c| c.train.micro_batch_size = n);
        }
        let response = cfg.data.sequence.max_response_tokens;
        if response == 0 || response > 1024 {
            let top = if response == 0 { self.model.max_position_embeddings } else { response - 1 };
            let n = self.largest(cfg, (1024, top), &|c, n| c.data.sequence.max_response_tokens = n) / 256 * 256;
            with(format!("data.max_response_tokens = {}", n.max(1024)), &|c| {
                c.data.sequence.max_response_tokens = n.max(1024)
            });
        }
        if let Some(r) = cfg.rollout.as_ref().filter(|r| r.max_new_tokens > 1024) {
            let set = |c: &mut TrainConfig, n| c.rollout.as_mut().expect("set").max_new_tokens = n;
            let n = self.largest(cfg, (1024, r.max_new_tokens - 1), &set) / 256 * 256;
            let n = n.max(1024);
            with(format!("rollout.max_new_tokens = {n}"), &|c| c.rollout.as_mut().expect("set").max_new_tokens = n);
        }
        if let Some(v) = cfg.validation.as_ref().filter(|v| v.batch_size > 1) {
            let set = |c: &mut TrainConfig, n| c.validation.as_mut().expect("set").batch_size = n;
            let n = self.largest(cfg, (1, v.batch_size - 1), &set);
            with(format!("validation.batch_size = {n}"), &|c| c.validation.as_mut().expect("set").batch_size = n);
        }
        if let Some(r) = cfg.rollout.as_ref().filter(|r| r.batch_size > 1) {
            let set = |c: &mut TrainConfig, n| c.rollout.as_mut().expect("set").batch_size = n;
            let n = self.largest(cfg, (1, r.batch_size - 1), &set);
            with(format!("rollout.batch_size = {n}"), &|c| c.rollout.as_mut().expect("set").batch_size = n);
        }
        out
    }

    /// The largest value in `low..=high` that `set` makes fit (a bisection: the peak grows with each of
    /// these settings), or `low` when none does.
    fn largest(&self, cfg: &TrainConfig, (low, high): (usize, usize), set: &dyn Fn(&mut TrainConfig, usize)) -> usize {
        let fits = |n: usize| {
            let mut c = cfg.clone();
            set(&mut c, n);
            self.fits_with(&c).is_some()
        };
        let (mut lo, mut hi) = (low, high);
        if !fits(lo) {
            return low;
        }
        while lo < hi {
            let mid = lo + (hi - lo).div_ceil(2);
            if fits(mid) {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        lo
    }

    /// When every setting at its least still does not fit: the part none of them changes (the weights,
    /// the f32 gradient accumulator, the optimiser state on the device, a reference copy, the context), and
    /// what can change it.
    fn fixed_part_advice(&self, floor: &TrainConfig) -> String {
        let fixed = plan(floor, &self.model, self.inputs);
        let names = ["weights", "gradients (f32 accumulator)", "optimizer state", "reference model", "anchor snapshot"];
        let part: u64 = fixed
            .components
            .iter()
            .filter(|c| c.place == Place::Device && names.contains(&c.name.as_str()))
            .map(|c| c.bytes)
            .sum();
        let part = match self.gpu_device(Place::Device) {
            true => POOL_OVERHEAD.pooled(part) + CUDA_CONTEXT_BYTES,
            false => part,
        };
        let memory = self.inputs.device_memory.unwrap_or(0);
        let ranks = match floor.optim.offload {
            true => "more ranks do not help: ZeRO-1 shards only the optimizer state, which optim.offload already \
                     keeps in host memory, and every rank holds the whole weights and f32 gradients"
                .to_string(),
            false => "more ranks shard the optimizer state (--world-size N: ZeRO-1) but not the weights or the f32 \
                      gradients"
                .to_string(),
        };
        format!(
            "no setting of this run can fit it: at the least of every one (the micro-batch, the lengths, the batch \
             sizes, recomputation, offload) the plan's peak is {}, of which {} is the part they do not change (the \
             weights, the f32 gradient accumulator, the optimizer state on the device, a reference copy, and on a \
             GPU the memory pool and the context) against the device's {}; {ranks}; a smaller model or a device \
             with more memory does",
            gib(fixed.peak(Place::Device)),
            gib(part),
            gib(memory)
        )
    }
}

impl Plan {
    /// The device peak's lines: the tensors' peak by phase and, on a GPU, the pool's overheads and the
    /// context beside it.
    fn fmt_device_peak(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let phase = |ph| gib(self.sum(ph, Place::Device));
        let resident = match self.gpu_device(Place::Device) {
            true => gib(self.sum(Phase::Resident, Place::Device).saturating_sub(CUDA_CONTEXT_BYTES)),
            false => phase(Phase::Resident),
        };
        let tensors = self.tensor_peak(Place::Device);
        let by_phase = format!(
            "resident {resident} + max(step {} + max(backward {}, update {}), validation {}, rollouts {})",
            phase(Phase::Step),
            phase(Phase::Backward),
            phase(Phase::Update),
            phase(Phase::Validation),
            phase(Phase::Rollout)
        );
        let peak = self.peak(Place::Device);
        if !self.gpu_device(Place::Device) {
            return writeln!(f, "device peak: {} ({peak} bytes) = {by_phase}", gib(peak));
        }
        let o = POOL_OVERHEAD;
        writeln!(f, "tensors' peak: {} = {by_phase}", gib(tensors))?;
        writeln!(
            f,
            "memory pool: {} = tensors x {:.4} (not itemised) x {:.4} (the pool's reserve), measured on {}",
            gib(o.pooled(tensors)),
            1.0 + o.unitemised,
            1.0 + o.reserve,
            o.measured
        )?;
        writeln!(f, "device peak: {} ({peak} bytes) = memory pool + context {}", gib(peak), gib(CUDA_CONTEXT_BYTES))
    }
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "memory plan: {}", self.summary)?;
        writeln!(f, "{:<46} {:>11}  {:<6}  {:<10}  formula", "component", "peak", "where", "when")?;
        for c in &self.components {
            let place = if self.inputs.on_cpu {
                "host"
            } else if c.place == Place::Device {
                "device"
            } else {
                "host"
            };
            let phase = match c.phase {
                Phase::Resident => "resident",
                Phase::Step => "step",
                Phase::Backward => "backward",
                Phase::Update => "update",
                Phase::Validation => "validation",
                Phase::Rollout => "rollouts",
                Phase::Alternative => "(not used)",
            };
            writeln!(f, "{:<46} {:>11}  {:<6}  {:<10}  {}", c.name, gib(c.bytes), place, phase, c.formula)?;
        }
        self.fmt_device_peak(f)?;
        if !self.inputs.on_cpu {
            writeln!(f, "host peak (optimizer state and update): {}", gib(self.peak(Place::Host)))?;
        }
        match self.inputs.device_memory {
            Some(m) => {
                let peak = self.peak(Place::Device);
                let verdict = if peak <= self.usable(m) {
                    format!("fits, {} ({:.0}%) left", gib(m - peak), 100.0 * (m - peak) as f64 / m as f64)
                } else if peak <= m {
                    format!(
                        "does NOT fit: {} under the device's memory, within the {:.0}% a GPU's plan keeps free for its \
                         measured overheads' spread",
                        gib(m - peak),
                        100.0 * GPU_HEADROOM
                    )
                } else {
                    format!("does NOT fit: {} over", gib(peak - m))
                };
                writeln!(f, "device memory: {}: {verdict}", gib(m))
            }
            None => writeln!(f, "device memory: unknown (give --device-memory)"),
        }?;
        match &self.keep_logits_note {
            Some(note) => writeln!(f, "{note}"),
            None => Ok(()),
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

/// The plan of a run of `cfg` on a model of shape `model`, with `device_memory` bytes on its device, per
/// rank of `world_size` data-parallel ranks sharding the optimizer state (1: one process). Where
/// `model.keep_logits` is "auto", the plan keeps the logits on a GPU of known memory when the plan with
/// them fills at most [`AUTO_KEEP_LOGITS_SHARE`] of what it may use, else plans without them.
pub fn run_plan(cfg: &TrainConfig, model: &ModelConfig, device_memory: Option<u64>, world_size: u64) -> Plan {
    if cfg.model.keep_logits.is_some() {
        return plan_as_set(cfg, model, device_memory, world_size);
    }
    let with = |keep: bool| {
        let mut c = cfg.clone();
        c.model.keep_logits = Some(keep);
        plan_as_set(&c, model, device_memory, world_size)
    };
    let kept = with(true);
    let (peak, usable) = match (kept.gpu_device(Place::Device), device_memory) {
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

/// [`run_plan`] with `model.keep_logits` as `cfg` sets it ("auto": not kept).
fn plan_as_set(cfg: &TrainConfig, model: &ModelConfig, device_memory: Option<u64>, world_size: u64) -> Plan {
    let inputs = PlanInputs {
        // Without the fused ops, attention goes through the composite score matrix.
        attention: if cfg.model.fused_ops { cfg.model.attention } else { Attention::Matrix },
        reference_cached: crate::train::refcache::reference_is_cacheable(cfg),
        on_cpu: !cfg.model.device.is_cuda(),
        device_memory,
        world_size,
    };
    plan(cfg, model, inputs)
}

/// The shape of one rank's training step for the performance model: its share of the step's questions
/// (whole groups: rank i takes groups i, i + N, ...) at the plan's micro-batch shape, `blocks` the
/// attention's blocking the op's own (GPU) choice.
pub fn step_shape(cfg: &TrainConfig, model: &ModelConfig, plan: &Plan) -> time::StepShape {
    let world_size = plan.inputs.world_size;
    let (prompt, response) = sequence_tokens(cfg, model);
    let group = cfg.rollout.as_ref().map_or(cfg.data.input.group.group_size, |r| r.n) as u64;
    let questions = (cfg.train.batch_questions as u64).div_ceil(world_size.max(1));
    let seq_tokens = prompt.saturating_add(response).max(1);
    time::StepShape {
        answers: questions.saturating_mul(group).max(1),
        // A packed row of the budget holds budget / T answers of the longest: the work of that many padded.
        micro_batch: answers_per_micro_batch(cfg, seq_tokens),
        seq_tokens,
        scored_tokens: response,
        dtype_bytes: cfg.model.dtype.size_in_bytes() as u64,
        checkpoint_layers: cfg.model.checkpoint_layers,
        recompute_attention: cfg.model.recompute_attention,
        reference_forward: cfg.objective.build().needs_reference()
            && !crate::train::refcache::reference_is_cacheable(cfg),
        offload: cfg.optim.offload,
        build: time::MeasuredBuild::Current,
        logprob_chunk_bytes: plan.logprob_chunk_bytes,
        optimizer_shards: world_size.max(1),
        blocks: time::driver_blocks(model, seq_tokens),
        tensor_cores: cfg.model.decoder_options().tensor_core_attention(cfg.model.dtype.dtype(), model.head_dim),
        atomic_dq: !cfg.model.deterministic_attention,
        warpgroup: matches!(cfg.model.attention, Attention::Wgmma | Attention::Auto),
        // The model counts adapters on every projection (the default target_modules).
        lora_rank: cfg.model.lora.as_ref().map_or(0, |l| l.r as u64),
        keep_logits: plan.keep_logits,
    }
}

/// The model shape of a run without loading any weight: `model.path`'s config.json, or, for a tiny model
/// not made yet, the config `model.init_tiny` will write.
pub fn model_config(cfg: &TrainConfig) -> Result<ModelConfig, ModelError> {
    let local = std::path::Path::new(&cfg.model.path);
    if let (Some(spec), false) = (&cfg.model.init_tiny, local.join("config.json").exists()) {
        return spec.config(&ChatTokenizer::load(&spec.tokenizer)?);
    }
    // A hub id not in the cache: its config.json alone, not the weights.
    let source = cfg.model.source()?;
    if let Some(repo) =
        crate::hub::model_ref(&source).filter(|_| !local.exists() && !crate::model::load::looks_local(&cfg.model.path))
    {
        let snapshot = crate::hub::repo_files(&crate::hub::Settings::from_env(), &repo, &["config.json"])?;
        return Ok(ModelConfig::from_file(&snapshot.dir.join("config.json"))?);
    }
    let dir = crate::model::resolve_model_dir(&source)?;
    Ok(ModelConfig::from_file(&dir.join("config.json"))?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    /// A Qwen2-like shape small enough to count by hand: h 8, 2 heads / 1 KV head of dim 4, i 16, V 32.
    fn shape() -> ModelConfig {
        let raw = serde_json::json!({"model_type": "qwen2", "vocab_size": 32, "hidden_size": 8,
            "intermediate_size": 16, "num_hidden_layers": 3, "num_attention_heads": 2, "num_key_value_heads": 1,
            "tie_word_embeddings": false});
        ModelConfig::from_json(raw, Path::new("test")).unwrap()
    }

    fn config(extra: &[&str]) -> TrainConfig {
        let base = "[model]\npath = \"m\"\ndtype = \"bf16\"\n[data]\ninputs = [\"x.jsonl\"]\nmax_prompt_tokens = 6\n\
                    max_response_tokens = 10\n[objective]\nbeta = 0.1\n[train]\nmicro_batch_size = 2\n";
        let o: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        TrainConfig::parse(base, Path::new("c.toml"), &o).unwrap()
    }

    fn inputs(attention: Attention) -> PlanInputs {
        PlanInputs { attention, reference_cached: false, on_cpu: false, device_memory: Some(4 << 30), world_size: 1 }
    }

    fn bytes(p: &Plan, name: &str) -> u64 {
        p.components.iter().find(|c| c.name == name).unwrap_or_else(|| panic!("no {name}")).bytes
    }

    /// Kept logits are one more backward component, `n V d` (2 answers of 10 scored tokens), which the
    /// advice drops first when the step does not fit.
    #[test]
    fn kept_logits_are_counted_and_advised_away() {
        let m = shape();
        let (base, keeping) =
            (config(&["model.logprob_chunk_mb=1"]), config(&["model.logprob_chunk_mb=1", "model.keep_logits=true"]));
        let (plain, kept) =
            (super::plan(&base, &m, inputs(Attention::Flash)), super::plan(&keeping, &m, inputs(Attention::Flash)));
        let name = "logits kept (model.keep_logits)";
        assert_eq!(bytes(&kept, name), 2 * 10 * m.vocab_size as u64 * 2);
        assert!(plain.components.iter().all(|c| c.name != name));
        assert!(kept.tensor_peak(Place::Device) > plain.tensor_peak(Place::Device));
        // A device with the plain step's peak: keeping the logits does not fit, and the advice drops them.
        let memory = (plain.peak(Place::Device) as f64 / (1.0 - GPU_HEADROOM)).ceil() as u64 + 64;
        let tight = PlanInputs { device_memory: Some(memory), ..inputs(Attention::Flash) };
        assert_eq!(super::plan(&base, &m, tight).fits(), Some(true));
        let tight_plan = super::plan(&keeping, &m, tight);
        assert_eq!(tight_plan.fits(), Some(false), "{tight_plan}");
        assert!(tight_plan.advice(&keeping).contains("model.keep_logits = false"), "{}", tight_plan.advice(&keeping));
    }

    /// "auto" (the default) keeps the logits on a GPU where the plan with them leaves room to spare, never
    /// on the CPU or where the memory is unknown; `true` and `false` are kept as set.
    #[test]
    fn auto_keeps_logits_only_with_room_to_spare() {
        let m = shape();
        let gpu = |extra: &[&str]| config(&[&["model.logprob_chunk_mb=1", "model.device=cuda"], extra].concat());
        let kept = run_plan(&gpu(&["model.keep_logits=true"]), &m, None, 1);
        let plain = run_plan(&gpu(&["model.keep_logits=false"]), &m, None, 1);
        let (with, without) = (kept.peak(Place::Device) as f64, plain.peak(Place::Device) as f64);
        let usable = |share: f64| (share / (1.0 - GPU_HEADROOM)).ceil() as u64;
        // Room to spare: the peak with them at the share of what the plan may use.
        let roomy = usable(with / AUTO_KEEP_LOGITS_SHARE) + 64;
        // Room for them, not to spare: the peak with them fits, above the share.
        let snug = usable(with) + 64;
        assert!(without < with && (snug as f64) < roomy as f64 - 64.0);
        let auto = |c: &TrainConfig, memory: Option<u64>| run_plan(c, &m, memory, 1);
        let (roomy_plan, snug_plan) = (auto(&gpu(&[]), Some(roomy)), auto(&gpu(&[]), Some(snug)));
        assert!(roomy_plan.keep_logits && roomy_plan.components.iter().any(|c| c.name.starts_with("logits kept")));
        assert!(roomy_plan.to_string().contains("model.keep_logits = \"auto\": kept"), "{roomy_plan}");
        assert!(snug_plan.to_string().contains("model.keep_logits = \"auto\": recomputed"), "{snug_plan}");
        assert!(!snug_plan.keep_logits && snug_plan.components.iter().all(|c| !c.name.starts_with("logits kept")));
        assert_eq!(
            (snug_plan.fits(), auto(&gpu(&["model.keep_logits=true"]), Some(snug)).fits()),
            (Some(true), Some(true))
        );
        assert!(!auto(&gpu(&[]), None).keep_logits);
        assert!(!auto(&config(&["model.logprob_chunk_mb=1"]), Some(1 << 40)).keep_logits, "the CPU");
        assert!(!auto(&gpu(&["model.keep_logits=false"]), Some(roomy)).keep_logits);
        assert!(auto(&gpu(&["model.keep_logits=true"]), Some(snug)).keep_logits);
        // The step's shape follows the plan's choice.
        assert!(
            step_shape(&gpu(&[]), &m, &roomy_plan).keep_logits && !step_shape(&gpu(&[]), &m, &snug_plan).keep_logits
        );
        // The key takes true, false and "auto", and names what it expected otherwise.
        assert_eq!(gpu(&["model.keep_logits=auto"]).model.keep_logits, None);
        let toml = "[model]\npath = \"m\"\nkeep_logits = \"auto\"\n[data]\ninputs = [\"x.jsonl\"]\n";
        assert_eq!(TrainConfig::parse(toml, Path::new("c.toml"), &[]).unwrap().model.keep_logits, None);
        let bad = TrainConfig::parse(toml.replace("auto", "often").as_str(), Path::new("c.toml"), &[]).unwrap_err();
        assert!(bad.to_string().contains("expected true, false or \"auto\""), "{bad}");
    }

    #[test]
    fn components_follow_the_formulas() {
        let m = shape();
        // P: embed + lm_head 2 x 32 x 8, per layer q 64 + k 32 + v 32 + o 64 + biases 16 + MLP 384 + norms 16.
        let p = 2 * 32 * 8 + 3 * (64 + 32 + 32 + 64 + 16 + 384 + 16) + 8;
        assert_eq!(m.num_parameters(), p as usize);
        let plan = plan(&config(&[]), &m, inputs(Attention::Matrix));
        assert_eq!(bytes(&plan, "weights"), 2 * p);
        assert_eq!(bytes(&plan, "gradients (f32 accumulator)"), 4 * p);
        assert_eq!(bytes(&plan, "optimizer state"), 12 * p);
        assert_eq!(bytes(&plan, "reference model"), 2 * p); // beta > 0: the reference is loaded
                                                            // N = 2 x 16 = 32 tokens; per layer: 8 [N,8] + 5 [N,8] (q, with bias) + 6 [N,4] (k, v) + 4 [N,16]
                                                            // = 64 + 40 + 24 + 64 = 192 values per token, in bf16; scores + probs 2 x 2 x 2 x 16^2 x 2 B.
        let layer = 32 * 192 * 2 + 2 * 2 * 2 * 256 * 2;
        assert_eq!(bytes(&plan, "activations, checkpoint_layers = false"), 3 * layer + 32 * 8 * 2);
        assert_eq!(bytes(&plan, "activations, checkpoint_layers = true"), 4 * 32 * 8 * 2 + layer);
        // n = 2 x 10 scored tokens.
        assert_eq!(bytes(&plan, "log-prob head inputs"), 3 * 20 * 8 * 2 + 16 * 20);
        let flash = super::plan(&config(&[]), &m, inputs(Attention::Flash));
        let saved = bytes(&flash, "activations, checkpoint_layers = false");
        assert_eq!(saved, 3 * (32 * 192 * 2 + 4 * 2 * 2 * 16) + 32 * 8 * 2);
        // Kept attention outputs: per layer [N, q = 8] in bf16 and 4 B x 2 rows x 2 heads x 16 tokens; counted
        // in the backward only when the attention is not recomputed.
        let kept = "attention outputs kept (recompute_attention = false)";
        let recomputed = super::plan(&config(&["model.checkpoint_layers=true"]), &m, inputs(Attention::Flash));
        let keeping = &config(&["model.checkpoint_layers=true", "model.recompute_attention=false"]);
        let kept_plan = super::plan(keeping, &m, inputs(Attention::Flash));
        assert_eq!(bytes(&kept_plan, kept), 3 * (32 * 8 * 2 + 4 * 2 * 2 * 16));
        assert_eq!(bytes(&recomputed, kept), bytes(&kept_plan, kept));
        let extra = kept_plan.tensor_peak(Place::Device) - recomputed.tensor_peak(Place::Device);
        assert_eq!(extra, bytes(&kept_plan, kept), "{kept_plan}");
        assert!(kept_plan.advice(keeping).contains("model.recompute_attention = true"));
        assert!(!recomputed.advice(&config(&["model.checkpoint_layers=true"])).contains("recompute_attention"));
        // dq by atomics: an f32 accumulator of [N, q] in the attention workspace.
        let mma = super::plan(&config(&[]), &m, inputs(Attention::Mma));
        let atomic = super::plan(&config(&["model.deterministic_attention=false"]), &m, inputs(Attention::Mma));
        let workspace = |p: &Plan| bytes(p, "attention workspace");
        assert_eq!(workspace(&atomic) - workspace(&mma), 32 * 8 * 4);
    }

    /// On a GPU the device's peak is what nvidia-smi sees: the pool holding the plan's tensors with its
    /// measured overheads, and the context outside it; on the CPU the tensors alone. A chunk left to the
    /// device is sized from the memory the pool and the context leave free, as the run sizes it.
    #[test]
    fn the_gpu_peak_is_the_pool_with_its_overheads_beside_the_context() {
        let m = shape();
        let gpu = plan(&config(&[]), &m, inputs(Attention::Flash));
        let tensors = gpu.tensor_peak(Place::Device);
        let pooled = (tensors as f64 * (1.0 + POOL_OVERHEAD.unitemised) * (1.0 + POOL_OVERHEAD.reserve)) as u64;
        assert_eq!(gpu.peak(Place::Device), pooled + CUDA_CONTEXT_BYTES);
        assert!(gpu.to_string().contains("memory pool:"), "{gpu}");
        let cpu = plan(&config(&[]), &m, PlanInputs { on_cpu: true, ..inputs(Attention::Flash) });
        assert_eq!(cpu.peak(Place::Device), cpu.tensor_peak(Place::Device));
        assert!(!cpu.to_string().contains("memory pool:"), "{cpu}");
        // Sized as the run sizes it: an eighth of what the pool's other tensors and the context leave free.
        let device = CUDA_CONTEXT_BYTES + POOL_OVERHEAD.pooled(tensors) + (24u64 << 30);
        let sized =
            super::plan(&config(&[]), &m, PlanInputs { device_memory: Some(device), ..inputs(Attention::Flash) });
        let chunk = sized.components.iter().find(|c| c.name.starts_with("log-prob chunk")).unwrap().bytes;
        let others = sized.peak(Place::Device) - POOL_OVERHEAD.pooled(chunk);
        let expected = crate::kernels::gpu_chunk_bytes(device - others) as u64;
        assert!(
            sized.logprob_chunk_bytes.abs_diff(expected) <= expected / 100,
            "{} vs {expected}",
            sized.logprob_chunk_bytes
        );
        assert!(sized.logprob_chunk_bytes > 2 << 30, "{}", sized.logprob_chunk_bytes);
    }

    #[test]
    fn zero1_shards_only_the_optimizer_state() {
        let m = shape();
        let p = m.num_parameters() as u64;
        let one = plan(&config(&[]), &m, inputs(Attention::Flash));
        let four = plan(&config(&[]), &m, PlanInputs { world_size: 4, ..inputs(Attention::Flash) });
        assert_eq!(bytes(&four, "optimizer state"), (12 * p).div_ceil(4));
        for same in ["weights", "gradients (f32 accumulator)", "reference model"] {
            assert_eq!(bytes(&four, same), bytes(&one, same), "{same}");
        }
        // The peak drops by the state's three quarters, less the collectives' device buffers when the
        // update phase is the peak; the collectives' host staging is the flat gradients and a block.
        let (saved, buffers) = (12 * p - (12 * p).div_ceil(4), bytes(&four, "collective buffers (NCCL, per piece)"));
        let drop = one.tensor_peak(Place::Device) - four.tensor_peak(Place::Device);
        assert!(drop <= saved && drop + buffers >= saved, "{drop} {saved} {buffers}");
        assert_eq!(buffers, 4 * (p + p / 4));
        let staging = four.components.iter().find(|c| c.name == "collective staging (f32 gradients / weights)");
        assert_eq!(staging.map(|c| (c.bytes, c.place)), Some((4 * p + 4 * p / 4, Place::Host)));
        assert!(one.components.iter().all(|c| !c.name.starts_with("collective")));
        assert!(four.summary.contains("per rank of 4"), "{}", four.summary);
        // Offloaded, the shard is in host memory.
        let off = plan(&config(&["optim.offload=true"]), &m, PlanInputs { world_size: 4, ..inputs(Attention::Flash) });
        assert_eq!(off.components.iter().find(|c| c.name == "optimizer state").unwrap().place, Place::Host);
        assert!(off.peak(Place::Host) >= (12 * p).div_ceil(4));
    }

    #[test]
    fn rollouts_add_their_kv_cache_and_a_lagged_policy_copy() {
        let m = shape();
        let p = m.num_parameters() as u64;
        let set = ["rollout.batch_size=4", "rollout.max_new_tokens=10"];
        let on_policy = plan(&config(&set), &m, inputs(Attention::Flash));
        assert!(on_policy.components.iter().all(|c| c.name != "rollout sampling policy copy"));
        // 3 layers x 2 (k, v) x kv width 4 x 2 B per token; 4 sequences of 6 + 10 tokens (the paged pool,
        // the default: one block of 16 positions each; static batches count them twice); two f32 rows of 32
        // logits per sequence.
        let logits = 2 * 4 * 32 * 4;
        assert_eq!(bytes(&on_policy, "rollout KV cache"), 4 * 16 * (2 * 3 * 4 * 2) + logits);
        let static_batches =
            plan(&config(&[set[0], set[1], "rollout.generation.schedule=static"]), &m, inputs(Attention::Flash));
        assert_eq!(bytes(&static_batches, "rollout KV cache"), 2 * 4 * 16 * (2 * 3 * 4 * 2) + logits);
        let lagged = plan(&config(&[set[0], set[1], "rollout.sync_every=2"]), &m, inputs(Attention::Flash));
        assert_eq!(bytes(&lagged, "rollout sampling policy copy"), 2 * p);
        assert_eq!(lagged.tensor_peak(Place::Device), on_policy.tensor_peak(Place::Device) + 2 * p);
        let generation = on_policy.sum(Phase::Rollout, Place::Device);
        let (resident, step) = (on_policy.sum(Phase::Resident, Place::Device), on_policy.step_peak(Place::Device));
        assert_eq!(on_policy.tensor_peak(Place::Device) + CUDA_CONTEXT_BYTES, resident + step.max(generation));
    }

    #[test]
    fn with_rollouts_answers_are_sized_by_max_new_tokens() {
        let m = shape();
        // data.max_response_tokens = 10, but the sampled answers have at most 3 tokens + EOS.
        let p = plan(&config(&["rollout.max_new_tokens=3"]), &m, inputs(Attention::Flash));
        assert!(p.summary.ends_with("micro-batch 2 x 10 tokens (6 + 4)"), "{}", p.summary);
        assert_eq!(bytes(&p, "log-prob head inputs"), 3 * 8 * 8 * 2 + 16 * 8);
        // Teacher answers mixed in keep the data's limit.
        let mixed =
            plan(&config(&["rollout.max_new_tokens=3", "rollout.teacher_answers=1"]), &m, inputs(Attention::Flash));
        assert!(mixed.summary.ends_with("(6 + 10)"), "{}", mixed.summary);
    }

    /// With `train.micro_batch_tokens` a micro-batch is one packed row of the budget (of the longest
    /// answer when that is longer), every token of which may be scored; the performance model sees as many
    /// answers per micro-batch as the budget holds; the advice lowers the budget, not micro_batch_size.
    #[test]
    fn packed_micro_batches_plan_one_row_of_the_budget() {
        let m = shape();
        let [padded, packed] = [&[][..], &["train.micro_batch_tokens=32"]]
            .map(|set| [Attention::Flash, Attention::Matrix].map(|a| plan(&config(set), &m, inputs(a))));
        assert!(padded[0].summary.ends_with("micro-batch 2 x 16 tokens (6 + 10)"), "{}", padded[0].summary);
        assert!(packed[0].summary.contains("micro-batch 1 x 32 tokens (packed"), "{}", packed[0].summary);
        // The same 32 tokens per micro-batch: the layers' saved activations match (flash attention).
        for c in ["activations, checkpoint_layers = true", "activations, checkpoint_layers = false"] {
            assert_eq!(bytes(&packed[0], c), bytes(&padded[0], c), "{c}");
        }
        // 32 scored tokens (2 x 10 padded), and the score matrix of one row of 32 (two of 16 padded).
        assert_eq!(bytes(&packed[0], "log-prob head inputs"), 3 * 32 * 8 * 2 + 16 * 32);
        assert_eq!(bytes(&padded[0], "log-prob head inputs"), 3 * 20 * 8 * 2 + 16 * 20);
        assert_eq!(bytes(&packed[1], "attention workspace"), 2 * bytes(&padded[1], "attention workspace"));
        // A budget under the longest answer: that answer alone.
        let short = plan(&config(&["train.micro_batch_tokens=5"]), &m, inputs(Attention::Flash));
        assert!(short.summary.contains("micro-batch 1 x 16 tokens"), "{}", short.summary);
        let shape_of = |set: &[&str]| {
            let cfg = config(set);
            step_shape(&cfg, &m, &plan(&cfg, &m, inputs(Attention::Flash))).micro_batch
        };
        assert_eq!((shape_of(&["train.micro_batch_tokens=40"]), shape_of(&["train.micro_batch_tokens=5"])), (2, 1));
        let cfg = config(&["train.micro_batch_tokens=4096"]);
        let mut p = plan(&cfg, &m, PlanInputs { on_cpu: true, ..inputs(Attention::Matrix) });
        p.inputs.device_memory = Some(p.peak(Place::Device) - 1);
        let advice = p.advice(&cfg);
        assert!(advice.contains("train.micro_batch_tokens = ") && !advice.contains("micro_batch_size"), "{advice}");
    }

    #[test]
    fn absurd_shapes_do_not_hang_or_wrap_around_to_fit() {
        let start = std::time::Instant::now();
        let deep = ModelConfig { num_layers: 1_000_000_000, ..shape() };
        assert_eq!(plan(&config(&[]), &deep, inputs(Attention::Flash)).fits(), Some(false));
        assert!(start.elapsed() < std::time::Duration::from_secs(1), "{:?}", start.elapsed());
        for wide in [ModelConfig { vocab_size: usize::MAX, ..shape() }, ModelConfig { hidden_size: 1 << 40, ..shape() }]
        {
            let p = plan(&config(&[]), &wide, inputs(Attention::Matrix));
            assert_eq!(p.fits(), Some(false), "{p}");
        }
        // The largest values the config accepts: the matrix plan of their scores is past u64 and saturates.
        let long = config(&["data.max_prompt_tokens=16777216", "train.micro_batch_size=1048576"]);
        let p = plan(&long, &shape(), inputs(Attention::Matrix));
        assert_eq!((p.fits(), p.peak(Place::Device)), (Some(false), u64::MAX), "{p}");
    }

    #[test]
    fn switches_move_memory_where_they_say() {
        let m = shape();
        let base = plan(&config(&[]), &m, inputs(Attention::Matrix));
        let off = plan(&config(&["optim.offload=true"]), &m, inputs(Attention::Matrix));
        assert!(off.peak(Place::Device) < base.peak(Place::Device));
        assert_eq!(off.components.iter().find(|c| c.name == "optimizer state").unwrap().place, Place::Host);
        assert!(off.peak(Place::Host) >= 12 * m.num_parameters() as u64);
        let cached = PlanInputs { reference_cached: true, ..inputs(Attention::Matrix) };
        let with_cache = plan(&config(&[]), &m, cached);
        // The reference's weights (2 P) leave; its log-probs (4 B for each of the 20 scored tokens) come in.
        assert_eq!(
            base.tensor_peak(Place::Device) - with_cache.tensor_peak(Place::Device),
            2 * m.num_parameters() as u64 - 80
        );
        let no_ref = plan(&config(&["objective.beta=0"]), &m, inputs(Attention::Matrix));
        assert!(!no_ref.components.iter().any(|c| c.name.starts_with("reference")));
        // On the CPU the host is the device: offload changes nothing there.
        let cpu = |c: &TrainConfig| plan(c, &m, PlanInputs { on_cpu: true, ..inputs(Attention::Matrix) });
        let (a, b) = (cpu(&config(&[])), cpu(&config(&["optim.offload=true"])));
        assert_eq!(bytes(&a, "optimizer state"), bytes(&b, "optimizer state"));
        assert!(a.to_string().contains("process"));
    }

    #[test]
    fn the_verdict_and_the_table() {
        let m = shape();
        let mut p = plan(&config(&[]), &m, inputs(Attention::Matrix));
        assert_eq!(p.fits(), Some(true));
        p.inputs.device_memory = Some(1000);
        assert_eq!(p.fits(), Some(false));
        let text = p.to_string();
        assert!(text.contains("does NOT fit") && text.contains("weights") && text.contains("device peak"), "{text}");
        p.inputs.device_memory = None;
        assert_eq!(p.fits(), None);
        // Nothing fits 1000 bytes: the advice names the part no setting changes, and suggests no value.
        let cfg = config(&[]);
        let none = p.advice(&cfg);
        assert!(none.contains("no setting of this run can fit it") && none.contains("do not change"), "{none}");
        assert!(!none.contains(" = "), "{none}");
        // On a device between the floor and the plan, each setting that fits alone is named with its value
        // and the peak it plans, and only those.
        let floor = config(&["model.checkpoint_layers=true", "train.micro_batch_size=1", "optim.offload=true"]);
        let cpu = |a| PlanInputs { on_cpu: true, ..inputs(a) };
        let floor = plan(&floor, &m, PlanInputs { reference_cached: true, ..cpu(Attention::Flash) });
        let mut q = plan(&cfg, &m, cpu(Attention::Matrix));
        q.inputs.device_memory = Some(q.peak(Place::Device) - 1);
        let advice = q.advice(&cfg);
        assert!(advice.starts_with("reduce the peak with") && advice.contains("(peak "), "{advice}");
        for way in advice.trim_start_matches("reduce the peak with ").split(", or ").filter(|w| w.contains("(peak")) {
            let peak = way.rsplit("(peak ").next().unwrap().split(" GiB").next().unwrap();
            let peak = peak.parse::<f64>().unwrap() - 0.005; // (shown to 0.01 GiB)
            assert!(peak * (1u64 << 30) as f64 <= q.inputs.device_memory.unwrap() as f64, "{way}");
        }
        assert!(floor.peak(Place::Device) < q.peak(Place::Device));
        // Settings the config already has are not advised.
        let set = config(&["model.checkpoint_layers=true", "train.micro_batch_size=1", "optim.offload=true"]);
        let mut r = plan(&set, &m, PlanInputs { reference_cached: true, ..cpu(Attention::Flash) });
        r.inputs.device_memory = Some(r.peak(Place::Device) - 1);
        let advice = r.advice(&set);
        for key in ["checkpoint_layers", "micro_batch_size", "offload", "attention", "cache_reference"] {
            assert!(!advice.contains(&format!("{key} = ")), "{key}: {advice}");
        }
    }

    #[test]
    fn sizes_parse_with_units() {
        assert_eq!(parse_bytes("80GiB"), Ok(80 << 30));
        assert_eq!(parse_bytes("80 GB"), Ok(80_000_000_000));
        assert_eq!(parse_bytes("512MiB"), Ok(512 << 20));
        assert_eq!(parse_bytes("1.5gib"), Ok(3 << 29));
        assert_eq!(parse_bytes("1024"), Ok(1024));
        for bad in ["", "GiB", "-1GiB", "nan", "80 parsecs", "0"] {
            assert!(parse_bytes(bad).is_err(), "{bad}");
        }
    }
}
