//! `grpo bench`: speed and memory measurements of the trainer's hot paths on random weights, one JSON
//! record each, with the same keys as scripts/gpu/torch_ref.py prints for PyTorch, so that
//! scripts/gpu/report.py can put both side by side. One file per benchmark, its tests beside it:
//!
//! - [`train_step`] (train_step.rs): one whole training step (policy forward and backward, reference
//!   forward, AdamW) through the trainer's own code path, and [`predict_train_step`], the performance
//!   model's prediction of it alone;
//! - [`logprob`] (logprob.rs): the fused log-prob op alone (optionally with the off_grpo loss on top),
//!   and candle's naive whole-vocabulary log-softmax for comparison;
//! - [`generate`] (generate.rs): generation on a job of prompts and long-tailed answer lengths under
//!   either schedule (continuous batching or static batches), with the model's decode step beside;
//! - [`gemm`] (gemm.rs): a layer's projection GEMMs (forward, input and weight gradients) at a model
//!   shape;
//! - [`attention`] (attention.rs): forward and backward of one layer's chunked attention against a plain
//!   f32 matmul;
//! - [`optimizer`] (optimizer.rs): the offloaded optimiser's host update, fused against the composite
//!   ops it replaced;
//! - [`sample`] (sample.rs): picking the next token (temperature, top-k, top-p) on the device against the
//!   full-sort reference on the host;
//! - [`pack`] (pack.rs): the padding of padded against packed micro-batches on a long-tailed length mix
//!   (no model).
//!
//! harness.rs holds what they share: [`Timing`], the timed runs, the random model and inputs, the
//! record. Times are medians of the timed repetitions after warm-up, with the device synchronised
//! around each.

mod attention;
mod gemm;
mod generate;
mod harness;
mod logprob;
mod optimizer;
mod pack;
mod sample;
mod train_step;

pub use attention::{attention, AttentionSpec};
pub use gemm::{gemm, GemmSpec};
pub use generate::{generate, GenerateSpec};
pub use harness::{BenchError, Timing};
pub use logprob::{logprob, LogprobSpec};
pub use optimizer::{optimizer, OptimizerSpec};
pub use pack::{pack, PackSpec};
pub use sample::{sample, SampleSpec};
pub use train_step::{predict_train_step, train_step, TrainStepSpec};
