//! The memory plan of a training run: what each component of a step needs at its peak, where it lives
//! (device or host memory) and whether the total fits; from the configuration and the model's `config.json`
//! (no weights are loaded). The notation and formulas: docs/reference.md, "Memory plan".

pub use input::{GenerationLoad, PlanInput, RolloutLoad};

use self::{Phase::*, Place::*};
use super::time;
use crate::device::staging::{chunk_len, staging_bytes};
use crate::generate::GenerationOptions;
use crate::model::{Attention, ModelConfig};

/// The process's own memory on the CPU beyond its tensors (code, tokenizer, data reader, threads, the
/// checkpoint write, the allocator's keep): measured with tests/plan_cli.rs's tiny model (101-121 MiB).
pub const CPU_PROCESS_BYTES: u64 = 112 << 20;

/// Device memory outside candle's pool on a GPU: the CUDA context, the kernels' modules, cuBLAS's workspaces.
pub const CUDA_CONTEXT_BYTES: u64 = 768 << 20;

/// What candle's memory pool holds on a GPU beyond the plan's tensors, as fractions.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PoolOverhead {
    /// The pool's peak in use over the plan's tensors (what the plan does not itemise).
    pub unitemised: f64,
    /// The pool's reserve over its peak in use (kept for reuse, lost to fragmentation).
    pub reserve: f64,
    /// Where it was measured.
    pub measured: &'static str,
}

/// Measured at the seed's 7B step on an H100 (benches/results/gpu-2026-11-26-h100.*).
pub const POOL_OVERHEAD: PoolOverhead =
    PoolOverhead { unitemised: 0.0485, reserve: 0.1290, measured: "H100 80GB HBM3, 2026-11-26" };

/// The fraction of a GPU's memory a plan leaves free, for the spread of the pool's overheads.
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
    /// A training step, from the first backward to the end of the update.
    Step,
    /// The forward and backward of a micro-batch.
    Backward,
    Update,
    /// Validation's generation.
    Validation,
    /// A step's rollouts (`[rollout]`).
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
    pub input: PlanInput,
    /// Model and micro-batch, for the heading.
    pub summary: String,
    /// Bytes of the log-prob op's logits chunk the run uses (as the device sizes it when not set).
    pub logprob_chunk_bytes: u64,
    /// Whether the log-prob head keeps its logits: `model.keep_logits`, or "auto" decided ([`run_plan`]).
    pub keep_logits: bool,
    /// That choice and why, where "auto" made it on a GPU.
    pub keep_logits_note: Option<String>,
}

/// The activations of one micro-batch kept for (and made during) the backward, in bytes.
///
/// A layer keeps (each tensor of `Decoder::layer` once) 8 [N,h] (+1 per o_proj / down_proj bias),
/// 4 [N,q] (+1 with q/k/v biases), 4 [N,kv] (+2 with biases), with q/k norms 2 [N,q] + 2 [N,kv],
/// 4 [N,i] (+2 with MLP biases), and the attention's scores and probabilities (2 B heads T^2, matrix)
/// or its f32 log-sum-exp (4 B heads T, flash). `checkpoint_layers` keeps the L + 1 layer inputs and
/// one layer's tensors at a time. A layer's backward works in (3i+3h+2q) N d, the matrix attention's
/// in 2 B heads T^2 d more; the head keeps 3 [n,h] and accumulates the lm_head gradient in f32 (12 V h,
/// one chunk: 4 V h, and its d-byte original when d < 4) beside 2 rows V d of logits and their gradient.
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

/// LoRA's sizes: the adapters' parameters (in all, in a layer, the largest tensor), the bytes per token a
/// layer's adapters keep for the backward (each projection's `[N, r]` f32 product with A), and the f32
/// bytes per token of the largest projection's backward (`[N, in]` twice and `[N, out]`).
struct Lora {
    params: u64,
    layer: u64,
    largest: u64,
    saved_per_token: f64,
    backward_per_token: f64,
}

impl Lora {
    fn of(m: &ModelConfig, opts: &crate::model::LoraOptions) -> Self {
        let shapes = crate::model::lora::adapter_shapes(&one_layer(m), opts);
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

/// A one-layer copy of the shape (every layer has the same tensors, and the layer count may be large).
fn one_layer(m: &ModelConfig) -> ModelConfig {
    ModelConfig { num_layers: 1, ..m.clone() }
}

/// Sequence shape of the largest micro-batch.
struct Shape {
    b: u64,
    t: u64,
    n_scored: u64,
}

/// Bytes of a size computed in f64: an absurd configuration saturates at u64::MAX (it does not fit).
fn to_bytes(x: f64) -> u64 {
    match x.is_nan() {
        true => u64::MAX,
        false => x as u64, // saturating
    }
}

/// The largest decoder layer's and the largest tensor's parameter counts.
fn largest_params(m: &ModelConfig) -> (u64, u64) {
    let shapes = crate::model::decoder::parameter_shapes(&one_layer(m));
    let size = |s: &[usize]| to_bytes(s.iter().map(|&x| x as f64).product());
    let largest = shapes.iter().map(|(_, s)| size(s)).max().unwrap_or(0);
    let layer0 = shapes.iter().filter(|(n, _)| n.starts_with("model.layers.0.")).map(|(_, s)| size(s));
    (layer0.fold(0, u64::saturating_add), largest)
}

impl Activations {
    /// `lora`: per token, the bytes each layer's adapters keep for the backward.
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
        let matrix = attention == Attention::Matrix;
        let scores = 2.0 * b * heads * t * t * d;
        let (attn_saved, attn_work) =
            if matrix { (scores, scores) } else { (4.0 * b * heads * t, 8.0 * b * heads * t) };
        let layer = n * (width * d + lora) + attn_saved;
        let rows = (chunk_bytes as f64 / (4.0 * v).max(1.0)).floor().clamp(1.0, 65536.0).min(n_scored.max(1.0));
        let head_backward = match (n_scored <= rows, d >= 4.0) {
            (true, true) => 4.0 * v * h,
            (true, false) => (4.0 + d) * v * h,
            (false, _) => 12.0 * v * h,
        };
        Self {
            saved_full: to_bytes(l * layer + n * h * d),
            saved_checkpointed: to_bytes((l + 1.0) * n * h * d + layer),
            layer_backward: to_bytes(n * (3.0 * i + 3.0 * h + 2.0 * q) * d),
            attention_workspace: to_bytes(attn_work),
            kept_attention: if matrix { 0 } else { to_bytes(l * (n * q * d + 4.0 * b * heads * t)) },
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
    // Left to the device, the chunk is sized from the memory free when the head runs: the device's less
    // the pool holding the other tensors (from the plan with the smallest chunk) and the context.
    let chunk = first.components.iter().filter(|c| c.name.starts_with("log-prob chunk")).map(|c| c.bytes).max();
    let others = first.peak(Device).saturating_sub(POOL_OVERHEAD.pooled(chunk.unwrap_or(0)));
    let free = input.device_memory.unwrap_or(DEFAULT_GPU_MEMORY).saturating_sub(others);
    plan_with_chunk(input, logprob_chunk_bytes(input, Some(free)))
}

/// Device memory assumed for sizing a device-sized log-prob chunk when the plan is given none (80 GB).
const DEFAULT_GPU_MEMORY: u64 = 80_000_000_000;

/// The log-prob op's logits chunk: `model.logprob_chunk_mb`, else as [`crate::kernels::logprob_chunk_bytes`]
/// sizes it (on a GPU from `free`; unknown: the minimum).
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
    basis.generation(&mut c);
    Plan {
        components: c.0,
        input: input.clone(),
        summary: basis.summary(),
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

/// What the plan's parts are computed from: the input, d bytes an element, P parameters, the longest prompt
/// and answer, the largest micro-batch, what is trained (every weight or the adapters: in all, in a layer,
/// the largest tensor), the ranks (at least 1), and whether the tensor-core backward sums dq by atomics.
struct Basis<'a> {
    input: &'a PlanInput,
    model: &'a ModelConfig,
    d: u64,
    p: u64,
    prompt: u64,
    response: u64,
    shape: Shape,
    lora: Option<Lora>,
    p_train: u64,
    p_layer: u64,
    p_max: u64,
    world: u64,
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
        let (d, shape) = (input.dtype.size_in_bytes() as u64, micro_batch_shape(input, prompt, response));
        let atomic_dq = tensor_core_backward(input) && !input.decoder.deterministic_attention;
        let world = input.world_size.max(1);
        Basis { input, model, d, p, prompt, response, shape, lora, p_train, p_layer, p_max, world, atomic_dq }
    }

    /// The micro-batch's activations, with the head's and the attention's workspaces as this run has them.
    fn activations(&self, chunk_bytes: u64) -> Activations {
        let (input, model, shape) = (self.input, self.model, &self.shape);
        let lora_bytes = self.lora.as_ref().map_or(0.0, |l| l.saved_per_token);
        let mut act = Activations::new(model, shape, self.d, input.attention, chunk_bytes, lora_bytes);
        if input.decoder.fused_ops || self.lora.is_some() {
            // Fused, the lm_head's gradient goes chunk by chunk into the step's accumulator
            // (kernels::wgrad_accumulate); with LoRA the frozen lm_head gets none.
            act.head_backward = 0;
        }
        if let Some(l) = &self.lora {
            act.layer_backward += to_bytes(shape.b as f64 * shape.t as f64 * l.backward_per_token);
        }
        if tensor_core_backward(input) {
            // The dk/dv partial sums (each KV head's group split over the kernel's blocks) and, with dq by
            // atomics, its f32 accumulator, [N, q].
            let q = (model.num_heads as u64).saturating_mul(model.head_dim as u64);
            let dq =
                if self.atomic_dq { shape.b.saturating_mul(shape.t).saturating_mul(q).saturating_mul(4) } else { 0 };
            let (b, t) = (shape.b as usize, shape.t as usize);
            let parts =
                crate::kernels::dkv_partial_sum_bytes(b, model.num_heads, model.num_kv_heads, t, model.head_dim);
            act.attention_workspace = act.attention_workspace.saturating_add(dq).saturating_add(parts);
        }
        act
    }

    /// The plan's first line: the model's shape, the micro-batch and the ranks.
    fn summary(&self) -> String {
        let ModelConfig { num_layers, hidden_size, num_heads, num_kv_heads, intermediate_size, vocab_size, .. } =
            self.model;
        let (input, Shape { b, t, .. }, prompt, response) = (self.input, &self.shape, self.prompt, self.response);
        let params = self.model.num_parameters() as f64 / 1e9;
        let packed =
            if input.micro_batch_tokens > 0 { "packed: train.micro_batch_tokens; answers of up to " } else { "" };
        let ranks = match self.world {
            1 => String::new(),
            n => format!("; per rank of {n} (ZeRO-1: the optimizer state sharded)"),
        };
        format!(
            "{num_layers} layers, hidden {hidden_size}, {num_heads} heads / {num_kv_heads} KV heads, intermediate \
             {intermediate_size}, vocab {vocab_size}: {params:.2}B parameters, {}; micro-batch {b} x {t} tokens \
             ({packed}{prompt} + {response}){ranks}",
            input.dtype
        )
    }

    /// "P_lora" or "P": the trained parameters in the formulas.
    fn pn(&self) -> &'static str {
        self.lora.as_ref().map_or("P", |_| "P_lora")
    }

    /// Adds `name`, resident on the device: a copy of the weights (P d), or with LoRA and `adapters` of the
    /// adapters (P_lora x 4 B).
    fn copy(&self, c: &mut Components, name: &str, adapters: bool) {
        let (bytes, formula) = match &self.lora {
            Some(l) if adapters => (l.params.saturating_mul(4), "P_lora x 4 B".into()),
            _ => (self.p.saturating_mul(self.d), format!("P x {} B", self.d)),
        };
        c.add(name, bytes, Device, Resident, formula);
    }

    /// What the run holds throughout: weights, adapters, gradients, optimizer state, the reference, the
    /// anchor, and the process or the CUDA context.
    fn resident(&self, c: &mut Components) {
        let input = self.input;
        self.copy(c, "weights", false);
        if self.lora.is_some() {
            self.copy(c, "LoRA adapters (f32)", true);
        }
        let pn = self.pn();
        c.add("gradients (f32 accumulator)", self.p_train.saturating_mul(4), Device, Step, format!("{pn} x 4 B"));
        self.optimizer_state(c);
        if input.needs_reference {
            if input.reference_cached() {
                let bytes = self.shape.n_scored.saturating_mul(4);
                c.add("reference log-probs (cached)", bytes, Device, Backward, "4 B x scored tokens of a micro-batch");
            } else if self.lora.is_some() && !input.own_reference {
                c.add("reference model", 0, Device, Resident, "the policy's base weights (LoRA)");
            } else {
                self.copy(c, "reference model", false);
            }
        }
        if input.snapshot_anchor {
            // With LoRA a frozen copy of the adapters, sharing the base weights.
            self.copy(c, "anchor snapshot", true);
        }
        let (name, bytes, formula) = match input.on_cpu {
            true => ("process (binary, tokenizer, data, allocator)", CPU_PROCESS_BYTES, "measured"),
            false => ("CUDA context, modules and cuBLAS workspaces", CUDA_CONTEXT_BYTES, "outside the pool"),
        };
        c.add(name, bytes, Device, Resident, formula);
    }

    /// The optimizer's f32 master copy and moments, on the device or (offload) the host, sharded over the ranks.
    fn optimizer_state(&self, c: &mut Components) {
        let (input, pn) = (self.input, self.pn());
        let (state, what) = if input.adamw { (12, "f32 master + 2 moments") } else { (4, "f32 master") };
        let (place, off) = if input.offload { (Host, "host: optim.offload") } else { (Device, "device") };
        let (bytes, shard) = match self.world {
            1 => (self.p_train.saturating_mul(state), String::new()),
            n => (self.p_train.saturating_mul(state).div_ceil(n), format!(" / {n} ranks (ZeRO-1)")),
        };
        c.add("optimizer state", bytes, place, Resident, format!("{pn} x {state} B{shard} ({what}; {off})"));
    }

    /// What the forward keeps for the backward: the layers' activations (either setting of
    /// `checkpoint_layers`, the other shown), the kept attention outputs, the head's inputs, kept logits.
    fn saved(&self, c: &mut Components, act: &Activations) {
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
            let kept = to_bytes(self.shape.n_scored as f64 * self.model.vocab_size as f64 * self.d as f64);
            c.add("logits kept (model.keep_logits)", kept, Device, Backward, "n V d");
        }
    }

    /// The backward's larger part: the head's f32 lm_head gradient, or one layer's backward with the
    /// parameter gradients held before they are added to the accumulator (the other shown).
    fn backward_peak(&self, c: &mut Components, act: &Activations) {
        let grad_store = self.gradients_in_flight();
        let layer_part = act.layer_backward.saturating_add(act.attention_workspace).saturating_add(grad_store);
        let head_part = act.head_backward.saturating_add(act.logprob_chunk);
        let kind = attention_workspace_kind(self.input.attention, self.atomic_dq);
        let chunk = "log-prob chunk (logprob_chunk_mb)";
        if head_part >= layer_part {
            let formula = "12 V h B (1 chunk: 4+d)";
            c.add("log-prob head backward (f32 lm_head grad)", act.head_backward, Device, Backward, formula);
            c.add(chunk, act.logprob_chunk, Device, Backward, "2 rows V d");
            c.add("attention workspace", act.attention_workspace, Device, Alternative, kind);
        } else {
            c.add("layer backward workspace", act.layer_backward, Device, Backward, "(3i+3h+2q) N d");
            c.add("attention workspace", act.attention_workspace, Device, Backward, kind);
            let ckpt = self.input.decoder.checkpoint_layers;
            let what = if ckpt { "largest layer or tensor x d" } else { "P x d: all, until collected" };
            c.add("parameter gradients in flight", grad_store, Device, Backward, what);
            c.add(chunk, act.logprob_chunk, Device, Alternative, "2 rows V d");
        }
    }

    /// The parameter gradients a layer's backward holds before they are added to the accumulator. With f32
    /// weights and the whole step in one micro-batch, they become the accumulator: counted once.
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
        let (input, p_train, world) = (self.input, self.p_train, self.world);
        let name = "optimizer update temporaries";
        if input.offload {
            let bytes = staging_bytes(chunk_len(p_train as usize, input.offload_chunk_mb)) as u64;
            c.add(name, bytes, Host, Update, "staging: 2 slots of f32 gradients and weights");
        } else {
            c.add(name, self.p_max.saturating_mul(self.d), Device, Update, "the largest tensor's new weights x d");
        }
        if world > 1 {
            // The collectives' host buffers (src/train/zero.rs): the flat f32 gradients and this rank's block.
            let staging = p_train.saturating_mul(4).saturating_add(p_train.saturating_mul(4) / world);
            let place = if input.on_cpu { Device } else { Host };
            c.add("collective staging (f32 gradients / weights)", staging, place, Update, "P x 4 B (1 + 1/N)");
        }
        if world > 1 && !input.on_cpu {
            // NCCL's device buffers: a piece of dist::COLLECTIVE_CHUNK_VALUES f32 values and one rank's share.
            let values = (crate::dist::COLLECTIVE_CHUNK_VALUES as u64).min(p_train);
            let bytes = 4 * (values + values / world);
            c.add("collective buffers (NCCL, per piece)", bytes, Device, Update, "<= 256 MiB + a rank's share");
        }
    }

    /// The KV caches of generation: validation's, and with `[rollout]` grpo's sampler's (a server's use the
    /// server's memory) and a lagged sampling policy's copy of the weights.
    fn generation(&self, c: &mut Components) {
        let (input, d, prompt) = (self.input, self.d, self.prompt);
        let cache = |g: &GenerationLoad| {
            kv_cache(&input.model, d, g.batch_size, prompt.saturating_add(g.max_new_tokens as u64), &g.generation)
        };
        if let Some(v) = &input.validation {
            let (bytes, f) = cache(v);
            c.add("validation KV cache", bytes, Device, Validation, f);
        }
        let Some(r) = &input.rollout else { return };
        if r.sync_every > 1 {
            let f = format!("P x {d} B (the policy of the last refresh, rollout.sync_every = {})", r.sync_every);
            c.add("rollout sampling policy copy", self.p.saturating_mul(d), Device, Resident, f);
        }
        if r.native {
            let (bytes, f) = cache(&r.sampling);
            c.add("rollout KV cache", bytes, Device, Rollout, f);
        }
    }
}

/// A generation's KV cache for `batch` sequences of `tokens` tokens, 2 L kv d bytes per token: the paged
/// pool of `generation.pool_blocks` blocks, or with static batches a contiguous cache counted twice (it
/// grows by doubling); plus two rows of f32 logits per sequence.
fn kv_cache(model: &ModelConfig, d: u64, batch: usize, tokens: u64, g: &GenerationOptions) -> (u64, String) {
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
}

/// The run's attention backward runs on the tensor-core kernels (their dk/dv partial sums, and with
/// atomics their dq accumulator): the GPU kinds but the matrix and flash ones.
fn tensor_core_backward(input: &PlanInput) -> bool {
    matches!(input.attention, Attention::Mma | Attention::Wgmma | Attention::Auto) && !input.on_cpu
}

/// The attention workspace's formula.
fn attention_workspace_kind(attention: Attention, atomic_dq: bool) -> String {
    let kind = match attention {
        Attention::Flash => return "flash: O(T)".into(),
        Attention::Matrix => return "matrix: 2 B heads T^2 d".into(),
        Attention::Mma => "mma",
        Attention::Wgmma => "wgmma",
        Attention::Auto => "auto (tensor cores)",
    };
    let dq = if atomic_dq { " + [N,q] 4 B dq accumulator" } else { " (split x 2 [N,kv] 4 B)" };
    format!("{kind}: O(T) + dk/dv parts{dq}")
}

/// The largest micro-batch: `train.micro_batch_size` rows of the longest prompt + answer, or with
/// `train.micro_batch_tokens` one packed row of the budget (or of the longest answer, which runs alone when
/// longer), every token of which may be scored.
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

/// Answers of `seq` tokens (the longest) in one micro-batch: `train.micro_batch_size`, or as many as the
/// token budget holds (at least one).
fn answers_per_micro_batch(input: &PlanInput, seq: u64) -> u64 {
    match input.micro_batch_tokens as u64 {
        0 => input.micro_batch_size.max(1) as u64,
        budget => (budget / seq.max(1)).max(1),
    }
}

/// The tokens of the longest prompt and answer: `data.max_prompt_tokens` and `data.max_response_tokens`
/// (0: the model's context), or with `[rollout]` `rollout.max_new_tokens` + 1 (the EOS), at least the
/// data's limit when teacher answers are mixed in.
pub(super) fn sequence_tokens(input: &PlanInput) -> (u64, u64) {
    let max_pos = input.model.max_position_embeddings;
    let or_max = |x: usize| if x == 0 { max_pos } else { x } as u64;
    let teacher = or_max(input.max_response_tokens);
    let sampled = |r: &RolloutLoad| (r.sampling.max_new_tokens as u64).saturating_add(1);
    let response = match &input.rollout {
        None => teacher,
        Some(r) if r.teacher_answers > 0 => sampled(r).max(teacher),
        Some(r) => sampled(r),
    };
    (or_max(input.max_prompt_tokens), response)
}

impl Plan {
    /// The bytes of one phase in one place (on the CPU the host is the device: host components count there).
    fn sum(&self, phase: Phase, place: Place) -> u64 {
        let counts = |c: &&Component| c.place == place || (self.input.on_cpu && place == Device);
        let parts = self.components.iter().filter(|c| c.phase == phase).filter(counts);
        parts.map(|c| c.bytes).fold(0, u64::saturating_add)
    }

    /// The expected peak in `place`: resident + the largest of a training step, validation and rollouts
    /// (the pool is trimmed between them), on a GPU the pool with its overheads beside the context.
    pub fn peak(&self, place: Place) -> u64 {
        let tensors = self.tensor_peak(place);
        match self.gpu_device(place) {
            true => POOL_OVERHEAD.pooled(tensors).saturating_add(CUDA_CONTEXT_BYTES),
            false => tensors,
        }
    }

    /// The resident tensors in `place` (the context not counted on a GPU).
    fn resident_tensors(&self, place: Place) -> u64 {
        let resident = self.sum(Resident, place);
        match self.gpu_device(place) {
            true => resident.saturating_sub(CUDA_CONTEXT_BYTES),
            false => resident,
        }
    }

    /// The peak of the plan's own components in `place` (the context not counted on a GPU).
    fn tensor_peak(&self, place: Place) -> u64 {
        let generation = self.sum(Validation, place).max(self.sum(Rollout, place));
        self.resident_tensors(place).saturating_add(self.step_peak(place).max(generation))
    }

    /// Whether `place` is a GPU's device memory (where the pool's overheads apply).
    pub(super) fn gpu_device(&self, place: Place) -> bool {
        place == Device && !self.input.on_cpu
    }

    /// A training step's part of the peak: the gradients and the larger of the backward and the update.
    fn step_peak(&self, place: Place) -> u64 {
        self.sum(Step, place).saturating_add(self.sum(Backward, place).max(self.sum(Update, place)))
    }

    /// Whether the device's peak fits its memory (`None`: unknown), on a GPU with [`GPU_HEADROOM`] to spare.
    pub fn fits(&self) -> Option<bool> {
        self.input.device_memory.map(|m| self.peak(Device) <= self.usable(m))
    }

    /// The part of `memory` bytes of device memory a plan may fill.
    fn usable(&self, memory: u64) -> u64 {
        match self.gpu_device(Device) {
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

/// With `model.keep_logits = "auto"`, the share of what a plan may use ([`Plan::fits`]) that the plan with
/// the logits kept may fill for the run to keep them: they save 1-2% of a step, running out of memory
/// loses the run, so only with room to spare.
pub const AUTO_KEEP_LOGITS_SHARE: f64 = 0.9;

/// The plan of `input` with `model.keep_logits = "auto"` decided: the logits are kept on a GPU of known
/// memory when the plan with them fills at most [`AUTO_KEEP_LOGITS_SHARE`] of what it may use, else not.
pub fn run_plan(input: &PlanInput) -> Plan {
    if input.keep_logits.is_some() {
        return plan(input);
    }
    let with = |keep: bool| plan(&PlanInput { keep_logits: Some(keep), ..input.clone() });
    let kept = with(true);
    let (peak, usable) = match (kept.gpu_device(Device), input.device_memory) {
        (true, Some(m)) => (kept.peak(Device), kept.usable(m)),
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
    /// (whole groups) at the plan's micro-batch shape, the attention's blocking the op's own (GPU) choice.
    pub fn step_shape(&self) -> time::StepShape {
        let input = &self.input;
        let (model, world_size) = (&input.model, input.world_size);
        let (prompt, response) = sequence_tokens(input);
        let questions = (input.batch_questions as u64).div_ceil(world_size.max(1));
        let seq_tokens = prompt.saturating_add(response).max(1);
        let d = &input.decoder;
        time::StepShape {
            answers: questions.saturating_mul(input.group_size as u64).max(1),
            // A packed row holds budget / T answers of the longest: the work of that many padded.
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
