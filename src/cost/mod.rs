//! What a training step costs on a device, known without running it: the memory it holds at its peak
//! ([`memory`]: per component, device and host, against the device's memory) and the time it takes
//! ([`time`]: the work of every op counted from its arithmetic, turned into seconds by a few rates and
//! efficiencies of the device); and a generation engine's decode step ([`decode`]).
//!
//! Read by `grpo train --plan` and the check a run makes before loading weights, and by `grpo bench`,
//! which prints the prediction beside what it measured.

mod advice;
pub mod calibration;
pub mod decode;
pub mod memory;
pub mod split;
pub mod time;
