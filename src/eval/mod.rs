//! Evaluation: batched generation and benchmark scoring.

pub mod generate;

pub use generate::{generate, greedy_reference, FinishReason, Generation, SamplingParams};
