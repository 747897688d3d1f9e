//! The batches of the training and scoring forward: token rows (padded or packed) and the targets scored.

use candle_core::{Device, Tensor};

/// A batch of token rows for the training / scoring forward.
///
/// Rows are right-padded; a row may hold several packed sequences. `segments[b][t]` numbers the
/// sequence a token belongs to (1, 2, ...; 0 is padding): attention is causal within a segment only,
/// and position ids restart at 0 for each segment.
#[derive(Debug, Clone)]
pub struct TokenBatch {
    pub tokens: Vec<Vec<u32>>,
    pub positions: Vec<Vec<u32>>,
    pub segments: Vec<Vec<u32>>,
    /// A training batch's seed: LoRA's dropout masks ([`lora`]) are drawn from it in
    /// [`Decoder::forward_backward_into`] (and again, the same, in the layers' recomputation). `None`: no
    /// dropout.
    pub dropout_seed: Option<u64>,
    /// Whether the training loss differentiates the entropy column of the log-probs (an entropy bonus):
    /// `Some(false)` lets the log-prob head's backward skip the entropy's terms without reading the
    /// gradient to find out; `None`: it reads it (a host sync) and decides.
    pub entropy_gradient: Option<bool>,
}

impl TokenBatch {
    /// One sequence per row, right-padded with `pad`.
    pub fn padded(seqs: &[Vec<u32>], pad: u32) -> Self {
        Self::packed(&seqs.iter().map(|s| vec![s.clone()]).collect::<Vec<_>>(), pad)
    }

    /// Several sequences per row (packed), rows right-padded with `pad`.
    pub fn packed(rows: &[Vec<Vec<u32>>], pad: u32) -> Self {
        let width = rows.iter().map(|r| r.iter().map(Vec::len).sum::<usize>()).max().unwrap_or(0);
        let mut b = TokenBatch {
            tokens: vec![],
            positions: vec![],
            segments: vec![],
            dropout_seed: None,
            entropy_gradient: None,
        };
        for row in rows {
            let (mut t, mut p, mut s) =
                (Vec::with_capacity(width), Vec::with_capacity(width), Vec::with_capacity(width));
            for (i, seq) in row.iter().enumerate() {
                t.extend_from_slice(seq);
                p.extend(0..seq.len() as u32);
                s.extend(std::iter::repeat_n(i as u32 + 1, seq.len()));
            }
            t.resize(width, pad);
            p.resize(width, 0);
            s.resize(width, 0);
            b.tokens.push(t);
            b.positions.push(p);
            b.segments.push(s);
        }
        b
    }

    /// The batch with LoRA's dropout masks drawn from `seed` in training.
    pub fn with_dropout_seed(mut self, seed: u64) -> Self {
        self.dropout_seed = Some(seed);
        self
    }

    /// The batch of a training loss that does (`true`) or does not differentiate the entropy.
    pub fn with_entropy_gradient(mut self, entropy: bool) -> Self {
        self.entropy_gradient = Some(entropy);
        self
    }

    pub fn rows(&self) -> usize {
        self.tokens.len()
    }

    pub fn width(&self) -> usize {
        self.tokens.first().map_or(0, Vec::len)
    }

    /// Number of non-padding tokens.
    pub fn num_tokens(&self) -> usize {
        self.segments.iter().flatten().filter(|&&s| s != 0).count()
    }

    /// The keys each query attends to, `[B, T, 2]` u32 of inclusive `(lo, hi)`: causal within its
    /// segment; a padding query sees itself only (its output is never used, but must stay finite).
    pub(super) fn ranges(&self, device: &Device) -> candle_core::Result<Tensor> {
        let (b, t) = (self.rows(), self.width());
        let mut r = Vec::with_capacity(b * t * 2);
        for seg in &self.segments {
            let mut start = 0;
            for i in 0..t {
                if i == 0 || seg[i] != seg[i - 1] {
                    start = i;
                }
                r.extend_from_slice(&[if seg[i] == 0 { i as u32 } else { start as u32 }, i as u32]);
            }
        }
        crate::device::from_host(r, (b, t, 2), device)
    }
}

/// Which next-token log-probs to compute: entry n is the token at `(row, pos)` predicted from the
/// hidden state at `(row, pos - 1)`.
#[derive(Debug, Clone, Default)]
pub struct Targets {
    pub row: Vec<u32>,
    pub pos: Vec<u32>,
}

impl Targets {
    pub fn len(&self) -> usize {
        self.row.len()
    }

    pub fn is_empty(&self) -> bool {
        self.row.is_empty()
    }

    pub fn push(&mut self, row: usize, pos: usize) {
        debug_assert!(pos >= 1, "the first token of a sequence has no log-prob");
        self.row.push(row as u32);
        self.pos.push(pos as u32);
    }
}
