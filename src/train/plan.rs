//! The run's side of the memory plan: the plan's input from the training config, the model's shape
//! read without loading a weight, and the check before any weight loads. The plan itself is
//! [`crate::cost::memory`]'s.

use std::path::Path;

use super::config::TrainConfig;
use super::optim::OptimName;
use super::TrainError;
use crate::cost::memory::{self, GenerationLoad, Place, Plan, PlanInput, RolloutLoad};
use crate::model::{self, Attention, ChatTokenizer, ModelConfig, ModelError};
use crate::objective::Anchor;

impl TrainConfig {
    /// The memory plan's input for a run of this config on a model of shape `model`, with `device_memory`
    /// bytes on its device, per rank of `world_size` data-parallel ranks (1: one process).
    pub fn plan_input(&self, model: &ModelConfig, device_memory: Option<u64>, world_size: u64) -> PlanInput {
        let m = &self.model;
        let objective = self.objective.build();
        let seq = &self.data.sequence;
        PlanInput {
            model: model.clone(),
            dtype: m.dtype,
            decoder: m.decoder_options(),
            // Without the fused ops, attention goes through the composite score matrix.
            attention: if m.fused_ops { m.attention } else { Attention::Matrix },
            keep_logits: m.keep_logits,
            lora: m.lora.clone(),
            own_reference: m.reference.is_some(),
            needs_reference: objective.needs_reference(),
            snapshot_anchor: objective.anchor() == Some(Anchor::Snapshot),
            cache_reference: m.cache_reference,
            reference_cacheable: super::refcache::run_can_cache_reference(self),
            adamw: self.optim.name == OptimName::Adamw,
            offload: self.optim.offload,
            offload_chunk_mb: self.optim.offload_chunk_mb,
            group_size: self.rollout.as_ref().map_or(self.data.input.group.group_size, |r| r.n),
            batch_questions: self.train.batch_questions,
            micro_batch_size: self.train.micro_batch_size,
            micro_batch_tokens: self.train.micro_batch_tokens,
            max_prompt_tokens: seq.max_prompt_tokens,
            max_response_tokens: seq.max_response_tokens,
            validation: self.validation.as_ref().map(|v| GenerationLoad {
                batch_size: v.batch_size,
                max_new_tokens: v.max_new_tokens,
                generation: v.generation.clone(),
            }),
            rollout: self.rollout.as_ref().map(|r| RolloutLoad {
                sampling: GenerationLoad {
                    batch_size: r.batch_size,
                    max_new_tokens: r.max_new_tokens,
                    generation: r.generation.clone(),
                },
                teacher_answers: r.teacher_answers,
                sync_every: r.sync_every,
                native: r.server.engine == crate::eval::EngineKind::Native,
            }),
            on_cpu: !m.device.is_cuda(),
            device_memory,
            world_size,
        }
    }

    /// The memory plan of this run ([`memory::run_plan`]: "auto" settings decided).
    pub fn memory_plan(&self, model: &ModelConfig, device_memory: Option<u64>, world_size: u64) -> Plan {
        memory::run_plan(&self.plan_input(model, device_memory, world_size))
    }
}

/// The model shape of a run without loading any weight: `model.path`'s config.json, or, for a tiny model
/// not made yet, the config `model.init_tiny` will write.
pub fn model_config(cfg: &TrainConfig) -> Result<ModelConfig, ModelError> {
    let local = Path::new(&cfg.model.path);
    if let (Some(spec), false) = (&cfg.model.init_tiny, local.join("config.json").exists()) {
        return spec.config(&ChatTokenizer::load(&spec.tokenizer)?);
    }
    // A hub id not in the cache: its config.json alone, not the weights.
    let source = cfg.model.source()?;
    if let Some(repo) =
        crate::hub::model_ref(&source).filter(|_| !local.exists() && !model::load::looks_local(&cfg.model.path))
    {
        let snapshot = crate::hub::repo_files(&crate::hub::Settings::from_env(), &repo, &["config.json"])?;
        return Ok(ModelConfig::from_file(&snapshot.dir.join("config.json"))?);
    }
    let dir = model::resolve_model_dir(&source)?;
    Ok(ModelConfig::from_file(&dir.join("config.json"))?)
}

/// Refuse a run whose memory plan exceeds its device's memory, before any weight is loaded; the plan
/// when it fits. The run builds its models with the "auto" settings it decided ([`decoder_options`]).
pub(super) fn check_plan(
    cfg: &TrainConfig,
    model_dir: &Path,
    device_memory: Option<u64>,
    ranks: u64,
) -> Result<Plan, TrainError> {
    let shape = ModelConfig::from_file(&model_dir.join("config.json")).map_err(ModelError::from)?;
    let memory = match device_memory {
        Some(m) => Some(m),
        None => crate::device::total_memory(&model::open_device(cfg.model.device)?)?,
    };
    // Each of the `ranks` processes keeps 1/ranks of the optimiser state (ZeRO-1).
    let plan = cfg.memory_plan(&shape, memory, ranks);
    if plan.fits() == Some(false) {
        return Err(TrainError::DoesNotFit { plan: plan.to_string(), advice: plan.advice() });
    }
    let logits = plan.keep_logits_note.as_ref().map_or(String::new(), |n| format!("; {n}"));
    tracing::info!("memory plan: peak {:.2} GiB{logits}", plan.peak(Place::Device) as f64 / (1u64 << 30) as f64);
    Ok(plan)
}

/// The decoder options of the run's policy, its reference and its reference cache: `model.*` with every
/// "auto" decided once, before any model is built, and logged: `keep_logits` and the log-prob chunk
/// (`logprob_chunk_mb = 0`: sized from the device's memory) as the plan counted them, `attention` by the
/// kernels' start-up check on the run's device ([`model::DecoderOptions::resolve_attention`]).
pub(super) fn decoder_options(cfg: &TrainConfig, plan: &Plan) -> Result<model::DecoderOptions, TrainError> {
    let mut options = planned_options(cfg, plan);
    let device = model::open_device(cfg.model.device)?;
    let attention = options.resolve_attention(&device, cfg.model.dtype.dtype(), plan.input.model.head_dim)?;
    tracing::info!("{}", decided(cfg, &options, attention));
    Ok(options)
}

/// `model.*`'s decoder options with what `plan` decided: `keep_logits` and the log-prob chunk.
fn planned_options(cfg: &TrainConfig, plan: &Plan) -> model::DecoderOptions {
    model::DecoderOptions {
        keep_logits: plan.keep_logits,
        logprob_chunk_bytes: plan.logprob_chunk_bytes as usize,
        ..cfg.model.decoder_options()
    }
}

/// The log line of the decoder options [`decoder_options`] decided.
fn decided(cfg: &TrainConfig, options: &model::DecoderOptions, attention: Option<Attention>) -> String {
    let m = &cfg.model;
    let auto = |is_auto: bool| if is_auto { " (auto)" } else { "" };
    format!(
        "decoder: attention {}{}, log-prob chunk {} MiB{}, keep_logits {}{}",
        format!("{:?}", options.attention).to_lowercase(),
        auto(attention.is_some()),
        options.logprob_chunk_bytes >> 20,
        auto(m.logprob_chunk_mb == 0),
        options.keep_logits,
        auto(m.keep_logits.is_none()),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::DeviceName;

    fn config(device: &str) -> TrainConfig {
        let text = format!(
            "[model]\npath = \"m\"\ndtype = \"bf16\"\ndevice = \"{device}\"\n[data]\ninputs = [\"x.jsonl\"]\n\
             max_prompt_tokens = 512\nmax_response_tokens = 4096\n[train]\nmicro_batch_size = 2\n"
        );
        TrainConfig::parse(&text, Path::new("c.toml"), &[]).unwrap()
    }

    fn shape() -> ModelConfig {
        let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/models/qwen2.5-7b-instruct.config.json");
        ModelConfig::from_file(&p).unwrap()
    }

    /// A GPU run's device-sized log-prob chunk and its "auto" keep_logits are the plan's, so the run
    /// computes with what the plan counted; on the CPU the chunk is what the log-prob op sizes there.
    #[test]
    fn the_runs_decoder_options_are_the_plans_decisions() {
        let mut cfg = config("cuda");
        assert_eq!(cfg.model.device, DeviceName::Cuda(None));
        for memory in [80_000_000_000u64, 141_000_000_000] {
            let plan = cfg.memory_plan(&shape(), Some(memory), 1);
            let o = planned_options(&cfg, &plan);
            assert_eq!(o.logprob_chunk_bytes as u64, plan.logprob_chunk_bytes);
            assert!((1 << 30..=8 << 30).contains(&o.logprob_chunk_bytes), "{}", o.logprob_chunk_bytes);
            assert_eq!(o.keep_logits, plan.keep_logits);
        }
        cfg.model.logprob_chunk_mb = 256;
        assert_eq!(
            planned_options(&cfg, &cfg.memory_plan(&shape(), Some(80_000_000_000), 1)).logprob_chunk_bytes,
            256 << 20
        );
        let cpu = config("cpu");
        let o = planned_options(&cpu, &cpu.memory_plan(&shape(), None, 1));
        assert_eq!(o.logprob_chunk_bytes, crate::kernels::logprob_chunk_bytes(&candle_core::Device::Cpu).unwrap());
        assert!(!o.keep_logits);
    }

    #[test]
    fn the_decisions_are_logged_with_what_was_auto() {
        let cfg = config("cpu");
        let plan = cfg.memory_plan(&shape(), None, 1);
        let o = decoder_options(&cfg, &plan).unwrap();
        assert_eq!(o.attention, Attention::Flash);
        assert_eq!(
            decided(&cfg, &o, Some(Attention::Flash)),
            "decoder: attention flash (auto), log-prob chunk 64 MiB (auto), keep_logits false (auto)"
        );
    }
}
