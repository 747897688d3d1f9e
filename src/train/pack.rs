//! How a step's answers are grouped into micro-batches (one forward/backward each).
//!
//! By default (`train.micro_batch_tokens = 0`) a micro-batch is `train.micro_batch_size` answers in batch
//! order, one per row, every row padded to the longest: on a long-tailed length mix most of its tokens can
//! be padding. With a token budget (`train.micro_batch_tokens = N`, verl's dynamic batch size, NeMo-RL's
//! sequence packing) the answers (prompt + response) are packed first-fit-decreasing into rows of at most
//! N tokens, and each row is one micro-batch: attention is causal within each answer (the decoder's
//! segments, [`crate::model::TokenBatch::packed`]), positions restart at each answer, and no token is
//! padding. An answer longer than N goes alone in a row of its own length (the budget is a target, not a
//! bound: no answer is ever cut or refused).
//!
//! The grouping never changes the step's loss or gradient: the loss is a weighted sum over tokens whose
//! weights are computed from the whole batch, and sequence-level terms see whole answers (see
//! [`crate::objective`]).

use serde::Serialize;

/// How a step's answers are grouped into micro-batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Batching {
    /// This many answers per micro-batch in batch order, one per row, each row padded to the longest.
    Answers(usize),
    /// Answers packed first-fit-decreasing into rows of at most this many tokens, one row per micro-batch.
    Tokens(usize),
}

/// A micro-batch: its rows, each the indices (into the step's answers) of the answers it holds, in order.
pub type MicroBatch = Vec<Vec<usize>>;

impl Batching {
    /// `train.micro_batch_tokens` when set (> 0), else `train.micro_batch_size` answers.
    pub fn of(micro_batch_size: usize, micro_batch_tokens: usize) -> Self {
        match micro_batch_tokens {
            0 => Batching::Answers(micro_batch_size.max(1)),
            n => Batching::Tokens(n),
        }
    }

    /// The micro-batches of answers of `lengths` tokens (prompt + response), in the order they run.
    pub fn micro_batches(self, lengths: &[usize]) -> Vec<MicroBatch> {
        match self {
            Batching::Answers(n) => {
                let idx: Vec<usize> = (0..lengths.len()).collect();
                idx.chunks(n.max(1)).map(|c| c.iter().map(|&i| vec![i]).collect()).collect()
            }
            Batching::Tokens(budget) => {
                first_fit_decreasing(lengths, budget).into_iter().map(|row| vec![row]).collect()
            }
        }
    }
}

impl std::fmt::Display for Batching {
    /// The setting that chooses it.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Batching::Answers(n) => write!(f, "micro_batch_size = {n}"),
            Batching::Tokens(n) => write!(f, "micro_batch_tokens = {n}"),
        }
    }
}

/// Rows of at most `budget` tokens holding every answer of `lengths` once: answers taken longest first
/// (ties in batch order), each into the first row it fits in, else a new row; an answer longer than the
/// budget gets a row of its own. Each row lists its answers in batch order. Deterministic.
pub fn first_fit_decreasing(lengths: &[usize], budget: usize) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..lengths.len()).collect();
    order.sort_by(|&a, &b| lengths[b].cmp(&lengths[a]).then(a.cmp(&b)));
    let mut rows: Vec<(usize, Vec<usize>)> = Vec::new();
    for i in order {
        let len = lengths[i];
        match rows.iter_mut().find(|(used, _)| used + len <= budget) {
            Some((used, row)) => {
                *used += len;
                row.push(i);
            }
            None => rows.push((len, vec![i])),
        }
    }
    rows.into_iter()
        .map(|(_, mut row)| {
            row.sort_unstable();
            row
        })
        .collect()
}

/// The tokens a grouping of answers computes on, padding included.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Padding {
    pub micro_batches: usize,
    pub rows: usize,
    /// Prompt + response tokens of the answers.
    pub tokens: usize,
    /// Row slots computed on: each micro-batch's rows times its widest row.
    pub slots: usize,
    /// The largest micro-batch's slots (its activations' size).
    pub max_slots: usize,
}

impl Padding {
    /// The padding of `batches` over answers of `lengths` tokens.
    pub fn of(batches: &[MicroBatch], lengths: &[usize]) -> Self {
        let mut p = Padding { micro_batches: batches.len(), ..Default::default() };
        for mb in batches {
            let widths: Vec<usize> = mb.iter().map(|row| row.iter().map(|&i| lengths[i]).sum()).collect();
            let slots = mb.len() * widths.iter().copied().max().unwrap_or(0);
            p.rows += mb.len();
            p.tokens += widths.iter().sum::<usize>();
            p.slots += slots;
            p.max_slots = p.max_slots.max(slots);
        }
        p
    }

    /// The fraction of the slots that are padding.
    pub fn fraction(&self) -> f64 {
        if self.slots == 0 {
            0.0
        } else {
            (self.slots - self.tokens) as f64 / self.slots as f64
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_fit_decreasing_fills_rows_up_to_the_budget_and_gives_a_long_answer_its_own_row() {
        let lengths = [3, 9, 4, 12, 2, 5, 6];
        let rows = first_fit_decreasing(&lengths, 10);
        // Longest first: 12 alone (over the budget), 9 alone (nothing left fits beside it), 6+4, 5+3+2.
        assert_eq!(rows, vec![vec![3], vec![1], vec![2, 6], vec![0, 4, 5]]);
        let mut seen: Vec<usize> = rows.iter().flatten().copied().collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..lengths.len()).collect::<Vec<_>>());
        for row in &rows {
            let t: usize = row.iter().map(|&i| lengths[i]).sum();
            assert!(t <= 10 || row.len() == 1, "{row:?} holds {t} tokens");
        }
        assert_eq!(first_fit_decreasing(&[], 10), Vec::<Vec<usize>>::new());
    }

    #[test]
    fn padded_micro_batches_pad_to_the_longest_and_packed_ones_not_at_all() {
        let lengths = [10, 2, 6, 6, 1];
        let padded = Batching::of(2, 0).micro_batches(&lengths);
        assert_eq!(padded, vec![vec![vec![0], vec![1]], vec![vec![2], vec![3]], vec![vec![4]]]);
        let p = Padding::of(&padded, &lengths);
        assert_eq!((p.micro_batches, p.rows, p.tokens, p.slots, p.max_slots), (3, 5, 25, 20 + 12 + 1, 20));
        assert!((p.fraction() - 8.0 / 33.0).abs() < 1e-12);
        let packed = Batching::of(2, 12).micro_batches(&lengths);
        assert_eq!(packed, vec![vec![vec![0, 1]], vec![vec![2, 3]], vec![vec![4]]]);
        let q = Padding::of(&packed, &lengths);
        assert_eq!((q.micro_batches, q.rows, q.tokens, q.slots, q.max_slots), (3, 3, 25, 25, 12));
        assert_eq!(q.fraction(), 0.0);
        assert_eq!(Batching::of(0, 0), Batching::Answers(1));
    }
}
