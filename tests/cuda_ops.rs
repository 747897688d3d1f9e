//! The CUDA kernels against their CPU reference on random inputs (built only with `--features cuda`;
//! skips with a message when no CUDA device opens; the binary itself needs the driver's libcuda.so.1 to
//! start). Run on a GPU machine by scripts/gpu/run.sh.
#![cfg(feature = "cuda")]

use candle_core::{DType, Device, Tensor, Var};
use grpo::kernels::{flash_attention, logprobs_entropy, masked_softmax, rms_norm, rope, row_grad, row_stats};
use rand::{Rng, SeedableRng};

/// The GPU, or None (the test then skips) when none opens; with GRPO_REQUIRE_CUDA=1 (as scripts/gpu/run.sh
/// sets) a missing GPU fails the test instead.
fn gpu() -> Option<Device> {
    match Device::new_cuda(0) {
        Ok(d) => Some(d),
        Err(e) if std::env::var("GRPO_REQUIRE_CUDA").is_ok_and(|v| v == "1") => panic!("no CUDA device: {e}"),
        Err(e) => {
            eprintln!("skipped: no CUDA device ({e})");
            None
        }
    }
}

fn random(rng: &mut impl Rng, shape: (usize, usize), scale: f32) -> Tensor {
    let data: Vec<f32> = (0..shape.0 * shape.1).map(|_| rng.gen_range(-scale..scale)).collect();
    Tensor::from_vec(data, shape, &Device::Cpu).unwrap()
}

fn targets(rng: &mut impl Rng, n: usize, v: usize) -> Tensor {
    Tensor::from_vec((0..n).map(|_| rng.gen_range(0..v as u32)).collect::<Vec<_>>(), n, &Device::Cpu).unwrap()
}

/// Whether every element has |a - b| <= atol max|b| + rtol |b|, and the worst |a - b| / (atol max|b| +
/// rtol |b|) (NaN when either side has a NaN). The absolute floor scales with the largest value: an error
/// relative to each element alone fails spuriously near zero (a gradient entry of 1e-12 off by 1e-13).
fn close(a: &Tensor, b: &Tensor, rtol: f32, atol: f32) -> (bool, f32) {
    let a: Vec<f32> = a.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1().unwrap();
    let b: Vec<f32> = b.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1().unwrap();
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f32, |m, y| m.max(y.abs()));
    let worst = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs() / (atol * scale + rtol * y.abs()).max(f32::MIN_POSITIVE))
        .fold(0f32, |w, r| if r.is_nan() || w.is_nan() { f32::NAN } else { w.max(r) });
    (worst <= 1.0, worst)
}

#[test]
fn row_kernels_match_the_cpu_reference() {
    let Some(gpu) = gpu() else { return };
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    // A real vocabulary width and one that is not a multiple of the block size.
    for (n, v) in [(33, 151_936), (70, 1001)] {
        let t = targets(&mut rng, n, v);
        for dt in [DType::F32, DType::BF16, DType::F16] {
            let z = random(&mut rng, (n, v), 20.0).to_dtype(dt).unwrap();
            let s_cpu = row_stats(&z, &t).unwrap();
            let s_gpu = row_stats(&z.to_device(&gpu).unwrap(), &t.to_device(&gpu).unwrap()).unwrap();
            let (ok, worst) = close(&s_gpu.to_device(&Device::Cpu).unwrap(), &s_cpu, 1e-4, 1e-5);
            println!("row_stats n={n} V={v} {dt:?}: worst |a-b|/(atol max|b| + rtol|b|) {worst:.2e}");
            // The CPU sums 151,936 terms in order, the GPU in a tree: a few e-6 apart.
            assert!(ok, "row_stats {dt:?} V={v}: worst {worst}");

            let g = random(&mut rng, (n, 1), 2.0).squeeze(1).unwrap();
            let e = random(&mut rng, (n, 1), 2.0).squeeze(1).unwrap();
            let col = |i| s_cpu.narrow(1, i, 1).unwrap().squeeze(1).unwrap();
            // (lse, g), and (lse, g, H, e) with the entropy's gradient.
            for coef in
                [Tensor::stack(&[col(2), g.clone()], 1).unwrap(), Tensor::stack(&[col(2), g, col(1), e], 1).unwrap()]
            {
                let cols = coef.dims()[1];
                let d_cpu = row_grad(&z, &t, &coef).unwrap();
                let d_gpu =
                    row_grad(&z.to_device(&gpu).unwrap(), &t.to_device(&gpu).unwrap(), &coef.to_device(&gpu).unwrap())
                        .unwrap();
                // Both round the same f32 value to the output dtype; expf differs by a few ulp, which can
                // flip one rounding of the output type.
                let (rtol, atol) = match dt {
                    DType::F32 => (1e-4, 1e-6),
                    DType::BF16 => (1.6e-2, 1e-4),
                    _ => (2e-3, 1e-5),
                };
                let (ok, worst) = close(&d_gpu.to_device(&Device::Cpu).unwrap(), &d_cpu, rtol, atol);
                println!("row_grad  n={n} V={v} {dt:?} cols {cols}: worst |a-b|/(atol max|b| + rtol|b|) {worst:.2e}");
                assert!(ok, "row_grad {dt:?} V={v} cols {cols}: worst {worst}");
            }
        }
    }
}

#[test]
fn fused_op_forward_and_backward_match_the_cpu_in_f32_and_bf16() {
    let Some(gpu) = gpu() else { return };
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
    let (n, h, v) = (300, 128, 151_936);
    let hidden = random(&mut rng, (n, h), 2.0);
    let weight = random(&mut rng, (v, h), 0.1);
    let t = targets(&mut rng, n, v);
    let up = random(&mut rng, (n, 1), 1.0).squeeze(1).unwrap();
    let run = |dev: &Device, dt: DType| {
        let hv = Var::from_tensor(&hidden.to_dtype(dt).unwrap().to_device(dev).unwrap()).unwrap();
        let wv = Var::from_tensor(&weight.to_dtype(dt).unwrap().to_device(dev).unwrap()).unwrap();
        // 8 MiB chunks: several chunks at this vocabulary.
        let lp = logprobs_entropy(hv.as_tensor(), wv.as_tensor(), &t.to_device(dev).unwrap(), 8 << 20).unwrap();
        let loss = lp.narrow(1, 0, 1).unwrap().squeeze(1).unwrap().mul(&up.to_device(dev).unwrap()).unwrap();
        let grads = loss.sum_all().unwrap().backward().unwrap();
        let cpu = |x: &Tensor| x.to_device(&Device::Cpu).unwrap().to_dtype(DType::F32).unwrap();
        (cpu(&lp), cpu(grads.get(hv.as_tensor()).unwrap()), cpu(grads.get(wv.as_tensor()).unwrap()))
    };
    for (dt, tol_lp, tol_g) in [(DType::F32, 1e-4, 1e-3), (DType::BF16, 5e-2, 5e-2)] {
        let (lp_c, gh_c, gw_c) = run(&Device::Cpu, dt);
        let (lp_g, gh_g, gw_g) = run(&gpu, dt);
        for (what, a, b, tol) in [
            ("logp/entropy", &lp_g, &lp_c, tol_lp),
            ("grad hidden", &gh_g, &gh_c, tol_g),
            ("grad weight", &gw_g, &gw_c, tol_g),
        ] {
            let (ok, worst) = close(a, b, tol, tol);
            println!("fused {dt:?} {what}: worst |a-b|/(atol max|b| + rtol|b|) {worst:.2e}");
            assert!(ok, "{dt:?} {what}: worst {worst}");
        }
        // The gradient is not identically zero.
        let norm = gw_g.sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(norm > 0.0);
    }
}

#[test]
fn a_nan_logit_makes_the_row_nan_on_the_gpu() {
    let Some(gpu) = gpu() else { return };
    let mut z = vec![0.5f32; 3 * 2000];
    z[1234] = f32::NAN; // row 0
    z[2000] = f32::NAN; // row 1, first element
    let z = Tensor::from_vec(z, (3, 2000), &gpu).unwrap();
    let s: Vec<Vec<f32>> = row_stats(&z, &Tensor::new(&[1u32, 2, 3], &gpu).unwrap()).unwrap().to_vec2().unwrap();
    assert!(s[0].iter().chain(&s[1]).all(|x| x.is_nan()), "{s:?}");
    assert!(s[2].iter().all(|x| x.is_finite()), "{s:?}");
}

#[test]
fn out_of_range_target_gives_nan_not_a_crash() {
    let Some(gpu) = gpu() else { return };
    let z = Tensor::zeros((2, 10), DType::F32, &gpu).unwrap();
    let t = Tensor::new(&[3u32, 10], &gpu).unwrap();
    let s: Vec<Vec<f32>> = row_stats(&z, &t).unwrap().to_vec2().unwrap();
    assert!((s[0][0] + 10f32.ln()).abs() < 1e-6 && s[1][0].is_nan(), "{s:?}");
}

/// Run `op` on `x` as a Var of dtype `dt` on `dev`, backprop `sum(y * up)`, and return `y` and `dy/dx` on
/// the CPU in f32.
fn forward_backward(
    dev: &Device,
    dt: DType,
    x: &Tensor,
    up: &Tensor,
    op: impl Fn(&Tensor) -> Tensor,
) -> (Tensor, Tensor) {
    let xv = Var::from_tensor(&x.to_dtype(dt).unwrap().to_device(dev).unwrap()).unwrap();
    let y = op(xv.as_tensor());
    let loss = (y.to_dtype(DType::F32).unwrap() * up.to_device(dev).unwrap()).unwrap().sum_all().unwrap();
    let g = loss.backward().unwrap();
    let cpu = |t: &Tensor| t.to_device(&Device::Cpu).unwrap().to_dtype(DType::F32).unwrap();
    (cpu(&y), cpu(g.get(xv.as_tensor()).unwrap()))
}

/// `op` on the GPU against `op` on the CPU, forward and backward, in `dt` within `(rtol, atol)`.
fn gpu_matches_cpu(
    what: &str,
    gpu: &Device,
    dt: DType,
    tol: (f32, f32),
    x: &Tensor,
    up: &Tensor,
    op: impl Fn(&Tensor) -> Tensor,
) {
    let (y_c, g_c) = forward_backward(&Device::Cpu, dt, x, up, &op);
    let (y_g, g_g) = forward_backward(gpu, dt, x, up, &op);
    for (part, a, b) in [("y", &y_g, &y_c), ("grad", &g_g, &g_c)] {
        let (ok, worst) = close(a, b, tol.0, tol.1);
        println!("{what} {dt:?} {part}: worst |a-b|/(atol max|b| + rtol|b|) {worst:.2e}");
        assert!(ok, "{what} {dt:?} {part}: worst {worst}");
    }
}

#[test]
fn masked_softmax_matches_the_cpu_forward_and_backward() {
    let Some(gpu) = gpu() else { return };
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(13);
    // 2 rows x 3 heads x 300 queries over 301 keys (one cached): row 0 causal, row 1 two packed
    // segments and trailing padding.
    let (b, h, t, s) = (2, 3, 300, 301);
    let mut r = Vec::new();
    for i in 0..t as u32 {
        r.extend_from_slice(&[0, i + 1]);
    }
    for i in 0..t as u32 {
        let q = i + 1;
        r.extend_from_slice(&match i {
            0..=119 => [0, q],
            120..=279 => [121, q],
            297 => [5, 10_000], // past the last key: clipped
            298 => [7, 3],      // empty: an all-zero row
            _ => [q, q],
        });
    }
    let ranges = Tensor::from_vec(r, (b, t, 2), &Device::Cpu).unwrap();
    let x = random(&mut rng, (b * h * t, s), 6.0).reshape((b, h, t, s)).unwrap();
    let up = random(&mut rng, (b * h * t, s), 1.0).reshape((b, h, t, s)).unwrap();
    for (dt, tol) in [(DType::F32, (1e-4, 1e-7)), (DType::BF16, (2e-2, 1e-6)), (DType::F16, (5e-3, 1e-6))] {
        // Scores up to +-6 at scale 1: peaked rows with tiny probabilities.
        gpu_matches_cpu("masked_softmax", &gpu, dt, tol, &x, &up, |x| {
            masked_softmax(x, &ranges.to_device(x.device()).unwrap(), 1.0).unwrap()
        });
    }
}

#[test]
fn rms_norm_matches_the_cpu_forward_and_backward() {
    let Some(gpu) = gpu() else { return };
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(17);
    // Rows of a real hidden size and of an odd one (not a multiple of the block). The weight's gradient is
    // grpo selftest's (rms_norm bwd).
    for (rows, h) in [(1100, 896), (33, 77)] {
        let x = random(&mut rng, (rows, h), 8.0);
        let w = (random(&mut rng, (1, h), 0.5) + 1.0).unwrap().squeeze(0).unwrap();
        let up = random(&mut rng, (rows, h), 1.0);
        for (dt, tol) in [(DType::F32, (1e-4, 1e-6)), (DType::BF16, (2e-2, 1e-4)), (DType::F16, (5e-3, 1e-4))] {
            let what = format!("rms_norm {rows}x{h}");
            gpu_matches_cpu(&what, &gpu, dt, tol, &x, &up, |x| {
                rms_norm(x, &w.to_device(x.device()).unwrap().to_dtype(x.dtype()).unwrap(), 1e-6).unwrap()
            });
        }
    }
}

#[test]
fn rope_matches_the_cpu_forward_and_backward() {
    let Some(gpu) = gpu() else { return };
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(19);
    let (b, t, h, d) = (2, 37, 3, 64);
    let x = random(&mut rng, (b * t * h, d), 4.0).reshape((b, t, h, d)).unwrap();
    let angles = random(&mut rng, (b * t, d / 2), 50.0);
    let angles = Tensor::cat(&[&angles, &angles], 1).unwrap().reshape((b, 1, t, d)).unwrap();
    let (cos, sin) = (angles.cos().unwrap(), angles.sin().unwrap());
    let up = random(&mut rng, (b * h * t, d), 1.0).reshape((b, h, t, d)).unwrap();
    for (dt, tol) in [(DType::F32, (1e-5, 1e-6)), (DType::BF16, (1e-2, 1e-3)), (DType::F16, (2e-3, 1e-4))] {
        gpu_matches_cpu("rope", &gpu, dt, tol, &x, &up, |x| {
            let on = |t: &Tensor| t.to_dtype(x.dtype()).unwrap().to_device(x.device()).unwrap();
            rope(x, &on(&cos), &on(&sin)).unwrap()
        });
    }
}

/// Flash attention's output and gradients of q, k, v (`sum(o * up)`) on `dev` in `dt`, on the CPU in f32.
fn flash_forward_backward(dev: &Device, dt: DType, qkv: &[Tensor; 3], up: &Tensor, ranges: &Tensor) -> Vec<Tensor> {
    let vars: Vec<Var> =
        qkv.iter().map(|x| Var::from_tensor(&x.to_dtype(dt).unwrap().to_device(dev).unwrap()).unwrap()).collect();
    let ranges = ranges.to_device(dev).unwrap();
    let o = flash_attention(vars[0].as_tensor(), vars[1].as_tensor(), vars[2].as_tensor(), &ranges, 0.125).unwrap();
    assert_eq!(o.dtype(), dt);
    let loss = (o.to_dtype(DType::F32).unwrap() * up.to_device(dev).unwrap()).unwrap().sum_all().unwrap();
    let g = loss.backward().unwrap();
    let cpu = |t: &Tensor| t.to_device(&Device::Cpu).unwrap().to_dtype(DType::F32).unwrap();
    let mut out = vec![cpu(&o)];
    out.extend(vars.iter().map(|v| cpu(g.get(v.as_tensor()).unwrap())));
    out
}

/// Ranges `[B, T, 2]` over `past + T` keys: row 0 causal; row 1 two packed segments, a query whose range
/// runs past the keys (clipped), an empty one (zero output and gradient) and trailing padding.
fn flash_ranges(b: usize, t: usize, past: usize) -> Tensor {
    let mut r = Vec::new();
    for row in 0..b {
        for i in 0..t as u32 {
            let q = i + past as u32;
            let third = t as u32 / 3;
            r.extend_from_slice(&match (row, i) {
                (0, _) => [0, q],
                (_, i) if i < third => [0, q],
                (_, i) if i + 3 < t as u32 && i < 2 * third + 20 => [third + past as u32, q],
                (_, i) if i + 3 == t as u32 => [5, 1_000_000],
                (_, i) if i + 2 == t as u32 => [7, 3],
                _ => [q, q],
            });
        }
    }
    Tensor::from_vec(r, (b, t, 2), &Device::Cpu).unwrap()
}

#[test]
fn flash_attention_matches_the_cpu_forward_and_backward() {
    let Some(gpu) = gpu() else { return };
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(23);
    // (heads, kv heads, queries, cached keys, head dim): GQA groups of 1, 2 and 4; lengths that are not
    // multiples of the tiles; head dims of every tile choice; a decode step (one query over a cache).
    let cases = [(2, 2, 300, 1, 64), (4, 2, 257, 0, 128), (4, 1, 100, 37, 256), (8, 2, 1, 200, 128), (2, 1, 45, 0, 40)];
    for (h, kv, t, past, d) in cases {
        let b = 2;
        let s = t + past;
        let mut draw = |n: usize, m: usize, scale: f32| random(&mut rng, (n, m), scale);
        let q = draw(b * h * t, d, 3.0).reshape((b, h, t, d)).unwrap();
        let k = draw(b * kv * s, d, 3.0).reshape((b, kv, s, d)).unwrap();
        let v = draw(b * kv * s, d, 1.0).reshape((b, kv, s, d)).unwrap();
        let up = draw(b * h * t, d, 1.0).reshape((b, h, t, d)).unwrap();
        let ranges = flash_ranges(b, t, past);
        for (dt, tol) in [(DType::F32, 1e-4), (DType::BF16, 2e-2), (DType::F16, 5e-3)] {
            let qkv = [q.clone(), k.clone(), v.clone()];
            let cpu = flash_forward_backward(&Device::Cpu, dt, &qkv, &up, &ranges);
            let gpu_out = flash_forward_backward(&gpu, dt, &qkv, &up, &ranges);
            for (part, (a, c)) in ["o", "dq", "dk", "dv"].iter().zip(gpu_out.iter().zip(&cpu)) {
                // NaN when either holds a NaN or an infinity (candle's `max` would pass over a NaN).
                let err = grpo::selftest::max_error(a, c).unwrap();
                println!("flash_attention h={h} kv={kv} t={t} past={past} d={d} {dt:?} {part}: max|gpu-cpu|/max|cpu| {err:.2e}");
                assert!(err < tol, "flash_attention h={h} kv={kv} t={t} d={d} {dt:?} {part}: {err}");
            }
        }
    }
}
