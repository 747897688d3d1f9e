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
pub(super) struct Dims {
    pub(super) b: usize,
    pub(super) h: usize,
    pub(super) kv: usize,
    pub(super) t: usize,
    pub(super) s: usize,
    pub(super) d: usize,
}

impl Dims {
    pub(super) fn new(q: &Layout, k: &Layout, v: &Layout, ranges: &Layout) -> Result<Self> {
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
        use candle_core::backend::BackendStorage;
        let (rs, rl) = self.ranges.storage_and_layout();
        let dims = Dims::new(l1, l2, l3, rl)?;
        let plan = forward_plan(s1.dtype(), dims, self.scale)?;
        let mut outs = super::cuda::run(&plan, &[(s1, l1), (s2, l2), (s3, l3), (cuda_storage(&rs)?, rl)])?;
        let (out, lse) = (outs.pop().expect("the plan's output"), outs.pop().expect("the plan's log-sum-exp"));
        let lse = Storage::Cuda(lse);
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
        use candle_core::backend::BackendStorage;
        let (rs, rl) = self.ranges.storage_and_layout();
        let dims = Dims::new(l1, l2, l3, rl)?;
        let (gs, gl) = self.grad.storage_and_layout();
        let (ls, ll) = self.lse.storage_and_layout();
        let (ds, dl) = self.delta.storage_and_layout();
        let plan = backward_plan(s1.dtype(), dims, self.scale)?;
        let held = [(&gs, gl), (&rs, rl), (&ls, ll), (&ds, dl)];
        let mut inputs = vec![(s1, l1), (s2, l2), (s3, l3)];
        for (s, l) in &held {
            inputs.push((cuda_storage(s)?, *l));
        }
        let out = super::cuda::run(&plan, &inputs)?.remove(0);
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

#[cfg(test)]
pub(super) use plan::MAX_HEAD_DIM;
#[cfg(any(test, feature = "cuda"))]
pub(super) use plan::{backward_plan, forward_plan};

/// The GPU launches of the op (launch.rs): tiles sized to the head dim within the shared memory a block
/// may use.
#[cfg(any(test, feature = "cuda"))]
mod plan {
    use super::*;
    use crate::kernels::launch::{kernel_name, Arg, Launch, Module, Plan, MAX_SHARED_BYTES};

    /// Threads per block of every kernel of kernels/flash_attention.cu.
    const THREADS: u32 = 128;
    /// Values of a `[rows, D]` tile the kernels accumulate in registers (16 per thread).
    const MAX_TILE: usize = 2048;
    /// Keys per block of the forward (one per lane of a warp).
    const FWD_KEYS: usize = 32;
    /// The largest head dim the kernels take.
    pub const MAX_HEAD_DIM: usize = 256;

    /// The launch of one kernel: rows of queries (`bq`) and keys (`bk`) per block, and its shared memory
    /// in bytes (tiles of rows padded to D + 1 f32 against bank conflicts).
    #[derive(Clone, Copy)]
    struct Tiles {
        bq: usize,
        bk: usize,
        shared: usize,
    }

    /// The largest tiles (rows of queries, keys) whose shared memory, `words(bq, bk, d + 1)` f32, fits.
    fn tiles(d: usize, options: &[(usize, usize)], words: impl Fn(usize, usize, usize) -> usize) -> Result<Tiles> {
        if d > MAX_HEAD_DIM {
            candle_core::bail!("flash attention on the GPU: head dim {d} > {MAX_HEAD_DIM}");
        }
        options
            .iter()
            .map(|&(bq, bk)| Tiles { bq, bk, shared: 4 * words(bq, bk, d + 1) })
            .find(|t| t.shared <= MAX_SHARED_BYTES)
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

    /// A launch of `base` over `blocks` x `heads` blocks of 128 threads with `tiles`' shared memory.
    fn flash_launch(
        base: &str,
        dtype: DType,
        (blocks, heads): (usize, usize),
        tiles: Tiles,
        args: Vec<Arg>,
    ) -> Result<Launch> {
        Ok(Launch {
            module: Module::FlashAttention,
            kernel: kernel_name(base, dtype)?,
            grid: (blocks as u32, heads as u32, 1),
            block: (THREADS, 1, 1),
            shared_bytes: tiles.shared as u32,
            args,
        })
    }

    /// The sizes every kernel takes after its pointers: h, kv, t, s, d.
    fn sizes(d: &Dims) -> [Arg; 5] {
        [d.h, d.kv, d.t, d.s, d.d].map(|n| Arg::U32(n as u32))
    }

    /// The launch of `flash_fwd` over inputs `(q, k, v, ranges)` of `dtype`; outputs `(L, o)`. Blocks of `bq`
    /// queries of one head.
    pub fn forward_plan(dtype: DType, dims: Dims, scale: f32) -> Result<Plan> {
        let mut p = Plan::default();
        let (q, k, v) =
            (p.input("q", dtype, dims.q_len()), p.input("k", dtype, dims.kv_len()), p.input("v", dtype, dims.kv_len()));
        let ranges = p.input("attention ranges", DType::U32, dims.b * dims.t * 2);
        let lse = p.output("log-sum-exp", DType::F32, dims.b * dims.h * dims.t);
        let out = p.output("attention", dtype, dims.q_len());
        let tiles = forward_tiles(dims.d)?;
        let mut args = vec![q, k, v, ranges, lse, out];
        args.extend(sizes(&dims));
        args.extend([Arg::U32(tiles.bq as u32), Arg::F32(scale)]);
        p.launch(flash_launch("flash_fwd", dtype, (dims.t.div_ceil(tiles.bq), dims.b * dims.h), tiles, args)?)?;
        Ok(p)
    }

    /// The launches of `flash_bwd_dq` (blocks of queries of one head) and `flash_bwd_dkv` (blocks of keys of
    /// one KV head) over inputs `(q, k, v, grad, ranges, L, D)`; output dq, dk and dv one after the other.
    pub fn backward_plan(dtype: DType, dims: Dims, scale: f32) -> Result<Plan> {
        let (nq, nk) = (dims.q_len(), dims.kv_len());
        let mut p = Plan::default();
        let mut inputs = vec![p.input("q", dtype, nq), p.input("k", dtype, nk), p.input("v", dtype, nk)];
        inputs.push(p.input("grad", dtype, nq));
        inputs.push(p.input("attention ranges", DType::U32, dims.b * dims.t * 2));
        inputs.push(p.input("log-sum-exp", DType::F32, dims.b * dims.h * dims.t));
        inputs.push(p.input("delta", DType::F32, dims.b * dims.h * dims.t));
        let Arg::Buffer { index: grads, .. } = p.output("gradients", dtype, nq + 2 * nk) else { unreachable!() };
        let args = |offset: usize, t: &Tiles| {
            let mut a = inputs.clone();
            a.push(Arg::Buffer { index: grads, offset });
            a.extend(sizes(&dims));
            a.extend([Arg::U32(t.bq as u32), Arg::U32(t.bk as u32), Arg::F32(scale)]);
            a
        };
        let (tq, tk) = (dq_tiles(dims.d)?, dkv_tiles(dims.d)?);
        let dq = flash_launch("flash_bwd_dq", dtype, (dims.t.div_ceil(tq.bq), dims.b * dims.h), tq, args(0, &tq))?;
        let dkv = flash_launch("flash_bwd_dkv", dtype, (dims.s.div_ceil(tk.bk), dims.b * dims.kv), tk, args(nq, &tk))?;
        p.launch(dq)?;
        p.launch(dkv)?;
        Ok(p)
    }
}

#[cfg(feature = "cuda")]
fn cuda_storage(s: &Storage) -> Result<&candle_core::CudaStorage> {
    match s {
        Storage::Cuda(s) => Ok(s),
        _ => candle_core::bail!("flash attention: a held tensor is not on the GPU like q, k and v"),
    }
}

#[cfg(test)]
mod tests;
