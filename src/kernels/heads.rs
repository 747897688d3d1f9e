//! The transposes around the attention as copies of their own, with each other as backward:
//! [`to_heads`] `[B, T, H, D] -> [B, H, T, D]` (v into the attention kernels' layout) and [`from_heads`] the
//! other way (the attention's output back to its rows). candle's `transpose(1, 2).contiguous()` copies
//! element by element through 64-bit strided indexing; kernels/heads.cu moves 16-byte runs of each row.
//! CPU implementation here.

use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::cpu::{with_float, Elem, IntoStorage};
#[cfg(any(test, feature = "cuda"))]
use super::launch::{kernel_name, Arg, Launch, Module, Plan};
#[cfg(any(test, feature = "cuda"))]
use candle_core::DType;

/// `(b, t, h, d)` of the input (`[B, T, H, D]`, or `[B, H, T, D]` when `back`).
fn dims(l: &Layout, back: bool) -> Result<(usize, usize, usize, usize)> {
    let (b, x, y, d) = l.shape().dims4()?;
    if l.shape().elem_count() > u32::MAX as usize {
        candle_core::bail!("heads transpose of {:?}: at most 2^32 - 1 elements", l.shape().dims());
    }
    Ok(if back { (b, y, x, d) } else { (b, x, y, d) })
}

fn out_shape((b, t, h, d): (usize, usize, usize, usize), back: bool) -> Shape {
    if back {
        Shape::from((b, t, h, d))
    } else {
        Shape::from((b, h, t, d))
    }
}

fn cpu_heads<T: Elem>(src: &[T], (_, t, h, d): (usize, usize, usize, usize), back: bool) -> Vec<T> {
    let mut out = vec![T::of(0.0); src.len()];
    // One output row of D per (b, h, t) or (b, t, h).
    out.par_chunks_mut(d.max(1)).enumerate().for_each(|(r, o)| {
        let s = if back {
            let (bi, ti, hi) = (r / (t * h), (r / h) % t, r % h);
            ((bi * h + hi) * t + ti) * d
        } else {
            let (bi, hi, ti) = (r / (h * t), (r / t) % h, r % t);
            ((bi * t + ti) * h + hi) * d
        };
        o.copy_from_slice(&src[s..s + d]);
    });
    out
}

struct Heads {
    back: bool,
}

impl CustomOp1 for Heads {
    fn name(&self) -> &'static str {
        if self.back {
            "from-heads"
        } else {
            "to-heads"
        }
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let dims = dims(l, self.back)?;
        let back = self.back;
        let out = with_float!((s, l, "x") => |x| IntoStorage::storage(cpu_heads(x, dims, back)));
        Ok((out, out_shape(dims, back)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let dims = dims(l, self.back)?;
        let y = super::cuda::run(&heads_plan(s.dtype(), dims, self.back)?, &[(s, l)])?.remove(0);
        Ok((y, out_shape(dims, self.back)))
    }

    fn bwd(&self, _x: &Tensor, _y: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(grad.contiguous()?.apply_op1(Heads { back: !self.back })?))
    }
}

/// `x` `[B, T, H, D]` as `[B, H, T, D]`, contiguous (`x.transpose(1, 2).contiguous()`), with a backward.
pub fn to_heads(x: &Tensor) -> Result<Tensor> {
    x.contiguous()?.apply_op1(Heads { back: false })
}

/// `x` `[B, H, T, D]` as `[B, T, H, D]`, contiguous, with a backward.
pub fn from_heads(x: &Tensor) -> Result<Tensor> {
    x.contiguous()?.apply_op1(Heads { back: true })
}

/// The launch of `heads` over `[b, t, h, d]` of `dtype` (`back`: from `[b, h, t, d]`): a thread per 16-byte
/// run of a row, 256 per block, at most 1,024 blocks (a grid-stride loop covers the rest).
#[cfg(any(test, feature = "cuda"))]
fn heads_plan(dtype: DType, (b, t, h, d): (usize, usize, usize, usize), back: bool) -> Result<Plan> {
    let len = b * t * h * d;
    let mut p = Plan::default();
    let src = p.input("x", dtype, len);
    let dst = p.output("transposed", dtype, len);
    let dims = [b, t, h, d, usize::from(back)].map(|n| Arg::U32(n as u32));
    let blocks = super::launch::packed_grid(len, dtype);
    p.launch(Launch {
        module: Module::Heads,
        kernel: kernel_name("heads", dtype)?,
        grid: (blocks, 1, 1),
        block: (256, 1, 1),
        shared_bytes: 0,
        args: [src, dst].into_iter().chain(dims).collect(),
    })?;
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::super::testing::seeded;
    use super::*;
    use candle_core::{DType, Var};

    /// Both ways against candle's transpose and copy, values and gradients (each the other's op), exactly.
    #[test]
    fn equal_the_transpose_and_its_gradient() {
        let x = Var::from_tensor(&seeded(&[2, 5, 3, 8], 1.0, 1)).unwrap();
        let up = seeded(&[2, 3, 5, 8], 1.0, 2);
        let y = to_heads(x.as_tensor()).unwrap();
        let want = x.as_tensor().transpose(1, 2).unwrap().contiguous().unwrap();
        let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!((y.dims(), flat(&y)), (want.dims(), flat(&want)));
        let g = (&y * &up).unwrap().sum_all().unwrap().backward().unwrap();
        assert_eq!(flat(g.get(x.as_tensor()).unwrap()), flat(&up.transpose(1, 2).unwrap().contiguous().unwrap()));
        let back = from_heads(&y).unwrap();
        assert_eq!((back.dims(), flat(&back)), (x.as_tensor().dims(), flat(x.as_tensor())));
    }

    /// kernels/heads.cu on the emulator against the CPU op, both ways, every dtype: rows of whole 16-byte
    /// runs (head dims 64 and 8 in f32), rows of single elements (head dim 6), more runs than the grid's
    /// threads, nothing at all.
    #[test]
    fn the_kernel_equals_the_cpu_op() {
        for dims in [(2, 7, 3, 64), (1, 5, 2, 6), (1, 2100, 2, 64), (0, 3, 2, 8)] {
            for dtype in [DType::F32, DType::BF16, DType::F16] {
                for back in [false, true] {
                    let (b, t, h, d) = dims;
                    let shape = if back { [b, h, t, d] } else { [b, t, h, d] };
                    let x = seeded(&shape, 1.0, 3).to_dtype(dtype).unwrap();
                    let plan = heads_plan(dtype, dims, back).unwrap();
                    let got = super::super::emu::run(&plan, &[&x.flatten_all().unwrap()]).unwrap().remove(0);
                    let op = if back { from_heads } else { to_heads };
                    let want = op(&x).unwrap().flatten_all().unwrap();
                    let bits = |t: &Tensor| t.to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap();
                    assert_eq!(bits(&got), bits(&want), "{dims:?} {dtype:?} back {back}");
                }
            }
        }
    }
}
