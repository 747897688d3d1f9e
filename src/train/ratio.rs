//! The ratio pi_theta / pi_behaviour of a step's tokens, summarised for metrics.jsonl.

/// Sum, minimum and maximum of the per-token ratio exp(log pi_theta - log pi_behaviour).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RatioStats {
    pub sum: f64,
    pub min: f64,
    pub max: f64,
    pub tokens: usize,
}

impl RatioStats {
    pub(super) fn merge(&mut self, o: &RatioStats) {
        if o.tokens > 0 {
            (self.min, self.max) =
                if self.tokens == 0 { (o.min, o.max) } else { (self.min.min(o.min), self.max.max(o.max)) };
            self.sum += o.sum;
            self.tokens += o.tokens;
        }
    }

    /// The mean ratio (None without behaviour log-probs).
    pub fn mean(&self) -> Option<f64> {
        (self.tokens > 0).then(|| self.sum / self.tokens as f64)
    }
}
