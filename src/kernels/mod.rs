//! Fused operations with their own backward, as candle custom ops.
//!
//! Each op has a device-generic reference implementation built from candle tensor operations (the one
//! CI tests on CPU); CUDA kernels from `kernels/*.cu` replace the forward when the `cuda` feature is on.

mod logprob;

pub use logprob::{logprobs_entropy, logprobs_entropy_reference, LOGPROB_CHUNK_BYTES};
