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
//! The launcher is recognised from its environment ([`Launch`]: mpirun, srun or torchrun). Ranks on GPUs
//! use NCCL (libnccl loaded at run time, cargo feature `cuda`), whose unique id reaches every rank through MPI's
//! all-gather under mpirun or srun (with the `mpi` feature), else through a TCP rendezvous at
//! MASTER_ADDR:MASTER_PORT ([`rendezvous`]); ranks on CPUs use MPI (the `mpi` crate over Open MPI, cargo
//! feature `mpi`). No collective is written by hand. Every collective is bounded (GRPO_DIST_TIMEOUT_S; NCCL's
//! asynchronous errors are polled, MPI's collectives watched), and a rank that fails ends every rank. Work of
//! unbounded length that the ranks do apart (validation, waiting for a lock or a server) is waited for in
//! short rounds instead ([`Apart`]), and NCCL's set-up starts only once every rank said it is ready
//! ([`ready`]). Launched as one process, a
//! [`World`] is a single rank and every collective is the identity.

mod apart;
mod launch;
#[cfg(feature = "mpi")]
mod mpi_backend;
#[cfg(feature = "cuda")]
mod nccl_backend;
// The NCCL binding, loaded at run time; its tests (loading and its errors) need no GPU.
#[cfg(any(feature = "cuda", test))]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
mod nccl_sys;
mod ready;
pub mod rendezvous;
#[cfg(test)]
pub(crate) mod threads;

use crate::device::DeviceName;
use std::fmt;
use std::time::Duration;

pub use apart::Apart;
pub use launch::{Launch, LaunchError, Launcher, Master};

/// Why the processes of a run cannot work together.
#[derive(Debug, thiserror::Error)]
pub enum DistError {
    #[error("{0}")]
    Launch(String),
    #[error("the launcher's environment: {0}")]
    Env(#[from] LaunchError),
    #[error(transparent)]
    Rendezvous(#[from] rendezvous::RendezvousError),
}

/// How long a rank waits for a collective (NCCL) or the rendezvous before it gives up and stops every rank:
/// GRPO_DIST_TIMEOUT_S seconds, 1800 by default (a checkpoint of a large model is written while the other
/// ranks wait).
pub fn collective_timeout() -> Duration {
    let secs = std::env::var("GRPO_DIST_TIMEOUT_S").ok().and_then(|v| v.trim().parse::<u64>().ok());
    Duration::from_secs(secs.unwrap_or(1800))
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
    /// Every rank's `send` (of any length), in rank order, on every rank (an all-gather of variable
    /// size): how the ranks that each evaluated a share of the problems hand over their results.
    fn all_gather_bytes(&self, send: &[u8]) -> Vec<Vec<u8>>;
    /// Wait until every rank is here.
    fn barrier(&self);
    /// End every rank of the job now with `code`.
    fn abort(&self, code: i32) -> !;
    /// Send `data` to rank `to` alone (point to point, in order, with no bound: the receiver may be busy
    /// for as long as its work takes). Under 2 GiB; [`World::send_bytes`] cuts larger messages.
    fn send_bytes(&self, to: usize, data: &[u8]) -> Result<(), DistError> {
        let _ = (to, data);
        Err(DistError::Launch(UNSUPPORTED_POINT_TO_POINT.into()))
    }
    /// The next message rank `from` sent this rank ([`Collective::send_bytes`]).
    fn recv_bytes(&self, from: usize) -> Result<Vec<u8>, DistError> {
        let _ = from;
        Err(DistError::Launch(UNSUPPORTED_POINT_TO_POINT.into()))
    }
    /// The collectives of the ranks that pass the same `color` (every rank calls it), ranked in world order.
    fn split(&self, color: usize) -> Result<Box<dyn Collective>, DistError> {
        let _ = color;
        Err(DistError::Launch(UNSUPPORTED_POINT_TO_POINT.into()))
    }
}

/// What a backend without point-to-point messages says when asked for them.
const UNSUPPORTED_POINT_TO_POINT: &str = "this job's ranks talk over NCCL's collectives, which grpo does not use \
     for point-to-point messages: rollout.generation_ranks runs on CPU ranks over MPI (mpirun, srun); on GPUs \
     serve the rollouts with [rollout.server] instead";

/// Which ranks of a job generate (`rollout.generation_ranks`, the last ones) and which train.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Roles {
    /// The world ranks that train, data parallel among themselves (rank 0 first).
    pub trainers: Vec<usize>,
    /// The world ranks that generate.
    pub generators: Vec<usize>,
}

impl Roles {
    /// The last `generators` of `size` ranks generate; the others train. At least one of each.
    pub fn new(size: usize, generators: usize) -> Result<Self, DistError> {
        if generators >= size {
            return Err(DistError::Launch(format!(
                "rollout.generation_ranks = {generators} must be below the job's {size} ranks: at least one rank trains"
            )));
        }
        Ok(Self { trainers: (0..size - generators).collect(), generators: (size - generators..size).collect() })
    }

    /// The position of world rank `rank` among the generators, if it is one.
    pub fn generator_index(&self, rank: usize) -> Option<usize> {
        self.generators.iter().position(|&g| g == rank)
    }
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

impl World {
    /// One process: rank 0 of 1.
    pub fn single() -> Self {
        Self { rank: 0, size: 1, local_rank: 0, comm: None }
    }

    /// The world the launcher started this process in (a single process when none did): NCCL between the
    /// GPUs when `gpu`, else MPI.
    pub fn from_env(gpu: bool) -> Result<Self, DistError> {
        let Some(launch) = Launch::from_vars(|k| std::env::var(k).ok())? else { return Ok(Self::single()) };
        if launch.size <= 1 {
            return Ok(Self::single());
        }
        let comm = if gpu { nccl(&launch)? } else { mpi(&launch)? };
        Ok(Self { rank: launch.rank, size: launch.size, local_rank: launch.local_rank, comm: Some(comm) })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn size(&self) -> usize {
        self.size
    }

    /// The rank among the processes of this node.
    pub fn local_rank(&self) -> usize {
        self.local_rank
    }

    /// The device `configured` (`model.device`, `--device`) means on this rank: on several ranks, `cuda`
    /// and `cuda:N` are the rank's own GPU ([`local_gpu`]), as every rank of torchrun or DeepSpeed takes
    /// its local GPU whatever the script says (an explicit N that differs is said once); one process and
    /// the CPU keep it.
    pub fn rank_device(&self, configured: DeviceName) -> Result<DeviceName, DistError> {
        if self.size == 1 || !configured.is_cuda() {
            return Ok(configured);
        }
        let mine = DeviceName::Cuda(Some(local_gpu(self.local_rank, crate::device::visible_gpus())?));
        if configured != DeviceName::Cuda(None) && configured != mine && self.is_primary() {
            tracing::warn!(
                "device {configured} on {} ranks: each rank takes its own GPU ({mine} on rank 0)",
                self.size
            );
        }
        Ok(mine)
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
    /// `recv`: ZeRO's gradient reduction. Run in pieces of at most [`COLLECTIVE_CHUNK_VALUES`] values sent
    /// per rank, so that a GPU backend's device buffers stay that small whatever the model's size.
    pub fn reduce_scatter_sum_f32(&self, send: &[f32], recv: &mut [f32]) {
        assert_eq!(send.len(), recv.len() * self.size, "reduce-scatter: {} values for {} ranks", send.len(), self.size);
        match &self.comm {
            Some(c) => reduce_scatter_chunked(c.as_ref(), self.size, send, recv, COLLECTIVE_CHUNK_VALUES),
            None => recv.copy_from_slice(send),
        }
    }

    /// Every rank's `send` (of one length on all ranks) one after the other, in rank order, into `recv`:
    /// ZeRO's gathering of the updated weights. In pieces, as [`Self::reduce_scatter_sum_f32`].
    pub fn all_gather_f32(&self, send: &[f32], recv: &mut [f32]) {
        assert_eq!(recv.len(), send.len() * self.size, "all-gather: {} values from {} ranks", recv.len(), self.size);
        match &self.comm {
            Some(c) => all_gather_chunked(c.as_ref(), self.size, send, recv, COLLECTIVE_CHUNK_VALUES),
            None => recv.copy_from_slice(send),
        }
    }

    /// Every rank's `send` bytes (their lengths may differ), in rank order, on every rank: how `grpo eval`
    /// merges the results of the ranks' shares of the problems (serialised records).
    pub fn all_gather_bytes(&self, send: &[u8]) -> Vec<Vec<u8>> {
        match &self.comm {
            Some(c) => all_gather_bytes_chunked(c.as_ref(), self.size, send, COLLECTIVE_CHUNK_BYTES),
            None => vec![send.to_vec()],
        }
    }

    /// Whether `flag` is set on any rank (a stop request must stop every rank after the same step).
    pub fn any(&self, flag: bool) -> bool {
        let mut b = [f64::from(u8::from(flag))];
        self.max_f64(&mut b);
        b[0] > 0.0
    }

    pub fn barrier(&self) {
        if let Some(c) = &self.comm {
            c.barrier();
        }
    }

    /// Send `data` to rank `to` alone, in pieces of at most [`COLLECTIVE_CHUNK_BYTES`] (its length first).
    /// One process has no one to send to.
    pub fn send_bytes(&self, to: usize, data: &[u8]) -> Result<(), DistError> {
        let c = self.peer(to)?;
        c.send_bytes(to, &(data.len() as u64).to_le_bytes())?;
        data.chunks(COLLECTIVE_CHUNK_BYTES).try_for_each(|piece| c.send_bytes(to, piece))
    }

    /// The next message of [`World::send_bytes`] from rank `from`, waiting for it with no bound.
    pub fn recv_bytes(&self, from: usize) -> Result<Vec<u8>, DistError> {
        let c = self.peer(from)?;
        let len = c.recv_bytes(from)?;
        let len = len.get(..8).and_then(|b| b.try_into().ok()).map(u64::from_le_bytes).ok_or_else(|| {
            DistError::Launch(format!("rank {from} sent a message without its length ({} bytes)", len.len()))
        })? as usize;
        let mut out = Vec::with_capacity(len);
        while out.len() < len {
            out.extend_from_slice(&c.recv_bytes(from)?);
        }
        Ok(out)
    }

    fn peer(&self, other: usize) -> Result<&dyn Collective, DistError> {
        match &self.comm {
            Some(c) if other < self.size && other != self.rank => Ok(c.as_ref()),
            _ => Err(DistError::Launch(format!("rank {} of {} cannot message rank {other}", self.rank, self.size))),
        }
    }

    /// The world of the ranks in `members` (world ranks, ascending; this rank among them): every rank of the
    /// world calls it at the same point, each with its own group. A group of one is a single process.
    pub fn split(&self, members: &[usize]) -> Result<World, DistError> {
        let rank = members.iter().position(|&r| r == self.rank).ok_or_else(|| {
            DistError::Launch(format!("rank {} is not among the ranks {members:?} of its group", self.rank))
        })?;
        let comm = match &self.comm {
            Some(c) => Some(c.split(members[0])?),
            None => None,
        };
        let comm = if members.len() == 1 { None } else { comm };
        Ok(World { rank, size: members.len(), local_rank: self.local_rank, comm })
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

/// The most values one rank sends (reduce-scatter) or receives (all-gather) in one piece of the collective
/// (64 Mi f32, 256 MiB): a GPU backend's device buffers for a piece hold at most that plus one rank's
/// share of it.
pub const COLLECTIVE_CHUNK_VALUES: usize = 64 << 20;

/// The most bytes one all-gather of bytes receives in one piece (1 GiB): MPI counts and displacements are
/// 32-bit, so a piece stays under 2 GiB however much the ranks send.
pub const COLLECTIVE_CHUNK_BYTES: usize = 1 << 30;

/// [`Collective::all_gather_bytes`] of `send` in pieces: the lengths first, then rounds in which each rank
/// sends its next at most `chunk / size` bytes (nothing once it has sent all), appended to its part.
fn all_gather_bytes_chunked(c: &dyn Collective, size: usize, send: &[u8], chunk: usize) -> Vec<Vec<u8>> {
    let lens: Vec<usize> = c
        .all_gather_bytes(&(send.len() as u64).to_le_bytes())
        .iter()
        .map(|b| b.get(..8).and_then(|b| b.try_into().ok()).map_or(0, u64::from_le_bytes) as usize)
        .collect();
    let step = (chunk / size.max(1)).max(1);
    let rounds = lens.iter().map(|n| n.div_ceil(step)).max().unwrap_or(0);
    let mut out: Vec<Vec<u8>> = lens.iter().map(|&n| Vec::with_capacity(n)).collect();
    for k in 0..rounds {
        let (a, b) = ((k * step).min(send.len()), ((k + 1) * step).min(send.len()));
        for (part, piece) in out.iter_mut().zip(c.all_gather_bytes(&send[a..b])) {
            part.extend_from_slice(&piece);
        }
    }
    out
}

/// [`Collective::reduce_scatter_sum_f32`] of `send` (`size` blocks of `recv.len()`) in pieces: piece
/// `a..b` of every block, sent together (at most `chunk` values), reduces into `recv[a..b]`.
fn reduce_scatter_chunked(c: &dyn Collective, size: usize, send: &[f32], recv: &mut [f32], chunk: usize) {
    let block = recv.len();
    let step = (chunk / size.max(1)).max(1);
    let mut piece = Vec::new();
    for a in (0..block).step_by(step) {
        let b = (a + step).min(block);
        piece.clear();
        for r in 0..size {
            piece.extend_from_slice(&send[r * block + a..r * block + b]);
        }
        c.reduce_scatter_sum_f32(&piece, &mut recv[a..b]);
    }
}

/// [`Collective::all_gather_f32`] of `send` in pieces: piece `a..b` of every rank's `send` (at most `chunk`
/// values gathered at once) lands at `a..b` of that rank's block of `recv`.
fn all_gather_chunked(c: &dyn Collective, size: usize, send: &[f32], recv: &mut [f32], chunk: usize) {
    let block = send.len();
    let step = (chunk / size.max(1)).max(1);
    let mut piece = Vec::new();
    for a in (0..block).step_by(step) {
        let b = (a + step).min(block);
        piece.resize(size * (b - a), 0.0);
        c.all_gather_f32(&send[a..b], &mut piece);
        for r in 0..size {
            recv[r * block + a..r * block + b].copy_from_slice(&piece[r * (b - a)..(r + 1) * (b - a)]);
        }
    }
}

/// The GPU (ordinal) of the rank with local rank `local_rank`, among the `visible` GPUs its process sees:
/// its local rank when it sees several (torchrun, mpirun, `srun --gpus-per-node`: every rank of a node
/// sees the node's GPUs), the one it sees when the launcher bound one GPU to it (`srun --gpus-per-task=1`,
/// a CUDA_VISIBLE_DEVICES per rank).
pub fn local_gpu(local_rank: usize, visible: usize) -> Result<usize, DistError> {
    let devices =
        std::env::var("CUDA_VISIBLE_DEVICES").map(|v| format!(" (CUDA_VISIBLE_DEVICES={v})")).unwrap_or_default();
    match visible {
        0 => Err(DistError::Launch(format!("local rank {local_rank}: this process sees no GPU{devices}"))),
        1 => Ok(0),
        n if local_rank < n => Ok(local_rank),
        n => Err(DistError::Launch(format!(
            "local rank {local_rank}, but this process sees {n} GPUs{devices}: launch at most {n} processes per \
             node, or bind one GPU to each"
        ))),
    }
}

/// MPI's world as the collectives of the ranks.
#[cfg(feature = "mpi")]
fn mpi(launch: &Launch) -> Result<Box<dyn Collective>, DistError> {
    Ok(Box::new(mpi_init(launch)?))
}

/// MPI, initialised and checked against the launcher's numbering.
#[cfg(feature = "mpi")]
fn mpi_init(launch: &Launch) -> Result<mpi_backend::Mpi, DistError> {
    let (comm, rank, size) = mpi_backend::Mpi::init()?;
    if (rank, size) != (launch.rank, launch.size) {
        return Err(DistError::Launch(format!(
            "the launcher says rank {} of {}, MPI says rank {rank} of {size} (launch with mpirun or srun)",
            launch.rank, launch.size
        )));
    }
    Ok(comm)
}

#[cfg(not(feature = "mpi"))]
fn mpi(launch: &Launch) -> Result<Box<dyn Collective>, DistError> {
    Err(DistError::Launch(format!(
        "launched as {} processes on CPUs, but this grpo was built without MPI: build it with `--features mpi` \
         (needs Open MPI, e.g. Debian's libopenmpi-dev) and launch with mpirun or srun",
        launch.size
    )))
}

/// NCCL's communicator among the GPUs, each rank on its GPU ([`local_gpu`]). Before ncclCommInitRank (which
/// waits for every rank with no bound) the ranks agree, in one bounded exchange, that each is ready
/// ([`ready::agree`]): a rank that failed is named on every rank instead of leaving the others waiting.
#[cfg(feature = "cuda")]
fn nccl(launch: &Launch) -> Result<Box<dyn Collective>, DistError> {
    let timeout = collective_timeout();
    let meeting = Meeting::open(launch, timeout)?;
    // NCCL loaded, rank 0's id made, the rank's GPU found: each may fail on one rank only.
    let id = nccl_backend::load().and_then(|()| match launch.rank {
        0 => nccl_backend::new_id().map(|id| id.to_vec()),
        _ => Ok(Vec::new()),
    });
    let gpu = id.and_then(|id| Ok((id, local_gpu(launch.local_rank, crate::device::visible_gpus())?)));
    let (id, gpu) = match gpu {
        Ok(ready) => ready,
        Err(e) => {
            meeting.agree(launch.rank, Err(e.to_string()))?;
            return Err(e);
        }
    };
    let comm = nccl_backend::Nccl::init(gpu, launch.rank, launch.size, timeout, |device| {
        let (id_bytes, keep) = meeting.agree(launch.rank, device.map(|()| id))?;
        let id: [u8; nccl_backend::ID_BYTES] = id_bytes.as_slice().try_into().map_err(|_| {
            DistError::Launch(format!("rank {}: rank 0 sent an NCCL id of {} bytes", launch.rank, id_bytes.len()))
        })?;
        Ok((id, keep))
    })?;
    Ok(Box::new(comm))
}

/// What must live as long as a communicator made from a [`Meeting`] (NCCL's unique id holder), if anything.
#[cfg(feature = "cuda")]
type KeepAlive = Option<Box<dyn std::any::Any>>;

/// How the ranks of a GPU run meet before NCCL exists: MPI when the launcher started it (its environment is
/// kept as long as the communicator), else the TCP rendezvous at rank 0's MASTER_ADDR:MASTER_PORT.
#[cfg(feature = "cuda")]
enum Meeting {
    #[cfg(feature = "mpi")]
    Mpi(mpi_backend::Mpi),
    Tcp {
        master: Master,
        size: usize,
        timeout: Duration,
    },
}

#[cfg(feature = "cuda")]
impl Meeting {
    fn open(launch: &Launch, timeout: Duration) -> Result<Self, DistError> {
        #[cfg(feature = "mpi")]
        if launch.launcher.provides_mpi() {
            return Ok(Meeting::Mpi(mpi_init(launch)?));
        }
        let master = launch.master.clone().ok_or_else(|| {
            DistError::Launch(format!(
                "rank {}: the NCCL id needs rank 0's address: set MASTER_ADDR and MASTER_PORT (torchrun sets them)",
                launch.rank
            ))
        })?;
        Ok(Meeting::Tcp { master, size: launch.size, timeout })
    }

    /// [`ready::agree`] through this meeting: rank 0's payload, and what must live as long as NCCL's
    /// communicator.
    fn agree(self, rank: usize, mine: Result<Vec<u8>, String>) -> Result<(Vec<u8>, KeepAlive), DistError> {
        match self {
            #[cfg(feature = "mpi")]
            Meeting::Mpi(mpi) => {
                let id = ready::agree(rank, mine, |b| Ok(mpi.all_gather_bytes(b)))?;
                Ok((id, Some(Box::new(mpi))))
            }
            Meeting::Tcp { master, size, timeout } => {
                let id = ready::agree(rank, mine, |b| {
                    Ok(if rank == 0 {
                        rendezvous::serve(master.port, b, size, timeout)?
                    } else {
                        rendezvous::join(&master.addr, master.port, rank, b, timeout)?
                    })
                })?;
                Ok((id, None))
            }
        }
    }
}

#[cfg(not(feature = "cuda"))]
fn nccl(launch: &Launch) -> Result<Box<dyn Collective>, DistError> {
    Err(DistError::Launch(format!(
        "launched as {} processes on GPUs, but this grpo was built without CUDA: build it with `--features cuda`",
        launch.size
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Messages from one rank to another arrive whole and in order, an empty one included; one process has
    /// no one to message, and its group of one is itself.
    #[test]
    fn point_to_point_messages_arrive_whole_and_in_order() {
        let mut ranks = threads::ranks(2).into_iter();
        let (r0, r1) = (ranks.next().unwrap(), ranks.next().unwrap());
        let big: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        let sent = vec![b"first".to_vec(), Vec::new(), big];
        let expect = sent.clone();
        let sender = std::thread::spawn(move || {
            let w = r0.world();
            sent.iter().for_each(|m| w.send_bytes(1, m).unwrap());
            w.recv_bytes(1).unwrap()
        });
        let w = r1.world();
        let got: Vec<Vec<u8>> = (0..3).map(|_| w.recv_bytes(0).unwrap()).collect();
        w.send_bytes(0, b"done").unwrap();
        assert_eq!(got, expect);
        assert_eq!(sender.join().unwrap(), b"done");
        assert!(w.send_bytes(1, b"self").is_err(), "a rank does not message itself");
        let one = World::single();
        assert!(one.send_bytes(0, b"x").is_err());
        let group = one.split(&[0]).unwrap();
        assert_eq!((group.rank(), group.size()), (0, 1));
    }

    #[test]
    fn a_single_world_is_the_identity() {
        let w = World::single();
        let mut b = [1.5f32, -2.0];
        w.sum_f32(&mut b);
        assert_eq!(b, [1.5, -2.0]);
        assert!(w.any(true) && !w.any(false) && w.is_primary());
        assert_eq!(w.all_gather_bytes(b"abc"), vec![b"abc".to_vec()]);
        assert!((0..5).all(|i| w.owns_group(i)));
        let cuda3 = DeviceName::Cuda(Some(3));
        assert_eq!(w.rank_device(cuda3).unwrap(), cuda3, "one process keeps its device");
        assert_eq!(w.rank_device(DeviceName::Cpu).unwrap(), DeviceName::Cpu);
    }

    /// Rank `rank` of `size` ranks, rank k having sent `send + k` (every value): what real collectives
    /// return to it, and how many calls it took.
    struct Shifted {
        rank: usize,
        size: usize,
        calls: std::cell::Cell<usize>,
    }

    impl Collective for Shifted {
        fn sum_f32(&self, _: &mut [f32]) {
            unreachable!()
        }
        fn sum_f64(&self, _: &mut [f64]) {
            unreachable!()
        }
        fn max_f64(&self, _: &mut [f64]) {
            unreachable!()
        }
        fn reduce_scatter_sum_f32(&self, send: &[f32], recv: &mut [f32]) {
            self.calls.set(self.calls.get() + 1);
            let n = recv.len();
            for (i, r) in recv.iter_mut().enumerate() {
                *r = (0..self.size).map(|k| send[self.rank * n + i] + k as f32).sum();
            }
        }
        fn all_gather_f32(&self, send: &[f32], recv: &mut [f32]) {
            self.calls.set(self.calls.get() + 1);
            for k in 0..self.size {
                for (i, x) in send.iter().enumerate() {
                    recv[k * send.len() + i] = x + k as f32;
                }
            }
        }
        fn all_gather_bytes(&self, _: &[u8]) -> Vec<Vec<u8>> {
            unreachable!()
        }
        fn barrier(&self) {}
        fn abort(&self, _: i32) -> ! {
            unreachable!()
        }
    }

    /// In pieces (a block of 10 values, pieces of 2 or 3, or one piece), the collectives return what one
    /// call over the whole buffers returns.
    #[test]
    fn collectives_in_pieces_equal_one_whole_call() {
        let (size, block) = (3, 10);
        let send: Vec<f32> = (0..size * block).map(|i| i as f32 * 0.5).collect();
        for (chunk, pieces) in [(7, 5), (9, 4), (1 << 20, 1)] {
            let c = Shifted { rank: 1, size, calls: Default::default() };
            let (mut whole, mut chunked) = (vec![0f32; block], vec![0f32; block]);
            c.reduce_scatter_sum_f32(&send, &mut whole);
            c.calls.set(0);
            reduce_scatter_chunked(&c, size, &send, &mut chunked, chunk);
            assert_eq!((chunked.as_slice(), c.calls.get()), (whole.as_slice(), pieces), "chunk {chunk}");
            let (mut whole, mut chunked) = (vec![0f32; size * block], vec![0f32; size * block]);
            c.all_gather_f32(&send[..block], &mut whole);
            c.calls.set(0);
            all_gather_chunked(&c, size, &send[..block], &mut chunked, chunk);
            assert_eq!((chunked.as_slice(), c.calls.get()), (whole.as_slice(), pieces), "chunk {chunk}");
        }
    }

    /// Ranks holding `data[k]` each: what an all-gather of bytes returns, call after call (the lengths, then
    /// the pieces of `step` bytes), checking that no call gathers more than `limit` bytes.
    struct Pieces {
        data: Vec<Vec<u8>>,
        step: usize,
        limit: usize,
        calls: std::cell::Cell<usize>,
    }

    impl Collective for Pieces {
        fn sum_f32(&self, _: &mut [f32]) {}
        fn sum_f64(&self, _: &mut [f64]) {}
        fn max_f64(&self, _: &mut [f64]) {}
        fn reduce_scatter_sum_f32(&self, _: &[f32], _: &mut [f32]) {}
        fn all_gather_f32(&self, _: &[f32], _: &mut [f32]) {}
        fn all_gather_bytes(&self, send: &[u8]) -> Vec<Vec<u8>> {
            let call = self.calls.replace(self.calls.get() + 1);
            let out: Vec<Vec<u8>> = if call == 0 {
                self.data.iter().map(|d| (d.len() as u64).to_le_bytes().to_vec()).collect()
            } else {
                let at = (call - 1) * self.step;
                self.data.iter().map(|d| d[at.min(d.len())..(at + self.step).min(d.len())].to_vec()).collect()
            };
            assert_eq!(send, out[0].as_slice(), "rank 0 sent another piece than expected");
            assert!(out.iter().map(Vec::len).sum::<usize>() <= self.limit, "call {call} gathers too much");
            out
        }
        fn barrier(&self) {}
        fn abort(&self, _: i32) -> ! {
            unreachable!()
        }
    }

    /// Past the chunk (MPI's 32-bit counts: 2 GiB), bytes are gathered in pieces that each stay under it,
    /// and every rank's part arrives whole, whatever its length.
    #[test]
    fn a_byte_gather_past_the_chunk_goes_in_pieces() {
        let data: Vec<Vec<u8>> = [1000usize, 0, 2345]
            .iter()
            .enumerate()
            .map(|(k, &n)| (0..n).map(|i| (i * 7 + k) as u8).collect())
            .collect();
        let (chunk, size) = (300, 3);
        let c = Pieces { data: data.clone(), step: chunk / size, limit: chunk, calls: Default::default() };
        let parts = all_gather_bytes_chunked(&c, size, &data[0], chunk);
        assert_eq!(parts, data);
        assert_eq!(c.calls.get(), 1 + 2345usize.div_ceil(100));
    }

    #[test]
    fn each_rank_takes_its_local_gpu_or_the_one_bound_to_it() {
        assert_eq!(local_gpu(3, 8).unwrap(), 3, "torchrun: 8 GPUs visible to every rank of the node");
        assert_eq!(local_gpu(3, 1).unwrap(), 0, "srun --gpus-per-task=1: the one GPU of the task");
        assert_eq!(local_gpu(0, 1).unwrap(), 0);
        let e = local_gpu(4, 2).unwrap_err().to_string();
        assert!(e.contains("local rank 4, but this process sees 2 GPUs"), "{e}");
        assert!(local_gpu(0, 0).unwrap_err().to_string().contains("sees no GPU"));
    }
}
