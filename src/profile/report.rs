//! A profile as the mean step ([`ProfileReport`]): each phase's calls, self and total time and counts,
//! what each counter measures on the device, and the table `grpo bench train-step --profile` prints.

use serde::{Deserialize, Serialize};

use super::counters::Counts;

/// What a phase's counters measure on `device` (see the module's documentation).
pub(super) fn counted(device: &str) -> Counted {
    let cpu = device == "cpu";
    let allocs = if super::alloc::installed() {
        "host heap allocations and frees of every thread of the process (not device memory)"
    } else {
        "not counted: the counting allocator is not installed in this binary"
    };
    let buffers = if super::alloc::installed() && !super::alloc::counts_buffers() {
        "not counted: the allocator could not learn the layout of candle's storage header"
    } else {
        "ops that produced a new tensor buffer (on a GPU each is a device allocation and, but for copies, a kernel launch)"
    };
    let text = |cpu_text: &str, gpu_text: &str| if cpu { cpu_text } else { gpu_text }.to_string();
    Counted {
        time: text(
            "wall time (the CPU's ops are done when they return)",
            "wall time between device synchronisations at each phase boundary (the device time of the phase's work)",
        ),
        launches: text(
            "not counted on the CPU (see buffers)",
            "launches of grpo's own kernels; candle's CUDA ops (matmuls, element-wise, casts) are not counted (see buffers)",
        ),
        buffers: buffers.into(),
        allocs: allocs.into(),
        copies: text(
            "host<->model-device copies where the project makes them (in host memory on the CPU: the transfers a GPU run makes)",
            "host<->device copies where the project makes them",
        ),
        syncs: "reads of device values by the host (the profiler's own synchronisations are not counted)".into(),
    }
}

/// What each counter measures on the profiled device.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Counted {
    pub time: String,
    pub launches: String,
    pub buffers: String,
    pub allocs: String,
    pub copies: String,
    pub syncs: String,
}

/// A phase's counts in the mean step.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PhaseCounts {
    /// Launches of the project's own GPU kernels.
    pub launches: f64,
    /// New tensor buffers (ops that produced one).
    pub buffers: f64,
    pub allocs: f64,
    pub frees: f64,
    pub alloc_bytes: f64,
    /// Host-to-device copies and their bytes.
    pub h2d: f64,
    pub h2d_bytes: f64,
    /// Device-to-host copies and their bytes.
    pub d2h: f64,
    pub d2h_bytes: f64,
    pub host_syncs: f64,
}

impl PhaseCounts {
    pub(super) fn per_step(c: Counts, steps: f64) -> Self {
        Self {
            launches: c.launches as f64 / steps,
            buffers: c.buffers as f64 / steps,
            allocs: c.allocs as f64 / steps,
            frees: c.frees as f64 / steps,
            alloc_bytes: c.alloc_bytes as f64 / steps,
            h2d: c.to_device as f64 / steps,
            h2d_bytes: c.to_device_bytes as f64 / steps,
            d2h: c.to_host as f64 / steps,
            d2h_bytes: c.to_host_bytes as f64 / steps,
            host_syncs: c.syncs as f64 / steps,
        }
    }
}

/// One phase of a [`ProfileReport`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PhaseReport {
    /// The phases from the step's down to this one, e.g. `forward/attention`.
    pub path: String,
    pub name: String,
    /// 1 for the step's phases, 2 for theirs, ...
    pub depth: usize,
    /// Calls per step (a layer's phase: once per layer and micro-batch).
    pub calls: f64,
    /// Time in the phase but not in its sub-phases, seconds per step.
    pub self_s: f64,
    /// Time in the phase, sub-phases included.
    pub total_s: f64,
    pub self_counts: PhaseCounts,
    pub total_counts: PhaseCounts,
}

/// A profile as the mean of its steps (`grpo bench train-step --profile`'s `profile`, a line of a
/// run's profile.jsonl).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProfileReport {
    pub device: String,
    /// Steps the profile is the mean of.
    pub steps: u64,
    /// The step's time, seconds.
    pub step_s: f64,
    /// The step's time outside every phase: the self times of the phases and this add up to `step_s`.
    pub other_s: f64,
    pub other: PhaseCounts,
    pub phases: Vec<PhaseReport>,
    pub counted: Counted,
}

impl ProfileReport {
    /// The profile as a table: a row per phase, indented under its parent, then "other" and the step.
    pub fn table(&self) -> String {
        let mut s = format!(
            "{:<42} {:>6} {:>10} {:>10} {:>6} {:>8} {:>8} {:>8} {:>8} {:>9} {:>5} {:>9} {:>5} {:>9} {:>5}\n",
            "phase",
            "calls",
            "self ms",
            "total ms",
            "self%",
            "launches",
            "buffers",
            "allocs",
            "frees",
            "alloc MB",
            "H2D",
            "H2D MB",
            "D2H",
            "D2H MB",
            "syncs"
        );
        let row = |name: String, calls: Option<f64>, self_s: f64, total_s: f64, c: &PhaseCounts| {
            let calls = calls.map_or(String::new(), |c| format!("{c:.0}"));
            let mb = |b: f64| b / (1 << 20) as f64;
            format!(
                "{name:<42} {calls:>6} {:>10.3} {:>10.3} {:>6.1} {:>8.0} {:>8.0} {:>8.0} {:>8.0} {:>9.2} {:>5.0} {:>9.3} {:>5.0} {:>9.3} {:>5.0}\n",
                self_s * 1e3,
                total_s * 1e3,
                100.0 * self_s / self.step_s.max(f64::MIN_POSITIVE),
                c.launches,
                c.buffers,
                c.allocs,
                c.frees,
                mb(c.alloc_bytes),
                c.h2d,
                mb(c.h2d_bytes),
                c.d2h,
                mb(c.d2h_bytes),
                c.host_syncs
            )
        };
        for p in &self.phases {
            let name = format!("{}{}", "  ".repeat(p.depth - 1), p.name);
            s += &row(name, Some(p.calls), p.self_s, p.total_s, &p.self_counts);
        }
        s += &row("other (outside every phase)".into(), None, self.other_s, self.other_s, &self.other);
        let total: PhaseCounts = self.phases.iter().fold(self.other, |a, p| a.add(&p.self_counts));
        s += &row(format!("step (mean of {})", self.steps), None, self.step_s, self.step_s, &total);
        let c = &self.counted;
        s += &format!(
            "self: without sub-phases (self times and other add up to the step); per step; on {}\n\
             time: {}\nlaunches: {}\nbuffers: {}\nallocs: {}\ncopies: {}\nsyncs: {}\n",
            self.device, c.time, c.launches, c.buffers, c.allocs, c.copies, c.syncs
        );
        s
    }
}

impl PhaseCounts {
    pub(super) fn add(&self, o: &PhaseCounts) -> PhaseCounts {
        PhaseCounts {
            launches: self.launches + o.launches,
            buffers: self.buffers + o.buffers,
            allocs: self.allocs + o.allocs,
            frees: self.frees + o.frees,
            alloc_bytes: self.alloc_bytes + o.alloc_bytes,
            h2d: self.h2d + o.h2d,
            h2d_bytes: self.h2d_bytes + o.h2d_bytes,
            d2h: self.d2h + o.d2h,
            d2h_bytes: self.d2h_bytes + o.d2h_bytes,
            host_syncs: self.host_syncs + o.host_syncs,
        }
    }
}
