//! The fault-injection hook `GRPO_INJECT_OOM=<phase>[@<step>]`: entering the coarse phase it names
//! ([`super::coarse`]; at that step, counted from 1, when one is given) fails once with the CUDA driver's
//! out-of-memory error, on any device, so that how a run reports an allocation that fails (the phase, the
//! memory plan's figure, the last intact checkpoint) is tested without a GPU. It is read from the
//! environment of the `grpo` binary because the integration tests drive it there (tests/train_cli.rs
//! runs `grpo train` with `GRPO_INJECT_OOM=backward@2`); docs/reference.md documents it. Unset, it costs
//! one read of a `OnceLock` per coarse phase.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

static STEP: AtomicU64 = AtomicU64::new(0);
static INJECTED: AtomicBool = AtomicBool::new(false);

/// Tell the fault-injection hook which step (counted from 1, as metrics.jsonl and the checkpoints count
/// them) the run is in.
pub fn set_step(step: u64) {
    STEP.store(step, Ordering::Relaxed);
}

/// `GRPO_INJECT_OOM=<phase>[@<step>]`: the phase (and step) at which the hook fails once, as the CUDA
/// driver does when an allocation fails; read once.
fn injection() -> Option<&'static (String, Option<u64>)> {
    static SPEC: std::sync::OnceLock<Option<(String, Option<u64>)>> = std::sync::OnceLock::new();
    SPEC.get_or_init(|| std::env::var("GRPO_INJECT_OOM").ok().and_then(|v| parse_injection(&v))).as_ref()
}

fn parse_injection(v: &str) -> Option<(String, Option<u64>)> {
    let (phase, step) = match v.rsplit_once('@') {
        Some((p, s)) => (p, Some(s.trim().parse().ok()?)),
        None => (v, None),
    };
    let phase = phase.trim();
    (!phase.is_empty()).then(|| (phase.to_string(), step))
}

/// An out-of-memory error with the text of the CUDA driver's when `GRPO_INJECT_OOM` names the phase
/// `name` entered now (at its step when given), the first time only: a test of how a run reports an
/// allocation that fails, on any device.
pub(super) fn injected_oom(name: &str) -> candle_core::Result<()> {
    let Some((phase, step)) = injection() else { return Ok(()) };
    let due = phase == name && step.is_none_or(|s| s == STEP.load(Ordering::Relaxed));
    if due && !INJECTED.swap(true, Ordering::Relaxed) {
        return Err(candle_core::Error::Msg(
            "DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\") (injected by GRPO_INJECT_OOM)".into(),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn injections_name_a_phase_and_maybe_a_step() {
        assert_eq!(parse_injection("backward@2"), Some(("backward".into(), Some(2))));
        assert_eq!(parse_injection("log-prob head"), Some(("log-prob head".into(), None)));
        assert_eq!(parse_injection("backward@x"), None);
        assert_eq!(parse_injection(""), None);
    }
}
