//! The counting allocator: counts allocations, frees and bytes while a profile runs (one relaxed atomic
//! load otherwise), and new tensor buffers: the allocations of candle's storage header, one per buffer
//! (views share their buffer's).
//!
//! candle keeps a buffer as `Arc<parking_lot::RwLock<Storage>>`, one heap block. Its layout is not
//! guessed: [`start_counting`] makes one such `Arc` and watches the one allocation it makes, so a new std
//! or candle that lays it out otherwise is still matched. That candle keeps its buffers in that type is
//! assumed: tests/profile_alloc.rs fails when it does not, and `counted.buffers` says so where the
//! layout could not be learnt.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::Ordering::{Relaxed, SeqCst};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};

/// Installed by the binary: `#[global_allocator] static A: CountingAlloc = CountingAlloc;`.
pub struct CountingAlloc;

static COUNTING: AtomicBool = AtomicBool::new(false);
pub(super) static ALLOCS: AtomicU64 = AtomicU64::new(0);
pub(super) static FREES: AtomicU64 = AtomicU64::new(0);
pub(super) static ALLOC_BYTES: AtomicU64 = AtomicU64::new(0);
pub(super) static BUFFERS: AtomicU64 = AtomicU64::new(0);
/// Whether an allocation has gone through [`CountingAlloc`].
static INSTALLED: AtomicBool = AtomicBool::new(false);
/// The size and alignment of candle's storage header, once learnt (0 before).
static HEADER_SIZE: AtomicUsize = AtomicUsize::new(0);
static HEADER_ALIGN: AtomicUsize = AtomicUsize::new(0);
/// Whether some thread is watching its allocations: only then does an allocation look at [`PROBE`].
static PROBING: AtomicBool = AtomicBool::new(false);

/// What a thread learning the header's layout has seen of its own allocations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Probe {
    Off,
    /// Watching, nothing allocated yet.
    Armed,
    Seen(Layout),
    /// More than one allocation: no single block to learn.
    Several,
}

impl Probe {
    fn after(self, layout: Layout) -> Self {
        match self {
            Probe::Off => Probe::Off,
            Probe::Armed => Probe::Seen(layout),
            Probe::Seen(_) | Probe::Several => Probe::Several,
        }
    }
}

thread_local! {
    static PROBE: Cell<Probe> = const { Cell::new(Probe::Off) };
}

pub(super) fn installed() -> bool {
    INSTALLED.load(Relaxed)
}

/// Whether new tensor buffers are counted: the allocator is installed and has learnt the header.
pub(super) fn counts_buffers() -> bool {
    installed() && HEADER_SIZE.load(Relaxed) != 0
}

/// Start counting (learning the header first); whether counting was off before (then the caller turns
/// it off again: [`stop_counting`]).
pub(super) fn start_counting() -> bool {
    learn_storage_header();
    !COUNTING.swap(true, Relaxed)
}

pub(super) fn stop_counting() {
    COUNTING.store(false, Relaxed);
}

/// Learn the header's layout from the one allocation an `Arc<parking_lot::RwLock<Storage>>` of an empty
/// CPU buffer makes on this thread. Nothing is learnt where the allocator is not installed.
fn learn_storage_header() {
    if HEADER_SIZE.load(Relaxed) != 0 {
        return;
    }
    let storage = candle_core::Storage::Cpu(candle_core::CpuStorage::F32(Vec::new()));
    PROBE.with(|p| p.set(Probe::Armed));
    PROBING.store(true, SeqCst);
    let header = std::sync::Arc::new(parking_lot::RwLock::new(storage));
    PROBING.store(false, SeqCst);
    let seen = PROBE.with(|p| p.replace(Probe::Off));
    drop(header);
    if let Probe::Seen(layout) = seen {
        HEADER_ALIGN.store(layout.align(), Relaxed);
        HEADER_SIZE.store(layout.size(), Relaxed);
    }
}

// SAFETY: every call is forwarded to the system allocator unchanged; the counting touches only atomics
// and, while a thread learns the header's layout, a const-initialised thread-local without a destructor.
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
        if COUNTING.load(Relaxed) {
            FREES.fetch_add(1, Relaxed);
        }
        // SAFETY: as `alloc`.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if COUNTING.load(Relaxed) {
            // A move to a new block: one allocation and one free.
            ALLOCS.fetch_add(1, Relaxed);
            FREES.fetch_add(1, Relaxed);
            ALLOC_BYTES.fetch_add(new_size.saturating_sub(layout.size()) as u64, Relaxed);
        }
        // SAFETY: as `alloc`.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

fn count_alloc(layout: Layout) {
    if !INSTALLED.load(Relaxed) {
        INSTALLED.store(true, Relaxed);
    }
    if PROBING.load(Relaxed) {
        // `try_with`: a thread being torn down has no probe (and is not the one learning).
        let _ = PROBE.try_with(|p| p.set(p.get().after(layout)));
    }
    if COUNTING.load(Relaxed) {
        ALLOCS.fetch_add(1, Relaxed);
        ALLOC_BYTES.fetch_add(layout.size() as u64, Relaxed);
        if layout.size() == HEADER_SIZE.load(Relaxed) && layout.align() == HEADER_ALIGN.load(Relaxed) {
            BUFFERS.fetch_add(1, Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_probe_learns_a_single_allocation_only() {
        let (a, b) = (Layout::new::<[u64; 4]>(), Layout::new::<u8>());
        assert_eq!(Probe::Armed.after(a), Probe::Seen(a));
        assert_eq!(Probe::Seen(a).after(b), Probe::Several);
        assert_eq!(Probe::Several.after(a), Probe::Several);
        assert_eq!(Probe::Off.after(a), Probe::Off);
    }

    #[test]
    fn without_the_allocator_installed_nothing_is_learnt_or_counted() {
        // The library's tests run on the system allocator: the probe sees no allocation.
        learn_storage_header();
        assert!(!installed() && !counts_buffers());
        let c = super::super::counters::Counts::now();
        assert_eq!((c.allocs, c.frees, c.alloc_bytes, c.buffers), (0, 0, 0, 0));
    }
}
