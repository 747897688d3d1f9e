//! The offloaded update's traffic (`optim.offload`): the f32 gradients go down to host memory and the new
//! weights, in the model's dtype, come back up, in chunks (`optim.offload_chunk_mb`, [`crate::device::staging::DEFAULT_CHUNK_MB`]) through
//! two staging slots used in turn. On a GPU the slots are page-locked host memory and the copies are
//! asynchronous on the device's stream, so while the host updates one chunk the copy engine brings down
//! the next chunk's gradients and takes up the last chunk's weights: a step's offloaded update costs the
//! host's update plus one chunk's copies, not the sum of all copies and the update. The weights are
//! written into the parameters' own device buffers (no new tensor, no device-to-device copy).
//!
//! A parameter larger than a chunk is split over chunks: the update is element-wise, so a range of a
//! parameter is updated as the whole would be (the tests compare the offloaded update bit for bit with
//! the update on the parameters' device).

use candle_core::{CpuStorage, DType, Device, InplaceOp1, Layout, Result, Tensor, Var, WithDType};
use half::{bf16, f16};

/// `len` elements of parameter `param` from element `start`, at element `at` of its chunk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Piece {
    pub param: usize,
    pub start: usize,
    pub len: usize,
    pub at: usize,
}

/// Parameters of `sizes` elements, in that order, cut into consecutive chunks of at most `chunk` elements
/// (every chunk full but the last); a parameter larger than what is left of a chunk goes on in the next.
pub fn chunks(sizes: &[usize], chunk: usize) -> Vec<Vec<Piece>> {
    let chunk = chunk.max(1);
    let (mut out, mut current, mut used) = (Vec::new(), Vec::new(), 0);
    for (param, &size) in sizes.iter().enumerate() {
        let mut start = 0;
        while start < size {
            let len = (size - start).min(chunk - used);
            current.push(Piece { param, start, len, at: used });
            (start, used) = (start + len, used + len);
            if used == chunk {
                out.push(std::mem::take(&mut current));
                used = 0;
            }
        }
    }
    if !current.is_empty() {
        out.push(current);
    }
    out
}

/// An element type candle's CUDA storage holds (none to ask for without the `cuda` feature).
#[cfg(feature = "cuda")]
pub trait DeviceElement: candle_core::cuda_backend::CudaDType {}
#[cfg(feature = "cuda")]
impl<T: candle_core::cuda_backend::CudaDType> DeviceElement for T {}
#[cfg(not(feature = "cuda"))]
pub trait DeviceElement {}
#[cfg(not(feature = "cuda"))]
impl<T> DeviceElement for T {}

/// A dtype the weights are staged in: its slice of a host storage, and the rounding of an f32 master
/// weight to it (to nearest even, as candle's conversion rounds).
pub trait Staged: WithDType + DeviceElement {
    fn slice_mut(s: &mut CpuStorage) -> Option<&mut [Self]>;
    fn from_master(x: f32) -> Self;
}

macro_rules! staged {
    ($t:ty, $variant:ident, $from:expr) => {
        impl Staged for $t {
            fn slice_mut(s: &mut CpuStorage) -> Option<&mut [Self]> {
                match s {
                    CpuStorage::$variant(v) => Some(v),
                    _ => None,
                }
            }
            fn from_master(x: f32) -> Self {
                $from(x)
            }
        }
    };
}
staged!(f32, F32, std::convert::identity);
staged!(bf16, BF16, bf16::from_f32);
staged!(f16, F16, f16::from_f32);

/// One slot's buffers: `len` f32 gradients and `len` weights (of at most four bytes each, in the same
/// number of f32-sized words), in host memory or page-locked on the GPU's host.
struct Slot {
    grads: *mut f32,
    weights: *mut f32,
    len: usize,
    backing: Backing,
}

/// The memory a slot's pointers point into, owned by the slot.
enum Backing {
    Host {
        _grads: Vec<f32>,
        _weights: Vec<f32>,
    },
    #[cfg(feature = "cuda")]
    Pinned(pinned::Buffers),
}

// SAFETY: the raw pointers point into the slot's own `backing`, which it owns and moves with it.
unsafe impl Send for Slot {}

impl Slot {
    fn new(device: &Device, len: usize) -> Result<Self> {
        let (grads, weights, backing) = match device {
            Device::Cpu => {
                let (mut g, mut w) = (vec![0f32; len], vec![0f32; len]);
                (g.as_mut_ptr(), w.as_mut_ptr(), Backing::Host { _grads: g, _weights: w })
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(d) => {
                let b = pinned::Buffers::new(d, len)?;
                (b.grads_ptr(), b.weights_ptr(), Backing::Pinned(b))
            }
            d => candle_core::bail!("the offloaded update has no staging on {d:?}"),
        };
        Ok(Self { grads, weights, len, backing })
    }

    /// Wait for the copies issued on this slot (none on the host).
    fn wait(&mut self) -> Result<()> {
        match &mut self.backing {
            Backing::Host { .. } => Ok(()),
            #[cfg(feature = "cuda")]
            Backing::Pinned(b) => b.wait(),
        }
    }
}

/// The two slots a step's chunks go through in turn, kept from step to step (page-locking memory is
/// slow), for one device and one weight dtype.
pub struct Staging {
    slots: [Slot; 2],
    device: Device,
    dtype: DType,
}

impl Staging {
    /// Staging for chunks of `len` elements of gradients of `device`'s parameters of `dtype`.
    pub fn new(device: &Device, dtype: DType, len: usize) -> Result<Self> {
        if dtype.size_in_bytes() > 4 {
            candle_core::bail!("the offloaded update stages weights of at most 4 bytes, not {dtype:?}");
        }
        Ok(Self { slots: [Slot::new(device, len)?, Slot::new(device, len)?], device: device.clone(), dtype })
    }

    /// Whether these slots serve `device`'s parameters of `dtype` in chunks of `len`.
    pub fn serves(&self, device: &Device, dtype: DType, len: usize) -> bool {
        self.device.same_device(device) && self.dtype == dtype && self.slots[0].len >= len
    }

    /// Start copying the gradients of `chunk` (`grads[piece.param]`, f32) into slot `s`: on a GPU the
    /// copies are queued behind the device's work and this returns at once.
    ///
    /// The slot's gradients must have been read already (its [`Staging::slot`] returned and the host is
    /// done with them) or never written; its weights may still be on their way up: the new copies queue
    /// behind them on the same stream, and the event recorded after them covers both, so the next
    /// [`Staging::slot`] waits for the upload too, and the host never blocks here.
    pub fn download(&mut self, s: usize, chunk: &[Piece], grads: &[&Tensor]) -> Result<()> {
        let slot = &mut self.slots[s % 2];
        for p in chunk {
            let g = grads[p.param];
            if g.dtype() != DType::F32 {
                candle_core::bail!("the offloaded update takes f32 gradients, not {:?}", g.dtype());
            }
            if p.at + p.len > slot.len {
                candle_core::bail!("a chunk of {} elements in a slot of {}", p.at + p.len, slot.len);
            }
            // SAFETY: no copy into the slot's gradients is pending (the last one was waited for by
            // `slot`), the host no longer reads them (the caller's contract), and `at + len` is inside the
            // buffer.
            let dst = unsafe { std::slice::from_raw_parts_mut(slot.grads.add(p.at), p.len) };
            let (storage, layout) = g.storage_and_layout();
            let Some((a, b)) = layout.contiguous_offsets() else {
                candle_core::bail!("the offloaded update takes contiguous gradients")
            };
            if p.start + p.len > b - a {
                candle_core::bail!("elements {}..{} of a gradient of {}", p.start, p.start + p.len, b - a);
            }
            match &*storage {
                candle_core::Storage::Cpu(c) => {
                    parallel_copy(&f32::cpu_storage_as_slice(c)?[a + p.start..a + p.start + p.len], dst)
                }
                #[cfg(feature = "cuda")]
                candle_core::Storage::Cuda(c) => pinned::download(c, a + p.start, dst)?,
                _ => candle_core::bail!("the offloaded update has no staging on {:?}", g.device()),
            }
            crate::device::count_to_host(p.len * 4);
        }
        self.record(s)
    }

    /// Slot `s` once its copies are done: the gradients downloaded into it, and its weights as `T`
    /// (to be written by the host before [`Staging::upload`]).
    pub fn slot<T: Staged>(&mut self, s: usize) -> Result<(&[f32], &mut [T])> {
        if T::DTYPE != self.dtype {
            candle_core::bail!("weights staged as {:?}, written as {:?}", self.dtype, T::DTYPE);
        }
        let slot = &mut self.slots[s % 2];
        slot.wait()?;
        let n = slot.len * 4 / T::DTYPE.size_in_bytes();
        // SAFETY: both buffers hold `len` f32 words, owned by the slot, whose copies are done (waited
        // above); `T` is at most four bytes, aligned to at most four.
        Ok(unsafe {
            (
                std::slice::from_raw_parts(slot.grads, slot.len),
                std::slice::from_raw_parts_mut(slot.weights as *mut T, n),
            )
        })
    }

    /// Start copying the weights of `chunk` from slot `s` into `vars[piece.param]` (in place).
    pub fn upload<T: Staged>(&mut self, s: usize, chunk: &[Piece], vars: &[&Var]) -> Result<()> {
        let slot = &self.slots[s % 2];
        for p in chunk {
            // SAFETY: the host wrote these weights before this call and no copy writes them.
            let src = unsafe { std::slice::from_raw_parts((slot.weights as *const T).add(p.at), p.len) };
            vars[p.param].as_tensor().inplace_op1(&WriteRange { start: p.start, src })?;
            crate::device::count_to_device(p.len * T::DTYPE.size_in_bytes());
        }
        self.record(s)
    }

    /// Wait for every copy issued (the weights are in place on the device's stream already; this frees
    /// the slots for the host).
    pub fn finish(&mut self) -> Result<()> {
        self.slots.iter_mut().try_for_each(Slot::wait)
    }

    /// Mark the copies issued so far on slot `s` as what it waits for.
    fn record(&mut self, s: usize) -> Result<()> {
        match &mut self.slots[s % 2].backing {
            Backing::Host { .. } => Ok(()),
            #[cfg(feature = "cuda")]
            Backing::Pinned(b) => b.record(),
        }
    }
}

/// `src` copied into `dst` (of the same length) on all the host's threads.
fn parallel_copy<T: Copy + Send + Sync>(src: &[T], dst: &mut [T]) {
    use rayon::prelude::*;
    const BLOCK: usize = 1 << 16;
    dst.par_chunks_mut(BLOCK).zip(src.par_chunks(BLOCK)).for_each(|(d, s)| d.copy_from_slice(s));
}

/// Writes `src` into a contiguous tensor from its element `start` on, in place.
struct WriteRange<'a, T> {
    start: usize,
    src: &'a [T],
}

impl<T> WriteRange<'_, T> {
    /// The written range of a storage laid out as `l`.
    fn range(&self, l: &Layout) -> Result<std::ops::Range<usize>> {
        let Some((a, b)) = l.contiguous_offsets() else {
            candle_core::bail!("weights written in place must be contiguous")
        };
        let (from, to) = (a + self.start, a + self.start + self.src.len());
        if to > b {
            candle_core::bail!("elements {}..{} written into a tensor of {}", self.start, to - a, b - a);
        }
        Ok(from..to)
    }
}

impl<T: Staged> InplaceOp1 for WriteRange<'_, T> {
    fn name(&self) -> &'static str {
        "write-range"
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> Result<()> {
        let range = self.range(l)?;
        let dtype = candle_core::backend::BackendStorage::dtype(s);
        let Some(dst) = T::slice_mut(s) else { candle_core::bail!("weights of {dtype:?} written as {:?}", T::DTYPE) };
        parallel_copy(self.src, &mut dst[range]);
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &mut candle_core::CudaStorage, l: &Layout) -> Result<()> {
        pinned::upload(s, self.range(l)?.start, self.src)
    }
}

#[cfg(feature = "cuda")]
mod pinned {
    use std::sync::Arc;

    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{
        result, sys, CudaEvent, CudaSlice, DevicePtr, DevicePtrMut, PinnedHostSlice,
    };
    use candle_core::cuda_backend::{CudaDType, CudaDevice, WrapErr};
    use candle_core::{CudaStorage, Result};

    /// A slot's page-locked buffers and the event of the last copies queued on them. The gradients'
    /// buffer is cached (the host reads it); the weights' is write-combined (the host only writes it,
    /// and the device reads it faster over PCIe).
    pub struct Buffers {
        /// The page-locked memory `grads_ptr` and `weights_ptr` point into, owned here.
        _grads: PinnedHostSlice<f32>,
        _weights: PinnedHostSlice<f32>,
        grads_ptr: *mut f32,
        weights_ptr: *mut f32,
        stream: Arc<candle_core::cuda_backend::cudarc::driver::CudaStream>,
        pending: Option<CudaEvent>,
    }

    impl Buffers {
        pub fn new(dev: &CudaDevice, len: usize) -> Result<Self> {
            let stream = dev.cuda_stream();
            let ctx = stream.context().clone();
            let failed = |e| {
                candle_core::Error::Msg(format!(
                    "page-locking {} MiB of host memory for the offloaded update's staging (optim.offload_chunk_mb \
                     sets its size): {e}",
                    (len * 4) >> 20
                ))
            };
            // SAFETY: the buffers are written (by a copy or the host) before they are read.
            let (grads, weights) = unsafe {
                (
                    ctx.alloc_pinned_with_flags::<f32>(len, 0).map_err(failed)?,
                    ctx.alloc_pinned_with_flags::<f32>(len, sys::CU_MEMHOSTALLOC_WRITECOMBINED).map_err(failed)?,
                )
            };
            let (grads_ptr, weights_ptr) = (grads.as_ptr().w()? as *mut f32, weights.as_ptr().w()? as *mut f32);
            Ok(Self { _grads: grads, _weights: weights, grads_ptr, weights_ptr, stream, pending: None })
        }

        pub fn grads_ptr(&self) -> *mut f32 {
            self.grads_ptr
        }

        pub fn weights_ptr(&self) -> *mut f32 {
            self.weights_ptr
        }

        /// Mark what the stream has queued so far as this slot's copies.
        pub fn record(&mut self) -> Result<()> {
            let flags = Some(sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC);
            self.pending = Some(self.stream.record_event(flags).w()?);
            Ok(())
        }

        /// Wait for this slot's copies.
        pub fn wait(&mut self) -> Result<()> {
            if let Some(e) = self.pending.take() {
                e.synchronize().w()?;
            }
            Ok(())
        }
    }

    impl Drop for Buffers {
        /// The page-locked memory is freed only once no copy can still use it: after an error, copies
        /// may be queued without an event to wait for.
        fn drop(&mut self) {
            let _ = self.stream.synchronize();
        }
    }

    /// Queue the copy of f32 elements `from..from + dst.len()` of `s` into `dst` (page-locked).
    pub fn download(s: &CudaStorage, from: usize, dst: &mut [f32]) -> Result<()> {
        let stream = s.device().cuda_stream();
        stream.context().bind_to_thread().w()?;
        let src: &CudaSlice<f32> = s.as_cuda_slice()?;
        let (ptr, _guard) = src.device_ptr(&stream);
        // SAFETY: `dst` is page-locked and is neither read nor written by the host until the slot's event
        // (recorded after this copy) has completed; the source range is inside the gradient's buffer.
        unsafe { result::memcpy_dtoh_async(dst, ptr + (from * 4) as u64, stream.cu_stream()) }.w()
    }

    /// Queue the copy of `src` (page-locked) into elements `from..from + src.len()` of `s`.
    pub fn upload<T: CudaDType>(s: &mut CudaStorage, from: usize, src: &[T]) -> Result<()> {
        let stream = s.device().cuda_stream();
        stream.context().bind_to_thread().w()?;
        let dst: &mut CudaSlice<T> = s.as_cuda_slice_mut()?;
        let (ptr, _guard) = dst.device_ptr_mut(&stream);
        let at = ptr + (from * std::mem::size_of::<T>()) as u64;
        // SAFETY: `src` is page-locked and not written by the host until the slot's event (recorded after
        // this copy) has completed; the destination range was checked against the tensor's layout.
        unsafe { result::memcpy_htod_async(at, src, stream.cu_stream()) }.w()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_every_element_once_in_order() {
        let sizes = [5, 1, 12, 3];
        let out = chunks(&sizes, 4);
        assert!(out.iter().all(|c| c.iter().map(|p| p.len).sum::<usize>() <= 4));
        assert!(out[..out.len() - 1].iter().all(|c| c.iter().map(|p| p.len).sum::<usize>() == 4));
        let mut next = vec![0; sizes.len()];
        for c in &out {
            let mut at = 0;
            for p in c {
                assert_eq!((p.start, p.at), (next[p.param], at), "{out:?}");
                (next[p.param], at) = (p.start + p.len, at + p.len);
            }
        }
        assert_eq!(next, sizes);
        assert_eq!(out.len(), 6);
        assert_eq!(
            chunks(&[3, 0, 2], 10),
            vec![vec![Piece { param: 0, start: 0, len: 3, at: 0 }, Piece { param: 2, start: 0, len: 2, at: 3 }]]
        );
        assert!(chunks(&[], 10).is_empty());
    }

    #[test]
    fn a_range_is_written_in_place_and_out_of_range_is_an_error() {
        let var = Var::from_tensor(&Tensor::zeros((2, 3), DType::BF16, &Device::Cpu).unwrap()).unwrap();
        let src = [bf16::from_f32(1.5), bf16::from_f32(-2.0)];
        var.as_tensor().inplace_op1(&WriteRange { start: 2, src: &src }).unwrap();
        let got: Vec<f32> = var.as_tensor().flatten_all().unwrap().to_dtype(DType::F32).unwrap().to_vec1().unwrap();
        assert_eq!(got, [0.0, 0.0, 1.5, -2.0, 0.0, 0.0]);
        let err = var.as_tensor().inplace_op1(&WriteRange { start: 5, src: &src }).unwrap_err();
        assert!(err.to_string().contains("elements 5..7 written into a tensor of 6"), "{err}");
        let err = var.as_tensor().inplace_op1(&WriteRange { start: 0, src: &[1f32] }).unwrap_err();
        assert!(err.to_string().contains("written as F32"), "{err}");
    }
}
