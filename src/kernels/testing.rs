//! Helpers of the kernels' unit tests: seeded inputs and the error of a result relative to its reference.

use candle_core::{DType, Device, Tensor};

/// Seeded uniform values in `[-scale, scale)`, f32 on the CPU.
pub fn seeded(shape: &[usize], scale: f32, seed: u64) -> Tensor {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let n = shape.iter().product();
    Tensor::from_vec((0..n).map(|_| rng.gen_range(-scale..scale)).collect::<Vec<f32>>(), shape, &Device::Cpu).unwrap()
}

/// The largest absolute difference of `a` from `b` and `b`'s largest finite magnitude. A NaN in one and not
/// the other, or infinities that differ, count as an infinite difference: candle's `max` passes over NaN,
/// so a kernel that leaves elements unwritten (NaN in the emulator) would otherwise compare equal.
fn diff_and_scale(a: &Tensor, b: &Tensor) -> (f32, f32) {
    let flat = |t: &Tensor| -> Vec<f32> { t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1().unwrap() };
    let (a, b) = (flat(a), flat(b));
    (abs_diff(&a, &b), b.iter().filter(|y| y.is_finite()).fold(0f32, |m, y| m.max(y.abs())))
}

/// The largest difference of `a` from `b` relative to `b`'s largest magnitude (see [`diff_and_scale`]).
pub fn max_rel_diff(a: &Tensor, b: &Tensor) -> f32 {
    let (d, scale) = diff_and_scale(a, b);
    d / scale.max(f32::MIN_POSITIVE)
}

/// The largest difference of `a` from `b` relative to `b`'s largest magnitude or 1, the larger.
pub fn max_diff_over_1(a: &Tensor, b: &Tensor) -> f32 {
    let (d, scale) = diff_and_scale(a, b);
    d / scale.max(1.0)
}

/// The largest absolute difference of `a` from `b` (see [`diff_and_scale`]).
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    diff_and_scale(a, b).0
}

/// [`max_abs_diff`] of two slices.
pub fn abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "compared slices of {} and {} elements", a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| element_diff(*x, *y)).fold(0f32, f32::max)
}

/// |x - y|, infinite where one is NaN and the other not, 0 where both are NaN or equal infinities.
fn element_diff(x: f32, y: f32) -> f32 {
    match (x.is_nan(), y.is_nan()) {
        (true, true) => 0.0,
        (true, false) | (false, true) => f32::INFINITY,
        _ if x == y => 0.0,
        _ => (x - y).abs(),
    }
}
