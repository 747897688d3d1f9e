//! The devices and builds the performance model of [`super::time`] predicts for, as data.
//!
//! Each GPU's rates are a file of configs/devices/ (peaks, bandwidths, the measured GEMM and attention
//! rates, the host's costs, each with where it comes from: its `[sources]` table), written by
//! scripts/calibrate.py from the committed GPU results (benches/results/gpu-*-h100.jsonl) and compiled
//! into the binary. The script fits the host's time per tensor op and the element-wise kernels' share of
//! HBM's bandwidth on the committed train steps, reports each step's residual with the step left out of the
//! fit (leave-one-out), and `--check` fails when a committed file is not what it writes
//! (tests/calibration.rs runs it).
//!
//! This build's own counts are here ([`TENSOR_OPS`], counted on the CPU, where tests/calibration.rs holds
//! them to the bench's). A build an H100 run measured before is a file beside its results
//! (benches/results/builds/), read by `grpo bench train-step --measured-build FILE` so that the run's steps
//! are predicted as that build ran them ([`Build`]).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::OnceLock;

/// A GPU's rates and the efficiency of each kind of op on it, measured ([`Gpu::calibration`]) or assumed:
/// a file of configs/devices/ ([`gpus`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Gpu {
    pub name: &'static str,
    /// Dense bf16 tensor-core FLOP/s (no sparsity).
    pub peak_flops: f64,
    /// Streaming multiprocessors (a GEMM's tiles fill them in waves: [`super::time::gemm_flops_per_s`]).
    pub multiprocessors: u32,
    /// Device memory bandwidth, B/s.
    pub memory_bandwidth: f64,
    /// Fraction of the peak a cuBLAS bf16 GEMM's tiles reach while they run (a GEMM's rate is this times
    /// the share of the multiprocessors its tiles keep busy).
    pub gemm_efficiency: f64,
    /// Fraction of the peak the chunked attention's block GEMMs reach when compute-bound (each a call of
    /// its own, like the 2048^3 matmul timed alone).
    pub attention_gemm_efficiency: f64,
    /// The tensor-core attention kernels (kernels/flash_mma.cu), as fractions of the peak in the causal
    /// attention's useful FLOPs.
    pub mma: KernelRates,
    /// The warpgroup kernels (kernels/flash_wgmma.cu): two-kernel backward, and dq by atomics; `None`
    /// where the GPU has no wgmma (the `mma` kernels run instead).
    pub wgmma: Option<KernelRates>,
    pub wgmma_atomic: Option<KernelRates>,
    /// The warpgroup kernels at head dim 64, where measured (elsewhere the head-dim-128 rates stand for
    /// them at the same time per score).
    pub wgmma_d64: Option<KernelRates>,
    pub wgmma_atomic_d64: Option<KernelRates>,
    /// Fraction of the memory bandwidth a streaming element-wise kernel reaches (one element a thread and
    /// access, or strided indexing).
    pub memory_efficiency: f64,
    /// The same for one that moves 16 bytes a thread and access (kernels/common.cuh's packs, candle's
    /// contiguous bf16 add).
    pub packed_memory_efficiency: f64,
    /// Host time per op the host issues: candle's bookkeeping of a tensor op (its output's allocation
    /// from the memory pool, its layout copied to the device for a strided input, the graph's record)
    /// and the kernel launch, s.
    pub launch_s: f64,
    /// Host time per kernel launch of the project's own code (the attention's kernels and cuBLAS calls:
    /// no candle tensor made), s.
    pub kernel_launch_s: f64,
    /// Time of one host sync (device drained, value copied back, next launch issued), s.
    pub sync_s: f64,
    /// Host-device bandwidth per direction, B/s (PCIe).
    pub pcie_bandwidth: f64,
    /// Bytes per second the offloaded AdamW update (`optim.offload`) moves through host memory, counted
    /// as 32 B per parameter (the f32 master weights and two moments read and written): the fused update
    /// of this build ([`crate::kernels::adamw`]).
    pub host_update_bandwidth: f64,
    /// The same for the composite candle ops of the builds before the fused update (what the H100 run
    /// measured).
    pub composite_host_update_bandwidth: f64,
    /// Bandwidth per GPU to the other GPUs of its node, per direction, B/s (NVLink through NVSwitch).
    pub nvlink_bandwidth: f64,
    /// Bandwidth per GPU to other nodes, per direction, B/s (one InfiniBand NIC per GPU).
    pub network_bandwidth: f64,
    /// Where the rates were measured (`None`: every rate is an assumption).
    pub calibration: Option<Calibration>,
}

/// A tensor-core attention kernel's rate at two measured lengths, forward and backward as fractions of
/// the peak in useful FLOPs; between them interpolated in log length, outside them the nearer one.
#[derive(Debug, Clone, Copy, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KernelRates {
    pub short: RateAt,
    pub long: RateAt,
}

/// A kernel's forward and backward rate at `tokens` tokens.
#[derive(Debug, Clone, Copy, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RateAt {
    pub tokens: u64,
    pub forward: f64,
    pub backward: f64,
}

impl KernelRates {
    /// The fraction of the peak at `tokens` tokens, forward or backward.
    pub fn efficiency(&self, tokens: u64, backward: bool) -> f64 {
        let pick = |r: &RateAt| if backward { r.backward } else { r.forward };
        let (a, b) = (self.short, self.long);
        if tokens <= a.tokens || a.tokens >= b.tokens {
            return pick(&a);
        }
        if tokens >= b.tokens {
            return pick(&b);
        }
        let x = (tokens as f64 / a.tokens as f64).ln() / (b.tokens as f64 / a.tokens as f64).ln();
        pick(&a) + x * (pick(&b) - pick(&a))
    }
}

/// The tensors candle makes per unit of a step's work, counted on the CPU (where the graph of ops is the
/// GPU's): each costs the host its bookkeeping, and most a kernel launch and an allocation from the pool
/// on a GPU (views, a reshape or a transpose, cost less and launch nothing: [`Gpu::launch_s`] is the mean
/// over both). The attention is one op here: its GPU launches are counted by its kernels' own plan.
#[derive(Debug, Clone, Copy, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TensorOps {
    /// One layer's forward without a graph (the reference's), with its graph (the policy's), again in
    /// the backward (`checkpoint_layers`), and its backward.
    pub layer_reference: f64,
    pub layer_policy: f64,
    pub layer_recompute: f64,
    pub layer_backward: f64,
    /// Per micro-batch beyond the layers: the policy's embedding, log-prob head, loss and their
    /// backward; the reference's embedding and head.
    pub micro_batch: f64,
    pub micro_batch_reference: f64,
    /// Per step beyond the parameters' updates.
    pub step: f64,
    /// Per parameter tensor: adding its gradient into the f32 accumulator (per micro-batch), its part of
    /// the gradient norm and its AdamW update (per step).
    pub accumulate_per_tensor: f64,
    /// Per parameter tensor and step: the first micro-batch's gradient cast or copied into an accumulator of
    /// its own (where the later ones are added in place).
    pub accumulate_first_per_tensor: f64,
    pub norm_per_tensor: f64,
    pub update_per_tensor: f64,
    /// Passes over a layer's `[N, hidden]` output that its backward spends seeding the gradient: 4 where it
    /// formed `(y g).sum_all()` and differentiated that (read y and g, write the product, sum it), 0 with
    /// the patched candle's `backward_from(g)`.
    pub seed_passes: f64,
    /// Bytes per lm_head weight element per log-prob chunk that the head's backward spends on the weight's
    /// f32 gradient beyond its GEMM: 16 where each chunk's product was cast to f32 and summed into a new
    /// buffer (write 4, read 4, accumulator read and written), 10 where the product (d = 2 bytes) is added
    /// into the accumulator in place (read 2, accumulator read and written).
    pub head_grad_bytes: f64,
    /// Weight gradients GEMM'd straight into their f32 accumulators (kernels::wgrad_accumulate): the
    /// projections' and the lm_head's weight products write f32, read and written in the GEMM, with no
    /// product in the weight's dtype and no pass adding it (`head_grad_bytes` 0); the accumulators are made
    /// (zeros) before a step's first micro-batch. `false`: candle's product backward in the weight's dtype,
    /// added by kernels::accumulate.
    pub fused_wgrad: bool,
    /// The tensor ops beyond a layer's named element-wise ops each a pass over about their mean bytes (the
    /// released candle-core's backward added each op's first gradient to a tensor of zeros); `false`:
    /// they are views and bookkeeping, and the named ops are the layer's element-wise bytes.
    pub unnamed_ops_move_bytes: bool,
}

/// This build's, counted on the CPU (see [`TensorOps`]; tests/calibration.rs holds the model's count to the
/// bench's).
pub const TENSOR_OPS: TensorOps = COUNTED_TENSOR_OPS;

/// Where a GPU's rates were measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Calibration {
    /// The card as CUDA names it.
    pub card: &'static str,
    pub date: &'static str,
    /// The measurements, in the repository.
    pub results: &'static str,
}

/// A device file or build file that could not be read.
#[derive(Debug, thiserror::Error)]
pub enum CalibrationError {
    #[error("cannot read {path}: {source}")]
    Read { path: String, source: std::io::Error },
    #[error("{path}: {message}")]
    Invalid { path: String, message: String },
}

/// The device files compiled in, in the order the plan reports them.
const DEVICE_FILES: [(&str, &str); 2] = [
    ("configs/devices/h100-sxm.toml", include_str!("../../configs/devices/h100-sxm.toml")),
    ("configs/devices/a100-80gb.toml", include_str!("../../configs/devices/a100-80gb.toml")),
];

/// The GPUs the model predicts for: the device files of configs/devices/.
pub fn gpus() -> &'static [Gpu] {
    static GPUS: OnceLock<Vec<Gpu>> = OnceLock::new();
    GPUS.get_or_init(|| {
        // Compiled in and parsed by a test (`every_device_file_parses_with_a_source_per_rate`).
        DEVICE_FILES.iter().map(|(path, text)| parse_device(path, text).unwrap_or_else(|e| panic!("{e}"))).collect()
    })
}

/// The H100 SXM, whose rates the committed GPU runs measured.
pub fn h100() -> &'static Gpu {
    gpus().iter().find(|g| g.calibration.is_some()).expect("configs/devices/h100-sxm.toml has a [calibration]")
}

/// A device file as written (configs/devices/*.toml).
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct DeviceFile {
    name: String,
    peak_flops: f64,
    multiprocessors: u32,
    memory_bandwidth: f64,
    gemm_efficiency: f64,
    attention_gemm_efficiency: f64,
    memory_efficiency: f64,
    packed_memory_efficiency: f64,
    launch_s: f64,
    kernel_launch_s: f64,
    sync_s: f64,
    pcie_bandwidth: f64,
    host_update_bandwidth: f64,
    composite_host_update_bandwidth: f64,
    nvlink_bandwidth: f64,
    network_bandwidth: f64,
    calibration: Option<CalibrationFile>,
    attention: AttentionFile,
    /// Where each value comes from (read by the tests, not by the model).
    #[allow(dead_code)]
    sources: BTreeMap<String, String>,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct CalibrationFile {
    card: String,
    date: String,
    results: String,
}

/// The tensor-core attention kernels' rates of a device file (`mma`) or a build file (the warpgroup ones).
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct AttentionFile {
    mma: Option<KernelRates>,
    wgmma: Option<KernelRates>,
    wgmma_atomic: Option<KernelRates>,
    wgmma_d64: Option<KernelRates>,
    wgmma_atomic_d64: Option<KernelRates>,
}

/// The warpgroup kernels' rates ([`Gpu::wgmma`] and its kin).
#[derive(Debug, Clone, Copy, PartialEq, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Warpgroup {
    pub wgmma: Option<KernelRates>,
    pub wgmma_atomic: Option<KernelRates>,
    pub wgmma_d64: Option<KernelRates>,
    pub wgmma_atomic_d64: Option<KernelRates>,
}

/// Made once per process (the device files and a bench's build file), so kept for its lifetime.
fn leak(s: String) -> &'static str {
    Box::leak(s.into_boxed_str())
}

fn invalid(path: &str, e: impl std::fmt::Display) -> CalibrationError {
    CalibrationError::Invalid { path: path.into(), message: e.to_string() }
}

fn parse_device(path: &str, text: &str) -> Result<Gpu, CalibrationError> {
    let f: DeviceFile = toml::from_str(text).map_err(|e| invalid(path, e))?;
    let mma = f.attention.mma.ok_or_else(|| invalid(path, "[attention.mma] is missing"))?;
    let w = f.attention;
    Ok(Gpu {
        name: leak(f.name),
        peak_flops: f.peak_flops,
        multiprocessors: f.multiprocessors,
        memory_bandwidth: f.memory_bandwidth,
        gemm_efficiency: f.gemm_efficiency,
        attention_gemm_efficiency: f.attention_gemm_efficiency,
        mma,
        wgmma: w.wgmma,
        wgmma_atomic: w.wgmma_atomic,
        wgmma_d64: w.wgmma_d64,
        wgmma_atomic_d64: w.wgmma_atomic_d64,
        memory_efficiency: f.memory_efficiency,
        packed_memory_efficiency: f.packed_memory_efficiency,
        launch_s: f.launch_s,
        kernel_launch_s: f.kernel_launch_s,
        sync_s: f.sync_s,
        pcie_bandwidth: f.pcie_bandwidth,
        host_update_bandwidth: f.host_update_bandwidth,
        composite_host_update_bandwidth: f.composite_host_update_bandwidth,
        nvlink_bandwidth: f.nvlink_bandwidth,
        network_bandwidth: f.network_bandwidth,
        calibration: f.calibration.map(|c| Calibration {
            card: leak(c.card),
            date: leak(c.date),
            results: leak(c.results),
        }),
    })
}

/// The build a step is predicted for: this one ([`Build::CURRENT`]), or one whose steps a GPU run
/// measured (a file of benches/results/builds/, [`Build::from_file`]), so that each of that run's records
/// is predicted as it ran: with that build's tensor ops, kernels, offloaded update and warpgroup rates.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Build {
    /// The tensors candle made per part of a step.
    pub tensor_ops: TensorOps,
    /// The build's own element-wise kernels (norms, rope, SwiGLU, biases, the heads' transposes, the
    /// log-prob rows, gradient accumulation, the attention backward's row dot products) move 16-byte packs.
    pub packed_kernels: bool,
    /// The offloaded update as composite candle ops on the host, its copies and update one after the other
    /// (`false`: the fused update, overlapped with the copies but one chunk).
    pub composite_update: bool,
    /// The step read each micro-batch's loss to the host (a host sync per micro-batch); this build keeps
    /// the step's statistics on the device and reads them once, with the gradient norm.
    pub reads_loss_per_micro_batch: bool,
    /// The warpgroup kernels' rates as the build's run measured them on the GPU named (`None`: the
    /// device file's, this build's).
    pub measured: Option<(&'static str, Warpgroup)>,
}

impl Default for Build {
    fn default() -> Self {
        Self::CURRENT
    }
}

/// A build file as written (benches/results/builds/*.toml).
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct BuildFile {
    /// The results' tags (benches/results/gpu-<tag>-h100.jsonl) the build ran (read by the scripts).
    #[allow(dead_code)]
    tags: Vec<String>,
    device: String,
    packed_kernels: bool,
    composite_update: bool,
    reads_loss_per_micro_batch: bool,
    tensor_ops: TensorOps,
    #[serde(default)]
    attention: Warpgroup,
}

impl Build {
    /// This build.
    pub const CURRENT: Build = Build {
        tensor_ops: TENSOR_OPS,
        packed_kernels: true,
        composite_update: false,
        reads_loss_per_micro_batch: false,
        measured: None,
    };

    /// A measured build's file (benches/results/builds/*.toml).
    pub fn from_file(path: &Path) -> Result<Build, CalibrationError> {
        let shown = path.display().to_string();
        let text =
            std::fs::read_to_string(path).map_err(|source| CalibrationError::Read { path: shown.clone(), source })?;
        let f: BuildFile = toml::from_str(&text).map_err(|e| invalid(&shown, e))?;
        if !gpus().iter().any(|g| g.name == f.device) {
            return Err(invalid(&shown, format!("device = {:?} names no file of configs/devices/", f.device)));
        }
        Ok(Build {
            tensor_ops: f.tensor_ops,
            packed_kernels: f.packed_kernels,
            composite_update: f.composite_update,
            reads_loss_per_micro_batch: f.reads_loss_per_micro_batch,
            measured: Some((leak(f.device), f.attention)),
        })
    }

    /// `gpu` with this build's warpgroup rates: a measured build's on the GPU it ran on, else as it is.
    pub fn gpu(&self, gpu: Gpu) -> Gpu {
        match self.measured {
            Some((device, w)) if device == gpu.name => Gpu {
                wgmma: w.wgmma,
                wgmma_atomic: w.wgmma_atomic,
                wgmma_d64: w.wgmma_d64,
                wgmma_atomic_d64: w.wgmma_atomic_d64,
                ..gpu
            },
            _ => gpu,
        }
    }
}

/// The tensors candle makes in a step's parts, counted on the CPU (`tensor_ops_per_step` of `grpo bench
/// train-step`, at the 0.5B shape with 1 and 2 layers, 2 and 4 answers of 128 tokens, with and without
/// the reference and `checkpoint_layers`, the differences giving each part; see [`TensorOps`]).
/// A test holds the model's count to the bench's at other shapes.
pub const COUNTED_TENSOR_OPS: TensorOps = TensorOps {
    // The MLP's activation one fused op (kernels::swiglu) each way instead of candle's silu, product and
    // their backward; the backward's first gradient of each op stored rather than added to zeros (the
    // patched candle-core, third_party/candle-core/PATCHED.md); RMSNorm with its weight one op each way
    // (kernels::rms_norm, the weight's gradient in the op); a recomputed layer's backward seeded with the
    // incoming gradient (`backward_from`, no `(y g).sum_all()`) and no gradient formed for an operand that
    // leads to no variable (the patched candle): a layer's backward 102 tensors, not 249, and a recomputed
    // layer 65 more, not 84 (the residual's sum gone, the down projection run: recorded as a node of zeros
    // carrying its backward it made 64, but kept each recomputed layer's activations alive).
    // The q, k and v biases one op each way (kernels::bias_add, the bias's gradient in the op) instead of
    // candle's broadcast add and its sum: 3 fewer in each (50, 65 and 102 before); v to heads one op
    // (kernels::to_heads) instead of a transpose and its copy: 1 fewer.
    // Every weight's gradient added by its own GEMM (kernels::wgrad_accumulate, `fused_wgrad`): no
    // product in the weight's dtype, its transposes and its add: 18 fewer in a layer's backward (98
    // before), 3 fewer in the head's (131 before); the embedding's row sums added into its accumulator
    // (kernels::embedding_grad_into).
    layer_reference: 46.0,
    layer_policy: 46.0,
    layer_recompute: 61.0,
    layer_backward: 80.0,
    micro_batch: 128.0,
    micro_batch_reference: 75.0,
    // What a step adds beyond its micro-batches and its parameters' ops (counted: 1).
    step: 1.0,
    // The gradients still added by kernels::accumulate (norms, biases), in place, with the views and casts
    // around them: 1 a tensor a micro-batch; each accumulator a projection's GEMM or the embedding's row
    // sums add into, made before the first micro-batch: 1 a tensor a step (counted at 1 to 3 layers, 2 to
    // 4 micro-batches, with and without the reference and `checkpoint_layers`; 0.8 and 1.6 a tensor, all
    // of them, before).
    accumulate_per_tensor: 1.0,
    accumulate_first_per_tensor: 1.0,
    // The gradient's sum of squares, one op (kernels::sum_squares), where candle's square, sum and cast
    // were three.
    norm_per_tensor: 1.0,
    // The fused update's op and the views around it (the gradient flattened, the master copy's row and
    // its cast to the model's dtype): 10.4 fewer per tensor than the composite's, counted at 1 and 3 layers.
    update_per_tensor: 5.0,
    seed_passes: 0.0,
    head_grad_bytes: 0.0,
    fused_wgrad: true,
    unnamed_ops_move_bytes: false,
};

#[cfg(test)]
mod tests {
    use super::*;

    fn root() -> &'static Path {
        Path::new(env!("CARGO_MANIFEST_DIR"))
    }

    /// Every device file parses, names where each of its values comes from, and the H100's is the one
    /// calibrated on the committed runs.
    #[test]
    fn every_device_file_parses_with_a_source_per_rate() {
        for (path, text) in DEVICE_FILES {
            parse_device(path, text).unwrap();
            let raw: toml::Table = toml::from_str(text).unwrap();
            let sources = raw["sources"].as_table().unwrap();
            let mut keys: Vec<String> = raw
                .keys()
                .filter(|k| !["name", "sources", "calibration", "attention"].contains(&k.as_str()))
                .cloned()
                .collect();
            keys.extend(raw["attention"].as_table().unwrap().keys().map(|k| format!("attention.{k}")));
            for k in keys {
                let s = sources.get(&k).and_then(|s| s.as_str()).unwrap_or_else(|| panic!("{path}: no source for {k}"));
                assert!(!s.trim().is_empty(), "{path}: {k}");
            }
        }
        assert_eq!(gpus().len(), 2);
        assert_eq!(h100().name, "H100 SXM");
        assert_eq!(h100().calibration.unwrap().card, "NVIDIA H100 80GB HBM3");
        assert!(gpus()[1].calibration.is_none() && gpus()[1].wgmma.is_none());
    }

    /// A measured build replaces the warpgroup rates of the GPU it ran on, and of no other; its tensor ops
    /// are its own.
    #[test]
    fn a_measured_build_predicts_with_its_own_rates_on_its_own_gpu() {
        let path = root().join("benches/results/builds/2026-11-26.toml");
        let b = Build::from_file(&path).unwrap();
        assert!(b.composite_update && !b.packed_kernels && b.reads_loss_per_micro_batch);
        assert_ne!(b.tensor_ops, TENSOR_OPS);
        let then = b.gpu(*h100());
        assert_ne!(then.wgmma, h100().wgmma);
        assert!(then.wgmma_d64.is_none(), "that run measured no head-dim-64 rates");
        assert_eq!(then.mma, h100().mma);
        let a100 = gpus()[1];
        assert_eq!(b.gpu(a100), a100);
        assert_eq!(Build::CURRENT.gpu(*h100()), *h100());
    }

    #[test]
    fn a_bad_build_file_is_refused_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("b.toml");
        let good = std::fs::read_to_string(root().join("benches/results/builds/2026-11-27.toml")).unwrap();
        std::fs::write(&path, good.replace("device = \"H100 SXM\"", "device = \"H200\"")).unwrap();
        let e = Build::from_file(&path).unwrap_err().to_string();
        assert!(e.contains("b.toml") && e.contains("H200"), "{e}");
        std::fs::write(&path, good.replace("packed_kernels", "packed")).unwrap();
        let e = Build::from_file(&path).unwrap_err().to_string();
        assert!(e.contains("b.toml") && e.contains("packed"), "{e}");
        let e = Build::from_file(&dir.path().join("none.toml")).unwrap_err().to_string();
        assert!(e.contains("none.toml"), "{e}");
    }
}
