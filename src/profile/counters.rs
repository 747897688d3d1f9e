//! The running counts a profile reads at each phase boundary, kept by what they count: the device's
//! copies and host reads ([`crate::device`]), the project's kernels ([`crate::kernels::launches`]) and
//! the counting allocator (alloc.rs).

use std::sync::atomic::Ordering::Relaxed;

use serde::{Deserialize, Serialize};

use super::alloc;

/// A phase's counts: per step in a report (`f64`), running totals while recording ([`Counts`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct PhaseCounts<T = f64> {
    /// Launches of the project's own GPU kernels.
    pub launches: T,
    /// New tensor buffers (ops that produced one).
    pub buffers: T,
    pub allocs: T,
    pub frees: T,
    pub alloc_bytes: T,
    /// Host-to-device copies and their bytes.
    pub h2d: T,
    pub h2d_bytes: T,
    /// Device-to-host copies and their bytes.
    pub d2h: T,
    pub d2h_bytes: T,
    pub host_syncs: T,
}

/// Running counts at one instant (differences give a phase's).
pub(super) type Counts = PhaseCounts<u64>;

impl Counts {
    pub(super) fn now() -> Self {
        let copies = crate::device::copies();
        Self {
            launches: crate::kernels::launches(),
            buffers: alloc::BUFFERS.load(Relaxed),
            allocs: alloc::ALLOCS.load(Relaxed),
            frees: alloc::FREES.load(Relaxed),
            alloc_bytes: alloc::ALLOC_BYTES.load(Relaxed),
            h2d: copies.to_device,
            h2d_bytes: copies.to_device_bytes,
            d2h: copies.to_host,
            d2h_bytes: copies.to_host_bytes,
            host_syncs: crate::device::host_reads(),
        }
    }
}

impl<T: Copy> PhaseCounts<T> {
    pub(super) fn zip<U>(self, o: Self, f: impl Fn(T, T) -> U) -> PhaseCounts<U> {
        PhaseCounts {
            launches: f(self.launches, o.launches),
            buffers: f(self.buffers, o.buffers),
            allocs: f(self.allocs, o.allocs),
            frees: f(self.frees, o.frees),
            alloc_bytes: f(self.alloc_bytes, o.alloc_bytes),
            h2d: f(self.h2d, o.h2d),
            h2d_bytes: f(self.h2d_bytes, o.h2d_bytes),
            d2h: f(self.d2h, o.d2h),
            d2h_bytes: f(self.d2h_bytes, o.d2h_bytes),
            host_syncs: f(self.host_syncs, o.host_syncs),
        }
    }

    pub(super) fn map<U>(self, f: impl Fn(T) -> U) -> PhaseCounts<U> {
        self.zip(self, |a, _| f(a))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    #[test]
    fn counts_read_the_device_counters() {
        let before = Counts::now();
        let x = crate::device::from_host(vec![1f32, 2.0], 2, &Device::Cpu).unwrap();
        crate::device::to_host::<f32>(&Tensor::cat(&[&x, &x], 0).unwrap()).unwrap();
        let d = Counts::now().zip(before, u64::wrapping_sub);
        assert_eq!((d.host_syncs, d.h2d, d.h2d_bytes, d.d2h, d.d2h_bytes), (1, 1, 8, 1, 16));
        assert_eq!(d.launches, 0, "no GPU kernel runs on the CPU");
        // Without the counting allocator installed (the library's tests), no allocation is counted.
        assert_eq!((d.allocs, d.buffers), (0, 0));
    }
}
