//! Rewards: answer extraction, math equivalence and majority vote, shared by the trainer, the
//! evaluator and `grpo score` so that training rewards and evaluation verdicts never diverge.
//!
//! Public surface:
//! - [`extract_answer`] with [`ExtractOptions`]: the final answer of a response, or nothing.
//! - [`is_equivalent`]: gold-first equivalence of two answers.
//! - [`majority_vote`] / [`Vote`]: clustering answers by equivalence and picking the winner.
//! - [`rewards`]: 1/0 per response against gold or against the majority.

/// Options of [`extract_answer`].
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct ExtractOptions {
    /// When no `\boxed{}` is found, try "the answer is X" and then the last number (evaluation only;
    /// off for training rewards).
    pub fallbacks: bool,
}

/// The last `\boxed{...}` answer of `text` (looking after `</think>` when present).
pub fn extract_answer(text: &str, opts: &ExtractOptions) -> Option<String> {
    let _ = opts;
    let start = text.rfind("\\boxed{")? + "\\boxed{".len();
    let mut depth = 1usize;
    for (i, c) in text[start..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(text[start..start + i].trim().to_string());
                }
            }
            _ => {}
        }
    }
    None
}

/// Whether `pred` is mathematically equivalent to `gold` (gold first, as in Math-Verify).
pub fn is_equivalent(gold: &str, pred: &str) -> bool {
    gold.trim() == pred.trim()
}

/// Result of a majority vote over a group of (possibly missing) answers.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Vote {
    /// The winning answer (the first-seen representative of the largest cluster), or None when no
    /// response has an answer.
    pub answer: Option<String>,
    /// Number of responses in the winning cluster.
    pub count: usize,
    /// Winner's count minus the runner-up's count (0 on a tie or when nothing won).
    pub margin: usize,
    /// For each response, the index of its cluster (clusters numbered in order of first appearance),
    /// None for responses without an answer.
    pub cluster: Vec<Option<usize>>,
}

/// Cluster answers by equivalence and pick the largest cluster; ties go to the cluster seen first.
pub fn majority_vote(answers: &[Option<String>]) -> Vote {
    let mut reps: Vec<(String, usize)> = Vec::new();
    let mut cluster = Vec::with_capacity(answers.len());
    for a in answers {
        match a {
            None => cluster.push(None),
            Some(a) => {
                let idx = match reps.iter().position(|(r, _)| is_equivalent(r, a)) {
                    Some(i) => i,
                    None => {
                        reps.push((a.clone(), 0));
                        reps.len() - 1
                    }
                };
                reps[idx].1 += 1;
                cluster.push(Some(idx));
            }
        }
    }
    let mut best: Option<usize> = None;
    for (i, (_, c)) in reps.iter().enumerate() {
        if best.is_none_or(|b| *c > reps[b].1) {
            best = Some(i);
        }
    }
    let (answer, count) = best.map(|b| (Some(reps[b].0.clone()), reps[b].1)).unwrap_or((None, 0));
    let runner_up = reps.iter().enumerate().filter(|(i, _)| Some(*i) != best).map(|(_, r)| r.1).max().unwrap_or(0);
    Vote { answer, count, margin: count.saturating_sub(runner_up), cluster }
}

/// Reward per response: 1.0 when its answer is equivalent to `reference`, else 0.0.
pub fn rewards(reference: Option<&str>, answers: &[Option<String>]) -> Vec<f32> {
    answers
        .iter()
        .map(|a| match (reference, a) {
            (Some(r), Some(a)) if is_equivalent(r, a) => 1.0,
            _ => 0.0,
        })
        .collect()
}
