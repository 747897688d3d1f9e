//! Rewards: answer extraction, math equivalence and majority vote, shared by the trainer, the
//! evaluator and `grpo score` so that training rewards and evaluation verdicts never diverge.
//!
//! Public surface:
//! - [`extract_answer`] with [`ExtractOptions`]: the final answer of a response, or nothing.
//! - [`equivalence`] / [`Equivalence`]: gold-first equivalence of two answers (Math-Verify semantics),
//!   three-way: equal, not equal, or unknown (exact arithmetic past its size limits);
//!   [`is_equivalent`]: whether it is equal.
//! - [`majority_vote`] / [`Vote`]: clustering answers by equivalence and picking the winner, in a
//!   near-linear number of comparisons (answers are only compared within their fingerprint buckets).
//! - [`rewards`]: 1/0 per response against gold or against the majority (unknown earns 0).
//! - [`judge`] / [`Verdicts`]: the answers of a group of responses and their verdicts (correct, or
//!   unknown) against the gold answer or, without one, the majority (evaluation, validation and
//!   `grpo score`).
//! - [`pass_at_k`], [`summarize`] / [`Summary`] / [`ItemOutcome`]: avg@n, pass@k and maj@n.
//!
//! Every function ends in bounded time on any input: brace matching is iterative, regexes are
//! linear, the parser has length and depth limits and exact arithmetic has size limits.

mod equiv;
mod eval;
mod extract;
mod fingerprint;
mod metrics;
mod parse;
mod verdict;
mod vote;

pub use equiv::Equivalence;
use equiv::{equivalent_parsed, ParsedAnswer};
pub use extract::{extract_answer, ExtractOptions};
pub use metrics::{pass_at_k, summarize, ItemOutcome, Summary};
pub use verdict::{judge, Verdicts};
pub use vote::{majority_vote, rewards, Vote};

/// Whether `pred` is mathematically equivalent to `gold` (gold first, as in Math-Verify): equal, not
/// equal, or unknown (see [`Equivalence`]).
pub fn equivalence(gold: &str, pred: &str) -> Equivalence {
    equivalent_parsed(&ParsedAnswer::new(gold), &ParsedAnswer::new(pred))
}

/// Whether `pred` is known to be mathematically equivalent to `gold` ([`equivalence`] is Equal).
pub fn is_equivalent(gold: &str, pred: &str) -> bool {
    equivalence(gold, pred) == Equivalence::Equal
}
