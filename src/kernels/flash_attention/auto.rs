//! `model.attention = "auto"`: the fastest attention kernels that pass a check on the device they run on.
//! On a GPU of compute capability 9.0 the warpgroup kernels (kernels/flash_wgmma.cu), then the mma ones
//! (kernels/flash_mma.cu), on 8.x the mma ones, for bf16/f16 at a head dim of
//! [`TENSOR_CORE_HEAD_DIMS`](crate::kernels::TENSOR_CORE_HEAD_DIMS); the chunked path elsewhere and when
//! no candidate passes. A candidate passes when a small causal attention (two sequences packed in a
//! row of 400 tokens, GQA), forward and backward, gives what the chunked path gives on the same device
//! within the dtype's rounding; the check runs once per device, dtype, head dim and backward, the first time the
//! decoder attends there, and its verdict (and why a candidate was passed over) is logged.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use candle_core::{DType, Device, Result, Tensor, Var};

use super::{attend, GpuKernels};

/// What [`choose`] decided: the kernels, and a line for the log per candidate tried.
#[derive(Debug, Clone, PartialEq)]
pub struct Choice {
    pub kernels: GpuKernels,
    pub log: Vec<String>,
}

/// The first candidate that `check` passes (it returns the largest difference to the reference, or why
/// it could not run), or the chunked path.
pub fn choose(
    candidates: &[(&str, GpuKernels)],
    mut check: impl FnMut(GpuKernels) -> std::result::Result<f32, String>,
) -> Choice {
    let mut log = Vec::new();
    for &(name, kernels) in candidates {
        match check(kernels) {
            Ok(diff) => {
                log.push(format!("{name} kernels: passed the start-up check (largest relative difference {diff:.1e})"));
                return Choice { kernels, log };
            }
            Err(why) => log.push(format!("{name} kernels: failed the start-up check, not used: {why}")),
        }
    }
    log.push("the chunked path (cuBLAS GEMMs over blocks)".into());
    Choice { kernels: GpuKernels::Chunked, log }
}

/// The kernels `model.attention = "auto"` runs for inputs of `dtype` at head dim `head_dim` on `device`,
/// `atomic_dq` as `model.deterministic_attention = false` asks (checked once per key, then remembered).
pub fn auto_kernels(device: &Device, dtype: DType, head_dim: usize, atomic_dq: bool) -> Result<GpuKernels> {
    if !device.is_cuda() || !super::super::tensor_core_attention(dtype, head_dim) {
        return Ok(GpuKernels::Chunked);
    }
    static VERDICTS: OnceLock<Mutex<HashMap<String, GpuKernels>>> = OnceLock::new();
    let key = format!("{:?} {dtype:?} {head_dim} {atomic_dq}", device.location());
    let mut verdicts = VERDICTS.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
    if let Some(&k) = verdicts.get(&key) {
        return Ok(k);
    }
    let mut candidates = Vec::new();
    if super::super::warpgroup_attention(device)? {
        candidates.push(("warpgroup (wgmma)", GpuKernels::TensorCores { atomic_dq, warpgroup: true }));
    }
    candidates.push(("tensor-core (mma)", GpuKernels::TensorCores { atomic_dq, warpgroup: false }));
    let choice = choose(&candidates, |k| check(device, dtype, head_dim, k).map_err(|e| e.to_string())?);
    tracing::info!("model.attention = \"auto\" on {key}: {}", choice.log.join("; "));
    verdicts.insert(key, choice.kernels);
    Ok(choice.kernels)
}

/// The largest difference, relative to the output's and each gradient's largest magnitude, between
/// `kernels` and the chunked path on `device` for a small causal attention (`Err`: the kernels failed
/// to run, or differ by more than the dtype's rounding allows).
pub fn check(
    device: &Device,
    dtype: DType,
    head_dim: usize,
    kernels: GpuKernels,
) -> Result<std::result::Result<f32, String>> {
    use rand::{Rng, SeedableRng};
    let (b, h, kv, t) = (1, 4, 2, 400);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    let mut random = |shape: (usize, usize, usize, usize)| -> Result<Tensor> {
        let n = shape.0 * shape.1 * shape.2 * shape.3;
        let v: Vec<f32> = (0..n).map(|_| rng.gen_range(-2.0..2.0)).collect();
        Tensor::from_vec(v, shape, device)?.to_dtype(dtype)
    };
    let (q, k, v, up) = (
        random((b, h, t, head_dim))?,
        random((b, kv, t, head_dim))?,
        random((b, kv, t, head_dim))?,
        random((b, h, t, head_dim))?,
    );
    // Two sequences packed in the row (353 and 47 tokens), causal within each: the first's last queries
    // see six key blocks of 64, so that the warpgroup kernels' rings of five slots refill.
    let ranges: Vec<u32> = (0..t as u32).flat_map(|i| [if i < 353 { 0 } else { 353 }, i]).collect();
    let ranges = Tensor::from_vec(ranges, (b, t, 2), device)?;
    let scale = 1.0 / (head_dim as f64).sqrt();
    let run = |kernels: GpuKernels| -> Result<Vec<Tensor>> {
        let (qv, kv, vv) = (Var::from_tensor(&q)?, Var::from_tensor(&k)?, Var::from_tensor(&v)?);
        let y = attend(qv.as_tensor(), kv.as_tensor(), vv.as_tensor(), &ranges, scale, None, kernels, None)?;
        let grads = (y.to_dtype(DType::F32)? * up.to_dtype(DType::F32)?)?.sum_all()?.backward()?;
        let mut out = vec![y];
        for var in [&qv, &kv, &vv] {
            out.push(grads.get(var.as_tensor()).cloned().ok_or_else(|| candle_core::Error::Msg("no gradient".into()))?);
        }
        out.into_iter().map(|t| t.to_dtype(DType::F32)).collect()
    };
    let got = match run(kernels) {
        Ok(got) => got,
        Err(e) => return Ok(Err(e.to_string())),
    };
    let want = run(GpuKernels::Chunked)?;
    let tolerance = if dtype == DType::F32 { 1e-4 } else { 3e-2 };
    let mut worst = 0f32;
    for (name, (g, w)) in ["output", "dq", "dk", "dv"].iter().zip(got.iter().zip(&want)) {
        let scale = w.abs()?.max_all()?.to_scalar::<f32>()?.max(f32::MIN_POSITIVE);
        let diff = (g - w)?.abs()?.max_all()?.to_scalar::<f32>()? / scale;
        if !diff.is_finite() || diff > tolerance {
            return Ok(Err(format!("{name} differs from the chunked path's by {diff:.1e} of its largest value")));
        }
        worst = worst.max(diff);
    }
    Ok(Ok(worst))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MMA: GpuKernels = GpuKernels::TensorCores { atomic_dq: false, warpgroup: false };
    const WGMMA: GpuKernels = GpuKernels::TensorCores { atomic_dq: false, warpgroup: true };

    #[test]
    fn the_first_candidate_that_passes_is_taken_and_the_others_are_logged() {
        let mut tried = Vec::new();
        let c = choose(&[("wgmma", WGMMA), ("mma", MMA)], |k| {
            tried.push(k);
            if k == WGMMA {
                Err("CUDA_ERROR_ILLEGAL_INSTRUCTION".into())
            } else {
                Ok(1e-3)
            }
        });
        assert_eq!(c.kernels, MMA);
        assert_eq!(tried, [WGMMA, MMA]);
        assert!(c.log[0].contains("wgmma kernels: failed") && c.log[0].contains("ILLEGAL_INSTRUCTION"), "{:?}", c.log);
        assert!(c.log[1].contains("mma kernels: passed"), "{:?}", c.log);
    }

    #[test]
    fn without_a_candidate_that_passes_the_chunked_path_runs() {
        let c = choose(&[("wgmma", WGMMA), ("mma", MMA)], |_| Err("differs".into()));
        assert_eq!(c.kernels, GpuKernels::Chunked);
        assert_eq!(c.log.len(), 3);
        assert_eq!(choose(&[], |_| Ok(0.0)).kernels, GpuKernels::Chunked);
    }

    /// The check itself on the CPU (both paths are the CPU's one implementation: no difference), and the
    /// CPU never runs the tensor-core kernels.
    #[test]
    fn the_check_runs_forward_and_backward_and_the_cpu_takes_the_chunked_path() {
        for dtype in [DType::F32, DType::BF16] {
            let diff = check(&Device::Cpu, dtype, 64, MMA).unwrap().unwrap();
            assert_eq!(diff, 0.0, "{dtype:?}");
        }
        assert_eq!(auto_kernels(&Device::Cpu, DType::BF16, 128, false).unwrap(), GpuKernels::Chunked);
    }
}
