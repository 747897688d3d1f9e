//! Where a training step's time goes: a profile of its phases (`grpo bench train-step --profile`,
//! `[train] profile_steps`), and the coarse phase a thread is in ([`current_phase`]).
//!
//! A phase is a scope opened with [`phase`] (or [`coarse`]) until its guard drops. Phases nest into a
//! tree; calls of a phase under the same parent add up (every layer's attention is one row). Each phase
//! has its calls, its total time and self time (without its sub-phases: the self times and the step's
//! remainder, "other", add up to the step), and its counts:
//!
//! - **time**: wall time between device synchronisations, made at each phase boundary while profiling
//!   (the device time of the phase's work; the synchronisations cost the step some time).
//! - **host syncs**: reads of device values by the host ([`crate::device::to_host`]).
//! - **copies**: host-to-device and device-to-host copies and their bytes, counted where the project
//!   makes them on every device (on the CPU, the transfers a GPU run makes).
//! - **launches**: on a GPU, launches of the project's own kernels ([`crate::kernels`]); candle's CUDA
//!   ops have no hook to count them.
//! - **buffers**: new tensor buffers (views excepted), counted by [`CountingAlloc`] on every device; on a
//!   GPU each is a device allocation and, copies aside, a kernel launch.
//! - **allocations**: host heap allocations, frees and bytes of every thread, counted by
//!   [`CountingAlloc`] when the binary installs it (the `grpo` binary does); 0 otherwise.
//!
//! Profiling is off unless a [`Profiler`] runs on the thread; a phase guard then costs a thread-local
//! read. fault_injection.rs is the `GRPO_INJECT_OOM` hook the coarse phases call.

mod alloc;
mod counters;
mod fault_injection;
mod phases;
mod report;

pub use alloc::CountingAlloc;
pub use counters::PhaseCounts;
pub use fault_injection::set_step;
pub use phases::{coarse, current_phase, failed_phase, phase, Phase, Profile, ProfileError, Profiler};
pub use report::{Counted, PhaseReport, ProfileReport};
