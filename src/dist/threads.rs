//! Ranks as threads of one process, joined by in-memory collectives: how unit tests run the several ranks
//! of a run without a launcher. Only the collectives that work on bytes and f64 are provided.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Barrier, Condvar, Mutex};

use super::{Collective, DistError, World};

/// The messages not yet received, by (from, to).
type Mailboxes = HashMap<(usize, usize), VecDeque<Vec<u8>>>;

/// What the threads share: each rank's last contribution, the barrier they meet at, and the messages sent
/// from one rank to another and not yet received, by (from, to).
struct Shared {
    slots: Mutex<Vec<Vec<u8>>>,
    barrier: Barrier,
    mail: Mutex<Mailboxes>,
    posted: Condvar,
}

/// One rank's end of the in-memory collectives ([`ranks`]); sent to its thread, made a [`World`] there.
pub(crate) struct Rank {
    rank: usize,
    size: usize,
    shared: Arc<Shared>,
}

/// The `size` ranks of a world of threads.
pub(crate) fn ranks(size: usize) -> Vec<Rank> {
    let shared = Arc::new(Shared {
        slots: Mutex::new(vec![Vec::new(); size]),
        barrier: Barrier::new(size),
        mail: Mutex::new(HashMap::new()),
        posted: Condvar::new(),
    });
    (0..size).map(|rank| Rank { rank, size, shared: shared.clone() }).collect()
}

impl Rank {
    /// This rank's world (on its own thread).
    pub(crate) fn world(self) -> World {
        World { rank: self.rank, size: self.size, local_rank: self.rank, comm: Some(Box::new(self)) }
    }

    fn gather(&self, send: &[u8]) -> Vec<Vec<u8>> {
        self.shared.slots.lock().unwrap()[self.rank] = send.to_vec();
        self.shared.barrier.wait();
        let all = self.shared.slots.lock().unwrap().clone();
        self.shared.barrier.wait();
        all
    }

    fn reduce_f64(&self, buf: &mut [f64], op: fn(f64, f64) -> f64) {
        let bytes: Vec<u8> = buf.iter().flat_map(|v| v.to_le_bytes()).collect();
        let parts = self.gather(&bytes);
        for (i, v) in buf.iter_mut().enumerate() {
            let of = |p: &Vec<u8>| f64::from_le_bytes(p[i * 8..i * 8 + 8].try_into().unwrap());
            *v = parts.iter().map(of).reduce(op).unwrap();
        }
    }
}

impl Collective for Rank {
    fn sum_f32(&self, _: &mut [f32]) {
        unimplemented!("f32 collectives between threads")
    }
    fn sum_f64(&self, buf: &mut [f64]) {
        self.reduce_f64(buf, |a, b| a + b);
    }
    fn max_f64(&self, buf: &mut [f64]) {
        self.reduce_f64(buf, f64::max);
    }
    fn reduce_scatter_sum_f32(&self, _: &[f32], _: &mut [f32]) {
        unimplemented!("f32 collectives between threads")
    }
    fn all_gather_f32(&self, _: &[f32], _: &mut [f32]) {
        unimplemented!("f32 collectives between threads")
    }
    fn all_gather_bytes(&self, send: &[u8]) -> Vec<Vec<u8>> {
        self.gather(send)
    }
    fn barrier(&self) {
        self.shared.barrier.wait();
    }
    fn abort(&self, code: i32) -> ! {
        panic!("rank {} aborted with {code}", self.rank)
    }
    fn send_bytes(&self, to: usize, data: &[u8]) -> Result<(), DistError> {
        self.shared.mail.lock().unwrap().entry((self.rank, to)).or_default().push_back(data.to_vec());
        self.shared.posted.notify_all();
        Ok(())
    }
    fn recv_bytes(&self, from: usize) -> Result<Vec<u8>, DistError> {
        let mut mail = self.shared.mail.lock().unwrap();
        loop {
            if let Some(m) = mail.get_mut(&(from, self.rank)).and_then(|q| q.pop_front()) {
                return Ok(m);
            }
            mail = self.shared.posted.wait(mail).unwrap();
        }
    }
}
