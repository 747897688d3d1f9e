//! What the compute device is and how much memory it holds: the name of the card and the peak of GPU
//! memory in use, for the benchmarks and the training metrics.
//!
//! candle allocates CUDA memory with `cuMemAllocAsync` from the device's default memory pool, so the
//! pool's high-water mark of used memory is the peak of every tensor alive at once (cuBLAS workspaces
//! and the CUDA context are outside it, as they are outside PyTorch's `max_memory_allocated`).

use candle_core::{Device, Result, Tensor};

mod names;
pub mod staging;
pub use names::{DTypeName, DeviceName, UnknownName};

/// A readable name: `cpu`, or the CUDA card's name (e.g. `NVIDIA H100 80GB HBM3`).
pub fn device_name(device: &Device) -> String {
    match device {
        Device::Cpu => "cpu".into(),
        #[cfg(feature = "cuda")]
        Device::Cuda(d) => d.cuda_stream().context().name().unwrap_or_else(|_| "cuda".into()),
        #[allow(unreachable_patterns)]
        _ => format!("{device:?}"),
    }
}

/// The most elements one tensor may have on a CUDA device. candle 0.11's CUDA backend sizes the grid of
/// its element-wise, cast, copy and indexing kernels with `LaunchConfig::for_num_elems(n as u32)`, and
/// those kernels index with `unsigned int`: past 2^32 - 1 elements the count wraps and a kernel silently
/// covers part of the tensor. The project's own kernels index in 64 bits; what goes through candle's
/// must stay within this.
pub const CUDA_MAX_ELEMENTS: usize = u32::MAX as usize;

/// An error naming `what` when a tensor of `elements` elements is more than candle's CUDA kernels can
/// index on `device` ([`CUDA_MAX_ELEMENTS`]); `hint` says how to make it smaller. Nothing on the CPU.
pub fn check_elements(device: &Device, what: &str, elements: usize, hint: &str) -> Result<()> {
    if device.is_cuda() {
        within_cuda_limit(what, elements, hint)
    } else {
        Ok(())
    }
}

fn within_cuda_limit(what: &str, elements: usize, hint: &str) -> Result<()> {
    if elements > CUDA_MAX_ELEMENTS {
        candle_core::bail!(
            "{what} would have {elements} elements, more than the {CUDA_MAX_ELEMENTS} (2^32 - 1) candle's CUDA \
             kernels index in 32 bits: {hint}"
        );
    }
    Ok(())
}

/// Set a freshly opened device up: on CUDA, let freed memory stay in the allocation pool for reuse
/// rather than going back to the driver at every synchronisation. (Whether the card can run this build's
/// kernels is checked by the kernels module, which knows their PTX target.)
pub fn prepare(device: &Device) -> Result<()> {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => cuda::keep_freed_memory(device),
        _ => Ok(()),
    }
}

/// The GPUs this process sees (CUDA_VISIBLE_DEVICES applied); 0 in a build without CUDA or without a
/// driver.
pub fn visible_gpus() -> usize {
    #[cfg(feature = "cuda")]
    {
        use candle_core::cuda_backend::cudarc::driver::CudaContext;
        CudaContext::device_count().map_or(0, |n| n.max(0) as usize)
    }
    #[cfg(not(feature = "cuda"))]
    0
}

/// Start a new peak: the high-water mark restarts from the memory in use now. `Ok(false)` where the
/// device has no such counter (the CPU).
pub fn reset_peak_memory(device: &Device) -> Result<bool> {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(_) if cuda::pooled(device)? => {
            device.synchronize()?;
            cuda::reset_high(device)?;
            Ok(true)
        }
        _ => Ok(false),
    }
}

/// Return the memory the device's pool holds but no tensor uses to the driver (on CUDA, after waiting for
/// the work queued): called where a phase with its own peak ends (validation's and the rollouts' KV
/// caches, before the training step), so that the peaks of phases do not add up in the pool. Nothing on
/// the CPU.
pub fn release_pool(device: &Device) -> Result<()> {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(_) if cuda::pooled(device)? => {
            device.synchronize()?;
            cuda::trim(device)
        }
        _ => Ok(()),
    }
}

/// `(in use now, peak since the last reset)` in bytes, on a CUDA device; `None` on the CPU (and where
/// the driver has no memory pools, so allocations bypass the counters).
pub fn memory_bytes(device: &Device) -> Result<Option<(u64, u64)>> {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(_) if cuda::pooled(device)? => {
            device.synchronize()?;
            Ok(Some(cuda::used_and_high(device)?))
        }
        _ => Ok(None),
    }
}

/// The device's total memory in bytes: the card's on CUDA, the machine's RAM (`MemTotal` of
/// /proc/meminfo) on the CPU; `None` where it cannot be read.
pub fn total_memory(device: &Device) -> Result<Option<u64>> {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(d) => Ok(Some(d.cuda_stream().context().total_mem().map_err(candle_core::Error::wrap)? as u64)),
        Device::Cpu => Ok(std::fs::read_to_string("/proc/meminfo").ok().as_deref().and_then(mem_total)),
        #[allow(unreachable_patterns)]
        _ => Ok(None),
    }
}

/// The free memory of a CUDA device in bytes (`cuMemGetInfo`), `None` on the CPU: what the log-prob
/// op sizes its chunks of logits from.
pub fn free_gpu_memory(device: &Device) -> Result<Option<u64>> {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(d) => {
            let (free, _) = d.cuda_stream().context().mem_get_info().map_err(candle_core::Error::wrap)?;
            Ok(Some(free as u64))
        }
        _ => Ok(None),
    }
}

thread_local! {
    static HOST_READS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    static COPIES: std::cell::Cell<Copies> = const { std::cell::Cell::new(Copies::ZERO) };
}

/// The copies between host memory and the model's device made so far by this thread, and their bytes:
/// counted where the project moves data ([`to_host`], [`from_host`], the offloaded optimiser's staging),
/// on every device (on the CPU the model's memory is host memory: the transfers a GPU run makes).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Copies {
    pub to_device: u64,
    pub to_device_bytes: u64,
    pub to_host: u64,
    pub to_host_bytes: u64,
}

impl Copies {
    const ZERO: Self = Self { to_device: 0, to_device_bytes: 0, to_host: 0, to_host_bytes: 0 };
}

/// The copies this thread has made so far ([`Copies`]).
pub fn copies() -> Copies {
    COPIES.with(std::cell::Cell::get)
}

/// Count a copy of `bytes` from host memory to the model's device.
pub fn count_to_device(bytes: usize) {
    COPIES.with(|c| {
        let v = c.get();
        c.set(Copies { to_device: v.to_device + 1, to_device_bytes: v.to_device_bytes + bytes as u64, ..v });
    });
}

/// Count a copy of `bytes` from the model's device to host memory.
pub fn count_to_host(bytes: usize) {
    COPIES.with(|c| {
        let v = c.get();
        c.set(Copies { to_host: v.to_host + 1, to_host_bytes: v.to_host_bytes + bytes as u64, ..v });
    });
}

/// The values of `t` (any shape, flattened) copied to the host. On a GPU a copy to the host waits for
/// everything queued before it (a host sync): the training step reads device values only through this
/// function and [`to_host_scalar`], which count each read ([`host_reads`]).
pub fn to_host<T: candle_core::WithDType>(t: &Tensor) -> Result<Vec<T>> {
    HOST_READS.with(|c| c.set(c.get() + 1));
    count_to_host(t.elem_count() * t.dtype().size_in_bytes());
    t.flatten_all()?.to_vec1::<T>()
}

/// A tensor of `shape` on `device` holding `data` from the host: a host-to-device copy, counted
/// ([`copies`]) on every device.
pub fn from_host<T: candle_core::WithDType, S: Into<candle_core::Shape>>(
    data: Vec<T>,
    shape: S,
    device: &Device,
) -> Result<Tensor> {
    count_to_device(std::mem::size_of_val(data.as_slice()));
    Tensor::from_vec(data, shape, device)
}

/// The value of a one-element tensor `t` copied to the host, counted as [`to_host`].
pub fn to_host_scalar<T: candle_core::WithDType>(t: &Tensor) -> Result<T> {
    match to_host::<T>(t)?.as_slice() {
        [x] => Ok(*x),
        v => candle_core::bail!("a scalar read of {} values", v.len()),
    }
}

/// Reads of device values to the host ([`to_host`]) made so far by this thread.
pub fn host_reads() -> u64 {
    HOST_READS.with(|c| c.get())
}

/// `MemTotal` of /proc/meminfo's text, in bytes.
fn mem_total(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::cuda_backend::cudarc::driver::sys;
    use candle_core::cuda_backend::cudarc::driver::sys::CUmemPool_attribute as Attr;
    use candle_core::{Device, Result};

    /// Whether candle's allocations go through the default pool (`cuMemAllocAsync`).
    pub fn pooled(device: &Device) -> Result<bool> {
        Ok(device.as_cuda_device()?.cuda_stream().context().has_async_alloc())
    }

    fn pool(device: &Device) -> Result<sys::CUmemoryPool> {
        let ctx = device.as_cuda_device()?.cuda_stream().context().clone();
        ctx.bind_to_thread().map_err(candle_core::Error::wrap)?;
        let mut pool = std::ptr::null_mut();
        // SAFETY: the context is bound; `pool` is a valid out pointer.
        let r = unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) };
        if r != sys::CUresult::CUDA_SUCCESS {
            candle_core::bail!("cuDeviceGetDefaultMemPool failed: {r:?}");
        }
        Ok(pool)
    }

    /// Read a u64 attribute of the default pool, or write it when `set` is given.
    fn attr(device: &Device, attr: Attr, set: Option<u64>) -> Result<u64> {
        let p = pool(device)?;
        let mut v = set.unwrap_or(0);
        let ptr = &mut v as *mut u64 as *mut std::ffi::c_void;
        // SAFETY: the attributes used here (USED_MEM_*, RELEASE_THRESHOLD) are cuuint64_t values.
        let r = unsafe {
            match set {
                Some(_) => sys::cuMemPoolSetAttribute(p, attr, ptr),
                None => sys::cuMemPoolGetAttribute(p, attr, ptr),
            }
        };
        if r != sys::CUresult::CUDA_SUCCESS {
            candle_core::bail!("memory pool attribute {attr:?}: {r:?}");
        }
        Ok(v)
    }

    /// Let the pool keep freed memory instead of returning it to the driver at every synchronisation
    /// (what PyTorch's caching allocator does too).
    pub fn keep_freed_memory(device: &Device) -> Result<()> {
        if pooled(device)? {
            attr(device, Attr::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, Some(u64::MAX))?;
        }
        Ok(())
    }

    pub fn used_and_high(device: &Device) -> Result<(u64, u64)> {
        let used = attr(device, Attr::CU_MEMPOOL_ATTR_USED_MEM_CURRENT, None)?;
        // A mark reset to zero stays there until the next allocation.
        let high = attr(device, Attr::CU_MEMPOOL_ATTR_USED_MEM_HIGH, None)?.max(used);
        Ok((used, high))
    }

    /// Release every byte of the default pool that no allocation uses.
    pub fn trim(device: &Device) -> Result<()> {
        let p = pool(device)?;
        // SAFETY: `p` is the device's default pool, valid while the context lives.
        let r = unsafe { sys::cuMemPoolTrimTo(p, 0) };
        if r != sys::CUresult::CUDA_SUCCESS {
            candle_core::bail!("cuMemPoolTrimTo failed: {r:?}");
        }
        Ok(())
    }

    /// Restart the high-water mark (it may only be set to zero).
    pub fn reset_high(device: &Device) -> Result<()> {
        attr(device, Attr::CU_MEMPOOL_ATTR_USED_MEM_HIGH, Some(0)).map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_has_a_name_and_no_memory_counter() {
        let d = Device::Cpu;
        assert_eq!(device_name(&d), "cpu");
        assert!(!reset_peak_memory(&d).unwrap());
        assert_eq!(memory_bytes(&d).unwrap(), None);
        release_pool(&d).unwrap();
        assert_eq!(mem_total("MemFree: 1 kB\nMemTotal:       16384 kB\n"), Some(16 << 20));
        assert_eq!(mem_total("nothing"), None);
    }

    #[test]
    fn copies_are_counted_with_their_bytes() {
        let before = copies();
        let x = from_host(vec![1f32, 2.0, 3.0], 3, &Device::Cpu).unwrap();
        assert_eq!(to_host::<f32>(&x).unwrap(), [1.0, 2.0, 3.0]);
        assert_eq!(to_host_scalar::<f32>(&x.sum_all().unwrap()).unwrap(), 6.0);
        let after = copies();
        let diff = (after.to_device - before.to_device, after.to_device_bytes - before.to_device_bytes);
        assert_eq!(diff, (1, 12));
        assert_eq!((after.to_host - before.to_host, after.to_host_bytes - before.to_host_bytes), (2, 16));
        assert_eq!(free_gpu_memory(&Device::Cpu).unwrap(), None);
    }

    #[test]
    fn tensors_past_2_pow_32_elements_are_refused_on_cuda_only() {
        // 16k tokens x a 152k vocabulary of logits: 2.5e9, within; two such rows: past it.
        assert!(within_cuda_limit("logits", 16_384 * 151_936, "").is_ok());
        assert!(within_cuda_limit("x", CUDA_MAX_ELEMENTS, "").is_ok());
        let err = within_cuda_limit("logits", 2 * 16_384 * 151_936, "use smaller chunks").unwrap_err().to_string();
        assert!(
            err.contains("logits would have 4978638848 elements") && err.contains("in 32 bits: use smaller chunks"),
            "{err}"
        );
        assert!(check_elements(&Device::Cpu, "logits", usize::MAX, "").is_ok());
    }
}
