//! `grpo bench logprob`: the fused log-prob op alone (optionally with the off_grpo loss on top), and
//! candle's naive whole-vocabulary log-softmax for comparison.

use candle_core::{Tensor, Var};
use rand::{Rng, SeedableRng};
use serde_json::Value;

use super::harness::{dtype_name, median, random_ids, time_runs, to_record, Result, Timing};
use crate::device::device_name;
use crate::device::{memory_bytes, reset_peak_memory};
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

/// Forward, and forward + backward, of the per-token log-prob from hidden states and the lm_head.
pub fn logprob(spec: &LogprobSpec, t: &Timing) -> Result<Value> {
    let dev = &t.device;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
    let mut draw = |n: usize, scale: f32| -> Vec<f32> { (0..n).map(|_| rng.gen_range(-scale..scale)).collect() };
    let hidden = Var::from_tensor(
        &Tensor::from_vec(draw(spec.tokens * spec.hidden, 2.0), (spec.tokens, spec.hidden), dev)?.to_dtype(t.dtype)?,
    )?;
    let weight = Var::from_tensor(
        &Tensor::from_vec(draw(spec.vocab * spec.hidden, 0.05), (spec.vocab, spec.hidden), dev)?.to_dtype(t.dtype)?,
    )?;
    let upstream = Tensor::from_vec(draw(spec.tokens, 1.0), spec.tokens, dev)?;
    let ref_logp = Tensor::from_vec(draw(spec.tokens, 1.0), spec.tokens, dev)?.affine(1.0, -12.0)?;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(2);
    let targets = Tensor::from_vec(random_ids(&mut rng, spec.tokens, spec.vocab), spec.tokens, dev)?;
    let objective_cfg =
        ObjectiveConfig::from(ObjectiveKind::OffGrpo(PpoOptions { beta: 0.1, ..PpoOptions::default() }));
    let objective = objective_cfg.build();
    let mut inputs = TokenInputs::for_sequences(&[spec.tokens], &[0.0], &[1.0 / spec.tokens as f32], dev)?;
    inputs.advantages = upstream.clone();
    inputs.ref_logp = Some(ref_logp);
    let forward = || -> Result<Tensor> {
        let lp = if spec.naive {
            logprobs_entropy_reference(hidden.as_tensor(), weight.as_tensor(), &targets)?
        } else {
            logprobs_entropy(hidden.as_tensor(), weight.as_tensor(), &targets, spec.chunk_mb.max(1) << 20)?
        };
        let logp = lp.narrow(1, 0, 1)?.squeeze(1)?;
        Ok(if spec.with_loss { objective.loss(&logp, &inputs)?.loss } else { (logp * &upstream)?.sum_all()? })
    };
    let (fwd, _) = time_runs(t, || forward().map(|l| l.detach()))?;
    let before = memory_bytes(dev)?;
    reset_peak_memory(dev)?;
    let (fwd_bwd, _) = time_runs(t, || {
        let grads = forward()?.backward()?;
        Ok(grads.get(hidden.as_tensor()).is_some())
    })?;
    let peak = match (before, memory_bytes(dev)?) {
        (Some((used, _)), Some((_, high))) => Some(high.saturating_sub(used)),
        _ => None,
    };
    to_record(LogprobRecord {
        bench: "logprob",
        implementation: if spec.naive { "grpo_naive" } else { "grpo_fused" },
        tokens: spec.tokens,
        hidden: spec.hidden,
        vocab: spec.vocab,
        dtype: dtype_name(t.dtype),
        device: device_name(dev),
        with_loss: spec.with_loss,
        chunk_mb: (!spec.naive).then_some(spec.chunk_mb),
        fwd_time_s: median(&fwd),
        fwd_bwd_time_s: median(&fwd_bwd),
        peak_mem_bytes: peak,
    })
}

/// `grpo bench logprob`'s record: the forward's and the forward + backward's median times, and the peak
/// memory above the inputs.
#[derive(Debug, serde::Serialize)]
struct LogprobRecord {
    bench: &'static str,
    #[serde(rename = "impl")]
    implementation: &'static str,
    tokens: usize,
    hidden: usize,
    vocab: usize,
    dtype: &'static str,
    device: String,
    with_loss: bool,
    chunk_mb: Option<usize>,
    fwd_time_s: f64,
    fwd_bwd_time_s: f64,
    peak_mem_bytes: Option<u64>,
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
