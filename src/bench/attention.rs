//! `grpo bench attention`: forward and backward of one layer's causal attention against a plain matmul
//! in the same run.

use candle_core::{Tensor, Var};
use serde_json::Value;

use super::harness::{dtype_name, median, time_runs, to_record, Result, Timing};
use crate::device::device_name;

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

/// What `grpo bench attention` prints.
#[derive(Debug, serde::Serialize)]
struct AttentionRecord {
    bench: &'static str,
    device: String,
    dtype: &'static str,
    /// Which path ran: "wgmma" (the warpgroup kernels), "mma" (the tensor-core kernels) or "chunked"
    /// (block products as GEMMs).
    kernel: &'static str,
    /// The tensor-core kernels' backward summed dq by atomics.
    atomic_dq: bool,
    len: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    /// Query rows and keys per block on this device.
    block_q: usize,
    block_k: usize,
    /// Forward + backward, median.
    seconds: f64,
    /// The causal attention's useful FLOPs (4 + 10 per query-key pair and head dim, masked halves of
    /// diagonal blocks not counted) over the time.
    gflops: f64,
    /// FLOPs the GEMMs ran (diagonal blocks whole).
    gemm_gflop_run: f64,
    matmul_size: usize,
    matmul_gflops: f64,
    /// gflops / matmul_gflops.
    ratio: f64,
    /// The forward alone, median, and its useful FLOPs (4 per query-key pair and head dim) over that time;
    /// the backward's 10 over the rest of `seconds` (null when the forward alone timed no faster). On a GPU
    /// their ratios to the matmul's rate are what the performance model assumes per kernel
    /// (docs/performance-model.md).
    forward_seconds: f64,
    forward_gflops: f64,
    forward_ratio: f64,
    backward_gflops: Option<f64>,
    backward_ratio: Option<f64>,
    /// The GPU's blocks and launches for the same shape (forward, backward).
    gpu_block_q: usize,
    gpu_block_k: usize,
    gpu_launches: (usize, usize),
}

/// Forward and backward of causal attention over `--len` tokens (flash path) against a square matmul of
/// `--matmul` in the same dtype, both on the device, in the same run.
pub fn attention(spec: &AttentionSpec, t: &Timing) -> Result<Value> {
    use crate::kernels::{causal_work, flash_attention_recorded, AttentionDevice, GpuKernels};
    let (n, h, kv, d) = (spec.len, spec.heads, spec.kv_heads, spec.head_dim);
    let dev = &t.device;
    let var = |heads| -> Result<Var> {
        Ok(Var::from_tensor(&Tensor::randn(0f32, 1.0, (1, heads, n, d), dev)?.to_dtype(t.dtype)?)?)
    };
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
    let attend = |q: &Tensor, k: &Tensor, v: &Tensor, ranges: &Tensor, scale: f64| {
        flash_attention_recorded(q, k, v, ranges, scale, kernels, None)
    };
    let (times, _) = time_runs(t, || {
        let o = attend(q.as_tensor(), k.as_tensor(), v.as_tensor(), &ranges, scale)?;
        Ok(o.backward()?)
    })?;
    let seconds = median(&times);
    let (forward_times, _) = time_runs(t, || Ok(attend(q.as_tensor(), k.as_tensor(), v.as_tensor(), &ranges, scale)?))?;
    let forward_seconds = median(&forward_times);
    let m = spec.matmul;
    // In the bench's dtype: f32 on the CPU as the README quotes it; bf16/f16 on a GPU, the tensor cores'
    // rate the attention's products run at.
    let a = Tensor::randn(0f32, 1.0, (m, m), dev)?.to_dtype(t.dtype)?;
    let (mm, _) = time_runs(t, || Ok(a.matmul(&a)?))?;
    let matmul_gflops = 2.0 * (m * m * m) as f64 / median(&mm) / 1e9;
    let per_flop = (h * d) as f64 * (n * (n + 1) / 2) as f64; // query-key pairs x head dims
    let useful = 14.0 * per_flop;
    let forward_gflops = 4.0 * per_flop / forward_seconds / 1e9;
    let backward_gflops = (seconds > forward_seconds).then(|| 10.0 * per_flop / (seconds - forward_seconds) / 1e9);
    let bytes = t.dtype.size_in_bytes();
    let cpu = if dev.is_cpu() { AttentionDevice::Cpu } else { AttentionDevice::Gpu };
    let (blocks, fwd, bwd) = causal_work((1, h, kv, n, n, d), cpu, bytes);
    let (gpu, gf, gb) = causal_work((1, h, kv, n, n, d), AttentionDevice::Gpu, bytes);
    let gflops = useful / seconds / 1e9;
    let record = AttentionRecord {
        bench: "attention",
        device: device_name(dev),
        dtype: dtype_name(t.dtype),
        kernel,
        atomic_dq: tensor_cores && spec.atomic_dq,
        len: n,
        heads: h,
        kv_heads: kv,
        head_dim: d,
        block_q: blocks.bq,
        block_k: blocks.bk,
        seconds,
        gflops,
        gemm_gflop_run: (fwd.gemm_flops + bwd.gemm_flops) / 1e9,
        matmul_size: m,
        matmul_gflops,
        ratio: gflops / matmul_gflops,
        forward_seconds,
        forward_gflops,
        forward_ratio: forward_gflops / matmul_gflops,
        backward_gflops,
        backward_ratio: backward_gflops.map(|g| g / matmul_gflops),
        gpu_block_q: gpu.bq,
        gpu_block_k: gpu.bk,
        gpu_launches: (gf.launches, gb.launches),
    };
    to_record(record)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::harness::fixtures::cpu;

    #[test]
    fn attention_reports_its_rate_against_a_matmul() {
        let spec = AttentionSpec {
            len: 70,
            heads: 4,
            kv_heads: 2,
            head_dim: 16,
            matmul: 64,
            mma: false,
            wgmma: false,
            atomic_dq: false,
        };
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
