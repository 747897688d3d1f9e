//! The phase guards ([`phase`], [`coarse`]), the coarse phase a thread is in and the one an error left,
//! and the phase tree a [`Profiler`] records on its thread (calls under the same parent added up).

use std::cell::{Cell, RefCell};
use std::time::{Duration, Instant};

use candle_core::Device;

use super::counters::Counts;
use super::report::{PhaseReport, ProfileReport};

thread_local! {
    static COARSE: Cell<Option<&'static str>> = const { Cell::new(None) };
    static ACTIVE: Cell<bool> = const { Cell::new(false) };
    static RECORDER: RefCell<Option<Recorder>> = const { RefCell::new(None) };
    static FAILED_IN: Cell<Option<&'static str>> = const { Cell::new(None) };
}

/// The innermost coarse phase this thread is in ("forward", "backward", "log-prob head", "reference",
/// "optimizer", "validation", "rollouts"), kept whether or not a profile is recorded.
pub fn current_phase() -> Option<&'static str> {
    COARSE.with(Cell::get)
}

/// The guard of an open phase: the phase closes when it drops.
#[must_use = "a phase lasts as long as its guard"]
pub struct Phase {
    /// A coarse phase's name and the coarse phase to restore.
    coarse: Option<(&'static str, Option<&'static str>)>,
    recorded: bool,
}

/// Open the phase `name`, recorded only while a [`Profiler`] runs on this thread.
pub fn phase(name: &'static str) -> Phase {
    let recorded =
        ACTIVE.with(Cell::get) && RECORDER.with(|r| r.borrow_mut().as_mut().map(|r| r.enter(name)).is_some());
    Phase { coarse: None, recorded }
}

/// Open the phase `name` as the thread's coarse phase ([`current_phase`]). An error when
/// `GRPO_INJECT_OOM` names it ([`super::fault_injection`]).
pub fn coarse(name: &'static str) -> candle_core::Result<Phase> {
    FAILED_IN.with(|f| f.set(None));
    let previous = COARSE.with(|c| c.replace(Some(name)));
    let mut p = phase(name);
    p.coarse = Some((name, previous));
    super::fault_injection::injected_oom(name)?;
    Ok(p)
}

impl Phase {
    /// Close a coarse phase that ended normally (a guard dropped without it marks [`failed_phase`]).
    pub fn end(self) {
        drop(self);
        FAILED_IN.with(|f| f.set(None));
    }
}

/// The innermost coarse phase the last error unwound through: dropped without [`Phase::end`] since a
/// coarse phase was last entered (read once the error surfaces and the guards are gone).
pub fn failed_phase() -> Option<&'static str> {
    FAILED_IN.with(Cell::get)
}

impl Drop for Phase {
    fn drop(&mut self) {
        if self.recorded {
            RECORDER.with(|r| r.borrow_mut().as_mut().map(Recorder::exit));
        }
        if let Some((name, previous)) = self.coarse {
            COARSE.with(|c| c.set(previous));
            FAILED_IN.with(|f| f.set(f.get().or(Some(name))));
        }
    }
}

/// One phase of the tree, its calls summed.
#[derive(Debug, Clone, Default)]
struct Node {
    name: &'static str,
    children: Vec<usize>,
    calls: u64,
    total: Duration,
    counts: Counts,
}

/// The child `name` of `nodes[parent]`, added where it is not there yet.
fn child(nodes: &mut Vec<Node>, parent: usize, name: &'static str) -> usize {
    if let Some(&c) = nodes[parent].children.iter().find(|&&c| nodes[c].name == name) {
        return c;
    }
    nodes.push(Node { name, ..Node::default() });
    let id = nodes.len() - 1;
    nodes[parent].children.push(id);
    id
}

/// The phases recorded so far and those open now.
struct Recorder {
    device: Device,
    nodes: Vec<Node>,
    /// Open phases: node, start time, counts at the start.
    open: Vec<(usize, Instant, Counts)>,
}

impl Recorder {
    fn new(device: Device) -> Self {
        let mut r = Self { device, nodes: vec![Node { name: "step", ..Node::default() }], open: Vec::new() };
        r.open_node(0);
        r
    }

    fn open_node(&mut self, node: usize) {
        // A failed synchronisation only makes the phase's time not that of its device work.
        let _ = self.device.synchronize();
        self.open.push((node, Instant::now(), Counts::now()));
    }

    fn enter(&mut self, name: &'static str) {
        let parent = self.open.last().map_or(0, |o| o.0);
        let node = child(&mut self.nodes, parent, name);
        self.open_node(node);
    }

    fn exit(&mut self) {
        let _ = self.device.synchronize();
        let Some((node, start, before)) = self.open.pop() else { return };
        let n = &mut self.nodes[node];
        n.calls += 1;
        n.total += start.elapsed();
        n.counts = n.counts.zip(Counts::now().zip(before, u64::wrapping_sub), u64::wrapping_add);
    }
}

/// A profile being recorded on this thread, from [`Profiler::start`] to [`Profiler::finish`] (the
/// profiled step, its root phase).
pub struct Profiler {
    /// Allocation counting was off before (only the outermost profiler turns it off again).
    counting_was_off: bool,
}

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
        RECORDER.with(|r| *r.borrow_mut() = Some(Recorder::new(device.clone())));
        ACTIVE.with(|a| a.set(true));
        Ok(Self { counting_was_off })
    }

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
    /// Add another step's profile (the report then gives the mean step), phases matched by their path.
    pub fn merge(&mut self, other: &Profile) {
        self.steps += other.steps;
        self.merge_node(0, other, 0);
    }

    fn merge_node(&mut self, mine: usize, other: &Profile, theirs: usize) {
        let (n, o) = (&mut self.nodes[mine], &other.nodes[theirs]);
        n.calls += o.calls;
        n.total += o.total;
        n.counts = n.counts.zip(o.counts, u64::wrapping_add);
        for &oc in &o.children {
            let c = child(&mut self.nodes, mine, other.nodes[oc].name);
            self.merge_node(c, other, oc);
        }
    }

    /// The profile as the mean step: its phases in tree order (each after its parent), and the step's
    /// time outside every phase as "other".
    pub fn report(&self) -> ProfileReport {
        let steps = self.steps.max(1) as f64;
        let mut phases = Vec::new();
        self.report_node(0, 0, "", steps, &mut phases);
        let root = phases.remove(0);
        ProfileReport {
            device: self.device.clone(),
            steps: self.steps,
            step_s: root.total_s,
            other_s: root.self_s,
            other: root.self_counts,
            phases,
            counted: super::report::counted(&self.device),
        }
    }

    fn report_node(&self, id: usize, depth: usize, parent: &str, steps: f64, out: &mut Vec<PhaseReport>) {
        let n = &self.nodes[id];
        let children = n.children.iter().map(|&c| &self.nodes[c]);
        let child_time: Duration = children.clone().map(|c| c.total).sum();
        let child_counts = children.fold(Counts::default(), |a, c| a.zip(c.counts, u64::wrapping_add));
        // The step's phases are named from it down: `forward/attention`.
        let path = match depth {
            0 => String::new(),
            _ if parent.is_empty() => n.name.to_string(),
            _ => format!("{parent}/{}", n.name),
        };
        let per_step = |c: Counts| c.map(|v| v as f64 / steps);
        out.push(PhaseReport {
            path: path.clone(),
            name: n.name.to_string(),
            depth,
            calls: n.calls as f64 / steps,
            self_s: n.total.saturating_sub(child_time).as_secs_f64() / steps,
            total_s: n.total.as_secs_f64() / steps,
            self_counts: per_step(n.counts.zip(child_counts, u64::saturating_sub)),
            total_counts: per_step(n.counts),
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
        let [forward, attention, norm] = &r.phases[..] else { panic!("three phases: {r:?}") };
        assert_eq!(
            [&forward.path, &attention.path, &norm.path],
            ["forward", "forward/attention", "forward/attention/norm"]
        );
        assert_eq!((forward.calls, attention.calls, norm.calls), (1.0, 3.0, 3.0));
        assert_eq!((forward.depth, attention.depth, norm.depth), (1, 2, 3));
        assert!(norm.total_s >= 0.003 && attention.total_s >= 0.009, "{r:?}");
        assert!((attention.self_s - (attention.total_s - norm.total_s)).abs() < 1e-9);
        assert!((forward.self_s - (forward.total_s - attention.total_s)).abs() < 1e-9);
        assert!(r.other_s >= 0.001, "{r:?}");
        let sum = r.phases.iter().map(|p| p.self_s).sum::<f64>() + r.other_s;
        assert!((sum - r.step_s).abs() < 1e-9, "{sum} vs {}", r.step_s);
        // The read of three f32: a host sync and a device-to-host copy of 12 bytes, in the forward's own.
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
