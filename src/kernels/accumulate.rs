//! Gradient accumulation in place: a micro-batch's gradient (f32, bf16 or f16) added into its parameter's f32
//! accumulator, `acc += f32(g)`, in one pass that writes no new buffer. candle's `acc + g.to_dtype(f32)`
//! writes the cast and a new sum (16 bytes a parameter more, and a new weight-sized buffer a micro-batch).
//! A weight's gradient as candle's product backward leaves it, a transposed view, is read where it lies.
//! CPU implementation here; CUDA kernel in kernels/accumulate.cu.

use candle_core::{CpuStorage, InplaceOp2, Layout, Result, Tensor};
use rayon::prelude::*;

use super::cpu::Elem;
#[cfg(any(test, feature = "cuda"))]
use super::launch::{kernel_name, Arg, Launch, Module, Plan};
#[cfg(any(test, feature = "cuda"))]
use candle_core::DType;

/// Elements per block of the CPU's parallel loop.
const BLOCK: usize = 1 << 14;

/// Where element `(r, c)` of the gradient lies: `start + r s0 + c s1`, for `rows x cols` elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Strides {
    start: usize,
    rows: usize,
    cols: usize,
    s0: usize,
    s1: usize,
}

impl Strides {
    /// A contiguous layout (one row), or a transposed 2-D view of a contiguous buffer; `None` otherwise.
    fn of(l: &Layout) -> Option<Self> {
        let n = l.shape().elem_count();
        let start = l.start_offset();
        if l.is_contiguous() {
            return Some(Strides { start, rows: 1, cols: n, s0: n, s1: 1 });
        }
        match (l.dims(), l.stride()) {
            (&[rows, cols], &[1, s1]) if s1 == rows => Some(Strides { start, rows, cols, s0: 1, s1 }),
            _ => None,
        }
    }

    /// The elements of the buffer the view covers, from `start`.
    #[cfg(any(test, feature = "cuda"))]
    fn span(&self) -> usize {
        if self.rows * self.cols == 0 {
            return 0;
        }
        (self.rows - 1) * self.s0 + (self.cols - 1) * self.s1 + 1
    }
}

fn cpu_accumulate<T: Elem>(acc: &mut [f32], g: &[T], s: Strides) {
    acc.par_chunks_mut(BLOCK).enumerate().for_each(|(b, chunk)| {
        for (j, a) in chunk.iter_mut().enumerate() {
            let i = b * BLOCK + j;
            let (r, c) = (i / s.cols, i % s.cols);
            *a += g[s.start + r * s.s0 + c * s.s1].f32();
        }
    });
}

struct Accumulate(Strides);

impl InplaceOp2 for Accumulate {
    fn name(&self) -> &'static str {
        "accumulate"
    }

    fn cpu_fwd(&self, dst: &mut CpuStorage, dst_l: &Layout, g: &CpuStorage, _: &Layout) -> Result<()> {
        let CpuStorage::F32(acc) = dst else { candle_core::bail!("accumulate: the accumulator must be f32") };
        let (a, n) = (dst_l.start_offset(), dst_l.shape().elem_count());
        let acc = &mut acc[a..a + n];
        match g {
            CpuStorage::F32(g) => cpu_accumulate(acc, g, self.0),
            CpuStorage::BF16(g) => cpu_accumulate(acc, g, self.0),
            CpuStorage::F16(g) => cpu_accumulate(acc, g, self.0),
            _ => candle_core::bail!("accumulate: the gradient must be f32, bf16 or f16"),
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        dst: &mut candle_core::CudaStorage,
        dst_l: &Layout,
        g: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<()> {
        use candle_core::backend::BackendStorage;
        let s = self.0;
        let plan = accumulate_plan(g.dtype(), s)?;
        // The accumulator is the plan's first input, written in place; the gradient its covered span.
        let span = Layout::contiguous_with_offset(s.span(), s.start);
        super::cuda::run(&plan, &[(&*dst, dst_l), (g, &span)])?;
        Ok(())
    }
}

/// `acc += f32(g)` in place, for an f32 contiguous accumulator `acc` and a gradient `g` of its shape (any
/// float dtype; read where it lies when contiguous or a transposed 2-D view, copied first otherwise).
pub fn accumulate(acc: &Tensor, g: &Tensor) -> Result<()> {
    if acc.dtype() != candle_core::DType::F32 || !acc.is_contiguous() || acc.shape() != g.shape() {
        candle_core::bail!(
            "accumulate: an f32 contiguous accumulator of the gradient's shape {:?}, got {:?} {:?}",
            g.dims(),
            acc.dtype(),
            acc.dims()
        );
    }
    if acc.elem_count() > u32::MAX as usize {
        candle_core::bail!("accumulate: {} elements in one tensor, at most 2^32 - 1", acc.elem_count());
    }
    let g = match Strides::of(g.layout()) {
        Some(_) => g.clone(),
        None => g.contiguous()?,
    };
    let strides = Strides::of(g.layout()).expect("a contiguous layout has strides");
    acc.inplace_op2(&g, &Accumulate(strides))
}

/// The launch over the gradient's elements: `accumulate` for a contiguous gradient (256 threads a block, 4
/// elements a thread, at most 1,024 blocks), `accumulate_t` for a transposed one (32 x 32 tiles, a block of
/// 32 x 8 threads each).
#[cfg(any(test, feature = "cuda"))]
fn accumulate_plan(dtype: DType, s: Strides) -> Result<Plan> {
    let n = s.rows * s.cols;
    let mut p = Plan::default();
    let (acc, g) = (p.input("accumulator", DType::F32, n), p.input("gradient", dtype, s.span()));
    let (kernel, grid, block, args) = if s.s1 == 1 {
        let grid = (n.div_ceil(256 * 4).min(1024) as u32, 1, 1);
        (kernel_name("accumulate", dtype)?, grid, (256, 1, 1), vec![acc, g, Arg::U32(n as u32)])
    } else {
        let tiles = (s.rows.div_ceil(32) as u32, s.cols.div_ceil(32) as u32, 1);
        let args = vec![acc, g, Arg::U32(s.rows as u32), Arg::U32(s.cols as u32)];
        (kernel_name("accumulate_t", dtype)?, tiles, (32, 8, 1), args)
    };
    p.launch(Launch { module: Module::Accumulate, kernel, grid, block, shared_bytes: 0, args })?;
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::super::testing::seeded;
    use super::*;
    use candle_core::DType;

    /// Contiguous, transposed and other views, in every dtype: the same sum as candle's cast and add, bit for
    /// bit, in place (the accumulator's storage, not a new one).
    #[test]
    fn equals_the_cast_and_add_in_place() {
        let base = seeded(&[37, 53], 1.0, 1);
        let views: Vec<Tensor> = vec![
            seeded(&[37, 53], 1.0, 2),
            seeded(&[53, 37], 1.0, 3).t().unwrap(),
            seeded(&[37, 60], 1.0, 4).narrow(1, 2, 53).unwrap(),
            seeded(&[1, 37 * 53 + 5], 1.0, 5).narrow(1, 5, 37 * 53).unwrap().reshape((37, 53)).unwrap(),
        ];
        for g in views {
            for dtype in [DType::F32, DType::BF16, DType::F16] {
                let g = g.to_dtype(dtype).unwrap();
                let g = if g.is_contiguous() { g } else { g.contiguous().unwrap() };
                // The transposed view again (a cast makes a contiguous copy).
                for g in [g.clone(), g.t().unwrap().contiguous().unwrap().t().unwrap()] {
                    let acc = base.copy().unwrap();
                    let want = (&base + g.to_dtype(DType::F32).unwrap()).unwrap();
                    accumulate(&acc, &g).unwrap();
                    let (a, w) = (acc.to_vec2::<f32>().unwrap(), want.to_vec2::<f32>().unwrap());
                    assert_eq!(a, w, "{dtype:?} {:?}", g.layout());
                }
            }
        }
        let bad = accumulate(&base.to_dtype(DType::BF16).unwrap(), &base).unwrap_err().to_string();
        assert!(bad.contains("f32 contiguous accumulator"), "{bad}");
    }

    /// kernels/accumulate.cu on the emulator against the CPU op, bit for bit: contiguous (in fours with a
    /// tail, more fours than the grid's threads, and a gradient one element off alignment: one at a time)
    /// and transposed (partial tiles at both edges), every dtype, fewer elements than a block.
    #[test]
    fn the_kernel_equals_the_cpu_op() {
        let mut cases =
            vec![(1100, 1000, DType::BF16, true), (1100, 1000, DType::F16, false), (45, 77, DType::F32, true)];
        cases.extend([(3, 41, DType::BF16, false), (3, 41, DType::F32, false)]);
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            cases.extend([(5, 7, dtype, false), (5, 7, dtype, true)]);
        }
        for (rows, cols, dtype, transposed) in cases {
            let acc = seeded(&[rows, cols], 1.0, 6);
            let src = seeded(&if transposed { [cols, rows] } else { [rows, cols] }, 1.0, 7).to_dtype(dtype).unwrap();
            let g = if transposed { src.t().unwrap() } else { src.clone() };
            let s = Strides::of(g.layout()).unwrap();
            let plan = accumulate_plan(dtype, s).unwrap();
            let flat = |t: &Tensor| t.flatten_all().unwrap();
            let want = acc.copy().unwrap();
            accumulate(&want, &g).unwrap();
            let got = super::super::emu::run_in_place(&plan, &[&flat(&acc), &flat(&src)]).unwrap();
            let what = format!("{rows}x{cols} {dtype:?} transposed {transposed}");
            assert_eq!(got[0].to_vec1::<f32>().unwrap(), flat(&want).to_vec1::<f32>().unwrap(), "{what}");
            if !transposed {
                // The gradient one element into a buffer one longer: no pointer of it 8- or 16-byte aligned.
                let mut plan = plan.clone();
                plan.buffers[1].len += 1;
                plan.launches[0].args[1] = Arg::Buffer { index: 1, offset: 1 };
                let padded = Tensor::cat(&[&flat(&src).narrow(0, 0, 1).unwrap(), &flat(&src)], 0).unwrap();
                let got = super::super::emu::run_in_place(&plan, &[&flat(&acc), &padded]).unwrap();
                assert_eq!(got[0].to_vec1::<f32>().unwrap(), flat(&want).to_vec1::<f32>().unwrap(), "{what}, off");
            }
        }
    }
}
