//! Text generation for `grpo eval`, `[validation]` and `[rollout]`.
//!
//! - [`sampling`]: sampling settings, the host sampler, each sequence's random stream, and the pick of a
//!   step's next tokens; [`device_sampler`]: the same choice with tensor ops on the logits' device.
//! - [`blocks`]: the paged KV cache's pool of fixed-size blocks, shared by reference count and cached by
//!   their tokens (prefix caching).
//! - [`scheduler`]: continuous batching: a token budget per step, decode first, chunked prefill of the
//!   waiting sequences, preemption when the pool runs out, a problem's samples forked off one prefill.
//! - [`engine`]: the loop that runs the scheduler's steps through the decoder's paged forward.
//! - [`static_batch`]: static batches on a contiguous cache (the `static` schedule, the reference).
//! - [`options`]: the settings, one struct for every owner.

pub mod blocks;
pub mod device_sampler;
pub mod engine;
pub mod options;
pub mod sampling;
pub mod scheduler;
pub mod static_batch;

pub use device_sampler::sample_rows;
pub use engine::{generate_paged, GenerateError, Report, Request};
pub use options::{GenerationOptions, Schedule};
pub use sampling::{sample_token, sample_token_reference, sequence_rng, FinishReason, Generation, SamplingParams};
pub use static_batch::{generate, generate_limited};
