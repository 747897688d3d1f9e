//! The plan as the text `grpo train --plan` prints.

use std::fmt;

use super::{gib, Phase, Place, Plan, CUDA_CONTEXT_BYTES, GPU_HEADROOM, POOL_OVERHEAD};

impl Plan {
    /// The device peak's lines: the tensors' peak by phase and, on a GPU, the pool and the context.
    fn fmt_device_peak(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let phase = |ph| gib(self.sum(ph, Place::Device));
        let by_phase = format!(
            "resident {} + max(step {} + max(backward {}, update {}), validation {}, rollouts {})",
            gib(self.resident_tensors(Place::Device)),
            phase(Phase::Step),
            phase(Phase::Backward),
            phase(Phase::Update),
            phase(Phase::Validation),
            phase(Phase::Rollout)
        );
        let (tensors, peak) = (self.tensor_peak(Place::Device), self.peak(Place::Device));
        if !self.gpu_device(Place::Device) {
            return writeln!(f, "device peak: {} ({peak} bytes) = {by_phase}", gib(peak));
        }
        let o = POOL_OVERHEAD;
        writeln!(f, "tensors' peak: {} = {by_phase}", gib(tensors))?;
        writeln!(
            f,
            "memory pool: {} = tensors x {:.4} (not itemised) x {:.4} (the pool's reserve), measured on {}",
            gib(o.pooled(tensors)),
            1.0 + o.unitemised,
            1.0 + o.reserve,
            o.measured
        )?;
        writeln!(f, "device peak: {} ({peak} bytes) = memory pool + context {}", gib(peak), gib(CUDA_CONTEXT_BYTES))
    }

    /// Whether the device's peak fits `m` bytes of memory, in words.
    fn verdict(&self, m: u64) -> String {
        let peak = self.peak(Place::Device);
        if peak <= self.usable(m) {
            format!("fits, {} ({:.0}%) left", gib(m - peak), 100.0 * (m - peak) as f64 / m as f64)
        } else if peak <= m {
            format!(
                "does NOT fit: {} under the device's memory, within the {:.0}% a GPU's plan keeps free for its \
                 measured overheads' spread",
                gib(m - peak),
                100.0 * GPU_HEADROOM
            )
        } else {
            format!("does NOT fit: {} over", gib(peak - m))
        }
    }
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "memory plan: {}", self.summary)?;
        writeln!(f, "{:<46} {:>11}  {:<6}  {:<10}  formula", "component", "peak", "where", "when")?;
        for c in &self.components {
            let place = if self.input.on_cpu || c.place == Place::Host { "host" } else { "device" };
            let phase = match c.phase {
                Phase::Resident => "resident",
                Phase::Step => "step",
                Phase::Backward => "backward",
                Phase::Update => "update",
                Phase::Validation => "validation",
                Phase::Rollout => "rollouts",
                Phase::Alternative => "(not used)",
            };
            writeln!(f, "{:<46} {:>11}  {:<6}  {:<10}  {}", c.name, gib(c.bytes), place, phase, c.formula)?;
        }
        self.fmt_device_peak(f)?;
        if !self.input.on_cpu {
            writeln!(f, "host peak (optimizer state and update): {}", gib(self.peak(Place::Host)))?;
        }
        match self.input.device_memory {
            Some(m) => writeln!(f, "device memory: {}: {}", gib(m), self.verdict(m))?,
            None => writeln!(f, "device memory: unknown (give --device-memory)")?,
        }
        match &self.keep_logits_note {
            Some(note) => writeln!(f, "{note}"),
            None => Ok(()),
        }
    }
}
