//! Evaluation: the benchmark registry, the engines that draw samples (batched generation with a KV
//! cache, or an OpenAI-compatible server), and scoring through the reward module (avg@n, pass@k,
//! maj@n), with one set of options ([`EvalOptions`]) for `grpo eval` and the trainer's `[validation]`.

pub mod benchmarks;
pub mod engine;
mod options;
pub mod run;

/// Generation lives in [`crate::generate`]; `eval::generate` names it for the engines and callers here.
pub use crate::generate;

pub use engine::{Engine, EngineKind, EngineOptions};
pub use generate::sample_rows;
pub use generate::{generate, sample_token_reference, FinishReason, Generation, SamplingParams};
pub use options::EvalOptions;
pub use run::{
    evaluate, evaluate_share, evaluate_with, merge_shares, BenchReport, EvalProgress, ProblemResult, Share,
    ShareResults,
};

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
    #[error("{0}")]
    Engine(String),
    #[error(
        "{failed} problem{s} failed{unsent_note}; the finished ones are kept: rerun with --resume to send only the \
         others:\n{details}",
        s = if *failed == 1 { "" } else { "s" },
        unsent_note = if *unsent > 0 { format!(" and {unsent} were not sent") } else { String::new() }
    )]
    Requests { failed: usize, unsent: usize, details: String },
}
