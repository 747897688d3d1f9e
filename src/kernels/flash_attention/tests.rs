use candle_core::{DType, Device, Tensor, Var};
use rand::{Rng, SeedableRng};

use super::driver::{self, Backend, Blocks, Gemm, KeyBlock, QueryBlock, Visits};
use super::{attend, flash_attention, matrix_attention, Dims, GpuKernels};
use crate::kernels::masked_softmax;

const SCALE: f64 = 0.29;

fn random(rng: &mut impl Rng, shape: &[usize], scale: f32) -> Tensor {
    let n = shape.iter().product();
    let data: Vec<f32> = (0..n).map(|_| rng.gen_range(-scale..scale)).collect();
    Tensor::from_vec(data, shape, &Device::Cpu).unwrap()
}

/// Ranges `[B, T, 2]` from per-row lists of `(lo, hi)`.
fn ranges(rows: &[Vec<(u32, u32)>]) -> Tensor {
    let t = rows[0].len();
    let flat: Vec<u32> = rows.iter().flatten().flat_map(|&(lo, hi)| [lo, hi]).collect();
    Tensor::from_vec(flat, (rows.len(), t, 2), &Device::Cpu).unwrap()
}

/// Causal over `past` cached keys and `t` new ones.
fn causal(t: usize, past: usize) -> Vec<(u32, u32)> {
    (0..t).map(|i| (0, (past + i) as u32)).collect()
}

/// Two packed segments then padding queries (each sees itself only).
fn packed(t: usize) -> Vec<(u32, u32)> {
    let (a, b) = (t / 3, 2 * t / 3 + 1);
    (0..t)
        .map(|i| match i {
            i if i < a => (0, i as u32),
            i if i < b => (a as u32, i as u32),
            i => (i as u32, i as u32),
        })
        .collect()
}

struct Case {
    b: usize,
    h: usize,
    kv: usize,
    t: usize,
    s: usize,
    d: usize,
    ranges: Tensor,
}

impl Case {
    /// q, k, v (as variables) and an upstream gradient, in `dtype`.
    fn inputs(&self, seed: u64, dtype: DType) -> (Var, Var, Var, Tensor) {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let mut var = |shape: &[usize], scale| {
            Var::from_tensor(&random(&mut rng, shape, scale).to_dtype(dtype).unwrap()).unwrap()
        };
        let q = var(&[self.b, self.h, self.t, self.d], 2.0);
        let k = var(&[self.b, self.kv, self.s, self.d], 2.0);
        let v = var(&[self.b, self.kv, self.s, self.d], 1.0);
        let up = random(&mut rng, &[self.b, self.h, self.t, self.d], 1.0).to_dtype(dtype).unwrap();
        (q, k, v, up)
    }
}

/// Output, dq, dk and dv of `attend` on the case's inputs, in f32.
fn run(q: &Var, k: &Var, v: &Var, up: &Tensor, attend: impl Fn(&Tensor, &Tensor, &Tensor) -> Tensor) -> [Tensor; 4] {
    let o = attend(q.as_tensor(), k.as_tensor(), v.as_tensor());
    let g = (o.to_dtype(DType::F32).unwrap() * up.to_dtype(DType::F32).unwrap())
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let f32 = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
    [
        f32(&o),
        f32(g.get(q.as_tensor()).unwrap()),
        f32(g.get(k.as_tensor()).unwrap()),
        f32(g.get(v.as_tensor()).unwrap()),
    ]
}

fn flash(ranges: &Tensor) -> impl Fn(&Tensor, &Tensor, &Tensor) -> Tensor + '_ {
    move |q, k, v| flash_attention(q, k, v, ranges, SCALE).unwrap()
}

/// Small blocks, so that the cases run many block pairs, partial blocks and skipped pairs.
const SMALL: [Blocks; 3] = [Blocks { bq: 1, bk: 1 }, Blocks { bq: 16, bk: 24 }, Blocks { bq: 7, bk: 64 }];

fn flash_blocks(ranges: &Tensor, blocks: Blocks) -> impl Fn(&Tensor, &Tensor, &Tensor) -> Tensor + '_ {
    move |q, k, v| attend(q, k, v, ranges, SCALE, Some(blocks), GpuKernels::Chunked, None).unwrap()
}

fn matrix(ranges: &Tensor) -> impl Fn(&Tensor, &Tensor, &Tensor) -> Tensor + '_ {
    move |q, k, v| matrix_attention(q, k, v, |x| masked_softmax(x, ranges, SCALE)).unwrap()
}

// Largest absolute difference over the largest absolute value of `b` (at least 1).
use super::super::testing::max_diff_over_1 as rel_diff;

fn cases() -> Vec<(&'static str, Case)> {
    let mut out = vec![];
    for (h, kv) in [(2, 2), (4, 2), (4, 1)] {
        // 70 queries: 3 query blocks (the last partial), 2 key blocks; head dim 12 (not a multiple of 8).
        let t = 70;
        out.push(("causal", Case { b: 1, h, kv, t, s: t, d: 12, ranges: ranges(&[causal(t, 0)]) }));
        out.push((
            "cached keys",
            Case { b: 2, h, kv, t: 9, s: 9 + 61, d: 8, ranges: ranges(&[causal(9, 61), causal(9, 61)]) },
        ));
        out.push((
            "packed and padded",
            Case { b: 2, h, kv, t, s: t, d: 16, ranges: ranges(&[packed(t), causal(t, 0)]) },
        ));
    }
    out.push(("length 1", Case { b: 1, h: 4, kv: 2, t: 1, s: 1, d: 8, ranges: ranges(&[causal(1, 0)]) }));
    out.push((
        "one new query",
        Case { b: 2, h: 4, kv: 1, t: 1, s: 30, d: 8, ranges: ranges(&[causal(1, 29), causal(1, 29)]) },
    ));
    out
}

#[test]
fn small_blocks_match_the_matrix_path_in_values_and_gradients() {
    for blocks in SMALL {
        for (i, (name, case)) in cases().iter().enumerate() {
            let (q, k, v, up) = case.inputs(i as u64, DType::F32);
            let got = run(&q, &k, &v, &up, flash_blocks(&case.ranges, blocks));
            let want = run(&q, &k, &v, &up, matrix(&case.ranges));
            for (what, (a, b)) in ["out", "dq", "dk", "dv"].iter().zip(got.iter().zip(&want)) {
                let d = rel_diff(a, b);
                assert!(d < 2e-5, "{name} {blocks:?} h={} kv={}: {what} differs by {d}", case.h, case.kv);
            }
        }
    }
}

#[test]
fn causal_and_packed_block_pairs_are_skipped() {
    let dims = |t| Dims { b: 1, h: 4, kv: 2, t, s: t, d: 8 };
    let blocks = Blocks { bq: 16, bk: 16 };
    let flat = |rows: &[Vec<(u32, u32)>]| ranges(rows).flatten_all().unwrap().to_vec1::<u32>().unwrap();
    // Causal over 64: query block q visits key blocks 0..=q, 10 pairs of 16.
    let v = Visits::new(dims(64), blocks, &flat(&[causal(64, 0)]));
    assert_eq!(v.spans, vec![(0, 1), (0, 2), (0, 3), (0, 4)]);
    assert_eq!(v.spans, Visits::causal(dims(64), blocks).spans);
    // Packed segments 0..21, 21..43, then padding: the last query blocks skip the first key blocks.
    let v = Visits::new(dims(64), blocks, &flat(&[packed(64)]));
    assert_eq!(v.spans, vec![(0, 1), (0, 2), (1, 3), (3, 4)]);
    // A query block that sees no key visits nothing.
    let v = Visits::new(dims(2), Blocks { bq: 1, bk: 1 }, &flat(&[vec![(1, 0), (0, 1)]]));
    assert_eq!(v.spans, vec![(0, 0), (0, 2)]);
}

#[test]
fn matches_the_matrix_path_in_values_and_gradients() {
    for (i, (name, case)) in cases().iter().enumerate() {
        let (q, k, v, up) = case.inputs(i as u64, DType::F32);
        let got = run(&q, &k, &v, &up, flash(&case.ranges));
        let want = run(&q, &k, &v, &up, matrix(&case.ranges));
        for (what, (a, b)) in ["out", "dq", "dk", "dv"].iter().zip(got.iter().zip(&want)) {
            let d = rel_diff(a, b);
            assert!(d < 2e-5, "{name} h={} kv={}: {what} differs by {d}", case.h, case.kv);
        }
    }
}

/// bf16 and f16 inputs: the op (f32 inside, rounded once) against the matrix path in f32 on the same
/// rounded inputs, within the dtype's rounding.
#[test]
fn half_precision_matches_the_f32_matrix_path() {
    for (dtype, tol) in [(DType::BF16, 3e-2), (DType::F16, 4e-3)] {
        for (i, (name, case)) in cases().iter().enumerate() {
            let (q, k, v, up) = case.inputs(i as u64, dtype);
            let got = run(&q, &k, &v, &up, flash(&case.ranges));
            assert_eq!(flash(&case.ranges)(q.as_tensor(), k.as_tensor(), v.as_tensor()).dtype(), dtype);
            let f = |x: &Var| Var::from_tensor(&x.as_tensor().to_dtype(DType::F32).unwrap()).unwrap();
            let (qf, kf, vf) = (f(&q), f(&k), f(&v));
            let want = run(&qf, &kf, &vf, &up.to_dtype(DType::F32).unwrap(), matrix(&case.ranges));
            for (what, (a, b)) in ["out", "dq", "dk", "dv"].iter().zip(got.iter().zip(&want)) {
                let d = rel_diff(a, b);
                assert!(d < tol, "{dtype:?} {name} h={} kv={}: {what} differs by {d}", case.h, case.kv);
            }
        }
    }
}

#[test]
fn empty_ranges_give_zero_output_and_no_gradient() {
    // Query 1 of 3 sees nothing (lo > hi); query 2's range runs past the keys (clipped).
    let r = ranges(&[vec![(0, 0), (2, 1), (1, 99)]]);
    let case = Case { b: 1, h: 2, kv: 1, t: 3, s: 3, d: 4, ranges: r };
    let (q, k, v, up) = case.inputs(7, DType::F32);
    let [o, dq, _, _] = run(&q, &k, &v, &up, flash(&case.ranges));
    for head in 0..2 {
        let row = |t: &Tensor| t.get(0).unwrap().get(head).unwrap().get(1).unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(row(&o), vec![0.0; 4]);
        assert_eq!(row(&dq), vec![0.0; 4]);
    }
    // Query 0 sees key 0 only: its output is v_0.
    let o0: Vec<f32> = o.get(0).unwrap().get(0).unwrap().get(0).unwrap().to_vec1().unwrap();
    let v0: Vec<f32> = v.as_tensor().get(0).unwrap().get(0).unwrap().get(0).unwrap().to_vec1().unwrap();
    assert!(o0.iter().zip(&v0).all(|(a, b)| (a - b).abs() < 1e-6), "{o0:?} vs {v0:?}");
    let clipped = run(&q, &k, &v, &up, matrix(&ranges(&[vec![(0, 0), (0, 0), (1, 2)]])))[0].clone();
    let row2 = |t: &Tensor| t.get(0).unwrap().get(1).unwrap().get(2).unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(row2(&o).len(), row2(&clipped).len());
    assert!(row2(&o).iter().zip(row2(&clipped)).all(|(a, b)| (a - b).abs() < 1e-6));
}

#[test]
fn finite_differences_agree() {
    let t = 6;
    let case = Case { b: 1, h: 2, kv: 1, t, s: t, d: 4, ranges: ranges(&[packed(t)]) };
    let (q, k, v, up) = case.inputs(3, DType::F32);
    let [_, dq, dk, dv] = run(&q, &k, &v, &up, flash(&case.ranges));
    let loss = |q: &Tensor, k: &Tensor, v: &Tensor| -> f64 {
        let o = flash_attention(q, k, v, &case.ranges, SCALE).unwrap();
        (o * &up).unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap() as f64
    };
    let eps = 1e-2f32;
    for (which, grad) in [(0, dq), (1, dk), (2, dv)] {
        let grad: Vec<f32> = grad.flatten_all().unwrap().to_vec1().unwrap();
        let base = [&q, &k, &v][which].as_tensor();
        let x0: Vec<f32> = base.flatten_all().unwrap().to_vec1().unwrap();
        for idx in (0..x0.len()).step_by(5) {
            let at = |delta: f32| {
                let mut x = x0.clone();
                x[idx] += delta;
                let x = Tensor::from_vec(x, base.shape(), &Device::Cpu).unwrap();
                let mut args = [q.as_tensor().clone(), k.as_tensor().clone(), v.as_tensor().clone()];
                args[which] = x;
                loss(&args[0], &args[1], &args[2])
            };
            let fd = (at(eps) - at(-eps)) / (2.0 * eps as f64);
            assert!((fd - grad[idx] as f64).abs() < 2e-3, "input {which}[{idx}]: fd {fd} vs {}", grad[idx]);
        }
    }
}

#[test]
fn bad_shapes_are_errors() {
    let z = |shape: &[usize]| Tensor::zeros(shape, DType::F32, &Device::Cpu).unwrap();
    let r = ranges(&[causal(3, 0)]);
    let err = |q: &Tensor, k: &Tensor, r: &Tensor| flash_attention(q, k, k, r, 1.0).unwrap_err().to_string();
    assert!(err(&z(&[1, 3, 3, 4]), &z(&[1, 2, 3, 4]), &r).contains("not a multiple"));
    assert!(err(&z(&[1, 2, 3, 4]), &z(&[1, 2, 3, 5]), &r).contains("expected [B, H, T, D]"));
    assert!(err(&z(&[1, 2, 4, 4]), &z(&[1, 2, 4, 4]), &r).contains("ranges have shape"));
}

/// The CPU backend, counting what it is asked to do: GEMM calls and their FLOPs, and the other calls.
#[derive(Default)]
struct Recording {
    gemms: std::cell::Cell<usize>,
    flops: std::cell::Cell<f64>,
    others: std::cell::Cell<usize>,
}

impl Recording {
    fn other(&self) {
        self.others.set(self.others.get() + 1);
    }
}

impl Backend for Recording {
    type In = Vec<f32>;
    type F32 = Vec<f32>;
    type U32 = Vec<u32>;

    fn alloc_in(&self, len: usize) -> candle_core::Result<Vec<f32>> {
        super::cpu::CpuBackend.alloc_in(len)
    }
    fn zeros_f32(&self, len: usize) -> candle_core::Result<Vec<f32>> {
        super::cpu::CpuBackend.zeros_f32(len)
    }
    fn gemm(&self, g: &Gemm, a: &Vec<f32>, b: &Vec<f32>, c: &mut Vec<f32>) -> candle_core::Result<()> {
        self.gemms.set(self.gemms.get() + 1);
        self.flops.set(self.flops.get() + g.flops());
        super::cpu::CpuBackend.gemm(g, a, b, c)
    }
    fn gather(&self, blk: &QueryBlock, src: &Vec<f32>, dst: &mut Vec<f32>) -> candle_core::Result<()> {
        self.other();
        super::cpu::CpuBackend.gather(blk, src, dst)
    }
    fn fwd_scores(
        &self,
        blk: &QueryBlock,
        kb: &KeyBlock,
        scale: f32,
        ranges: &Vec<u32>,
        s: &Vec<f32>,
        p: &mut Vec<f32>,
        stats: &mut Vec<f32>,
        acc: &mut Vec<f32>,
    ) -> candle_core::Result<()> {
        self.other();
        super::cpu::CpuBackend.fwd_scores(blk, kb, scale, ranges, s, p, stats, acc)
    }
    fn fwd_finish(
        &self,
        blk: &QueryBlock,
        stats: &Vec<f32>,
        acc: &Vec<f32>,
        out: &mut Vec<f32>,
        lse: &mut Vec<f32>,
    ) -> candle_core::Result<()> {
        self.other();
        super::cpu::CpuBackend.fwd_finish(blk, stats, acc, out, lse)
    }
    fn bwd_scores(
        &self,
        blk: &QueryBlock,
        kb: &KeyBlock,
        scale: f32,
        ranges: &Vec<u32>,
        lse_delta: &Vec<f32>,
        s: &Vec<f32>,
        dp: &Vec<f32>,
        p: &mut Vec<f32>,
        ds: &mut Vec<f32>,
    ) -> candle_core::Result<()> {
        self.other();
        super::cpu::CpuBackend.bwd_scores(blk, kb, scale, ranges, lse_delta, s, dp, p, ds)
    }
    fn scatter(&self, blk: &QueryBlock, acc: &Vec<f32>, dst: &mut Vec<f32>, offset: usize) -> candle_core::Result<()> {
        self.other();
        super::cpu::CpuBackend.scatter(blk, acc, dst, offset)
    }
    fn cast(&self, src: &Vec<f32>, len: usize, dst: &mut Vec<f32>, offset: usize) -> candle_core::Result<()> {
        self.other();
        super::cpu::CpuBackend.cast(src, len, dst, offset)
    }
}

fn host(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1().unwrap()
}

/// Every product of the driver is a GEMM call: over full (non-causal) ranges the GEMMs' FLOPs are the
/// attention's whole 4 B H T S D forward and 10 B H T S D backward (2 and 5 products), and the calls
/// and launches are those [`driver::cost`] predicts, one GEMM per product per block pair.
#[test]
fn every_product_is_a_gemm_call_as_the_cost_model_counts() {
    let (b, h, kv, t, d) = (2, 4, 2, 40, 8);
    let dims = Dims { b, h, kv, t, s: t, d };
    let full: Vec<(u32, u32)> = (0..t).map(|_| (0, t as u32 - 1)).collect();
    let r = ranges(&[full.clone(), full]);
    let case = Case { b, h, kv, t, s: t, d, ranges: r.clone() };
    let (q, k, vv, up) = case.inputs(5, DType::F32);
    let blocks = Blocks { bq: 16, bk: 16 };
    let visits = Visits::new(dims, blocks, &r.flatten_all().unwrap().to_vec1::<u32>().unwrap());
    let (qh, kh, vh) = (host(q.as_tensor()), host(k.as_tensor()), host(vv.as_tensor()));
    let rh = r.flatten_all().unwrap().to_vec1::<u32>().unwrap();
    let x = driver::Inputs { q: &qh, k: &kh, v: &vh, ranges: &rh, scale: SCALE as f32 };
    let rec = Recording::default();
    let (o, lse) = driver::forward(&rec, &visits, &x).unwrap();
    let (fwd, bwd) = driver::cost(&visits, 4);
    let nominal = (b * h * t * t * d) as f64;
    assert_eq!((rec.flops.get(), fwd.gemm_flops), (4.0 * nominal, 4.0 * nominal));
    let pairs = 3 * 3;
    assert_eq!(rec.gemms.get(), 2 * pairs);
    assert_eq!(rec.gemms.get() + rec.others.get(), fwd.launches);
    let want = run(&q, &k, &vv, &up, matrix(&r));
    assert!(rel_diff(&Tensor::from_vec(o, (b, h, t, d), &Device::Cpu).unwrap(), &want[0]) < 2e-5);

    let delta: Vec<f32> = host(&(want[0].clone() * &up).unwrap().sum(3).unwrap());
    let lse_delta: Vec<f32> = lse.iter().chain(&delta).copied().collect();
    let dout = host(&up);
    let rec = Recording::default();
    let grads = driver::backward(&rec, &visits, &x, &driver::Upstream { dout: &dout, lse_delta: &lse_delta }).unwrap();
    assert_eq!((rec.flops.get(), bwd.gemm_flops), (10.0 * nominal, 10.0 * nominal));
    assert_eq!(rec.gemms.get(), 5 * pairs);
    assert_eq!(rec.gemms.get() + rec.others.get(), bwd.launches);
    let nq = b * h * t * d;
    let dq = Tensor::from_vec(grads[..nq].to_vec(), (b, h, t, d), &Device::Cpu).unwrap();
    assert!(rel_diff(&dq, &want[1]) < 2e-5);
}

#[test]
fn the_vectorised_exp_is_within_two_ulp() {
    for i in -8700..8800 {
        let x = i as f32 / 100.0 + 0.003;
        let (got, want) = (super::cpu::exp(x), (x as f64).exp());
        assert!(((got as f64 - want) / want).abs() < 2.5e-7, "exp({x}) = {got}, want {want}");
    }
}

/// A replayed forward (a recomputed layer whose attention output was recorded) gives the recorded output
/// and the same gradients as computing it, without running the forward: a record of other inputs is
/// replayed as it is, which shows no forward ran. A record of another shape is refused.
#[test]
fn a_recorded_forward_replays_with_the_same_output_and_gradients() {
    use super::{flash_attention_recorded, Replay};
    for (i, (name, case)) in cases().iter().enumerate() {
        let (q, k, v, up) = case.inputs(i as u64, DType::F32);
        let mut slot = None;
        let (q0, k0, v0) = (q.as_tensor().detach(), k.as_tensor().detach(), v.as_tensor().detach());
        let first = flash_attention_recorded(
            &q0,
            &k0,
            &v0,
            &case.ranges,
            SCALE,
            GpuKernels::Chunked,
            Some(Replay::Record(&mut slot)),
        )
        .unwrap();
        let record = slot.take().expect("the forward was recorded");
        assert!(record.bytes() >= first.elem_count() * 4, "{name}");
        let replayed = |q: &Tensor, k: &Tensor, v: &Tensor| {
            flash_attention_recorded(q, k, v, &case.ranges, SCALE, GpuKernels::Chunked, Some(Replay::From(&record)))
                .unwrap()
        };
        let got = run(&q, &k, &v, &up, replayed);
        let want = run(&q, &k, &v, &up, flash(&case.ranges));
        for (what, (a, b)) in ["out", "dq", "dk", "dv"].iter().zip(got.iter().zip(&want)) {
            assert_eq!(rel_diff(a, b), 0.0, "{name}: {what}");
        }
        // Other queries: the output is still the record's (no forward ran).
        let other = (q.as_tensor() * 0.5).unwrap();
        let out = replayed(&other, k.as_tensor(), v.as_tensor());
        assert_eq!(rel_diff(&out, &first), 0.0, "{name}");
        let longer = Tensor::cat(&[q.as_tensor(), q.as_tensor()], 3).unwrap();
        let err = flash_attention_recorded(
            &longer,
            &longer,
            &longer,
            &case.ranges,
            SCALE,
            GpuKernels::Chunked,
            Some(Replay::From(&record)),
        );
        assert!(err.is_err(), "{name}: a record of another shape was replayed");
    }
}
