//! Where a training step's time goes: a profile of its phases (`grpo bench train-step --profile`,
//! `[train] profile_steps`), and the coarse phase a thread is in ([`current_phase`]).
//!
//! A phase is a scope opened with [`phase`] (or [`coarse`]) and closed when its guard drops. Phases nest
//! into a tree (a layer's attention inside the forward); calls of the same phase under the same parent
//! are added up (every layer's attention is one row, its call count shown). For each phase the profile
//! records its calls, its time in it (total, and self: without its sub-phases, so that the self times
//! of all phases and of the step's remainder, "other", add up to the step) and what happened in it:
//!
//! - **time**: wall time between device synchronisations. While profiling, each phase boundary waits
//!   for the device (`Device::synchronize`), so a phase's time is the device time of the work it queued
//!   (on a GPU, as CUDA events would give; on the CPU the work is done when the call returns). The
//!   synchronisations themselves cost a step some time a run without the profiler does not spend.
//! - **host syncs**: reads of device values by the host ([`crate::device::to_host`]), each a wait for
//!   the device on a GPU; the profiler's own synchronisations are not counted.
//! - **copies**: host-to-device copies (host data placed on the model's device,
//!   [`crate::device::from_host`], and the offloaded optimiser's new weights) and device-to-host copies
//!   (reads, and gradients to the offloaded optimiser), with their bytes. They are counted where the
//!   project moves data on every device: on the CPU the model's memory is host memory, so the counts are
//!   the transfers a GPU run of the same step makes.
//! - **launches**: on a GPU, the launches of the project's own kernels ([`crate::kernels`]); candle's
//!   own CUDA ops (matmuls, element-wise ops, casts) have no hook to count them (candle 0.11 has none).
//! - **buffers**: the ops that produced a new tensor buffer, on every device (each allocation of
//!   candle's storage header, made once per new buffer, views excepted, counted by [`CountingAlloc`]).
//!   On a GPU each is a device allocation and, copies aside, a kernel launch: on the CPU, the count of
//!   the launches a GPU run of the step makes.
//! - **allocations**: host heap allocations and frees, and the bytes allocated, of every thread of the
//!   process (candle's CPU ops run on a thread pool), counted by [`CountingAlloc`] when the binary
//!   installs it as its global allocator (the `grpo` binary does). On a GPU, device memory is not in
//!   these counts. Without the allocator installed they read 0.
//!
//! Profiling is off unless a [`Profiler`] is running on the thread; a phase guard then costs a
//! thread-local read. The coarse phase ([`current_phase`]) is kept whether or not a profile runs.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::{Cell, RefCell};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use candle_core::Device;
use serde::{Deserialize, Serialize};

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
/// [`injected_oom`].
pub fn coarse(name: &'static str) -> candle_core::Result<Phase> {
    FAILED_IN.with(|f| f.set(None));
    let restore = COARSE.with(|c| c.replace(Some(name)));
    let mut p = phase(name);
    p.restore = Some(restore);
    p.coarse = Some(name);
    injected_oom(name)?;
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

static STEP: AtomicU64 = AtomicU64::new(0);
static INJECTED: AtomicBool = AtomicBool::new(false);

/// Tell the fault-injection hook which step (counted from 1, as metrics.jsonl and the checkpoints count
/// them) the run is in.
pub fn set_step(step: u64) {
    STEP.store(step, Ordering::Relaxed);
}

/// `GRPO_INJECT_OOM=<phase>[@<step>]`: the phase (and step) at which the hook fails once, as the CUDA
/// driver does when an allocation fails; read once.
fn injection() -> Option<&'static (String, Option<u64>)> {
    static SPEC: std::sync::OnceLock<Option<(String, Option<u64>)>> = std::sync::OnceLock::new();
    SPEC.get_or_init(|| std::env::var("GRPO_INJECT_OOM").ok().and_then(|v| parse_injection(&v))).as_ref()
}

fn parse_injection(v: &str) -> Option<(String, Option<u64>)> {
    let (phase, step) = match v.rsplit_once('@') {
        Some((p, s)) => (p, Some(s.trim().parse().ok()?)),
        None => (v, None),
    };
    let phase = phase.trim();
    (!phase.is_empty()).then(|| (phase.to_string(), step))
}

/// An out-of-memory error with the text of the CUDA driver's when `GRPO_INJECT_OOM` names the phase
/// `name` entered now (at its step when given), the first time only: a test of how a run reports an
/// allocation that fails, on any device.
fn injected_oom(name: &str) -> candle_core::Result<()> {
    let Some((phase, step)) = injection() else { return Ok(()) };
    let due = phase == name && step.is_none_or(|s| s == STEP.load(Ordering::Relaxed));
    if due && !INJECTED.swap(true, Ordering::Relaxed) {
        return Err(candle_core::Error::Msg(
            "DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\") (injected by GRPO_INJECT_OOM)".into(),
        ));
    }
    Ok(())
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

/// A global allocator that counts allocations, frees and bytes while a profile runs (one relaxed
/// atomic load otherwise), and the allocations of candle's storage header (one per new tensor buffer).
/// Installed by the binary: `#[global_allocator] static A: CountingAlloc = CountingAlloc;`.
pub struct CountingAlloc;

static COUNTING: AtomicBool = AtomicBool::new(false);
static ALLOCS: AtomicU64 = AtomicU64::new(0);
static FREES: AtomicU64 = AtomicU64::new(0);
static ALLOC_BYTES: AtomicU64 = AtomicU64::new(0);
static BUFFERS: AtomicU64 = AtomicU64::new(0);
/// Whether an allocation has gone through [`CountingAlloc`] (it is installed).
static INSTALLED: AtomicBool = AtomicBool::new(false);

/// The size of candle's `Arc<RwLock<Storage>>` allocation, made once for each new tensor buffer (views
/// share their buffer's): two reference counts, the lock's state word, the storage.
#[repr(C)]
struct StorageHeader {
    counts: [usize; 2],
    lock: usize,
    storage: candle_core::Storage,
}

const STORAGE_HEADER: Layout = Layout::new::<StorageHeader>();

// SAFETY: every call is forwarded to the system allocator unchanged; the counting touches only atomics.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count_alloc(layout);
        // SAFETY: the caller's contract is the system allocator's.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count_alloc(layout);
        // SAFETY: as `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if COUNTING.load(Ordering::Relaxed) {
            FREES.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: as `alloc`.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            // A move to a new block: one allocation and one free.
            ALLOCS.fetch_add(1, Ordering::Relaxed);
            FREES.fetch_add(1, Ordering::Relaxed);
            ALLOC_BYTES.fetch_add(new_size.saturating_sub(layout.size()) as u64, Ordering::Relaxed);
        }
        // SAFETY: as `alloc`.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

fn count_alloc(layout: Layout) {
    if !INSTALLED.load(Ordering::Relaxed) {
        INSTALLED.store(true, Ordering::Relaxed);
    }
    if COUNTING.load(Ordering::Relaxed) {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        ALLOC_BYTES.fetch_add(layout.size() as u64, Ordering::Relaxed);
        if layout == STORAGE_HEADER {
            BUFFERS.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Running counts at one instant (differences give a phase's).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Counts {
    syncs: u64,
    to_device: u64,
    to_device_bytes: u64,
    to_host: u64,
    to_host_bytes: u64,
    launches: u64,
    allocs: u64,
    frees: u64,
    alloc_bytes: u64,
    buffers: u64,
}

impl Counts {
    fn now() -> Self {
        let copies = crate::device::copies();
        Self {
            syncs: crate::device::host_reads(),
            to_device: copies.to_device,
            to_device_bytes: copies.to_device_bytes,
            to_host: copies.to_host,
            to_host_bytes: copies.to_host_bytes,
            launches: crate::kernels::launches(),
            allocs: ALLOCS.load(Ordering::Relaxed),
            frees: FREES.load(Ordering::Relaxed),
            alloc_bytes: ALLOC_BYTES.load(Ordering::Relaxed),
            buffers: BUFFERS.load(Ordering::Relaxed),
        }
    }

    fn zip(self, o: Self, f: impl Fn(u64, u64) -> u64) -> Self {
        Self {
            syncs: f(self.syncs, o.syncs),
            to_device: f(self.to_device, o.to_device),
            to_device_bytes: f(self.to_device_bytes, o.to_device_bytes),
            to_host: f(self.to_host, o.to_host),
            to_host_bytes: f(self.to_host_bytes, o.to_host_bytes),
            launches: f(self.launches, o.launches),
            allocs: f(self.allocs, o.allocs),
            frees: f(self.frees, o.frees),
            alloc_bytes: f(self.alloc_bytes, o.alloc_bytes),
            buffers: f(self.buffers, o.buffers),
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
        let counting_was_off = !COUNTING.swap(true, Ordering::Relaxed);
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
            COUNTING.store(false, Ordering::Relaxed);
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
            counted: counted(&self.device),
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

/// What a phase's counters measure on `device` (see the module's documentation).
fn counted(device: &str) -> Counted {
    let cpu = device == "cpu";
    let allocs = if INSTALLED.load(Ordering::Relaxed) {
        "host heap allocations and frees of every thread of the process (not device memory)"
    } else {
        "not counted: the counting allocator is not installed in this binary"
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
        buffers: "ops that produced a new tensor buffer (on a GPU each is a device allocation and, but for copies, a kernel launch)".into(),
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
    fn per_step(c: Counts, steps: f64) -> Self {
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
    fn add(&self, o: &PhaseCounts) -> PhaseCounts {
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

    #[test]
    fn injections_name_a_phase_and_maybe_a_step() {
        assert_eq!(parse_injection("backward@2"), Some(("backward".into(), Some(2))));
        assert_eq!(parse_injection("log-prob head"), Some(("log-prob head".into(), None)));
        assert_eq!(parse_injection("backward@x"), None);
        assert_eq!(parse_injection(""), None);
    }
}
