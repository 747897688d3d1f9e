//! The counting allocator: a global allocator that counts allocations, frees and bytes while a profile
//! runs (one relaxed atomic load otherwise), and the allocations of candle's storage header, made once
//! per new tensor buffer (views share their buffer's).
//!
//! candle's `Tensor_` holds its buffer as `Arc<parking_lot::RwLock<Storage>>`: one heap block per
//! buffer, whose layout is std's and parking_lot's (the reference counts, the lock) around candle's
//! `Storage`. That layout is not
//! guessed: the allocator learns it by making one such `Arc` itself on the thread that starts counting
//! and watching the one allocation it makes ([`start_counting`]), so a new std or candle that lays it out
//! otherwise is still matched. What stays assumed is that candle keeps its buffers in that type:
//! tests/profile_alloc.rs (the allocator installed, as the binary installs it) fails when a new candle
//! makes a buffer otherwise, and the profile's `counted.buffers` says so where the layout could not be
//! learnt.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

/// A global allocator that counts allocations, frees and bytes while a profile runs, and new tensor
/// buffers. Installed by the binary: `#[global_allocator] static A: CountingAlloc = CountingAlloc;`.
pub struct CountingAlloc;

static COUNTING: AtomicBool = AtomicBool::new(false);
static ALLOCS: AtomicU64 = AtomicU64::new(0);
static FREES: AtomicU64 = AtomicU64::new(0);
static ALLOC_BYTES: AtomicU64 = AtomicU64::new(0);
static BUFFERS: AtomicU64 = AtomicU64::new(0);
/// Whether an allocation has gone through [`CountingAlloc`] (it is installed).
static INSTALLED: AtomicBool = AtomicBool::new(false);
/// The size and alignment of candle's storage header, once learnt ([`learn_storage_header`]; 0 before).
static HEADER_SIZE: AtomicUsize = AtomicUsize::new(0);
static HEADER_ALIGN: AtomicUsize = AtomicUsize::new(0);
/// Whether some thread is watching its allocations ([`Probe`]): only then does an allocation look at
/// its thread's probe.
static PROBING: AtomicBool = AtomicBool::new(false);

/// What a thread learning the header's layout has seen of its own allocations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Probe {
    Off,
    /// Watching, nothing allocated yet.
    Armed,
    /// One allocation, of this layout.
    Seen(Layout),
    /// More than one: no single block to learn.
    Several,
}

impl Probe {
    /// The probe after an allocation of `layout`.
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

/// The counts of allocations so far (differences give a phase's).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct AllocCounts {
    pub(super) allocs: u64,
    pub(super) frees: u64,
    pub(super) bytes: u64,
    pub(super) buffers: u64,
}

/// The allocator's counts now (all 0 where it is not installed).
pub(super) fn counts() -> AllocCounts {
    AllocCounts {
        allocs: ALLOCS.load(Ordering::Relaxed),
        frees: FREES.load(Ordering::Relaxed),
        bytes: ALLOC_BYTES.load(Ordering::Relaxed),
        buffers: BUFFERS.load(Ordering::Relaxed),
    }
}

/// Whether the binary installed [`CountingAlloc`] (an allocation has gone through it).
pub(super) fn installed() -> bool {
    INSTALLED.load(Ordering::Relaxed)
}

/// Whether new tensor buffers are counted: the allocator is installed and has learnt candle's storage
/// header.
pub(super) fn counts_buffers() -> bool {
    installed() && HEADER_SIZE.load(Ordering::Relaxed) != 0
}

/// Start counting (learning the storage header's layout first, where it is not known yet); whether
/// counting was off before (the caller that turned it on turns it off: [`stop_counting`]).
pub(super) fn start_counting() -> bool {
    learn_storage_header();
    !COUNTING.swap(true, Ordering::Relaxed)
}

pub(super) fn stop_counting() {
    COUNTING.store(false, Ordering::Relaxed);
}

/// Learn the layout of candle's storage header from the one allocation that making an
/// `Arc<parking_lot::RwLock<Storage>>` makes on this thread (its storage an empty CPU buffer, which allocates
/// nothing itself). Nothing is learnt where the allocator is not installed (no allocation is seen).
fn learn_storage_header() {
    if HEADER_SIZE.load(Ordering::Relaxed) != 0 {
        return;
    }
    let storage = candle_core::Storage::Cpu(candle_core::CpuStorage::F32(Vec::new()));
    PROBE.with(|p| p.set(Probe::Armed));
    PROBING.store(true, Ordering::SeqCst);
    let header = std::sync::Arc::new(parking_lot::RwLock::new(storage));
    PROBING.store(false, Ordering::SeqCst);
    let seen = PROBE.with(|p| p.replace(Probe::Off));
    drop(header);
    if let Probe::Seen(layout) = seen {
        HEADER_ALIGN.store(layout.align(), Ordering::Relaxed);
        HEADER_SIZE.store(layout.size(), Ordering::Relaxed);
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
    if PROBING.load(Ordering::Relaxed) {
        // `try_with`: a thread being torn down has no probe (and is not the one learning).
        let _ = PROBE.try_with(|p| p.set(p.get().after(layout)));
    }
    if COUNTING.load(Ordering::Relaxed) {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        ALLOC_BYTES.fetch_add(layout.size() as u64, Ordering::Relaxed);
        if layout.size() == HEADER_SIZE.load(Ordering::Relaxed)
            && layout.align() == HEADER_ALIGN.load(Ordering::Relaxed)
        {
            BUFFERS.fetch_add(1, Ordering::Relaxed);
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
        assert_eq!(counts(), AllocCounts::default());
    }
}
