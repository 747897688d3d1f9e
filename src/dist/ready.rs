//! Before NCCL's set-up: ncclCommInitRank waits, with no bound, for every rank of the communicator, so a rank
//! that failed before it (no GPU visible, more local ranks than GPUs, a CUDA error) would leave the others
//! waiting forever (under srun without --kill-on-bad-exit). So each rank first says whether it is ready, or
//! why not, in one bounded exchange (MPI's all-gather under mpirun or srun, else the TCP rendezvous), which
//! also carries rank 0's NCCL id; only when every rank is ready does any call ncclCommInitRank, and otherwise
//! every rank stops with an error naming the ranks that failed and why.

use serde::{Deserialize, Serialize};

use super::DistError;

/// What a rank tells the others before NCCL's set-up.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Hello {
    /// Why this rank cannot join; None when it is ready.
    failed: Option<String>,
    /// NCCL's unique id (rank 0's; empty on the others).
    id: Vec<u8>,
}

/// Exchange this rank's readiness (`mine`: the payload to hand over, rank 0's NCCL id, or why this rank
/// failed) with every rank through `all_gather` (every rank's bytes in rank order). Returns rank 0's payload
/// when every rank is ready, else an error naming each rank that failed (the same on every rank).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(super) fn agree(
    rank: usize,
    mine: Result<Vec<u8>, String>,
    all_gather: impl FnOnce(&[u8]) -> Result<Vec<Vec<u8>>, DistError>,
) -> Result<Vec<u8>, DistError> {
    let hello = match mine {
        Ok(id) => Hello { failed: None, id },
        Err(why) => Hello { failed: Some(why), id: Vec::new() },
    };
    let bytes = serde_json::to_vec(&hello).expect("a Hello serialises");
    let parts = all_gather(&bytes)?;
    let hellos: Vec<Hello> = parts
        .iter()
        .map(|b| {
            serde_json::from_slice(b)
                .unwrap_or_else(|e| Hello { failed: Some(format!("an unreadable message: {e}")), id: Vec::new() })
        })
        .collect();
    let failed: Vec<String> = hellos
        .iter()
        .enumerate()
        .filter_map(|(r, h)| h.failed.as_ref().map(|why| format!("rank {r}: {why}")))
        .collect();
    if !failed.is_empty() {
        return Err(DistError::Launch(format!(
            "rank {rank}: NCCL's set-up stopped before ncclCommInitRank, as {} of {} ranks cannot join: {}",
            failed.len(),
            hellos.len(),
            failed.join("; ")
        )));
    }
    Ok(hellos.into_iter().next().map(|h| h.id).unwrap_or_default())
}

/// A bound on a call that can block with none (ncclCommInitRank once every rank is ready: a rank that dies
/// inside it leaves the others in it): unless the guard is dropped within `limit`, `expire` runs (in a
/// run: say which rank and call, and exit the process, which ends NCCL's waits with it).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(super) struct Deadline {
    done: std::sync::mpsc::Sender<()>,
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
impl Deadline {
    pub(super) fn start(limit: std::time::Duration, expire: impl FnOnce() + Send + 'static) -> Self {
        let (done, wait) = std::sync::mpsc::channel::<()>();
        std::thread::spawn(move || {
            if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = wait.recv_timeout(limit) {
                expire();
            }
        });
        Self { done }
    }

    /// The call returned in time.
    pub(super) fn met(self) {
        let _ = self.done.send(());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;
    use std::time::{Duration, Instant};

    /// Ranks 0..n agreeing through the TCP rendezvous (each in a thread), rank k's readiness `ready(k)`:
    /// what `agree` returns on each.
    fn meet(n: usize, ready: fn(usize) -> Result<Vec<u8>, String>, timeout: Duration) -> Vec<Result<Vec<u8>, String>> {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let ranks: Vec<_> = (0..n)
            .map(|r| {
                std::thread::spawn(move || {
                    let gather = |b: &[u8]| -> Result<Vec<Vec<u8>>, DistError> {
                        Ok(if r == 0 {
                            super::super::rendezvous::serve(port, b, n, timeout)?
                        } else {
                            super::super::rendezvous::join("127.0.0.1", port, r, b, timeout)?
                        })
                    };
                    agree(r, ready(r), gather).map_err(|e| e.to_string())
                })
            })
            .collect();
        ranks.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn ready_ranks_receive_rank_zeros_id() {
        let got = meet(3, |r| Ok(if r == 0 { vec![7; 128] } else { Vec::new() }), Duration::from_secs(20));
        assert!(got.iter().all(|g| g.as_deref() == Ok(&[7u8; 128][..])), "{got:?}");
    }

    /// A rank that fails before ncclCommInitRank (here: it sees no GPU) tells rank 0, and every rank stops
    /// with an error that names it and its reason, in bounded time.
    #[test]
    fn a_rank_that_cannot_join_is_named_on_every_rank() {
        let t = Instant::now();
        let got = meet(
            3,
            |r| match r {
                0 => Ok(vec![1; 128]),
                2 => Err(super::super::local_gpu(2, 0).unwrap_err().to_string()),
                _ => Ok(Vec::new()),
            },
            Duration::from_secs(20),
        );
        assert!(t.elapsed() < Duration::from_secs(10));
        for (r, g) in got.iter().enumerate() {
            let e = g.as_ref().unwrap_err();
            assert!(e.starts_with(&format!("rank {r}: ")), "{e}");
            assert!(e.contains("1 of 3 ranks cannot join: rank 2: local rank 2: this process sees no GPU"), "{e}");
        }
    }

    /// A rank that never comes (it died before the exchange): rank 0 stops within the timeout, naming it.
    #[test]
    fn a_rank_that_never_comes_stops_rank_zero_in_bounded_time() {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let t = Instant::now();
        let gather = |b: &[u8]| Ok(super::super::rendezvous::serve(port, b, 2, Duration::from_millis(500))?);
        let e = agree(0, Ok(vec![1; 128]), gather).unwrap_err().to_string();
        assert!(t.elapsed() < Duration::from_secs(5));
        assert!(e.contains("ranks [1] did not connect"), "{e}");
    }

    #[test]
    fn a_deadline_expires_only_when_it_is_not_met_in_time() {
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::sync::Arc;
        use std::time::Duration;
        let (late, early) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)));
        let flag = late.clone();
        let _stuck = Deadline::start(Duration::from_millis(20), move || flag.store(true, Ordering::SeqCst));
        let flag = early.clone();
        Deadline::start(Duration::from_millis(20), move || flag.store(true, Ordering::SeqCst)).met();
        std::thread::sleep(Duration::from_millis(300));
        assert!(late.load(Ordering::SeqCst), "a call stuck past its limit expires");
        assert!(!early.load(Ordering::SeqCst), "a call that returned in time does not");
    }
}
