//! Helpers of the kernels' unit tests: seeded inputs and the error of a result relative to its reference.

use candle_core::{DType, Device, Tensor};

/// Seeded uniform values in `[-scale, scale)`, f32 on the CPU.
pub fn seeded(shape: &[usize], scale: f32, seed: u64) -> Tensor {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let n = shape.iter().product();
    Tensor::from_vec((0..n).map(|_| rng.gen_range(-scale..scale)).collect::<Vec<f32>>(), shape, &Device::Cpu).unwrap()
}

/// The largest difference of `a` from `b` relative to `b`'s largest magnitude.
pub fn max_rel_diff(a: &Tensor, b: &Tensor) -> f32 {
    let b = b.to_dtype(DType::F32).unwrap();
    let d = (a.to_dtype(DType::F32).unwrap() - &b).unwrap();
    let max = |t: &Tensor| -> f32 { t.abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar().unwrap() };
    max(&d) / max(&b).max(f32::MIN_POSITIVE)
}
