//! `grpo bench attention`: forward and backward of one layer's causal attention against a plain matmul
//! in the same run.

use candle_core::{Tensor, Var};
use serde_json::{json, Value};

use super::harness::{dtype_name, randn, time_median, Result, Timing};
use crate::device::device_name;
use crate::kernels::{causal_work, flash_attention_recorded, AttentionDevice, GpuKernels};

/// One layer's attention (`grpo bench attention`): causal, one row, random inputs.
#[derive(Debug, Clone, clap::Args)]
pub struct AttentionSpec {
    /// Tokens (queries and keys).
    #[arg(long, default_value_t = 4096)]
    pub len: usize,
    /// Query heads (Qwen2.5-7B: 28 of 128; the default keeps its head dim and a 4-head group).
    #[arg(long, default_value_t = 16)]
    pub heads: usize,
    #[arg(long, default_value_t = 4)]
    pub kv_heads: usize,
    #[arg(long, default_value_t = 128)]
    pub head_dim: usize,
    /// Side of the square matmul (in the bench's dtype) measured as the reference rate.
    #[arg(long, default_value_t = 2048)]
    pub matmul: usize,
    /// The tensor-core kernels (`model.attention = "mma"`; on a GPU in bf16/f16 at head dim 64 or 128,
    /// elsewhere the chunked path) instead of the chunked GEMMs.
    #[arg(long, conflicts_with = "wgmma")]
    pub mma: bool,
    /// The warpgroup kernels (`model.attention = "wgmma"`; on an H100/H200, compute capability 9.0, in
    /// bf16/f16 at head dim 64 or 128; elsewhere as --mma).
    #[arg(long)]
    pub wgmma: bool,
    /// With --mma or --wgmma, the backward that sums dq by f32 atomics
    /// (`model.deterministic_attention = false`).
    #[arg(long)]
    pub atomic_dq: bool,
}

/// Forward and backward of causal attention over `--len` tokens (flash path) against a square matmul of
/// `--matmul` in the same dtype (bf16/f16 on a GPU: the tensor cores' rate), both on the device. Useful
/// FLOPs are 4 (forward) + 10 (backward) per query-key pair and head dim, masked halves of diagonal
/// blocks not counted; the performance model assumes their ratios to the matmul's rate per kernel.
pub fn attention(spec: &AttentionSpec, t: &Timing) -> Result<Value> {
    let (n, h, kv, d) = (spec.len, spec.heads, spec.kv_heads, spec.head_dim);
    let dev = &t.device;
    let var = |heads| -> Result<Var> { Ok(Var::from_tensor(&randn(t, (1, heads, n, d), 1.0)?)?) };
    let (q, k, v) = (var(h)?, var(kv)?, var(kv)?);
    let ranges: Vec<u32> = (0..n as u32).flat_map(|i| [0, i]).collect();
    let ranges = Tensor::from_vec(ranges, (1, n, 2), dev)?;
    let scale = 1.0 / (d as f64).sqrt();
    let tensor_cores = (spec.mma || spec.wgmma) && !dev.is_cpu() && crate::kernels::tensor_core_attention(t.dtype, d);
    let kernel = match (tensor_cores, spec.wgmma && crate::kernels::warpgroup_attention(dev)?) {
        (true, true) => "wgmma",
        (true, false) => "mma",
        (false, _) => "chunked",
    };
    let kernels = match spec.mma || spec.wgmma {
        true => GpuKernels::TensorCores { atomic_dq: spec.atomic_dq, warpgroup: spec.wgmma },
        false => GpuKernels::Chunked,
    };
    let attend =
        || flash_attention_recorded(q.as_tensor(), k.as_tensor(), v.as_tensor(), &ranges, scale, kernels, None);
    let seconds = time_median(t, || Ok(attend()?.backward()?))?;
    let forward_seconds = time_median(t, || Ok(attend()?))?;
    let m = spec.matmul;
    let a = randn(t, (m, m), 1.0)?;
    let matmul_gflops = 2.0 * (m * m * m) as f64 / time_median(t, || Ok(a.matmul(&a)?))? / 1e9;
    let per_flop = (h * d) as f64 * (n * (n + 1) / 2) as f64; // query-key pairs x head dims
    let gflops = 14.0 * per_flop / seconds / 1e9;
    let forward_gflops = 4.0 * per_flop / forward_seconds / 1e9;
    // The backward over the rest of the time; null when the forward alone timed no faster.
    let backward_gflops = (seconds > forward_seconds).then(|| 10.0 * per_flop / (seconds - forward_seconds) / 1e9);
    let here = if dev.is_cpu() { AttentionDevice::Cpu } else { AttentionDevice::Gpu };
    let (blocks, fwd, bwd) = causal_work((1, h, kv, n, n, d), here, t.dtype.size_in_bytes());
    let (gpu, gpu_fwd, gpu_bwd) = causal_work((1, h, kv, n, n, d), AttentionDevice::Gpu, t.dtype.size_in_bytes());
    Ok(json!({
        "bench": "attention",
        "device": device_name(dev),
        "dtype": dtype_name(t.dtype),
        "kernel": kernel,
        "atomic_dq": tensor_cores && spec.atomic_dq,
        "len": n,
        "heads": h,
        "kv_heads": kv,
        "head_dim": d,
        "block_q": blocks.bq,
        "block_k": blocks.bk,
        "seconds": seconds,
        "gflops": gflops,
        "gemm_gflop_run": (fwd.gemm_flops + bwd.gemm_flops) / 1e9, // diagonal blocks whole
        "matmul_size": m,
        "matmul_gflops": matmul_gflops,
        "ratio": gflops / matmul_gflops,
        "forward_seconds": forward_seconds,
        "forward_gflops": forward_gflops,
        "forward_ratio": forward_gflops / matmul_gflops,
        "backward_gflops": backward_gflops,
        "backward_ratio": backward_gflops.map(|g| g / matmul_gflops),
        "gpu_block_q": gpu.bq,
        "gpu_block_k": gpu.bk,
        "gpu_launches": (gpu_fwd.launches, gpu_bwd.launches),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::harness::fixtures::{cpu, parse};

    #[test]
    fn attention_reports_its_rate_against_a_matmul() {
        let spec: AttentionSpec =
            parse(&["--len", "70", "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--matmul", "64"]);
        let r = attention(&spec, &cpu()).unwrap();
        assert_eq!(
            (r["bench"].as_str(), r["len"].as_u64(), r["block_q"].as_u64()),
            (Some("attention"), Some(70), Some(70))
        );
        // The CPU has one attention: asked for the GPU's kernels, it says it ran the chunked path.
        for (mma, wgmma) in [(true, false), (false, true)] {
            let r = attention(&AttentionSpec { mma, wgmma, atomic_dq: true, ..spec }, &cpu()).unwrap();
            assert_eq!((r["kernel"].as_str(), r["atomic_dq"].as_bool()), (Some("chunked"), Some(false)), "{r}");
        }
        let (g, m, ratio) =
            (r["gflops"].as_f64().unwrap(), r["matmul_gflops"].as_f64().unwrap(), r["ratio"].as_f64().unwrap());
        assert!(g > 0.0 && m > 0.0 && (ratio - g / m).abs() < 1e-9, "{r}");
        // The forward timed alone; the backward's rate over the rest of the time, where there is some.
        let (fs, fg) = (r["forward_seconds"].as_f64().unwrap(), r["forward_gflops"].as_f64().unwrap());
        let pairs = 4.0 * 16.0 * (70.0 * 71.0 / 2.0);
        assert!((fg - 4.0 * pairs / fs / 1e9).abs() <= 1e-9 * fg, "{r}");
        assert!((r["forward_ratio"].as_f64().unwrap() - fg / m).abs() < 1e-9, "{r}");
        let total = r["seconds"].as_f64().unwrap();
        match r["backward_gflops"].as_f64() {
            Some(bg) => assert!((bg - 10.0 * pairs / (total - fs) / 1e9).abs() <= 1e-9 * bg, "{r}"),
            None => assert!(total <= fs && r["backward_ratio"].is_null(), "{r}"),
        }
    }
}
