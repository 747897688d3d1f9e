//! Per-token log-probs and entropy from final hidden states and the lm_head weight, computed chunk by
//! chunk so that the `[tokens x vocab]` logits are never held whole, with a backward that recomputes
//! each chunk's logits instead of keeping them (or, with [`HeadBackward::keep_logits`], reads the chunks
//! the forward kept), and adds each chunk's weight gradient into an f32 accumulator by one GEMM
//! ([`super::wgrad_accumulate`]: its own, or the caller's, [`HeadBackward::accumulator`]).
//!
//! For rows `h_n` (hidden states), weight `W` (`[vocab, hidden]`) and targets `t_n`:
//!   z_n = W h_n,  lse_n = log sum_v exp z_nv,  logp_n = z_{n,t_n} - lse_n,  H_n = lse_n - sum_v p_nv z_nv
//! and for upstream gradients g_n on logp_n and e_n on H_n (d H / d z = -p (log p + H)):
//!   dz_n = g_n (onehot(t_n) - p_n) - e_n p_n (log p_n + H_n),  dh_n = W^T dz_n,  dW = sum_n dz_n h_n^T.
//! When no row has an entropy gradient the entropy term is left out of the kernel's work.

use candle_core::{CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor, D};

use super::rows::{row_grad, row_stats};
use crate::device::CUDA_MAX_ELEMENTS;

/// Default memory budget for one chunk of logits, counted as f32 (`rows = budget / (4 vocab)`).
pub const LOGPROB_CHUNK_BYTES: usize = 64 << 20;

/// Bytes of one chunk of logits (counted as f32) when the configuration leaves it to the device: on a
/// GPU an eighth of its free memory, between 1 and 8 GiB (a few large launches per micro-batch instead
/// of thousands of small ones, [`gpu_chunk_bytes`]); on the CPU [`LOGPROB_CHUNK_BYTES`] (64 MiB), which
/// keeps a chunk near the caches.
pub fn logprob_chunk_bytes(device: &candle_core::Device) -> Result<usize> {
    Ok(crate::device::free_gpu_memory(device)?.map_or(LOGPROB_CHUNK_BYTES, gpu_chunk_bytes))
}

/// The GPU's chunk for `free` bytes of free memory: `free / 8` within 1..=8 GiB (also what the memory
/// plan counts for a GPU run that leaves the chunk to the device).
pub fn gpu_chunk_bytes(free: u64) -> usize {
    (free / 8).clamp(1 << 30, 8 << 30) as usize
}

/// Rows of one chunk: as many as `budget_bytes` of f32 logits hold, at most 65,536, and never more than
/// candle's CUDA kernels can index in one tensor ([`CUDA_MAX_ELEMENTS`]: a budget past 16 GiB would
/// otherwise make chunks of more than 2^32 logits, which they would silently cover only in part).
fn chunk_rows(vocab: usize, budget_bytes: usize) -> usize {
    let vocab = vocab.max(1);
    (budget_bytes / (vocab * 4)).min(CUDA_MAX_ELEMENTS / vocab).clamp(1, 1 << 16)
}

/// Row ranges `(start, len)` of the chunks of `n` rows.
fn chunks(n: usize, vocab: usize, budget: usize) -> impl Iterator<Item = (usize, usize)> {
    let rows = chunk_rows(vocab, budget);
    (0..n).step_by(rows).map(move |s| (s, rows.min(n - s)))
}

/// The values of the op, computed without a graph: `[n, 3]` f32 of `(log p, entropy, lse)`, and with
/// `keep` each chunk's logits (in the weight's dtype) for the backward; without it each chunk's logits are
/// the only `[rows, vocab]` buffer.
fn forward_values(
    hidden: &Tensor,
    weight: &Tensor,
    targets: &Tensor,
    budget: usize,
    keep: bool,
) -> Result<(Tensor, Vec<Tensor>)> {
    let (n, _) = hidden.dims2()?;
    let (vocab, _) = weight.dims2()?;
    let (hidden, weight, targets) = (hidden.detach(), weight.detach(), targets.detach());
    let wt = weight.t()?;
    let mut kept = Vec::new();
    let mut out = Vec::new();
    for (s, len) in chunks(n, vocab, budget) {
        let logits = hidden.narrow(0, s, len)?.matmul(&wt)?;
        out.push(row_stats(&logits, &targets.narrow(0, s, len)?)?);
        if keep {
            kept.push(logits);
        }
    }
    if out.is_empty() {
        return Ok((Tensor::zeros((0, 3), DType::F32, hidden.device())?, kept));
    }
    Ok((Tensor::cat(&out, 0)?.contiguous()?, kept))
}

/// The op in the graph: recorded with its values (`record_op3`), its backward its own.
struct LogprobEntropy {
    /// `[n]`: each row's log-sum-exp, kept for the backward.
    lse: Tensor,
    budget: usize,
    /// The weight's f32 gradient accumulator, into which each chunk's `dz^T h` is added by one GEMM
    /// ([`super::wgrad_accumulate`]); the weight, then recorded detached, gets no gradient in the store.
    accumulator: Option<Tensor>,
    /// Each chunk's logits from the forward (`HeadBackward::keep_logits`); empty: recomputed.
    kept: Vec<Tensor>,
    /// [`HeadBackward::entropy_gradient`].
    entropy_gradient: Option<bool>,
}

impl CustomOp3 for LogprobEntropy {
    fn name(&self) -> &'static str {
        "logprob-entropy"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        super::cpu::recorded(self.name())
    }

    fn bwd(
        &self,
        hidden: &Tensor,
        weight: &Tensor,
        targets: &Tensor,
        res: &Tensor,
        grad_res: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        // A frozen weight (LoRA's lm_head) gets no gradient: its `[vocab, hidden]` product is skipped.
        let weight_grad = weight.track_op();
        let (hidden, weight, targets) = (hidden.detach(), weight.detach(), targets.detach());
        let grad = grad_res.detach().to_dtype(DType::F32)?;
        let entropy_grad = grad.narrow(1, 1, 1)?.squeeze(1)?;
        let has_entropy_grad = match self.entropy_gradient {
            Some(told) => {
                // The tests hold the caller to its word (a read the step's count of syncs leaves out).
                #[cfg(test)]
                if !told {
                    assert_eq!(entropy_grad.abs()?.sum_all()?.to_scalar::<f32>()?, 0.0, "an entropy gradient");
                }
                told
            }
            None => crate::device::to_host_scalar::<f32>(&entropy_grad.abs()?.sum_all()?)? != 0.0,
        };
        // (lse, g) per row, plus (H, e) with an entropy gradient: all the backward needs besides the
        // recomputed logits.
        let mut coef = vec![self.lse.clone(), grad.narrow(1, 0, 1)?.squeeze(1)?];
        if has_entropy_grad {
            coef.extend([res.detach().narrow(1, 1, 1)?.squeeze(1)?, entropy_grad]);
        }
        let coef = Tensor::stack(&coef, 1)?;
        let (n, _) = hidden.dims2()?;
        let (vocab, _) = weight.dims2()?;
        let wt = weight.t()?;
        let mut grad_h = Vec::with_capacity(n.div_ceil(chunk_rows(vocab, self.budget)));
        // The weight's f32 gradient: the caller's accumulator, or one of the op's own (cast to the weight's
        // dtype at the end); each chunk's `dz^T h` added into it by one GEMM, never rounded on the way.
        let acc = match (&self.accumulator, weight_grad) {
            (Some(acc), _) => Some(acc.clone()),
            (None, true) => Some(Tensor::zeros(weight.shape(), DType::F32, weight.device())?),
            (None, false) => None,
        };
        for (i, (s, len)) in chunks(n, vocab, self.budget).enumerate() {
            let h = hidden.narrow(0, s, len)?;
            let logits = match self.kept.get(i) {
                Some(kept) => kept.clone(),
                None => h.matmul(&wt)?,
            };
            let dz = row_grad(&logits, &targets.narrow(0, s, len)?, &coef.narrow(0, s, len)?)?;
            grad_h.push(dz.matmul(&weight)?);
            if let Some(acc) = &acc {
                super::wgrad_accumulate(acc, &dz, &h)?;
            }
        }
        let grad_h = if grad_h.is_empty() { hidden.zeros_like()? } else { Tensor::cat(&grad_h, 0)? };
        let grad_w = match (&self.accumulator, acc) {
            (None, Some(acc)) => Some(acc.to_dtype(weight.dtype())?),
            _ => None,
        };
        Ok((Some(grad_h), grad_w, None))
    }
}

/// Per-token `[log p(target), entropy]` (`[n, 2]`, f32) of `hidden` (`[n, hidden]`) under
/// `weight` (`[vocab, hidden]`), chunked to `budget_bytes` of logits at a time, forward and backward
/// (both columns differentiable).
pub fn logprobs_entropy(hidden: &Tensor, weight: &Tensor, targets: &Tensor, budget_bytes: usize) -> Result<Tensor> {
    logprobs_entropy_with(hidden, weight, targets, budget_bytes, HeadBackward::default())
}

/// What the log-prob op's backward does beyond the gradient of `hidden`.
#[derive(Debug, Clone, Copy, Default)]
pub struct HeadBackward<'a> {
    /// The weight's f32 gradient accumulator (`[vocab, hidden]`): each chunk's gradient added into it in
    /// place instead of handed to candle's gradient store (where `hidden` leads to a variable).
    pub accumulator: Option<&'a Tensor>,
    /// Keep every chunk's logits from the forward (`n x vocab` in the weight's dtype, alive until the
    /// backward) instead of recomputing them there: one `[rows, hidden] x [hidden, vocab]` GEMM less a
    /// chunk.
    pub keep_logits: bool,
    /// Whether the loss differentiates the entropy column: `Some(false)` skips the entropy's terms in the
    /// backward (its gradient must then be zero); `None` reads the gradient to decide (a host sync).
    pub entropy_gradient: Option<bool>,
}

/// [`logprobs_entropy`] with its backward as `backward` says.
pub fn logprobs_entropy_with(
    hidden: &Tensor,
    weight: &Tensor,
    targets: &Tensor,
    budget: usize,
    backward: HeadBackward,
) -> Result<Tensor> {
    let accumulate = backward.accumulator.filter(|_| hidden.track_op());
    let weight = if accumulate.is_some() { weight.detach() } else { weight.clone() };
    let graph = hidden.track_op() || weight.track_op();
    let (stats, kept) = forward_values(hidden, &weight, targets, budget, graph && backward.keep_logits)?;
    let values = stats.narrow(1, 0, 2)?;
    if !graph {
        return Ok(values);
    }
    let lse = stats.narrow(1, 2, 1)?.squeeze(1)?.contiguous()?;
    let op = LogprobEntropy {
        lse,
        budget,
        accumulator: accumulate.cloned(),
        kept,
        entropy_gradient: backward.entropy_gradient,
    };
    hidden.record_op3(&weight, targets, &values, op)
}

/// The same quantities from the whole `[n, vocab]` log-softmax with candle's own autograd: the reference
/// the fused op is tested against (and the naive baseline of the benchmarks).
pub fn logprobs_entropy_reference(hidden: &Tensor, weight: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let logits = hidden.matmul(&weight.t()?)?.to_dtype(DType::F32)?;
    let logp_all = candle_nn::ops::log_softmax(&logits, D::Minus1)?;
    let logp = logp_all.gather(&targets.unsqueeze(1)?, 1)?.squeeze(1)?;
    let entropy = (logp_all.exp()? * &logp_all)?.sum(D::Minus1)?.neg()?;
    Tensor::stack(&[logp, entropy], 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    fn setup(n: usize, h: usize, v: usize) -> (Var, Var, Tensor, Tensor) {
        use rand::{Rng, SeedableRng};
        let dev = Device::Cpu;
        // Seeded values (candle's randn is not seeded): deterministic tests.
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64((n * 131 + h * 7 + v) as u64);
        let mut draw =
            |count: usize, scale: f32| -> Vec<f32> { (0..count).map(|_| rng.gen_range(-scale..scale)).collect() };
        let hidden = Var::from_vec(draw(n * h, 1.7), (n, h), &dev).unwrap();
        let weight = Var::from_vec(draw(v * h, 0.9), (v, h), &dev).unwrap();
        let upstream = Tensor::from_vec(draw(n, 1.7), n, &dev).unwrap();
        let targets =
            Tensor::from_vec((0..n as u32).map(|i| (i * 7 + 3) % v as u32).collect::<Vec<_>>(), n, &dev).unwrap();
        (hidden, weight, targets, upstream)
    }

    /// A frozen weight (LoRA's lm_head) gets no gradient, and the hidden states the same one as with a
    /// trainable weight.
    #[test]
    fn a_frozen_weight_gets_no_gradient() {
        let (hidden, weight, targets, upstream) = setup(9, 8, 40);
        let frozen = weight.as_detached_tensor();
        let loss = |w: &Tensor| {
            let lp = logprobs_entropy(hidden.as_tensor(), w, &targets, 4 * 40 * 4).unwrap();
            lp.narrow(1, 0, 1).unwrap().squeeze(1).unwrap().mul(&upstream).unwrap().sum_all().unwrap()
        };
        let (with, without) = (loss(weight.as_tensor()).backward().unwrap(), loss(&frozen).backward().unwrap());
        assert!(with.get(weight.as_tensor()).is_some());
        assert!(without.get(&frozen).is_none());
        let dh = |g: &candle_core::backprop::GradStore| -> Vec<f32> {
            g.get(hidden.as_tensor()).unwrap().flatten_all().unwrap().to_vec1().unwrap()
        };
        assert_eq!(dh(&with), dh(&without));
    }

    /// Kept logits and an accumulator change where the backward's inputs come from, not what it computes:
    /// the hidden states' gradient equal bit for bit across chunkings (1 row, 8 rows, all), the weight's
    /// equal to the store's when kept, and added into the accumulator (twice: in place) otherwise the same.
    #[test]
    fn kept_logits_and_an_accumulator_give_the_same_gradients() {
        let (hidden, weight, targets, up) = setup(37, 16, 50);
        let run = |budget: usize, backward: HeadBackward| {
            let lp = logprobs_entropy_with(hidden.as_tensor(), weight.as_tensor(), &targets, budget, backward).unwrap();
            let both =
                (lp.narrow(1, 0, 1).unwrap().squeeze(1).unwrap() + lp.narrow(1, 1, 1).unwrap().squeeze(1)).unwrap();
            both.mul(&up).unwrap().sum_all().unwrap().backward().unwrap()
        };
        let values = |t: &Tensor| -> Vec<f32> { t.flatten_all().unwrap().to_vec1().unwrap() };
        for budget in [4 * 50, 8 * 50 * 4, 1 << 30] {
            let plain = run(budget, HeadBackward::default());
            let (dh, dw) = (values(plain.get(&hidden).unwrap()), values(plain.get(&weight).unwrap()));
            let kept = run(budget, HeadBackward { keep_logits: true, ..Default::default() });
            assert_eq!(values(kept.get(&hidden).unwrap()), dh, "budget {budget}");
            assert_eq!(values(kept.get(&weight).unwrap()), dw, "budget {budget}");
            let acc = Tensor::zeros((50, 16), DType::F32, &Device::Cpu).unwrap();
            for times in [1.0f32, 2.0] {
                let into =
                    run(budget, HeadBackward { accumulator: Some(&acc), keep_logits: true, ..Default::default() });
                assert!(into.get(&weight).is_none());
                assert_eq!(values(into.get(&hidden).unwrap()), dh, "budget {budget}");
                let want: Vec<f32> = dw.iter().map(|w| w * times).collect();
                let err = super::super::testing::abs_diff(&values(&acc), &want);
                assert!(err < 1e-5, "budget {budget}, {times} backward(s): {err}");
            }
        }
    }

    /// A loss told to have no entropy gradient (`entropy_gradient: Some(false)`) gets the gradients the
    /// head finds by reading the gradient; one told it has one (`Some(true)`), those of an entropy bonus.
    #[test]
    fn a_told_entropy_gradient_gives_the_gradients_of_a_read_one() {
        let (hidden, weight, targets, up) = setup(9, 16, 50);
        let run = |entropy: f64, told: Option<bool>| -> (Vec<f32>, Vec<f32>) {
            let backward = HeadBackward { entropy_gradient: told, ..Default::default() };
            let lp =
                logprobs_entropy_with(hidden.as_tensor(), weight.as_tensor(), &targets, 1 << 30, backward).unwrap();
            let h = (lp.narrow(1, 1, 1).unwrap().squeeze(1).unwrap() * entropy).unwrap();
            let loss = (lp.narrow(1, 0, 1).unwrap().squeeze(1).unwrap() + h).unwrap();
            let g = loss.mul(&up).unwrap().sum_all().unwrap().backward().unwrap();
            let v = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            (v(g.get(&hidden).unwrap()), v(g.get(&weight).unwrap()))
        };
        assert_eq!(run(0.0, Some(false)), run(0.0, None));
        assert_eq!(run(0.5, Some(true)), run(0.5, None));
        assert_ne!(run(0.5, Some(true)), run(0.0, None));
    }

    use super::super::testing::max_abs_diff as max_diff;

    #[test]
    fn matches_reference_forward_and_backward_across_chunkings() {
        let (hidden, weight, targets, up) = setup(37, 16, 50);
        let reference = logprobs_entropy_reference(&hidden, &weight, &targets).unwrap();
        let loss_ref = reference.narrow(1, 0, 1).unwrap().squeeze(1).unwrap().mul(&up).unwrap().sum_all().unwrap();
        let g_ref = loss_ref.backward().unwrap();
        // Budgets of 1 row, 8 rows and everything at once.
        for budget in [1usize, 8 * 50 * 4, 1 << 30] {
            let fused = logprobs_entropy(&hidden, &weight, &targets, budget).unwrap();
            assert!(max_diff(&fused, &reference) < 1e-5, "forward differs at budget {budget}");
            let loss = fused.narrow(1, 0, 1).unwrap().squeeze(1).unwrap().mul(&up).unwrap().sum_all().unwrap();
            let g = loss.backward().unwrap();
            for var in [&hidden, &weight] {
                let a = g.get(var.as_tensor()).unwrap();
                let b = g_ref.get(var.as_tensor()).unwrap();
                assert!(max_diff(a, b) < 1e-5, "gradient differs at budget {budget}");
            }
        }
    }

    #[test]
    fn finite_differences_agree_with_backward() {
        let (hidden, weight, targets, up) = setup(5, 4, 11);
        let f = |h: &Tensor, w: &Tensor| -> f64 {
            let lp = logprobs_entropy(h, w, &targets, 16).unwrap();
            lp.narrow(1, 0, 1)
                .unwrap()
                .squeeze(1)
                .unwrap()
                .mul(&up)
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap() as f64
        };
        let lp = logprobs_entropy(&hidden, &weight, &targets, 16).unwrap();
        let loss = lp.narrow(1, 0, 1).unwrap().squeeze(1).unwrap().mul(&up).unwrap().sum_all().unwrap();
        let grads = loss.backward().unwrap();
        let gw = grads.get(weight.as_tensor()).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let w0 = weight.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let eps = 1e-2f32;
        for idx in [0usize, 7, 19, 43] {
            let mut plus = w0.clone();
            plus[idx] += eps;
            let mut minus = w0.clone();
            minus[idx] -= eps;
            let wp = Tensor::from_vec(plus, (11, 4), &Device::Cpu).unwrap();
            let wm = Tensor::from_vec(minus, (11, 4), &Device::Cpu).unwrap();
            let fd = (f(hidden.as_tensor(), &wp) - f(hidden.as_tensor(), &wm)) / (2.0 * eps as f64);
            assert!((fd - gw[idx] as f64).abs() < 2e-3, "d/dw[{idx}]: fd {fd} vs autograd {}", gw[idx]);
        }
    }

    #[test]
    fn logprob_chunks_are_device_sized() {
        assert_eq!(logprob_chunk_bytes(&Device::Cpu).unwrap(), 64 << 20);
        assert_eq!(gpu_chunk_bytes(2 << 30), 1 << 30);
        assert_eq!(gpu_chunk_bytes(40 << 30), 5 << 30);
        assert_eq!(gpu_chunk_bytes(140 << 30), 8 << 30);
    }

    #[test]
    fn chunks_stay_within_the_cuda_element_limit() {
        assert_eq!(chunk_rows(151_936, LOGPROB_CHUNK_BYTES), 110);
        // 64 GiB of logits asked for: 65,536 rows of 151,936 would be 9.96e9 logits.
        let rows = chunk_rows(151_936, 64 << 30);
        assert!(rows * 151_936 <= CUDA_MAX_ELEMENTS && (rows + 1) * 151_936 > CUDA_MAX_ELEMENTS, "{rows}");
        let covered: usize = chunks(70_000, 151_936, usize::MAX)
            .map(|(s, len)| {
                assert!(len * 151_936 <= CUDA_MAX_ELEMENTS);
                s + len
            })
            .max()
            .unwrap();
        assert_eq!(covered, 70_000);
        // A vocabulary past the limit still gets one row at a time.
        assert_eq!(chunk_rows(CUDA_MAX_ELEMENTS + 1, 1 << 20), 1);
    }

    /// `sum_n g_n log p_n + e_n H_n` of the op's output, `e` the entropy's upstream gradient.
    fn both_columns(out: &Tensor, up: &Tensor, e: &Tensor) -> Tensor {
        let col = |i| out.narrow(1, i, 1).unwrap().squeeze(1).unwrap();
        (col(0).mul(up).unwrap().sum_all().unwrap() + col(1).mul(e).unwrap().sum_all().unwrap()).unwrap()
    }

    #[test]
    fn the_entropy_gradient_matches_the_reference_across_chunkings() {
        let (hidden, weight, targets, up) = setup(23, 8, 40);
        let e = (up.sin().unwrap() * 1.3).unwrap();
        let reference = logprobs_entropy_reference(&hidden, &weight, &targets).unwrap();
        let g_ref = both_columns(&reference, &up, &e).backward().unwrap();
        // The entropy alone (g = 0) and both columns together.
        let g_ent_ref = both_columns(&reference, &up.zeros_like().unwrap(), &e).backward().unwrap();
        for budget in [1usize, 5 * 40 * 4, 1 << 30] {
            let fused = logprobs_entropy(&hidden, &weight, &targets, budget).unwrap();
            let g = both_columns(&fused, &up, &e).backward().unwrap();
            let g_ent = both_columns(&fused, &up.zeros_like().unwrap(), &e).backward().unwrap();
            for var in [&hidden, &weight] {
                let (a, b) = (g.get(var.as_tensor()).unwrap(), g_ref.get(var.as_tensor()).unwrap());
                assert!(max_diff(a, b) < 1e-5, "gradient differs at budget {budget}: {}", max_diff(a, b));
                let (a, b) = (g_ent.get(var.as_tensor()).unwrap(), g_ent_ref.get(var.as_tensor()).unwrap());
                assert!(max_diff(a, b) < 1e-5, "entropy gradient differs at budget {budget}: {}", max_diff(a, b));
            }
        }
    }

    #[test]
    fn the_entropy_gradient_agrees_with_finite_differences() {
        let (hidden, weight, targets, up) = setup(5, 4, 11);
        let e = Tensor::new(&[0.7f32, -1.1, 0.4, 2.0, -0.3], &Device::Cpu).unwrap();
        let up = (up * 0.0).unwrap();
        let f = |h: &Tensor, w: &Tensor| -> f64 {
            both_columns(&logprobs_entropy(h, w, &targets, 16).unwrap(), &up, &e).to_scalar::<f32>().unwrap() as f64
        };
        let out = logprobs_entropy(&hidden, &weight, &targets, 16).unwrap();
        let grads = both_columns(&out, &up, &e).backward().unwrap();
        let eps = 1e-2f32;
        for (var, shape) in [(&weight, (11, 4)), (&hidden, (5, 4))] {
            let g = grads.get(var.as_tensor()).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let x0 = var.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            for idx in [0usize, 7, 13, 19] {
                let moved = |d: f32| {
                    let mut x = x0.clone();
                    x[idx] += d;
                    Tensor::from_vec(x, shape, &Device::Cpu).unwrap()
                };
                let fd = if shape.0 == 11 {
                    (f(hidden.as_tensor(), &moved(eps)) - f(hidden.as_tensor(), &moved(-eps))) / (2.0 * eps as f64)
                } else {
                    (f(&moved(eps), weight.as_tensor()) - f(&moved(-eps), weight.as_tensor())) / (2.0 * eps as f64)
                };
                assert!((fd - g[idx] as f64).abs() < 2e-3, "d/d[{idx}] of {shape:?}: fd {fd} vs backward {}", g[idx]);
            }
        }
    }
}
