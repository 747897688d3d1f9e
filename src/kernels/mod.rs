//! Fused operations with their own backward, as candle custom ops.
//!
//! [`rope`] is the rotary embedding fused with the head transpose, each way in one op; CPU implementation
//! here, CUDA kernels in kernels/rope.cu.
//!
//! [`rms_normalize`] is RMSNorm without its weight, in one pass with its own backward; CPU implementation
//! here, CUDA kernels in kernels/norm.cu.
//!
//! [`masked_softmax`] is the attention softmax (scale, causal/segment mask, softmax) in one pass with its
//! own backward; CPU implementation here, CUDA kernels in kernels/attention.cu.
//!
//! The log-prob op ([`logprobs_entropy`]) runs its matmuls through candle and its per-row work through
//! two row kernels ([`row_stats`], [`row_grad`]): a CPU implementation (the reference CI tests) and, with
//! the `cuda` feature, CUDA kernels from kernels/logprob.cu compiled to PTX by build.rs.

mod attention;
mod cpu;
#[cfg(feature = "cuda")]
mod cuda;
mod logprob;
mod norm;
mod rope;
mod rows;

pub use attention::{masked_softmax, masked_softmax_reference};
pub use logprob::{logprobs_entropy, logprobs_entropy_reference, LOGPROB_CHUNK_BYTES};
pub use norm::{rms_normalize, rms_normalize_reference};
pub use rope::{rope, rope_reference};
pub use rows::{row_grad, row_stats};
