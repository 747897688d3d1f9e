//! The [`Collective`] of NCCL (loaded at run time by `nccl_sys`) for ranks that each drive one GPU: ncclAllReduce,
//! ncclReduceScatter and ncclAllGather on the rank's GPU (the host buffers of the shared code are copied
//! in and out). Byte strings of different lengths are gathered as blocks padded to the longest, after an
//! all-reduce of the lengths. Every wait is bounded: the rank polls the collective's completion and NCCL's asynchronous
//! error (`ncclCommGetAsyncError`), and past `timeout` or on an error it aborts the communicator and
//! exits, naming itself and the cause; the other ranks' collectives then fail or time out the same way.

use std::ffi::{c_char, c_void};
use std::mem::MaybeUninit;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, ValidAsZeroBits};

use super::nccl_sys::{self as sys, DataType, NcclError, RedOp};
use super::{Collective, DistError};

/// The length of NCCL's unique id, which rank 0 makes and every rank needs to join.
pub(super) const ID_BYTES: usize = sys::ID_BYTES;

/// Load NCCL (every rank, before the id is shared): without libnccl a run on several GPUs stops here.
pub(super) fn load() -> Result<(), DistError> {
    sys::load().map_err(|e| DistError::Launch(e.to_string()))
}

/// A new NCCL unique id (rank 0).
pub(super) fn new_id() -> Result<[u8; ID_BYTES], DistError> {
    let id = sys::get_unique_id().map_err(|e| DistError::Launch(e.to_string()))?;
    Ok(id.internal.map(|c| c as u8))
}

/// One rank's NCCL communicator on its GPU.
pub(super) struct Nccl {
    comm: sys::Comm,
    stream: Arc<CudaStream>,
    rank: usize,
    size: usize,
    timeout: Duration,
    /// What must live as long as the communicator (MPI, when it carried the id).
    _keep: Option<Box<dyn std::any::Any>>,
}

/// The element types the collectives carry.
trait Element: DeviceRepr + ValidAsZeroBits + Copy {
    const TYPE: DataType;
}

impl Element for f32 {
    const TYPE: DataType = DataType::FLOAT32;
}

impl Element for u8 {
    const TYPE: DataType = DataType::UINT8;
}

impl Element for f64 {
    const TYPE: DataType = DataType::FLOAT64;
}

impl Nccl {
    /// Join the communicator of `size` ranks as rank `rank`, on GPU `ordinal`. Once the GPU is set up (or
    /// failed), `ready` tells the other ranks and returns the id of the communicator (and what must live as
    /// long as it) when every rank is ready: ncclCommInitRank, which waits for all, is called only then.
    pub(super) fn init(
        ordinal: usize,
        rank: usize,
        size: usize,
        timeout: Duration,
        ready: impl FnOnce(Result<(), String>) -> Result<([u8; ID_BYTES], Option<Box<dyn std::any::Any>>), DistError>,
    ) -> Result<Self, DistError> {
        let launch = |what: &str, e: String| DistError::Launch(format!("rank {rank}: {what}: {e}"));
        let device = CudaContext::new(ordinal)
            .map_err(|e| launch(&format!("CUDA device {ordinal}"), e.to_string()))
            .and_then(|ctx| ctx.new_stream().map_err(|e| launch("a CUDA stream", e.to_string())));
        let (id, keep) = ready(device.as_ref().map(|_| ()).map_err(|e| e.to_string()))?;
        let stream = device?;
        let id = sys::UniqueId { internal: id.map(|b| b as c_char) };
        let mut comm = MaybeUninit::uninit();
        // Every rank is ready, but one can still die inside ncclCommInitRank, which would then wait for it
        // with no bound: past `timeout` this rank says so and exits.
        let deadline = super::ready::Deadline::start(timeout, move || {
            eprintln!(
                "error: rank {rank}: joining the NCCL communicator of {size} ranks (ncclCommInitRank) did not finish \
                 within {timeout:?}: a rank stopped or hangs in it (GRPO_DIST_TIMEOUT_S sets the limit); stopping"
            );
            std::process::exit(1)
        });
        // SAFETY: `comm` is written by ncclCommInitRank before it is read.
        let comm = unsafe {
            sys::comm_init_rank(comm.as_mut_ptr(), size as i32, id, rank as i32)
                .map_err(|e| DistError::Launch(format!("rank {rank}: {e}")))?;
            comm.assume_init()
        };
        deadline.met();
        Ok(Self { comm, stream, rank, size, timeout, _keep: keep })
    }

    /// End this rank after a failed or stuck collective: abort the communicator (so that no collective of
    /// this process waits on), say why, and exit.
    fn fail(&self, message: String) -> ! {
        eprintln!("error: rank {}: {message}; stopping every rank", self.rank);
        // SAFETY: the communicator is valid until this process exits.
        let _ = unsafe { sys::comm_abort(self.comm) };
        std::process::exit(1)
    }

    /// Wait for the work queued on the stream, polling NCCL's asynchronous error, at most `timeout`.
    fn wait(&self, what: &str) -> Result<(), String> {
        let done = self.stream.record_event(None).map_err(|e| format!("{what}: {e}"))?;
        let deadline = Instant::now() + self.timeout;
        loop {
            if done.try_is_complete().map_err(|e| format!("{what}: {e}"))? {
                return Ok(());
            }
            // SAFETY: a valid communicator.
            if let Err(error) = unsafe { sys::comm_get_async_error(self.comm) } {
                return Err(format!("{what}: NCCL reports {error} (another rank failed or the network broke)"));
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "{what} did not finish within {:?} (a rank stopped or hangs; GRPO_DIST_TIMEOUT_S sets the limit)",
                    self.timeout
                ));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// Copy `send` to the GPU, run the collective `op` (send and receive device pointers), wait for it and
    /// copy the result into `recv`.
    fn run<T: Element>(
        &self,
        what: &str,
        send: &[T],
        recv: &mut [T],
        op: impl FnOnce(*const c_void, *mut c_void) -> Result<(), NcclError>,
    ) {
        let outcome = (|| -> Result<(), String> {
            let dsend = self.stream.clone_htod(send).map_err(|e| e.to_string())?;
            let mut drecv = self.stream.alloc_zeros::<T>(recv.len()).map_err(|e| e.to_string())?;
            {
                let (s, _s) = dsend.device_ptr(&self.stream);
                let (r, _r) = drecv.device_ptr_mut(&self.stream);
                op(s as *const c_void, r as *mut c_void).map_err(|e| e.to_string())?;
            }
            self.wait(what)?;
            self.stream.memcpy_dtoh(&drecv, recv).map_err(|e| e.to_string())
        })();
        if let Err(message) = outcome {
            self.fail(message);
        }
    }

    fn all_reduce<T: Element>(&self, buf: &mut [T], op: RedOp) {
        let send = buf.to_vec();
        let (comm, stream) = (self.comm, self.stream.cu_stream());
        // SAFETY: device buffers of `send.len()` elements of T, valid during the call and the wait.
        self.run("ncclAllReduce", &send, buf, |s, r| unsafe {
            sys::all_reduce(s, r, send.len(), T::TYPE, op, comm, stream as _)
        });
    }
}

impl Collective for Nccl {
    fn sum_f32(&self, buf: &mut [f32]) {
        self.all_reduce(buf, RedOp::SUM);
    }

    fn sum_f64(&self, buf: &mut [f64]) {
        self.all_reduce(buf, RedOp::SUM);
    }

    fn max_f64(&self, buf: &mut [f64]) {
        self.all_reduce(buf, RedOp::MAX);
    }

    fn reduce_scatter_sum_f32(&self, send: &[f32], recv: &mut [f32]) {
        let (comm, stream, n) = (self.comm, self.stream.cu_stream(), recv.len());
        // SAFETY: a send buffer of N * n and a receive buffer of n f32 on the device, valid during the call.
        self.run("ncclReduceScatter", send, recv, |s, r| unsafe {
            sys::reduce_scatter(s, r, n, f32::TYPE, RedOp::SUM, comm, stream as _)
        });
    }

    fn all_gather_f32(&self, send: &[f32], recv: &mut [f32]) {
        let (comm, stream, n) = (self.comm, self.stream.cu_stream(), send.len());
        // SAFETY: a send buffer of n and a receive buffer of N * n f32 on the device, valid during the call.
        self.run("ncclAllGather", send, recv, |s, r| unsafe { sys::all_gather(s, r, n, f32::TYPE, comm, stream as _) });
    }

    fn all_gather_bytes(&self, send: &[u8]) -> Vec<Vec<u8>> {
        // Each rank's length in its slot (exact in f64 below 2^53), then blocks padded to the longest.
        let size = self.size;
        let mut lengths = vec![0f64; size];
        lengths[self.rank] = send.len() as f64;
        self.sum_f64(&mut lengths);
        let lengths: Vec<usize> = lengths.iter().map(|&l| l as usize).collect();
        let block = lengths.iter().copied().max().unwrap_or(0).max(1);
        let mut padded = send.to_vec();
        padded.resize(block, 0);
        let mut all = vec![0u8; block * size];
        let (comm, stream) = (self.comm, self.stream.cu_stream());
        // SAFETY: a send buffer of `block` and a receive buffer of N * `block` bytes on the device.
        self.run("ncclAllGather", &padded, &mut all, |s, r| unsafe {
            sys::all_gather(s, r, block, u8::TYPE, comm, stream as _)
        });
        all.chunks(block).zip(lengths).map(|(b, n)| b[..n].to_vec()).collect()
    }

    fn barrier(&self) {
        // NCCL has no barrier: a one-value all-reduce waits for every rank.
        self.sum_f32(&mut [0.0]);
    }

    fn abort(&self, code: i32) -> ! {
        // SAFETY: the communicator is valid until this process exits.
        let _ = unsafe { sys::comm_abort(self.comm) };
        std::process::exit(code)
    }
}

impl Drop for Nccl {
    fn drop(&mut self) {
        // SAFETY: the communicator is destroyed once, after its last use.
        let _ = unsafe { sys::comm_destroy(self.comm) };
    }
}
