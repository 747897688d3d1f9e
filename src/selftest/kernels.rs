//! The fused ops of [`crate::kernels`] on a device against their composite references on the CPU.
//!
//! Each check draws seeded inputs in f32, rounds them to the dtype under test, runs the op on the device
//! in that dtype (forward, then the backward of `sum(y * up)`), and runs the composite reference on the
//! CPU in f32 from the same rounded inputs: what remains is the op's own error. The shapes are those
//! where kernels go wrong: rows that are not a multiple of a block, a real 151,936-token vocabulary,
//! grouped-query heads, packed segments, clipped key ranges, a decode step over a cache, every head-dim
//! tile of flash attention.

use candle_core::{DType, Device, Result, Tensor, Var, D};
use rand::{Rng, SeedableRng};

use super::Part;
use crate::kernels::{
    accumulate, bias_add, flash_attention, flash_attention_recorded, from_heads, logprobs_entropy,
    logprobs_entropy_reference, lora_linear, lora_linear_reference, masked_softmax, masked_softmax_reference,
    matrix_attention, rms_norm, rms_norm_reference, rope, rope_reference, row_dot, row_grad, row_stats, sum_squares,
    swiglu, swiglu_reference, to_heads, wgmma_layouts, wgrad_accumulate, Dropout, GpuKernels,
};
use crate::kernels::{paged_attention, paged_attention_reference, PagedLayout};

/// One kernel check: `run(device, dtype)` gives the error of each compared part.
pub struct KernelCheck {
    pub op: &'static str,
    pub run: fn(&Device, DType) -> Result<Vec<Part>>,
    /// The tolerance of every part in a dtype.
    pub tolerance: fn(DType) -> f32,
}

/// Every fused op, in the order of the table.
pub const CHECKS: &[KernelCheck] = &[
    KernelCheck { op: "row_stats", run: row_stats_check, tolerance: exact_inputs },
    KernelCheck { op: "row_grad", run: row_grad_check, tolerance: rounded_output },
    KernelCheck { op: "rms_norm", run: rms_norm_check, tolerance: rounded_output },
    KernelCheck { op: "rope", run: rope_check, tolerance: rounded_output },
    KernelCheck { op: "swiglu", run: swiglu_check, tolerance: rounded_output },
    KernelCheck { op: "bias_add", run: bias_add_check, tolerance: rounded_output },
    KernelCheck { op: "heads", run: heads_check, tolerance: exact_inputs },
    KernelCheck { op: "accumulate", run: accumulate_check, tolerance: exact_inputs },
    KernelCheck { op: "wgrad", run: wgrad_check, tolerance: summed_products },
    KernelCheck { op: "sum_squares", run: sum_squares_check, tolerance: exact_inputs },
    KernelCheck { op: "row_dot", run: row_dot_check, tolerance: exact_inputs },
    KernelCheck { op: "lora_linear", run: lora_linear_check, tolerance: rounded_matmul },
    KernelCheck { op: "masked_softmax", run: masked_softmax_check, tolerance: rounded_output },
    KernelCheck { op: "flash_attention", run: flash_attention_check, tolerance: rounded_output },
    KernelCheck { op: "flash_attention_mma", run: flash_attention_mma_check, tolerance: rounded_output },
    KernelCheck {
        op: "flash_attention_mma_atomic_dq",
        run: flash_attention_mma_atomic_check,
        tolerance: rounded_output,
    },
    KernelCheck { op: "flash_attention_wgmma", run: flash_attention_wgmma_check, tolerance: rounded_output },
    KernelCheck {
        op: "flash_attention_wgmma_atomic_dq",
        run: flash_attention_wgmma_atomic_check,
        tolerance: rounded_output,
    },
    KernelCheck { op: "wgmma_layouts", run: wgmma_layouts_check, tolerance: rounded_output },
    KernelCheck { op: "logprobs_entropy", run: logprobs_entropy_check, tolerance: rounded_matmul },
    KernelCheck { op: "paged_attention", run: paged_attention_check, tolerance: rounded_output },
];

/// Ops whose output is f32 from f32 sums (row statistics): only the order of the sums differs.
fn exact_inputs(_: DType) -> f32 {
    1e-5
}

/// A GEMM into f32 of rounded inputs: exact products, f32 sums in cuBLAS's order (f32 inputs may run as
/// TF32 where the handle allows it).
fn summed_products(dtype: DType) -> f32 {
    match dtype {
        DType::F32 => 2e-3,
        _ => 1e-4,
    }
}

/// Ops that compute in f32 and round their output (and the incoming gradient) to the dtype: a few units
/// of its rounding error, relative to the largest value.
fn rounded_output(dtype: DType) -> f32 {
    match dtype {
        DType::BF16 => 2e-2,
        DType::F16 => 3e-3,
        _ => 1e-4,
    }
}

/// The log-prob op: its logits come out of a matmul in the dtype, rounded there before the row sums.
fn rounded_matmul(dtype: DType) -> f32 {
    match dtype {
        DType::BF16 => 5e-2,
        DType::F16 => 1e-2,
        _ => 1e-4,
    }
}

/// Seeded uniform values in `[-scale, scale)`, f32 on the CPU.
fn uniform(rng: &mut impl Rng, shape: &[usize], scale: f32) -> Result<Tensor> {
    let n = shape.iter().product();
    Tensor::from_vec((0..n).map(|_| rng.gen_range(-scale..scale)).collect::<Vec<f32>>(), shape, &Device::Cpu)
}

/// `x` rounded to `dtype` and back to f32: what the device computes from.
fn rounded(x: &Tensor, dtype: DType) -> Result<Tensor> {
    x.to_dtype(dtype)?.to_dtype(DType::F32)
}

/// `op` on `inputs` (as variables of `dtype` on `device`): its output and the gradients of
/// `sum(y * up)` with respect to each input, all as f32 on the CPU.
fn forward_backward(
    device: &Device,
    dtype: DType,
    inputs: &[&Tensor],
    up: &Tensor,
    op: impl Fn(&[Tensor]) -> Result<Tensor>,
) -> Result<(Tensor, Vec<Tensor>)> {
    let vars =
        inputs.iter().map(|x| Var::from_tensor(&x.to_dtype(dtype)?.to_device(device)?)).collect::<Result<Vec<_>>>()?;
    let y = op(&vars.iter().map(|v| v.as_tensor().clone()).collect::<Vec<_>>())?;
    let loss = (y.to_dtype(DType::F32)? * up.to_device(device)?)?.sum_all()?;
    let grads = loss.backward()?;
    let cpu = |t: &Tensor| t.to_device(&Device::Cpu)?.to_dtype(DType::F32);
    let g = vars
        .iter()
        .map(|v| match grads.get(v.as_tensor()) {
            Some(g) => cpu(g),
            None => candle_core::bail!("no gradient reached an input"),
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((cpu(&y)?, g))
}

/// The op on the device in `dtype` and the reference on the CPU in f32, from the same rounded inputs
/// and upstream gradient: `[fwd, bwd]` parts, the backward's error the largest over the inputs.
fn fwd_bwd_parts(
    device: &Device,
    dtype: DType,
    inputs: &[&Tensor],
    up: &Tensor,
    op: impl Fn(&[Tensor]) -> Result<Tensor>,
    reference: impl Fn(&[Tensor]) -> Result<Tensor>,
) -> Result<Vec<Part>> {
    let inputs = inputs.iter().map(|x| rounded(x, dtype)).collect::<Result<Vec<_>>>()?;
    let inputs: Vec<&Tensor> = inputs.iter().collect();
    let up = rounded(up, dtype)?;
    let (y, g) = forward_backward(device, dtype, &inputs, &up, op)?;
    let (y_ref, g_ref) = forward_backward(&Device::Cpu, DType::F32, &inputs, &up, reference)?;
    let mut bwd = Part { name: "bwd", error: 0.0 };
    for (a, b) in g.iter().zip(&g_ref) {
        let e = Part::compare("bwd", a, b)?.error;
        // NaN wins (f32::max would drop it).
        if e.is_nan() || e > bwd.error {
            bwd.error = e;
        }
    }
    Ok(vec![Part::compare("fwd", &y, &y_ref)?, bwd])
}

fn rng(seed: u64) -> rand_chacha::ChaCha8Rng {
    rand_chacha::ChaCha8Rng::seed_from_u64(seed)
}

/// Random targets in `0..vocab`.
fn targets(rng: &mut impl Rng, n: usize, vocab: usize) -> Result<Tensor> {
    Tensor::from_vec((0..n).map(|_| rng.gen_range(0..vocab as u32)).collect::<Vec<_>>(), n, &Device::Cpu)
}

/// Log-prob, entropy and log-sum-exp of each row of f32 `z` from candle's log-softmax: `[n, 3]`.
fn row_stats_reference(z: &Tensor, t: &Tensor) -> Result<Tensor> {
    let logp_all = candle_nn::ops::log_softmax(z, D::Minus1)?;
    let logp = logp_all.gather(&t.unsqueeze(1)?, 1)?.squeeze(1)?;
    let entropy = (logp_all.exp()? * &logp_all)?.sum(D::Minus1)?.neg()?;
    let lse = (z - &logp_all)?.narrow(1, 0, 1)?.squeeze(1)?;
    Tensor::stack(&[logp, entropy, lse], 1)
}

/// Logits rows `[n, V]` of a real vocabulary width and of one that is not a multiple of any block.
const ROW_SHAPES: [(usize, usize); 2] = [(33, 151_936), (70, 1001)];

fn row_stats_check(device: &Device, dtype: DType) -> Result<Vec<Part>> {
    let mut rng = rng(7);
    let mut error = 0f32;
    for (n, v) in ROW_SHAPES {
        let z = rounded(&uniform(&mut rng, &[n, v], 20.0)?, dtype)?;
        let t = targets(&mut rng, n, v)?;
        let s = row_stats(&z.to_dtype(dtype)?.to_device(device)?, &t.to_device(device)?)?;
        error = worst(error, Part::compare("", &s, &row_stats_reference(&z, &t)?)?.error);
    }
    Ok(vec![Part { name: "fwd", error }])
}

fn row_grad_check(device: &Device, dtype: DType) -> Result<Vec<Part>> {
    let mut rng = rng(8);
    let mut error = 0f32;
    for (n, v) in ROW_SHAPES {
        let z = rounded(&uniform(&mut rng, &[n, v], 20.0)?, dtype)?;
        let t = targets(&mut rng, n, v)?;
        let g = uniform(&mut rng, &[n], 2.0)?;
        let lse = row_stats_reference(&z, &t)?.narrow(1, 2, 1)?.squeeze(1)?;
        let coef = Tensor::stack(&[&lse, &g], 1)?;
        let on = |x: &Tensor| x.to_device(device);
        let dz = row_grad(&on(&z.to_dtype(dtype)?)?, &on(&t)?, &on(&coef)?)?;
        // g (onehot(t) - softmax(z)).
        let onehot = Tensor::zeros((n, v), DType::F32, &Device::Cpu)?.scatter_add(
            &t.unsqueeze(1)?,
            &Tensor::ones((n, 1), DType::F32, &Device::Cpu)?,
            1,
        )?;
        let reference = (onehot - candle_nn::ops::softmax(&z, D::Minus1)?)?.broadcast_mul(&g.unsqueeze(1)?)?;
        error = worst(error, Part::compare("", &dz, &reference)?.error);
    }
    Ok(vec![Part { name: "fwd", error }])
}

/// The larger error, NaN winning.
fn worst(a: f32, b: f32) -> f32 {
    if a.is_nan() || b.is_nan() {
        f32::NAN
    } else {
        a.max(b)
    }
}

/// The worse of each part over several cases.
fn worst_parts(cases: Vec<Vec<Part>>) -> Vec<Part> {
    let mut out: Vec<Part> = Vec::new();
    for parts in cases {
        for p in parts {
            match out.iter_mut().find(|q| q.name == p.name) {
                Some(q) => q.error = worst(q.error, p.error),
                None => out.push(p),
            }
        }
    }
    out
}

fn rms_norm_check(device: &Device, dtype: DType) -> Result<Vec<Part>> {
    let mut rng = rng(17);
    // A real hidden size over more rows than the backward's blocks, and an odd one (not a multiple of the
    // block).
    let cases = [(1100, 896), (33, 77)]
        .into_iter()
        .map(|(rows, h)| {
            let x = uniform(&mut rng, &[rows, h], 8.0)?;
            let w = (uniform(&mut rng, &[h], 0.5)? + 1.0)?;
            let up = uniform(&mut rng, &[rows, h], 1.0)?;
            fwd_bwd_parts(
                device,
                dtype,
                &[&x, &w],
                &up,
                |x| rms_norm(&x[0], &x[1], 1e-6),
                |x| rms_norm_reference(&x[0], &x[1], 1e-6),
            )
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(worst_parts(cases))
}

/// The MLP's activation on an intermediate width that is not a multiple of a block.
fn swiglu_check(device: &Device, dtype: DType) -> Result<Vec<Part>> {
    let mut rng = rng(23);
    let (g, u) = (uniform(&mut rng, &[37, 4864], 6.0)?, uniform(&mut rng, &[37, 4864], 2.0)?);
    let up = uniform(&mut rng, &[37, 4864], 1.0)?;
    fwd_bwd_parts(device, dtype, &[&g, &u], &up, |x| swiglu(&x[0], &x[1]), |x| swiglu_reference(&x[0], &x[1]))
}

/// A q, k, v projection's bias (the 0.5B's 896 + 2 x 128 columns) over rows that are not a multiple of the
/// bias gradient's blocks, and a width of no whole 16-byte packs (the scalar path).
fn bias_add_check(device: &Device, dtype: DType) -> Result<Vec<Part>> {
    let mut rng = rng(24);
    let cases = [(1037, 1152), (45, 13)]
        .into_iter()
        .map(|(rows, cols)| {
            let (x, b) = (uniform(&mut rng, &[rows, cols], 2.0)?, uniform(&mut rng, &[cols], 1.0)?);
            let up = uniform(&mut rng, &[rows, cols], 1.0)?;
            fwd_bwd_parts(device, dtype, &[&x, &b], &up, |x| bias_add(&x[0], &x[1]), |x| x[0].broadcast_add(&x[1]))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(worst_parts(cases))
}

/// The transposes around the attention (v to heads at the 0.5B's 2 KV heads of 64, the output back from 14
/// heads) against candle's transpose and copy, and a head dim of no whole 16-byte runs.
fn heads_check(device: &Device, dtype: DType) -> Result<Vec<Part>> {
    let mut rng = rng(25);
    let cases = [([1, 77, 2, 64], false), ([1, 14, 77, 64], true), ([2, 5, 3, 6], false)]
        .into_iter()
        .map(|(shape, back)| {
            let (x, up) =
                (uniform(&mut rng, &shape, 1.0)?, uniform(&mut rng, &[shape[0], shape[2], shape[1], shape[3]], 1.0)?);
            let op = if back { from_heads } else { to_heads };
            fwd_bwd_parts(device, dtype, &[&x], &up, |x| op(&x[0]), |x| x[0].transpose(1, 2)?.contiguous())
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(worst_parts(cases))
}

/// Gradient accumulation into f32 in place: a contiguous gradient (in fours, with a tail) and a transposed
/// one (as a weight's gradient comes out of candle's product backward: 32 x 32 tiles, partial at the
/// edges), against the CPU's cast and add of the same rounded values.
fn accumulate_check(device: &Device, dtype: DType) -> Result<Vec<Part>> {
    let mut rng = rng(26);
    let cases = [(false, 131, 77), (true, 1100, 45)]
        .into_iter()
        .map(|(transposed, rows, cols)| {
            let acc = uniform(&mut rng, &[rows, cols], 1.0)?;
            let src = rounded(&uniform(&mut rng, &if transposed { [cols, rows] } else { [rows, cols] }, 1.0)?, dtype)?;
            let g = if transposed { src.t()? } else { src.clone() };
            // A buffer of its own (on the CPU, to_device shares `acc`'s, which the op writes in place).
            let on_device = acc.to_device(device)?.copy()?;
            let src_device = src.to_dtype(dtype)?.to_device(device)?;
            accumulate(&on_device, &if transposed { src_device.t()? } else { src_device })?;
            let want = (&acc + g)?;
            Ok(vec![Part::compare("fwd", &on_device.to_device(&Device::Cpu)?, &want)?])
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(worst_parts(cases))
}

/// A weight's gradient added into its f32 accumulator by one GEMM (`acc += g^T x`, cuBLAS with beta 1 on
/// the GPU), over many rows and over a few, against the CPU's f32 product of the same rounded values
/// added to the accumulator.
fn wgrad_check(device: &Device, dtype: DType) -> Result<Vec<Part>> {
    let mut rng = rng(29);
    let cases = [(1100, 77, 45), (33, 151, 64)]
        .into_iter()
        .map(|(rows, out, inp)| {
            let acc = uniform(&mut rng, &[out, inp], 1.0)?;
            let g = rounded(&uniform(&mut rng, &[rows, out], 1.0)?, dtype)?;
            let x = rounded(&uniform(&mut rng, &[rows, inp], 1.0)?, dtype)?;
            let on_device = acc.to_device(device)?.copy()?;
            let on = |t: &Tensor| t.to_dtype(dtype)?.to_device(device);
            wgrad_accumulate(&on_device, &on(&g)?, &on(&x)?)?;
            let want = (&acc + g.t()?.matmul(&x)?)?;
            Ok(vec![Part::compare("fwd", &on_device.to_device(&Device::Cpu)?, &want)?])
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(worst_parts(cases))
}

/// The gradient norm's sum of squares over more elements than the kernel's grid has threads (its stride
/// loop) and over a few, against the CPU's f64 sum of the same rounded values.
fn sum_squares_check(device: &Device, dtype: DType) -> Result<Vec<Part>> {
    let mut rng = rng(27);
    let cases = [[1100, 896], [33, 77]]
        .into_iter()
        .map(|shape| {
            let x = rounded(&uniform(&mut rng, &shape, 4.0)?, dtype)?;
            let got = sum_squares(&x.to_dtype(dtype)?.to_device(device)?)?.to_device(&Device::Cpu)?;
            let want = x.to_dtype(DType::F64)?.sqr()?.sum_all()?.to_dtype(DType::F32)?;
            Ok(vec![Part::compare("fwd", &got, &want)?])
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(worst_parts(cases))
}

/// The rows' dot products of the attention backward's delta (rows of head dims 64 and 128, and of 6, whose
/// elements go one at a time), against the composite f64 sum of the same rounded inputs.
fn row_dot_check(device: &Device, dtype: DType) -> Result<Vec<Part>> {
    let mut rng = rng(28);
    let cases = [[2, 14, 77, 64], [1, 4, 33, 128], [1, 1, 5, 6]]
        .into_iter()
        .map(|shape| {
            let (a, b) =
                (rounded(&uniform(&mut rng, &shape, 1.0)?, dtype)?, rounded(&uniform(&mut rng, &shape, 1.0)?, dtype)?);
            let on = |x: &Tensor| x.to_dtype(dtype)?.to_device(device);
            let got = row_dot(&on(&a)?, &on(&b)?)?.to_device(&Device::Cpu)?;
            let want = (a.to_dtype(DType::F64)? * b.to_dtype(DType::F64)?)?.sum(D::Minus1)?.to_dtype(DType::F32)?;
            Ok(vec![Part::compare("fwd", &got, &want)?])
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(worst_parts(cases))
}

/// A LoRA projection (the frozen weight and bias in the dtype, f32 adapters) with dropout: the mask the
/// device draws must be the CPU's, element for element.
fn lora_linear_check(device: &Device, dtype: DType) -> Result<Vec<Part>> {
    let mut rng = rng(29);
    let (n, i, o, r) = (77, 96, 80, 8);
    let x = uniform(&mut rng, &[n, i], 1.0)?;
    let (a, b) = (uniform(&mut rng, &[r, i], 0.3)?, uniform(&mut rng, &[o, r], 0.3)?);
    let w = rounded(&uniform(&mut rng, &[o, i], 0.3)?, dtype)?;
    let bias = rounded(&uniform(&mut rng, &[o], 0.2)?, dtype)?;
    let up = uniform(&mut rng, &[n, o], 1.0)?;
    let dropout = Some(Dropout { p: 0.2, seed: 77 });
    let op = |v: &[Tensor], fused: bool| -> Result<Tensor> {
        let like = |t: &Tensor| t.to_device(v[0].device())?.to_dtype(v[0].dtype());
        let (w, bias) = (like(&w)?, like(&bias)?);
        let (a, b) = (v[1].to_dtype(DType::F32)?, v[2].to_dtype(DType::F32)?);
        let f = if fused { lora_linear } else { lora_linear_reference };
        f(&v[0], (&w, Some(&bias)), (&a, &b), 2.0, dropout)
    };
    fwd_bwd_parts(device, dtype, &[&x, &a, &b], &up, |v| op(v, true), |v| op(v, false))
}

fn rope_check(device: &Device, dtype: DType) -> Result<Vec<Part>> {
    let mut rng = rng(19);
    let (b, t, h, d) = (2, 37, 3, 64);
    let x = uniform(&mut rng, &[b, t, h, d], 4.0)?;
    let half = uniform(&mut rng, &[b, 1, t, d / 2], 50.0)?;
    let angles = Tensor::cat(&[&half, &half], 3)?;
    let (cos, sin) = (rounded(&angles.cos()?, dtype)?, rounded(&angles.sin()?, dtype)?);
    let up = uniform(&mut rng, &[b, h, t, d], 1.0)?;
    let on = |c: &Tensor, x: &Tensor| c.to_dtype(x.dtype())?.to_device(x.device());
    fwd_bwd_parts(
        device,
        dtype,
        &[&x],
        &up,
        |x| rope(&x[0], &on(&cos, &x[0])?, &on(&sin, &x[0])?),
        |x| rope_reference(&x[0], &cos, &sin),
    )
}

/// Ranges `[B, T, 2]` over `past + T` keys: row 0 causal; row 1 two packed segments, a query whose
/// range runs past the keys (clipped) and trailing padding (each padding query sees itself).
fn ranges(b: usize, t: usize, past: usize) -> Result<Tensor> {
    let mut r = Vec::with_capacity(b * t * 2);
    let third = t / 3;
    for row in 0..b {
        for i in 0..t {
            let q = (i + past) as u32;
            r.extend_from_slice(&match (row, i) {
                (0, _) => [0, q],
                (_, i) if i < third => [0, q],
                (_, i) if i + 3 == t => [5.min(q), 1_000_000],
                (_, i) if i < 2 * third + 2 => [(third + past) as u32, q],
                _ => [q, q],
            });
        }
    }
    Tensor::from_vec(r, (b, t, 2), &Device::Cpu)
}

fn masked_softmax_check(device: &Device, dtype: DType) -> Result<Vec<Part>> {
    let mut rng = rng(13);
    // 3 heads x 300 queries over 301 keys (one cached).
    let (b, h, t, s) = (2, 3, 300, 301);
    let r = ranges(b, t, s - t)?;
    let x = uniform(&mut rng, &[b, h, t, s], 6.0)?;
    let up = uniform(&mut rng, &[b, h, t, s], 1.0)?;
    let rd = r.to_device(device)?;
    fwd_bwd_parts(
        device,
        dtype,
        &[&x],
        &up,
        |x| masked_softmax(&x[0], &rd, 0.7),
        |x| masked_softmax_reference(&x[0], &r, 0.7),
    )
}

fn flash_attention_check(device: &Device, dtype: DType) -> Result<Vec<Part>> {
    // (heads, kv heads, queries, cached keys, head dim): GQA groups of 1, 2 and 4, lengths that are not
    // multiples of the tiles, every tile choice of head dim, a decode step over a cache.
    let cases = [(2, 2, 130, 1, 64), (4, 2, 97, 0, 128), (4, 1, 40, 17, 256), (8, 2, 1, 200, 128), (2, 1, 45, 0, 40)];
    attention_check(device, dtype, &cases, flash_attention)
}

/// The tensor-core kernels' cases: both head dims they take, lengths past their blocks (64 rows; the
/// warpgroup kernels' 128), a decode step over a cache, and at both head dims a causal row whose last
/// query block spans seven key steps of 64, so that the warpgroup kernels' rings of five slots refill.
const TENSOR_CORE_CASES: [(usize, usize, usize, usize, usize); 6] = [
    (2, 2, 130, 1, 64),
    (4, 2, 97, 0, 128),
    (8, 2, 1, 200, 128),
    (4, 1, 200, 3, 64),
    (4, 1, 400, 3, 128),
    (2, 1, 400, 0, 64),
];

/// The tensor-core attention `kernels` (bf16 and f16; f32 takes the chunked path) on the cases above.
fn tensor_core_check(device: &Device, dtype: DType, kernels: GpuKernels) -> Result<Vec<Part>> {
    attention_check(device, dtype, &TENSOR_CORE_CASES, |q, k, v, r, s| {
        flash_attention_recorded(q, k, v, r, s, kernels, None)
    })
}

/// The tensor-core kernels (`flash_attention_mma`).
fn flash_attention_mma_check(device: &Device, dtype: DType) -> Result<Vec<Part>> {
    tensor_core_check(device, dtype, GpuKernels::TensorCores { atomic_dq: false, warpgroup: false })
}

/// Their backward with dq by f32 atomics (`deterministic_attention = false`).
fn flash_attention_mma_atomic_check(device: &Device, dtype: DType) -> Result<Vec<Part>> {
    tensor_core_check(device, dtype, GpuKernels::TensorCores { atomic_dq: true, warpgroup: false })
}

/// The warpgroup kernels (`flash_attention_wgmma`: on compute capability 9.0; the tensor-core kernels
/// elsewhere).
fn flash_attention_wgmma_check(device: &Device, dtype: DType) -> Result<Vec<Part>> {
    tensor_core_check(device, dtype, GpuKernels::TensorCores { atomic_dq: false, warpgroup: true })
}

/// Their backward with dq by f32 atomics.
fn flash_attention_wgmma_atomic_check(device: &Device, dtype: DType) -> Result<Vec<Part>> {
    tensor_core_check(device, dtype, GpuKernels::TensorCores { atomic_dq: true, warpgroup: true })
}

/// Each operand layout the warpgroup attention kernels give `wgmma` (one product each) against the
/// matmul of the same rounded inputs: rows only on a GPU with wgmma (compute capability 9.0), in bf16
/// and f16; none elsewhere.
fn wgmma_layouts_check(device: &Device, dtype: DType) -> Result<Vec<Part>> {
    if dtype == DType::F32 {
        return Ok(Vec::new());
    }
    let mut rng = rng(29);
    let (a, b) =
        (uniform(&mut rng, &[64, 16], 2.0)?.to_dtype(dtype)?, uniform(&mut rng, &[16, 64], 2.0)?.to_dtype(dtype)?);
    let Some(got) = wgmma_layouts(&a.to_device(device)?, &b.to_device(device)?)? else { return Ok(Vec::new()) };
    let want = a.to_dtype(DType::F32)?.matmul(&b.to_dtype(DType::F32)?)?;
    let names = ["registers x K-major", "registers x MN-major", "K-major x K-major", "MN-major x MN-major"];
    names.iter().enumerate().map(|(v, name)| Part::compare(name, &got.get(v)?, &want)).collect()
}

/// `attend` against the matrix reference on `cases` (heads, kv heads, queries, cached keys, head dim)
/// of two rows with packed segments.
fn attention_check(
    device: &Device,
    dtype: DType,
    cases: &[(usize, usize, usize, usize, usize)],
    attend: impl Fn(&Tensor, &Tensor, &Tensor, &Tensor, f64) -> Result<Tensor>,
) -> Result<Vec<Part>> {
    let mut rng = rng(23);
    let scale = 0.125;
    let parts = cases
        .iter()
        .map(|&(h, kv, t, past, d)| {
            let (b, s) = (2, t + past);
            let q = uniform(&mut rng, &[b, h, t, d], 3.0)?;
            let k = uniform(&mut rng, &[b, kv, s, d], 3.0)?;
            let v = uniform(&mut rng, &[b, kv, s, d], 1.0)?;
            let up = uniform(&mut rng, &[b, h, t, d], 1.0)?;
            let r = ranges(b, t, past)?;
            let rd = r.to_device(device)?;
            fwd_bwd_parts(
                device,
                dtype,
                &[&q, &k, &v],
                &up,
                |x| attend(&x[0], &x[1], &x[2], &rd, scale),
                |x| matrix_attention(&x[0], &x[1], &x[2], |sc| masked_softmax_reference(sc, &r, scale)),
            )
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(worst_parts(parts))
}

fn logprobs_entropy_check(device: &Device, dtype: DType) -> Result<Vec<Part>> {
    let mut rng = rng(11);
    let (n, h, v) = (96, 128, 32_000);
    let hidden = uniform(&mut rng, &[n, h], 2.0)?;
    let weight = uniform(&mut rng, &[v, h], 0.1)?;
    let t = targets(&mut rng, n, v)?;
    let up = uniform(&mut rng, &[n], 1.0)?;
    let td = t.to_device(device)?;
    // Log-probs only (the entropy's gradient is checked by tests/cuda_ops.rs and the unit tests): `[n]`,
    // against `up`.
    let logp = |lp: Tensor| lp.narrow(1, 0, 1)?.squeeze(1);
    let entropy = |lp: &Tensor| lp.narrow(1, 1, 1);
    // 4 MiB chunks: 32 rows of 32,000 logits, three chunks.
    let chunk = 4 << 20;
    let mut parts = fwd_bwd_parts(
        device,
        dtype,
        &[&hidden, &weight],
        &up,
        |x| logp(logprobs_entropy(&x[0], &x[1], &td, chunk)?),
        |x| logp(logprobs_entropy_reference(&x[0], &x[1], &t)?),
    )?;
    let (hr, wr) = (rounded(&hidden, dtype)?, rounded(&weight, dtype)?);
    let on = |x: &Tensor| x.to_dtype(dtype)?.to_device(device);
    let e = entropy(&logprobs_entropy(&on(&hr)?, &on(&wr)?, &td, chunk)?)?;
    parts.push(Part::compare("entropy", &e, &entropy(&logprobs_entropy_reference(&hr, &wr, &t)?)?)?);
    Ok(parts)
}

/// Generation's attention over the paged KV cache: 14 query heads over 2 KV heads of dim 64 (the 0.5B
/// shape), blocks of 16 in a shuffled order; one sequence decoding at 1,300 positions (the GPU kernel's
/// context in three splits), one prefilling a chunk of 5 queries, one at its first position.
fn paged_attention_check(device: &Device, dtype: DType) -> Result<Vec<Part>> {
    let mut rng = rng(31);
    let (bs, blocks) = (16usize, 96usize);
    let mut order: Vec<u32> = (0..blocks as u32).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, rng.gen_range(0..=i));
    }
    let max_blocks = 1300usize.div_ceil(bs);
    let mut tables = vec![0u32; 3 * max_blocks];
    tables[..max_blocks].copy_from_slice(&order[..max_blocks]);
    tables[max_blocks..max_blocks + 2].copy_from_slice(&order[max_blocks..max_blocks + 2]);
    tables[2 * max_blocks] = order[max_blocks + 2];
    let layout = PagedLayout {
        block_size: bs,
        max_blocks,
        tables,
        token_seq: vec![0, 1, 1, 1, 1, 1, 2],
        token_ctx: vec![1300, 14, 15, 16, 17, 18, 1],
    };
    let q = rounded(&uniform(&mut rng, &[14, 7, 64], 1.0)?, dtype)?;
    let kv = rounded(&uniform(&mut rng, &[4, blocks * bs, 64], 1.0)?, dtype)?;
    let on = |x: &Tensor| x.to_dtype(dtype)?.to_device(device);
    let got = paged_attention(&on(&q)?, &on(&kv)?, &layout, 0.125)?.to_device(&Device::Cpu)?;
    let want = paged_attention_reference(&q, &kv, &layout, 0.125)?;
    Ok(vec![Part::compare("fwd", &got, &want)?])
}
