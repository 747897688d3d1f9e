//! Attention computed block by block (the flash-attention algorithm) as one op with its own backward.
//!
//! For queries `q` `[B, H, T, D]`, keys and values `k`, `v` `[B, KV, S, D]` (H a multiple of KV: query
//! head `h` reads KV head `h / (H / KV)`, grouped-query attention) and, per query `(b, i)`, the keys
//! `lo..=hi` it may attend to (`ranges` `[B, T, 2]` u32, as for [`masked_softmax`](super::masked_softmax):
//! causal within a packed segment, padding queries see themselves only):
//!   s_ij = scale q_i . k_j,   L_i = log sum_{j in lo..=hi} exp(s_ij),   p_ij = exp(s_ij - L_i),
//!   o_i = sum_j p_ij v_j.
//! The forward walks the keys in blocks with an online softmax (running max and sum, f32 accumulators)
//! and keeps only `o` (in the inputs' dtype) and `L` (f32, one per query). The backward recomputes `p`
//! block by block from `L`:
//!   D_i = do_i . o_i,   ds_ij = p_ij (do_i . v_j - D_i),
//!   dq_i = scale sum_j ds_ij k_j,   dk_j = scale sum_i ds_ij q_i,   dv_j = sum_i p_ij do_i,
//! with dk, dv summed over the query heads of a group. Memory is O(T) per head both ways: nothing of
//! size T x S is ever allocated. A query with an empty range (lo > hi) outputs 0 and gets no gradient.
//! CPU reference here (rayon over query blocks and key blocks); CUDA kernels in
//! kernels/flash_attention.cu.

use std::sync::OnceLock;

use candle_core::{CpuStorage, CustomOp3, DType, Device, Layout, Result, Shape, Storage, Tensor, D};
use rayon::prelude::*;

use super::cpu::{contiguous, u32s, with_float, Elem, IntoStorage};

/// Query rows per block of the CPU path.
const CPU_QUERY_BLOCK: usize = 32;
/// Keys per block of the CPU path.
const CPU_KEY_BLOCK: usize = 64;

/// The sizes of one attention call.
#[derive(Debug, Clone, Copy)]
struct Dims {
    b: usize,
    h: usize,
    kv: usize,
    t: usize,
    s: usize,
    d: usize,
}

impl Dims {
    fn new(q: &Layout, k: &Layout, v: &Layout, ranges: &Layout) -> Result<Self> {
        let (b, h, t, d) = q.shape().dims4()?;
        let (bk, kv, s, dk) = k.shape().dims4()?;
        if k.shape() != v.shape() || bk != b || dk != d {
            candle_core::bail!(
                "flash attention: q {:?}, k {:?}, v {:?}: expected [B, H, T, D] and two [B, KV, S, D]",
                q.shape().dims(),
                k.shape().dims(),
                v.shape().dims()
            );
        }
        if kv == 0 || h % kv != 0 {
            candle_core::bail!("flash attention: {h} query heads are not a multiple of {kv} key/value heads");
        }
        if ranges.shape().dims() != [b, t, 2] {
            candle_core::bail!("attention ranges have shape {:?}, expected [{b}, {t}, 2]", ranges.shape().dims());
        }
        if t == 0 || s == 0 || d == 0 || s.max(t) > i32::MAX as usize || (b * h).max(b * kv) > u16::MAX as usize {
            candle_core::bail!("flash attention over {t} queries, {s} keys, {b}x{h} heads of {d}: out of range");
        }
        Ok(Self { b, h, kv, t, s, d })
    }

    fn group(&self) -> usize {
        self.h / self.kv
    }

    fn q_len(&self) -> usize {
        self.b * self.h * self.t * self.d
    }

    fn kv_len(&self) -> usize {
        self.b * self.kv * self.s * self.d
    }
}

/// The keys query `i` of batch row `b` attends to, clipped to the keys; `None` when empty.
fn key_range(ranges: &[u32], dims: &Dims, b: usize, i: usize) -> Option<(usize, usize)> {
    let lo = ranges[(b * dims.t + i) * 2] as usize;
    let hi = (ranges[(b * dims.t + i) * 2 + 1] as usize).min(dims.s - 1);
    (lo <= hi).then_some((lo, hi))
}

/// Dot product in f32 over 8 independent lanes (vectorised; the order differs from a plain sum).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    let mut acc = [0f32; 8];
    for (x, y) in ca.zip(cb) {
        for ((a, x), y) in acc.iter_mut().zip(x).zip(y) {
            *a += x * y;
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// `y += a x`.
fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

fn to_f32<T: Elem>(x: &[T], out: &mut Vec<f32>) {
    out.clear();
    out.extend(x.iter().map(|v| v.f32()));
}

/// The inputs of one call on the CPU.
struct Inputs<'a, T> {
    q: &'a [T],
    k: &'a [T],
    v: &'a [T],
    ranges: &'a [u32],
    dims: Dims,
    scale: f32,
}

/// What the backward adds: the output's gradient (inputs' dtype), and per query `L` and `D` (f32).
struct Upstream<'a, T> {
    dout: &'a [T],
    lse: &'a [f32],
    delta: &'a [f32],
}

/// A block of query rows `i0..i0 + n` of head `bh` (= b H + h): their queries in f32, key ranges, and
/// the span of keys any of them sees.
struct QueryBlock {
    q: Vec<f32>,
    ranges: Vec<Option<(usize, usize)>>,
    span: Option<(usize, usize)>,
    /// Offset of the head's keys and values.
    kv_base: usize,
}

impl<T: Elem> Inputs<'_, T> {
    fn query_block(&self, bh: usize, i0: usize, n: usize) -> QueryBlock {
        let Dims { h, t, s, d, .. } = self.dims;
        let (b, head) = (bh / h, bh % h);
        let mut q = Vec::with_capacity(n * d);
        to_f32(&self.q[(bh * t + i0) * d..(bh * t + i0 + n) * d], &mut q);
        let ranges: Vec<_> = (0..n).map(|r| key_range(self.ranges, &self.dims, b, i0 + r)).collect();
        let span = ranges.iter().flatten().fold(None, |acc: Option<(usize, usize)>, &(lo, hi)| match acc {
            None => Some((lo, hi)),
            Some((a, z)) => Some((a.min(lo), z.max(hi))),
        });
        let kv_base = (b * self.dims.kv + head / self.dims.group()) * s * d;
        QueryBlock { q, ranges, span, kv_base }
    }

    /// Keys and values `j0..j1` of the head at `base`, in f32.
    fn key_block(&self, base: usize, j0: usize, j1: usize, k: &mut Vec<f32>, v: &mut Vec<f32>) {
        let d = self.dims.d;
        to_f32(&self.k[base + j0 * d..base + j1 * d], k);
        to_f32(&self.v[base + j0 * d..base + j1 * d], v);
    }

    /// Output rows and log-sum-exps of the `lse.len()` queries from `i0` of head `bh`.
    fn forward_block(&self, bh: usize, i0: usize, out: &mut [T], lse: &mut [f32]) {
        let d = self.dims.d;
        let n = lse.len();
        let qb = self.query_block(bh, i0, n);
        let (mut m, mut l, mut acc) = (vec![f32::NEG_INFINITY; n], vec![0f32; n], vec![0f32; n * d]);
        let (mut kf, mut vf, mut sc) = (Vec::new(), Vec::new(), vec![0f32; CPU_KEY_BLOCK]);
        if let Some((kmin, kmax)) = qb.span {
            for j0 in (kmin..=kmax).step_by(CPU_KEY_BLOCK) {
                let j1 = (j0 + CPU_KEY_BLOCK).min(kmax + 1);
                self.key_block(qb.kv_base, j0, j1, &mut kf, &mut vf);
                for (r, range) in qb.ranges.iter().enumerate() {
                    let Some((lo, hi)) = *range else { continue };
                    let (a, z) = (lo.max(j0), hi.min(j1 - 1));
                    if a > z {
                        continue;
                    }
                    let qr = &qb.q[r * d..(r + 1) * d];
                    let mut mx = f32::NEG_INFINITY;
                    for j in a..=z {
                        let x = self.scale * dot(qr, &kf[(j - j0) * d..(j - j0 + 1) * d]);
                        sc[j - a] = x;
                        mx = mx.max(x);
                    }
                    let m_new = m[r].max(mx);
                    let alpha = (m[r] - m_new).exp();
                    let ar = &mut acc[r * d..(r + 1) * d];
                    ar.iter_mut().for_each(|x| *x *= alpha);
                    let mut sum = 0f32;
                    for j in a..=z {
                        let p = (sc[j - a] - m_new).exp();
                        sum += p;
                        axpy(ar, p, &vf[(j - j0) * d..(j - j0 + 1) * d]);
                    }
                    l[r] = l[r] * alpha + sum;
                    m[r] = m_new;
                }
            }
        }
        for r in 0..n {
            let (inv, lr) = if l[r] > 0.0 { (1.0 / l[r], m[r] + l[r].ln()) } else { (0.0, f32::NEG_INFINITY) };
            for (o, a) in out[r * d..(r + 1) * d].iter_mut().zip(&acc[r * d..(r + 1) * d]) {
                *o = T::of(a * inv);
            }
            lse[r] = lr;
        }
    }

    /// `(o, L)`: `[B, H, T, D]` in `T`, `[B, H, T]` f32.
    fn forward(&self) -> (Vec<T>, Vec<f32>) {
        let Dims { t, d, .. } = self.dims;
        let mut out = vec![T::of(0.0); self.dims.q_len()];
        let mut lse = vec![0f32; self.dims.b * self.dims.h * t];
        out.par_chunks_mut(t * d).zip(lse.par_chunks_mut(t)).enumerate().for_each(|(bh, (oh, lh))| {
            oh.par_chunks_mut(CPU_QUERY_BLOCK * d)
                .zip(lh.par_chunks_mut(CPU_QUERY_BLOCK))
                .enumerate()
                .for_each(|(blk, (o, l))| self.forward_block(bh, blk * CPU_QUERY_BLOCK, o, l));
        });
        (out, lse)
    }

    /// dq of the `dq.len() / D` queries from `i0` of head `bh`.
    fn dq_block(&self, up: &Upstream<T>, bh: usize, i0: usize, dq: &mut [T]) {
        let Dims { t, d, .. } = self.dims;
        let n = dq.len() / d;
        let qb = self.query_block(bh, i0, n);
        let mut g = Vec::with_capacity(n * d);
        to_f32(&up.dout[(bh * t + i0) * d..(bh * t + i0 + n) * d], &mut g);
        let mut acc = vec![0f32; n * d];
        let (mut kf, mut vf) = (Vec::new(), Vec::new());
        if let Some((kmin, kmax)) = qb.span {
            for j0 in (kmin..=kmax).step_by(CPU_KEY_BLOCK) {
                let j1 = (j0 + CPU_KEY_BLOCK).min(kmax + 1);
                self.key_block(qb.kv_base, j0, j1, &mut kf, &mut vf);
                for (r, range) in qb.ranges.iter().enumerate() {
                    let Some((lo, hi)) = *range else { continue };
                    let (qr, gr) = (&qb.q[r * d..(r + 1) * d], &g[r * d..(r + 1) * d]);
                    let (lse, delta) = (up.lse[bh * t + i0 + r], up.delta[bh * t + i0 + r]);
                    for j in lo.max(j0)..=hi.min(j1 - 1) {
                        let (kj, vj) = (&kf[(j - j0) * d..(j - j0 + 1) * d], &vf[(j - j0) * d..(j - j0 + 1) * d]);
                        let p = (self.scale * dot(qr, kj) - lse).exp();
                        let ds = p * (dot(gr, vj) - delta);
                        axpy(&mut acc[r * d..(r + 1) * d], ds, kj);
                    }
                }
            }
        }
        for (o, a) in dq.iter_mut().zip(&acc) {
            *o = T::of(self.scale * a);
        }
    }

    /// dk and dv of the `dk.len() / D` keys from `j0` of KV head `bkv` (= b KV + kv head), summed over
    /// the queries of every head of its group that see them.
    fn dkv_block(&self, up: &Upstream<T>, bkv: usize, j0: usize, dk: &mut [T], dv: &mut [T]) {
        let Dims { h, kv, t, s, d, .. } = self.dims;
        let n = dk.len() / d;
        let j1 = j0 + n;
        let (b, head) = (bkv / kv, bkv % kv);
        let (mut kf, mut vf) = (Vec::new(), Vec::new());
        self.key_block(bkv * s * d, j0, j1, &mut kf, &mut vf);
        let (mut dka, mut dva) = (vec![0f32; n * d], vec![0f32; n * d]);
        let (mut qf, mut gf) = (Vec::with_capacity(d), Vec::with_capacity(d));
        let group = self.dims.group();
        for hq in head * group..(head + 1) * group {
            let bh = b * h + hq;
            for i in 0..t {
                let Some((lo, hi)) = key_range(self.ranges, &self.dims, b, i) else { continue };
                let (a, z) = (lo.max(j0), hi.min(j1 - 1));
                if a > z {
                    continue;
                }
                let row = (bh * t + i) * d;
                to_f32(&self.q[row..row + d], &mut qf);
                to_f32(&up.dout[row..row + d], &mut gf);
                let (lse, delta) = (up.lse[bh * t + i], up.delta[bh * t + i]);
                for j in a..=z {
                    let c = (j - j0) * d;
                    let p = (self.scale * dot(&qf, &kf[c..c + d]) - lse).exp();
                    axpy(&mut dva[c..c + d], p, &gf);
                    let ds = p * (dot(&gf, &vf[c..c + d]) - delta);
                    axpy(&mut dka[c..c + d], ds, &qf);
                }
            }
        }
        for (o, a) in dk.iter_mut().zip(&dka) {
            *o = T::of(self.scale * a);
        }
        for (o, a) in dv.iter_mut().zip(&dva) {
            *o = T::of(*a);
        }
    }

    /// dq, dk and dv one after the other in one vector.
    fn backward(&self, up: &Upstream<T>) -> Vec<T> {
        let Dims { t, s, d, .. } = self.dims;
        let (nq, nk) = (self.dims.q_len(), self.dims.kv_len());
        let mut grads = vec![T::of(0.0); nq + 2 * nk];
        let (dq, dkv) = grads.split_at_mut(nq);
        let (dk, dv) = dkv.split_at_mut(nk);
        dq.par_chunks_mut(t * d).enumerate().for_each(|(bh, dqh)| {
            dqh.par_chunks_mut(CPU_QUERY_BLOCK * d)
                .enumerate()
                .for_each(|(blk, dq)| self.dq_block(up, bh, blk * CPU_QUERY_BLOCK, dq));
        });
        dk.par_chunks_mut(s * d).zip(dv.par_chunks_mut(s * d)).enumerate().for_each(|(bkv, (dkh, dvh))| {
            dkh.par_chunks_mut(CPU_KEY_BLOCK * d)
                .zip(dvh.par_chunks_mut(CPU_KEY_BLOCK * d))
                .enumerate()
                .for_each(|(blk, (dk, dv))| self.dkv_block(up, bkv, blk * CPU_KEY_BLOCK, dk, dv));
        });
        grads
    }
}

fn cpu_storage<'a>(s: &'a Storage, what: &str) -> Result<&'a CpuStorage> {
    match s {
        Storage::Cpu(s) => Ok(s),
        _ => candle_core::bail!("flash attention: {what} is not on the CPU like q, k and v"),
    }
}

fn f32s<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> Result<&'a [f32]> {
    contiguous(s.as_slice::<f32>()?, l, what)
}

/// The forward op over `(q, k, v)`; the ranges are held, and the forward leaves `L` here for the backward.
struct FlashAttention {
    ranges: Tensor,
    scale: f32,
    lse: OnceLock<Tensor>,
}

impl FlashAttention {
    fn keep_lse(&self, lse: Tensor) {
        // One op instance runs one forward: the value is set once.
        let _ = self.lse.set(lse);
    }
}

impl CustomOp3 for FlashAttention {
    fn name(&self) -> &'static str {
        "flash-attention"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (rs, rl) = self.ranges.storage_and_layout();
        let dims = Dims::new(l1, l2, l3, rl)?;
        let ranges = u32s(cpu_storage(&rs, "ranges")?, rl, "attention ranges")?;
        let scale = self.scale;
        let (out, lse) = with_float!((s1, l1, "q"), (s2, l2, "k"), (s3, l3, "v") => |q, k, v| {
            let (o, lse) = Inputs { q, k, v, ranges, dims, scale }.forward();
            (IntoStorage::storage(o), lse)
        });
        self.keep_lse(Tensor::from_vec(lse, (dims.b, dims.h, dims.t), &Device::Cpu)?);
        Ok((out, l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (rs, rl) = self.ranges.storage_and_layout();
        let dims = Dims::new(l1, l2, l3, rl)?;
        let (out, lse) = cuda::forward([(s1, l1), (s2, l2), (s3, l3)], (cuda::storage(&rs)?, rl), dims, self.scale)?;
        let lse = Storage::Cuda(candle_core::CudaStorage::wrap_cuda_slice(lse, s1.device.clone()));
        self.keep_lse(Tensor::from_storage(lse, (dims.b, dims.h, dims.t), candle_core::op::BackpropOp::none(), false));
        Ok((out, l1.shape().clone()))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let Some(lse) = self.lse.get() else { candle_core::bail!("flash attention backward before its forward") };
        let grad = grad.to_dtype(out.dtype())?.contiguous()?;
        let delta = (grad.to_dtype(DType::F32)? * out.to_dtype(DType::F32)?)?.sum(D::Minus1)?.contiguous()?;
        let op = FlashAttentionBwd { ranges: &self.ranges, grad: &grad, lse, delta: &delta, scale: self.scale };
        let grads = q.apply_op3_no_bwd(k, v, &op)?;
        let (nq, nk) = (q.elem_count(), k.elem_count());
        let dq = grads.narrow(0, 0, nq)?.reshape(q.shape())?;
        let dk = grads.narrow(0, nq, nk)?.reshape(k.shape())?;
        let dv = grads.narrow(0, nq + nk, nk)?.reshape(v.shape())?;
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

/// The backward op over `(q, k, v)`, holding the rest: its output is dq, dk and dv one after the other
/// (`[nq + 2 nk]`), split by [`FlashAttention::bwd`].
struct FlashAttentionBwd<'a> {
    ranges: &'a Tensor,
    grad: &'a Tensor,
    lse: &'a Tensor,
    delta: &'a Tensor,
    scale: f32,
}

impl CustomOp3 for FlashAttentionBwd<'_> {
    fn name(&self) -> &'static str {
        "flash-attention-bwd"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (rs, rl) = self.ranges.storage_and_layout();
        let dims = Dims::new(l1, l2, l3, rl)?;
        let ranges = u32s(cpu_storage(&rs, "ranges")?, rl, "attention ranges")?;
        let (gs, gl) = self.grad.storage_and_layout();
        let (ls, ll) = self.lse.storage_and_layout();
        let (ds, dl) = self.delta.storage_and_layout();
        let lse = f32s(cpu_storage(&ls, "log-sum-exp")?, ll, "log-sum-exp")?;
        let delta = f32s(cpu_storage(&ds, "delta")?, dl, "delta")?;
        let gs = cpu_storage(&gs, "grad")?;
        let scale = self.scale;
        let out = with_float!((s1, l1, "q"), (s2, l2, "k"), (s3, l3, "v"), (gs, gl, "grad") => |q, k, v, dout| {
            let up = Upstream { dout, lse, delta };
            IntoStorage::storage(Inputs { q, k, v, ranges, dims, scale }.backward(&up))
        });
        Ok((out, Shape::from(dims.q_len() + 2 * dims.kv_len())))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (rs, rl) = self.ranges.storage_and_layout();
        let dims = Dims::new(l1, l2, l3, rl)?;
        let (gs, gl) = self.grad.storage_and_layout();
        let (ls, ll) = self.lse.storage_and_layout();
        let (ds, dl) = self.delta.storage_and_layout();
        let held = cuda::Held {
            ranges: (cuda::storage(&rs)?, rl),
            grad: (cuda::storage(&gs)?, gl),
            lse: (cuda::storage(&ls)?, ll),
            delta: (cuda::storage(&ds)?, dl),
        };
        let out = cuda::backward([(s1, l1), (s2, l2), (s3, l3)], held, dims, self.scale)?;
        Ok((out, Shape::from(dims.q_len() + 2 * dims.kv_len())))
    }
}

/// Attention of `q` `[B, H, T, D]` over `k`, `v` `[B, KV, S, D]` (H a multiple of KV), each query
/// `(b, i)` seeing keys `ranges[b, i] = (lo, hi)` (inclusive; `[B, T, 2]` u32), scores scaled by `scale`:
/// `[B, H, T, D]` in the inputs' dtype (f32, bf16 or f16), with a backward to q, k and v. Computed
/// block by block in O(T) memory per head.
pub fn flash_attention(q: &Tensor, k: &Tensor, v: &Tensor, ranges: &Tensor, scale: f64) -> Result<Tensor> {
    let op = FlashAttention { ranges: ranges.contiguous()?, scale: scale as f32, lse: OnceLock::new() };
    q.contiguous()?.apply_op3(&k.contiguous()?, &v.contiguous()?, op)
}

/// The same through the attention matrix: `softmax` of the `[B, H, T, S]` scores `q k^T` (unscaled:
/// the softmax scales and masks, e.g. [`masked_softmax`](super::masked_softmax)), times `v`, the key/value
/// heads shared by stacking the query heads of a group along time. O(T x S) memory: the reference the op
/// is tested against, and the decoder's path with `attention = "matrix"` or without fused ops.
pub fn matrix_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    softmax: impl FnOnce(&Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    let (b, h, t, d) = q.dims4()?;
    let (_, kv, s, _) = k.dims4()?;
    if kv == 0 || h % kv != 0 {
        candle_core::bail!("attention: {h} query heads are not a multiple of {kv} key/value heads");
    }
    let qg = q.contiguous()?.reshape((b, kv, (h / kv) * t, d))?;
    let scores = qg.matmul(&k.t()?)?.reshape((b, h, t, s))?;
    let probs = softmax(&scores)?;
    probs.reshape((b, kv, (h / kv) * t, s))?.matmul(v)?.reshape((b, h, t, d))
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::{CudaDevice, WrapErr};
    use candle_core::{CudaStorage, Layout, Result, Storage};

    use super::Dims;
    use crate::kernels::cuda::{f32_view, kernel_name, u32_view, view, Float, Map3, FLASH_ATTENTION};

    /// Threads per block of every kernel of kernels/flash_attention.cu.
    const THREADS: u32 = 128;
    /// Values of a `[rows, D]` tile the kernels accumulate in registers (16 per thread).
    const MAX_TILE: usize = 2048;
    /// Shared memory a block may use without opting in.
    const MAX_SHARED: usize = 48 << 10;
    /// Keys per block of the forward (one per lane of a warp).
    const FWD_KEYS: usize = 32;

    pub fn storage<'a>(s: &'a Storage) -> Result<&'a CudaStorage> {
        match s {
            Storage::Cuda(s) => Ok(s),
            _ => candle_core::bail!("flash attention: a held tensor is not on the GPU like q, k and v"),
        }
    }

    /// The tensors the backward holds besides q, k and v.
    pub struct Held<'a> {
        pub ranges: (&'a CudaStorage, &'a Layout),
        pub grad: (&'a CudaStorage, &'a Layout),
        pub lse: (&'a CudaStorage, &'a Layout),
        pub delta: (&'a CudaStorage, &'a Layout),
    }

    /// The launch of one kernel: rows of queries (`bq`) and keys (`bk`) per block, and its shared memory
    /// (f32 words, tiles of rows padded to D + 1 against bank conflicts).
    #[derive(Clone, Copy)]
    struct Tiles {
        bq: usize,
        bk: usize,
        shared: usize,
    }

    /// The largest tiles (rows of queries, keys) whose shared memory, `words(bq, bk, d + 1)`, fits.
    fn tiles(d: usize, options: &[(usize, usize)], words: impl Fn(usize, usize, usize) -> usize) -> Result<Tiles> {
        if d > 256 {
            candle_core::bail!("flash attention on the GPU: head dim {d} > 256");
        }
        options
            .iter()
            .map(|&(bq, bk)| Tiles { bq, bk, shared: 4 * words(bq, bk, d + 1) })
            .find(|t| t.shared <= MAX_SHARED)
            .ok_or_else(|| candle_core::Error::Msg(format!("flash attention: no tile fits head dim {d}")))
    }

    fn forward_tiles(d: usize) -> Result<Tiles> {
        let bq = (MAX_TILE / d).min(16);
        tiles(d, &[(bq, FWD_KEYS)], |bq, bk, ld| bq * ld + bk * ld + bq * bk + 5 * bq)
    }

    fn dq_tiles(d: usize) -> Result<Tiles> {
        let bq = (MAX_TILE / d).min(16);
        tiles(d, &[(bq, 32), (bq, 16), (bq, 8)], |bq, bk, ld| 2 * bq * ld + bk * ld + bq * bk + 4 * bq)
    }

    fn dkv_tiles(d: usize) -> Result<Tiles> {
        let bk = (MAX_TILE / d).min(32);
        tiles(d, &[(16, bk), (8, bk), (4, bk)], |bq, bk, ld| 2 * bk * ld + 2 * bq * ld + 2 * bq * bk + 4 * bq)
    }

    fn config(blocks: usize, heads: usize, t: &Tiles) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (blocks as u32, heads as u32, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: t.shared as u32,
        }
    }

    /// The sizes every kernel takes after its pointers.
    fn sizes(d: &Dims) -> [u32; 5] {
        [d.h as u32, d.kv as u32, d.t as u32, d.s as u32, d.d as u32]
    }

    struct Forward<'a> {
        ranges: CudaView<'a, u32>,
        lse: CudaSlice<f32>,
        dims: Dims,
        scale: f32,
    }

    impl Map3 for Forward<'_> {
        fn f<T: Float>(
            &self,
            q: &CudaView<'_, T>,
            k: &CudaView<'_, T>,
            v: &CudaView<'_, T>,
            dev: &CudaDevice,
        ) -> Result<CudaStorage> {
            let dims = &self.dims;
            let tiles = forward_tiles(dims.d)?;
            // SAFETY: the kernel writes every output element.
            let out = unsafe { dev.alloc::<T>(dims.q_len())? };
            let f =
                dev.get_or_load_custom_func(&kernel_name::<T>("flash_fwd"), FLASH_ATTENTION.name, FLASH_ATTENTION.ptx)?;
            let [h, kv, t, s, d] = sizes(dims);
            let bq = tiles.bq as u32;
            let mut b = f.builder();
            b.arg(q).arg(k).arg(v).arg(&self.ranges).arg(&self.lse).arg(&out);
            b.arg(&h).arg(&kv).arg(&t).arg(&s).arg(&d).arg(&bq).arg(&self.scale);
            let cfg = config(dims.t.div_ceil(tiles.bq), dims.b * dims.h, &tiles);
            // SAFETY: the argument types and order match flash_fwd's signature.
            unsafe { b.launch(cfg) }.w()?;
            Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
        }
    }

    /// `(o, L)` of the forward.
    pub fn forward(
        [(q, lq), (k, lk), (v, lv)]: [(&CudaStorage, &Layout); 3],
        (r, lr): (&CudaStorage, &Layout),
        dims: Dims,
        scale: f32,
    ) -> Result<(CudaStorage, CudaSlice<f32>)> {
        let ranges = u32_view(r, lr, "attention ranges")?;
        // SAFETY: the kernel writes the log-sum-exp of every query.
        let lse = unsafe { q.device.alloc::<f32>(dims.b * dims.h * dims.t)? };
        let op = Forward { ranges, lse, dims, scale };
        let out = op.map((q, lq, "q"), (k, lk, "k"), (v, lv, "v"))?;
        Ok((out, op.lse))
    }

    struct Backward<'a> {
        ranges: CudaView<'a, u32>,
        grad: (&'a CudaStorage, &'a Layout),
        lse: CudaView<'a, f32>,
        delta: CudaView<'a, f32>,
        dims: Dims,
        scale: f32,
    }

    impl Backward<'_> {
        /// Launch `{name}` with `(q, k, v, dout, ranges, lse, delta, out, sizes..., bq, bk, scale)`.
        #[allow(clippy::too_many_arguments)]
        fn launch<T: Float>(
            &self,
            name: &str,
            [q, k, v, dout]: [&CudaView<'_, T>; 4],
            out: &mut candle_core::cuda_backend::cudarc::driver::CudaViewMut<'_, T>,
            tiles: Tiles,
            cfg: LaunchConfig,
            dev: &CudaDevice,
        ) -> Result<()> {
            let f = dev.get_or_load_custom_func(&kernel_name::<T>(name), FLASH_ATTENTION.name, FLASH_ATTENTION.ptx)?;
            let [h, kv, t, s, d] = sizes(&self.dims);
            let (bq, bk) = (tiles.bq as u32, tiles.bk as u32);
            let mut b = f.builder();
            b.arg(q).arg(k).arg(v).arg(dout).arg(&self.ranges).arg(&self.lse).arg(&self.delta).arg(out);
            b.arg(&h).arg(&kv).arg(&t).arg(&s).arg(&d).arg(&bq).arg(&bk).arg(&self.scale);
            // SAFETY: the argument types and order match the kernel's signature.
            unsafe { b.launch(cfg) }.w()?;
            Ok(())
        }
    }

    impl Map3 for Backward<'_> {
        fn f<T: Float>(
            &self,
            q: &CudaView<'_, T>,
            k: &CudaView<'_, T>,
            v: &CudaView<'_, T>,
            dev: &CudaDevice,
        ) -> Result<CudaStorage> {
            let dims = &self.dims;
            let dout = view(self.grad.0.as_cuda_slice::<T>()?, self.grad.1, "grad")?;
            let (nq, nk) = (dims.q_len(), dims.kv_len());
            // SAFETY: the two kernels write every element: dq, then dk and dv.
            let mut out = unsafe { dev.alloc::<T>(nq + 2 * nk)? };
            let tq = dq_tiles(dims.d)?;
            let cfg = config(dims.t.div_ceil(tq.bq), dims.b * dims.h, &tq);
            self.launch("flash_bwd_dq", [q, k, v, &dout], &mut out.slice_mut(..nq), tq, cfg, dev)?;
            let tk = dkv_tiles(dims.d)?;
            let cfg = config(dims.s.div_ceil(tk.bk), dims.b * dims.kv, &tk);
            self.launch("flash_bwd_dkv", [q, k, v, &dout], &mut out.slice_mut(nq..), tk, cfg, dev)?;
            Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
        }
    }

    /// dq, dk and dv one after the other.
    pub fn backward(
        [(q, lq), (k, lk), (v, lv)]: [(&CudaStorage, &Layout); 3],
        held: Held,
        dims: Dims,
        scale: f32,
    ) -> Result<CudaStorage> {
        let op = Backward {
            ranges: u32_view(held.ranges.0, held.ranges.1, "attention ranges")?,
            grad: held.grad,
            lse: f32_view(held.lse.0, held.lse.1, "log-sum-exp")?,
            delta: f32_view(held.delta.0, held.delta.1, "delta")?,
            dims,
            scale,
        };
        op.map((q, lq, "q"), (k, lk, "k"), (v, lv, "v"))
    }
}

#[cfg(test)]
mod tests;
