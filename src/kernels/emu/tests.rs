//! Every kernel of kernels/*.cu, launched by its op's plan on the host emulator, against the op's CPU
//! implementation: forward and backward, f32/bf16/f16, with edge shapes (length 1, lengths no block size
//! divides, GQA groups, packed segments, clipped and empty key ranges, empty batches, the largest head
//! dim). The cases of tests/cuda_ops.rs at sizes a host runs in seconds. One test per kernel.

use candle_core::{DType, Device, Tensor, Var, D};
use rand::{Rng, SeedableRng};

use super::{run, run_in_place, run_with, Buf, RawArg, KIND_F32, KIND_U64};
use crate::kernels::attention::softmax_plan;
use crate::kernels::embedding;
use crate::kernels::flash_attention::{backward_plan, forward_plan, Dims, MAX_HEAD_DIM};
use crate::kernels::norm::norm_plan;
use crate::kernels::rope::rope_plan;
use crate::kernels::rows::{grad_plan, stats_plan};
use crate::kernels::{embedding_grad, flash_attention, masked_softmax, rms_norm, rope, row_stats};
use crate::kernels::{flash_mma, flash_wgmma};

const DTYPES: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

fn random(rng: &mut impl Rng, shape: &[usize], scale: f32) -> Tensor {
    let n = shape.iter().product();
    let data: Vec<f32> = (0..n).map(|_| rng.gen_range(-scale..scale)).collect();
    Tensor::from_vec(data, shape, &Device::Cpu).unwrap()
}

/// `(rtol, atol)`, atol relative to max |b|: f32 rounding differences of a different summation order;
/// for bf16/f16 outputs one rounding of the output type either way.
fn tol(dt: DType) -> (f32, f32) {
    match dt {
        DType::F32 => (1e-4, 1e-5),
        DType::BF16 => (1.6e-2, 1e-3),
        _ => (2e-3, 1e-4),
    }
}

fn flat(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_dtype(DType::F32).unwrap().to_vec1().unwrap()
}

/// Every element has |a - b| <= atol max|b| + rtol |b| (NaN only where both are NaN).
fn assert_close(what: &str, a: &Tensor, b: &Tensor, (rtol, atol): (f32, f32)) {
    let (a, b) = (flat(a), flat(b));
    assert_eq!(a.len(), b.len(), "{what}: {} vs {} elements", a.len(), b.len());
    let scale = b.iter().filter(|x| x.is_finite()).fold(0f32, |m, x| m.max(x.abs()));
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        let ok = (x.is_nan() && y.is_nan()) || (x - y).abs() <= atol * scale + rtol * y.abs();
        assert!(ok, "{what}: element {i}: emulated {x} vs cpu {y} (max |cpu| {scale}, seed {})", super::seed());
    }
}

fn u32s(v: &[u32], shape: &[usize]) -> Tensor {
    Tensor::from_vec(v.to_vec(), shape, &Device::Cpu).unwrap()
}

#[test]
fn lp_row_stats() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    // 20,000 and 40: rows of whole 16-byte packs (20,000: several a thread, the later ones summed in f32);
    // 1001 and 33: rows off 16-byte alignment.
    for (n, v) in [(1, 1), (3, 1001), (2, 33), (2, 20_000)] {
        let t = u32s(&(0..n).map(|_| rng.gen_range(0..v as u32)).collect::<Vec<_>>(), &[n]);
        for dt in DTYPES {
            let z = random(&mut rng, &[n, v], 20.0).to_dtype(dt).unwrap();
            let got = run(&stats_plan(dt, n, v).unwrap(), &[&z, &t]).unwrap().remove(0);
            assert_close(&format!("lp_row_stats {n}x{v} {dt:?}"), &got, &row_stats(&z, &t).unwrap(), (1e-5, 1e-6));
        }
    }
    // A NaN logit makes its row NaN; a target outside the vocabulary gives NaN log-probs, not a read.
    let mut z = vec![0.5f32; 3 * 40];
    z[17] = f32::NAN;
    let z = Tensor::from_vec(z, (3, 40), &Device::Cpu).unwrap();
    let got = run(&stats_plan(DType::F32, 3, 40).unwrap(), &[&z, &u32s(&[1, 2, 40], &[3])]).unwrap().remove(0);
    let got = flat(&got);
    assert!(got[..3].iter().all(|x| x.is_nan()) && got[3..6].iter().all(|x| x.is_finite()), "{got:?}");
    assert!(got[6].is_nan() && got[7..].iter().all(|x| x.is_finite()), "{got:?}");
    // -inf logits (probability 0): whole packs of them (a thread's first, and a later one), and scattered
    // through packs, in rows of 12,288 (3-6 packs a thread).
    let v = 12_288;
    let mut z: Vec<f32> = flat(&random(&mut rng, &[2, v], 5.0));
    for i in (0..8).chain(8192..8200).chain((0..2 * v).step_by(37)) {
        z[i] = f32::NEG_INFINITY;
    }
    let t = u32s(&[8, 5], &[2]);
    for dt in DTYPES {
        let z = Tensor::from_vec(z.clone(), (2, v), &Device::Cpu).unwrap().to_dtype(dt).unwrap();
        let got = run(&stats_plan(dt, 2, v).unwrap(), &[&z, &t]).unwrap().remove(0);
        assert_close(&format!("lp_row_stats -inf {dt:?}"), &got, &row_stats(&z, &t).unwrap(), (1e-5, 1e-6));
    }
}

#[test]
fn lp_row_grad() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(8);
    // 2100 and 8200 in 16-byte packs (8200: more packs than a row's threads), 1001 off alignment.
    for (n, v) in [(1, 1), (3, 1001), (2, 2100), (2, 8200)] {
        let t = u32s(&(0..n).map(|_| rng.gen_range(0..v as u32)).collect::<Vec<_>>(), &[n]);
        for dt in DTYPES {
            let z = random(&mut rng, &[n, v], 8.0).to_dtype(dt).unwrap();
            let lse = row_stats(&z, &t).unwrap().narrow(1, 2, 1).unwrap().squeeze(1).unwrap();
            let ent = row_stats(&z, &t).unwrap().narrow(1, 1, 1).unwrap().squeeze(1).unwrap();
            let g = random(&mut rng, &[n], 2.0);
            // Without and with the entropy term.
            let coef2 = Tensor::stack(&[&lse, &g], 1).unwrap();
            let coef4 = Tensor::stack(&[&lse, &g, &ent, &random(&mut rng, &[n], 2.0)], 1).unwrap();
            for coef in [coef2, coef4] {
                let cols = coef.dims()[1];
                let want = crate::kernels::row_grad(&z, &t, &coef).unwrap();
                let got = run(&grad_plan(dt, n, v, cols).unwrap(), &[&z, &t, &coef]).unwrap().remove(0);
                assert_close(&format!("lp_row_grad {n}x{v} {dt:?} cols {cols}"), &got, &want, tol(dt));
            }
        }
    }
}

/// Ranges `[B, T, 2]` over `past + T` keys: row 0 causal; later rows two packed segments, a query whose
/// range runs past the keys (clipped), an empty one and trailing padding (each sees itself).
fn ranges(b: usize, t: usize, past: usize) -> Tensor {
    let mut r = Vec::new();
    for row in 0..b {
        for i in 0..t {
            let q = (i + past) as u32;
            let third = t / 3;
            r.extend_from_slice(&match (row, i) {
                (0, _) => [0, q],
                (_, i) if i < third => [0, q],
                (_, i) if i + 3 < t && i < 2 * third + 2 => [(third + past) as u32, q],
                (_, i) if i + 3 == t => [2, 1_000_000],
                (_, i) if i + 2 == t => [7, 3],
                _ => [q, q],
            });
        }
    }
    u32s(&r, &[b, t, 2])
}

/// The op's output and the gradient of `sum(y * up)` with respect to `x`, on the CPU, in `x`'s dtype.
fn cpu_forward_backward(x: &Tensor, up: &Tensor, op: impl Fn(&Tensor) -> Tensor) -> (Tensor, Tensor) {
    let xv = Var::from_tensor(x).unwrap();
    let y = op(xv.as_tensor());
    let loss = (y.to_dtype(DType::F32).unwrap() * up.to_dtype(DType::F32).unwrap()).unwrap().sum_all().unwrap();
    let g = loss.backward().unwrap();
    (y, g.get(xv.as_tensor()).unwrap().clone())
}

const SOFTMAX_CASES: [(usize, usize, usize, usize); 3] = [(1, 1, 1, 1), (2, 2, 7, 9), (0, 2, 3, 4)];

#[test]
fn attn_softmax_fwd() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(13);
    for (b, h, t, s) in SOFTMAX_CASES {
        let r = ranges(b, t, s - t);
        for dt in DTYPES {
            let x = random(&mut rng, &[b, h, t, s], 6.0).to_dtype(dt).unwrap();
            let got = run(&softmax_plan(dt, (b, h, t, s), 0.7, false).unwrap(), &[&x, &r]).unwrap().remove(0);
            let want = masked_softmax(&x, &r, 0.7).unwrap();
            assert_close(&format!("attn_softmax_fwd {b}x{h}x{t}x{s} {dt:?}"), &got, &want, tol(dt));
        }
    }
}

#[test]
fn attn_softmax_bwd() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(14);
    for (b, h, t, s) in SOFTMAX_CASES {
        let r = ranges(b, t, s - t);
        for dt in DTYPES {
            let x = random(&mut rng, &[b, h, t, s], 6.0).to_dtype(dt).unwrap();
            let up = random(&mut rng, &[b, h, t, s], 1.0).to_dtype(dt).unwrap();
            let (y, want) = cpu_forward_backward(&x, &up, |x| masked_softmax(x, &r, 0.7).unwrap());
            let got = run(&softmax_plan(dt, (b, h, t, s), 0.7, true).unwrap(), &[&y, &up, &r]).unwrap().remove(0);
            assert_close(&format!("attn_softmax_bwd {b}x{h}x{t}x{s} {dt:?}"), &got, &want, tol(dt));
        }
    }
}

/// Rows x features: one feature, a row shorter than a warp's multiple, a row longer than the block.
/// `(rows, h)`: one element, odd widths (one element at a time), more rows than the backward's 512 blocks
/// (several rows a block; at a width of 6,144 more than its 2 warps, each taking rows in turn), the widest
/// row (12,288 f32 partials of one warp: all 48 KiB of shared memory), no rows.
const NORM_CASES: [(usize, usize); 7] = [(1, 1), (3, 77), (2, 300), (1030, 40), (1030, 6144), (2, 12288), (0, 8)];

/// A norm weight of `h` around 1, in `dt`.
fn norm_weight(rng: &mut impl Rng, h: usize, dt: DType) -> Tensor {
    (random(rng, &[h], 0.5) + 1.0).unwrap().to_dtype(dt).unwrap()
}

#[test]
fn rms_norm_fwd() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(17);
    for (rows, h) in NORM_CASES {
        for dt in DTYPES {
            let x = random(&mut rng, &[rows, h], 8.0).to_dtype(dt).unwrap();
            let w = norm_weight(&mut rng, h, dt);
            let got = run(&norm_plan(dt, rows, h, 1e-6, false).unwrap(), &[&x, &w]).unwrap().remove(0);
            let want = rms_norm(&x, &w, 1e-6).unwrap();
            assert_close(&format!("rms_norm_fwd {rows}x{h} {dt:?}"), &got, &want, tol(dt));
        }
    }
}

/// The input's gradient and the weight's (after it in the output) against the CPU op's. The weight's
/// gradient sums `g T(xhat)` over rows, and `T(xhat)` may round the other way where `r` differs in its
/// last bit (`rsqrtf` against `1 / sqrt`): a unit of the dtype at `|xhat|` (up to 2 here) times `|g|` (up to
/// 1) a row, against a largest sum of about 3 over two rows: its own absolute tolerance.
#[test]
fn rms_norm_bwd() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(18);
    for (rows, h) in NORM_CASES {
        for dt in DTYPES {
            let x = random(&mut rng, &[rows, h], 8.0).to_dtype(dt).unwrap();
            let w = Var::from_tensor(&norm_weight(&mut rng, h, dt)).unwrap();
            let up = random(&mut rng, &[rows, h], 1.0).to_dtype(dt).unwrap();
            let (_, dx) = cpu_forward_backward(&x, &up, |x| rms_norm(x, w.as_tensor(), 1e-6).unwrap());
            let (_, dw) = cpu_forward_backward(w.as_tensor(), &up, |w| rms_norm(&x, w, 1e-6).unwrap());
            let got = run(&norm_plan(dt, rows, h, 1e-6, true).unwrap(), &[&x, w.as_tensor(), &up]).unwrap().remove(0);
            let what = format!("rms_norm_bwd {rows}x{h} {dt:?}");
            assert_close(&what, &got.narrow(0, 0, rows * h).unwrap(), &dx.flatten_all().unwrap(), tol(dt));
            let ulp = match dt {
                DType::BF16 => 2f32.powi(-7),
                DType::F16 => 2f32.powi(-10),
                _ => 0.0,
            };
            let (rtol, atol) = tol(dt);
            assert_close(&format!("{what} weight"), &got.narrow(0, rows * h, h).unwrap(), &dw, (rtol, atol + ulp));
        }
    }
}

/// `[B, T, H, D]`: one pair, an odd number of heads and positions (half-rows of 4: 16-byte runs in f32, single
/// elements in bf16/f16), more pairs than one block's threads, runs of 16 bytes over two sequences of odd
/// lengths and heads (head dim 128), no rows.
const ROPE_CASES: [(usize, usize, usize, usize); 5] =
    [(1, 1, 1, 2), (2, 5, 3, 8), (1, 9, 2, 64), (2, 7, 5, 128), (0, 3, 2, 4)];

/// cos and sin `[B, 1, T, D]` of random angles (both halves equal), in `dt`.
fn cos_sin(rng: &mut impl Rng, (b, t, _, d): (usize, usize, usize, usize), dt: DType) -> (Tensor, Tensor) {
    let half = random(rng, &[b, 1, t, d / 2], 50.0);
    let angles = Tensor::cat(&[&half, &half], 3).unwrap();
    (angles.cos().unwrap().to_dtype(dt).unwrap(), angles.sin().unwrap().to_dtype(dt).unwrap())
}

#[test]
fn rope_fwd() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(19);
    for dims @ (b, t, h, d) in ROPE_CASES {
        for dt in DTYPES {
            let (c, s) = cos_sin(&mut rng, dims, dt);
            let x = random(&mut rng, &[b, t, h, d], 4.0).to_dtype(dt).unwrap();
            let got = run(&rope_plan(dt, dims, false).unwrap(), &[&x, &c, &s]).unwrap().remove(0);
            assert_close(&format!("rope_fwd {dims:?} {dt:?}"), &got, &rope(&x, &c, &s).unwrap(), tol(dt));
        }
    }
}

#[test]
fn rope_bwd() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(20);
    for dims @ (b, t, h, d) in ROPE_CASES {
        for dt in DTYPES {
            let (c, s) = cos_sin(&mut rng, dims, dt);
            let x = random(&mut rng, &[b, t, h, d], 4.0).to_dtype(dt).unwrap();
            let up = random(&mut rng, &[b, h, t, d], 1.0).to_dtype(dt).unwrap();
            let (_, want) = cpu_forward_backward(&x, &up, |x| rope(x, &c, &s).unwrap());
            let got = run(&rope_plan(dt, dims, true).unwrap(), &[&up, &c, &s]).unwrap().remove(0);
            assert_close(&format!("rope_bwd {dims:?} {dt:?}"), &got, &want, tol(dt));
        }
    }
}

/// Flash-attention cases `(b, h, kv, t, past keys, d)`: one query, GQA groups of 2 and 4, lengths no
/// tile divides, a decode-like step over cached keys, the largest head dim, an empty batch.
const FLASH_CASES: [FlashCase; 5] =
    [(1, 2, 2, 1, 0, 8), (2, 4, 2, 19, 3, 16), (2, 4, 1, 10, 0, 40), (1, 2, 1, 9, 0, MAX_HEAD_DIM), (0, 2, 1, 4, 0, 8)];

struct Flash {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    up: Tensor,
    ranges: Tensor,
    dims: Dims,
}

impl Flash {
    fn new(rng: &mut impl Rng, (b, h, kv, t, past, d): (usize, usize, usize, usize, usize, usize), dt: DType) -> Self {
        let s = t + past;
        let mut draw = |shape: &[usize], scale| random(rng, shape, scale).to_dtype(dt).unwrap();
        let (q, k, v) = (draw(&[b, h, t, d], 2.0), draw(&[b, kv, s, d], 2.0), draw(&[b, kv, s, d], 1.0));
        let up = draw(&[b, h, t, d], 1.0);
        let ranges = ranges(b, t, past);
        let dims = Dims::new(q.layout(), k.layout(), v.layout(), ranges.layout()).unwrap();
        Self { q, k, v, up, ranges, dims }
    }

    /// `(o, dq, dk, dv)` on the CPU, in the inputs' dtype.
    fn cpu(&self) -> [Tensor; 4] {
        let vars = [&self.q, &self.k, &self.v].map(|x| Var::from_tensor(x).unwrap());
        let o =
            flash_attention(vars[0].as_tensor(), vars[1].as_tensor(), vars[2].as_tensor(), &self.ranges, 0.3).unwrap();
        let loss = (o.to_dtype(DType::F32).unwrap() * self.up.to_dtype(DType::F32).unwrap()).unwrap();
        let g = loss.sum_all().unwrap().backward().unwrap();
        let grad = |i: usize| g.get(vars[i].as_tensor()).unwrap().clone();
        [o, grad(0), grad(1), grad(2)]
    }

    /// Log-sum-exp of each query's scaled scores over its keys (f64), `[B, H, T]`; -inf when none.
    fn lse(&self) -> Tensor {
        let Dims { b, h, kv, t, s, d } = self.dims;
        let (q, k) = (flat(&self.q), flat(&self.k));
        let r: Vec<u32> = self.ranges.flatten_all().unwrap().to_vec1().unwrap();
        let mut out = Vec::with_capacity(b * h * t);
        for (bi, hi, i) in (0..b).flat_map(|bi| (0..h).flat_map(move |hi| (0..t).map(move |i| (bi, hi, i)))) {
            let (lo, hi_key) = (r[(bi * t + i) * 2] as usize, (r[(bi * t + i) * 2 + 1] as usize).min(s - 1));
            let qr = &q[((bi * h + hi) * t + i) * d..][..d];
            let kvh = bi * kv + hi / (h / kv);
            let scores: Vec<f64> = (lo..=hi_key)
                .map(|j| 0.3 * qr.iter().zip(&k[(kvh * s + j) * d..][..d]).map(|(a, b)| (a * b) as f64).sum::<f64>())
                .collect();
            let m = scores.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x));
            out.push((m + scores.iter().map(|x| (x - m).exp()).sum::<f64>().ln()) as f32);
        }
        Tensor::from_vec(out, (b, h, t), &Device::Cpu).unwrap()
    }
}

type PlanResult = candle_core::Result<crate::kernels::launch::Plan>;
type FlashPlan = fn(DType, Dims, f32) -> PlanResult;
type FlashCase = (usize, usize, usize, usize, usize, usize);

/// The forward `plan` (outputs L, o) of each case and dtype, emulated, against the CPU op: o within the
/// dtype's tolerance, L where finite within 2e-3 and -inf (an empty range) exactly.
fn check_flash_forward(name: &str, plan: FlashPlan, cases: &[FlashCase], dtypes: [DType; 2], seed: u64) {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    for &case in cases {
        for dt in dtypes {
            let f = Flash::new(&mut rng, case, dt);
            let got = run(&plan(dt, f.dims, 0.3).unwrap(), &[&f.q, &f.k, &f.v, &f.ranges]).unwrap();
            let [o, ..] = f.cpu();
            let (rtol, atol) = tol(dt);
            assert_close(&format!("{name} {case:?} {dt:?} o"), &got[1], &o, (rtol, atol.max(2e-3)));
            let (want, lse) = (flat(&f.lse()), flat(&got[0]));
            for (i, (a, w)) in lse.iter().zip(&want).enumerate() {
                let ok = if w.is_finite() { (a - w).abs() <= 2e-3 * (1.0 + w.abs()) } else { a == w };
                assert!(ok, "{name} {case:?} {dt:?} lse {i}: {a} vs {w}");
            }
        }
    }
}

/// The backward `plan` (output dq|dk|dv) of each case and dtype, emulated, against the CPU op's gradients.
fn check_flash_backward(
    name: &str,
    plan: impl Fn(DType, Dims, f32) -> PlanResult,
    cases: &[FlashCase],
    dtypes: &[DType],
    seed: u64,
) {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    for &case in cases {
        for &dt in dtypes {
            let f = Flash::new(&mut rng, case, dt);
            let [o, dq, dk, dv] = f.cpu();
            let lse = f.lse();
            let delta =
                (f.up.to_dtype(DType::F32).unwrap() * o.to_dtype(DType::F32).unwrap()).unwrap().sum(D::Minus1).unwrap();
            let plan = plan(dt, f.dims, 0.3).unwrap();
            let got = run(&plan, &[&f.q, &f.k, &f.v, &f.up, &f.ranges, &lse, &delta]).unwrap().remove(0);
            let (nq, nk) = (dq.elem_count(), dk.elem_count());
            let (rtol, atol) = tol(dt);
            for (part, off, len, want) in [("dq", 0, nq, &dq), ("dk", nq, nk, &dk), ("dv", nq + nk, nk, &dv)] {
                let what = format!("{name} {case:?} {dt:?} {part}");
                assert_close(&what, &got.narrow(0, off, len).unwrap(), want, (rtol, atol.max(2e-3)));
            }
        }
    }
}

#[test]
fn flash_fwd() {
    check_flash_forward("flash_fwd", forward_plan, &FLASH_CASES, [DType::F32, DType::BF16], 23);
}

#[test]
fn flash_bwd_dq_and_dkv() {
    check_flash_backward("flash_bwd", backward_plan, &FLASH_CASES, &[DType::F32, DType::BF16], 29);
}

/// Tensor-core flash-attention cases `(b, h, kv, t, past keys, d)`: both head dims, GQA groups of 2,
/// lengths no block (64 queries, 64 or 32 keys) divides with packed, clipped and empty ranges, one query
/// over cached keys, an empty batch, and queries 48..63 whose last key (64) is a key block's first.
const MMA_CASES: [FlashCase; 5] =
    [(2, 4, 2, 70, 3, 64), (1, 2, 1, 1, 5, 64), (2, 2, 2, 19, 2, 128), (0, 2, 1, 4, 0, 64), (1, 2, 1, 70, 1, 64)];

#[test]
fn flash_mma_fwd() {
    check_flash_forward("flash_mma_fwd", flash_mma::forward_plan, &MMA_CASES, [DType::BF16, DType::F16], 31);
}

#[test]
fn flash_mma_bwd() {
    check_flash_backward("flash_mma_bwd", flash_mma::backward_plan, &MMA_CASES, &[DType::BF16, DType::F16], 37);
}

/// Warpgroup tensor-core cases `(b, h, kv, t, past keys, d)`: both head dims, GQA groups of 2, lengths
/// no block (128 queries or keys, 64 keys or queries per step) divides with packed, clipped and empty
/// ranges, one query over cached keys, an empty batch, and a length past two query blocks whose keys
/// span three key steps of the forward and two query steps of the dk/dv kernel.
const WGMMA_CASES: [FlashCase; 5] =
    [(2, 4, 2, 70, 3, 64), (1, 2, 1, 1, 5, 64), (2, 2, 2, 19, 2, 128), (0, 2, 1, 4, 0, 64), (1, 2, 1, 150, 2, 128)];

/// A length whose last query block's keys span six key steps of the forward: every slot of its K and V
/// ring refilled, so that its named barriers (and the warpgroups' drift) are exercised.
const WGMMA_LONG: [FlashCase; 1] = [(1, 2, 1, 300, 40, 64)];

#[test]
fn flash_wgmma_fwd() {
    let plan = flash_wgmma::forward_plan;
    check_flash_forward("flash_wgmma_fwd", plan, &WGMMA_CASES, [DType::BF16, DType::F16], 41);
    check_flash_forward("flash_wgmma_fwd", plan, &WGMMA_LONG, [DType::BF16, DType::F16], 43);
}

#[test]
fn flash_wgmma_bwd() {
    let plan = flash_wgmma::backward_plan;
    check_flash_backward("flash_wgmma_bwd", plan, &WGMMA_CASES, &[DType::BF16, DType::F16], 47);
}

/// The dq kernel's ring at head dim 128 cycled: a last query block whose keys span six key steps, so that
/// every slot is refilled while the other warpgroup's products on the blocks before it may still read
/// them; bf16.
#[test]
fn flash_wgmma_bwd_dq_ring_cycles_at_128() {
    let case = [(1, 2, 1, 300, 40, 128)];
    check_flash_backward("flash_wgmma_bwd", flash_wgmma::backward_plan, &case, &[DType::BF16], 53);
}

/// The dk/dv kernels with 7 query heads a KV head (the 0.5B shape's 14 of 2) split over their blocks 1,
/// 3 (3 + 3 + 1) and 7 ways with a dq kernel, and 2 (4 + 3) ways with dq by atomics, against the CPU op;
/// bf16 (the dtype does not enter the split).
#[test]
fn dkv_groups_split_over_blocks() {
    use crate::kernels::{flash_mma::MMA, flash_wgmma::WGMMA};
    for (name, file, case) in
        [("flash_mma", &MMA, (1, 7, 1, 70, 2, 64)), ("flash_wgmma", &WGMMA, (1, 14, 2, 70, 0, 64))]
    {
        for (split, atomic) in [(1, false), (3, false), (7, false), (2, true)] {
            let plan = |dt, dims, scale| file.backward_plan_split(dt, dims, scale, atomic, split);
            let what = format!("{name} split {split} atomic dq {atomic}");
            check_flash_backward(&what, plan, &[case], &[DType::BF16], 61 + split as u64);
        }
    }
}

/// The warpgroup dk/dv kernel's bitmask of query blocks over more than one 32-bit word (33 blocks of 64
/// queries): the second row's middle third sees no key of the first third, so the key blocks there skip
/// from the first third's query blocks across the word to the last block (whose query sees every key).
#[test]
fn wgmma_dkv_query_mask_spans_words() {
    let plan = flash_wgmma::backward_plan;
    check_flash_backward("flash_wgmma_bwd mask", plan, &[(2, 1, 1, 2112, 0, 64)], &[DType::BF16], 67);
}

/// The warpgroup dk/dv kernels' test for a step without the mask, which takes both halves of the step's
/// queries: in the second row of 300 tokens the second segment starts at query 100, in the second half
/// (queries 96..127) of the query block from 64, whose first half (64..95) sees every key of 0..63. The
/// step of keys 0..63 against that block must mask; a test that read the first half's bounds alone would
/// not.
#[test]
fn wgmma_dkv_mask_reads_both_halves() {
    let case = [(2, 2, 1, 300, 0, 64)];
    check_flash_backward("flash_wgmma_bwd halves", flash_wgmma::backward_plan, &case, &[DType::BF16], 71);
    check_flash_backward("flash_wgmma_bwd_atomic halves", flash_wgmma::backward_plan_atomic, &case, &[DType::BF16], 73);
}

/// The probe of the wgmma operand layouts: each of its four products equals A B (f32 sums of the same
/// products, in another order).
#[test]
fn wgmma_layouts() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(61);
    for dt in [DType::BF16, DType::F16] {
        let (a, b) = (
            random(&mut rng, &[64, 16], 2.0).to_dtype(dt).unwrap(),
            random(&mut rng, &[16, 64], 2.0).to_dtype(dt).unwrap(),
        );
        let want = a.to_dtype(DType::F32).unwrap().matmul(&b.to_dtype(DType::F32).unwrap()).unwrap();
        let got = run(&flash_wgmma::layouts_plan(dt).unwrap(), &[&a.flatten_all().unwrap(), &b.flatten_all().unwrap()])
            .unwrap()
            .remove(0)
            .reshape((4, 64, 64))
            .unwrap();
        for v in 0..4 {
            assert_close(&format!("{dt:?} layout {v}"), &got.get(v).unwrap(), &want, (1e-5, 1e-5));
        }
    }
}

/// The warpgroup backward with dq by f32 atomics: against the CPU op's gradients, and against the
/// two-kernel warpgroup backward on the same inputs (dk and dv bit for bit, dq within one rounding); also
/// at head dim 64 over ten query steps of a key block (5 blocks of two heads), so that the pipelined loop's
/// stages and its two dS^T tiles cycle, each step's dQ added to the rows of the step before it.
#[test]
fn flash_wgmma_bwd_atomic_dq() {
    let plan = flash_wgmma::backward_plan_atomic;
    check_flash_backward("flash_wgmma_bwd_atomic", plan, &WGMMA_CASES, &[DType::BF16, DType::F16], 53);
    check_flash_backward("flash_wgmma_bwd_atomic", plan, &WGMMA_LONG, &[DType::BF16], 57);
    check_atomic_against_two_kernels(plan, flash_wgmma::backward_plan, &WGMMA_CASES, 59);
}

/// The backward whose dq is summed by f32 atomics in the dk/dv kernel: against the CPU op's gradients, and
/// against the two-kernel backward on the same inputs: the same dk and dv bit for bit, and dq, the same
/// products summed in another order, within one rounding of the output dtype.
#[test]
fn flash_mma_bwd_atomic_dq() {
    let plan = flash_mma::backward_plan_atomic;
    check_flash_backward("flash_mma_bwd_atomic", plan, &MMA_CASES, &[DType::BF16, DType::F16], 37);
    check_atomic_against_two_kernels(plan, flash_mma::backward_plan, &MMA_CASES, 43);
}

/// The backward `atomic` (dq summed by f32 atomics) against `two` (a dq kernel of its own) on the same
/// inputs of each case, bf16 and f16: dk and dv bit for bit, dq within one rounding of the output dtype.
fn check_atomic_against_two_kernels(atomic: FlashPlan, two: FlashPlan, cases: &[FlashCase], seed: u64) {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    for &case in cases {
        for dt in [DType::BF16, DType::F16] {
            let f = Flash::new(&mut rng, case, dt);
            let [o, ..] = f.cpu();
            let delta =
                (f.up.to_dtype(DType::F32).unwrap() * o.to_dtype(DType::F32).unwrap()).unwrap().sum(D::Minus1).unwrap();
            let lse = f.lse();
            let ins = [&f.q, &f.k, &f.v, &f.up, &f.ranges, &lse, &delta];
            let a = run(&atomic(dt, f.dims, 0.3).unwrap(), &ins).unwrap().remove(0);
            let b = run(&two(dt, f.dims, 0.3).unwrap(), &ins).unwrap().remove(0);
            let nq = f.q.elem_count();
            let rest = |g: &Tensor| flat(&g.narrow(0, nq, g.elem_count() - nq).unwrap());
            assert_eq!(rest(&a), rest(&b), "{case:?} {dt:?}: dk, dv");
            let ulp = if dt == DType::BF16 { 1.0 / 128.0 } else { 1.0 / 1024.0 };
            let dq = |g: &Tensor| g.narrow(0, 0, nq).unwrap();
            assert_close(&format!("{case:?} {dt:?}: dq"), &dq(&a), &dq(&b), (ulp, 1e-6));
        }
    }
}

#[test]
fn emb_fwd() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
    for (n, v, h) in [(1, 1, 1), (37, 13, 40), (300, 5, 3)] {
        let ids = u32s(&(0..n).map(|_| rng.gen_range(0..v as u32)).collect::<Vec<_>>(), &[n]);
        for dt in DTYPES {
            let w = random(&mut rng, &[v, h], 2.0).to_dtype(dt).unwrap();
            let got = run(&embedding::forward_plan(dt, (n, v, h)).unwrap(), &[&w, &ids]).unwrap().remove(0);
            let want = crate::kernels::embedding(&w, &ids).unwrap();
            assert_close(&format!("emb_fwd {n}x{v}x{h} {dt:?}"), &got, &want, (0.0, 0.0));
        }
    }
    // An id outside the vocabulary reads as a NaN row, not past the table.
    let w = Tensor::ones((2, 3), DType::F32, &Device::Cpu).unwrap();
    let got = run(&embedding::forward_plan(DType::F32, (2, 2, 3)).unwrap(), &[&w, &u32s(&[1, 2], &[2])]).unwrap();
    let got = flat(&got[0]);
    assert!(got[..3].iter().all(|&x| x == 1.0) && got[3..].iter().all(|x| x.is_nan()), "{got:?}");
}

/// The f32 atomics against the CPU's sorted sums: the same up to f32 rounding of the summation order,
/// with a token repeated 2,000 times; unused tokens are zero (the accumulator is cleared first).
#[test]
fn emb_bwd() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(12);
    for (n, v, h) in [(1, 1, 1), (37, 13, 40), (2000, 7, 5)] {
        let ids: Vec<u32> =
            (0..n).map(|i| if i % 3 == 0 { 0 } else { rng.gen_range(0..v as u32 - v.min(2) as u32 + 1) }).collect();
        let ids = u32s(&ids, &[n]);
        for dt in DTYPES {
            let g = random(&mut rng, &[n, h], 1.0).to_dtype(dt).unwrap();
            let got = run(&embedding::backward_plan(dt, (n, v, h)).unwrap(), &[&ids, &g]).unwrap().remove(0);
            assert_eq!(got.dtype(), DType::F32);
            let want = embedding_grad(&ids, &g, v).unwrap();
            assert_close(&format!("emb_bwd {n}x{v}x{h} {dt:?}"), &got, &want, (1e-4, 1e-5));
        }
    }
    // An id outside the vocabulary adds nothing.
    let g = Tensor::ones((2, 3), DType::F32, &Device::Cpu).unwrap();
    let got = run(&embedding::backward_plan(DType::F32, (2, 2, 3)).unwrap(), &[&u32s(&[1, 2], &[2]), &g]).unwrap();
    assert_eq!(flat(&got[0]), [0.0, 0.0, 0.0, 1.0, 1.0, 1.0]);
}

/// `emb_bwd` alone into a non-zero accumulator, in place (the decoder's path): the accumulator plus the
/// CPU's sorted sums, up to f32 rounding of the order; rows of unused tokens untouched.
#[test]
fn emb_bwd_into_an_accumulator() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(13);
    for (n, v, h) in [(1, 2, 1), (37, 13, 40), (2000, 7, 5)] {
        let ids: Vec<u32> = (0..n).map(|i| if i % 3 == 0 { 0 } else { rng.gen_range(0..v as u32 - 1) }).collect();
        let ids = u32s(&ids, &[n]);
        for dt in DTYPES {
            let g = random(&mut rng, &[n, h], 1.0).to_dtype(dt).unwrap();
            let acc = random(&mut rng, &[v, h], 1.0);
            let got = run_in_place(&embedding::backward_into_plan(dt, (n, v, h)).unwrap(), &[&acc, &ids, &g]).unwrap();
            let want = (&acc + embedding_grad(&ids, &g, v).unwrap()).unwrap();
            assert_close(&format!("emb_bwd into {n}x{v}x{h} {dt:?}"), &got[0], &want, (1e-4, 1e-5));
            let last = (flat(&got[0])[(v - 1) * h..].to_vec(), flat(&acc)[(v - 1) * h..].to_vec());
            assert_eq!(last.0, last.1, "the last token is never drawn: its row stays");
        }
    }
}

#[test]
fn empty_inputs_launch_nothing_and_allocate_no_zero_bytes() {
    // The emulator's "device" refuses zero-byte allocations as cuMemAlloc does; an empty output is
    // backed by one element, and its launch (an empty grid) is left out.
    assert!(Buf::alloc(DType::F32, 0).is_err());
    let plan = stats_plan(DType::BF16, 0, 5).unwrap();
    assert!(plan.launches.is_empty());
    let z = Tensor::zeros((0, 5), DType::BF16, &Device::Cpu).unwrap();
    let got = run(&plan, &[&z, &u32s(&[], &[0])]).unwrap();
    assert_eq!(got[0].elem_count(), 0);
    let plan = rope_plan(DType::F32, (0, 3, 2, 4), false).unwrap();
    assert!(plan.launches.is_empty() && plan.outputs().all(|b| b.len == 0 && b.alloc_len() == 1));
}

/// The emulator checks each argument against the kernel's parameter: its size, kind and element type.
#[test]
fn arguments_are_checked_against_the_kernel_signature() {
    let x = Tensor::ones((2, 40), DType::F32, &Device::Cpu).unwrap();
    let w = Tensor::ones(40, DType::F32, &Device::Cpu).unwrap();
    let plan = norm_plan(DType::F32, 2, 40, 1e-6, false).unwrap();
    let wide = 40u64;
    let err =
        |edit: &dyn Fn(Vec<RawArg>) -> Vec<RawArg>| run_with(&plan, &[&x, &w], |_, a| edit(a)).unwrap_err().to_string();
    // rows passed as 8 bytes (a usize) where the kernel takes a u32.
    let e = err(&|mut a| {
        a[3] = RawArg { kind: KIND_U64, elem: 0, size: 8, value: &wide as *const u64 as *const _ };
        a
    });
    assert!(e.contains("argument 3: the launch passes 8 bytes"), "{e}");
    // eps as a u32 of the same size (h and eps swapped): the kind differs.
    let e = err(&|mut a| {
        a.swap(4, 5);
        a
    });
    assert!(e.contains("argument 4") && e.contains("f32"), "{e}");
    let e = err(&|mut a| {
        a.pop();
        a
    });
    assert!(e.contains("takes 6 arguments, the launch passes 5"), "{e}");
    // A bf16 buffer where the f32 kernel takes f32.
    let e = err(&|mut a| {
        a[0].elem = 2;
        a
    });
    assert!(e.contains("argument 0") && e.contains("pointer to bf16"), "{e}");
    assert_eq!(KIND_F32, 3);
}

/// A shared-memory formula one f32 short: the kernel's last write lands past the launch's dynamic shared
/// memory, which the emulator reports (AddressSanitizer too: scripts/emu-sanitize.sh).
#[test]
fn dynamic_shared_memory_one_element_short_is_reported() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(31);
    let f = Flash::new(&mut rng, (1, 1, 1, 5, 0, 8), DType::F32);
    let mut plan = forward_plan(DType::F32, f.dims, 0.3).unwrap();
    plan.launches[0].shared_bytes -= 4;
    let e = run(&plan, &[&f.q, &f.k, &f.v, &f.ranges]).unwrap_err().to_string();
    assert!(e.contains("past the") && e.contains("dynamic shared memory"), "{e}");
}
