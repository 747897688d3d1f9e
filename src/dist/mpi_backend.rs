//! The [`Collective`] of MPI (rsmpi over Open MPI): MPI_Allreduce, MPI_Reduce_scatter_block, MPI_Allgather,
//! MPI_Allgatherv, MPI_Barrier, MPI_Abort. Every collective is bounded as NCCL's are: a watchdog ends every
//! rank (MPI_Abort), naming this one and the collective, when one has not finished within
//! GRPO_DIST_TIMEOUT_S ([`super::collective_timeout`]).

use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mpi::collective::SystemOperation;
use mpi::datatype::PartitionMut;
use mpi::environment::Universe;
use mpi::topology::{Color, SimpleCommunicator};
use mpi::traits::*;

use super::{Collective, DistError};

/// MPI, initialised once for the process and finalised when the last communicator is dropped: the world's,
/// or a group's ([`Collective::split`]).
pub(super) struct Mpi {
    // Declared before the universe: dropped first.
    world: SimpleCommunicator,
    universe: Rc<Universe>,
    watch: Arc<Watch>,
    rank: usize,
}

/// What the watchdog sees: when the collective in flight began (milliseconds since `origin`, plus one; 0
/// when none is), which one it is, and whether MPI was finalised.
struct Watch {
    origin: Instant,
    since: AtomicU64,
    what: std::sync::Mutex<&'static str>,
    closed: AtomicBool,
}

impl Watch {
    /// Watch collectives of rank `rank`: a thread that ends every rank once one has lasted `timeout`.
    fn start(rank: usize, timeout: Duration) -> Arc<Self> {
        let watch = Arc::new(Self {
            origin: Instant::now(),
            since: AtomicU64::new(0),
            what: std::sync::Mutex::new(""),
            closed: AtomicBool::new(false),
        });
        let w = watch.clone();
        let poll = (timeout / 10).clamp(Duration::from_millis(10), Duration::from_secs(1));
        std::thread::spawn(move || loop {
            std::thread::sleep(poll);
            if w.closed.load(Ordering::SeqCst) {
                return;
            }
            let since = w.since.load(Ordering::SeqCst);
            if since > 0 && w.origin.elapsed().as_millis() as u64 + 1 >= since + timeout.as_millis() as u64 {
                let what = *w.what.lock().unwrap_or_else(|e| e.into_inner());
                eprintln!(
                    "error: rank {rank}: {what} did not finish within {timeout:?} (a rank stopped or hangs; \
                     GRPO_DIST_TIMEOUT_S sets the limit); stopping every rank"
                );
                // SAFETY: MPI is initialised (not yet finalised: `closed` is unset) and the world communicator
                // exists for the whole job.
                unsafe { mpi::ffi::MPI_Abort(mpi::ffi::RSMPI_COMM_WORLD, 1) };
                std::process::exit(1);
            }
        });
        watch
    }

    /// Run the collective `what` (`f`) under the watchdog.
    fn run<T>(&self, what: &'static str, f: impl FnOnce() -> T) -> T {
        *self.what.lock().unwrap_or_else(|e| e.into_inner()) = what;
        self.since.store(self.origin.elapsed().as_millis() as u64 + 1, Ordering::SeqCst);
        let out = f();
        self.since.store(0, Ordering::SeqCst);
        out
    }
}

impl Drop for Mpi {
    fn drop(&mut self) {
        self.watch.closed.store(true, Ordering::SeqCst);
    }
}

impl Mpi {
    /// Initialise MPI: the communicator, this process's rank and the world size.
    pub(super) fn init() -> Result<(Self, usize, usize), DistError> {
        let universe =
            mpi::initialize().ok_or_else(|| DistError::Launch("MPI was already initialised in this process".into()))?;
        let world = universe.world();
        let (rank, size) = (world.rank() as usize, world.size() as usize);
        let watch = Watch::start(rank, super::collective_timeout());
        Ok((Self { world, universe: Rc::new(universe), watch, rank }, rank, size))
    }
}

impl Collective for Mpi {
    fn sum_f32(&self, buf: &mut [f32]) {
        let send = buf.to_vec();
        self.watch.run("MPI_Allreduce", || self.world.all_reduce_into(&send[..], buf, SystemOperation::sum()));
    }

    fn sum_f64(&self, buf: &mut [f64]) {
        let send = buf.to_vec();
        self.watch.run("MPI_Allreduce", || self.world.all_reduce_into(&send[..], buf, SystemOperation::sum()));
    }

    fn max_f64(&self, buf: &mut [f64]) {
        let send = buf.to_vec();
        self.watch.run("MPI_Allreduce", || self.world.all_reduce_into(&send[..], buf, SystemOperation::max()));
    }

    fn reduce_scatter_sum_f32(&self, send: &[f32], recv: &mut [f32]) {
        self.watch.run("MPI_Reduce_scatter_block", || {
            self.world.reduce_scatter_block_into(send, recv, SystemOperation::sum())
        });
    }

    fn all_gather_f32(&self, send: &[f32], recv: &mut [f32]) {
        self.watch.run("MPI_Allgather", || self.world.all_gather_into(send, recv));
    }

    fn all_gather_bytes(&self, send: &[u8]) -> Vec<Vec<u8>> {
        let count = mpi::Count::try_from(send.len()).expect("an all-gather sends under 2 GiB from a rank");
        let mut counts = vec![0 as mpi::Count; self.world.size() as usize];
        self.watch.run("MPI_Allgather", || self.world.all_gather_into(&count, &mut counts[..]));
        let sizes: Vec<usize> = counts.iter().map(|&c| c as usize).collect();
        let total = mpi::Count::try_from(sizes.iter().sum::<usize>()).expect("an all-gather receives under 2 GiB");
        let displs: Vec<mpi::Count> = counts.iter().scan(0, |at, &c| Some(std::mem::replace(at, *at + c))).collect();
        let mut all = vec![0u8; total as usize];
        let mut parts = PartitionMut::new(&mut all[..], &counts[..], &displs[..]);
        self.watch.run("MPI_Allgatherv", || self.world.all_gather_varcount_into(send, &mut parts));
        let mut rest = &all[..];
        sizes
            .iter()
            .map(|&n| {
                let (part, tail) = rest.split_at(n);
                rest = tail;
                part.to_vec()
            })
            .collect()
    }

    fn barrier(&self) {
        self.watch.run("MPI_Barrier", || self.world.barrier());
    }

    fn abort(&self, code: i32) -> ! {
        self.world.abort(code)
    }

    fn send_bytes(&self, to: usize, data: &[u8]) -> Result<(), DistError> {
        let to = i32::try_from(to).map_err(|_| DistError::Launch(format!("no rank {to}")))?;
        self.world.process_at_rank(to).send(data);
        Ok(())
    }

    fn recv_bytes(&self, from: usize) -> Result<Vec<u8>, DistError> {
        let from = i32::try_from(from).map_err(|_| DistError::Launch(format!("no rank {from}")))?;
        Ok(self.world.process_at_rank(from).receive_vec::<u8>().0)
    }

    fn split(&self, color: usize) -> Result<Box<dyn Collective>, DistError> {
        let value = i32::try_from(color).map_err(|_| DistError::Launch(format!("group colour {color}")))?;
        let comm = self.watch.run("MPI_Comm_split", || self.world.split_by_color(Color::with_value(value)));
        let comm =
            comm.ok_or_else(|| DistError::Launch(format!("rank {}: MPI_Comm_split gave no group", self.rank)))?;
        let watch = Watch::start(self.rank, super::collective_timeout());
        Ok(Box::new(Mpi { world: comm, universe: self.universe.clone(), watch, rank: self.rank }))
    }
}
