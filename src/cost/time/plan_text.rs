//! The data-parallel communication estimate and the text `grpo train --plan` prints of a prediction.

use super::*;

/// Communication of one ZeRO-1 step on `world` ranks (src/train/zero.rs): the ring reduce-scatter of the
/// f32 gradients and all-gather of the f32 weights through each rank's slowest link, and the copies
/// through host memory around them over PCIe (4 (4 + 2 / N) B a parameter).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Zero1Comms {
    pub link_bytes: f64,
    pub link_s: f64,
    pub pcie_bytes: f64,
    pub pcie_s: f64,
}

impl Zero1Comms {
    pub fn seconds(&self) -> f64 {
        self.link_s + self.pcie_s
    }
}

pub fn zero1_comms(params: u64, world: u64, gpus_per_node: u64, gpu: &Gpu) -> Zero1Comms {
    if world <= 1 {
        return Zero1Comms { link_bytes: 0.0, link_s: 0.0, pcie_bytes: 0.0, pcie_s: 0.0 };
    }
    let (n, p) = (world as f64, params as f64);
    let link_bytes = (n - 1.0) / n * p * 8.0;
    let link = if world <= gpus_per_node { gpu.nvlink_bandwidth } else { gpu.network_bandwidth };
    let pcie_bytes = p * 4.0 * (4.0 + 2.0 / n);
    Zero1Comms {
        link_bytes,
        link_s: link_bytes / (link * COLLECTIVE_EFFICIENCY),
        pcie_bytes,
        pcie_s: pcie_bytes / gpu.pcie_bandwidth,
    }
}

/// Where `gpu`'s rates come from, for the reader of a prediction.
pub fn calibration_note(gpu: &Gpu) -> String {
    match gpu.calibration {
        Some(c) => format!("calibrated on {}, {}", c.card, c.date),
        None => "assumed rates: no such card has run grpo".to_string(),
    }
}

/// GPUs per node in the scaling estimate (an HGX / DGX H100 or A100 node).
pub const GPUS_PER_NODE: u64 = 8;

/// The lines `grpo train --plan` prints: one rank's step `s` of a step of `global_answers` sequences on
/// `world_size` ranks, and for each of [`gpus`] its predicted time, throughput and efficiency.
pub fn report(m: &ModelConfig, s: &StepShape, global_answers: u64, world_size: u64) -> String {
    let world = world_size.max(1);
    let attention = match (s.tensor_cores, s.warpgroup, s.atomic_dq) {
        (true, true, true) => "attention on the warpgroup kernels (elsewhere tensor-core, dq by atomics)".to_string(),
        (true, true, false) => "attention on the warpgroup kernels (elsewhere tensor-core)".to_string(),
        (true, false, true) => "attention on the tensor-core kernels (dq by atomics)".to_string(),
        (true, false, false) => "attention on the tensor-core kernels".to_string(),
        (false, ..) => format!("attention in {} x {} blocks", s.blocks.query, s.blocks.key),
    };
    let recompute = match (s.checkpoint_layers, s.recompute_attention) {
        (true, true) => "layers recomputed",
        (true, false) => "layers recomputed but their attention's forward (kept)",
        (false, _) => "no recomputation",
    };
    let mut out = format!(
        "performance model (src/cost/time.rs): {} answers x {} tokens{}, micro-batch {}, {attention}, {}, {}\n",
        s.answers,
        s.seq_tokens,
        if world > 1 { " per rank" } else { "" },
        s.micro_batch,
        recompute,
        if s.reference_forward { "a reference forward" } else { "no reference forward (cached or beta 0)" },
    );
    let tokens = global_answers as f64 * s.seq_tokens as f64;
    // Ranks take whole groups: past one group per rank, the others wait.
    let busy = global_answers.div_ceil(s.answers.max(1)).clamp(1, world);
    if busy < world {
        out.push_str(&format!("  only {busy} of {world} ranks have a group to train on (groups are not split)\n"));
    }
    for gpu in gpus() {
        let p = predict(m, s, gpu);
        let comms = zero1_comms(m.num_parameters() as u64, world, GPUS_PER_NODE, gpu);
        let step = p.step_s + comms.seconds();
        out.push_str(&format!(
            "predicted on {} ({}): step {:.1} s, {:.0} tokens/s{}; MFU {:.1}%, attention at {:.1}% of peak (device: \
             GEMMs {:.1} s, attention {:.1} s, element-wise {:.1} s; waiting for the host {:.1} s; {:.3e} tensor ops \
             and launches, {})\n",
            gpu.name,
            calibration_note(gpu),
            step,
            tokens / step,
            if world > 1 { format!(" on {world} GPUs") } else { String::new() },
            100.0 * p.mfu * p.step_s / step * busy as f64 / world as f64,
            100.0 * p.attention_of_peak,
            p.gemm_s,
            p.attention_s,
            p.elementwise_s,
            p.host_s,
            p.launches,
            crate::progress::count(p.syncs.round() as u64, "host sync"),
        ));
        out.push_str(&format!("  longest ops (their share of the step): {}\n", longest_ops(&p.ops, p.step_s, 4)));
        if world > 1 {
            let link = if world <= GPUS_PER_NODE { "NVLink" } else { "InfiniBand" };
            out.push_str(&format!(
                "  {} ranks: ZeRO-1 reduce-scatter + all-gather {:.1} GB per rank, {:.2} s over {link}, and {:.1} GB \
                 through host memory, {:.2} s over PCIe; {:.0} tokens/s per GPU\n",
                world,
                comms.link_bytes / 1e9,
                comms.link_s,
                comms.pcie_bytes / 1e9,
                comms.pcie_s,
                tokens / step / world as f64
            ));
        }
    }
    out
}

/// The `n` longest of `ops` as "window op share-of-`step_s`", joined.
pub(super) fn longest_ops(ops: &[OpTime], step_s: f64, n: usize) -> String {
    let line = |o: &OpTime| {
        let name = o.op.strip_suffix(&format!(" ({})", o.window)).unwrap_or(o.op);
        format!("{} {name} {:.0}%", o.window, 100.0 * o.device_s / step_s)
    };
    ops.iter().take(n).map(line).collect::<Vec<_>>().join(", ")
}
