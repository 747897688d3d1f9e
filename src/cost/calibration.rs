//! The measurements the model of [`super::time`] is calibrated on, and the calibrated H100.
//!
//! Two GPU runs (an H100 80GB HBM3) measured, besides whole training steps, the pieces the model is made of:
//! - 2026-11-26 (benches/results/gpu-2026-11-26-h100.*): a 2048^3 bf16 matmul through candle, 370 TFLOP/s
//!   (the chunked attention's block GEMMs); one layer's attention (16 heads of 128, GQA 4) at 4,096 and
//!   16,384 tokens for the chunked path and each tensor-core kernel; the chunked attention's time per
//!   launch (16.8 us at 4,096 tokens: the host's time per launch of the project's own code);
//! - 2026-11-27, first at b68f48a (gpu-2026-11-27-h100-b68f48a.*): one layer's 21 projection GEMMs at the
//!   7B and 0.5B shapes (the GEMMs' efficiency and their tiles' waves); the offloaded update's host rate;
//!   then at the dk/dv kernels' split groups (gpu-2026-11-27-h100.*): the warpgroup kernels at head dims
//!   128 and 64, and six training steps;
//! - 2026-11-27b, this build's attention (gpu-2026-11-27b-h100.*, the backward on the forward's ring of
//!   slots): every attention kernel at 4,096 and 16,384 tokens, five 0.5B training steps, one profiled
//!   phase by phase at 16k; 2026-11-27c (gpu-2026-11-27c-h100.*): the 7B seed step at 8 answers.
//!
//! Those are taken as they are, with the tensors candle makes in each part of a step counted on the CPU
//! ([`COUNTED_TENSOR_OPS`]), and each measured step predicted as its build ran it ([`MeasuredBuild`]).
//! Three constants are fitted, by scripts/calibrate.py on the committed train steps (it prints every
//! point's prediction, measurement and residual; benches/results/calibration-2026-11-27b-h100.txt):
//! - [`Gpu::launch_s`], the host's time per tensor op, and [`Gpu::memory_efficiency`], the share of HBM's
//!   bandwidth of the element-wise kernels that move one element a thread and access, on the thirteen
//!   0.5B-shape steps of the four builds (two constants);
//! - [`Gpu::composite_host_update_bandwidth`], the first build's composite offloaded update, on its 7B
//!   step (the only one: fitted there, not predicted).
//!
//! One rate is assumed, not measured: [`Gpu::packed_memory_efficiency`], the element-wise kernels that move
//! 16-byte packs (this build's own, candle's contiguous add) and GEMMs' operand streams.
//!
//! The two 7B steps of the later builds, offloaded at the measured host rate, are not fitted on: predicted
//! at 0.86 (4 answers, attention recomputed) and 1.10 (8 answers, attention kept) of their times.
//!
//! tests/calibration.rs holds every committed train step within 25% of the model; a prediction for a
//! point the fit never saw (another length, the 7B shape at other settings, another kernel) follows from
//! the same constants, and the next GPU run (scripts/gpu/run.sh) measures it beside its prediction.

/// A GPU's rates and the efficiency of each kind of op on it, measured ([`Gpu::calibration`]) or assumed.
#[derive(Debug, Clone, Copy)]
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
#[derive(Debug, Clone, Copy)]
pub struct KernelRates {
    pub short: RateAt,
    pub long: RateAt,
}

/// A kernel's forward and backward rate at `tokens` tokens.
#[derive(Debug, Clone, Copy)]
pub struct RateAt {
    pub tokens: u64,
    pub forward: f64,
    pub backward: f64,
}

impl KernelRates {
    /// The same rates at every length.
    pub const fn flat(forward: f64, backward: f64) -> Self {
        let at = RateAt { tokens: 1, forward, backward };
        Self { short: at, long: at }
    }

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

/// NVIDIA H100 SXM5 80GB, calibrated on the first GPU run ([`H100`]).
pub const H100_SXM: Gpu = H100;

/// NVIDIA A100 SXM4 80GB. Peak dense BF16 312 TFLOP/s and HBM2e 2.039 TB/s: the A100 datasheet
/// (nvidia.com/en-us/data-center/a100). NVLink 3: 600 GB/s per GPU in total, 300 per direction; one
/// 200 Gb/s HDR NIC per GPU (DGX A100); PCIe Gen4 x16 32 GB/s per direction, ~25 GB/s achieved.
/// No A100 has run grpo: its rates are the H100's measured efficiencies where the two cards' hardware is
/// alike (candle's host cost per op, element-wise kernels, the offloaded update's host), and assumptions
/// where it is not: GEMMs at the H100's measured 0.37 of the peak (the A100's lower peak is easier to
/// reach: an underestimate), the tensor-core attention kernels at 0.35 of the peak forward and backward
/// (FlashAttention-2 reaches 50-73% of the A100's peak; these kernels' blocks are smaller).
pub const A100_80GB: Gpu = Gpu {
    name: "A100 80GB",
    peak_flops: 312e12,
    memory_bandwidth: 2.039e12,
    multiprocessors: 108,
    mma: KernelRates::flat(0.35, 0.35),
    wgmma: None,
    wgmma_atomic: None,
    wgmma_d64: None,
    wgmma_atomic_d64: None,
    pcie_bandwidth: 25e9,
    nvlink_bandwidth: 300e9,
    network_bandwidth: 25e9,
    calibration: None,
    ..H100_SXM
};

/// The GPUs the plan predicts for.
pub const GPUS: [Gpu; 2] = [H100_SXM, A100_80GB];

/// The tensors candle makes per unit of a step's work, counted on the CPU (where the graph of ops is the
/// GPU's): each costs the host its bookkeeping, and most a kernel launch and an allocation from the pool
/// on a GPU (views, a reshape or a transpose, cost less and launch nothing: [`Gpu::launch_s`] is the mean
/// over both). The attention is one op here: its GPU launches are counted by its kernels' own plan.
#[derive(Debug, Clone, Copy)]
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

/// The H100 runs the constants come from.
pub const H100_RUN: Calibration = Calibration {
    card: "NVIDIA H100 80GB HBM3",
    date: "2026-11-26 and 2026-11-27",
    results: "benches/results/gpu-2026-11-26-h100.jsonl, benches/results/gpu-2026-11-27*-h100*.jsonl",
};

/// A measured forward and backward rate (useful TFLOP/s) as fractions of the H100's peak.
const fn h100(tokens: u64, forward_tflops: f64, backward_tflops: f64) -> RateAt {
    RateAt { tokens, forward: forward_tflops / 989.4, backward: backward_tflops / 989.4 }
}

/// The warpgroup kernels as the 2026-11-26 run measured them (one layer, 16 heads of 128, GQA 4), before
/// the dk/dv kernels split each KV head's group over their blocks: what the steps of that build ran.
const H100_NOV26_WGMMA: KernelRates = KernelRates { short: h100(4096, 153.3, 72.8), long: h100(16384, 241.3, 138.7) };
const H100_NOV26_WGMMA_ATOMIC: KernelRates =
    KernelRates { short: h100(4096, 167.1, 69.1), long: h100(16384, 239.0, 146.1) };
/// The warpgroup kernels as the first 2026-11-27 run measured them (gpu-2026-11-27-h100.*: the dk/dv
/// kernels' groups split, the backward two-staged with a block-wide barrier a step), at head dims 128 (16
/// heads, GQA 4) and 64 (14 heads, GQA 7, the 0.5B shape's).
const H100_NOV27_WGMMA: KernelRates = KernelRates { short: h100(4096, 201.6, 104.3), long: h100(16384, 259.6, 142.6) };
const H100_NOV27_WGMMA_ATOMIC: KernelRates =
    KernelRates { short: h100(4096, 205.3, 108.5), long: h100(16384, 261.1, 147.6) };
const H100_NOV27_WGMMA_D64: KernelRates =
    KernelRates { short: h100(4096, 132.6, 69.7), long: h100(16384, 171.6, 88.4) };
const H100_NOV27_WGMMA_ATOMIC_D64: KernelRates =
    KernelRates { short: h100(4096, 132.8, 68.4), long: h100(16384, 170.1, 86.1) };

/// NVIDIA H100 SXM5 80GB: peak dense BF16 989.4 TFLOP/s, 132 multiprocessors and HBM3 3.35 TB/s (the
/// H100 datasheet, nvidia.com/en-us/data-center/h100); NVLink 4 450 GB/s per direction, one 400 Gb/s NIC
/// per GPU, PCIe Gen5 ~50 GB/s achieved (assumed: not measured). Measured on [`H100_RUN`]'s runs:
/// the GEMMs' efficiency (2026-11-27, `bench gemm`), the tensor-core attention kernels' rates (as the
/// 2026-11-27b run measured them: the warpgroup kernels at head dims 128 and 64, the `mma` kernels at 128,
/// their two-kernel rate standing for their dq by atomics; this build's leaner warpgroup loops are
/// projected from them, [`MeasuredBuild::Current`]), the offloaded update's host rate (2026-11-27, `bench optimizer` on the GPU machine's host); fitted: the
/// host's time per op and the element-wise kernels' fraction of HBM's bandwidth. Assumed: a host sync
/// 20 us, the chunked attention's block GEMMs at the 2048^3 matmul's efficiency.
pub const H100: Gpu = Gpu {
    name: "H100 SXM",
    peak_flops: 989.4e12,
    multiprocessors: 132,
    memory_bandwidth: 3.35e12,
    gemm_efficiency: MEASURED_GEMM_EFFICIENCY,
    // The 2048^3 matmul timed alone on 2026-11-26: 370 TFLOP/s through candle (its launch and sync in it,
    // as in each of the chunked attention's block GEMMs).
    attention_gemm_efficiency: 0.374,
    // This build's kernels as the 2026-11-27b run measured them (gpu-2026-11-27b-h100.*: one layer at
    // 4,096 and 16,384 tokens; the warpgroup backward on the forward's ring of slots).
    mma: KernelRates { short: h100(4096, 200.0, 94.5), long: h100(16384, 261.2, 140.6) },
    wgmma: Some(KernelRates { short: h100(4096, 248.3, 166.6), long: h100(16384, 332.9, 273.2) }),
    wgmma_atomic: Some(KernelRates { short: h100(4096, 241.8, 164.6), long: h100(16384, 333.9, 263.9) }),
    // 14 heads of 64, GQA 7 (the 0.5B shape's).
    wgmma_d64: Some(KernelRates { short: h100(4096, 206.4, 126.0), long: h100(16384, 310.3, 192.8) }),
    wgmma_atomic_d64: Some(KernelRates { short: h100(4096, 217.6, 133.0), long: h100(16384, 314.2, 206.8) }),
    memory_efficiency: FITTED_MEMORY_EFFICIENCY,
    packed_memory_efficiency: ASSUMED_PACKED_MEMORY_EFFICIENCY,
    launch_s: FITTED_LAUNCH_S,
    kernel_launch_s: 16.8e-6,
    sync_s: 20e-6,
    pcie_bandwidth: 50e9,
    host_update_bandwidth: MEASURED_HOST_UPDATE_BANDWIDTH,
    composite_host_update_bandwidth: FITTED_HOST_UPDATE_BANDWIDTH,
    nvlink_bandwidth: 450e9,
    network_bandwidth: 50e9,
    calibration: Some(H100_RUN),
};

/// The builds whose train steps the committed H100 runs measured, each named by its results' tag
/// (benches/results/gpu-<tag>-h100.jsonl), so that each record is predicted as it ran: with its build's
/// tensor ops, attention kernels and offloaded update. The model's own rates ([`H100`]) are the newest
/// run's; this build's warpgroup attention is projected from them ([`Leaner`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MeasuredBuild {
    /// 2026-11-26: the optimiser's update and the MLP's activation as composite candle ops
    /// ([`H100_RUN_TENSOR_OPS`], the update on the host at [`Gpu::composite_host_update_bandwidth`], its
    /// copies not overlapped), candle-core as released, the first warpgroup kernels (no head-dim-64 rates).
    H100Nov26,
    /// 2026-11-27 (the first run at the dk/dv kernels' split groups): [`NOV27_TENSOR_OPS`], the warpgroup
    /// kernels before their ring backward ([`H100_NOV27_WGMMA`]).
    H100Nov27,
    /// The 2026-11-27b run (the ring backward, [`H100`]'s attention rates) and the 2026-11-27c run (its 7B
    /// step, after the recomputed down projection's fix): [`NOV27_TENSOR_OPS`].
    H100Nov27b,
    /// This build: its warpgroup attention loops' rates projected from the 2026-11-27b run's ([`Leaner`]).
    #[default]
    Current,
}

impl MeasuredBuild {
    /// The tag of a results file (`gpu-<tag>-h100.jsonl`), or `None` for a tag no build is known by.
    pub fn from_tag(tag: &str) -> Option<Self> {
        match tag {
            "2026-11-26" => Some(Self::H100Nov26),
            "2026-11-27" => Some(Self::H100Nov27),
            "2026-11-27b" | "2026-11-27c" => Some(Self::H100Nov27b),
            "current" => Some(Self::Current),
            _ => None,
        }
    }

    /// The tensors candle made per part of a step in this build.
    pub fn tensor_ops(self) -> TensorOps {
        match self {
            Self::H100Nov26 => H100_RUN_TENSOR_OPS,
            Self::H100Nov27 | Self::H100Nov27b => NOV27_TENSOR_OPS,
            Self::Current => TENSOR_OPS,
        }
    }

    /// The build's own element-wise kernels (norms, rope, SwiGLU, biases, the heads' transposes, the log-prob
    /// rows, gradient accumulation, the attention backward's row dot products) move 16-byte packs: this
    /// one's.
    pub fn packed_kernels(self) -> bool {
        self == Self::Current
    }

    /// The offloaded update as composite candle ops on the host, its copies and update one after the
    /// other (`false`: the fused update, overlapped with the copies but one chunk).
    pub fn composite_update(self) -> bool {
        self == Self::H100Nov26
    }

    /// The step read each micro-batch's loss to the host (a host sync per micro-batch); this build keeps
    /// the step's statistics on the device and reads them once, with the gradient norm.
    pub fn reads_loss_per_micro_batch(self) -> bool {
        self != Self::Current
    }

    /// `gpu` with the attention kernels' rates of this build: the H100's as they were measured then; any
    /// other GPU as it is.
    pub fn gpu(self, gpu: Gpu) -> Gpu {
        if gpu.name != H100.name {
            return gpu;
        }
        match self {
            Self::H100Nov26 => Gpu {
                wgmma: Some(H100_NOV26_WGMMA),
                wgmma_atomic: Some(H100_NOV26_WGMMA_ATOMIC),
                wgmma_d64: None,
                wgmma_atomic_d64: None,
                ..gpu
            },
            Self::H100Nov27 => Gpu {
                wgmma: Some(H100_NOV27_WGMMA),
                wgmma_atomic: Some(H100_NOV27_WGMMA_ATOMIC),
                wgmma_d64: Some(H100_NOV27_WGMMA_D64),
                wgmma_atomic_d64: Some(H100_NOV27_WGMMA_ATOMIC_D64),
                ..gpu
            },
            Self::H100Nov27b => gpu,
            Self::Current => Gpu {
                wgmma: gpu.wgmma.map(|r| LEANER_D128.two_kernels(r)),
                wgmma_atomic: gpu.wgmma_atomic.map(|r| LEANER_D128.atomic(r)),
                wgmma_d64: gpu.wgmma_d64.map(|r| LEANER_D64.two_kernels(r)),
                wgmma_atomic_d64: gpu.wgmma_atomic_d64.map(|r| LEANER_D64.atomic(r)),
                ..gpu
            },
        }
    }
}

/// This build's warpgroup attention kernels against the ones the 2026-11-27b run measured, whose rates
/// [`H100`] holds. A kernel's time is taken as a part that issues instructions and a part that does not
/// (its warps stalled on latency with no other warp to issue): the first scales with the instructions a
/// step runs, the second stays. The issuing part is the run's Nsight Compute profile at 16,384 tokens
/// (benches/results/gpu-2026-11-27b-h100-ncu.txt, "Issued Warp Per Scheduler": the cycles a scheduler
/// issues), the instructions an inside step's before and after (benches/results/sass-loops-2026-11-27b.txt,
/// `step0` and `step`: SASS, no GPU). No constant is fitted. Back-tested on the forward's change from the
/// 2026-11-27 build to the 2026-11-27b one, which cut its instructions alone (824 to 357 a step at head
/// dim 64, 962 to 421 at 128: benches/results/sass-loops-2026-11-27-history.txt): this projection gives
/// its speed-up as 1.77x and 1.57x, measured 1.81x and 1.28x at 16,384 tokens, 1.56x and 1.23x at 4,096.
/// So it holds at head dim 64 and long rows and overstates the gain elsewhere; the next run measures it.
#[derive(Debug, Clone, Copy)]
struct Issue {
    /// The profile's fraction of cycles a scheduler issues.
    issuing: f64,
    /// Instructions of an inside step, the measured build's and this one's.
    before: f64,
    after: f64,
}

impl Issue {
    /// This build's time per step over the measured build's.
    fn factor(self) -> f64 {
        1.0 - self.issuing * (1.0 - self.after / self.before)
    }
}

/// [`Issue`] for each warpgroup kernel at one head dim.
#[derive(Debug, Clone, Copy)]
struct Leaner {
    forward: Issue,
    dq: Issue,
    dkv: Issue,
    /// The dk/dv kernel with dq by atomics (not profiled: the dk/dv kernel's issuing fraction).
    dkvq: Issue,
    /// The dq kernel's share of the two-kernel backward's time (the profile's durations).
    dq_share: f64,
}

impl Leaner {
    fn rates(self, r: KernelRates, backward: f64) -> KernelRates {
        let forward = self.forward.factor();
        let at = |a: RateAt| RateAt { forward: a.forward / forward, backward: a.backward / backward, ..a };
        KernelRates { short: at(r.short), long: at(r.long) }
    }
    fn two_kernels(self, r: KernelRates) -> KernelRates {
        self.rates(r, self.dq_share * self.dq.factor() + (1.0 - self.dq_share) * self.dkv.factor())
    }
    fn atomic(self, r: KernelRates) -> KernelRates {
        self.rates(r, self.dkvq.factor())
    }
}

const fn issue(issuing: f64, before: f64, after: f64) -> Issue {
    Issue { issuing, before, after }
}

/// Head dim 64 (14 heads, GQA 7); the dq kernel 1.85 of 5.54 ms.
const LEANER_D64: Leaner = Leaner {
    forward: issue(0.59, 357.0, 304.0),
    dq: issue(0.41, 328.0, 276.0),
    dkv: issue(0.34, 626.0, 457.0),
    dkvq: issue(0.34, 818.0, 674.0),
    dq_share: 1.85 / 5.54,
};
/// Head dim 128 (16 heads, GQA 4); the dq kernel 3.35 of 8.61 ms.
const LEANER_D128: Leaner = Leaner {
    forward: issue(0.44, 421.0, 345.0),
    dq: issue(0.42, 398.0, 327.0),
    dkv: issue(0.36, 721.0, 538.0),
    dkvq: issue(0.36, 1166.0, 1055.0),
    dq_share: 3.35 / 8.61,
};

/// Measured on 2026-11-27 (`grpo bench gemm`, one layer's 21 projection GEMMs at the 7B shape over 18,432
/// rows and at the 0.5B shape over 4,096, each timed alone: benches/results/gpu-2026-11-27-h100-b68f48a.*):
/// a GEMM's time taken as 25 us (each timed call's launch and sync, not in a step's stream of launches)
/// plus its FLOPs at this fraction of the peak times its tiles' utilisation ([`super::time::gemm_flops_per_s`]:
/// 128 x 128 tiles on 132 multiprocessors): two constants on 42 GEMMs, each within 0.79-1.09 at the 7B shape and
/// 0.62-1.47 at the 0.5B (the extremes, weight gradients of 128 rows, are where cuBLAS splits the sum).
/// The one matmul of 2048^3 timed alone (370 TFLOP/s, 0.374) stood for every GEMM before: at the 7B
/// shape they ran at 746 TFLOP/s.
const MEASURED_GEMM_EFFICIENCY: f64 = 0.81;
/// The fused offloaded AdamW update on the H100 machine's host (16 cores), 2026-11-27: 256 M bf16
/// parameters in 256 tensors in 0.110 s, 74.6 GB/s of the 32 B per parameter counted (`grpo bench
/// optimizer`); the 7B step's profile, its update synchronised chunk by chunk, had its host part at 71.
const MEASURED_HOST_UPDATE_BANDWIDTH: f64 = 74.6e9;

/// Assumed, not measured: the fraction of HBM's bandwidth an element-wise kernel reaches that moves 16 bytes
/// a thread and access (the kernels of kernels/common.cuh's packs: 8 bf16 a load or store, enough bytes in
/// flight per multiprocessor to stream HBM; a copy kernel of that kind streams 2.6-3.0 TB/s of the H100's
/// 3.35). The next run's profile times two of them alone (the norm and rope phases), and gradient
/// accumulation.
const ASSUMED_PACKED_MEMORY_EFFICIENCY: f64 = 0.80;

/// Fitted by scripts/calibrate.py (see the module's doc; benches/results/calibration-2026-11-27b-h100.txt).
/// The host's time per tensor candle makes: 8.50 us. A raw kernel launch of the project's own code took
/// 16.8 us (the chunked attention at 4,096 tokens, whose launches include cuBLAS calls and a device that
/// is not idle); a candle op's mean is lower because a third of its tensors are views.
const FITTED_LAUNCH_S: f64 = 8.50e-6;
/// The fraction of HBM's bandwidth the element-wise kernels that move one element a thread and access
/// reach over the bytes the model counts: 0.22. The profile of the 2026-11-27b run's 16k step times two of
/// them on their own, in line with it: the fused RMSNorm at 0.27 (66 us for 59 MB) and rope at 0.24 (84 us
/// for 67 MB), each phase's time with its synchronisation (some microseconds) in it.
const FITTED_MEMORY_EFFICIENCY: f64 = 0.22;
/// The composite offloaded AdamW update's host rate (the first run's build): 7 GB/s of the 32 B per
/// parameter the model counts, ~220 M parameters a second (~15 candle CPU ops per tensor, each a pass over
/// f32 arrays).
const FITTED_HOST_UPDATE_BANDWIDTH: f64 = 7.0e9;

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

/// The counts of the builds the 2026-11-27 runs measured: the q, k and v biases as candle's broadcast add
/// and its sum (3 tensors more a layer each way), v to heads a transpose and its copy (1 more), and
/// every weight's gradient candle's product in the weight's dtype, added into its accumulator by
/// kernels::accumulate (its first micro-batch's cast into an accumulator of its own). The morning's build
/// also took the gradient norm as candle's square, sum and cast (3 tensors a parameter, not 1): not
/// counted here.
pub const NOV27_TENSOR_OPS: TensorOps = TensorOps {
    layer_reference: 50.0,
    layer_policy: 50.0,
    layer_recompute: 65.0,
    layer_backward: 102.0,
    micro_batch: 131.0,
    micro_batch_reference: 75.0,
    step: 0.0,
    accumulate_per_tensor: 0.8,
    accumulate_first_per_tensor: 1.6,
    norm_per_tensor: 1.0,
    update_per_tensor: 5.0,
    seed_passes: 0.0,
    head_grad_bytes: 10.0,
    fused_wgrad: false,
    unnamed_ops_move_bytes: false,
};

/// The same counts for the build the 2026-11-26 H100 run measured (counted on the CPU in that build): the
/// optimiser's update as composite candle ops, the MLP's activation as candle's silu and product, and
/// candle-core's backward as released (each op's first gradient added to a tensor of zeros).
pub const H100_RUN_TENSOR_OPS: TensorOps = TensorOps {
    layer_reference: 55.0,
    layer_policy: 55.0,
    layer_recompute: 84.0,
    layer_backward: 249.0,
    micro_batch: 186.0,
    micro_batch_reference: 107.0,
    step: 37.0,
    accumulate_per_tensor: 2.0,
    accumulate_first_per_tensor: 0.0,
    norm_per_tensor: 3.0,
    update_per_tensor: 15.0,
    seed_passes: 4.0,
    head_grad_bytes: 16.0,
    fused_wgrad: false,
    unnamed_ops_move_bytes: true,
};

#[cfg(test)]
mod tests {
    use super::*;

    /// The projection by issue back-tested on the forward's change between the 2026-11-27 and 2026-11-27b
    /// builds (instructions alone: 824 to 357 a step at head dim 64, 962 to 421 at 128), from the later
    /// run's issuing fractions, against the two runs' forward rates at 16,384 tokens: within 3% at head dim
    /// 64, the gain overstated by at most 25% at 128 (as `Leaner` says).
    #[test]
    fn the_issue_projection_reproduces_the_forwards_measured_gain() {
        let measured = |then: KernelRates, now: Option<KernelRates>| now.unwrap().long.forward / then.long.forward;
        let d64 = issue(LEANER_D64.forward.issuing, 357.0, 824.0).factor();
        let m64 = measured(H100_NOV27_WGMMA_D64, H100.wgmma_d64);
        assert!((d64 / m64 - 1.0).abs() < 0.03, "projected {d64:.3} measured {m64:.3}");
        let d128 = issue(LEANER_D128.forward.issuing, 421.0, 962.0).factor();
        let m128 = measured(H100_NOV27_WGMMA, H100.wgmma);
        assert!(d128 > m128 && d128 < 1.25 * m128, "projected {d128:.3} measured {m128:.3}");
    }

    /// This build's warpgroup rates are the measured ones over the projected factors: faster, each by no
    /// more than the share of its time that issues.
    #[test]
    fn this_builds_warpgroup_rates_are_the_measured_ones_projected() {
        let now = MeasuredBuild::Current.gpu(H100);
        let pairs = [
            (H100.wgmma_d64, now.wgmma_d64, LEANER_D64),
            (H100.wgmma_atomic_d64, now.wgmma_atomic_d64, LEANER_D64),
            (H100.wgmma, now.wgmma, LEANER_D128),
            (H100.wgmma_atomic, now.wgmma_atomic, LEANER_D128),
        ];
        for (then, now, l) in pairs {
            let (then, now) = (then.unwrap().long, now.unwrap().long);
            let gain = now.forward / then.forward;
            assert!(gain > 1.0 && gain < 1.0 / (1.0 - l.forward.issuing), "{gain}");
            assert!(now.backward > then.backward && now.backward < then.backward / (1.0 - l.dkv.issuing));
        }
        assert_eq!(MeasuredBuild::H100Nov27b.gpu(H100).wgmma_d64.unwrap().long.forward, 310.3e12 / H100.peak_flops);
    }
}
