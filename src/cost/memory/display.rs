//! The plan as the text `grpo train --plan` prints.

use std::fmt;

use super::{gib, Phase, Place, Plan, CUDA_CONTEXT_BYTES, GPU_HEADROOM, POOL_OVERHEAD};

impl Plan {
    /// The device peak's lines: the tensors' peak by phase and, on a GPU, the pool's overheads and the
    /// context beside it.
    fn fmt_device_peak(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let phase = |ph| gib(self.sum(ph, Place::Device));
        let resident = match self.gpu_device(Place::Device) {
            true => gib(self.sum(Phase::Resident, Place::Device).saturating_sub(CUDA_CONTEXT_BYTES)),
            false => phase(Phase::Resident),
        };
        let tensors = self.tensor_peak(Place::Device);
        let by_phase = format!(
            "resident {resident} + max(step {} + max(backward {}, update {}), validation {}, rollouts {})",
            phase(Phase::Step),
            phase(Phase::Backward),
            phase(Phase::Update),
            phase(Phase::Validation),
            phase(Phase::Rollout)
        );
        let peak = self.peak(Place::Device);
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
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "memory plan: {}", self.summary)?;
        writeln!(f, "{:<46} {:>11}  {:<6}  {:<10}  formula", "component", "peak", "where", "when")?;
        for c in &self.components {
            let place = if self.input.on_cpu {
                "host"
            } else if c.place == Place::Device {
                "device"
            } else {
                "host"
            };
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
            Some(m) => {
                let peak = self.peak(Place::Device);
                let verdict = if peak <= self.usable(m) {
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
                };
                writeln!(f, "device memory: {}: {verdict}", gib(m))
            }
            None => writeln!(f, "device memory: unknown (give --device-memory)"),
        }?;
        match &self.keep_logits_note {
            Some(note) => writeln!(f, "{note}"),
            None => Ok(()),
        }
    }
}
