//! Where a training step's time goes: a profile of its phases (`grpo bench train-step --profile`,
//! `[train] profile_steps`), and the coarse phase a thread is in ([`current_phase`]).
//!
//! A phase is a scope opened with [`phase`] (or [`coarse`]) and closed when its guard drops. Phases nest
//! into a tree (a layer's attention inside the forward); calls of the same phase under the same parent
//! are added up (every layer's attention is one row, its call count shown). For each phase the profile
//! records its calls, its time in it (total, and self: without its sub-phases, so that the self times
//! of all phases and of the step's remainder, "other", add up to the step) and what happened in it:
//!
//! - **time**: wall time between device synchronisations. While profiling, each phase boundary waits
//!   for the device (`Device::synchronize`), so a phase's time is the device time of the work it queued
//!   (on a GPU, as CUDA events would give; on the CPU the work is done when the call returns). The
//!   synchronisations themselves cost a step some time a run without the profiler does not spend.
//! - **host syncs**: reads of device values by the host ([`crate::device::to_host`]), each a wait for
//!   the device on a GPU; the profiler's own synchronisations are not counted.
//! - **copies**: host-to-device copies (host data placed on the model's device,
//!   [`crate::device::from_host`], and the offloaded optimiser's new weights) and device-to-host copies
//!   (reads, and gradients to the offloaded optimiser), with their bytes. They are counted where the
//!   project moves data on every device: on the CPU the model's memory is host memory, so the counts are
//!   the transfers a GPU run of the same step makes.
//! - **launches**: on a GPU, the launches of the project's own kernels ([`crate::kernels`]); candle's
//!   own CUDA ops (matmuls, element-wise ops, casts) have no hook to count them (candle 0.11 has none).
//! - **buffers**: the ops that produced a new tensor buffer, on every device (each allocation of
//!   candle's storage header, made once per new buffer, views excepted, counted by [`CountingAlloc`]).
//!   On a GPU each is a device allocation and, copies aside, a kernel launch: on the CPU, the count of
//!   the launches a GPU run of the step makes.
//! - **allocations**: host heap allocations and frees, and the bytes allocated, of every thread of the
//!   process (candle's CPU ops run on a thread pool), counted by [`CountingAlloc`] when the binary
//!   installs it as its global allocator (the `grpo` binary does). On a GPU, device memory is not in
//!   these counts. Without the allocator installed they read 0.
//!
//! Profiling is off unless a [`Profiler`] is running on the thread; a phase guard then costs a
//! thread-local read. The coarse phase ([`current_phase`]) is kept whether or not a profile runs.
//!
//! By concern: phases.rs holds the phase tree and the coarse phase; counters.rs reads the counters
//! that the device ([`crate::device::copies`], [`crate::device::host_reads`]), the kernels
//! ([`crate::kernels::launches`]) and the allocator (alloc.rs) keep; report.rs is the mean step as a
//! record and a table; fault_injection.rs is the `GRPO_INJECT_OOM` hook the coarse phases call.

mod alloc;
mod counters;
mod fault_injection;
mod phases;
mod report;

pub use alloc::CountingAlloc;
pub use fault_injection::set_step;
pub use phases::{coarse, current_phase, failed_phase, phase, Phase, Profile, ProfileError, Profiler};
pub use report::{Counted, PhaseCounts, PhaseReport, ProfileReport};
