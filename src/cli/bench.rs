//! `grpo bench`: measure a training step, the log-prob op or generation on random weights; prints one
//! JSON line per measurement on stdout (the format of scripts/gpu/torch_ref.py, merged by
//! scripts/gpu/report.py).

use std::path::PathBuf;

use anyhow::Context;

use crate::model::{parse_device, parse_dtype};
use crate::perf::{self, GenerateSpec, LogprobSpec, Timing, TrainStepSpec};

#[derive(Debug, clap::Args)]
pub struct Common {
    /// Device: cpu or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Weight and activation dtype: f32, bf16 or f16.
    #[arg(long, default_value = "f32")]
    pub dtype: String,
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
        /// HF config.json of the model shape (e.g. scripts/gpu/shapes/qwen2.5-0.5b.json); weights are random.
        #[arg(long)]
        shape: PathBuf,
        /// Answers in the step (one question).
        #[arg(long, default_value_t = 8)]
        answers: usize,
        /// Tokens of each answer's sequence, prompt included.
        #[arg(long, default_value_t = 1024)]
        seq_len: usize,
        #[arg(long, default_value_t = 128)]
        prompt_len: usize,
        /// Answers per forward/backward.
        #[arg(long, default_value_t = 1)]
        micro_batch: usize,
        /// Recompute layer activations in the backward (less memory, one more forward).
        #[arg(long)]
        checkpoint_layers: bool,
        /// Memory budget of one chunk of logits in the log-prob op, MiB.
        #[arg(long, default_value_t = 64)]
        logprob_chunk_mb: usize,
        /// Use candle's composite ops instead of the fused RMSNorm, rope and attention softmax.
        #[arg(long)]
        composite_ops: bool,
        #[command(flatten)]
        common: Common,
    },
    /// The per-token log-prob op alone: fused and chunked (default) or candle's naive log-softmax.
    Logprob {
        #[arg(long, default_value_t = 8192)]
        tokens: usize,
        #[arg(long, default_value_t = 896)]
        hidden: usize,
        #[arg(long, default_value_t = 151_936)]
        vocab: usize,
        /// Add the off_grpo token loss (ratio, clip, k3 KL) on top.
        #[arg(long)]
        with_loss: bool,
        /// Chunk budget of the fused op, MiB.
        #[arg(long, default_value_t = 64)]
        chunk_mb: usize,
        /// Measure the naive whole-vocabulary log-softmax instead of the fused op.
        #[arg(long)]
        naive: bool,
        #[command(flatten)]
        common: Common,
    },
    /// Greedy generation of exactly --new-tokens per row from random prompts.
    Generate {
        #[arg(long)]
        shape: PathBuf,
        #[arg(long, default_value_t = 1)]
        batch: usize,
        #[arg(long, default_value_t = 128)]
        prompt_len: usize,
        #[arg(long, default_value_t = 256)]
        new_tokens: usize,
        /// Use candle's composite ops instead of the fused RMSNorm, rope and attention softmax.
        #[arg(long)]
        composite_ops: bool,
        #[command(flatten)]
        common: Common,
    },
    /// Picking the next token (temperature, top-k, top-p) from random logits: ours vs the full-sort
    /// reference.
    Sample {
        #[arg(long, default_value_t = 151_936)]
        vocab: usize,
        /// Rows per timed run (one per sequence of a generation batch).
        #[arg(long, default_value_t = 32)]
        rows: usize,
        #[arg(long, default_value_t = 0.6)]
        temperature: f32,
        #[arg(long, default_value_t = 0.95)]
        top_p: f32,
        #[arg(long, default_value_t = 0)]
        top_k: usize,
        #[command(flatten)]
        common: Common,
    },
}

fn timing(c: &Common) -> anyhow::Result<Timing> {
    Ok(Timing {
        device: parse_device(&c.device).with_context(|| format!("--device {}", c.device))?,
        dtype: parse_dtype(&c.dtype).with_context(|| format!("--dtype {}", c.dtype))?,
        warmup: c.warmup,
        repeats: c.repeats.max(1),
    })
}

pub fn run(cmd: BenchCommand) -> anyhow::Result<()> {
    let record = match cmd {
        BenchCommand::TrainStep {
            shape,
            answers,
            seq_len,
            prompt_len,
            micro_batch,
            checkpoint_layers,
            logprob_chunk_mb,
            composite_ops,
            common,
        } => {
            let spec = TrainStepSpec {
                shape,
                answers,
                seq_len,
                prompt_len,
                micro_batch,
                checkpoint_layers,
                logprob_chunk_mb,
                fused_ops: !composite_ops,
            };
            perf::train_step(&spec, &timing(&common)?).context("train-step benchmark")?
        }
        BenchCommand::Logprob { tokens, hidden, vocab, with_loss, chunk_mb, naive, common } => {
            let spec = LogprobSpec { tokens, hidden, vocab, with_loss, chunk_mb: (!naive).then_some(chunk_mb) };
            perf::logprob(&spec, &timing(&common)?).context("logprob benchmark")?
        }
        BenchCommand::Sample { vocab, rows, temperature, top_p, top_k, common } => {
            let params =
                crate::eval::SamplingParams { temperature, top_p, top_k, ..crate::eval::SamplingParams::default() };
            perf::sample(&perf::SampleSpec { vocab, rows, params }, &timing(&common)?).context("sample benchmark")?
        }
        BenchCommand::Generate { shape, batch, prompt_len, new_tokens, composite_ops, common } => {
            let spec = GenerateSpec { shape, batch, prompt_len, new_tokens, fused_ops: !composite_ops };
            perf::generate(&spec, &timing(&common)?).context("generate benchmark")?
        }
    };
    println!("{record}");
    Ok(())
}
