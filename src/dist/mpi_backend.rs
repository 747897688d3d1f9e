//! The [`Collective`] of MPI (rsmpi over Open MPI): MPI_Allreduce, MPI_Reduce_scatter_block, MPI_Allgather,
//! MPI_Allgatherv, MPI_Barrier, MPI_Abort.

use mpi::collective::SystemOperation;
use mpi::datatype::PartitionMut;
use mpi::environment::Universe;
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;

use super::{Collective, DistError};

/// MPI, initialised once for the process; finalised when dropped.
pub(super) struct Mpi {
    // Declared before the universe: dropped first.
    world: SimpleCommunicator,
    _universe: Universe,
}

impl Mpi {
    /// Initialise MPI: the communicator, this process's rank and the world size.
    pub(super) fn init() -> Result<(Self, usize, usize), DistError> {
        let universe =
            mpi::initialize().ok_or_else(|| DistError::Launch("MPI was already initialised in this process".into()))?;
        let world = universe.world();
        let (rank, size) = (world.rank() as usize, world.size() as usize);
        Ok((Self { world, _universe: universe }, rank, size))
    }

    /// Rank 0's `buf` on every rank (MPI_Bcast): how NCCL's unique id reaches the ranks under mpirun.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(super) fn broadcast_from_first(&self, buf: &mut [u8]) {
        self.world.process_at_rank(0).broadcast_into(buf);
    }
}

impl Collective for Mpi {
    fn sum_f32(&self, buf: &mut [f32]) {
        let send = buf.to_vec();
        self.world.all_reduce_into(&send[..], buf, SystemOperation::sum());
    }

    fn sum_f64(&self, buf: &mut [f64]) {
        let send = buf.to_vec();
        self.world.all_reduce_into(&send[..], buf, SystemOperation::sum());
    }

    fn max_f64(&self, buf: &mut [f64]) {
        let send = buf.to_vec();
        self.world.all_reduce_into(&send[..], buf, SystemOperation::max());
    }

    fn reduce_scatter_sum_f32(&self, send: &[f32], recv: &mut [f32]) {
        self.world.reduce_scatter_block_into(send, recv, SystemOperation::sum());
    }

    fn all_gather_f32(&self, send: &[f32], recv: &mut [f32]) {
        self.world.all_gather_into(send, recv);
    }

    fn all_gather_bytes(&self, send: &[u8]) -> Vec<Vec<u8>> {
        let count = mpi::Count::try_from(send.len()).expect("an all-gather sends under 2 GiB from a rank");
        let mut counts = vec![0 as mpi::Count; self.world.size() as usize];
        self.world.all_gather_into(&count, &mut counts[..]);
        let sizes: Vec<usize> = counts.iter().map(|&c| c as usize).collect();
        let total = mpi::Count::try_from(sizes.iter().sum::<usize>()).expect("an all-gather receives under 2 GiB");
        let displs: Vec<mpi::Count> = counts.iter().scan(0, |at, &c| Some(std::mem::replace(at, *at + c))).collect();
        let mut all = vec![0u8; total as usize];
        let mut parts = PartitionMut::new(&mut all[..], &counts[..], &displs[..]);
        self.world.all_gather_varcount_into(send, &mut parts);
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
        self.world.barrier();
    }

    fn abort(&self, code: i32) -> ! {
        self.world.abort(code)
    }
}
