//! `GRPO_INJECT_OOM=<phase>[@<step>]`: entering the coarse phase it names ([`super::coarse`]; at that
//! step, counted from 1, when given) fails once with the CUDA driver's out-of-memory error, on any
//! device, so that how a run reports a failed allocation is tested without a GPU (tests/train_cli.rs,
//! docs/reference.md). Unset, it costs a `OnceLock` read per coarse phase.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::OnceLock;

static STEP: AtomicU64 = AtomicU64::new(0);
static INJECTED: AtomicBool = AtomicBool::new(false);

/// Tell the hook the run's step (counted from 1, as metrics.jsonl and the checkpoints count them).
pub fn set_step(step: u64) {
    STEP.store(step, Ordering::Relaxed);
}

fn parse_injection(v: &str) -> Option<(String, Option<u64>)> {
    let (phase, step) = match v.rsplit_once('@') {
        Some((p, s)) => (p, Some(s.trim().parse().ok()?)),
        None => (v, None),
    };
    let phase = phase.trim();
    (!phase.is_empty()).then(|| (phase.to_string(), step))
}

/// The CUDA driver's out-of-memory error, the first time the phase `name` is entered where
/// `GRPO_INJECT_OOM` names it (and its step).
pub(super) fn injected_oom(name: &str) -> candle_core::Result<()> {
    static SPEC: OnceLock<Option<(String, Option<u64>)>> = OnceLock::new();
    let spec = SPEC.get_or_init(|| std::env::var("GRPO_INJECT_OOM").ok().and_then(|v| parse_injection(&v)));
    let Some((phase, step)) = spec else { return Ok(()) };
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
