//! Work the ranks do apart, for as long as it takes: validation (each rank its share of the problems), a
//! rank waiting for a lock another process holds, a rank waiting for its rollout server. A collective is
//! bounded (GRPO_DIST_TIMEOUT_S), so the ranks that are done must not wait in one for the others: instead
//! the ranks meet in short rounds, one every [`beat`], in which each says whether it is still working and
//! whether it was asked to stop. A working rank takes part in a round from its work's progress
//! ([`Apart::tick`]); a rank that is done takes part in rounds until no rank is working
//! ([`Apart::finish`]). Every rank leaves at the same round, no round waits longer than about one beat
//! while every working rank makes progress, and a stop request on any rank reaches every rank at the next
//! round (work that can be cut short, such as waiting for a lock, then ends).

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::World;

/// How often the ranks meet while some work apart: a quarter of the collective's timeout (at most a
/// minute), so that a rank that is done waits in a round for at most about a beat.
pub fn beat() -> Duration {
    (super::collective_timeout() / 4).clamp(Duration::from_millis(10), Duration::from_secs(60))
}

/// One rank's part in a phase of work apart (see the module's documentation).
pub struct Apart<'a> {
    world: &'a World,
    stop: Option<&'a AtomicBool>,
    beat: Duration,
    last: Instant,
    /// A stop was requested on some rank (as of the last round; identical on every rank).
    stop_seen: bool,
}

impl<'a> Apart<'a> {
    /// Begin work apart on this rank of `world`; `stop` is this rank's stop request.
    pub fn begin(world: &'a World, stop: Option<&'a AtomicBool>) -> Self {
        Self { world, stop, beat: beat(), last: Instant::now(), stop_seen: false }
    }

    fn stop_here(&self) -> bool {
        self.stop.is_some_and(|s| s.load(Ordering::SeqCst))
    }

    /// One round: whether any rank is still working.
    fn round(&mut self, working: bool) -> bool {
        let mut b = [f64::from(u8::from(working)), f64::from(u8::from(self.stop_here()))];
        self.world.max_f64(&mut b);
        self.last = Instant::now();
        self.stop_seen |= b[1] > 0.0;
        b[0] > 0.0
    }

    /// Call often while this rank works (at least every few beats): a round when a beat has passed since the
    /// last. Returns whether a stop was requested, here or (as of the last round) on any rank.
    pub fn tick(&mut self) -> bool {
        if self.world.size() > 1 && self.last.elapsed() >= self.beat {
            self.round(true);
        }
        self.stop_seen || self.stop_here()
    }

    /// This rank's work is done (or failed: every rank must still come here, or end the job): wait in
    /// rounds, with no bound, for as long as another rank works. Returns whether a stop was requested on
    /// any rank during the phase (the same answer on every rank).
    pub fn finish(mut self) -> bool {
        if self.world.size() == 1 {
            return self.stop_here();
        }
        while self.round(false) {}
        self.stop_seen
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_process_works_alone_and_sees_its_own_stop() {
        let w = World::single();
        let stop = AtomicBool::new(false);
        let mut a = Apart::begin(&w, Some(&stop));
        assert!(!a.tick());
        stop.store(true, Ordering::SeqCst);
        assert!(a.tick());
        assert!(a.finish());
        assert!(!Apart::begin(&w, None).finish());
    }
}
