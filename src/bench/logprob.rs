//! `grpo bench logprob`: the fused log-prob op alone (optionally with the off_grpo loss on top), and
//! candle's naive whole-vocabulary log-softmax for comparison.

use candle_core::{Tensor, Var};
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

use super::harness::{dtype_name, random_ids, time_median, Result, Timing};
use crate::device::{device_name, memory_bytes, reset_peak_memory};
use crate::kernels::{logprobs_entropy, logprobs_entropy_reference};
use crate::objective::{ObjectiveConfig, ObjectiveKind, PpoOptions, TokenInputs};

/// The log-prob op's settings (`grpo bench logprob`).
#[derive(Debug, Clone, clap::Args)]
pub struct LogprobSpec {
    #[arg(long, default_value_t = 8192)]
    pub tokens: usize,
    #[arg(long, default_value_t = 896)]
    pub hidden: usize,
    #[arg(long, default_value_t = 151_936)]
    pub vocab: usize,
    /// Put the off_grpo token loss (ratio, clip, k3 KL) on top, as the trainer does.
    #[arg(long)]
    pub with_loss: bool,
    /// Chunk budget of the fused op, MiB.
    #[arg(long, default_value_t = 64)]
    pub chunk_mb: usize,
    /// Measure candle's naive whole-vocabulary log-softmax instead of the fused op.
    #[arg(long)]
    pub naive: bool,
}

/// Median times of the forward, and forward + backward, of the per-token log-prob from hidden states and
/// the lm_head, and the peak memory above the inputs.
pub fn logprob(spec: &LogprobSpec, t: &Timing) -> Result<Value> {
    let (dev, n) = (&t.device, spec.tokens);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
    let mut draw = |len: usize, scale: f32| -> Vec<f32> { (0..len).map(|_| rng.gen_range(-scale..scale)).collect() };
    let mut param = |rows: usize, scale: f32| -> Result<Var> {
        let values = Tensor::from_vec(draw(rows * spec.hidden, scale), (rows, spec.hidden), dev)?;
        Ok(Var::from_tensor(&values.to_dtype(t.dtype)?)?)
    };
    let (hidden, weight) = (param(n, 2.0)?, param(spec.vocab, 0.05)?);
    let upstream = Tensor::from_vec(draw(n, 1.0), n, dev)?;
    let ref_logp = Tensor::from_vec(draw(n, 1.0), n, dev)?.affine(1.0, -12.0)?;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(2);
    let targets = Tensor::from_vec(random_ids(&mut rng, n, spec.vocab), n, dev)?;
    let objective =
        ObjectiveConfig::from(ObjectiveKind::OffGrpo(PpoOptions { beta: 0.1, ..PpoOptions::default() })).build();
    let mut inputs = TokenInputs::for_sequences(&[n], &[0.0], &[1.0 / n as f32], dev)?;
    inputs.advantages = upstream.clone();
    inputs.ref_logp = Some(ref_logp);
    let forward = || -> Result<Tensor> {
        let (h, w) = (hidden.as_tensor(), weight.as_tensor());
        let lp = match spec.naive {
            true => logprobs_entropy_reference(h, w, &targets)?,
            false => logprobs_entropy(h, w, &targets, spec.chunk_mb.max(1) << 20)?,
        };
        let logp = lp.narrow(1, 0, 1)?.squeeze(1)?;
        Ok(if spec.with_loss { objective.loss(&logp, &inputs)?.loss } else { (logp * &upstream)?.sum_all()? })
    };
    let fwd = time_median(t, || forward().map(|l| l.detach()))?;
    let before = memory_bytes(dev)?;
    reset_peak_memory(dev)?;
    let fwd_bwd = time_median(t, || Ok(forward()?.backward()?.get(hidden.as_tensor()).is_some()))?;
    let peak = match (before, memory_bytes(dev)?) {
        (Some((used, _)), Some((_, high))) => Some(high.saturating_sub(used)),
        _ => None,
    };
    Ok(json!({
        "bench": "logprob",
        "impl": if spec.naive { "grpo_naive" } else { "grpo_fused" },
        "tokens": n,
        "hidden": spec.hidden,
        "vocab": spec.vocab,
        "dtype": dtype_name(t.dtype),
        "device": device_name(dev),
        "with_loss": spec.with_loss,
        "chunk_mb": (!spec.naive).then_some(spec.chunk_mb),
        "fwd_time_s": fwd,
        "fwd_bwd_time_s": fwd_bwd,
        "peak_mem_bytes": peak,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::harness::fixtures::cpu;

    #[test]
    fn fused_and_naive_logprob_both_run() {
        for naive in [false, true] {
            for with_loss in [false, true] {
                let spec = LogprobSpec { tokens: 6, hidden: 8, vocab: 50, with_loss, chunk_mb: 1, naive };
                let r = logprob(&spec, &cpu()).unwrap();
                assert!(r["fwd_bwd_time_s"].as_f64().unwrap() > 0.0, "{r}");
            }
        }
    }
}
