//! Evaluation: the benchmark registry, batched generation with a KV cache, and scoring through the
//! reward module (avg@n, pass@k, maj@n), with one set of options ([`EvalOptions`]) for `grpo eval` and
//! the trainer's `[validation]`.

pub mod benchmarks;
pub mod generate;
mod options;
pub mod run;

pub use generate::{generate, sample_token, sample_token_reference, FinishReason, Generation, SamplingParams};
pub use options::EvalOptions;
pub use run::{evaluate, BenchReport, ProblemResult};

/// Errors of evaluation.
#[derive(Debug, thiserror::Error)]
pub enum EvalError {
    #[error("{0}")]
    Benchmark(String),
    #[error(transparent)]
    Tokenizer(#[from] crate::model::tokenizer::TokenizerError),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[error("{path}: {source}")]
    Io { path: std::path::PathBuf, source: std::io::Error },
}
