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

use std::sync::{Arc, OnceLock};

#[cfg(any(test, feature = "cuda"))]
use candle_core::DType;
use candle_core::{CpuStorage, CustomOp3, Device, Layout, Result, Shape, Storage, Tensor};

use super::cpu::{contiguous, u32s, with_float, Elem, IntoStorage};
#[cfg(feature = "cuda")]
use super::flash_mma;
#[cfg(feature = "cuda")]
use candle_core::backend::BackendStorage;
pub(super) use dims::Dims;
use driver::{Blocks, Visits};

/// `$body` with `be` the GPU backend of `$s`'s dtype.
#[cfg(feature = "cuda")]
macro_rules! gpu_dispatch {
    ($s:expr, |$be:ident| $body:expr) => {{
        use candle_core::backend::BackendStorage;
        let (dev, dtype) = ($s.device.clone(), $s.dtype());
        match dtype {
            DType::F32 => {
                let $be = gpu::GpuBackend::<f32>::new(dev, dtype);
                $body?
            }
            DType::BF16 => {
                let $be = gpu::GpuBackend::<half::bf16>::new(dev, dtype);
                $body?
            }
            DType::F16 => {
                let $be = gpu::GpuBackend::<half::f16>::new(dev, dtype);
                $body?
            }
            d => candle_core::bail!("flash attention: no kernel for {d:?} (f32, bf16 or f16)"),
        }
    }};
}

mod auto;
pub use auto::auto_kernels;
mod cpu;
pub(super) mod dims;
pub(crate) use dims::dkv_partial_sum_bytes;
pub(crate) mod driver;
#[cfg(test)]
mod emu_tests;
#[cfg(feature = "cuda")]
mod gpu;
#[cfg(any(test, feature = "cuda"))]
mod launches;

/// The keys query `i` of batch row `b` attends to, clipped to the keys; `None` when empty.
fn key_range(ranges: &[u32], dims: &Dims, b: usize, i: usize) -> Option<(usize, usize)> {
    let lo = ranges[(b * dims.t + i) * 2] as usize;
    let hi = (ranges[(b * dims.t + i) * 2 + 1] as usize).min(dims.s - 1);
    (lo <= hi).then_some((lo, hi))
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

/// The forward op over `(q, k, v)`; the ranges are held, and the forward leaves `L` and the block
/// pairs it visited here for the backward. `blocks`: block sizes, or `None` for [`driver::block_sizes`].
struct FlashAttention {
    ranges: Tensor,
    scale: f32,
    blocks: Option<Blocks>,
    /// The kernels it runs on a GPU.
    kernels: GpuKernels,
    /// The output and log-sum-exp of an earlier forward of the same inputs: the forward copies the output
    /// instead of computing it.
    replay: Option<AttentionRecord>,
    /// Shared with [`attend`], which reads it back to record the forward.
    lse: Arc<OnceLock<Tensor>>,
    visits: OnceLock<Visits>,
}

impl FlashAttention {
    fn keep_lse(&self, lse: Tensor) {
        // One op instance runs one forward: the value is set once.
        let _ = self.lse.set(lse);
    }

    /// The replayed forward's output, a copy of the record's (its log-sum-exp kept for the backward).
    fn replayed(&self, record: &AttentionRecord, q: &Layout) -> Result<Storage> {
        if record.out.dims() != q.dims() || record.lse.elem_count() * q.dims()[3] != q.shape().elem_count() {
            candle_core::bail!(
                "flash attention: a recorded output of shape {:?} replayed for queries of shape {:?}",
                record.out.dims(),
                q.dims()
            );
        }
        self.keep_lse(record.lse.clone());
        let (s, l) = record.out.storage_and_layout();
        s.try_clone(l)
    }

    /// The block pairs of the forward (computed once, from the ranges on the host).
    fn visits(&self, dims: Dims, device: driver::Device, ranges: &[u32]) -> &Visits {
        let blocks = self.blocks.unwrap_or_else(|| driver::block_sizes(&dims, device));
        self.visits.get_or_init(|| Visits::new(dims, blocks, ranges))
    }
}

/// `x` in f32.
fn f32_vec<T: Elem>(x: &[T]) -> Vec<f32> {
    x.iter().map(|v| v.f32()).collect()
}

/// `x` in the element type of `_like`.
fn from_f32<T: Elem>(_like: &[T], x: &[f32]) -> Vec<T> {
    x.iter().map(|&v| T::of(v)).collect()
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
        let visits = self.visits(dims, driver::Device::Cpu, ranges);
        if let Some(record) = &self.replay {
            return match self.replayed(record, l1)? {
                Storage::Cpu(out) => Ok((out, l1.shape().clone())),
                _ => candle_core::bail!("flash attention: a recorded output replayed on another device"),
            };
        }
        let ranges = ranges.to_vec();
        let (out, lse) = with_float!((s1, l1, "q"), (s2, l2, "k"), (s3, l3, "v") => |qt, kt, vt| {
            let (q, k, v) = (f32_vec(qt), f32_vec(kt), f32_vec(vt));
            let x = driver::Inputs { q: &q, k: &k, v: &v, ranges: &ranges, scale: self.scale };
            let (o, lse) = driver::forward(&cpu::CpuBackend, visits, &x)?;
            (IntoStorage::storage(from_f32(qt, &o)), lse)
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
        let dims = Dims::new(l1, l2, l3, self.ranges.layout())?;
        let tensor_cores = self.kernels.tensor_cores() && flash_mma::supports(s1.dtype(), dims.d);
        if let Some(record) = &self.replay {
            if !tensor_cores {
                // The chunked backward walks the forward's block pairs.
                let host: Vec<u32> = self.ranges.flatten_all()?.to_vec1()?;
                self.visits(dims, driver::Device::Gpu, &host);
            }
            return match self.replayed(record, l1)? {
                Storage::Cuda(out) => Ok((out, l1.shape().clone())),
                _ => candle_core::bail!("flash attention: a recorded output replayed on another device"),
            };
        }
        if tensor_cores {
            let (rs, rl) = self.ranges.storage_and_layout();
            let plan = match self.kernels.warpgroup_on(&s1.device)? {
                true => super::flash_wgmma::forward_plan(s1.dtype(), dims, self.scale)?,
                false => flash_mma::forward_plan(s1.dtype(), dims, self.scale)?,
            };
            let [lse, out]: [candle_core::CudaStorage; 2] =
                super::cuda::run(&plan, &[(s1, l1), (s2, l2), (s3, l3), (cuda_storage(&rs)?, rl)])?
                    .try_into()
                    .map_err(|_| candle_core::Error::Msg("flash attention: two outputs expected".into()))?;
            let lse = Storage::Cuda(lse);
            self.keep_lse(Tensor::from_storage(
                lse,
                (dims.b, dims.h, dims.t),
                candle_core::op::BackpropOp::none(),
                false,
            ));
            return Ok((out, l1.shape().clone()));
        }
        // One host read per call: the block pairs to visit come from the ranges.
        let host: Vec<u32> = self.ranges.flatten_all()?.to_vec1()?;
        let visits = self.visits(dims, driver::Device::Gpu, &host);
        let (rs, rl) = self.ranges.storage_and_layout();
        let ins = [(s1, l1), (s2, l2), (s3, l3), (cuda_storage(&rs)?, rl)];
        let (out, lse) = gpu_dispatch!(s1, |be| gpu_forward(&be, visits, self.scale, ins));
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
        // The block pairs of the CPU driver (the GPU's kernels walk the ranges themselves).
        let visits = self.visits.get();
        let grad = grad.to_dtype(out.dtype())?.contiguous()?;
        let delta = super::row_dot(&grad, out)?;
        let lse_delta = Tensor::cat(&[lse.flatten_all()?, delta.flatten_all()?], 0)?;
        let op = FlashAttentionBwd {
            ranges: &self.ranges,
            grad: &grad,
            lse_delta: &lse_delta,
            scale: self.scale,
            visits,
            kernels: self.kernels,
        };
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
    /// L then D, `[2 B H T]` f32.
    lse_delta: &'a Tensor,
    scale: f32,
    visits: Option<&'a Visits>,
    /// As [`FlashAttention`]'s (read on the GPU only).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    kernels: GpuKernels,
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
        let (ls, ll) = self.lse_delta.storage_and_layout();
        let lse_delta = f32s(cpu_storage(&ls, "log-sum-exp")?, ll, "log-sum-exp")?.to_vec();
        let gs = cpu_storage(&gs, "grad")?;
        let ranges = ranges.to_vec();
        let Some(visits) = self.visits else { candle_core::bail!("flash attention backward before its CPU forward") };
        let out = with_float!((s1, l1, "q"), (s2, l2, "k"), (s3, l3, "v"), (gs, gl, "grad") => |qt, kt, vt, gt| {
            let (q, k, v, dout) = (f32_vec(qt), f32_vec(kt), f32_vec(vt), f32_vec(gt));
            let x = driver::Inputs { q: &q, k: &k, v: &v, ranges: &ranges, scale: self.scale };
            let up = driver::Upstream { dout: &dout, lse_delta: &lse_delta };
            IntoStorage::storage(from_f32(qt, &driver::backward(&cpu::CpuBackend, visits, &x, &up)?))
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
        if let (GpuKernels::TensorCores { atomic_dq, .. }, true) =
            (self.kernels, flash_mma::supports(s1.dtype(), dims.d))
        {
            let kernels = match (self.kernels.warpgroup_on(&s1.device)?, atomic_dq) {
                (true, true) => MmaBackward::WarpgroupAtomicDq,
                (true, false) => MmaBackward::Warpgroup,
                (false, true) => MmaBackward::AtomicDq,
                (false, false) => MmaBackward::TwoKernels,
            };
            return mma_backward(
                (dims, self.scale, kernels),
                [(s1, l1), (s2, l2), (s3, l3)],
                self.grad,
                (&rs, rl),
                self.lse_delta,
            );
        }
        let Some(visits) = self.visits else { candle_core::bail!("flash attention backward before its forward") };
        let (gs, gl) = self.grad.storage_and_layout();
        let (ls, ll) = self.lse_delta.storage_and_layout();
        let ins = [(s1, l1), (s2, l2), (s3, l3), (cuda_storage(&gs)?, gl)];
        let held = (cuda_storage(&rs)?, rl, cuda_storage(&ls)?, ll);
        let out = gpu_dispatch!(s1, |be| gpu_backward(&be, visits, self.scale, ins, held));
        Ok((out, Shape::from(dims.q_len() + 2 * dims.kv_len())))
    }
}

/// Attention of `q` `[B, H, T, D]` over `k`, `v` `[B, KV, S, D]` (H a multiple of KV), each query
/// `(b, i)` seeing keys `ranges[b, i] = (lo, hi)` (inclusive; `[B, T, 2]` u32), scores scaled by `scale`:
/// `[B, H, T, D]` in the inputs' dtype (f32, bf16 or f16), with a backward to q, k and v. Computed
/// block by block in O(T) memory per head.
pub fn flash_attention(q: &Tensor, k: &Tensor, v: &Tensor, ranges: &Tensor, scale: f64) -> Result<Tensor> {
    attend(q, k, v, ranges, scale, None, GpuKernels::Chunked, None)
}

/// The kernels flash attention runs on a GPU (the CPU runs its one implementation whatever this says).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GpuKernels {
    /// The block products as cuBLAS GEMMs over blocks in device memory (chunked).
    #[default]
    Chunked,
    /// The tensor-core kernels of kernels/flash_mma.cu where they apply (bf16/f16 at a head dim of
    /// [`TENSOR_CORE_HEAD_DIMS`](super::TENSOR_CORE_HEAD_DIMS)), chunked elsewhere. `atomic_dq`: the
    /// backward sums dq by f32 atomics in the dk/dv kernel (FlashAttention-2's: 10 hd FLOPs per score
    /// against 14, its rounding varying from run to run) instead of a dq kernel of its own (reproducible).
    /// `warpgroup`: on a GPU of compute capability 9.0, the warpgroup kernels of kernels/flash_wgmma.cu
    /// instead (with the same two backwards).
    TensorCores { atomic_dq: bool, warpgroup: bool },
}

impl GpuKernels {
    #[cfg(feature = "cuda")]
    fn tensor_cores(self) -> bool {
        matches!(self, GpuKernels::TensorCores { .. })
    }

    /// Whether the tensor-core kernels on `dev` are the warpgroup ones (asked for, and the GPU is of
    /// compute capability 9.0, the only one wgmma exists on).
    #[cfg(feature = "cuda")]
    fn warpgroup_on(self, dev: &candle_core::CudaDevice) -> Result<bool> {
        Ok(matches!(self, GpuKernels::TensorCores { warpgroup: true, .. })
            && super::cuda::compute_capability(dev)?.0 == 9)
    }
}

/// The output and the per-query log-sum-exp of one flash-attention forward, kept so that the same
/// attention, run again on the same inputs (a layer recomputed in the backward), skips its forward and
/// still has its backward.
#[derive(Debug, Clone)]
pub struct AttentionRecord {
    out: Tensor,
    lse: Tensor,
}

impl AttentionRecord {
    /// The bytes it holds.
    pub fn bytes(&self) -> usize {
        self.out.elem_count() * self.out.dtype().size_in_bytes() + self.lse.elem_count() * 4
    }
}

/// What [`flash_attention_recorded`] does with a record of the forward.
pub enum Replay<'a> {
    /// Compute the forward and keep its output and log-sum-exp in the slot.
    Record(&'a mut Option<AttentionRecord>),
    /// Compute no forward: the output is a copy of the record's, which must have been made from the same
    /// q, k, v, ranges and scale; the backward is the usual one, from the record's log-sum-exp.
    From(&'a AttentionRecord),
}

/// [`flash_attention`] on `kernels` on a GPU, recording its forward or replaying a recorded one.
pub fn flash_attention_recorded(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    ranges: &Tensor,
    scale: f64,
    kernels: GpuKernels,
    replay: Option<Replay>,
) -> Result<Tensor> {
    attend(q, k, v, ranges, scale, None, kernels, replay)
}

/// [`flash_attention`] with the given block sizes (`None`: [`driver::block_sizes`] of the device), on a GPU
/// through `kernels`, recording or replaying its
/// forward as `replay` says.
#[allow(clippy::too_many_arguments)]
fn attend(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    ranges: &Tensor,
    scale: f64,
    blocks: Option<Blocks>,
    kernels: GpuKernels,
    replay: Option<Replay>,
) -> Result<Tensor> {
    let lse = Arc::new(OnceLock::new());
    let op = FlashAttention {
        ranges: ranges.contiguous()?,
        scale: scale as f32,
        blocks,
        kernels,
        replay: match &replay {
            Some(Replay::From(record)) => Some((*record).clone()),
            _ => None,
        },
        lse: lse.clone(),
        visits: OnceLock::new(),
    };
    let out = q.contiguous()?.apply_op3(&k.contiguous()?, &v.contiguous()?, op)?;
    if let Some(Replay::Record(slot)) = replay {
        let Some(lse) = lse.get() else { candle_core::bail!("flash attention: the forward kept no log-sum-exp") };
        *slot = Some(AttentionRecord { out: out.detach(), lse: lse.clone() });
    }
    Ok(out)
}

/// Block sizes and the work (GEMM FLOPs, element-wise bytes, launches) of the forward and the backward of
/// causal attention over `t` new queries and `s` keys (`s - t` cached), `b` rows, `h` query heads, `kv`
/// key/value heads of dim `d`, GEMM operands of `in_bytes` bytes, with [`driver::block_sizes`] of `device`:
/// what the driver would run, counted without running it (performance model and benchmarks).
pub(crate) fn causal_work(
    (b, h, kv, t, s, d): (usize, usize, usize, usize, usize, usize),
    device: driver::Device,
    in_bytes: usize,
) -> (Blocks, driver::Work, driver::Work) {
    let dims = Dims { b, h, kv, t, s, d };
    let blocks = driver::block_sizes(&dims, device);
    let (f, w) = driver::cost(&Visits::causal(dims, blocks), in_bytes);
    (blocks, f, w)
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
#[cfg(test)]
pub(super) use plan::{backward_plan, forward_plan};

/// The launches of the scalar kernels `flash_fwd`, `flash_bwd_dq` and `flash_bwd_dkv` (launch.rs): tiles
/// sized to the head dim within the shared memory a block may use. The op runs the chunked driver on
/// every device; these kernels remain for the emulator's own tests (dynamic shared memory checks).
#[cfg(test)]
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
        let mut args = crate::kernels::flash_mma::forward_buffers(&mut p, dtype, &dims);
        let tiles = forward_tiles(dims.d)?;
        args.extend(sizes(&dims));
        args.extend([Arg::U32(tiles.bq as u32), Arg::F32(scale)]);
        p.launch(flash_launch("flash_fwd", dtype, (dims.t.div_ceil(tiles.bq), dims.b * dims.h), tiles, args)?)?;
        Ok(p)
    }

    /// The launches of `flash_bwd_dq` (blocks of queries of one head) and `flash_bwd_dkv` (blocks of keys of
    /// one KV head) over inputs `(q, k, v, grad, ranges, L, D)`; output dq, dk and dv one after the other.
    pub fn backward_plan(dtype: DType, dims: Dims, scale: f32) -> Result<Plan> {
        let nq = dims.q_len();
        let mut p = Plan::default();
        let (inputs, grads) = crate::kernels::flash_mma::backward_buffers(&mut p, dtype, &dims);
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
type CudaIn<'a> = (&'a candle_core::CudaStorage, &'a Layout);

/// The driver's forward on the GPU: `(o, L)`.
#[cfg(feature = "cuda")]
fn gpu_forward<T>(
    be: &gpu::GpuBackend<T>,
    visits: &Visits,
    scale: f32,
    [q, k, v, r]: [CudaIn; 4],
) -> Result<(candle_core::CudaStorage, candle_core::CudaStorage)>
where
    T: candle_core::cuda_backend::CudaDType
        + candle_core::cuda_backend::cudarc::driver::DeviceRepr
        + candle_core::cuda_backend::cudarc::driver::ValidAsZeroBits,
{
    let (q, k, v) = (be.input(q.0, q.1)?, be.input(k.0, k.1)?, be.input(v.0, v.1)?);
    let ranges = gpu::input::<u32>(&be.dev, r.0, r.1)?;
    let (o, lse) = driver::forward(be, visits, &driver::Inputs { q: &q, k: &k, v: &v, ranges: &ranges, scale })?;
    let dev = be.dev.clone();
    Ok((candle_core::CudaStorage::wrap_cuda_slice(o, dev.clone()), candle_core::CudaStorage::wrap_cuda_slice(lse, dev)))
}

/// The driver's backward on the GPU: dq|dk|dv.
#[cfg(feature = "cuda")]
fn gpu_backward<T>(
    be: &gpu::GpuBackend<T>,
    visits: &Visits,
    scale: f32,
    [q, k, v, g]: [CudaIn; 4],
    (rs, rl, ls, ll): (&candle_core::CudaStorage, &Layout, &candle_core::CudaStorage, &Layout),
) -> Result<candle_core::CudaStorage>
where
    T: candle_core::cuda_backend::CudaDType
        + candle_core::cuda_backend::cudarc::driver::DeviceRepr
        + candle_core::cuda_backend::cudarc::driver::ValidAsZeroBits,
{
    let (q, k, v, dout) = (be.input(q.0, q.1)?, be.input(k.0, k.1)?, be.input(v.0, v.1)?, be.input(g.0, g.1)?);
    let ranges = gpu::input::<u32>(&be.dev, rs, rl)?;
    let lse_delta = gpu::input::<f32>(&be.dev, ls, ll)?;
    let x = driver::Inputs { q: &q, k: &k, v: &v, ranges: &ranges, scale };
    let grads = driver::backward(be, visits, &x, &driver::Upstream { dout: &dout, lse_delta: &lse_delta })?;
    Ok(candle_core::CudaStorage::wrap_cuda_slice(grads, be.dev.clone()))
}

/// Which tensor-core backward runs.
#[cfg(feature = "cuda")]
enum MmaBackward {
    /// kernels/flash_mma.cu's dq kernel, then its dk/dv kernel.
    TwoKernels,
    /// kernels/flash_mma.cu's dk/dv kernel summing dq by f32 atomics.
    AtomicDq,
    /// kernels/flash_wgmma.cu's dq kernel, then its dk/dv kernel.
    Warpgroup,
    /// kernels/flash_wgmma.cu's dk/dv kernel summing dq by f32 atomics.
    WarpgroupAtomicDq,
}

/// The tensor-core kernels' backward on the GPU (kernels/flash_mma.cu or flash_wgmma.cu): dq|dk|dv.
#[cfg(feature = "cuda")]
fn mma_backward(
    (dims, scale, kernels): (Dims, f32, MmaBackward),
    [q, k, v]: [CudaIn; 3],
    grad: &Tensor,
    (rs, rl): (&Storage, &Layout),
    lse_delta: &Tensor,
) -> Result<(candle_core::CudaStorage, Shape)> {
    let n = dims.b * dims.h * dims.t;
    let (lse, delta) = (lse_delta.narrow(0, 0, n)?, lse_delta.narrow(0, n, n)?);
    let ((gs, gl), (ls, ll), (ds, dl)) =
        (grad.storage_and_layout(), lse.storage_and_layout(), delta.storage_and_layout());
    let plan = match kernels {
        MmaBackward::TwoKernels => flash_mma::backward_plan(q.0.dtype(), dims, scale)?,
        MmaBackward::AtomicDq => flash_mma::backward_plan_atomic(q.0.dtype(), dims, scale)?,
        MmaBackward::Warpgroup => super::flash_wgmma::backward_plan(q.0.dtype(), dims, scale)?,
        MmaBackward::WarpgroupAtomicDq => super::flash_wgmma::backward_plan_atomic(q.0.dtype(), dims, scale)?,
    };
    let held = [(cuda_storage(&gs)?, gl), (cuda_storage(rs)?, rl), (cuda_storage(&ls)?, ll), (cuda_storage(&ds)?, dl)];
    let ins = [q, k, v, held[0], held[1], held[2], held[3]];
    // The first output is dq|dk|dv (the second, the query blocks' key spans, is the kernels' own).
    let out = super::cuda::run(&plan, &ins)?.into_iter().next();
    let out = out.ok_or_else(|| candle_core::Error::Msg("flash attention backward: no output".into()))?;
    Ok((out, Shape::from(dims.q_len() + 2 * dims.kv_len())))
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
