use candle_core::{DType, Device, Tensor, Var};
use rand::{Rng, SeedableRng};

use super::{flash_attention, matrix_attention};
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

fn matrix(ranges: &Tensor) -> impl Fn(&Tensor, &Tensor, &Tensor) -> Tensor + '_ {
    move |q, k, v| matrix_attention(q, k, v, |x| masked_softmax(x, ranges, SCALE)).unwrap()
}

/// Largest absolute difference over the largest absolute value of `b` (at least 1).
fn rel_diff(a: &Tensor, b: &Tensor) -> f32 {
    let max = |t: Tensor| t.abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
    max((a - b).unwrap()) / max(b.clone()).max(1.0)
}

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
    out
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
