//! What a decode step of the paged engine costs on a GPU (`grpo bench generate` prints it beside what it
//! measured): the longer of the device reading the weights once and every sequence's keys and values,
//! and the host issuing the step's tensor ops one by one (no CUDA graph), plus one host read of the
//! sampled tokens. The ops are the paged step's (src/model/decoder/{layer,paged}.rs), counted per layer
//! ([`layer_ops`]) and per step ([`STEP_OPS`]).

use super::calibration::Gpu;
use crate::model::ModelConfig;

/// Tensor ops per step outside the layers (uploads, embedding, rope tables, scatter index, head, the
/// device sampler's softmax, top-k/top-p and draw).
const STEP_OPS: f64 = 24.0;

/// One decode step: `sequences` each attending to `context` positions on average, weights and cache in
/// `dtype_bytes` bytes an element.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DecodeShape {
    pub sequences: f64,
    pub context: f64,
    pub dtype_bytes: f64,
}

/// The model's decode step on one GPU.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct DecodePrediction {
    pub gpu: &'static str,
    /// The weights read once at the streaming kernels' share of the bandwidth.
    pub weights_s: f64,
    /// Every sequence's keys and values read once (and the step's written).
    pub kv_s: f64,
    /// The host issuing the step's tensor ops and kernel launches.
    pub host_s: f64,
    pub tensor_ops: f64,
    /// The longer of the device's time (weights, cache, logits) and the host's, plus one host read.
    pub step_s: f64,
    pub tokens_per_s: f64,
}

/// Tensor ops of one layer of the paged step: the input norm, q/k/v, rope of q and k, the value heads'
/// transpose, the keys and values concatenated and scattered into their slots, the paged attention (one op,
/// two kernels), the heads transposed back, o_proj, the residual; q/k norms (Qwen3); the biases; the MLP's
/// norm, gate, up, SwiGLU, down and residual.
fn layer_ops(m: &ModelConfig) -> f64 {
    let attention = 1.0 + 3.0 + 2.0 + 1.0 + 2.0 + 1.0 + 1.0 + 1.0 + 1.0;
    let qk_norm = if m.qk_norm { 2.0 } else { 0.0 };
    let biases = 3.0 * f64::from(u8::from(m.qkv_bias)) + f64::from(u8::from(m.o_bias));
    let mlp = 6.0 + 3.0 * f64::from(u8::from(m.mlp_bias));
    attention + qk_norm + biases + mlp
}

/// The parameters' elements (the head counted once when tied).
fn parameters(m: &ModelConfig) -> f64 {
    crate::model::decoder::parameter_shapes(m).iter().map(|(_, s)| s.iter().product::<usize>() as f64).sum()
}

/// The decode step `s` of model `m` on `gpu`.
pub fn predict_decode(m: &ModelConfig, s: DecodeShape, gpu: &Gpu) -> DecodePrediction {
    let streamed = gpu.memory_bandwidth * gpu.packed_memory_efficiency;
    let weights_s = parameters(m) * s.dtype_bytes / streamed;
    let kv_row = (2 * m.num_layers * m.num_kv_heads * m.head_dim) as f64 * s.dtype_bytes;
    let kv_s = s.sequences * (s.context + 1.0) * kv_row / (gpu.memory_bandwidth * gpu.memory_efficiency);
    let logits_s = s.sequences * m.vocab_size as f64 * 4.0 * 3.0 / (gpu.memory_bandwidth * gpu.memory_efficiency);
    let tensor_ops = STEP_OPS + m.num_layers as f64 * layer_ops(m);
    let host_s = tensor_ops * gpu.launch_s + m.num_layers as f64 * 2.0 * gpu.kernel_launch_s;
    let step_s = (weights_s + kv_s + logits_s).max(host_s) + gpu.sync_s;
    DecodePrediction { gpu: gpu.name, weights_s, kv_s, host_s, tensor_ops, step_s, tokens_per_s: s.sequences / step_s }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::calibration::h100;

    fn config(name: &str) -> ModelConfig {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        ModelConfig::from_file(&root.join("scripts/gpu/shapes").join(name)).unwrap()
    }

    /// Hand-computed for the 0.5B shape at batch 32 and 1k positions: 24 layers of 19 ops (Qwen2: no q/k
    /// norms, q/k/v biases) and 24 more; the weights' 0.99 GB streamed is below the host's time there,
    /// so the step is host-bound; at batch 256 and 8k positions the cache's reads dominate.
    #[test]
    fn a_small_batch_is_host_bound_and_a_long_context_reads_the_cache() {
        let m = config("qwen2.5-0.5b.json");
        let p = predict_decode(&m, DecodeShape { sequences: 32.0, context: 1024.0, dtype_bytes: 2.0 }, h100());
        assert_eq!(layer_ops(&m), 19.0 + 3.0);
        assert_eq!(p.tensor_ops, 24.0 + 24.0 * 22.0);
        let host = p.tensor_ops * h100().launch_s + 48.0 * h100().kernel_launch_s;
        assert!((p.host_s - host).abs() < 1e-12);
        assert!(p.host_s > p.weights_s + p.kv_s, "{p:?}");
        assert!((p.step_s - p.host_s - h100().sync_s).abs() < 1e-12);
        let long = predict_decode(&m, DecodeShape { sequences: 256.0, context: 8192.0, dtype_bytes: 2.0 }, h100());
        assert!(long.kv_s > long.weights_s && long.step_s > long.host_s, "{long:?}");
        let kv =
            256.0 * 8193.0 * (2.0 * 24.0 * 2.0 * 64.0 * 2.0) / (h100().memory_bandwidth * h100().memory_efficiency);
        assert!((long.kv_s - kv).abs() / kv < 1e-12);
    }
}
