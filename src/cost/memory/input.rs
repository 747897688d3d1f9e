//! The memory plan's input: what the trainer tells the plan of its run.

use crate::device::DTypeName;
use crate::generate::GenerationOptions;
use crate::model::{Attention, DecoderOptions, LoraOptions, ModelConfig};

/// What a plan is computed from: the model's shape and the settings of the run that move its memory, as
/// `TrainConfig::plan_input` resolves them. Each field names its config key; the advice
/// ([`Plan::advice`](super::Plan::advice)) plans changed copies of it.
#[derive(Debug, Clone)]
pub struct PlanInput {
    /// The model's shape (its config.json).
    pub model: ModelConfig,
    /// `model.dtype`: the weights' dtype.
    pub dtype: DTypeName,
    /// `model.*`: how the decoder computes (its `keep_logits` is not read: [`PlanInput::keep_logits`] is).
    pub decoder: DecoderOptions,
    /// `model.attention`, or the composite score matrix without `model.fused_ops`.
    pub attention: Attention,
    /// `model.keep_logits`: `None` for "auto", which [`super::run_plan`] decides.
    pub keep_logits: Option<bool>,
    /// `model.lora`: the adapters trained instead of the weights.
    pub lora: Option<LoraOptions>,
    /// `model.reference` is given: the reference is a model of its own, even with LoRA.
    pub own_reference: bool,
    /// The objective reads the frozen reference's log-probs (its KL term or anchor).
    pub needs_reference: bool,
    /// `objective.anchor = "snapshot"`.
    pub snapshot_anchor: bool,
    /// `model.cache_reference`, and whether the run can cache the reference's log-probs (no
    /// `train.reference_swap_every`, no `[rollout]`).
    pub cache_reference: bool,
    pub reference_cacheable: bool,
    /// `optim.name = "adamw"` (else SGD), `optim.offload` and `optim.offload_chunk_mb`.
    pub adamw: bool,
    pub offload: bool,
    pub offload_chunk_mb: usize,
    /// `data.group_size` (or `rollout.n`) and `train.batch_questions`.
    pub group_size: usize,
    pub batch_questions: usize,
    /// `train.micro_batch_size` and `train.micro_batch_tokens` (0: not packed).
    pub micro_batch_size: usize,
    pub micro_batch_tokens: usize,
    /// `data.max_prompt_tokens` and `data.max_response_tokens` (0: the model's context).
    pub max_prompt_tokens: usize,
    pub max_response_tokens: usize,
    pub validation: Option<GenerationLoad>,
    pub rollout: Option<RolloutLoad>,
    /// `model.device` is the CPU: the device is host memory and the process counts in it.
    pub on_cpu: bool,
    /// Bytes of device memory (`None`: unknown).
    pub device_memory: Option<u64>,
    /// Data-parallel ranks sharing the optimiser state (ZeRO-1).
    pub world_size: u64,
}

/// A generation of the run (`[validation]`, `[rollout]`): `batch_size` sequences of at most
/// `max_new_tokens` new tokens each.
#[derive(Debug, Clone)]
pub struct GenerationLoad {
    pub batch_size: usize,
    pub max_new_tokens: usize,
    pub generation: GenerationOptions,
}

/// `[rollout]`: its generation, and what else it adds to the run's memory.
#[derive(Debug, Clone)]
pub struct RolloutLoad {
    pub sampling: GenerationLoad,
    /// `rollout.teacher_answers`: teacher answers mixed into each group.
    pub teacher_answers: usize,
    /// `rollout.sync_every`: > 1 keeps a lagged copy of the weights.
    pub sync_every: usize,
    /// `rollout.engine = "native"`: the answers are sampled here, not by a server.
    pub native: bool,
}

impl PlanInput {
    /// The reference's log-probs are read from a file instead of computed by a loaded reference.
    pub fn reference_cached(&self) -> bool {
        self.cache_reference && self.reference_cacheable
    }
}
