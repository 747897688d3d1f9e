//! Data parallelism: one `grpo train` command on N processes (ranks), launched as other trainers are
//! (`mpirun -np N grpo train ...`, `srun grpo train ...` under an MPI-enabled SLURM).
//!
//! Each step's batch is formed on every rank from the same seeded data order, its advantages and loss
//! weights are computed over the whole (global) batch, and then each rank trains on the answers of its
//! share of the groups (group i goes to rank i mod N: a group's statistics are never split). The
//! gradients are summed across ranks, so the update, the gradient norm, the clip and the bad-step check are
//! those of one process on the global batch, for every loss aggregation (the per-token weights already carry
//! the global normaliser). The optimiser state is sharded (ZeRO-1, `train::zero`): the gradients are
//! reduce-scattered, each rank updates its 1/N of the f32 master weights and moments, and the new weights are
//! all-gathered. Rank 0 writes checkpoints, metrics and curves, each rank its optimiser shard. A stop request
//! stops every rank after the same step.
//!
//! The collectives are MPI's (the `mpi` crate over Open MPI, cargo feature `mpi`); none is written by hand.
//! Without the feature, or launched as one process, a [`World`] is a single rank and every collective is the
//! identity.

#[cfg(feature = "mpi")]
mod mpi_backend;

use std::fmt;

/// Why the processes of a run cannot work together.
#[derive(Debug, thiserror::Error)]
pub enum DistError {
    #[error("{0}")]
    Launch(String),
}

/// The collective operations a data-parallel step needs, provided by a communication library.
pub trait Collective {
    /// Element-wise sum over the ranks, in place.
    fn sum_f32(&self, buf: &mut [f32]);
    /// Element-wise sum over the ranks, in place.
    fn sum_f64(&self, buf: &mut [f64]);
    /// Element-wise maximum over the ranks, in place.
    fn max_f64(&self, buf: &mut [f64]);
    /// Element-wise sum over the ranks of `send` (N blocks of `recv.len()`), of which this rank receives
    /// block `rank` (a reduce-scatter).
    fn reduce_scatter_sum_f32(&self, send: &[f32], recv: &mut [f32]);
    /// Every rank's `send` (all of one length), in rank order (an all-gather).
    fn all_gather_f32(&self, send: &[f32], recv: &mut [f32]);
    /// Wait until every rank is here.
    fn barrier(&self);
    /// End every rank of the job now with `code`.
    fn abort(&self, code: i32) -> !;
}

/// This process's place among the run's processes, and the collectives that join them.
pub struct World {
    rank: usize,
    size: usize,
    local_rank: usize,
    comm: Option<Box<dyn Collective>>,
}

impl fmt::Debug for World {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("World").field("rank", &self.rank).field("size", &self.size).finish()
    }
}

/// What the launcher says about this process: (rank, world size, local rank), from the variables of
/// Open MPI's mpirun, SLURM's srun or torchrun, in that order.
pub fn launch_env(var: impl Fn(&str) -> Option<String>) -> Option<(usize, usize, usize)> {
    let num = |k: &str| var(k).and_then(|v| v.trim().parse::<usize>().ok());
    let triples = [
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
        ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
        ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
        ("RANK", "WORLD_SIZE", "LOCAL_RANK"),
    ];
    triples.iter().find_map(|(r, s, l)| Some((num(r)?, num(s)?, num(l).unwrap_or(0))))
}

impl World {
    /// One process: rank 0 of 1.
    pub fn single() -> Self {
        Self { rank: 0, size: 1, local_rank: 0, comm: None }
    }

    /// The world the launcher started this process in: MPI's when launched by mpirun or srun with more
    /// than one process, else a single process.
    pub fn from_env() -> Result<Self, DistError> {
        let Some((_, size, _)) = launch_env(|k| std::env::var(k).ok()) else { return Ok(Self::single()) };
        if size <= 1 {
            return Ok(Self::single());
        }
        Self::multi(size)
    }

    #[cfg(feature = "mpi")]
    fn multi(size: usize) -> Result<Self, DistError> {
        let (comm, rank, world) = mpi_backend::Mpi::init()?;
        if world != size {
            return Err(DistError::Launch(format!("the launcher says {size} processes, MPI has {world}")));
        }
        let local_rank = launch_env(|k| std::env::var(k).ok()).map_or(0, |(_, _, l)| l);
        Ok(Self { rank, size, local_rank, comm: Some(Box::new(comm)) })
    }

    #[cfg(not(feature = "mpi"))]
    fn multi(size: usize) -> Result<Self, DistError> {
        Err(DistError::Launch(format!(
            "launched as {size} processes, but this grpo was built without MPI: build it with `--features mpi` \
             (needs Open MPI, e.g. Debian's libopenmpi-dev) and launch with mpirun or srun"
        )))
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn size(&self) -> usize {
        self.size
    }

    /// The rank among the processes of this node (which GPU this process takes).
    pub fn local_rank(&self) -> usize {
        self.local_rank
    }

    /// Rank 0: the one that writes the run's files.
    pub fn is_primary(&self) -> bool {
        self.rank == 0
    }

    /// Whether group `i` of a step's batch is this rank's to train on.
    pub fn owns_group(&self, i: usize) -> bool {
        i % self.size == self.rank
    }

    pub fn sum_f32(&self, buf: &mut [f32]) {
        if let Some(c) = &self.comm {
            c.sum_f32(buf);
        }
    }

    pub fn sum_f64(&self, buf: &mut [f64]) {
        if let Some(c) = &self.comm {
            c.sum_f64(buf);
        }
    }

    pub fn max_f64(&self, buf: &mut [f64]) {
        if let Some(c) = &self.comm {
            c.max_f64(buf);
        }
    }

    /// The sum over the ranks of `send` (`size` blocks of `recv.len()` values), block `rank` of it into
    /// `recv`: ZeRO's gradient reduction.
    pub fn reduce_scatter_sum_f32(&self, send: &[f32], recv: &mut [f32]) {
        assert_eq!(send.len(), recv.len() * self.size, "reduce-scatter: {} values for {} ranks", send.len(), self.size);
        match &self.comm {
            Some(c) => c.reduce_scatter_sum_f32(send, recv),
            None => recv.copy_from_slice(send),
        }
    }

    /// Every rank's `send` (of one length on all ranks) one after the other, in rank order, into `recv`:
    /// ZeRO's gathering of the updated weights.
    pub fn all_gather_f32(&self, send: &[f32], recv: &mut [f32]) {
        assert_eq!(recv.len(), send.len() * self.size, "all-gather: {} values from {} ranks", recv.len(), self.size);
        match &self.comm {
            Some(c) => c.all_gather_f32(send, recv),
            None => recv.copy_from_slice(send),
        }
    }

    /// Whether `flag` is set on any rank (a stop request must stop every rank after the same step).
    pub fn any(&self, flag: bool) -> bool {
        let mut b = [f64::from(u8::from(flag))];
        self.max_f64(&mut b);
        b[0] > 0.0
    }

    /// Rank 0's `value` on every rank.
    pub fn from_primary(&self, value: Option<f64>) -> Option<f64> {
        if self.size == 1 {
            return value;
        }
        let mine = if self.is_primary() { value } else { None };
        let mut b = [mine.map_or(0.0, |_| 1.0), mine.unwrap_or(f64::NEG_INFINITY)];
        self.max_f64(&mut b);
        (b[0] > 0.0).then_some(b[1])
    }

    pub fn barrier(&self) {
        if let Some(c) = &self.comm {
            c.barrier();
        }
    }

    /// After an error on this rank: end every rank now (a collective would otherwise wait for this one
    /// forever), saying which rank failed and why. A single process just returns.
    pub fn abort_on_error(&self, error: &dyn fmt::Display) {
        if let Some(c) = &self.comm {
            eprintln!("error: rank {} of {}: {error}; stopping every rank", self.rank, self.size);
            c.abort(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
    }

    #[test]
    fn each_launcher_names_rank_size_and_local_rank() {
        assert_eq!(launch_env(env(&[])), None);
        let mpirun =
            [("OMPI_COMM_WORLD_RANK", "3"), ("OMPI_COMM_WORLD_SIZE", "8"), ("OMPI_COMM_WORLD_LOCAL_RANK", "1")];
        assert_eq!(launch_env(env(&mpirun)), Some((3, 8, 1)));
        let srun = [("SLURM_PROCID", "9"), ("SLURM_NTASKS", "16"), ("SLURM_LOCALID", "1")];
        assert_eq!(launch_env(env(&srun)), Some((9, 16, 1)));
        let torchrun = [("RANK", "5"), ("WORLD_SIZE", "16"), ("LOCAL_RANK", "5")];
        assert_eq!(launch_env(env(&torchrun)), Some((5, 16, 5)));
        // mpirun inside a SLURM allocation: MPI's own numbering wins.
        let both = [srun.as_slice(), mpirun.as_slice()].concat();
        assert_eq!(launch_env(env(&both)), Some((3, 8, 1)));
    }

    #[test]
    fn a_single_world_is_the_identity() {
        let w = World::single();
        let mut b = [1.5f32, -2.0];
        w.sum_f32(&mut b);
        assert_eq!(b, [1.5, -2.0]);
        assert!(w.any(true) && !w.any(false) && w.is_primary());
        assert_eq!(w.from_primary(Some(0.25)), Some(0.25));
        assert!((0..5).all(|i| w.owns_group(i)));
    }
}
