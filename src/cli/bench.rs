//! `grpo bench`: measure a training step, the log-prob op or generation on random weights; prints one
//! JSON line per measurement on stdout (the format of scripts/gpu/torch_ref.py, merged by
//! scripts/gpu/report.py).

use anyhow::Context;
use serde::Deserialize;

use crate::bench::{
    self, AttentionSpec, GemmSpec, GenerateSpec, LogprobSpec, OptimizerSpec, PackSpec, SampleSpec, Timing,
    TrainStepSpec,
};
use crate::model::open_device;

#[derive(Debug, clap::Args)]
pub struct Common {
    /// Device: cpu or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub device: crate::device::DeviceName,
    /// Weight and activation dtype: f32, bf16 or f16.
    #[arg(long, default_value = "f32")]
    pub dtype: crate::device::DTypeName,
    /// Untimed runs first.
    #[arg(long, default_value_t = 1)]
    pub warmup: usize,
    /// Timed runs (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
}

#[derive(Debug, clap::Subcommand)]
pub enum BenchCommand {
    /// One off_grpo training step (policy forward+backward, reference forward, AdamW) of a model shape.
    TrainStep {
        #[command(flatten)]
        spec: TrainStepSpec,
        #[command(flatten)]
        common: Common,
    },
    /// The per-token log-prob op alone: fused and chunked (default) or candle's naive log-softmax.
    Logprob {
        #[command(flatten)]
        spec: LogprobSpec,
        #[command(flatten)]
        common: Common,
    },
    /// Generation on random weights: --batch prompts answered in full, or --problems x --samples with
    /// long-tailed answer lengths, under --schedule (and with --compare the other one).
    Generate {
        #[command(flatten)]
        spec: GenerateSpec,
        #[command(flatten)]
        common: Common,
    },
    /// Forward and backward of one layer's causal attention (chunked, GEMM products) on random data, and
    /// a plain f32 matmul measured in the same run: achieved GFLOP/s and their ratio.
    Attention {
        #[command(flatten)]
        spec: AttentionSpec,
        #[command(flatten)]
        common: Common,
    },
    /// One layer's projection GEMMs at a model shape (forward, input and weight gradients of q, k, v, o,
    /// gate, up, down over --tokens rows): TFLOP/s each and in all, beside the performance model's rate.
    Gemm {
        #[command(flatten)]
        spec: GemmSpec,
        #[command(flatten)]
        common: Common,
    },
    /// The optimiser's host update (`optim.offload`: AdamW over f32 state in host memory): the fused
    /// in-place update against the composite candle ops it replaced, in GB/s of state (32 B a parameter).
    Optimizer {
        #[command(flatten)]
        spec: OptimizerSpec,
        #[command(flatten)]
        common: Common,
    },
    /// Picking the next token (temperature, top-k, top-p) from a batch of random logits: on the device,
    /// copying back the ids, vs copying the logits to the host for the full-sort reference.
    Sample {
        #[command(flatten)]
        spec: SampleSpec,
        #[command(flatten)]
        common: Common,
    },
    /// The padding of padded micro-batches (train.micro_batch_size) against packed ones
    /// (train.micro_batch_tokens) on a long-tailed, OpenThoughts3-like answer length mix; no model runs.
    Pack {
        #[command(flatten)]
        spec: PackSpec,
    },
}

fn timing(c: &Common) -> anyhow::Result<Timing> {
    Ok(Timing {
        device: open_device(c.device).with_context(|| format!("--device {}", c.device))?,
        dtype: c.dtype.dtype(),
        warmup: c.warmup,
        repeats: c.repeats.max(1),
    })
}

pub fn run(cmd: BenchCommand) -> anyhow::Result<()> {
    let record = match cmd {
        BenchCommand::TrainStep { spec, common } if spec.predict_only => {
            let dtype = common.dtype.dtype();
            bench::predict_train_step(&spec, dtype).context("train-step prediction")?
        }
        BenchCommand::TrainStep { spec, common } => {
            bench::train_step(&spec, &timing(&common)?).context("train-step benchmark")?
        }
        BenchCommand::Logprob { spec, common } => {
            bench::logprob(&spec, &timing(&common)?).context("logprob benchmark")?
        }
        BenchCommand::Attention { spec, common } => {
            bench::attention(&spec, &timing(&common)?).context("attention benchmark")?
        }
        BenchCommand::Gemm { spec, common } => bench::gemm(&spec, &timing(&common)?).context("gemm benchmark")?,
        BenchCommand::Optimizer { spec, common } => {
            bench::optimizer(&spec, &timing(&common)?).context("optimizer benchmark")?
        }
        BenchCommand::Sample { spec, common } => bench::sample(&spec, &timing(&common)?).context("sample benchmark")?,
        BenchCommand::Pack { spec } => bench::pack(&spec).context("pack benchmark")?,
        BenchCommand::Generate { spec, common } => {
            bench::generate(&spec, &timing(&common)?).context("generate benchmark")?
        }
    };
    if let Some(p) = record.get("profile").filter(|p| !p.is_null()) {
        let profile = crate::profile::ProfileReport::deserialize(p).context("the profile's record")?;
        eprint!("{}", profile.table());
    }
    println!("{record}");
    Ok(())
}
