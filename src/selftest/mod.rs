//! `grpo selftest`: what a user runs first on a new machine. Every fused kernel runs on the device
//! against its composite candle reference on the CPU in f32 ([`kernels`]), then one training step and
//! one greedy generation of a tiny random model run on the device against the same model on the CPU
//! with the composite ops ([`model`]). Each comparison is one [`CheckResult`]: its largest error, the
//! tolerance, pass or fail and the time it took.
//!
//! On `cpu` the same table compares the CPU implementations of the fused ops with their composite
//! references; on `cuda:N` it compares the CUDA kernels (and candle's CUDA backend around them).

pub mod kernels;
pub mod model;

use std::time::Instant;

use candle_core::{DType, Device, Result, Tensor};
use serde::Serialize;

/// One row of the self-test's table.
#[derive(Debug, Clone, Serialize)]
pub struct CheckResult {
    /// What was compared, e.g. `rms_norm bwd` or `train step loss`.
    pub check: String,
    /// The dtype the device computed in.
    pub dtype: &'static str,
    /// The largest error ([`max_error`] unless the check says otherwise); NaN when a value was NaN.
    pub max_error: f32,
    pub tolerance: f32,
    pub passed: bool,
    /// Seconds the check took, device and reference together (the first launch of a kernel includes
    /// loading its module).
    pub seconds: f64,
    /// Why the check could not run (its `max_error` is then NaN).
    pub error: Option<String>,
}

/// One compared quantity of a check: its name and its error.
#[derive(Debug, Clone, PartialEq)]
pub struct Part {
    pub name: &'static str,
    pub error: f32,
}

impl Part {
    /// `name` with the [`max_error`] of `device` against `reference`.
    pub fn compare(name: &'static str, device: &Tensor, reference: &Tensor) -> Result<Self> {
        Ok(Part { name, error: max_error(device, reference)? })
    }
}

/// `max |a - b| / max |b|` over all elements (the error relative to the reference's scale, which stays
/// meaningful where single values are near zero); NaN when either side holds a NaN or an infinity, or
/// when the shapes differ. An all-zero reference gives the absolute error.
pub fn max_error(a: &Tensor, b: &Tensor) -> Result<f32> {
    let flat =
        |t: &Tensor| -> Result<Vec<f32>> { t.to_device(&Device::Cpu)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1() };
    let (a, b) = (flat(a)?, flat(b)?);
    if a.len() != b.len() || a.iter().chain(&b).any(|x| !x.is_finite()) {
        return Ok(f32::NAN);
    }
    let diff = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
    let scale = b.iter().map(|y| y.abs()).fold(0f32, f32::max);
    Ok(if scale > 0.0 { diff / scale } else { diff })
}

/// The name of a float dtype as the CLI spells it.
pub fn dtype_name(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        DType::F64 => "f64",
        _ => "other",
    }
}

/// The rows of one check: one per part when it ran (the check named `{op} {part}`), one failed row
/// carrying the error when it did not.
fn rows(op: &str, dtype: DType, tolerance: f32, seconds: f64, outcome: Result<Vec<Part>>) -> Vec<CheckResult> {
    let row = |check: String, max_error: f32, error: Option<String>| CheckResult {
        check,
        dtype: dtype_name(dtype),
        max_error,
        tolerance,
        passed: error.is_none() && max_error <= tolerance,
        seconds,
        error,
    };
    match outcome {
        Ok(parts) => parts.into_iter().map(|p| row(format!("{op} {}", p.name), p.error, None)).collect(),
        Err(e) => vec![row(op.to_string(), f32::NAN, Some(e.to_string()))],
    }
}

/// Run every check on `device`, calling `on_row` with each row as it is done (the CLI prints them as
/// they come); returns all rows. A check that fails to run is a failed row, never an early stop.
pub fn run(device: &Device, mut on_row: impl FnMut(&CheckResult)) -> Vec<CheckResult> {
    let mut all = Vec::new();
    let mut record = |op: &str, dtype: DType, tolerance: f32, f: &mut dyn FnMut() -> Result<Vec<Part>>| {
        let t0 = Instant::now();
        let outcome = f();
        let seconds = t0.elapsed().as_secs_f64();
        for r in rows(op, dtype, tolerance, seconds, outcome) {
            on_row(&r);
            all.push(r);
        }
    };
    for check in kernels::CHECKS {
        for &dtype in &[DType::F32, DType::BF16, DType::F16] {
            record(check.op, dtype, (check.tolerance)(dtype), &mut || (check.run)(device, dtype));
        }
    }
    for check in model::CHECKS {
        record(check.op, check.dtype, check.tolerance, &mut || (check.run)(device));
    }
    all
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(v: &[f32]) -> Tensor {
        Tensor::new(v, &Device::Cpu).unwrap()
    }

    #[test]
    fn the_error_is_relative_to_the_reference_scale_and_fails_on_nan() {
        // 0.01 off at a value of 1e-6: relative to the largest value (2), not to the 1e-6.
        assert!((max_error(&t(&[2.0, 0.010001]), &t(&[2.0, 1e-6])).unwrap() - 0.005).abs() < 1e-6);
        assert_eq!(max_error(&t(&[1.0, 3.0]), &t(&[1.0, 3.0])).unwrap(), 0.0);
        assert_eq!(max_error(&t(&[0.5]), &t(&[0.0])).unwrap(), 0.5);
        assert!(max_error(&t(&[f32::NAN]), &t(&[1.0])).unwrap().is_nan());
        assert!(max_error(&t(&[1.0]), &t(&[f32::INFINITY])).unwrap().is_nan());
        assert!(max_error(&t(&[1.0, 2.0]), &t(&[1.0])).unwrap().is_nan());
    }

    #[test]
    fn a_check_that_cannot_run_is_one_failed_row() {
        let failed = rows("rope", DType::BF16, 0.1, 0.5, Err(candle_core::Error::Msg("no kernel".into())));
        assert_eq!(failed.len(), 1);
        assert!(!failed[0].passed && failed[0].max_error.is_nan() && failed[0].dtype == "bf16");
        assert_eq!(failed[0].error.as_deref(), Some("no kernel"));
        let parts = vec![Part { name: "fwd", error: 0.05 }, Part { name: "bwd", error: 0.2 }];
        let ran = rows("rope", DType::F32, 0.1, 0.5, Ok(parts));
        assert_eq!(
            ran.iter().map(|r| (r.check.as_str(), r.passed)).collect::<Vec<_>>(),
            [("rope fwd", true), ("rope bwd", false)]
        );
    }
}
