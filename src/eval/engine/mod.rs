//! Where the samples of an evaluation come from: grpo's own sampler on the model's weights
//! ([`Native`]) or an OpenAI-compatible server's completions endpoint ([`OpenAi`]: vLLM, SGLang,
//! llama.cpp). Both receive the same prompts, rendered by grpo with the model's chat template, and return
//! the same per-problem samples, which the scorer consumes unchanged.

#[cfg(test)]
pub(crate) mod fake_server;
mod native;
mod openai;
mod options;

pub use native::Native;
pub use openai::OpenAi;
pub use options::{EngineKind, EngineOptions};

use super::generate::{FinishReason, SamplingParams};
use super::EvalError;

/// One problem to sample: its prompt rendered with the chat template, the prompt's token ids, and the
/// index of its first sequence (`problem index * n`), from which each sample's random stream is seeded.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptJob {
    /// The problem's id (named in errors).
    pub id: String,
    pub text: String,
    pub ids: Vec<u32>,
    pub first_sequence: u64,
}

/// One sample of a problem: the generated text (special tokens removed), its length in tokens of the
/// model's tokenizer and why it stopped.
#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    pub text: String,
    pub tokens: usize,
    pub finish: FinishReason,
    /// The server's tokens with their log-probs, when they were asked for and sent (not cut to the
    /// text: an answer cut to max_tokens keeps them all).
    pub logprobs: Option<Vec<ServerToken>>,
}

/// One token of a server's answer as its `logprobs` report it: its text (or `token_id:N`), its id when
/// the server names it so, and its log-prob.
#[derive(Debug, Clone, PartialEq)]
pub struct ServerToken {
    pub text: String,
    pub id: Option<u32>,
    pub logprob: Option<f32>,
}

/// What an engine reports while it works.
pub trait Progress {
    /// `count` more tokens were generated.
    fn tokens(&mut self, count: usize);
    /// All `n` samples of `jobs[job]` are ready. An error stops the engine and is returned by it.
    fn done(&mut self, job: usize, samples: Vec<Completion>) -> Result<(), EvalError>;
}

/// A source of samples.
pub trait Engine {
    /// Draw `n` samples for each job, calling `progress.done` once per job (in any order) as its samples
    /// are ready. Jobs that fail are reported together in the returned error, with their problem ids;
    /// the others have been passed to `progress.done`.
    fn complete(
        &self,
        jobs: &[PromptJob],
        n: usize,
        sampling: &SamplingParams,
        progress: &mut dyn Progress,
    ) -> Result<(), EvalError>;

    /// A short description for logs and reports (`native`, `openai NAME at URL`).
    fn describe(&self) -> String;
}
