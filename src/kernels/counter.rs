//! The launches of the project's own GPU kernels, counted per thread where cuda.rs launches them (a
//! plan's kernels, the weight-gradient GEMM): what a profile's `launches` reads. Always 0 on the CPU.

use std::cell::Cell;

thread_local! {
    static LAUNCHES: Cell<u64> = const { Cell::new(0) };
}

/// Count a launch of one of the project's GPU kernels.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(super) fn count_launch() {
    LAUNCHES.with(|c| c.set(c.get() + 1));
}

/// Launches of the project's GPU kernels made so far by this thread.
pub fn launches() -> u64 {
    LAUNCHES.with(Cell::get)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn launches_are_counted_per_thread() {
        let before = launches();
        count_launch();
        count_launch();
        assert_eq!(launches() - before, 2);
        assert_eq!(std::thread::spawn(launches).join().unwrap(), 0);
    }
}
