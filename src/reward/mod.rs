//! Rewards: answer extraction, math equivalence and majority vote, shared by the trainer, the
//! evaluator and `grpo score` so that training rewards and evaluation verdicts never diverge.
//!
//! Public surface:
//! - [`extract_answer`] with [`ExtractOptions`]: the final answer of a response, or nothing.
//! - [`is_equivalent`]: gold-first equivalence of two answers (Math-Verify semantics).
//! - [`majority_vote`] / [`Vote`]: clustering answers by equivalence and picking the winner.
//! - [`rewards`]: 1/0 per response against gold or against the majority.
//! - [`judge`] / [`Verdicts`]: the answers of a group of responses and their verdicts against the gold
//!   answer or, without one, the majority (evaluation, validation and `grpo score`).
//! - [`pass_at_k`], [`summarize`] / [`Summary`] / [`ItemOutcome`]: avg@n, pass@k and maj@n.
//!
//! Every function ends in bounded time on any input: brace matching is iterative, regexes are
//! linear, the parser has length and depth limits and exact arithmetic has size limits.

mod equiv;
mod eval;
mod extract;
mod metrics;
mod parse;
mod verdict;
mod vote;

use equiv::{equivalent_parsed, ParsedAnswer};
pub use extract::{extract_answer, ExtractOptions};
pub use metrics::{pass_at_k, summarize, ItemOutcome, Summary};
pub use verdict::{judge, Verdicts};
pub use vote::{majority_vote, rewards, Vote};

/// Whether `pred` is mathematically equivalent to `gold` (gold first, as in Math-Verify).
pub fn is_equivalent(gold: &str, pred: &str) -> bool {
    equivalent_parsed(&ParsedAnswer::new(gold), &ParsedAnswer::new(pred))
}
