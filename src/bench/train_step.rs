//! `grpo bench train-step`: one whole training step (policy forward and backward, reference forward,
//! AdamW) through the trainer's own code path, with the host's counts, an optional profile and the
//! performance model's prediction beside it; and `--predict-only`, the prediction alone.

use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};
use rand::SeedableRng;
use serde_json::{json, Value};

use super::harness::{
    dtype_name, is_gpu, load_shape, median, random_ids, random_model, shape_name, time_runs, BenchError, Result, Timing,
};
use crate::cost::calibration::Build;
use crate::cost::time::{driver_blocks, gpus, predict, tensor_ops_per_step, StepShape};
use crate::data::{Group, Response};
use crate::device::{device_name, host_reads, memory_bytes, reset_peak_memory};
use crate::model::{Attention, Decoder, DecoderOptions, LoraOptions, ModelConfig};
use crate::objective::{CommonOptions, KlEstimator, LossAgg, ObjectiveConfig, ObjectiveKind, PpoOptions};
use crate::profile::{Profile, Profiler};
use crate::train::optim::OptimConfig;
use crate::train::pack::Batching;
use crate::train::step::{StepStats, TrainStep};

/// One training step's settings (`grpo bench train-step`).
#[derive(Debug, Clone, clap::Args)]
pub struct TrainStepSpec {
    /// HF config.json of the model shape (e.g. scripts/gpu/shapes/qwen2.5-0.5b.json); weights are random.
    #[arg(long)]
    pub shape: PathBuf,
    /// Answers in the step (one question).
    #[arg(long, default_value_t = 8)]
    pub answers: usize,
    /// Tokens of each answer's sequence, prompt included.
    #[arg(long, default_value_t = 1024)]
    pub seq_len: usize,
    /// Prompt tokens at the start of each sequence (no loss on them); the remaining seq-len - prompt-len
    /// tokens are the answer's.
    #[arg(long, default_value_t = 128)]
    pub prompt_len: usize,
    /// Answers per forward/backward.
    #[arg(long, default_value_t = 1)]
    pub micro_batch: usize,
    /// Token budget of a packed micro-batch (`train.micro_batch_tokens`: budget / seq-len answers one after
    /// the other in one row); 0: --micro-batch answers per micro-batch, one per row.
    #[arg(long, default_value_t = 0)]
    pub micro_batch_tokens: usize,
    /// Recompute layer activations in the backward (less memory, one more forward).
    #[arg(long)]
    pub checkpoint_layers: bool,
    /// With --checkpoint-layers: keep each layer's attention output and log-sum-exp and skip the
    /// attention's forward in the recomputation (`model.recompute_attention = false`).
    #[arg(long)]
    pub keep_attention: bool,
    /// Memory budget of one chunk of logits in the log-prob op, MiB (0: from the device, at least 1 GiB
    /// on a GPU, 64 MiB on the CPU).
    #[arg(long, default_value_t = 0)]
    pub logprob_chunk_mb: usize,
    /// Keep the log-prob op's logits from the forward for its backward instead of recomputing them
    /// (`model.keep_logits = true`; the trainer's "auto" keeps them on a GPU whose memory plan leaves room
    /// to spare, as at the 0.5B-1.5B shapes on an 80 GB card).
    #[arg(long)]
    pub keep_logits: bool,
    /// The fused RMSNorm/rope/softmax kernels; --composite-ops uses candle's composite ops instead.
    #[arg(long = "composite-ops", action = clap::ArgAction::SetFalse)]
    pub fused_ops: bool,
    /// Keep the optimiser state in host memory and update there (`optim.offload`).
    #[arg(long)]
    pub offload: bool,
    /// With --predict-only: predict the step as a build an H100 run measured ran it, described by its file
    /// (benches/results/builds/*.toml: its tensor ops, attention kernels' rates and offloaded update), to
    /// compare with that run's records. Without it: this build.
    #[arg(long = "measured-build", value_name = "FILE", value_parser = measured_build, requires = "predict_only")]
    pub build: Option<Box<Build>>,
    /// No reference model in memory (beta 0): the memory of a run whose reference log-probs are cached.
    #[arg(long)]
    pub no_reference: bool,
    /// Train rank-R LoRA adapters of every projection (`[model.lora]`, alpha 2R) instead of every weight;
    /// the reference is the base model (the adapters off). 0: every weight.
    #[arg(long, default_value_t = 0)]
    pub lora_r: usize,
    /// How attention is computed with fused ops: auto (`model.attention`'s default: on a GPU the fastest
    /// tensor-core kernels that pass a start-up check, else flash), flash (block by block), mma (flash on
    /// the tensor cores, on a GPU), wgmma (on an H100/H200's warpgroup tensor cores; elsewhere mma) or
    /// matrix (score matrix).
    #[arg(long, value_enum, default_value_t = Attention::Auto)]
    pub attention: Attention,
    /// With --attention mma or wgmma on a GPU: sum dq by atomics in the dk/dv kernel
    /// (`model.deterministic_attention = false`).
    #[arg(long)]
    pub atomic_dq: bool,
    /// Print the performance model's prediction of this step on each modelled GPU (its calibration's card
    /// and date) without running it: a GPU's step predicted on any machine.
    #[arg(long)]
    pub predict_only: bool,
    /// Profile the last timed step phase by phase (src/profile/): a table on stderr and its phases in the
    /// record's `profile`; `step_time_s` is then the median of the other timed steps (the profiler syncs
    /// at every phase boundary), or the profiled one's where it is the only one (`step_time_profiled`).
    #[arg(long)]
    pub profile: bool,
}

impl TrainStepSpec {
    fn batching(&self) -> Batching {
        Batching::of(self.micro_batch, self.micro_batch_tokens)
    }

    /// The step's micro-batches and the answers in the first (the largest).
    fn micro_batches(&self) -> (usize, usize) {
        let batches = self.batching().micro_batches(&vec![self.seq_len; self.answers]);
        (batches.len(), batches.first().map_or(0, |mb| mb.iter().map(Vec::len).sum()))
    }

    /// The prompt must leave room for an answer.
    fn check_lengths(&self) -> Result<()> {
        if self.prompt_len == 0 || self.prompt_len >= self.seq_len {
            return Err(BenchError::Invalid(format!(
                "prompt length {} must be in 1..{} (the sequence length)",
                self.prompt_len, self.seq_len
            )));
        }
        Ok(())
    }
}

/// A measured build's file (`--measured-build`).
fn measured_build(path: &str) -> std::result::Result<Box<Build>, String> {
    Build::from_file(std::path::Path::new(path)).map(Box::new).map_err(|e| e.to_string())
}

/// The tensors candle has made in this process so far: the id of a new scalar (`TensorId` shows its
/// number only through `Debug`).
fn tensors_made() -> Result<u64> {
    let id = format!("{:?}", Tensor::zeros((), DType::F32, &Device::Cpu)?.id());
    let digits: String = id.chars().filter(char::is_ascii_digit).collect();
    digits.parse().map_err(|_| BenchError::Invalid(format!("candle's tensor id `{id}` has no number")))
}

/// One off_grpo training step as `grpo train` runs it: `answers` sequences of one random question,
/// rewards alternating 1, 0, eps 0.2, beta 0.1 with k3 to a frozen reference (beta 0 and no reference
/// with `no_reference`), seq-mean-token-mean, AdamW at lr 1e-6 (state in host memory with `offload`).
pub fn train_step(spec: &TrainStepSpec, t: &Timing) -> Result<Value> {
    spec.check_lengths()?;
    let cfg = load_shape(&spec.shape)?;
    let vocab = cfg.vocab_size;
    let (policy, reference) = bench_models(spec, cfg, t)?;
    let (times, stats, (syncs, tensor_ops), profile) = run_steps(spec, t, (&policy, reference.as_ref()), vocab)?;
    let peak = memory_bytes(&t.device)?.map(|(_, high)| high);
    let (micro_batches, _) = spec.micro_batches();
    // A profiled last step is timed apart from the others, where there are others.
    let profiled = spec.profile.then(|| times.last().copied()).flatten();
    let unprofiled = if profiled.is_some() && times.len() > 1 { &times[..times.len() - 1] } else { &times[..] };
    let step_time = median(unprofiled);
    let tokens = spec.answers * spec.seq_len;
    Ok(json!({
        "bench": "train_step",
        "impl": "grpo",
        "shape": shape_name(&spec.shape),
        "answers": spec.answers,
        "seq_len": spec.seq_len,
        "prompt_len": spec.prompt_len,
        "dtype": dtype_name(t.dtype),
        "device": device_name(&t.device),
        "micro_batch": spec.micro_batch,
        "micro_batch_tokens": spec.micro_batch_tokens,
        "checkpoint_layers": spec.checkpoint_layers,
        "keep_attention": spec.keep_attention,
        "atomic_dq": spec.atomic_dq,
        "logprob_chunk_mb": spec.logprob_chunk_mb,
        "keep_logits": spec.keep_logits,
        "fused_ops": spec.fused_ops,
        "offload": spec.offload,
        "update": "fused", // the optimiser's update as this build runs it (kernels::adamw)
        "reference": !spec.no_reference,
        "lora_r": spec.lora_r,
        "attention": spec.attention,
        "step_times": times,
        "step_time_s": step_time,
        "profiled_step_s": profiled,
        "step_time_profiled": profiled.is_some() && times.len() == 1,
        "tokens": tokens,
        "response_tokens": stats.first().map_or(0, |s| s.response_tokens),
        "tokens_per_s": tokens as f64 / step_time,
        "peak_mem_bytes": peak,
        "losses": stats.iter().map(|s| s.loss).collect::<Vec<_>>(),
        "predicted": predicted_steps(policy.config(), spec, (&t.device, t.dtype), Some(step_time)),
        "micro_batches": micro_batches,
        "host_syncs_per_step": syncs,
        "host_syncs_per_micro_batch": syncs as f64 / micro_batches as f64,
        "tensor_ops_per_step": tensor_ops,
        "profile": profile.map(|p| p.report()),
    }))
}

/// The timed steps' times and statistics, the last one's host syncs and tensors made, and with
/// `spec.profile` the last one's profile.
type Steps = (Vec<f64>, Vec<StepStats>, (u64, u64), Option<Profile>);

fn run_steps(
    spec: &TrainStepSpec,
    t: &Timing,
    (policy, reference): (&Decoder, Option<&Decoder>),
    vocab: usize,
) -> Result<Steps> {
    let objective_cfg = ObjectiveConfig {
        kind: ObjectiveKind::OffGrpo(PpoOptions {
            eps: Some(0.2),
            beta: if spec.no_reference { 0.0 } else { 0.1 },
            kl_estimator: Some(KlEstimator::K3),
            ..PpoOptions::default()
        }),
        common: CommonOptions { loss_agg: Some(LossAgg::SeqMeanTokenMean), ..CommonOptions::default() },
    };
    let optim_cfg = OptimConfig { lr: 1e-6, offload: spec.offload, ..OptimConfig::default() };
    let mut step = TrainStep::new(&objective_cfg, &optim_cfg, policy, spec.micro_batch, spec.seq_len, 0)?;
    step.set_batching(spec.batching());
    let groups = [random_group(spec, vocab)];
    let (mut step_no, mut counts, mut profile) = (0, (0, 0), None);
    let (times, stats) = time_runs(t, || {
        if step_no == t.warmup {
            reset_peak_memory(&t.device)?;
        }
        step_no += 1;
        let (before, made) = (host_reads(), tensors_made()?);
        // Only the last step is profiled: the profiler's syncs would slow the steps the record times.
        let profiler = (spec.profile && step_no == t.warmup + t.repeats.max(1))
            .then(|| Profiler::start(&t.device))
            .transpose()
            .map_err(|e| BenchError::Invalid(e.to_string()))?;
        let stats = step.run(policy, reference, &groups, optim_cfg.lr)?.stats;
        if let Some(p) = profiler {
            profile = Some(p.finish());
        }
        // (less the probe's own tensor)
        counts = (host_reads() - before, tensors_made()? - made - 1);
        Ok(stats)
    })?;
    Ok((times, stats, counts, profile))
}

/// The bench's policy (random weights of the shape, with rank-`lora_r` adapters) with the spec's options,
/// and its reference (the base model under LoRA, a frozen copy otherwise; none with `no_reference`).
fn bench_models(spec: &TrainStepSpec, cfg: ModelConfig, t: &Timing) -> Result<(Decoder, Option<Decoder>)> {
    let mut policy = random_model(cfg, t, spec.lora_r == 0)?;
    if spec.lora_r > 0 {
        let opts = LoraOptions { r: spec.lora_r, alpha: 2.0 * spec.lora_r as f64, ..LoraOptions::default() };
        let adapters = crate::model::lora::init_adapters(policy.config(), &opts, 0, &t.device)?;
        policy = policy.with_adapters(&opts, adapters, true)?;
    }
    let options = &mut policy.options;
    options.checkpoint_layers = spec.checkpoint_layers;
    options.recompute_attention = !spec.keep_attention;
    options.logprob_chunk_bytes = spec.logprob_chunk_mb << 20;
    options.keep_logits = spec.keep_logits;
    options.fused_ops = spec.fused_ops;
    options.attention = spec.attention;
    options.deterministic_attention = !spec.atomic_dq;
    if spec.no_reference {
        return Ok((policy, None));
    }
    let mut reference = if spec.lora_r > 0 { policy.without_adapters() } else { policy.frozen_copy()? };
    reference.options = policy.options.clone();
    Ok((policy, Some(reference)))
}

/// One question's group of `spec.answers` random answers (every other one rewarded), each truncated at
/// `seq_len - prompt_len` tokens after a random prompt.
fn random_group(spec: &TrainStepSpec, vocab: usize) -> Group {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0);
    Group {
        index: 0,
        question_id: "random".into(),
        domain: None,
        source: None,
        prompt_tokens: random_ids(&mut rng, spec.prompt_len, vocab),
        responses: (0..spec.answers)
            .map(|i| Response {
                tokens: random_ids(&mut rng, spec.seq_len - spec.prompt_len, vocab),
                reward: if i % 2 == 0 { 1.0 } else { 0.0 },
                answer: None,
                truncated: true,
                teacher_logprobs: None,
                is_weights: None,
            })
            .collect(),
        majority: None,
        majority_count: 0,
        vote_margin: 0,
    }
}

/// The model's step shape of the bench's settings; `chunk` the log-prob op's logits chunk in bytes.
fn step_shape(cfg: &ModelConfig, spec: &TrainStepSpec, dtype: DType, chunk: u64) -> StepShape {
    StepShape {
        answers: spec.answers as u64,
        // A packed row of k answers is modelled as k padded ones (the attention skips the blocks between
        // answers).
        micro_batch: spec.micro_batches().1.max(1) as u64,
        seq_tokens: spec.seq_len as u64,
        scored_tokens: (spec.seq_len - spec.prompt_len) as u64,
        dtype_bytes: dtype.size_in_bytes() as u64,
        checkpoint_layers: spec.checkpoint_layers,
        recompute_attention: !spec.keep_attention,
        reference_forward: !spec.no_reference,
        offload: spec.offload,
        build: spec.build.as_deref().copied().unwrap_or_default(),
        logprob_chunk_bytes: chunk,
        optimizer_shards: 1,
        blocks: driver_blocks(cfg, spec.seq_len as u64),
        tensor_cores: DecoderOptions { fused_ops: spec.fused_ops, attention: spec.attention, ..Default::default() }
            .tensor_core_attention(dtype, cfg.head_dim),
        atomic_dq: spec.atomic_dq,
        warpgroup: matches!(spec.attention, Attention::Wgmma | Attention::Auto),
        lora_rank: spec.lora_r as u64,
        keep_logits: spec.keep_logits,
    }
}

/// The model's predicted step (src/cost/time.rs) on each modelled GPU; `measured` the step's time on
/// `device` (`None`: not run). A chunk left to the device is its size on `device`, or when the step is
/// only predicted a GPU's 1 GiB least.
fn predicted_steps(
    cfg: &ModelConfig,
    spec: &TrainStepSpec,
    (device, dtype): (&Device, DType),
    measured: Option<f64>,
) -> Vec<Value> {
    let chunk = match (spec.logprob_chunk_mb, measured) {
        (0, Some(_)) => crate::kernels::logprob_chunk_bytes(device).unwrap_or(crate::kernels::LOGPROB_CHUNK_BYTES),
        (0, None) => crate::kernels::gpu_chunk_bytes(0),
        (mb, _) => mb << 20,
    };
    let shape = step_shape(cfg, spec, dtype, chunk as u64);
    let device = device_name(device);
    let gpu_step = |gpu: &crate::cost::time::Gpu| {
        let p = predict(cfg, &shape, gpu);
        json!({
            "gpu": gpu.name,
            // The card and date the GPU's rates were measured on; null: its rates are assumptions.
            "calibrated_on": gpu.calibration.map(|c| format!("{}, {}", c.card, c.date)),
            "step_time_s": p.step_s,
            "tokens_per_s": p.tokens_per_s,
            "mfu": p.mfu,
            "attention_of_peak": p.attention_of_peak,
            "gemm_s": p.gemm_s,
            "attention_s": p.attention_s,
            "elementwise_s": p.elementwise_s,
            "host_s": p.host_s,
            "sync_s": p.sync_s,
            "launches": p.launches,
            "host_syncs": p.syncs,
            "tensor_ops": tensor_ops_per_step(cfg, &shape),
            "memory_efficiency": gpu.memory_efficiency,
            "kernel_launch_s": gpu.kernel_launch_s,
            "windows": p.windows,
            "ops": p.ops,
            "measured_over_predicted": measured.filter(|_| is_gpu(&device, gpu.name)).map(|m| m / p.step_s),
        })
    };
    gpus().iter().map(gpu_step).collect()
}

/// The model's prediction of `spec`'s step in `dtype` on each modelled GPU, without running it (so a
/// GPU's step is predicted on a CPU).
pub fn predict_train_step(spec: &TrainStepSpec, dtype: DType) -> Result<Value> {
    spec.check_lengths()?;
    let cfg = load_shape(&spec.shape)?;
    Ok(json!({
        "bench": "train_step_prediction",
        "shape": shape_name(&spec.shape),
        "answers": spec.answers,
        "seq_len": spec.seq_len,
        "prompt_len": spec.prompt_len,
        "dtype": dtype_name(dtype),
        "micro_batch": spec.micro_batch,
        "micro_batch_tokens": spec.micro_batch_tokens,
        "checkpoint_layers": spec.checkpoint_layers,
        "keep_attention": spec.keep_attention,
        "keep_logits": spec.keep_logits,
        "atomic_dq": spec.atomic_dq,
        "offload": spec.offload,
        "reference": !spec.no_reference,
        "attention": spec.attention,
        "predicted": predicted_steps(&cfg, spec, (&Device::Cpu, dtype), None),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::harness::fixtures::{cpu, parse, tiny_shape};

    /// `--shape` and the 4-answer, 12-token step the tests run, with `more` options.
    fn spec(shape: &std::path::Path, more: &[&str]) -> TrainStepSpec {
        let shape = shape.to_str().unwrap();
        let base = ["--shape", shape, "--answers", "4", "--seq-len", "12", "--prompt-len", "4", "--micro-batch", "2"];
        parse(&[&base[..], more].concat())
    }

    #[test]
    fn train_step_reports_every_field() {
        let dir = tempfile::tempdir().unwrap();
        let more = ["--checkpoint-layers", "--logprob-chunk-mb", "1", "--attention", "matrix"];
        let spec = spec(&tiny_shape(dir.path()), &more);
        let r = train_step(&spec, &cpu()).unwrap();
        assert_eq!(r["attention"], "matrix");
        assert_eq!(r["tokens"], 48);
        assert_eq!(r["response_tokens"], 32);
        assert_eq!(r["shape"], "tiny");
        assert_eq!(r["step_times"].as_array().unwrap().len(), 2);
        assert!(r["tokens_per_s"].as_f64().unwrap() > 0.0);
        assert!(r["losses"].as_array().unwrap().iter().all(|l| l.as_f64().unwrap().is_finite()));
        assert!(r["peak_mem_bytes"].is_null());
        // The model's prediction for each GPU, with no measured ratio on the CPU.
        let predicted = r["predicted"].as_array().unwrap();
        assert_eq!(predicted.len(), 2);
        assert!(predicted
            .iter()
            .all(|p| p["step_time_s"].as_f64().unwrap() > 0.0 && p["measured_over_predicted"].is_null()));
        let lean = train_step(&TrainStepSpec { offload: true, no_reference: true, ..spec.clone() }, &cpu()).unwrap();
        // LoRA: the adapters train (the base model is the reference) and the model predicts the LoRA step.
        let lora = train_step(&TrainStepSpec { lora_r: 2, ..spec.clone() }, &cpu()).unwrap();
        assert_eq!(lora["lora_r"], 2);
        assert!(lora["losses"][0].as_f64().unwrap().is_finite(), "{lora}");
        assert_eq!((&lean["offload"], &lean["reference"]), (&true.into(), &false.into()));
        let bad = TrainStepSpec { prompt_len: 12, ..spec };
        assert!(train_step(&bad, &cpu()).unwrap_err().to_string().contains("prompt length"));
    }

    /// A step reads the device once, whatever the number of layers (and so of tensors) and of
    /// micro-batches: its statistics with the gradient norm; packing two answers into each row adds none.
    /// The performance model counts the same.
    #[test]
    fn a_step_reads_the_device_once() {
        let dir = tempfile::tempdir().unwrap();
        let tiny = tiny_shape(dir.path());
        let syncs = |layers: usize, micro_batch_tokens: usize| {
            let mut raw: Value = serde_json::from_str(&std::fs::read_to_string(&tiny).unwrap()).unwrap();
            raw["num_hidden_layers"] = layers.into();
            let shape = dir.path().join(format!("layers-{layers}.json"));
            std::fs::write(&shape, raw.to_string()).unwrap();
            let tokens = micro_batch_tokens.to_string();
            let r =
                train_step(&spec(&shape, &["--micro-batch-tokens", &tokens, "--attention", "flash"]), &cpu()).unwrap();
            assert_eq!(r["micro_batches"], 2);
            for p in r["predicted"].as_array().unwrap() {
                assert_eq!(p["host_syncs"], 1.0, "{}", p["gpu"]);
            }
            r["host_syncs_per_step"].as_u64().unwrap()
        };
        assert_eq!((syncs(2, 0), syncs(6, 0), syncs(2, 24)), (1, 1, 1));
    }
}
