//! The launches of the element-wise steps of the chunked attention (kernels/flash_attention.cu, `fa_*`), as
//! launch plans (launch.rs) over buffers the driver already holds: every buffer is an input of the plan, in
//! the order of the kernel's pointer parameters, and the kernels update some in place. One function per
//! backend method, shared by the GPU backend and the emulator's (tests).

use candle_core::{DType, Result};

use super::driver::{KeyBlock, QueryBlock};
use crate::kernels::launch::{kernel_name, Arg, Launch, Module, Plan};

/// Threads per block: one block per stacked row (up to a few thousand keys, or D values).
const THREADS: u32 = 128;

/// A step: its kernel, grid and scalar arguments; the pointers come first, from the caller's buffers.
pub(crate) struct Step {
    base: &'static str,
    grid: (usize, usize),
    scalars: Vec<Arg>,
}

impl Step {
    /// The plan of the step over buffers `(name, dtype, len)` in the kernel's order, for GEMM dtype `dtype`.
    pub fn plan(&self, dtype: DType, buffers: &[(&'static str, DType, usize)]) -> Result<Plan> {
        let mut p = Plan::default();
        let mut args: Vec<Arg> = buffers.iter().map(|&(name, dt, len)| p.input(name, dt, len)).collect();
        args.extend(self.scalars.iter().copied());
        p.launch(Launch {
            module: Module::FlashAttention,
            kernel: kernel_name(self.base, dtype)?,
            grid: (self.grid.0 as u32, self.grid.1 as u32, 1),
            block: (THREADS, 1, 1),
            shared_bytes: 0,
            args,
        })?;
        Ok(p)
    }
}

fn u32s<const N: usize>(xs: [usize; N]) -> Vec<Arg> {
    xs.iter().map(|&x| Arg::U32(x as u32)).collect()
}

fn rows(blk: &QueryBlock) -> (usize, usize) {
    (blk.m(), blk.batch())
}

/// `fa_gather(src, dst, h, kv, t, d, i0, n)`.
pub(crate) fn gather(blk: &QueryBlock) -> Step {
    let dm = blk.dims;
    Step { base: "fa_gather", grid: rows(blk), scalars: u32s([dm.h, dm.kv, dm.t, dm.d, blk.i0, blk.n]) }
}

/// `fa_scatter(acc, dst + offset, h, kv, t, d, i0, n)`.
pub(crate) fn scatter(blk: &QueryBlock) -> Step {
    Step { base: "fa_scatter", ..gather(blk) }
}

/// `fa_cast(src, dst + offset, len)`.
pub(crate) fn cast(len: usize) -> Step {
    Step { base: "fa_cast", grid: (len.div_ceil(THREADS as usize).clamp(1, 4096), 1), scalars: u32s([len]) }
}

/// `fa_fwd_scores(s, p, stats, acc, ranges, h, kv, t, s, d, i0, n, j0, nk, scale)`.
pub(crate) fn fwd_scores(blk: &QueryBlock, kb: &KeyBlock, scale: f32) -> Step {
    let dm = blk.dims;
    let mut scalars = u32s([dm.h, dm.kv, dm.t, dm.s, dm.d, blk.i0, blk.n, kb.j0, kb.nk]);
    scalars.push(Arg::F32(scale));
    Step { base: "fa_fwd_scores", grid: rows(blk), scalars }
}

/// `fa_fwd_finish(stats, acc, out, lse, h, kv, t, d, i0, n)`.
pub(crate) fn fwd_finish(blk: &QueryBlock) -> Step {
    Step { base: "fa_fwd_finish", ..gather(blk) }
}

/// `fa_bwd_scores(s, dp, lse_delta, ranges, p, ds, h, kv, t, s, i0, n, j0, nk, scale, B H T)`.
pub(crate) fn bwd_scores(blk: &QueryBlock, kb: &KeyBlock, scale: f32) -> Step {
    let dm = blk.dims;
    let mut scalars = u32s([dm.h, dm.kv, dm.t, dm.s, blk.i0, blk.n, kb.j0, kb.nk]);
    scalars.push(Arg::F32(scale));
    scalars.push(Arg::U32((dm.b * dm.h * dm.t) as u32));
    Step { base: "fa_bwd_scores", grid: rows(blk), scalars }
}
