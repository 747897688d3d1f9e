//! The running counts a profile reads at each phase boundary, each kept by what it counts: the
//! device's copies and host reads ([`crate::device::copies`], [`crate::device::host_reads`]), the
//! launches of the project's kernels ([`crate::kernels::launches`]) and the counting allocator's
//! allocations and buffers (alloc.rs). The profile only reads them.

/// Running counts at one instant (differences give a phase's).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(super) struct Counts {
    pub(super) syncs: u64,
    pub(super) to_device: u64,
    pub(super) to_device_bytes: u64,
    pub(super) to_host: u64,
    pub(super) to_host_bytes: u64,
    pub(super) launches: u64,
    pub(super) allocs: u64,
    pub(super) frees: u64,
    pub(super) alloc_bytes: u64,
    pub(super) buffers: u64,
}

impl Counts {
    pub(super) fn now() -> Self {
        let (copies, allocs) = (crate::device::copies(), super::alloc::counts());
        Self {
            syncs: crate::device::host_reads(),
            to_device: copies.to_device,
            to_device_bytes: copies.to_device_bytes,
            to_host: copies.to_host,
            to_host_bytes: copies.to_host_bytes,
            launches: crate::kernels::launches(),
            allocs: allocs.allocs,
            frees: allocs.frees,
            alloc_bytes: allocs.bytes,
            buffers: allocs.buffers,
        }
    }

    pub(super) fn zip(self, o: Self, f: impl Fn(u64, u64) -> u64) -> Self {
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
        assert_eq!((d.syncs, d.to_device, d.to_device_bytes, d.to_host, d.to_host_bytes), (1, 1, 8, 1, 16));
        assert_eq!(d.launches, 0, "no GPU kernel runs on the CPU");
        // Without the counting allocator installed (the library's tests), no allocation is counted.
        assert_eq!((d.allocs, d.buffers), (0, 0));
    }
}
