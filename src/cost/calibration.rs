//! The devices and builds the performance model of [`super::time`] predicts for, as data: each GPU's
//! rates a file of configs/devices/ (compiled in), each build a GPU run measured a file of
//! benches/results/builds/, both written by scripts/calibrate.py (docs/performance-model.md). This
//! build's own tensor counts are [`TENSOR_OPS`].

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::OnceLock;

/// A GPU's rates and the efficiency of each kind of op on it (a file of configs/devices/, whose
/// `[sources]` say where each comes from).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Gpu {
    pub name: &'static str,
    /// Dense bf16 tensor-core FLOP/s.
    pub peak_flops: f64,
    pub multiprocessors: u32,
    /// B/s, as every bandwidth.
    pub memory_bandwidth: f64,
    /// Fractions of the peak: a cuBLAS GEMM's tiles while they run, chunked attention's block GEMMs.
    pub gemm_efficiency: f64,
    pub attention_gemm_efficiency: f64,
    /// The tensor-core attention kernels (flash_mma.cu), in useful FLOPs over the peak.
    pub mma: KernelRates,
    /// The warpgroup kernels (flash_wgmma.cu; dq by atomics; at head dim 64); `None` without wgmma.
    pub wgmma: Option<KernelRates>,
    pub wgmma_atomic: Option<KernelRates>,
    pub wgmma_d64: Option<KernelRates>,
    pub wgmma_atomic_d64: Option<KernelRates>,
    /// Fractions of the bandwidth an element-wise kernel reaches: one element a thread, 16-byte packs.
    pub memory_efficiency: f64,
    pub packed_memory_efficiency: f64,
    /// Host seconds per candle tensor op, per kernel launch of the project's own code, per host sync.
    pub launch_s: f64,
    pub kernel_launch_s: f64,
    pub sync_s: f64,
    /// Per direction.
    pub pcie_bandwidth: f64,
    /// Host memory bytes a second of the offloaded AdamW update (32 B a parameter), fused and composite.
    pub host_update_bandwidth: f64,
    pub composite_host_update_bandwidth: f64,
    /// Per GPU and direction, within a node and to other nodes.
    pub nvlink_bandwidth: f64,
    pub network_bandwidth: f64,
    /// Where the rates were measured (`None`: all assumed).
    pub calibration: Option<Calibration>,
}

/// A tensor-core attention kernel's rate at two measured lengths, interpolated in log length between them.
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

/// The tensors candle makes per part of a step, counted on the CPU (the GPU's graph is the same); each
/// costs the host [`Gpu::launch_s`]. The attention is one op here.
#[derive(Debug, Clone, Copy, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TensorOps {
    /// One layer's forward (reference, policy, recomputed) and backward.
    pub layer_reference: f64,
    pub layer_policy: f64,
    pub layer_recompute: f64,
    pub layer_backward: f64,
    /// Per micro-batch beyond the layers: the policy's embedding, head and loss, both ways; the reference's.
    pub micro_batch: f64,
    pub micro_batch_reference: f64,
    /// Per step beyond the parameters' updates.
    pub step: f64,
    /// Per parameter tensor: its gradient's accumulation (per micro-batch; the first micro-batch's making
    /// the accumulator), its part of the norm and its update (per step).
    pub accumulate_per_tensor: f64,
    pub accumulate_first_per_tensor: f64,
    pub norm_per_tensor: f64,
    pub update_per_tensor: f64,
    /// Passes over a layer's `[N, hidden]` output spent seeding its backward with `(y g).sum_all()`.
    pub seed_passes: f64,
    /// Bytes per lm_head weight element and log-prob chunk its f32 gradient costs beyond the GEMM.
    pub head_grad_bytes: f64,
    /// Weight gradients GEMM'd straight into their f32 accumulators (kernels::wgrad_accumulate).
    pub fused_wgrad: bool,
    /// The tensor ops beyond a layer's named element-wise ops each a pass over their mean bytes.
    pub unnamed_ops_move_bytes: bool,
}

/// Where a GPU's rates were measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Calibration {
    /// The card as CUDA names it, the date, and the results file.
    pub card: &'static str,
    pub date: &'static str,
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

/// Made once per process, so kept for its lifetime.
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
/// measured ([`Build::from_file`]), to predict them as it ran them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Build {
    pub tensor_ops: TensorOps,
    /// The project's element-wise kernels move 16-byte packs.
    pub packed_kernels: bool,
    /// The offloaded update as composite ops, its copies and update in turn (else fused and overlapped).
    pub composite_update: bool,
    /// A host sync per micro-batch for its loss.
    pub reads_loss_per_micro_batch: bool,
    /// The warpgroup rates the build's run measured on the GPU named (`None`: the device file's).
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

/// The tensors candle makes in a step's parts, counted with `grpo bench train-step` on the CPU at the 0.5B
/// shape (1 and 2 layers, 2 and 4 answers of 128 tokens, with and without the reference and
/// `checkpoint_layers`; the differences give each part); tests/calibration.rs holds the model's count to
/// the bench's.
pub const TENSOR_OPS: TensorOps = TensorOps {
    layer_reference: 46.0,
    layer_policy: 46.0,
    layer_recompute: 61.0,
    layer_backward: 80.0,
    micro_batch: 128.0,
    micro_batch_reference: 75.0,
    step: 1.0,
    accumulate_per_tensor: 1.0,
    accumulate_first_per_tensor: 1.0,
    norm_per_tensor: 1.0,
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
