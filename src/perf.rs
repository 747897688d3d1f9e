//! Speed and memory measurements of the trainer's hot paths on random weights, one JSON record each,
//! with the same keys as scripts/gpu/torch_ref.py prints for PyTorch, so that scripts/gpu/report.py can
//! put both side by side:
//!
//! - [`train_step`]: one whole training step (policy forward and backward, reference forward, AdamW)
//!   through the trainer's own code path;
//! - [`logprob`]: the fused log-prob op alone (optionally with the off_grpo loss on top), and candle's
//!   naive whole-vocabulary log-softmax for comparison;
//! - [`generate`]: greedy generation with the KV cache, never stopping early;
//! - [`gemm`]: a layer's projection GEMMs (forward, input and weight gradients) at a model shape;
//! - [`attention`]: forward and backward of one layer's chunked attention against a plain f32 matmul;
//! - [`optimizer`]: the offloaded optimiser's host update, fused against the composite ops it replaced;
//! - [`sample`]: picking the next token (temperature, top-k, top-p) on the device against the full-sort
//!   reference on the host;
//! - [`pack`]: the padding of padded against packed micro-batches on a long-tailed length mix (no model).
//!
//! Times are medians of the timed repetitions after warm-up, with the device synchronised around each.

use std::path::PathBuf;
use std::time::Instant;

use candle_core::{DType, Device, Tensor, Var};
use rand::{Rng, SeedableRng};
use serde_json::Value;

use crate::cost::calibration::MeasuredBuild;
use crate::data::{Group, Response};
use crate::device::{device_name, host_reads, memory_bytes, reset_peak_memory};
use crate::kernels::{logprobs_entropy, logprobs_entropy_reference};
use crate::model::load::random_parameter;
use crate::model::LoraOptions;
use crate::model::{Attention, Decoder, DecoderOptions, ModelConfig};
use crate::objective::{KlEstimator, LossAgg, ObjectiveConfig, ObjectiveName, TokenInputs};
use crate::train::optim::OptimConfig;
use crate::train::step::TrainStep;

/// Errors of a measurement.
#[derive(Debug, thiserror::Error)]
pub enum PerfError {
    #[error("{0}")]
    Candle(#[from] candle_core::Error),
    #[error("{0}")]
    Model(#[from] crate::model::ModelError),
    #[error("model shape {path}: {source}")]
    Shape { path: PathBuf, source: crate::model::config::ConfigError },
    #[error("{0}")]
    Invalid(String),
}

type Result<T> = std::result::Result<T, PerfError>;

/// Where and how long to measure.
#[derive(Debug, Clone)]
pub struct Timing {
    pub device: Device,
    pub dtype: DType,
    pub warmup: usize,
    pub repeats: usize,
}

fn dtype_name(d: DType) -> &'static str {
    match d {
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        DType::F32 => "f32",
        _ => "other",
    }
}

fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => 0.5 * (v[n / 2 - 1] + v[n / 2]),
    }
}

/// Run `f` `warmup + repeats` times with the device synchronised around each; the timed durations.
fn time_runs<T>(t: &Timing, mut f: impl FnMut() -> Result<T>) -> Result<(Vec<f64>, Vec<T>)> {
    let (mut times, mut outs) = (Vec::new(), Vec::new());
    for i in 0..t.warmup + t.repeats.max(1) {
        t.device.synchronize()?;
        let t0 = Instant::now();
        let out = f()?;
        t.device.synchronize()?;
        let dt = t0.elapsed().as_secs_f64();
        let kind = if i < t.warmup { "warm-up" } else { "timed" };
        tracing::info!("run {}/{} ({kind}): {dt:.3} s", i + 1, t.warmup + t.repeats.max(1));
        if i >= t.warmup {
            times.push(dt);
            outs.push(out);
        }
    }
    Ok((times, outs))
}

fn shape_name(path: &std::path::Path) -> String {
    path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default()
}

fn load_shape(path: &std::path::Path) -> Result<ModelConfig> {
    ModelConfig::from_file(path).map_err(|source| PerfError::Shape { path: path.to_path_buf(), source })
}

/// A model of `cfg` with random weights drawn on the device itself (fast at billions of parameters; the
/// values do not matter for timing): normal(0, 0.02) matrices, unit norms, zero biases.
fn random_model(cfg: ModelConfig, t: &Timing, trainable: bool) -> Result<Decoder> {
    let dev = &t.device;
    let get =
        |name: &str, shape: &[usize]| random_parameter(name, shape, dev, || Ok(Tensor::randn(0f32, 0.02, shape, dev)?));
    Ok(Decoder::from_tensors(cfg, get, t.dtype, &t.device, trainable)?)
}

fn random_ids(rng: &mut impl Rng, n: usize, vocab: usize) -> Vec<u32> {
    (0..n).map(|_| rng.gen_range(0..vocab as u32)).collect()
}

/// The projections' GEMMs of one layer of a model shape (`grpo bench gemm`).
#[derive(Debug, Clone, clap::Args)]
pub struct GemmSpec {
    /// HF config.json of the model shape (e.g. configs/models/qwen2.5-7b-instruct.config.json).
    #[arg(long)]
    pub shape: PathBuf,
    /// Tokens of a micro-batch: the products' rows.
    #[arg(long, default_value_t = 4096)]
    pub tokens: usize,
}

/// One GEMM of `grpo bench gemm`: `[m, k] x [k, n]`, median seconds and TFLOP/s.
#[derive(Debug, serde::Serialize)]
struct GemmTiming {
    name: String,
    m: usize,
    k: usize,
    n: usize,
    seconds: f64,
    tflops: f64,
}

/// The rate the performance model assumes for the layer's projection GEMMs on a GPU (each at its peak times
/// [`crate::cost::time::Gpu::gemm_efficiency`] times its tiles' utilisation), over their sum.
#[derive(Debug, serde::Serialize)]
struct AssumedGemm {
    gpu: &'static str,
    tflops: f64,
}

/// What `grpo bench gemm` prints.
#[derive(Debug, serde::Serialize)]
struct GemmRecord {
    bench: &'static str,
    device: String,
    dtype: &'static str,
    shape: String,
    tokens: usize,
    /// Each projection's forward (`x W^T`), input gradient (`g W`) and weight gradient (`g^T x`), as the
    /// decoder runs them (candle's matmul on the transposed weight, cuBLAS on a GPU).
    gemms: Vec<GemmTiming>,
    /// Their sum, and all their FLOPs over it: the layer's GEMM rate the performance model's single GEMM
    /// efficiency stands for.
    seconds: f64,
    tflops: f64,
    assumed: Vec<AssumedGemm>,
}

/// Each projection's three GEMMs of one layer of `--shape` over `--tokens` rows, timed one by one on the
/// device in the bench's dtype: what the performance model's GEMM efficiency (measured at 2048^3) should be
/// at the shapes a step runs.
pub fn gemm(spec: &GemmSpec, t: &Timing) -> Result<Value> {
    let cfg = load_shape(&spec.shape)?;
    let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
    let (q, kv) = (cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim);
    let n = spec.tokens;
    let rand = |shape: (usize, usize)| -> Result<Tensor> {
        Ok(Tensor::randn(0f32, 0.02, shape, &t.device)?.to_dtype(t.dtype)?)
    };
    let mut gemms = Vec::new();
    for (name, fan_in, fan_out) in
        [("q", h, q), ("k", h, kv), ("v", h, kv), ("o", q, h), ("gate", h, i), ("up", h, i), ("down", i, h)]
    {
        let (x, w, g) = (rand((n, fan_in))?, rand((fan_out, fan_in))?, rand((n, fan_out))?);
        // (lhs, rhs) of each product: x W^T, g W, g^T x.
        let cases = [
            ("forward", (n, fan_in, fan_out), (x.clone(), w.t()?)),
            ("input gradient", (n, fan_out, fan_in), (g.clone(), w.clone())),
            ("weight gradient", (fan_out, n, fan_in), (g.t()?, x.clone())),
        ];
        for (what, (m, k, cols), (lhs, rhs)) in cases {
            let (times, _) = time_runs(t, || Ok(lhs.matmul(&rhs)?))?;
            let seconds = median(&times);
            let tflops = 2.0 * (m * k * cols) as f64 / seconds / 1e12;
            gemms.push(GemmTiming { name: format!("{name} {what}"), m, k, n: cols, seconds, tflops });
        }
    }
    let seconds = gemms.iter().map(|g| g.seconds).sum::<f64>();
    let flops = gemms.iter().map(|g| 2.0 * (g.m * g.k * g.n) as f64).sum::<f64>();
    // The model's time for each GEMM, at the rate of its product's shape.
    let assumed = crate::cost::time::GPUS
        .iter()
        .map(|gpu| {
            let rate = |g: &GemmTiming| crate::cost::time::gemm_flops_per_s(g.m as f64, g.n as f64, gpu);
            let model_s = gemms.iter().map(|g| 2.0 * (g.m * g.k * g.n) as f64 / rate(g)).sum::<f64>();
            AssumedGemm { gpu: gpu.name, tflops: flops / model_s / 1e12 }
        })
        .collect();
    let record = GemmRecord {
        bench: "gemm",
        device: device_name(&t.device),
        dtype: dtype_name(t.dtype),
        shape: shape_name(&spec.shape),
        tokens: n,
        gemms,
        seconds,
        tflops: flops / seconds / 1e12,
        assumed,
    };
    to_record(record)
}

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
    /// With --predict-only: predict the step as the build an H100 run measured ran it, named by its
    /// results' tag (benches/results/gpu-<TAG>-h100.jsonl: 2026-11-26, 2026-11-27, 2026-11-27b, ...; its
    /// tensor ops, attention kernels' rates and offloaded update), to compare with that run's records.
    #[arg(long = "measured-build", value_name = "TAG", default_value = "current", value_parser = measured_build,
          requires = "predict_only")]
    pub build: MeasuredBuild,
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
    fn batching(&self) -> crate::train::pack::Batching {
        crate::train::pack::Batching::of(self.micro_batch, self.micro_batch_tokens)
    }

    /// The step's micro-batches and the answers in the first (the largest).
    fn micro_batches(&self) -> (usize, usize) {
        let batches = self.batching().micro_batches(&vec![self.seq_len; self.answers]);
        (batches.len(), batches.first().map_or(0, |mb| mb.iter().map(Vec::len).sum()))
    }
}

/// The tensors candle has made in this process so far: every op's output and every view gets the next
/// of candle's tensor ids, which is read here from the id of a new scalar (`TensorId` shows its number
/// only through `Debug`).
fn tensors_made() -> Result<u64> {
    let probe = Tensor::zeros((), DType::F32, &Device::Cpu)?;
    let id = format!("{:?}", probe.id());
    let digits: String = id.chars().filter(char::is_ascii_digit).collect();
    digits.parse().map_err(|_| PerfError::Invalid(format!("candle's tensor id `{id}` has no number")))
}

/// The prompt must leave room for an answer.
fn check_lengths(spec: &TrainStepSpec) -> Result<()> {
    if spec.prompt_len == 0 || spec.prompt_len >= spec.seq_len {
        return Err(PerfError::Invalid(format!(
            "prompt length {} must be in 1..{} (the sequence length)",
            spec.prompt_len, spec.seq_len
        )));
    }
    Ok(())
}

/// One off_grpo training step as `grpo train` runs it: `answers` sequences of one random question,
/// rewards alternating 1, 0 (advantages +-1 after normalisation), eps 0.2, beta 0.1 with k3 to a frozen
/// reference (beta 0 and no reference with `no_reference`), seq-mean-token-mean, AdamW at lr 1e-6 with
/// f32 master weights and moments (in host memory with `offload`).
pub fn train_step(spec: &TrainStepSpec, t: &Timing) -> Result<Value> {
    check_lengths(spec)?;
    let cfg = load_shape(&spec.shape)?;
    let vocab = cfg.vocab_size;
    let (policy, reference) = bench_models(spec, cfg, t)?;
    let objective_cfg = ObjectiveConfig {
        name: ObjectiveName::OffGrpo,
        eps: Some(0.2),
        beta: if spec.no_reference { 0.0 } else { 0.1 },
        kl_estimator: Some(KlEstimator::K3),
        loss_agg: Some(LossAgg::SeqMeanTokenMean),
        ..ObjectiveConfig::default()
    };
    let optim_cfg = OptimConfig { lr: 1e-6, offload: spec.offload, ..OptimConfig::default() };
    let mut step = TrainStep::new(&objective_cfg, &optim_cfg, &policy, spec.micro_batch, spec.seq_len, 0)?;
    step.set_batching(spec.batching());
    let groups = [random_group(spec, vocab)];
    let mut step_no = 0usize;
    let mut counts = StepCounts::default();
    let mut profile: Option<crate::profile::Profile> = None;
    let (times, stats) = time_runs(t, || {
        if step_no == t.warmup {
            reset_peak_memory(&t.device)?;
        }
        step_no += 1;
        let (before, made) = (host_reads(), tensors_made()?);
        // Only the last step is profiled: the profiler's syncs at every phase boundary (and within the
        // offloaded update, between its chunks) would slow the steps whose time the record gives.
        let profiler = (spec.profile && step_no == t.warmup + t.repeats.max(1))
            .then(|| crate::profile::Profiler::start(&t.device))
            .transpose()
            .map_err(|e| PerfError::Invalid(e.to_string()))?;
        let stats = step.run(&policy, reference.as_ref(), &groups, optim_cfg.lr)?.stats;
        if let Some(p) = profiler.map(crate::profile::Profiler::finish) {
            match &mut profile {
                Some(all) => all.merge(&p),
                None => profile = Some(p),
            }
        }
        // (less the probe's own tensor)
        counts = StepCounts { syncs: host_reads() - before, tensor_ops: tensors_made()? - made - 1 };
        Ok(stats)
    })?;
    let peak = memory_bytes(&t.device)?.map(|(_, high)| high);
    let record = train_step_record((spec, policy.config()), t, (times, &stats), counts, (peak, profile));
    to_record(record)
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
    policy.options.checkpoint_layers = spec.checkpoint_layers;
    policy.options.recompute_attention = !spec.keep_attention;
    policy.options.logprob_chunk_bytes = spec.logprob_chunk_mb << 20;
    policy.options.keep_logits = spec.keep_logits;
    policy.options.fused_ops = spec.fused_ops;
    policy.options.attention = spec.attention;
    policy.options.deterministic_attention = !spec.atomic_dq;
    let reference = if spec.no_reference {
        None
    } else {
        let mut r = if spec.lora_r > 0 { policy.without_adapters() } else { policy.frozen_copy()? };
        r.options = policy.options.clone();
        Some(r)
    };
    Ok((policy, reference))
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

/// What the host did in the last timed step: reads from the device it waited for, tensors candle made.
#[derive(Debug, Clone, Copy, Default)]
struct StepCounts {
    syncs: u64,
    tensor_ops: u64,
}

/// A measured training step (`grpo bench train-step`): the spec, the timings, the model's prediction and
/// the host's counts.
#[derive(Debug, serde::Serialize)]
struct TrainStepRecord {
    bench: &'static str,
    #[serde(rename = "impl")]
    implementation: &'static str,
    shape: String,
    answers: usize,
    seq_len: usize,
    prompt_len: usize,
    dtype: &'static str,
    device: String,
    micro_batch: usize,
    micro_batch_tokens: usize,
    checkpoint_layers: bool,
    keep_attention: bool,
    atomic_dq: bool,
    logprob_chunk_mb: usize,
    keep_logits: bool,
    fused_ops: bool,
    offload: bool,
    /// The optimiser's update as this build runs it (kernels::adamw; the 2026-11-26 run's records, without
    /// this field, ran the composite update).
    update: &'static str,
    reference: bool,
    lora_r: usize,
    attention: Attention,
    step_times: Vec<f64>,
    step_time_s: f64,
    /// With --profile: the last step's time, profiled; whether step_time_s is that one (a single timed step).
    profiled_step_s: Option<f64>,
    step_time_profiled: bool,
    tokens: usize,
    response_tokens: usize,
    tokens_per_s: f64,
    peak_mem_bytes: Option<u64>,
    losses: Vec<f64>,
    predicted: Vec<PredictedStep>,
    micro_batches: usize,
    host_syncs_per_step: u64,
    host_syncs_per_micro_batch: f64,
    tensor_ops_per_step: u64,
    profile: Option<crate::profile::ProfileReport>,
}

/// The record of a measured step: its time the median of the timed steps but a profiled last one (where
/// another ran without the profiler).
fn train_step_record(
    (spec, cfg): (&TrainStepSpec, &ModelConfig),
    t: &Timing,
    (times, stats): (Vec<f64>, &[crate::train::step::StepStats]),
    counts: StepCounts,
    (peak, profile): (Option<u64>, Option<crate::profile::Profile>),
) -> TrainStepRecord {
    let (micro_batches, _) = spec.micro_batches();
    let profiled = spec.profile.then(|| times.last().copied()).flatten();
    let unprofiled = if profiled.is_some() && times.len() > 1 { &times[..times.len() - 1] } else { &times[..] };
    let step_time = median(unprofiled);
    let tokens = spec.answers * spec.seq_len;
    let predicted = predicted_steps(cfg, spec, (&t.device, t.dtype), Some(step_time));
    TrainStepRecord {
        bench: "train_step",
        implementation: "grpo",
        shape: shape_name(&spec.shape),
        answers: spec.answers,
        seq_len: spec.seq_len,
        prompt_len: spec.prompt_len,
        dtype: dtype_name(t.dtype),
        device: device_name(&t.device),
        micro_batch: spec.micro_batch,
        micro_batch_tokens: spec.micro_batch_tokens,
        checkpoint_layers: spec.checkpoint_layers,
        keep_attention: spec.keep_attention,
        atomic_dq: spec.atomic_dq,
        logprob_chunk_mb: spec.logprob_chunk_mb,
        keep_logits: spec.keep_logits,
        fused_ops: spec.fused_ops,
        offload: spec.offload,
        update: "fused",
        reference: !spec.no_reference,
        lora_r: spec.lora_r,
        attention: spec.attention,
        step_time_s: step_time,
        profiled_step_s: profiled,
        step_time_profiled: profiled.is_some() && times.len() == 1,
        step_times: times,
        tokens,
        response_tokens: stats.first().map_or(0, |s| s.response_tokens),
        tokens_per_s: tokens as f64 / step_time,
        peak_mem_bytes: peak,
        losses: stats.iter().map(|s| s.loss).collect(),
        predicted,
        micro_batches,
        host_syncs_per_step: counts.syncs,
        host_syncs_per_micro_batch: counts.syncs as f64 / micro_batches as f64,
        tensor_ops_per_step: counts.tensor_ops,
        profile: profile.map(|p| p.report()),
    }
}

/// A bench's record as the JSON line it prints.
fn to_record(record: impl serde::Serialize) -> Result<Value> {
    serde_json::to_value(record).map_err(|e| PerfError::Invalid(e.to_string()))
}

/// The performance model's prediction of one GPU for a step, beside the measured time when the bench
/// ran on that GPU.
#[derive(Debug, serde::Serialize)]
struct PredictedStep {
    gpu: &'static str,
    /// The card and date the GPU's rates were measured on; `null`: its rates are assumptions.
    calibrated_on: Option<String>,
    step_time_s: f64,
    tokens_per_s: f64,
    mfu: f64,
    attention_of_peak: f64,
    /// The device's seconds per kind, the time it waits for the host, and the host syncs: they add up to
    /// the step.
    gemm_s: f64,
    attention_s: f64,
    elementwise_s: f64,
    host_s: f64,
    sync_s: f64,
    launches: f64,
    host_syncs: f64,
    /// The tensors candle makes in the step by the model's count ([`crate::cost::time::tensor_ops_per_step`]),
    /// what a run's `tensor_ops_per_step` measures.
    tensor_ops: f64,
    /// The rates the windows' times are at (scripts/calibrate.py refits them).
    memory_efficiency: f64,
    kernel_launch_s: f64,
    windows: Vec<crate::cost::time::WindowCost>,
    /// Where the device's time goes, op by op (longest first).
    ops: Vec<crate::cost::time::OpTime>,
    /// Measured over predicted step time, when the device is this GPU (by its CUDA name).
    measured_over_predicted: Option<f64>,
}

/// A measured build's tag (`--measured-build`).
fn measured_build(tag: &str) -> std::result::Result<MeasuredBuild, String> {
    MeasuredBuild::from_tag(tag).ok_or_else(|| format!("no measured build is tagged {tag:?} (src/cost/calibration.rs)"))
}

/// The model's step shape of the bench's settings; `chunk` the log-prob op's logits chunk in bytes.
fn step_shape(cfg: &ModelConfig, spec: &TrainStepSpec, dtype: DType, chunk: u64) -> crate::cost::time::StepShape {
    use crate::cost::time::{driver_blocks, StepShape};
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
        build: spec.build,
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

/// The model's predicted step (src/cost/time.rs) for the bench's shape on each modelled GPU; `measured`
/// the step's time on `device` (`None`: not run). A chunk left to the device is its size on `device`, or
/// on a GPU's the 1 GiB least when the step is only predicted.
fn predicted_steps(
    cfg: &ModelConfig,
    spec: &TrainStepSpec,
    (device, dtype): (&Device, DType),
    measured: Option<f64>,
) -> Vec<PredictedStep> {
    use crate::cost::time::{predict, GPUS};
    let chunk = match (spec.logprob_chunk_mb, measured) {
        (0, Some(_)) => crate::kernels::logprob_chunk_bytes(device).unwrap_or(crate::kernels::LOGPROB_CHUNK_BYTES),
        (0, None) => crate::kernels::gpu_chunk_bytes(0),
        (mb, _) => mb << 20,
    };
    let shape = step_shape(cfg, spec, dtype, chunk as u64);
    let device = device_name(device);
    GPUS.iter()
        .map(|gpu| {
            let p = predict(cfg, &shape, gpu);
            let here = device.contains(gpu.name.split(' ').next().unwrap_or(gpu.name));
            PredictedStep {
                gpu: gpu.name,
                calibrated_on: gpu.calibration.map(|c| format!("{}, {}", c.card, c.date)),
                step_time_s: p.step_s,
                tokens_per_s: p.tokens_per_s,
                mfu: p.mfu,
                attention_of_peak: p.attention_of_peak,
                gemm_s: p.gemm_s,
                attention_s: p.attention_s,
                elementwise_s: p.elementwise_s,
                host_s: p.host_s,
                sync_s: p.sync_s,
                launches: p.launches,
                host_syncs: p.syncs,
                tensor_ops: crate::cost::time::tensor_ops_per_step(cfg, &shape),
                memory_efficiency: gpu.memory_efficiency,
                kernel_launch_s: gpu.kernel_launch_s,
                windows: p.windows,
                ops: p.ops,
                measured_over_predicted: measured.filter(|_| here).map(|m| m / p.step_s),
            }
        })
        .collect()
}

/// What `grpo bench train-step --predict-only` prints: the model's prediction of the bench's step on
/// each modelled GPU, without running it.
#[derive(Debug, serde::Serialize)]
struct PredictedRecord {
    bench: &'static str,
    shape: String,
    answers: usize,
    seq_len: usize,
    prompt_len: usize,
    dtype: &'static str,
    micro_batch: usize,
    micro_batch_tokens: usize,
    checkpoint_layers: bool,
    keep_attention: bool,
    keep_logits: bool,
    atomic_dq: bool,
    offload: bool,
    reference: bool,
    attention: Attention,
    predicted: Vec<PredictedStep>,
}

/// The model's prediction of `spec`'s step in `dtype`, without running it (so a GPU's step is predicted
/// on a CPU).
pub fn predict_train_step(spec: &TrainStepSpec, dtype: DType) -> Result<Value> {
    check_lengths(spec)?;
    let cfg = load_shape(&spec.shape)?;
    let record = PredictedRecord {
        bench: "train_step_prediction",
        shape: shape_name(&spec.shape),
        answers: spec.answers,
        seq_len: spec.seq_len,
        prompt_len: spec.prompt_len,
        dtype: dtype_name(dtype),
        micro_batch: spec.micro_batch,
        micro_batch_tokens: spec.micro_batch_tokens,
        checkpoint_layers: spec.checkpoint_layers,
        keep_attention: spec.keep_attention,
        keep_logits: spec.keep_logits,
        atomic_dq: spec.atomic_dq,
        offload: spec.offload,
        reference: !spec.no_reference,
        attention: spec.attention,
        predicted: predicted_steps(&cfg, spec, (&Device::Cpu, dtype), None),
    };
    to_record(record)
}

/// The log-prob op's settings (`grpo bench logprob`).
#[derive(Debug, Clone, clap::Args)]
pub struct LogprobSpec {
    #[arg(long, default_value_t = 8192)]
    pub tokens: usize,
    #[arg(long, default_value_t = 896)]
    pub hidden: usize,
    #[arg(long, default_value_t = 151_936)]
    pub vocab: usize,
    /// Put the off_grpo token loss (ratio, clip, k3 KL) on top, as the trainer does.
    #[arg(long)]
    pub with_loss: bool,
    /// Chunk budget of the fused op, MiB.
    #[arg(long, default_value_t = 64)]
    pub chunk_mb: usize,
    /// Measure candle's naive whole-vocabulary log-softmax instead of the fused op.
    #[arg(long)]
    pub naive: bool,
}

/// Forward, and forward + backward, of the per-token log-prob from hidden states and the lm_head.
pub fn logprob(spec: &LogprobSpec, t: &Timing) -> Result<Value> {
    let dev = &t.device;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
    let mut draw = |n: usize, scale: f32| -> Vec<f32> { (0..n).map(|_| rng.gen_range(-scale..scale)).collect() };
    let hidden = Var::from_tensor(
        &Tensor::from_vec(draw(spec.tokens * spec.hidden, 2.0), (spec.tokens, spec.hidden), dev)?.to_dtype(t.dtype)?,
    )?;
    let weight = Var::from_tensor(
        &Tensor::from_vec(draw(spec.vocab * spec.hidden, 0.05), (spec.vocab, spec.hidden), dev)?.to_dtype(t.dtype)?,
    )?;
    let upstream = Tensor::from_vec(draw(spec.tokens, 1.0), spec.tokens, dev)?;
    let ref_logp = Tensor::from_vec(draw(spec.tokens, 1.0), spec.tokens, dev)?.affine(1.0, -12.0)?;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(2);
    let targets = Tensor::from_vec(random_ids(&mut rng, spec.tokens, spec.vocab), spec.tokens, dev)?;
    let objective_cfg = ObjectiveConfig { beta: 0.1, ..ObjectiveConfig::default() };
    let objective = objective_cfg.build();
    let mut inputs = TokenInputs::for_sequences(&[spec.tokens], &[0.0], &[1.0 / spec.tokens as f32], dev)?;
    inputs.advantages = upstream.clone();
    inputs.ref_logp = Some(ref_logp);
    let forward = || -> Result<Tensor> {
        let lp = if spec.naive {
            logprobs_entropy_reference(hidden.as_tensor(), weight.as_tensor(), &targets)?
        } else {
            logprobs_entropy(hidden.as_tensor(), weight.as_tensor(), &targets, spec.chunk_mb.max(1) << 20)?
        };
        let logp = lp.narrow(1, 0, 1)?.squeeze(1)?;
        Ok(if spec.with_loss { objective.loss(&logp, &inputs)?.loss } else { (logp * &upstream)?.sum_all()? })
    };
    let (fwd, _) = time_runs(t, || forward().map(|l| l.detach()))?;
    let before = memory_bytes(dev)?;
    reset_peak_memory(dev)?;
    let (fwd_bwd, _) = time_runs(t, || {
        let grads = forward()?.backward()?;
        Ok(grads.get(hidden.as_tensor()).is_some())
    })?;
    let peak = match (before, memory_bytes(dev)?) {
        (Some((used, _)), Some((_, high))) => Some(high.saturating_sub(used)),
        _ => None,
    };
    to_record(LogprobRecord {
        bench: "logprob",
        implementation: if spec.naive { "grpo_naive" } else { "grpo_fused" },
        tokens: spec.tokens,
        hidden: spec.hidden,
        vocab: spec.vocab,
        dtype: dtype_name(t.dtype),
        device: device_name(dev),
        with_loss: spec.with_loss,
        chunk_mb: (!spec.naive).then_some(spec.chunk_mb),
        fwd_time_s: median(&fwd),
        fwd_bwd_time_s: median(&fwd_bwd),
        peak_mem_bytes: peak,
    })
}

/// `grpo bench logprob`'s record: the forward's and the forward + backward's median times, and the peak
/// memory above the inputs.
#[derive(Debug, serde::Serialize)]
struct LogprobRecord {
    bench: &'static str,
    #[serde(rename = "impl")]
    implementation: &'static str,
    tokens: usize,
    hidden: usize,
    vocab: usize,
    dtype: &'static str,
    device: String,
    with_loss: bool,
    chunk_mb: Option<usize>,
    fwd_time_s: f64,
    fwd_bwd_time_s: f64,
    peak_mem_bytes: Option<u64>,
}

/// Generation settings (`grpo bench generate`).
#[derive(Debug, Clone, clap::Args)]
pub struct GenerateSpec {
    /// HF config.json of the model shape; weights are random.
    #[arg(long)]
    pub shape: PathBuf,
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    #[arg(long, default_value_t = 128)]
    pub prompt_len: usize,
    #[arg(long, default_value_t = 256)]
    pub new_tokens: usize,
    /// The fused RMSNorm/rope/softmax kernels; --composite-ops uses candle's composite ops instead.
    #[arg(long = "composite-ops", action = clap::ArgAction::SetFalse)]
    pub fused_ops: bool,
}

/// Greedy generation of exactly `new_tokens` per row (no stop token) from random prompts.
pub fn generate(spec: &GenerateSpec, t: &Timing) -> Result<Value> {
    use crate::eval::{generate as run_generate, SamplingParams};
    let cfg = load_shape(&spec.shape)?;
    let vocab = cfg.vocab_size;
    let mut model = random_model(cfg, t, false)?;
    model.options.fused_ops = spec.fused_ops;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
    let prompts: Vec<Vec<u32>> = (0..spec.batch).map(|_| random_ids(&mut rng, spec.prompt_len, vocab)).collect();
    let ids: Vec<u64> = (0..spec.batch as u64).collect();
    let params = SamplingParams { max_new_tokens: spec.new_tokens, ..SamplingParams::default() };
    let (times, outs) = time_runs(t, || {
        let g = run_generate(&model, &prompts, &ids, &params, &[], 0, |_| {})?;
        Ok(g.iter().map(|g| g.tokens.len()).sum::<usize>())
    })?;
    let produced = outs.first().copied().unwrap_or(0);
    if produced != spec.batch * spec.new_tokens {
        return Err(PerfError::Invalid(format!(
            "generated {produced} tokens, expected {} x {}",
            spec.batch, spec.new_tokens
        )));
    }
    let time = median(&times);
    to_record(GenerateRecord {
        bench: "generate",
        implementation: "grpo",
        shape: shape_name(&spec.shape),
        batch: spec.batch,
        prompt_len: spec.prompt_len,
        new_tokens: spec.new_tokens,
        fused_ops: spec.fused_ops,
        dtype: dtype_name(t.dtype),
        device: device_name(&t.device),
        time_s: time,
        tokens_per_s: produced as f64 / time,
    })
}

/// `grpo bench generate`'s record: the median time of the batch's generation and its new tokens a second.
#[derive(Debug, serde::Serialize)]
struct GenerateRecord {
    bench: &'static str,
    #[serde(rename = "impl")]
    implementation: &'static str,
    shape: String,
    batch: usize,
    prompt_len: usize,
    new_tokens: usize,
    fused_ops: bool,
    dtype: &'static str,
    device: String,
    time_s: f64,
    tokens_per_s: f64,
}

/// Sampling settings of [`sample`] (`grpo bench sample`).
#[derive(Debug, Clone, clap::Args)]
pub struct SampleSpec {
    #[arg(long, default_value_t = 151_936)]
    pub vocab: usize,
    /// Rows per timed run (one per sequence of a generation batch).
    #[arg(long, default_value_t = 32)]
    pub rows: usize,
    #[arg(long, default_value_t = 0.6)]
    pub temperature: f32,
    #[arg(long, default_value_t = 0.95)]
    pub top_p: f32,
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
}

/// Time to pick one token per row of a `[rows, vocab]` batch of logits (normal, std 3) as generation
/// does: on the device, copying back only the ids ([`crate::eval::sample_rows`]), against the full-sort
/// reference on the host after copying the whole logits there. Both draw with the same uniforms, so they
/// pick the same tokens but for a uniform within float rounding of a boundary (counted).
pub fn sample(spec: &SampleSpec, t: &Timing) -> Result<Value> {
    use crate::eval::{sample_rows, sample_token_reference};
    use rayon::prelude::*;
    let params = crate::eval::SamplingParams {
        temperature: spec.temperature,
        top_p: spec.top_p,
        top_k: spec.top_k,
        ..crate::eval::SamplingParams::default()
    };
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(4);
    let flat: Vec<f32> =
        (0..spec.rows * spec.vocab).map(|_| 3.0 * crate::model::load::sample_normal(&mut rng)).collect();
    let logits = Tensor::from_vec(flat, (spec.rows, spec.vocab), &t.device)?;
    let uniforms: Vec<f64> = (0..spec.rows).map(|_| rng.gen::<f64>()).collect();
    let as_f32: Vec<f32> = uniforms.iter().map(|&u| u as f32).collect();
    let (ours, picks) = time_runs(t, || Ok(crate::device::to_host::<u32>(&sample_rows(&logits, &params, &as_f32)?)?))?;
    let (reference, ref_picks) = time_runs(t, || {
        let rows = logits.to_vec2::<f32>()?;
        let picks = rows
            .par_iter()
            .zip(&uniforms)
            .map(|(row, &u)| sample_token_reference(row, &params, u))
            .collect::<Vec<u32>>();
        Ok(picks)
    })?;
    let differ = picks.last().zip(ref_picks.last()).map_or(0, |(a, b)| a.iter().zip(b).filter(|(x, y)| x != y).count());
    let per_row = |times: &[f64]| median(times) / spec.rows.max(1) as f64;
    to_record(SampleRecord {
        bench: "sample",
        implementation: "grpo",
        device: device_name(&t.device),
        vocab: spec.vocab,
        rows: spec.rows,
        temperature: params.temperature,
        top_p: params.top_p,
        top_k: params.top_k,
        us_per_row: per_row(&ours) * 1e6,
        reference_us_per_row: per_row(&reference) * 1e6,
        speedup: per_row(&reference) / per_row(&ours),
        picks_differing: differ,
    })
}

/// `grpo bench sample`'s record: the time per row on the device against the host's full sort, and the rows
/// whose picks differ.
#[derive(Debug, serde::Serialize)]
struct SampleRecord {
    bench: &'static str,
    #[serde(rename = "impl")]
    implementation: &'static str,
    device: String,
    vocab: usize,
    rows: usize,
    temperature: f32,
    top_p: f32,
    top_k: usize,
    us_per_row: f64,
    reference_us_per_row: f64,
    speedup: f64,
    picks_differing: usize,
}

/// One layer's attention (`grpo bench attention`): causal, one row, random inputs.
#[derive(Debug, Clone, clap::Args)]
pub struct AttentionSpec {
    /// Tokens (queries and keys).
    #[arg(long, default_value_t = 4096)]
    pub len: usize,
    /// Query heads (Qwen2.5-7B: 28 of 128; the default keeps its head dim and a 4-head group).
    #[arg(long, default_value_t = 16)]
    pub heads: usize,
    #[arg(long, default_value_t = 4)]
    pub kv_heads: usize,
    #[arg(long, default_value_t = 128)]
    pub head_dim: usize,
    /// Side of the square matmul (in the bench's dtype) measured as the reference rate.
    #[arg(long, default_value_t = 2048)]
    pub matmul: usize,
    /// The tensor-core kernels (`model.attention = "mma"`; on a GPU in bf16/f16 at head dim 64 or 128,
    /// elsewhere the chunked path) instead of the chunked GEMMs.
    #[arg(long, conflicts_with = "wgmma")]
    pub mma: bool,
    /// The warpgroup kernels (`model.attention = "wgmma"`; on an H100/H200, compute capability 9.0, in
    /// bf16/f16 at head dim 64 or 128; elsewhere as --mma).
    #[arg(long)]
    pub wgmma: bool,
    /// With --mma or --wgmma, the backward that sums dq by f32 atomics
    /// (`model.deterministic_attention = false`).
    #[arg(long)]
    pub atomic_dq: bool,
}

/// What `grpo bench attention` prints.
#[derive(Debug, serde::Serialize)]
struct AttentionRecord {
    bench: &'static str,
    device: String,
    dtype: &'static str,
    /// Which path ran: "wgmma" (the warpgroup kernels), "mma" (the tensor-core kernels) or "chunked"
    /// (block products as GEMMs).
    kernel: &'static str,
    /// The tensor-core kernels' backward summed dq by atomics.
    atomic_dq: bool,
    len: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    /// Query rows and keys per block on this device.
    block_q: usize,
    block_k: usize,
    /// Forward + backward, median.
    seconds: f64,
    /// The causal attention's useful FLOPs (4 + 10 per query-key pair and head dim, masked halves of
    /// diagonal blocks not counted) over the time.
    gflops: f64,
    /// FLOPs the GEMMs ran (diagonal blocks whole).
    gemm_gflop_run: f64,
    matmul_size: usize,
    matmul_gflops: f64,
    /// gflops / matmul_gflops.
    ratio: f64,
    /// The forward alone, median, and its useful FLOPs (4 per query-key pair and head dim) over that time;
    /// the backward's 10 over the rest of `seconds` (null when the forward alone timed no faster). On a GPU
    /// their ratios to the matmul's rate are what the performance model assumes per kernel
    /// (docs/performance-model.md).
    forward_seconds: f64,
    forward_gflops: f64,
    forward_ratio: f64,
    backward_gflops: Option<f64>,
    backward_ratio: Option<f64>,
    /// The GPU's blocks and launches for the same shape (forward, backward).
    gpu_block_q: usize,
    gpu_block_k: usize,
    gpu_launches: (usize, usize),
}

/// Forward and backward of causal attention over `--len` tokens (flash path) against a square matmul of
/// `--matmul` in the same dtype, both on the device, in the same run.
pub fn attention(spec: &AttentionSpec, t: &Timing) -> Result<Value> {
    use crate::kernels::{causal_work, flash_attention_recorded, AttentionDevice, GpuKernels};
    let (n, h, kv, d) = (spec.len, spec.heads, spec.kv_heads, spec.head_dim);
    let dev = &t.device;
    let var = |heads| -> Result<Var> {
        Ok(Var::from_tensor(&Tensor::randn(0f32, 1.0, (1, heads, n, d), dev)?.to_dtype(t.dtype)?)?)
    };
    let (q, k, v) = (var(h)?, var(kv)?, var(kv)?);
    let ranges: Vec<u32> = (0..n as u32).flat_map(|i| [0, i]).collect();
    let ranges = Tensor::from_vec(ranges, (1, n, 2), dev)?;
    let scale = 1.0 / (d as f64).sqrt();
    let tensor_cores = (spec.mma || spec.wgmma) && !dev.is_cpu() && crate::kernels::tensor_core_attention(t.dtype, d);
    let kernel = match (tensor_cores, spec.wgmma && crate::kernels::warpgroup_attention(dev)?) {
        (true, true) => "wgmma",
        (true, false) => "mma",
        (false, _) => "chunked",
    };
    let kernels = match spec.mma || spec.wgmma {
        true => GpuKernels::TensorCores { atomic_dq: spec.atomic_dq, warpgroup: spec.wgmma },
        false => GpuKernels::Chunked,
    };
    let attend = |q: &Tensor, k: &Tensor, v: &Tensor, ranges: &Tensor, scale: f64| {
        flash_attention_recorded(q, k, v, ranges, scale, kernels, None)
    };
    let (times, _) = time_runs(t, || {
        let o = attend(q.as_tensor(), k.as_tensor(), v.as_tensor(), &ranges, scale)?;
        Ok(o.backward()?)
    })?;
    let seconds = median(&times);
    let (forward_times, _) = time_runs(t, || Ok(attend(q.as_tensor(), k.as_tensor(), v.as_tensor(), &ranges, scale)?))?;
    let forward_seconds = median(&forward_times);
    let m = spec.matmul;
    // In the bench's dtype: f32 on the CPU as the README quotes it; bf16/f16 on a GPU, the tensor cores'
    // rate the attention's products run at.
    let a = Tensor::randn(0f32, 1.0, (m, m), dev)?.to_dtype(t.dtype)?;
    let (mm, _) = time_runs(t, || Ok(a.matmul(&a)?))?;
    let matmul_gflops = 2.0 * (m * m * m) as f64 / median(&mm) / 1e9;
    let per_flop = (h * d) as f64 * (n * (n + 1) / 2) as f64; // query-key pairs x head dims
    let useful = 14.0 * per_flop;
    let forward_gflops = 4.0 * per_flop / forward_seconds / 1e9;
    let backward_gflops = (seconds > forward_seconds).then(|| 10.0 * per_flop / (seconds - forward_seconds) / 1e9);
    let bytes = t.dtype.size_in_bytes();
    let cpu = if dev.is_cpu() { AttentionDevice::Cpu } else { AttentionDevice::Gpu };
    let (blocks, fwd, bwd) = causal_work((1, h, kv, n, n, d), cpu, bytes);
    let (gpu, gf, gb) = causal_work((1, h, kv, n, n, d), AttentionDevice::Gpu, bytes);
    let gflops = useful / seconds / 1e9;
    let record = AttentionRecord {
        bench: "attention",
        device: device_name(dev),
        dtype: dtype_name(t.dtype),
        kernel,
        atomic_dq: tensor_cores && spec.atomic_dq,
        len: n,
        heads: h,
        kv_heads: kv,
        head_dim: d,
        block_q: blocks.bq,
        block_k: blocks.bk,
        seconds,
        gflops,
        gemm_gflop_run: (fwd.gemm_flops + bwd.gemm_flops) / 1e9,
        matmul_size: m,
        matmul_gflops,
        ratio: gflops / matmul_gflops,
        forward_seconds,
        forward_gflops,
        forward_ratio: forward_gflops / matmul_gflops,
        backward_gflops,
        backward_ratio: backward_gflops.map(|g| g / matmul_gflops),
        gpu_block_q: gpu.bq,
        gpu_block_k: gpu.bk,
        gpu_launches: (gf.launches, gb.launches),
    };
    to_record(record)
}

/// A long-tailed answer length mix and the groupings to compare on it (`grpo bench pack`).
#[derive(Debug, Clone, clap::Args)]
pub struct PackSpec {
    /// Questions in the step.
    #[arg(long, default_value_t = 32)]
    pub questions: usize,
    /// Answers per question (adjacent in the batch, as a step orders them).
    #[arg(long, default_value_t = 8)]
    pub group: usize,
    /// Median response tokens (log-normal).
    #[arg(long, default_value_t = 4096.0)]
    pub median: f64,
    /// Standard deviation of a question's log length around the median (hard questions get long answers).
    #[arg(long, default_value_t = 0.5)]
    pub question_sigma: f64,
    /// Standard deviation of an answer's log length around its question's.
    #[arg(long, default_value_t = 0.55)]
    pub answer_sigma: f64,
    /// Response tokens are cut here (`data.max_response_tokens`; the seed's 16,384).
    #[arg(long, default_value_t = 16_384)]
    pub max_response: usize,
    /// Median prompt tokens (log-normal, sigma 0.6, at most 2,048).
    #[arg(long, default_value_t = 150.0)]
    pub prompt_median: f64,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Answers per padded micro-batch (`train.micro_batch_size`), each compared.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
    pub micro_batch: Vec<usize>,
    /// Token budgets of packed micro-batches (`train.micro_batch_tokens`), each compared.
    #[arg(long, value_delimiter = ',', default_value = "16384,18432,32768,65536")]
    pub budgets: Vec<usize>,
}

/// One grouping of [`pack`]'s answers.
#[derive(Debug, serde::Serialize)]
struct PackRow {
    /// `micro_batch_size = n` or `micro_batch_tokens = n`.
    batching: String,
    #[serde(flatten)]
    padding: crate::train::pack::Padding,
    padding_fraction: f64,
    /// Tokens of the answers over the micro-batches' budget (packed only: how full its rows are).
    budget_fill: Option<f64>,
}

/// What `grpo bench pack` prints.
#[derive(Debug, serde::Serialize)]
struct PackRecord {
    bench: &'static str,
    answers: usize,
    seed: u64,
    /// The answers' tokens (prompt + response): median, 90th percentile, maximum, mean.
    length_median: usize,
    length_p90: usize,
    length_max: usize,
    length_mean: f64,
    /// Answers cut at `max_response`.
    cut: usize,
    groupings: Vec<PackRow>,
}

/// The answer lengths (prompt + response) of `spec`'s step: per question a log-normal draw of its median
/// (log sd `question_sigma`) and prompt, per answer a log-normal draw around it (log sd `answer_sigma`),
/// responses cut at `max_response`. Deterministic in `seed`.
fn pack_lengths(spec: &PackSpec) -> (Vec<usize>, usize) {
    use crate::model::load::sample_normal;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(spec.seed);
    let (mut lengths, mut cut) = (Vec::new(), 0);
    for _ in 0..spec.questions {
        let prompt = (spec.prompt_median * (0.6 * sample_normal(&mut rng) as f64).exp()).round().clamp(1.0, 2048.0);
        let centre = spec.median.ln() + spec.question_sigma * sample_normal(&mut rng) as f64;
        for _ in 0..spec.group {
            let response =
                (centre + spec.answer_sigma * sample_normal(&mut rng) as f64).exp().round().max(1.0) as usize;
            cut += usize::from(response >= spec.max_response);
            lengths.push(prompt as usize + response.min(spec.max_response));
        }
    }
    (lengths, cut)
}

/// The padding of a step's micro-batches on a long-tailed length mix like OpenThoughts3's (QwQ-32B
/// reasoning: a median of a few thousand tokens, a tail cut at 16k): padded micro-batches of each size
/// against packed ones of each token budget (src/train/pack.rs). No model runs.
pub fn pack(spec: &PackSpec) -> Result<Value> {
    use crate::train::pack::{Batching, Padding};
    if spec.questions == 0 || spec.group == 0 || spec.median < 1.0 || spec.max_response == 0 {
        return Err(PerfError::Invalid("questions, group, median and max-response must be positive".into()));
    }
    let (lengths, cut) = pack_lengths(spec);
    let mut sorted = lengths.clone();
    sorted.sort_unstable();
    let at = |q: f64| sorted[((sorted.len() - 1) as f64 * q).round() as usize];
    let row = |batching: Batching| {
        let padding = Padding::of(&batching.micro_batches(&lengths), &lengths);
        let fill = match batching {
            Batching::Answers(_) => None,
            Batching::Tokens(n) => Some(padding.tokens as f64 / (padding.micro_batches * n).max(1) as f64),
        };
        PackRow { batching: batching.to_string(), padding, padding_fraction: padding.fraction(), budget_fill: fill }
    };
    let groupings = spec
        .micro_batch
        .iter()
        .map(|&n| row(Batching::Answers(n.max(1))))
        .chain(spec.budgets.iter().filter(|&&n| n > 0).map(|&n| row(Batching::Tokens(n))))
        .collect();
    let record = PackRecord {
        bench: "pack",
        answers: lengths.len(),
        seed: spec.seed,
        length_median: at(0.5),
        length_p90: at(0.9),
        length_max: at(1.0),
        length_mean: lengths.iter().sum::<usize>() as f64 / lengths.len() as f64,
        cut,
        groupings,
    };
    to_record(record)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn tiny_shape(dir: &std::path::Path) -> PathBuf {
        let raw = json!({"model_type": "qwen2", "vocab_size": 97, "hidden_size": 16, "intermediate_size": 32,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": true});
        let p = dir.join("tiny.json");
        std::fs::write(&p, raw.to_string()).unwrap();
        p
    }

    fn cpu() -> Timing {
        Timing { device: Device::Cpu, dtype: DType::F32, warmup: 1, repeats: 2 }
    }

    #[test]
    fn attention_reports_its_rate_against_a_matmul() {
        let spec = AttentionSpec {
            len: 70,
            heads: 4,
            kv_heads: 2,
            head_dim: 16,
            matmul: 64,
            mma: false,
            wgmma: false,
            atomic_dq: false,
        };
        let r = attention(&spec, &cpu()).unwrap();
        assert_eq!(
            (r["bench"].as_str(), r["len"].as_u64(), r["block_q"].as_u64()),
            (Some("attention"), Some(70), Some(70))
        );
        // The CPU has one attention: asked for the GPU's kernels, it says it ran the chunked path.
        for (mma, wgmma) in [(true, false), (false, true)] {
            let r = attention(&AttentionSpec { mma, wgmma, atomic_dq: true, ..spec }, &cpu()).unwrap();
            assert_eq!((r["kernel"].as_str(), r["atomic_dq"].as_bool()), (Some("chunked"), Some(false)), "{r}");
        }
        let (g, m, ratio) =
            (r["gflops"].as_f64().unwrap(), r["matmul_gflops"].as_f64().unwrap(), r["ratio"].as_f64().unwrap());
        assert!(g > 0.0 && m > 0.0 && (ratio - g / m).abs() < 1e-9, "{r}");
        // The forward timed alone; the backward's rate over the rest of the time, where there is some.
        let (fs, fg) = (r["forward_seconds"].as_f64().unwrap(), r["forward_gflops"].as_f64().unwrap());
        let pairs = 4.0 * 16.0 * (70.0 * 71.0 / 2.0);
        assert!((fg - 4.0 * pairs / fs / 1e9).abs() <= 1e-9 * fg, "{r}");
        assert!((r["forward_ratio"].as_f64().unwrap() - fg / m).abs() < 1e-9, "{r}");
        let total = r["seconds"].as_f64().unwrap();
        match r["backward_gflops"].as_f64() {
            Some(bg) => assert!((bg - 10.0 * pairs / (total - fs) / 1e9).abs() <= 1e-9 * bg, "{r}"),
            None => assert!(total <= fs && r["backward_ratio"].is_null(), "{r}"),
        }
    }

    #[test]
    fn train_step_reports_every_field() {
        let dir = tempfile::tempdir().unwrap();
        let spec = TrainStepSpec {
            shape: tiny_shape(dir.path()),
            answers: 4,
            seq_len: 12,
            prompt_len: 4,
            micro_batch: 2,
            micro_batch_tokens: 0,
            checkpoint_layers: true,
            keep_attention: false,
            logprob_chunk_mb: 1,
            keep_logits: false,
            fused_ops: true,
            offload: false,
            no_reference: false,
            lora_r: 0,
            attention: Attention::Matrix,
            atomic_dq: false,
            predict_only: false,
            build: MeasuredBuild::Current,
            profile: false,
        };
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

    /// The host syncs of a step do not grow with the number of layers (and so of tensors): a constant per
    /// micro-batch and one read of the gradient norm per step; packing two answers into each row (the same
    /// micro-batches) adds none.
    #[test]
    fn host_syncs_do_not_grow_with_the_layers() {
        let dir = tempfile::tempdir().unwrap();
        let tiny = tiny_shape(dir.path());
        let syncs = |layers: usize, micro_batch_tokens: usize| {
            let mut raw: Value = serde_json::from_str(&std::fs::read_to_string(&tiny).unwrap()).unwrap();
            raw["num_hidden_layers"] = layers.into();
            let shape = dir.path().join(format!("layers-{layers}.json"));
            std::fs::write(&shape, raw.to_string()).unwrap();
            let spec = TrainStepSpec {
                shape,
                answers: 4,
                seq_len: 12,
                prompt_len: 4,
                micro_batch: 2,
                micro_batch_tokens,
                checkpoint_layers: false,
                keep_attention: false,
                logprob_chunk_mb: 0,
                keep_logits: false,
                fused_ops: true,
                offload: false,
                no_reference: false,
                lora_r: 0,
                attention: Attention::Flash,
                atomic_dq: false,
                predict_only: false,
                build: MeasuredBuild::Current,
                profile: false,
            };
            let r = train_step(&spec, &cpu()).unwrap();
            assert_eq!(r["micro_batches"], 2);
            r["host_syncs_per_step"].as_u64().unwrap()
        };
        let (two, six) = (syncs(2, 0), syncs(6, 0));
        assert_eq!(two, six);
        assert_eq!(syncs(2, 24), two);
        assert!(two <= 2 * 8 + 1, "{two} host syncs for 2 micro-batches");
    }

    #[test]
    fn fused_and_naive_logprob_both_run() {
        for naive in [false, true] {
            for with_loss in [false, true] {
                let spec = LogprobSpec { tokens: 6, hidden: 8, vocab: 50, with_loss, chunk_mb: 1, naive };
                let r = logprob(&spec, &cpu()).unwrap();
                assert!(r["fwd_bwd_time_s"].as_f64().unwrap() > 0.0, "{r}");
            }
        }
    }

    #[test]
    fn sampling_agrees_with_the_reference() {
        let spec = SampleSpec { vocab: 3000, rows: 4, temperature: 0.6, top_p: 0.95, top_k: 0 };
        let r = sample(&spec, &cpu()).unwrap();
        assert!(r["speedup"].as_f64().unwrap() > 0.0, "{r}");
        assert_eq!(r["picks_differing"], 0, "{r}");
    }

    #[test]
    fn generation_produces_every_token() {
        let dir = tempfile::tempdir().unwrap();
        let spec =
            GenerateSpec { shape: tiny_shape(dir.path()), batch: 3, prompt_len: 5, new_tokens: 4, fused_ops: false };
        let r = generate(&spec, &cpu()).unwrap();
        assert_eq!(r["batch"], 3);
        assert!(r["tokens_per_s"].as_f64().unwrap() > 0.0);
    }
}

/// The shape of [`optimizer`]'s benchmark: the state in host memory, as `optim.offload` keeps it, and the
/// parameters and their gradients on the bench's device.
#[derive(Debug, Clone, clap::Args)]
pub struct OptimizerSpec {
    /// Parameters in all.
    #[arg(long, default_value_t = 64_000_000)]
    pub params: usize,
    /// Tensors they are split into (a 7B model has ~340, a 0.5B one ~290).
    #[arg(long, default_value_t = 64)]
    pub tensors: usize,
}

/// [`optimizer`]'s record: the offloaded AdamW update's rate, as the optimiser runs it and as the
/// reference runs it, in the model's units (32 B per parameter, [`crate::cost::Gpu::host_update_bandwidth`]).
#[derive(Debug, serde::Serialize)]
struct OptimizerRecord {
    bench: &'static str,
    device: String,
    dtype: &'static str,
    params: usize,
    tensors: usize,
    threads: usize,
    /// The update as the optimiser runs it with `optim.offload`: the fused in-place AdamW
    /// ([`crate::kernels::adamw`]) of every tensor, their new weights in the model's dtype; on a GPU with
    /// the gradients brought down and the weights taken up through the staging of
    /// [`crate::train::offload`], overlapped with the host's update.
    fused_s: f64,
    fused_gb_per_s: f64,
    /// What the reference is: on the CPU, the same update from candle's composite ops (~15 per tensor,
    /// each allocating its result, the tensors in parallel: the update before the fused op); on a GPU,
    /// the fused update with its copies one tensor after another through pageable memory, waiting for
    /// each (the offloaded update before the staging).
    reference: &'static str,
    reference_s: f64,
    reference_gb_per_s: f64,
    speedup: f64,
    /// Bytes over PCIe per update on a GPU (f32 gradients down, weights up), 0 on the CPU.
    pcie_bytes: usize,
    /// The performance model's time for this offloaded update from each modelled GPU (src/cost/time.rs:
    /// one chunk's copies, then the longer of the host's update and the other copies), and on the card
    /// that ran, the measured time over it.
    predicted: Vec<PredictedUpdate>,
    /// The master weights after the timed runs agree bit for bit.
    same_bits: bool,
}

/// [`OptimizerRecord::predicted`]'s entry for one GPU.
#[derive(Debug, serde::Serialize)]
struct PredictedUpdate {
    gpu: &'static str,
    seconds: f64,
    measured_over_predicted: Option<f64>,
}

/// Random `[1, n]` weights (of `dtype`) and `[n]` f32 gradients on `device` for tensors of `sizes`.
fn optimizer_problem(sizes: &[usize], dtype: DType, device: &Device) -> Result<(Vec<Var>, crate::model::Grads)> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
    let mut random = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.gen_range(-1.0..1.0)).collect() };
    let mut vars = Vec::new();
    let mut grads = Vec::new();
    for &n in sizes {
        vars.push(Var::from_tensor(&Tensor::from_vec(random(n), (1, n), device)?.to_dtype(dtype)?)?);
        grads.push(Some(Tensor::from_vec(random(n), n, device)?));
    }
    Ok((vars, crate::model::Grads { grads }))
}

/// The offloaded optimiser's update (AdamW, f32 state in host memory) over `spec.params` parameters in
/// `spec.tensors` tensors of dtype `t.dtype` on `t.device`, against the reference
/// the record names (`reference`) in the same run, each from the same state: the composite ops on the CPU,
/// pageable copies one tensor at a time from a GPU.
pub fn optimizer(spec: &OptimizerSpec, t: &Timing) -> Result<Value> {
    use crate::train::optim::Optimizer;
    let tensors = spec.tensors.clamp(1, spec.params.max(1));
    let sizes: Vec<usize> =
        (0..tensors).map(|i| spec.params / tensors + usize::from(i < spec.params % tensors)).collect();
    let (vars, grads) = optimizer_problem(&sizes, t.dtype, &t.device)?;
    let names: Vec<String> = (0..tensors).map(|i| format!("w{i}")).collect();
    let cfg = OptimConfig { offload: true, weight_decay: 0.01, ..OptimConfig::default() };
    // The reference's state, from the same initial weights (copied: the fused run updates them).
    let mut state: Vec<Tensor> = vars
        .iter()
        .map(|v| v.as_tensor().to_device(&Device::Cpu)?.to_dtype(DType::F32)?.flatten_all()?.copy())
        .collect::<candle_core::Result<_>>()?;
    let mut opt = Optimizer::new(cfg.clone(), &names, &vars.iter().collect::<Vec<_>>())?;
    let (fused, _) = time_runs(t, || Ok(opt.step(&grads, cfg.lr, 1.0)?))?;
    let (reference, reference_runs) = match t.device.is_cpu() {
        true => ("composite candle ops", composite_update(t, &cfg, &mut state, &grads)?),
        false => ("pageable copies, one tensor at a time", serial_offload(t, &cfg, &mut state, &grads, &vars)?),
    };
    let fused_master = opt
        .state_tensors()?
        .into_iter()
        .filter(|(n, _)| n.starts_with("master."))
        .map(|(_, t)| t.flatten_all())
        .collect::<candle_core::Result<Vec<_>>>()?;
    let same_bits = fused_master.iter().zip(&state).all(|(a, b)| {
        let bits = |t: &Tensor| t.to_vec1::<f32>().map(|v| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>()).ok();
        bits(a) == bits(b)
    });
    let (fused_s, reference_s) = (median(&fused), median(&reference_runs));
    let gb = |s: f64| 32.0 * spec.params as f64 / s / 1e9;
    let pcie_bytes = if t.device.is_cpu() { 0 } else { spec.params * (4 + t.dtype.size_in_bytes()) };
    let device = device_name(&t.device);
    let predicted = (crate::cost::time::GPUS.iter())
        .map(|gpu| {
            let d = t.dtype.size_in_bytes() as f64;
            let seconds = crate::cost::time::offload_update_s(spec.params as f64, d, gpu);
            let here = device.contains(gpu.name.split(' ').next().unwrap_or(gpu.name));
            PredictedUpdate { gpu: gpu.name, seconds, measured_over_predicted: here.then(|| fused_s / seconds) }
        })
        .collect();
    let record = OptimizerRecord {
        bench: "optimizer",
        device,
        dtype: dtype_name(t.dtype),
        params: spec.params,
        tensors,
        threads: rayon::current_num_threads(),
        fused_s,
        fused_gb_per_s: gb(fused_s),
        reference,
        reference_s,
        reference_gb_per_s: gb(reference_s),
        speedup: reference_s / fused_s,
        pcie_bytes,
        predicted,
        same_bits,
    };
    to_record(record)
}

/// The update of `grads` (host memory) into the master weights `state` by candle's composite ops (the
/// moments kept beside them), the tensors in parallel, their new weights in the model's dtype: the host
/// update before the fused op. Returns the timed runs.
fn composite_update(
    t: &Timing,
    cfg: &OptimConfig,
    state: &mut [Tensor],
    grads: &crate::model::Grads,
) -> Result<Vec<f64>> {
    use crate::kernels::adamw_reference;
    use rayon::prelude::*;
    let mut moments: Vec<Option<(Tensor, Tensor)>> = vec![None; state.len()];
    let mut step = 0;
    let (runs, _) = time_runs(t, || {
        step += 1;
        let op = adam_op(cfg, step);
        let out = (state.par_iter().zip(&moments).zip(&grads.grads))
            .map(|((master, moments), g)| {
                let g = g.as_ref().expect("every tensor has a gradient");
                let (master, moments) = adamw_reference(master, moments.as_ref().map(|(m, v)| (m, v)), g, &op)?;
                master.to_dtype(t.dtype)?;
                Ok((master, moments))
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        for (k, (master, m)) in out.into_iter().enumerate() {
            (state[k], moments[k]) = (master, m);
        }
        Ok(())
    })?;
    Ok(runs)
}

/// The offloaded update as it ran before the staging: per tensor, the gradient copied to the host
/// (pageable memory, waited for), the fused update on the host, the new weights copied to the device
/// and set into a copy of the parameter. Returns the timed runs; `state` ends as the master weights.
fn serial_offload(
    t: &Timing,
    cfg: &OptimConfig,
    state: &mut [Tensor],
    grads: &crate::model::Grads,
    vars: &[Var],
) -> Result<Vec<f64>> {
    let rows: Vec<Tensor> = state
        .iter()
        .map(|m| Tensor::cat(&[m.unsqueeze(0)?, m.zeros_like()?.unsqueeze(0)?, m.zeros_like()?.unsqueeze(0)?], 0))
        .collect::<candle_core::Result<_>>()?;
    let copies: Vec<Var> =
        vars.iter().map(|v| Var::from_tensor(&v.as_tensor().copy()?)).collect::<candle_core::Result<_>>()?;
    let mut step = 0;
    let (runs, _) = time_runs(t, || {
        step += 1;
        let op = adam_op(cfg, step);
        for ((s, g), var) in rows.iter().zip(&grads.grads).zip(&copies) {
            let g = g.as_ref().expect("every tensor has a gradient").to_device(&Device::Cpu)?;
            crate::kernels::adamw(s, &g, &op)?;
            let w = s.get(0)?.to_dtype(t.dtype)?.reshape(var.shape())?.to_device(var.device())?;
            var.set(&w)?;
        }
        Ok(())
    })?;
    for (k, s) in rows.iter().enumerate() {
        state[k] = s.get(0)?;
    }
    Ok(runs)
}

/// The AdamW op of the optimizer bench's update number `step`.
fn adam_op(cfg: &OptimConfig, step: i32) -> crate::kernels::AdamW {
    crate::kernels::AdamW {
        adam: true,
        scale: 1.0,
        lr: cfg.lr,
        weight_decay: cfg.weight_decay,
        betas: cfg.betas,
        eps: cfg.eps,
        t: step,
    }
}
