//! The CPU [`Backend`] of the chunked attention: GEMMs by the `gemm` crate (what candle's CPU matmul
//! uses), batch entries in parallel with rayon; element-wise steps in Rust over rows, with a vectorisable
//! `exp`. Buffers are f32 (`In` included: the op converts half-precision inputs once).

use candle_core::Result;
use rayon::prelude::*;

use super::driver::{Backend, Gemm, KeyBlock, Operand, QueryBlock};

pub(crate) struct CpuBackend;

/// `e^x` for `x <= 88` to about 2 ulp, in straight-line code the compiler vectorises (f32::exp is a
/// libm call per element): `2^n e^f` with `n = round(x / ln 2)`, `|f| <= ln 2 / 2`, and a degree-6
/// Taylor polynomial of `e^f` (relative error < 2e-7). Below -87 the result is ~1e-38 rather than 0.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    let x = x.clamp(-87.0, 88.0);
    let n = (x * std::f32::consts::LOG2_E + 12_582_912.0) - 12_582_912.0;
    let f = x - n * LN2_HI - n * LN2_LO;
    let p = 1.0 + f * (1.0 + f * (0.5 + f * (1.0 / 6.0 + f * (1.0 / 24.0 + f * (1.0 / 120.0 + f / 720.0)))));
    f32::from_bits((p.to_bits() as i32).wrapping_add((n as i32) << 23) as u32)
}

/// Operand strides `(rows, cols)` for gemm's `(rs, cs)`.
fn strides(o: &Operand) -> (isize, isize) {
    match o.trans {
        false => (o.ld as isize, 1),
        true => (1, o.ld as isize),
    }
}

/// The largest element a batched operand of `rows x cols` (as op() sees it) reaches, plus one.
fn extent(o: &Operand, batch: usize, rows: usize, cols: usize) -> usize {
    let (r, c) = if o.trans { (cols, rows) } else { (rows, cols) };
    o.offset + (batch - 1) * o.batch_stride + (r - 1) * o.ld + c
}

fn check(g: &Gemm, a: usize, b: usize, c: usize) -> Result<()> {
    let empty = g.batch == 0 || g.m == 0 || g.n == 0 || g.k == 0;
    if !empty
        && (extent(&g.a, g.batch, g.m, g.k) > a
            || extent(&g.b, g.batch, g.k, g.n) > b
            || extent(&g.c, g.batch, g.m, g.n) > c
            || (g.batch > 1 && g.c.batch_stride < (g.m - 1) * g.c.ld + g.n))
    {
        candle_core::bail!("flash attention: GEMM {g:?} outside its buffers ({a}, {b}, {c})");
    }
    Ok(())
}

/// One batch entry: `c = alpha a b + beta c` (gemm's own alpha scales the destination).
fn gemm_one(g: &Gemm, a: &[f32], b: &[f32], c: &mut [f32], par: gemm::Parallelism) {
    let ((ars, acs), (brs, bcs)) = (strides(&g.a), strides(&g.b));
    // SAFETY: `check` keeps every element the product reads in `a` and `b` and writes in `c`.
    unsafe {
        gemm::gemm(
            g.m,
            g.n,
            g.k,
            c.as_mut_ptr(),
            1,
            g.c.ld as isize,
            g.beta != 0.0,
            a.as_ptr(),
            acs,
            ars,
            b.as_ptr(),
            bcs,
            brs,
            g.beta,
            g.alpha,
            false,
            false,
            false,
            par,
        )
    }
}

/// The `n`-element chunks of `x[..batch n]`.
fn rows_of(x: &mut [f32], batch: usize, n: usize) -> rayon::slice::ChunksMut<'_, f32> {
    x[..batch * n].par_chunks_mut(n)
}

impl Backend for CpuBackend {
    type In = Vec<f32>;
    type F32 = Vec<f32>;
    type U32 = Vec<u32>;

    fn alloc_in(&self, len: usize) -> Result<Vec<f32>> {
        Ok(vec![0.0; len])
    }

    fn zeros_f32(&self, len: usize) -> Result<Vec<f32>> {
        Ok(vec![0.0; len])
    }

    fn gemm(&self, g: &Gemm, a: &Vec<f32>, b: &Vec<f32>, c: &mut Vec<f32>) -> Result<()> {
        check(g, a.len(), b.len(), c.len())?;
        if g.batch == 0 || g.m == 0 || g.n == 0 {
            return Ok(());
        }
        let at = |e: usize| &a[g.a.offset + e * g.a.batch_stride..];
        let bt = |e: usize| &b[g.b.offset + e * g.b.batch_stride..];
        let c = &mut c[g.c.offset..];
        let threads = rayon::current_num_threads();
        if g.batch == 1 || g.batch < threads {
            // Few entries: one after the other, each product split over the threads.
            for e in 0..g.batch {
                let stride = g.c.batch_stride;
                gemm_one(g, at(e), bt(e), &mut c[e * stride..], gemm::Parallelism::Rayon(threads));
            }
        } else {
            c.par_chunks_mut(g.c.batch_stride)
                .take(g.batch)
                .enumerate()
                .for_each(|(e, c)| gemm_one(g, at(e), bt(e), c, gemm::Parallelism::None));
        }
        Ok(())
    }

    fn gather(&self, blk: &QueryBlock, src: &Vec<f32>, dst: &mut Vec<f32>) -> Result<()> {
        let (m, d) = (blk.m(), blk.dims.d);
        rows_of(dst, blk.batch(), m * d).enumerate().for_each(|(e, dst)| {
            for (row, out) in dst.chunks_exact_mut(d).enumerate() {
                let at = blk.row(e, row).2 * d;
                out.copy_from_slice(&src[at..at + d]);
            }
        });
        Ok(())
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
    ) -> Result<()> {
        let (n, m, nk, d) = (blk.batch(), blk.m(), kb.nk, blk.dims.d);
        let (ms, ls) = stats.split_at_mut(n * m);
        let rows = rows_of(p, n, m * nk).zip(rows_of(ms, n, m)).zip(rows_of(ls, n, m)).zip(rows_of(acc, n, m * d));
        rows.enumerate().for_each(|(e, (((p, ms), ls), acc))| {
            for row in 0..m {
                let p = &mut p[row * nk..(row + 1) * nk];
                let Some((a, z)) = visible(blk, kb, ranges, e, row) else {
                    p.fill(0.0);
                    continue;
                };
                let x = &s[(e * m + row) * nk..][..nk];
                let mx = x[a..z].iter().fold(f32::NEG_INFINITY, |mx, &v| mx.max(scale * v));
                let m_old = if ls[row] > 0.0 { ms[row] } else { f32::NEG_INFINITY };
                let m_new = m_old.max(mx);
                p[..a].fill(0.0);
                p[z..].fill(0.0);
                for (p, &x) in p[a..z].iter_mut().zip(&x[a..z]) {
                    *p = exp(scale * x - m_new);
                }
                let alpha = if ls[row] > 0.0 { (m_old - m_new).exp() } else { 0.0 };
                ls[row] = ls[row] * alpha + p[a..z].iter().sum::<f32>();
                ms[row] = m_new;
                if alpha != 1.0 {
                    acc[row * d..(row + 1) * d].iter_mut().for_each(|v| *v *= alpha);
                }
            }
        });
        Ok(())
    }

    fn fwd_finish(
        &self,
        blk: &QueryBlock,
        stats: &Vec<f32>,
        acc: &Vec<f32>,
        out: &mut Vec<f32>,
        lse: &mut Vec<f32>,
    ) -> Result<()> {
        let (n, m, d) = (blk.batch(), blk.m(), blk.dims.d);
        for e in 0..n {
            for row in 0..m {
                let (mx, l) = (stats[e * m + row], stats[n * m + e * m + row]);
                let at = blk.row(e, row).2;
                let (inv, lr) = if l > 0.0 { (1.0 / l, mx + l.ln()) } else { (0.0, f32::NEG_INFINITY) };
                let src = &acc[(e * m + row) * d..][..d];
                out[at * d..(at + 1) * d].iter_mut().zip(src).for_each(|(o, a)| *o = a * inv);
                lse[at] = lr;
            }
        }
        Ok(())
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
    ) -> Result<()> {
        let (n, m, nk) = (blk.batch(), blk.m(), kb.nk);
        let rows_total = blk.dims.b * blk.dims.h * blk.dims.t;
        rows_of(p, n, m * nk).zip(rows_of(ds, n, m * nk)).enumerate().for_each(|(e, (p, ds))| {
            for row in 0..m {
                let (p, ds) = (&mut p[row * nk..(row + 1) * nk], &mut ds[row * nk..(row + 1) * nk]);
                p.fill(0.0);
                ds.fill(0.0);
                let Some((a, z)) = visible(blk, kb, ranges, e, row) else { continue };
                let at = blk.row(e, row).2;
                let (lse, delta) = (lse_delta[at], lse_delta[rows_total + at]);
                let (x, g) = (&s[(e * m + row) * nk..][a..z], &dp[(e * m + row) * nk..][a..z]);
                for (p, &x) in p[a..z].iter_mut().zip(x) {
                    *p = exp(scale * x - lse);
                }
                for ((ds, &p), &g) in ds[a..z].iter_mut().zip(&p[a..z]).zip(g) {
                    *ds = p * (g - delta);
                }
            }
        });
        Ok(())
    }

    fn scatter(&self, blk: &QueryBlock, acc: &Vec<f32>, dst: &mut Vec<f32>, offset: usize) -> Result<()> {
        let (m, d) = (blk.m(), blk.dims.d);
        for e in 0..blk.batch() {
            for row in 0..m {
                let at = offset + blk.row(e, row).2 * d;
                dst[at..at + d].copy_from_slice(&acc[(e * m + row) * d..][..d]);
            }
        }
        Ok(())
    }

    fn cast(&self, src: &Vec<f32>, len: usize, dst: &mut Vec<f32>, offset: usize) -> Result<()> {
        dst[offset..offset + len].copy_from_slice(&src[..len]);
        Ok(())
    }
}

/// The keys of block `kb` stacked row `row` of entry `e` sees, as `a..z` within the block.
pub(crate) fn visible(blk: &QueryBlock, kb: &KeyBlock, ranges: &[u32], e: usize, row: usize) -> Option<(usize, usize)> {
    let (lo, hi) = blk.keys(ranges, e, row)?;
    let (a, z) = (lo.max(kb.j0), (hi + 1).min(kb.j0 + kb.nk));
    (a < z).then(|| (a - kb.j0, z - kb.j0))
}
