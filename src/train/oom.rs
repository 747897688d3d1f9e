//! An allocation that fails during a run: the driver's bare `CUDA_ERROR_OUT_OF_MEMORY` turned into an
//! error that names the phase it failed in, what the memory plan expected there, what was in use, and the
//! settings that bring the peak down.

use candle_core::Device;

use super::{TrainConfig, TrainError};
use crate::cost::memory::{Phase, Place, Plan};

/// The text of the CUDA driver's out-of-memory error, as candle wraps it.
const DRIVER_OOM: &str = "CUDA_ERROR_OUT_OF_MEMORY";

const GIB: f64 = (1u64 << 30) as f64;

/// What an out-of-memory error says.
#[derive(Debug, thiserror::Error)]
#[error(
    "out of device memory in the {phase}: the memory plan expected {expected}; in use: {in_use}. To fit, \
     {advice}. The last completed step's checkpoint: {checkpoint}. ({cause})"
)]
pub struct OutOfMemory {
    /// The coarse phase the allocation failed in ([`crate::profile::current_phase`]'s names).
    pub phase: &'static str,
    pub expected: String,
    pub in_use: String,
    /// The settings that bring the peak down.
    pub advice: String,
    pub checkpoint: String,
    /// The driver's error.
    pub cause: String,
}

/// `err` as [`TrainError::OutOfMemory`] when it is the driver's out-of-memory error (else as it is):
/// the phase is the innermost coarse phase the error left ([`crate::profile::failed_phase`]), the
/// expected bytes the plan's for that phase, the bytes in use the pool's now and at its peak since the
/// step began (None on the CPU).
pub(super) fn classify(err: TrainError, plan: Option<&Plan>, cfg: &TrainConfig, device: &Device) -> TrainError {
    let cause = err.to_string();
    if !cause.contains(DRIVER_OOM) {
        return err;
    }
    let phase = crate::profile::failed_phase().unwrap_or("the training loop");
    // After a failed allocation the device may refuse a synchronisation too: then nothing is measured.
    let in_use = crate::device::memory_bytes(device).ok().flatten();
    let expected = plan.map(|p| expected(p, phase));
    let advice =
        plan.map_or_else(|| "reduce train.micro_batch_size or data.max_response_tokens".into(), |p| p.advice());
    let checkpoint = super::latest_checkpoint(&cfg.train.output_dir);
    TrainError::OutOfMemory(Box::new(OutOfMemory {
        phase,
        expected: describe_expected(expected),
        in_use: describe_in_use(in_use),
        advice,
        checkpoint: checkpoint.map_or_else(
            || "none yet".into(),
            |c| format!("{} (intact: --resume auto continues from it)", c.display()),
        ),
        cause,
    }))
}

/// The plan's bytes for the coarse phase `phase`: `(tensors alive in it, the run's device peak)`.
fn expected(plan: &Plan, phase: &str) -> (Option<u64>, u64) {
    let phases: &[Phase] = match phase {
        "forward" | "backward" | "log-prob head" | "reference" => &[Phase::Step, Phase::Backward],
        "optimizer" => &[Phase::Step, Phase::Update],
        "validation" => &[Phase::Validation],
        "rollouts" => &[Phase::Rollout],
        _ => &[],
    };
    let on_device = |place: Place| place == Place::Device || plan.input.on_cpu;
    let sum = |ph: Phase| -> u64 {
        plan.components.iter().filter(|c| c.phase == ph && on_device(c.place)).map(|c| c.bytes).sum()
    };
    let there = (!phases.is_empty()).then(|| sum(Phase::Resident) + phases.iter().map(|&p| sum(p)).sum::<u64>());
    (there, plan.peak(Place::Device))
}

fn describe_expected(expected: Option<(Option<u64>, u64)>) -> String {
    match expected {
        None => "no memory plan".into(),
        Some((Some(there), peak)) => {
            format!(
                "{:.2} GiB of tensors there (the run's device peak: {:.2} GiB)",
                there as f64 / GIB,
                peak as f64 / GIB
            )
        }
        Some((None, peak)) => format!("a device peak of {:.2} GiB", peak as f64 / GIB),
    }
}

fn describe_in_use(in_use: Option<(u64, u64)>) -> String {
    match in_use {
        Some((now, peak)) => format!(
            "{:.2} GiB in the pool after the failure, {:.2} GiB at the step's peak",
            now as f64 / GIB,
            peak as f64 / GIB
        ),
        None => "not measured (no device memory counter)".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_drivers_out_of_memory_error_is_classified() {
        let min = "[model]\npath = \"m\"\n[data]\ninputs = [\"x.jsonl\"]\n[train]\noutput_dir = \"/nonexistent\"\n";
        let cfg = TrainConfig::parse(min, std::path::Path::new("c.toml"), &[]).unwrap();
        let other = classify(TrainError::Stopped("disk full".into()), None, &cfg, &Device::Cpu);
        assert!(matches!(other, TrainError::Stopped(_)));
        let oom = candle_core::Error::Msg("DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")".into());
        let e = classify(oom.into(), None, &cfg, &Device::Cpu).to_string();
        assert!(e.starts_with("out of device memory in the "), "{e}");
        assert!(e.contains("not measured") && e.contains("micro_batch_size"), "{e}");
    }
}
