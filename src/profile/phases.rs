//! The phases of a step: the guard of an open phase ([`phase`], [`coarse`]), the coarse phase a thread
//! is in and the one an error left, and the phase tree a [`Profiler`] records on its thread (calls of a
//! phase under the same parent added up), with its counts at each boundary ([`Counts`]).

use std::cell::{Cell, RefCell};
use std::time::{Duration, Instant};

use candle_core::Device;

use super::counters::Counts;
use super::report::{PhaseCounts, PhaseReport, ProfileReport};

thread_local! {
    static COARSE: Cell<Option<&'static str>> = const { Cell::new(None) };
    static ACTIVE: Cell<bool> = const { Cell::new(false) };
    static RECORDER: RefCell<Option<Recorder>> = const { RefCell::new(None) };
    static FAILED_IN: Cell<Option<&'static str>> = const { Cell::new(None) };
}

/// The coarse phase this thread is in: "forward", "backward", "log-prob head", "reference",
/// "optimizer", "validation" or "rollouts" (the innermost one open), or `None` outside them. Kept
/// whether or not a profile is recorded.
pub fn current_phase() -> Option<&'static str> {
    COARSE.with(Cell::get)
}

/// The guard of an open phase: the phase closes when it drops.
#[must_use = "a phase lasts as long as its guard"]
pub struct Phase {
    /// The coarse phase to restore (a coarse phase's guard).
    restore: Option<Option<&'static str>>,
    /// A coarse phase's name.
    coarse: Option<&'static str>,
    /// Whether the phase is recorded in a profile.
    recorded: bool,
}

/// Open the phase `name` (closed when the guard drops). Recorded only while a [`Profiler`] runs on
/// this thread.
pub fn phase(name: &'static str) -> Phase {
    let recorded =
        ACTIVE.with(Cell::get) && RECORDER.with(|r| r.borrow_mut().as_mut().map(|r| r.enter(name)).is_some());
    Phase { restore: None, coarse: None, recorded }
}

/// Open the phase `name` and make it the thread's coarse phase ([`current_phase`]) until the guard
/// drops. An error when `GRPO_INJECT_OOM` names this phase (and step): the fault-injection hook of
/// [`super::fault_injection`].
pub fn coarse(name: &'static str) -> candle_core::Result<Phase> {
    FAILED_IN.with(|f| f.set(None));
    let restore = COARSE.with(|c| c.replace(Some(name)));
    let mut p = phase(name);
    p.restore = Some(restore);
    p.coarse = Some(name);
    super::fault_injection::injected_oom(name)?;
    Ok(p)
}

impl Phase {
    /// Close a coarse phase that ended normally (dropping the guard without it marks the phase as the
    /// one an error left: [`failed_phase`]).
    pub fn end(self) {
        drop(self);
        FAILED_IN.with(|f| f.set(None));
    }
}

/// The innermost coarse phase that the last error unwound through: the phase whose guard was dropped
/// without [`Phase::end`] since a coarse phase was last entered (read once the error surfaces, when the
/// guards are gone and [`current_phase`] no longer names it).
pub fn failed_phase() -> Option<&'static str> {
    FAILED_IN.with(Cell::get)
}

impl Drop for Phase {
    fn drop(&mut self) {
        if self.recorded {
            RECORDER.with(|r| {
                if let Some(r) = r.borrow_mut().as_mut() {
                    r.exit();
                }
            });
        }
        if let Some(previous) = self.restore {
            COARSE.with(|c| c.set(previous));
        }
        if let Some(name) = self.coarse {
            FAILED_IN.with(|f| f.set(f.get().or(Some(name))));
        }
    }
}

/// One phase of the tree, its calls summed.
#[derive(Debug, Clone)]
struct Node {
    name: &'static str,
    children: Vec<usize>,
    calls: u64,
    total: Duration,
    counts: Counts,
}

/// The phases recorded so far and those open now.
struct Recorder {
    device: Device,
    nodes: Vec<Node>,
    /// Open phases: node, start time, counts at the start.
    open: Vec<(usize, Instant, Counts)>,
    /// A synchronisation failed (the time of the phase is then not that of its device work).
    sync_failed: bool,
}

impl Recorder {
    fn new(device: Device, root: &'static str) -> Self {
        let root =
            Node { name: root, children: Vec::new(), calls: 0, total: Duration::ZERO, counts: Counts::default() };
        let mut r = Self { device, nodes: vec![root], open: Vec::new(), sync_failed: false };
        r.open_node(0);
        r
    }

    fn sync(&mut self) {
        self.sync_failed |= self.device.synchronize().is_err();
    }

    fn open_node(&mut self, node: usize) {
        self.sync();
        self.open.push((node, Instant::now(), Counts::now()));
    }

    fn enter(&mut self, name: &'static str) {
        let parent = self.open.last().map_or(0, |o| o.0);
        let found = self.nodes[parent].children.iter().copied().find(|&c| self.nodes[c].name == name);
        let node = found.unwrap_or_else(|| {
            self.nodes.push(Node {
                name,
                children: Vec::new(),
                calls: 0,
                total: Duration::ZERO,
                counts: Counts::default(),
            });
            let id = self.nodes.len() - 1;
            self.nodes[parent].children.push(id);
            id
        });
        self.open_node(node);
    }

    fn exit(&mut self) {
        self.sync();
        let Some((node, start, before)) = self.open.pop() else { return };
        let n = &mut self.nodes[node];
        n.calls += 1;
        n.total += start.elapsed();
        n.counts = n.counts.zip(Counts::now().zip(before, u64::wrapping_sub), u64::wrapping_add);
    }
}

/// A profile being recorded on this thread, from [`Profiler::start`] to [`Profiler::finish`]: the
/// time between is the profiled step, its root phase.
pub struct Profiler {
    /// Allocation counting was off before (only the outermost profiler turns it off again).
    counting_was_off: bool,
}

/// Errors of the profiler.
#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    #[error("a profile is already being recorded on this thread")]
    AlreadyRunning,
}

impl Profiler {
    /// Start recording on this thread, the work queued on `device` timed.
    pub fn start(device: &Device) -> Result<Self, ProfileError> {
        if ACTIVE.with(Cell::get) {
            return Err(ProfileError::AlreadyRunning);
        }
        let counting_was_off = super::alloc::start_counting();
        RECORDER.with(|r| *r.borrow_mut() = Some(Recorder::new(device.clone(), "step")));
        ACTIVE.with(|a| a.set(true));
        Ok(Self { counting_was_off })
    }

    /// Stop recording: the step's profile.
    pub fn finish(self) -> Profile {
        let mut recorder = RECORDER.with(|r| r.borrow_mut().take()).expect("a running profiler has a recorder");
        // Phases left open (an error unwound through them) close now.
        while !recorder.open.is_empty() {
            recorder.exit();
        }
        Profile { device: crate::device::device_name(&recorder.device), steps: 1, nodes: recorder.nodes }
    }
}

impl Drop for Profiler {
    fn drop(&mut self) {
        RECORDER.with(|r| r.borrow_mut().take());
        ACTIVE.with(|a| a.set(false));
        if self.counting_was_off {
            super::alloc::stop_counting();
        }
    }
}

/// The recorded phases of one or more steps (their sums).
#[derive(Debug, Clone)]
pub struct Profile {
    device: String,
    steps: u64,
    nodes: Vec<Node>,
}

impl Profile {
    /// Add another step's profile (the report then gives the mean step). Phases are matched by their
    /// path from the root.
    pub fn merge(&mut self, other: &Profile) {
        self.steps += other.steps;
        self.merge_node(0, other, 0);
    }

    fn merge_node(&mut self, mine: usize, other: &Profile, theirs: usize) {
        let o = &other.nodes[theirs];
        let n = &mut self.nodes[mine];
        n.calls += o.calls;
        n.total += o.total;
        n.counts = n.counts.zip(o.counts, u64::wrapping_add);
        for &oc in &o.children {
            let name = other.nodes[oc].name;
            let found = self.nodes[mine].children.iter().copied().find(|&c| self.nodes[c].name == name);
            let child = found.unwrap_or_else(|| {
                self.nodes.push(Node {
                    calls: 0,
                    total: Duration::ZERO,
                    counts: Counts::default(),
                    children: vec![],
                    ..other.nodes[oc].clone()
                });
                let id = self.nodes.len() - 1;
                self.nodes[mine].children.push(id);
                id
            });
            self.merge_node(child, other, oc);
        }
    }

    /// The profile as the mean step: each phase with its self and total figures, in tree order (each
    /// phase after its parent), and the step's time outside every phase as "other".
    pub fn report(&self) -> ProfileReport {
        let steps = self.steps.max(1) as f64;
        let mut phases = Vec::new();
        self.report_node(0, 0, "", steps, &mut phases);
        let root = phases.remove(0);
        let step_s = root.total_s;
        ProfileReport {
            device: self.device.clone(),
            steps: self.steps,
            step_s,
            other_s: root.self_s,
            other: root.self_counts,
            phases,
            counted: super::report::counted(&self.device),
        }
    }

    fn report_node(&self, id: usize, depth: usize, parent: &str, steps: f64, out: &mut Vec<PhaseReport>) {
        let n = &self.nodes[id];
        let (mut child_time, mut child_counts) = (Duration::ZERO, Counts::default());
        for &c in &n.children {
            child_time += self.nodes[c].total;
            child_counts = child_counts.zip(self.nodes[c].counts, u64::wrapping_add);
        }
        // The step's phases are named from it down: `forward/attention`.
        let path = match (depth, parent.is_empty()) {
            (0, _) => String::new(),
            (_, true) => n.name.to_string(),
            (_, false) => format!("{parent}/{}", n.name),
        };
        out.push(PhaseReport {
            path: path.clone(),
            name: n.name.to_string(),
            depth,
            calls: n.calls as f64 / steps,
            self_s: n.total.saturating_sub(child_time).as_secs_f64() / steps,
            total_s: n.total.as_secs_f64() / steps,
            self_counts: PhaseCounts::per_step(n.counts.zip(child_counts, u64::saturating_sub), steps),
            total_counts: PhaseCounts::per_step(n.counts, steps),
        });
        for &c in &n.children {
            self.report_node(c, depth + 1, &path, steps, out);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::thread::sleep;

    fn find<'a>(r: &'a ProfileReport, path: &str) -> &'a PhaseReport {
        r.phases.iter().find(|p| p.path == path).unwrap_or_else(|| panic!("no phase {path}: {r:?}"))
    }

    /// Three calls of a phase with a sub-phase, inside a coarse phase: calls add up per path, self time
    /// is total time less the sub-phases', and the self times and "other" add up to the step.
    fn profiled_step() -> Profile {
        let profiler = Profiler::start(&Device::Cpu).unwrap();
        assert!(matches!(Profiler::start(&Device::Cpu), Err(ProfileError::AlreadyRunning)));
        {
            let _forward = coarse("forward").unwrap();
            for _ in 0..3 {
                let _attention = phase("attention");
                sleep(Duration::from_millis(2));
                let _norm = phase("norm");
                sleep(Duration::from_millis(1));
            }
            let x = candle_core::Tensor::new(&[1f32, 2.0, 3.0], &Device::Cpu).unwrap();
            assert_eq!(crate::device::to_host::<f32>(&x).unwrap().len(), 3);
        }
        sleep(Duration::from_millis(1));
        profiler.finish()
    }

    #[test]
    fn phases_nest_and_self_times_add_up_to_the_step() {
        let r = profiled_step().report();
        let paths: Vec<&str> = r.phases.iter().map(|p| p.path.as_str()).collect();
        assert_eq!(paths, ["forward", "forward/attention", "forward/attention/norm"]);
        let (forward, attention, norm) =
            (find(&r, "forward"), find(&r, "forward/attention"), find(&r, "forward/attention/norm"));
        assert_eq!((forward.calls, attention.calls, norm.calls), (1.0, 3.0, 3.0));
        assert_eq!((forward.depth, attention.depth, norm.depth), (1, 2, 3));
        assert!(norm.total_s >= 0.003 && attention.total_s >= 0.009, "{r:?}");
        assert!((attention.self_s - (attention.total_s - norm.total_s)).abs() < 1e-9);
        assert!((forward.self_s - (forward.total_s - attention.total_s)).abs() < 1e-9);
        assert!(r.other_s >= 0.001, "{r:?}");
        let sum = r.phases.iter().map(|p| p.self_s).sum::<f64>() + r.other_s;
        assert!((sum - r.step_s).abs() < 1e-9, "{sum} vs {}", r.step_s);
        // The read of three f32 is a host sync and a device-to-host copy of 12 bytes, in the forward's
        // own time.
        assert_eq!((forward.self_counts.host_syncs, forward.self_counts.d2h_bytes), (1.0, 12.0));
        assert_eq!((attention.total_counts.host_syncs, r.other.host_syncs), (0.0, 0.0));
        let table = r.table();
        for row in ["forward", "  attention", "    norm", "other (outside every phase)", "step (mean of 1)"] {
            assert!(table.lines().any(|l| l.starts_with(row)), "{row} missing:\n{table}");
        }
    }

    #[test]
    fn merged_steps_report_their_mean() {
        let (a, b) = (profiled_step(), profiled_step());
        let (ra, rb) = (a.report(), b.report());
        let mut both = a.clone();
        both.merge(&b);
        let r = both.report();
        assert_eq!(r.steps, 2);
        assert!((r.step_s - (ra.step_s + rb.step_s) / 2.0).abs() < 1e-9);
        let attention = find(&r, "forward/attention");
        assert_eq!(attention.calls, 3.0);
        let mean = (find(&ra, "forward/attention").self_s + find(&rb, "forward/attention").self_s) / 2.0;
        assert!((attention.self_s - mean).abs() < 1e-9);
        // The report survives its JSON form (the bench's record is read back to print the table).
        let back: ProfileReport = serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
        assert_eq!(back, r);
    }

    #[test]
    fn the_coarse_phase_is_kept_without_a_profile() {
        assert_eq!(current_phase(), None);
        {
            let _outer = coarse("backward").unwrap();
            let _fine = phase("attention");
            assert_eq!(current_phase(), Some("backward"));
            {
                let _inner = coarse("log-prob head").unwrap();
                assert_eq!(current_phase(), Some("log-prob head"));
            }
            assert_eq!(current_phase(), Some("backward"));
        }
        assert_eq!(current_phase(), None);
        // Nothing was recorded: a profile started now holds only what happens in it.
        let r = Profiler::start(&Device::Cpu).unwrap().finish().report();
        assert!(r.phases.is_empty());
    }

    /// A failure inside the backward, after its log-prob head ended normally, is the backward's; one in
    /// the head is the head's, whichever guards drop after it.
    fn fail_in(inner: bool) -> Option<&'static str> {
        let run = || -> candle_core::Result<()> {
            let _backward = coarse("backward")?;
            let head = coarse("log-prob head")?;
            if inner {
                candle_core::bail!("in the head");
            }
            head.end();
            candle_core::bail!("in a layer")
        };
        assert!(run().is_err());
        failed_phase()
    }

    #[test]
    fn the_phase_an_error_left_is_the_innermost_open_one() {
        assert_eq!(fail_in(false), Some("backward"));
        assert_eq!(fail_in(true), Some("log-prob head"));
        coarse("optimizer").unwrap().end();
        assert_eq!(failed_phase(), None);
    }
}
