//! Loading a run: the policy (from its checkpoint when resuming), the reference, the tokenizer, the
//! training step and the rollouts, and the checks of the weights' files before any is read.

use super::*;

/// Load the policy (from the checkpoint when resuming), the reference when the objective needs one (its
/// KL term, or the reference as its anchor) unless its log-probs are in `ref_cache`, the tokenizer and the
/// training step. The policy (and the reference) compute with `decoder`, the options resolved from
/// `memory_plan` ([`plan::decoder_options`]).
pub(super) fn load_run<'a>(
    cfg: &'a TrainConfig,
    model_dir: PathBuf,
    resume_from: Option<&Path>,
    ref_cache: Option<refcache::ReferenceCache>,
    memory_plan: crate::cost::memory::Plan,
    decoder: model::DecoderOptions,
) -> Result<Run<'a>, TrainError> {
    let device = model::open_device(cfg.model.device)?;
    let dtype = cfg.model.dtype.dtype();
    let save_dtype = cfg.train.save_dtype.map(DTypeName::dtype);
    let mut policy = load_policy(cfg, &model_dir, resume_from, (dtype, &device))?;
    policy.options = decoder;
    log_attention_fallback(&policy, dtype, &device);
    log_lora(&policy);
    let tok = ChatTokenizer::load(&model_dir).map_err(ModelError::from)?;
    let mut step = TrainStep::new(
        &cfg.objective,
        &cfg.optim,
        &policy,
        cfg.train.micro_batch_size,
        cfg.data.sequence.max_response_tokens,
        tok.pad_id(),
    )?;
    step.set_batching(pack::Batching::of(cfg.train.micro_batch_size, cfg.train.micro_batch_tokens));
    let reference = match step.needs_reference() && ref_cache.is_none() {
        true => Some(load_reference(cfg, &policy, &model_dir, resume_from, (dtype, &device))?),
        false => None,
    };
    let checkpoints = Checkpointer {
        output_dir: cfg.train.output_dir.clone(),
        model_dir,
        save_dtype,
        keep_last: cfg.train.keep_last,
        config_toml: cfg.to_toml(),
    };
    let rollouts = cfg.rollout.as_ref().map(|r| new_rollouts(cfg, r, &checkpoints)).transpose()?;
    let world = Rc::new(World::single());
    Ok(Run {
        cfg,
        policy,
        reference,
        ref_cache,
        reference_swapped: false,
        rollouts,
        step,
        tok,
        checkpoints,
        world,
        memory_plan: Some(memory_plan),
    })
}

/// A log line where `model.attention` names tensor-core kernels this run cannot use (the chunked path runs).
pub(super) fn log_attention_fallback(policy: &Decoder, dtype: candle_core::DType, device: &candle_core::Device) {
    let o = &policy.options;
    if matches!(o.attention, model::Attention::Mma | model::Attention::Wgmma)
        && !(device.is_cuda() && o.tensor_core_attention(dtype, policy.config().head_dim))
    {
        tracing::info!(
            "model.attention = {:?}: the tensor-core kernels take bf16/f16 at head dim 64 or 128 on a GPU; \
             this run ({:?}, head dim {}, {}) uses flash attention's chunked path",
            o.attention,
            dtype,
            policy.config().head_dim,
            if device.is_cuda() { "GPU" } else { "CPU" }
        );
    }
}

/// The frozen reference, with the policy's options: `model.reference`, or the policy's base model (LoRA,
/// its weights shared), or the model of `model_dir` (resumed: the policy has moved), or a copy of the policy.
pub(super) fn load_reference(
    cfg: &TrainConfig,
    policy: &Decoder,
    model_dir: &Path,
    resume_from: Option<&Path>,
    (dtype, device): (candle_core::DType, &candle_core::Device),
) -> Result<Decoder, TrainError> {
    let mut r = match &cfg.model.reference {
        Some(p) => model::load_decoder(&model::resolve_model_dir(p)?, dtype, device, false)?,
        // LoRA: the base model, its weights shared with the policy (no copy).
        None if policy.lora().is_some() => policy.without_adapters(),
        None if resume_from.is_some() => model::load_decoder(model_dir, dtype, device, false)?,
        None => policy.frozen_copy()?,
    };
    r.options = policy.options.clone();
    Ok(r)
}

/// `[rollout]`'s sampler, serving the policy's weights from OUTPUT/rollout-policy to a server.
pub(super) fn new_rollouts(
    cfg: &TrainConfig,
    r: &crate::rollout::RolloutOptions,
    checkpoints: &Checkpointer,
) -> Result<Rollouts, TrainError> {
    let tok = ChatTokenizer::load(&checkpoints.model_dir).map_err(ModelError::from)?;
    let mut rollouts = Rollouts::new(r.clone(), tok, cfg.train.seed, cfg.train.micro_batch_size);
    let save = model::checkpoint::SaveOptions {
        dtype: checkpoints.save_dtype,
        tokenizer_dir: Some(checkpoints.model_dir.clone()),
        ..Default::default()
    };
    rollouts.serve_weights_from(cfg.train.output_dir.join("rollout-policy"), save);
    Ok(rollouts)
}

/// The policy: the model of `model_dir` (or of the checkpoint `resume_from`), trainable; with `[model.lora]`,
/// the base model of `model_dir`, frozen, with the checkpoint's adapters or fresh ones (from `train.seed`).
pub(super) fn load_policy(
    cfg: &TrainConfig,
    model_dir: &Path,
    resume_from: Option<&Path>,
    (dtype, device): (candle_core::DType, &candle_core::Device),
) -> Result<Decoder, TrainError> {
    if let Some(ck) = resume_from {
        checkpoint_holds(ck, cfg.model.lora.is_some())?;
    }
    let Some(lora) = &cfg.model.lora else {
        return Ok(model::load_decoder(resume_from.unwrap_or(model_dir), dtype, device, true)?);
    };
    if let Some(ck) = resume_from {
        return Ok(model::load::load_with_adapter(model_dir, ck, Some(lora), (dtype, device), true)?);
    }
    let base = model::load_decoder(model_dir, dtype, device, false)?;
    let adapters = model::lora::init_adapters(base.config(), lora, cfg.train.seed, device)?;
    Ok(base.with_adapters(lora, adapters, true)?)
}

/// Check that checkpoint `ck` holds what the run trains: LoRA adapters when `lora`, whole weights otherwise.
pub(super) fn checkpoint_holds(ck: &Path, lora: bool) -> Result<(), TrainError> {
    let adapters = model::lora::is_adapter_dir(ck);
    let message = match (lora, adapters) {
        (false, true) => {
            "it holds LoRA adapters (adapter_model.safetensors), written by a run with [model.lora]; \
                          resume it with that [model.lora] section, or start a new run (--overwrite)"
        }
        (true, false) => {
            "it holds whole weights, written by a run without [model.lora]; resume it without \
                          [model.lora], or start a new run (--overwrite)"
        }
        _ => return Ok(()),
    };
    Err(TrainError::Incompatible { ck: ck.to_path_buf(), message: message.into() })
}

/// The log line of a LoRA policy: its adapters and how much of the model they train.
pub(super) fn log_lora(policy: &Decoder) {
    let Some(lora) = policy.lora() else { return };
    let count = |ts: Vec<(String, candle_core::Tensor)>| ts.iter().map(|(_, t)| t.elem_count()).sum::<usize>();
    let (trained, base) = (count(policy.adapter_tensors()), count(policy.named_tensors()));
    tracing::info!(
        "LoRA: rank {}, alpha {}, on {} of each layer: {trained} trainable parameters, {:.3}% of the base's {base}",
        lora.r,
        lora.alpha,
        lora.target_modules.join(", "),
        100.0 * trained as f64 / base.max(1) as f64
    );
}

/// Check the names and shapes of the model's weights (and of `model.reference`'s) against their
/// config.json from the files' headers, before the data is prepared or any weight is read: a config that
/// does not match its weights fails here, naming the folder and file ([`model::load::check_weights`]).
pub(super) fn check_weights(cfg: &TrainConfig, model_dir: &Path) -> Result<(), TrainError> {
    let reference = cfg.model.reference.as_deref().map(model::resolve_model_dir).transpose()?;
    for dir in std::iter::once(model_dir).chain(reference.as_deref()) {
        let shape = model::ModelConfig::from_file(&dir.join("config.json")).map_err(ModelError::from)?;
        model::load::check_weights(dir, &shape)?;
    }
    Ok(())
}
