//! Helpers of the kernels' unit tests: seeded inputs and the error of a result relative to its reference.

use candle_core::{DType, Device, Tensor};

/// Seeded uniform values in `[-scale, scale)`, f32 on the CPU.
pub fn seeded(shape: &[usize], scale: f32, seed: u64) -> Tensor {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let n = shape.iter().product();
    Tensor::from_vec((0..n).map(|_| rng.gen_range(-scale..scale)).collect::<Vec<f32>>(), shape, &Device::Cpu).unwrap()
}

/// The largest difference of `a` from `b` relative to `b`'s largest magnitude; infinite where `a` is NaN
/// and `b` is not (candle's `max` passes over NaN, so a kernel that leaves elements unwritten, NaN in the
/// emulator, would otherwise compare equal), or where the two differ in infinity.
pub fn max_rel_diff(a: &Tensor, b: &Tensor) -> f32 {
    let flat = |t: &Tensor| -> Vec<f32> { t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1().unwrap() };
    let (a, b) = (flat(a), flat(b));
    assert_eq!(a.len(), b.len(), "max_rel_diff of {} and {} elements", a.len(), b.len());
    let mut worst = 0f32;
    for (x, y) in a.iter().zip(&b) {
        let d = match (x.is_nan(), y.is_nan()) {
            (true, true) => 0.0,
            (true, false) | (false, true) => f32::INFINITY,
            _ if x == y => 0.0,
            _ => (x - y).abs(),
        };
        worst = worst.max(d);
    }
    let scale = b.iter().filter(|y| y.is_finite()).fold(0f32, |m, y| m.max(y.abs()));
    worst / scale.max(f32::MIN_POSITIVE)
}
