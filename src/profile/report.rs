//! A profile as the mean step ([`ProfileReport`]), what each counter measures on the device, and the
//! table `grpo bench train-step --profile` prints.

use serde::{Deserialize, Serialize};

use super::alloc;
use super::counters::PhaseCounts;

/// What a phase's counters measure on `device` (see the module's documentation).
pub(super) fn counted(device: &str) -> Counted {
    let on = |cpu: &str, gpu: &str| if device == "cpu" { cpu } else { gpu }.to_string();
    Counted {
        time: on(
            "wall time (the CPU's ops are done when they return)",
            "wall time between device synchronisations at each phase boundary (the device time of the phase's work)",
        ),
        launches: on(
            "not counted on the CPU (see buffers)",
            "launches of grpo's own kernels; candle's CUDA ops (matmuls, element-wise, casts) are not counted (see buffers)",
        ),
        buffers: if alloc::installed() && !alloc::counts_buffers() {
            "not counted: the allocator could not learn the layout of candle's storage header"
        } else {
            "ops that produced a new tensor buffer (on a GPU each is a device allocation and, but for copies, a kernel launch)"
        }
        .into(),
        allocs: if alloc::installed() {
            "host heap allocations and frees of every thread of the process (not device memory)"
        } else {
            "not counted: the counting allocator is not installed in this binary"
        }
        .into(),
        copies: on(
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

/// The table's columns after the phase and its calls, and each one's width and decimals.
const COLUMNS: [&str; 13] = [
    "self ms", "total ms", "self%", "launches", "buffers", "allocs", "frees", "alloc MB", "H2D", "H2D MB", "D2H",
    "D2H MB", "syncs",
];
const FORMATS: [(usize, usize); 13] =
    [(10, 3), (10, 3), (6, 1), (8, 0), (8, 0), (8, 0), (8, 0), (9, 2), (5, 0), (9, 3), (5, 0), (9, 3), (5, 0)];

impl ProfileReport {
    /// The profile as a table: a row per phase, indented under its parent, then "other" and the step.
    pub fn table(&self) -> String {
        let mut s = format!("{:<42} {:>6}", "phase", "calls");
        for (heading, (width, _)) in COLUMNS.into_iter().zip(FORMATS) {
            s += &format!(" {heading:>width$}");
        }
        s += "\n";
        let row = |name: &str, calls: Option<f64>, self_s: f64, total_s: f64, c: &PhaseCounts| {
            let calls = calls.map_or(String::new(), |c| format!("{c:.0}"));
            let mb = |b: f64| b / (1 << 20) as f64;
            let self_pct = 100.0 * self_s / self.step_s.max(f64::MIN_POSITIVE);
            let values = [self_s * 1e3, total_s * 1e3, self_pct, c.launches, c.buffers, c.allocs, c.frees]
                .into_iter()
                .chain([mb(c.alloc_bytes), c.h2d, mb(c.h2d_bytes), c.d2h, mb(c.d2h_bytes), c.host_syncs]);
            let mut line = format!("{name:<42} {calls:>6}");
            for ((width, decimals), v) in FORMATS.into_iter().zip(values) {
                line += &format!(" {v:>width$.decimals$}");
            }
            line + "\n"
        };
        for p in &self.phases {
            let name = format!("{}{}", "  ".repeat(p.depth - 1), p.name);
            s += &row(&name, Some(p.calls), p.self_s, p.total_s, &p.self_counts);
        }
        s += &row("other (outside every phase)", None, self.other_s, self.other_s, &self.other);
        let total = self.phases.iter().fold(self.other, |a, p| a.zip(p.self_counts, |x, y| x + y));
        s += &row(&format!("step (mean of {})", self.steps), None, self.step_s, self.step_s, &total);
        let c = &self.counted;
        s += &format!(
            "self: without sub-phases (self times and other add up to the step); per step; on {}\n\
             time: {}\nlaunches: {}\nbuffers: {}\nallocs: {}\ncopies: {}\nsyncs: {}\n",
            self.device, c.time, c.launches, c.buffers, c.allocs, c.copies, c.syncs
        );
        s
    }
}
