//! How (not what) the decoder computes: the attention's kernels, recomputation, the log-prob head's memory.

use candle_core::DType;

use crate::kernels::GpuKernels;

/// How the decoder computes attention (the same values either way, up to rounding).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Attention {
    /// Block by block with an online softmax and its own backward (flash attention): O(T) memory per
    /// head, forward and backward.
    Flash,
    /// Through the `[T, S]` score matrix of each head and the fused masked softmax: O(T x S) memory.
    Matrix,
    /// As `flash`, but on a GPU, for bf16 and f16 weights with a head dim of 64 or 128, through the
    /// tensor-core kernels of kernels/flash_mma.cu (FlashAttention-2's design: `mma.sync` block products
    /// with the scores in registers) instead of cuBLAS GEMMs over blocks in device memory; elsewhere the
    /// same as `flash`. Tested on the host emulator, and on an H100 against the CPU op (`grpo selftest`,
    /// 2026-11-27, build 598e6a8: benches/results/gpu-2026-11-27b-h100.log).
    Mma,
    /// As `mma`, but on a GPU of compute capability 9.0 (H100, H200) through the warpgroup tensor-core
    /// kernels of kernels/flash_wgmma.cu (`wgmma.mma_async` on 64-row tiles in swizzled shared memory,
    /// `deterministic_attention` as with `mma`); on other GPUs the same as `mma`.
    /// Tested on the host emulator, and on an H100 in the same selftest run; its leaner loops since
    /// (docs/cuda.md, "Leaner loops") on the host emulator only.
    Wgmma,
    /// The default: on a GPU, the fastest of `wgmma` (compute capability 9.0) and `mma` (8.x) that passes
    /// a check against the chunked path on that device the first time it attends (bf16/f16 at head dim
    /// 64 or 128; the verdict is logged), else `flash`; on the CPU `flash`.
    #[default]
    Auto,
}

impl Attention {
    /// The setting that runs `kernels` (their `atomic_dq` is `deterministic_attention`'s).
    fn running(kernels: GpuKernels) -> Self {
        match kernels {
            GpuKernels::TensorCores { warpgroup: true, .. } => Attention::Wgmma,
            GpuKernels::TensorCores { warpgroup: false, .. } => Attention::Mma,
            GpuKernels::Chunked => Attention::Flash,
        }
    }
}

/// Options that change how (not what) the decoder computes.
#[derive(Debug, Clone)]
pub struct DecoderOptions {
    /// Recompute each layer during the backward pass instead of keeping its activations.
    pub checkpoint_layers: bool,
    /// With `checkpoint_layers` and flash-kind attention: `false` keeps each layer's attention output and
    /// log-sum-exp from the forward ([B, H, T, D] + 4 B H T bytes a layer), and the recomputation runs the
    /// attention's backward without its forward (`true`: the attention is recomputed with the layer).
    pub recompute_attention: bool,
    /// Memory budget of one chunk of f32 logits in the log-prob op; 0 sizes it from the device
    /// ([`crate::kernels::logprob_chunk_bytes`]: at least 1 GiB on a GPU, 64 MiB on the CPU).
    pub logprob_chunk_bytes: usize,
    /// Keep the log-prob op's logits (`[scored tokens, vocab]` in the weight's dtype) from the forward
    /// for its backward instead of recomputing them chunk by chunk ([`HeadBackward::keep_logits`]).
    pub keep_logits: bool,
    /// Use the project's fused ops (RMSNorm, rope, attention softmax); `false` uses their composite
    /// candle references instead (slower, more memory: for checking the kernels and measuring them),
    /// attention through the score matrix whatever `attention` says.
    pub fused_ops: bool,
    /// How attention is computed (with `fused_ops`; generation's one-token steps, whose scores are
    /// linear in the cache, always go through the score matrix).
    pub attention: Attention,
    /// With `attention = "mma"` on a GPU: `false` sums the backward's dq by f32 atomics (FlashAttention-2's
    /// backward, fewer FLOPs, its rounding varying from run to run); `true` computes it in a kernel of its own,
    /// the same bits every run.
    pub deterministic_attention: bool,
}

impl DecoderOptions {
    /// Whether attention runs on the tensor-core kernels (kernels/flash_mma.cu) on a GPU for weights of
    /// `dtype` with head dim `head_dim`: `attention = "mma"` or `"wgmma"` with fused ops, where the kernels
    /// apply.
    pub fn tensor_core_attention(&self, dtype: DType, head_dim: usize) -> bool {
        self.fused_ops
            && matches!(self.attention, Attention::Mma | Attention::Wgmma | Attention::Auto)
            && crate::kernels::tensor_core_attention(dtype, head_dim)
    }

    /// `attention = "auto"` decided for weights of `dtype` at head dim `head_dim` on `device`: the kernels
    /// that pass the start-up check there ([`crate::kernels::auto_kernels`]: `wgmma` or `mma` on a GPU whose
    /// kernels pass it, `flash` otherwise and on the CPU), named as the setting that runs them. Any other
    /// setting is left as it is. Returns what was decided (`None`: nothing was "auto").
    pub fn resolve_attention(
        &mut self,
        device: &candle_core::Device,
        dtype: DType,
        head_dim: usize,
    ) -> candle_core::Result<Option<Attention>> {
        if self.attention != Attention::Auto {
            return Ok(None);
        }
        let kernels = crate::kernels::auto_kernels(device, dtype, head_dim, !self.deterministic_attention)?;
        self.attention = Attention::running(kernels);
        Ok(Some(self.attention))
    }

    /// The kernels flash attention runs on a GPU.
    pub fn gpu_kernels(&self) -> GpuKernels {
        match self.attention {
            Attention::Mma => GpuKernels::TensorCores { atomic_dq: !self.deterministic_attention, warpgroup: false },
            Attention::Wgmma => GpuKernels::TensorCores { atomic_dq: !self.deterministic_attention, warpgroup: true },
            // Chosen on the device by a check (`kernels::auto_kernels`); the chunked path until then.
            Attention::Flash | Attention::Matrix | Attention::Auto => GpuKernels::Chunked,
        }
    }
}

impl Default for DecoderOptions {
    fn default() -> Self {
        Self {
            checkpoint_layers: false,
            recompute_attention: true,
            logprob_chunk_bytes: 0,
            keep_logits: false,
            fused_ops: true,
            attention: Attention::Auto,
            deterministic_attention: true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The setting "auto" is resolved to runs the kernels the check chose, for either backward.
    #[test]
    fn an_auto_decision_runs_the_kernels_it_names() {
        for deterministic_attention in [true, false] {
            let atomic_dq = !deterministic_attention;
            for kernels in [
                GpuKernels::Chunked,
                GpuKernels::TensorCores { atomic_dq, warpgroup: false },
                GpuKernels::TensorCores { atomic_dq, warpgroup: true },
            ] {
                let o = DecoderOptions {
                    attention: Attention::running(kernels),
                    deterministic_attention,
                    ..Default::default()
                };
                assert_ne!(o.attention, Attention::Auto);
                assert_eq!(o.gpu_kernels(), kernels);
            }
        }
    }

    /// On the CPU "auto" is flash attention (what it ran there before it was resolved up front); a
    /// setting that is not "auto" stays.
    #[test]
    fn auto_attention_resolves_to_flash_on_the_cpu() {
        let cpu = candle_core::Device::Cpu;
        let mut o = DecoderOptions::default();
        assert_eq!(o.resolve_attention(&cpu, DType::BF16, 64).unwrap(), Some(Attention::Flash));
        assert_eq!(o.attention, Attention::Flash);
        let mut mma = DecoderOptions { attention: Attention::Mma, ..Default::default() };
        assert_eq!(mma.resolve_attention(&cpu, DType::BF16, 64).unwrap(), None);
        assert_eq!(mma.attention, Attention::Mma);
    }
}
