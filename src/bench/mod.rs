//! `grpo bench`: speed and memory measurements of the trainer's hot paths on random weights, one JSON
//! record each, with the same keys as scripts/gpu/torch_ref.py prints for PyTorch, so that
//! scripts/gpu/report.py can put both side by side. One file per benchmark, its tests beside it:
//! [`train_step`] (and [`predict_train_step`], the performance model's prediction alone), [`logprob`],
//! [`generate`], [`gemm`], [`attention`], [`optimizer`], [`sample`] and [`pack`] (no model).
//!
//! harness.rs holds what they share: [`Timing`], the timed runs, the random model and inputs. Times are
//! medians of the timed repetitions after warm-up, with the device synchronised around each.

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
