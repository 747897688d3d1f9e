//! The ratio pi_theta / pi_behaviour of a step's tokens, summarised for metrics.jsonl.

use candle_core::Tensor;

/// Sum, minimum and maximum of the per-token ratio exp(log pi_theta - log pi_behaviour).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RatioStats {
    pub sum: f64,
    pub min: f64,
    pub max: f64,
    pub tokens: usize,
}

impl RatioStats {
    /// Add the ratios of `log_ratio` (`[n]`, detached).
    pub(super) fn add(&mut self, log_ratio: &Tensor) -> candle_core::Result<()> {
        let r: Vec<f32> =
            crate::device::to_host(&crate::objective::exp_clamped(log_ratio)?.to_dtype(candle_core::DType::F32)?)?;
        for &x in &r {
            let x = x as f64;
            (self.min, self.max) = if self.tokens == 0 { (x, x) } else { (self.min.min(x), self.max.max(x)) };
            self.sum += x;
            self.tokens += 1;
        }
        Ok(())
    }

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
