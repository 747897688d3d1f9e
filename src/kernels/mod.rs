//! Fused operations with their own backward, as candle custom ops.
//!
//! The log-prob op ([`logprobs_entropy`]) runs its matmuls through candle and its per-row work through
//! two row kernels ([`row_stats`], [`row_grad`]): a CPU implementation (the reference CI tests) and, with
//! the `cuda` feature, CUDA kernels from kernels/logprob.cu compiled to PTX by build.rs.

mod logprob;
mod rows;

pub use logprob::{logprobs_entropy, logprobs_entropy_reference, LOGPROB_CHUNK_BYTES};
pub use rows::{row_grad, row_stats};
