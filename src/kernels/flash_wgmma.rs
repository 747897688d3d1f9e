//! Flash attention on Hopper's warpgroup tensor cores: the launch plans of kernels/flash_wgmma.cu, whose
//! block products are `wgmma.mma_async` instructions (m64nNk16, bf16/f16 in, f32 accumulators;
//! kernels/wgmma.cuh) on shared tiles in the 128-byte swizzle, compiled for sm_90a only (H100, H200). The
//! same inputs, outputs and arithmetic as [`flash_mma`](super::flash_mma)'s kernels and their plans'
//! buffers (whose CPU reference is the [`flash_attention`](super::flash_attention) op), for bf16 and f16
//! and a head dim in [`TENSOR_CORE_HEAD_DIMS`](super::TENSOR_CORE_HEAD_DIMS); the op takes this path with
//! `attention = "wgmma"` on a GPU of compute capability 9.0.

use candle_core::{DType, Result};

use super::flash_attention::dims::Dims;
use super::flash_mma::KernelFile;
use super::launch::{kernel_name, Launch, Module, Plan};

/// Threads per block: two warpgroups of four warps.
const THREADS: u32 = 256;
/// Queries per block of the forward and the dq kernel (64 per warpgroup), keys per step.
const QUERIES: usize = 128;
const KEYS: usize = 64;
/// Keys per block of the dk/dv kernel (64 per warpgroup), queries per step.
const DKV_KEYS: usize = super::flash_attention::dims::WGMMA_DKV_KEYS;
const DKV_QUERIES: usize = 64;
/// Slack for aligning the tiles to 1024 bytes (the 128-byte swizzle's period).
const ALIGN: usize = 1024;

/// Key tiles of K and V the forward and the dq kernel hold (kernels/flash_wgmma.cu's WG_FWD_SLOTS).
const FWD_SLOTS: usize = 5;

/// The dk/dv kernels' stages of Q and dO tiles (kernels/flash_wgmma.cu's `wg_dkv_stages`): a ring (the
/// forward's schedule) of five slots at head dim 64 and four at 128, but two stages for dq by atomics at 128.
const fn dkv_stages(d: usize, atomic_dq: bool) -> usize {
    match (d, atomic_dq) {
        (64, _) => FWD_SLOTS,
        (_, false) => 4,
        _ => 2,
    }
}

/// Shared memory of each kernel, as kernels/flash_wgmma.cu lays it out: swizzled tiles of 16-bit values
/// (slots of K and V; or K and V, then the stages of Q and dO), then the rows' key ranges and statistics
/// (the dk/dv kernels: a 16-byte record per query of each stage, then the tile of dS^T with dq by atomics,
/// each stage's bounds on its queries' key ranges, and in the ring each stage's query block); the dk/dv
/// kernels end with the bitmask of the query blocks that see their keys (a bit per block of `DKV_QUERIES`
/// queries, in 32-bit words) and the list of those blocks (a 32-bit word each).
fn shared_bytes(kernel: &str, dims: &Dims) -> usize {
    let d = dims.d;
    let mask = 4 * dims.t.div_ceil(DKV_QUERIES).div_ceil(32);
    let dkv = |atomic_dq: bool| {
        let stages = dkv_stages(d, atomic_dq);
        // the ring's (query head, first query) of each stage, a copy per warpgroup
        let ids = if stages > 2 { 2 * stages * 8 } else { 0 };
        // each stage's bounds on its queries' key ranges (16 bytes), the list of query blocks (4 bytes each)
        let (bounds, list) = (16 * stages, 4 * dims.t.div_ceil(DKV_QUERIES));
        ALIGN
            + 2 * (2 * DKV_KEYS * d + 2 * stages * DKV_QUERIES * d)
            + 16 * stages * DKV_QUERIES
            + bounds
            + ids
            + mask
            + list
    };
    match kernel {
        "fwd" => ALIGN + 2 * (2 * FWD_SLOTS * KEYS * d) + 2 * 4 * QUERIES,
        "bwd_dq" => ALIGN + 2 * (2 * FWD_SLOTS * KEYS * d) + 2 * 4 * QUERIES,
        "bwd_dkv" => dkv(false),
        // and the tile of dS^T, [128 keys][64 queries]
        _ => dkv(true) + 2 * DKV_KEYS * DKV_QUERIES,
    }
}

/// kernels/flash_wgmma.cu.
pub(crate) const WGMMA: KernelFile = KernelFile {
    module: Module::FlashWgmma,
    prefix: "flash_wgmma",
    threads: THREADS,
    rows: QUERIES,
    dkv_keys: DKV_KEYS,
    shared_bytes,
};

/// The forward over inputs `(q, k, v, ranges)` of `dtype`; outputs `(L, o)`.
pub(crate) fn forward_plan(dtype: DType, dims: Dims, scale: f32) -> Result<Plan> {
    WGMMA.forward_plan(dtype, dims, scale)
}

/// The backward over inputs `(q, k, v, grad, ranges, L, D)`: dq (query blocks of one head), then dk and
/// dv (key blocks of one KV head, over its part of its group's query heads, the parts summed in order),
/// one output after the other, and the kernels' own ([`KernelFile::backward_plan_split`]). Deterministic:
/// every sum in a fixed order.
pub(crate) fn backward_plan(dtype: DType, dims: Dims, scale: f32) -> Result<Plan> {
    WGMMA.backward_plan(dtype, dims, scale)
}

/// The backward with dq summed by f32 atomics in this file's dk/dv kernel (`bwd_dkvq`: each 64-query step's
/// dS^T through shared memory, then dQ = dS K as a warpgroup product), between kernels/flash_mma.cu's
/// `bwd_prep` and `bwd_dq_out` ([`KernelFile::backward_plan_atomic`]): 10 hd FLOPs per score against 14,
/// dq's rounding varying from run to run.
pub(crate) fn backward_plan_atomic(dtype: DType, dims: Dims, scale: f32) -> Result<Plan> {
    WGMMA.backward_plan_atomic(dtype, dims, scale)
}

/// Shared memory of `wgmma_layouts`: A and B each as a K-major 64 x 64 tile and an MN-major 16 x 64 tile.
const LAYOUTS_SHARED: usize = ALIGN + 2 * (2 * 64 * 64 + 2 * 16 * 64);

/// The plan of `wgmma_layouts_{dtype}`: inputs A `[64, 16]` and B `[16, 64]` (row-major, bf16 or f16);
/// output `[4, 64, 64]` f32, A B by each operand layout the attention kernels use (registers x K-major,
/// registers x MN-major, K-major x K-major, MN-major x MN-major; see the kernel).
pub(crate) fn layouts_plan(dtype: DType) -> Result<Plan> {
    if !matches!(dtype, DType::BF16 | DType::F16) {
        candle_core::bail!("wgmma_layouts: {dtype:?} (bf16 or f16)");
    }
    let mut p = Plan::default();
    let (a, b) = (p.input("a", dtype, 64 * 16), p.input("b", dtype, 16 * 64));
    let out = p.output("products", DType::F32, 4 * 64 * 64);
    p.launch(Launch {
        module: Module::FlashWgmma,
        kernel: kernel_name("wgmma_layouts", dtype)?,
        grid: (1, 1, 1),
        block: (128, 1, 1),
        shared_bytes: LAYOUTS_SHARED as u32,
        args: vec![a, b, out],
    })?;
    Ok(p)
}

/// [`layouts_plan`] on the GPU of `a` and `b` (contiguous): `[4, 64, 64]` f32.
#[cfg(feature = "cuda")]
pub(crate) fn layouts(a: &candle_core::Tensor, b: &candle_core::Tensor) -> Result<candle_core::Tensor> {
    use candle_core::Storage;
    let plan = layouts_plan(a.dtype())?;
    let ((sa, la), (sb, lb)) = (a.storage_and_layout(), b.storage_and_layout());
    let (Storage::Cuda(sa), Storage::Cuda(sb)) = (&*sa, &*sb) else {
        candle_core::bail!("wgmma_layouts: the inputs are not on the GPU")
    };
    let out = super::cuda::run(&plan, &[(sa, la), (sb, lb)])?.remove(0);
    Ok(candle_core::Tensor::from_storage(Storage::Cuda(out), (4, 64, 64), candle_core::op::BackpropOp::none(), false))
}
