//! Fused operations with their own backward, as candle custom ops. Each `X.rs` holds an op's CPU
//! implementation (the reference CI tests) and the launch plan of its CUDA kernels of kernels/X.cu
//! (launch.rs: kernel, grid, block, shared memory, ordered arguments, as plain data), which cuda.rs runs
//! on a GPU (`cuda` feature; PTX compiled by build.rs) and emu.rs on the host emulator in the tests
//! (docs/cuda-emulator.md):
//!
//! - [`rope`] (rope.rs): the rotary embedding fused with the head transpose, each way in one op.
//! - [`rms_norm`] (norm.rs): RMSNorm with its weight, one kernel forward and two backward (the input's and
//!   the weight's gradients).
//! - [`masked_softmax`] (attention.rs): the attention softmax (scale, causal/segment mask, softmax) in
//!   one pass with its own backward.
//! - [`flash_attention`] (flash_attention.rs): attention block by block with an online softmax and its
//!   own backward, O(T) memory per head; [`matrix_attention`] is the same through the `[T, S]` matrix.
//!   Its GPU path runs the block products as cuBLAS GEMMs, or, with [`GpuKernels::TensorCores`]
//!   ([`flash_attention_recorded`]), as the tensor-core instructions of kernels/flash_mma.cu (flash_mma.rs:
//!   their launch plans) or, on an H100/H200, the warpgroup ones of kernels/flash_wgmma.cu (flash_wgmma.rs).
//! - [`embedding`] (embedding.rs): the embedding lookup, whose backward [`embedding_grad`] sums each
//!   token's gradient rows in f32 ([`embedding_grad_into`]: into the weight's f32 accumulator, in place).
//! - [`row_stats`], [`row_grad`] (rows.rs): the two row kernels of the log-prob op, log-prob, entropy and
//!   log-sum-exp of each logits row in one pass, and its gradient `g (onehot - softmax)`.
//!
//! - [`swiglu`] (swiglu.rs): the MLP's `silu(gate) * up` in one pass each way.
//! - [`to_heads`], [`from_heads`] (heads.rs): the transposes around the attention as copies in 16-byte
//!   runs, each the other's backward.
//! - [`row_dot`] (row_dot.rs): each row's dot product of two tensors in f32, the attention backward's
//!   `rowsum(dO O)`, reading each input once.
//! - [`bias_add`] (bias.rs): a projection's bias added to its rows; the bias's gradient summed over rows
//!   in f32, in fixed row blocks.
//! - [`adamw`] (adamw.rs): the optimiser's update (AdamW or SGD) in one pass over a parameter's f32
//!   state, in place, equal bit for bit to the composite [`adamw_reference`].
//! - [`lora_linear`] (lora.rs): a LoRA projection, `x W^T + b + (dropout(x) A^T) B^T alpha / r` with the
//!   base frozen and the adapters in f32, as one op with its own backward: its products are candle's
//!   GEMMs, its element-wise steps (the adapters' input with the dropout mask, the sum) kernels/lora.cu.
//! - [`accumulate`] (accumulate.rs): a micro-batch's gradient added into its f32 accumulator in place,
//!   a transposed weight gradient read where it lies.
//! - [`sum_squares`] (sum_squares.rs): a tensor's sum of squares in one read over the whole GPU (each
//!   gradient's part of the gradient norm).
//! - [`frozen_matmul`], [`matmul_accumulating`] (frozen.rs): `x W^T` with the weight outside candle's
//!   graph, whose backward gives the gradient of `x` and either none to the weight (LoRA's frozen base
//!   projections) or adds it straight into the weight's f32 accumulator through [`wgrad_accumulate`]
//!   (wgrad.rs: `acc += g^T x`, one GEMM with an f32 output; cuBLAS on the GPU).
//!
//! - [`paged_attention`] (paged_attention.rs): generation's attention over a paged KV cache, each query
//!   token of a step against its sequence's positions in a pool of blocks, through its block table.
//!
//! The log-prob op [`logprobs_entropy`] (logprob.rs) runs its matmuls through candle, chunk by chunk,
//! and its per-row work through the row kernels.
//!
//! Every kernel exists for f32, bf16 and f16, and each side dispatches on the dtype in one place: on
//! the CPU `with_float!` (cpu.rs) binds the inputs' elements and the generic body is monomorphised per
//! dtype; on the GPU an op's plan names the kernel instance `{name}_{f32,bf16,f16}` of its inputs' dtype.

mod accumulate;
mod adamw;
mod attention;
mod bias;
// The PTX target against the card's compute capability, checked by cuda.rs.
#[cfg(any(test, feature = "cuda"))]
mod capability;
mod counter;
mod cpu;
#[cfg(feature = "cuda")]
mod cuda;
mod embedding;
#[cfg(test)]
mod emu;
mod flash_attention;
#[cfg(any(test, feature = "cuda"))]
mod flash_mma;
#[cfg(any(test, feature = "cuda"))]
mod flash_wgmma;
mod frozen;
mod heads;
mod row_dot;
// Launch plans, run by cuda.rs on a GPU and by the emulator (emu.rs) in the tests.
#[cfg(any(test, feature = "cuda"))]
mod launch;
mod logprob;
mod lora;
mod norm;
mod paged_attention;
mod rope;
mod rows;
mod sum_squares;
mod swiglu;
#[cfg(test)]
pub(crate) mod testing;
mod wgrad;

pub use accumulate::accumulate;
pub use adamw::{adamw, adamw_host, adamw_reference, AdamW};
pub use attention::{masked_softmax, masked_softmax_reference};
pub use bias::bias_add;
pub use counter::launches;
pub use embedding::{embedding, embedding_grad, embedding_grad_into, embedding_reference};
pub(crate) use flash_attention::dkv_partial_sum_bytes;
pub use flash_attention::{
    auto_kernels, flash_attention, flash_attention_recorded, matrix_attention, AttentionRecord, GpuKernels, Replay,
};
pub(crate) use flash_attention::{causal_work, driver::Device as AttentionDevice};
pub use frozen::{frozen_matmul, matmul_accumulating};
pub use heads::{from_heads, to_heads};
pub use logprob::{
    gpu_chunk_bytes, logprob_chunk_bytes, logprobs_entropy, logprobs_entropy_reference, logprobs_entropy_with,
    HeadBackward, LOGPROB_CHUNK_BYTES,
};
pub use lora::{lora_linear, lora_linear_reference, Dropout};
pub use norm::{rms_norm, rms_norm_reference};
pub use paged_attention::{paged_attention, paged_attention_reference, PagedLayout};
pub use rope::{rope, rope_reference};
pub use row_dot::row_dot;
pub use rows::{row_grad, row_stats};
pub use sum_squares::sum_squares;
pub use swiglu::{swiglu, swiglu_reference};
pub use wgrad::wgrad_accumulate;

/// Head dims the tensor-core attention kernels (kernels/flash_mma.cu) are compiled for.
pub const TENSOR_CORE_HEAD_DIMS: [usize; 2] = [64, 128];

/// Whether [`GpuKernels::TensorCores`] runs the tensor-core kernels on a GPU for inputs of `dtype` with head
/// dim `head_dim` (bf16 or f16 at a head dim of [`TENSOR_CORE_HEAD_DIMS`]; otherwise the chunked path).
pub fn tensor_core_attention(dtype: candle_core::DType, head_dim: usize) -> bool {
    matches!(dtype, candle_core::DType::BF16 | candle_core::DType::F16) && TENSOR_CORE_HEAD_DIMS.contains(&head_dim)
}

/// Whether [`GpuKernels::TensorCores`] with `warpgroup` runs the warpgroup kernels (kernels/flash_wgmma.cu) on `device`:
/// a GPU of compute capability 9.0 (the only one with wgmma), for the inputs [`tensor_core_attention`]
/// takes; elsewhere the tensor-core kernels or the chunked path.
pub fn warpgroup_attention(device: &candle_core::Device) -> candle_core::Result<bool> {
    match device {
        #[cfg(feature = "cuda")]
        candle_core::Device::Cuda(dev) => Ok(cuda::compute_capability(dev)?.0 == 9),
        _ => Ok(false),
    }
}

/// `A B` for `a` `[64, 16]` and `b` `[16, 64]` (bf16 or f16, row-major) by each operand layout the warpgroup
/// attention kernels give `wgmma`: A from registers with B K-major, and with B MN-major; A and B K-major
/// from shared tiles; both MN-major. `[4, 64, 64]` f32 on a GPU of compute capability 9.0 (kernels/
/// flash_wgmma.cu's `wgmma_layouts`), `None` on other devices (no wgmma there): for `grpo selftest`, where a
/// wrong layout shows by name before it shows in attention.
pub fn wgmma_layouts(
    a: &candle_core::Tensor,
    b: &candle_core::Tensor,
) -> candle_core::Result<Option<candle_core::Tensor>> {
    #[cfg(feature = "cuda")]
    if warpgroup_attention(a.device())? {
        return flash_wgmma::layouts(&a.contiguous()?, &b.contiguous()?).map(Some);
    }
    #[cfg(not(feature = "cuda"))]
    let _ = (a, b); // a build without CUDA has no device with wgmma
    Ok(None)
}

/// An error when `device` is a GPU whose compute capability is below the PTX target of this build's
/// kernels (the driver would refuse every launch with a less clear message); nothing on the CPU. Called
/// where a CUDA device is opened.
pub fn check_capability(device: &candle_core::Device) -> candle_core::Result<()> {
    match device {
        #[cfg(feature = "cuda")]
        candle_core::Device::Cuda(dev) => cuda::check_compute_capability(dev),
        _ => Ok(()),
    }
}
