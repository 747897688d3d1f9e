//! The profiler's counting allocator, installed as the `grpo` binary installs it: under a profile each op
//! that produces a new tensor buffer counts one buffer and a view none, and allocations and frees are
//! counted. One test in this binary, so that no other test's allocations are counted beside it. It is
//! the guard of the allocator's one assumption about candle (src/profile/alloc.rs): that each new
//! buffer is one `Arc<parking_lot::RwLock<Storage>>`, whose layout the allocator learns; a candle that makes its
//! buffers otherwise fails it.

use candle_core::{Device, Tensor};
use grpo::profile::{phase, Profiler};

#[global_allocator]
static ALLOCATOR: grpo::profile::CountingAlloc = grpo::profile::CountingAlloc;

#[test]
fn new_buffers_are_counted_and_views_are_not() {
    let x = Tensor::randn(0f32, 1.0, (64, 64), &Device::Cpu).unwrap();
    let profiler = Profiler::start(&Device::Cpu).unwrap();
    {
        let _ops = phase("ops");
        let mut y = x.clone();
        for _ in 0..10 {
            y = y.exp().unwrap();
        }
        y = (y + &x).unwrap().sum_all().unwrap();
        drop(y);
    }
    {
        let _views = phase("views");
        for _ in 0..10 {
            let v = x.reshape((32, 128)).unwrap().narrow(0, 0, 4).unwrap().t().unwrap();
            assert_eq!(v.dims(), [128, 4]);
        }
    }
    let r = profiler.finish().report();
    let counts = |path: &str| r.phases.iter().find(|p| p.path == path).unwrap().self_counts;
    let (ops, views) = (counts("ops"), counts("views"));
    assert_eq!((ops.buffers, views.buffers), (12.0, 0.0), "{r:?}");
    assert!(ops.allocs >= 12.0 && ops.frees >= 12.0 && ops.alloc_bytes >= (11 * 64 * 64 * 4) as f64, "{ops:?}");
    assert!(r.counted.allocs.starts_with("host heap allocations"), "{:?}", r.counted);
    assert!(r.counted.buffers.starts_with("ops that produced a new tensor buffer"), "{:?}", r.counted);
}
