//! Continuous batching: which tokens of which sequences run in the next forward. Each step has a token
//! budget; the sequences already running come first (one token each when decoding, the next chunk of
//! their prompt while prefilling), then waiting ones are admitted, oldest first, while seats, budget and
//! blocks last. A sequence that needs a block when the pool is empty preempts the newest running one: its
//! blocks are released and it waits at the front of the queue to be computed again (its tokens kept).
//!
//! The n samples of a problem are one group: its leader prefills the prompt; when the prompt is done, the
//! others fork off it, sharing the prompt's blocks (a partly filled last block is copied when a sequence
//! first writes into it while others share it). Full blocks are cached by their tokens ([`BlockPool`]),
//! so a sequence computed again, or a prompt that starts as an earlier one did, takes them as they are.

use std::collections::VecDeque;

use super::blocks::{BlockId, BlockPool};

/// A sequence's index in the scheduler (the order it was added in).
pub type SeqId = usize;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Status {
    Waiting,
    Running,
    /// A sample of a group whose leader has not finished the prompt yet.
    Pending,
    Done,
}

#[derive(Debug)]
struct Seq {
    tokens: Vec<u32>,
    prompt_len: usize,
    /// Positions whose keys and values are in `blocks`.
    computed: usize,
    blocks: Vec<BlockId>,
    /// The hashes of the first blocks, registered in the pool's cache.
    hashes: Vec<u64>,
    status: Status,
    /// The samples that fork off this sequence when its prompt is done.
    forks: Vec<SeqId>,
}

/// One sequence's part of a step: its tokens `start..start + len` run, and when they reach its last token
/// (`sample`), the next token is drawn from the logits of the last.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub seq: SeqId,
    pub start: usize,
    pub len: usize,
    pub sample: bool,
}

/// A copy of the first `len` positions of block `from` into block `to` (copy on write), made before the
/// step's forward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Copy {
    pub from: BlockId,
    pub to: BlockId,
    pub len: usize,
}

/// What the next forward runs.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Step {
    pub entries: Vec<Entry>,
    pub copies: Vec<Copy>,
    /// Sequences preempted while the step was planned.
    pub preempted: Vec<SeqId>,
}

impl Step {
    pub fn tokens(&self) -> usize {
        self.entries.iter().map(|e| e.len).sum()
    }
}

/// Counts over a run, for the report.
#[derive(Debug, Default, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Counts {
    /// Prompt positions computed by a forward.
    pub prefill_computed: usize,
    /// Prompt positions that were not: shared with a group's leader, or taken from the prefix cache.
    pub prefill_saved: usize,
    pub preemptions: usize,
    /// Positions computed again after a preemption.
    pub recomputed: usize,
}

/// The scheduler's state: the pool, the sequences and the queue.
#[derive(Debug)]
pub struct Scheduler {
    pool: BlockPool,
    seqs: Vec<Seq>,
    waiting: VecDeque<SeqId>,
    /// In admission order: the last is preempted first.
    running: Vec<SeqId>,
    max_seqs: usize,
    max_tokens: usize,
    /// Whether admission takes cached blocks of the same tokens.
    prefix_cache: bool,
    pub counts: Counts,
}

impl Scheduler {
    /// At most `max_seqs` sequences at a time and `max_tokens` tokens a step, over `pool`.
    pub fn new(pool: BlockPool, max_seqs: usize, max_tokens: usize) -> Self {
        assert!(max_seqs > 0 && max_tokens > 0, "the options are checked before");
        Scheduler {
            pool,
            seqs: Vec::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            max_seqs,
            max_tokens,
            prefix_cache: true,
            counts: Counts::default(),
        }
    }

    /// Without the prefix cache: every sequence computes its own blocks (a group's samples still share).
    pub fn without_prefix_cache(mut self) -> Self {
        self.prefix_cache = false;
        self
    }

    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// Blocks a sequence of `len` positions takes.
    pub fn blocks_for(&self, len: usize) -> usize {
        len.div_ceil(self.pool.block_size())
    }

    /// Queue `samples` sequences that start with `prompt` (at least one token), as one group; their ids,
    /// the leader's first.
    pub fn add(&mut self, prompt: &[u32], samples: usize) -> Vec<SeqId> {
        assert!(!prompt.is_empty() && samples > 0);
        let first = self.seqs.len();
        let ids: Vec<SeqId> = (first..first + samples).collect();
        for (i, _) in ids.iter().enumerate() {
            self.seqs.push(Seq {
                tokens: prompt.to_vec(),
                prompt_len: prompt.len(),
                computed: 0,
                blocks: Vec::new(),
                hashes: Vec::new(),
                status: if i == 0 { Status::Waiting } else { Status::Pending },
                forks: if i == 0 { ids[1..].to_vec() } else { Vec::new() },
            });
        }
        self.waiting.push_back(first);
        ids
    }

    /// Whether nothing is waiting or running.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    /// Sequences running.
    pub fn running(&self) -> usize {
        self.running.len()
    }

    /// The seats `s` holds: one, and one for each sample still to fork off it.
    fn seats(&self, s: SeqId) -> usize {
        1 + self.seqs[s].forks.len()
    }

    pub fn tokens(&self, s: SeqId) -> &[u32] {
        &self.seqs[s].tokens
    }

    pub fn prompt_len(&self, s: SeqId) -> usize {
        self.seqs[s].prompt_len
    }

    /// The pool slot of position `pos` of `s` (`block * block_size + offset`).
    pub fn slot(&self, s: SeqId, pos: usize) -> u32 {
        let bs = self.pool.block_size();
        self.seqs[s].blocks[pos / bs] * bs as u32 + (pos % bs) as u32
    }

    /// The block table of `s`.
    pub fn blocks(&self, s: SeqId) -> &[BlockId] {
        &self.seqs[s].blocks
    }

    /// Plan the next step (empty when nothing is left to run).
    pub fn schedule(&mut self) -> Step {
        let mut step = Step::default();
        let mut budget = self.max_tokens;
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let s = self.running[i];
            let want = (self.seqs[s].tokens.len() - self.seqs[s].computed).min(budget);
            if self.reserve(s, want, &mut step.copies) {
                step.entries.push(self.entry(s, want));
                budget -= want;
                i += 1;
                continue;
            }
            let newest = *self.running.last().expect("s runs");
            self.preempt(newest);
            step.preempted.push(newest);
        }
        if step.preempted.is_empty() {
            self.admit(&mut step, budget);
        }
        step
    }

    /// Admit waiting sequences, oldest first, while the seats, the budget and the blocks allow.
    fn admit(&mut self, step: &mut Step, mut budget: usize) {
        let mut seats: usize = self.running.iter().map(|&s| self.seats(s)).sum();
        while let Some(&s) = self.waiting.front() {
            if budget == 0 || seats + self.seats(s) > self.max_seqs {
                break;
            }
            self.take_cached_prefix(s);
            let want = (self.seqs[s].tokens.len() - self.seqs[s].computed).min(budget);
            if !self.reserve(s, want, &mut step.copies) {
                self.release_blocks(s);
                break;
            }
            self.waiting.pop_front();
            self.seqs[s].status = Status::Running;
            self.running.push(s);
            seats += self.seats(s);
            step.entries.push(self.entry(s, want));
            budget -= want;
        }
    }

    fn entry(&self, s: SeqId, len: usize) -> Entry {
        let q = &self.seqs[s];
        Entry { seq: s, start: q.computed, len, sample: q.computed + len == q.tokens.len() }
    }

    /// Take the cached blocks that `s`'s tokens start with, keeping at least its last token to compute
    /// (its logits are what the step is for).
    fn take_cached_prefix(&mut self, s: SeqId) {
        let bs = self.pool.block_size();
        let q = &self.seqs[s];
        if q.computed > 0 || !self.prefix_cache {
            return;
        }
        let full = (q.tokens.len() - 1) / bs;
        let tokens = q.tokens.clone();
        let mut parent = None;
        for b in 0..full {
            let Some((block, hash)) = self.pool.lookup(parent, &tokens[b * bs..(b + 1) * bs]) else { break };
            let q = &mut self.seqs[s];
            q.blocks.push(block);
            q.hashes.push(hash);
            q.computed += bs;
            parent = Some(hash);
            self.counts.prefill_saved += bs.min(q.prompt_len.saturating_sub(b * bs));
        }
    }

    /// Make room for positions `computed..computed + len` of `s`: new blocks, and a private copy of a
    /// shared, partly filled last block. False (nothing taken) when the pool has too few.
    fn reserve(&mut self, s: SeqId, len: usize, copies: &mut Vec<Copy>) -> bool {
        let bs = self.pool.block_size();
        let q = &self.seqs[s];
        let (computed, held) = (q.computed, q.blocks.len());
        let cow = computed % bs != 0 && len > 0 && self.pool.refs(q.blocks[computed / bs]) > 1;
        let fresh = (computed + len).div_ceil(bs).saturating_sub(held);
        if self.pool.available() < fresh + usize::from(cow) {
            return false;
        }
        if cow {
            let to = self.pool.allocate().expect("counted");
            let from = std::mem::replace(&mut self.seqs[s].blocks[computed / bs], to);
            self.pool.release(from);
            copies.push(Copy { from, to, len: computed % bs });
        }
        for _ in 0..fresh {
            let b = self.pool.allocate().expect("counted");
            self.seqs[s].blocks.push(b);
        }
        true
    }

    /// Let go of `s`'s blocks and start it again later, before every other waiting sequence.
    fn preempt(&mut self, s: SeqId) {
        self.running.retain(|&r| r != s);
        self.counts.preemptions += 1;
        self.counts.recomputed += self.seqs[s].computed;
        self.release_blocks(s);
        self.seqs[s].status = Status::Waiting;
        self.waiting.push_front(s);
    }

    fn release_blocks(&mut self, s: SeqId) {
        let q = &mut self.seqs[s];
        q.computed = 0;
        q.hashes.clear();
        for b in std::mem::take(&mut q.blocks) {
            self.pool.release(b);
        }
    }

    /// After the forward of `step`: its positions are computed and newly full blocks cached. Groups whose
    /// prompt is done fork their samples, which then share the leader's blocks (and sample from its last
    /// logits): returned as `(leader, samples)`.
    pub fn computed(&mut self, step: &Step) -> Vec<(SeqId, Vec<SeqId>)> {
        let bs = self.pool.block_size();
        let mut forked = Vec::new();
        for e in &step.entries {
            let q = &mut self.seqs[e.seq];
            self.counts.prefill_computed += q.prompt_len.saturating_sub(e.start).min(e.len);
            q.computed = e.start + e.len;
            while q.hashes.len() < q.computed / bs {
                let b = q.hashes.len();
                let h = self.pool.register(q.blocks[b], q.hashes.last().copied(), &q.tokens[b * bs..(b + 1) * bs]);
                q.hashes.push(h);
            }
            if e.sample && !q.forks.is_empty() {
                forked.push((e.seq, self.fork(e.seq)));
            }
        }
        forked
    }

    /// The samples of `leader`'s group take its blocks and run from here on.
    fn fork(&mut self, leader: SeqId) -> Vec<SeqId> {
        let forks = std::mem::take(&mut self.seqs[leader].forks);
        let l = &self.seqs[leader];
        let (blocks, hashes, computed) = (l.blocks.clone(), l.hashes.clone(), l.computed);
        for &f in &forks {
            blocks.iter().for_each(|&b| self.pool.share(b));
            let q = &mut self.seqs[f];
            (q.blocks, q.hashes, q.computed, q.status) = (blocks.clone(), hashes.clone(), computed, Status::Running);
            self.counts.prefill_saved += q.prompt_len;
            self.running.push(f);
        }
        forks
    }

    /// The positions cached in the blocks running sequences hold (a shared block counted once).
    pub fn cached_positions(&self) -> usize {
        let bs = self.pool.block_size();
        let mut fill = std::collections::HashMap::new();
        for &s in &self.running {
            let q = &self.seqs[s];
            for (i, &b) in q.blocks.iter().enumerate() {
                let f = q.computed.saturating_sub(i * bs).min(bs);
                let e = fill.entry(b).or_insert(0);
                *e = f.max(*e);
            }
        }
        fill.values().sum()
    }

    /// The next token of `s`.
    pub fn append(&mut self, s: SeqId, token: u32) {
        self.seqs[s].tokens.push(token);
    }

    /// `s` is done: its blocks go back (full ones stay cached).
    pub fn finish(&mut self, s: SeqId) {
        self.running.retain(|&r| r != s);
        self.waiting.retain(|&r| r != s);
        self.release_blocks(s);
        self.seqs[s].status = Status::Done;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Run `sched` to the end as an engine would, each sequence generating `new` tokens (its id, then
    /// counting), and check at every step that a step's tokens fit the budget, that no two running
    /// sequences write one slot, and that the seats are kept. Returns the steps and each sequence's tokens.
    fn drive(
        sched: &mut Scheduler,
        ids: &[SeqId],
        new: usize,
        budget: usize,
        seats: usize,
    ) -> (Vec<Step>, Vec<Vec<u32>>) {
        let mut steps = Vec::new();
        let mut produced = vec![0usize; ids.len()];
        while !sched.is_idle() {
            let step = sched.schedule();
            assert!(!step.entries.is_empty() || !step.preempted.is_empty(), "a step with nothing to run");
            assert!(step.tokens() <= budget, "{} tokens over the budget {budget}", step.tokens());
            assert!(sched.running() <= seats, "{} running over {seats} seats", sched.running());
            let mut slots = std::collections::HashSet::new();
            for e in &step.entries {
                for p in e.start..e.start + e.len {
                    assert!(slots.insert(sched.slot(e.seq, p)), "slot written twice in a step");
                }
            }
            let forked = sched.computed(&step);
            let mut sampling: Vec<SeqId> = step.entries.iter().filter(|e| e.sample).map(|e| e.seq).collect();
            sampling.extend(forked.into_iter().flat_map(|(_, f)| f));
            for s in sampling {
                let i = ids.iter().position(|&x| x == s).unwrap();
                produced[i] += 1;
                sched.append(s, (s * 1000 + produced[i]) as u32);
                if produced[i] == new {
                    sched.finish(s);
                }
            }
            steps.push(step);
        }
        let tokens = ids.iter().map(|&s| sched.tokens(s)[sched.prompt_len(s)..].to_vec()).collect();
        (steps, tokens)
    }

    fn prompt(seed: u32, len: usize) -> Vec<u32> {
        (0..len as u32).map(|i| seed * 100 + i).collect()
    }

    /// Sequences are admitted as seats free up, decoding ones run before new prompts, a long prompt is
    /// prefilled in chunks of the budget, and every block comes back at the end.
    #[test]
    fn admits_as_sequences_finish_and_chunks_long_prompts() {
        let mut sched = Scheduler::new(BlockPool::new(64, 4), 2, 8);
        let mut ids = Vec::new();
        for (i, len) in [3, 20, 5].into_iter().enumerate() {
            ids.extend(sched.add(&prompt(i as u32, len), 1));
        }
        let (steps, tokens) = drive(&mut sched, &ids, 3, 8, 2);
        // Step 1: seq 0's 3 prompt tokens and 5 of seq 1's 20.
        assert_eq!(
            steps[0].entries,
            vec![Entry { seq: 0, start: 0, len: 3, sample: true }, Entry { seq: 1, start: 0, len: 5, sample: false },]
        );
        // Step 2: seq 0 decodes first, then seq 1's next chunk of 7.
        assert_eq!(steps[1].entries[0], Entry { seq: 0, start: 3, len: 1, sample: true });
        assert_eq!(steps[1].entries[1], Entry { seq: 1, start: 5, len: 7, sample: false });
        // Seq 2 waits for a seat: it enters the step after seq 0's third token.
        let first_of_2 = steps.iter().position(|s| s.entries.iter().any(|e| e.seq == 2)).unwrap();
        let last_of_0 = steps.iter().rposition(|s| s.entries.iter().any(|e| e.seq == 0)).unwrap();
        assert_eq!(first_of_2, last_of_0 + 1);
        assert_eq!(tokens, vec![vec![1, 2, 3], vec![1001, 1002, 1003], vec![2001, 2002, 2003]]);
        assert_eq!(sched.pool().in_use(), 0);
        assert_eq!(sched.counts.prefill_computed, 28);
    }

    /// When the pool runs out the newest sequence is preempted and computed again later (its prompt and
    /// what it had generated); everything still finishes with the same tokens, and nothing leaks.
    #[test]
    fn preempts_the_newest_when_the_pool_runs_out() {
        // 3 sequences of 4 + 8 positions need 3 blocks of 4 each: 6 blocks hold two of them.
        let mut sched = Scheduler::new(BlockPool::new(6, 4), 3, 64);
        let ids: Vec<SeqId> = (0..3).flat_map(|i| sched.add(&prompt(i, 4), 1)).collect();
        let (steps, tokens) = drive(&mut sched, &ids, 8, 64, 3);
        assert!(sched.counts.preemptions > 0);
        assert!(steps.iter().any(|s| s.preempted.contains(&2)), "the newest goes first");
        for (i, t) in tokens.iter().enumerate() {
            assert_eq!(t, &(1..=8).map(|k| (i * 1000 + k) as u32).collect::<Vec<_>>());
        }
        assert_eq!(sched.pool().in_use(), 0);
    }

    /// The n samples of a problem prefill its prompt once and share its blocks; the partly filled last
    /// block is copied for every writer but the last; the full ones stay shared.
    #[test]
    fn samples_share_their_prompt_and_copy_its_partial_block() {
        let mut sched = Scheduler::new(BlockPool::new(32, 4), 8, 64);
        let ids = sched.add(&prompt(1, 10), 4);
        let step = sched.schedule();
        assert_eq!(step.entries, vec![Entry { seq: 0, start: 0, len: 10, sample: true }]);
        let forked = sched.computed(&step);
        assert_eq!(forked, vec![(0, vec![1, 2, 3])]);
        assert_eq!(sched.pool().in_use(), 3, "the prompt's 3 blocks, shared");
        assert_eq!(sched.pool().refs(sched.blocks(0)[0]), 4);
        for &s in &ids {
            sched.append(s, 7);
        }
        let step = sched.schedule();
        assert_eq!(step.entries.len(), 4);
        assert_eq!(step.copies.len(), 3, "three copies of the partial block, the last writer keeps it");
        assert!(step.copies.iter().all(|c| c.len == 2));
        assert_eq!(sched.blocks(1)[..2], sched.blocks(0)[..2]);
        assert_ne!(sched.blocks(1)[2], sched.blocks(0)[2]);
        assert_eq!(sched.counts.prefill_computed, 10);
        assert_eq!(sched.counts.prefill_saved, 30);
        sched.computed(&step);
        ids.iter().for_each(|&s| sched.finish(s));
        assert_eq!(sched.pool().in_use(), 0);
    }

    /// A prompt that starts with the full blocks of an earlier one (the same system prompt and template)
    /// takes them from the cache and prefills only the rest; its last token is always computed.
    #[test]
    fn later_prompts_reuse_the_cached_blocks_of_a_shared_prefix() {
        let mut sched = Scheduler::new(BlockPool::new(32, 4), 1, 64);
        let system = prompt(9, 8);
        let a = sched.add(&[system.clone(), vec![1, 2, 3]].concat(), 1);
        drive(&mut sched, &a, 2, 64, 1);
        let b = sched.add(&[system.clone(), vec![4, 5]].concat(), 1);
        let step = sched.schedule();
        assert_eq!(step.entries, vec![Entry { seq: b[0], start: 8, len: 2, sample: true }]);
        assert_eq!(sched.counts.prefill_saved, 8);
        // The same prompt again: all but the last block's last token could come from the cache.
        sched.computed(&step);
        sched.finish(b[0]);
        let c = sched.add(&system, 1);
        let step = sched.schedule();
        assert_eq!(step.entries, vec![Entry { seq: c[0], start: 4, len: 4, sample: true }]);
    }
}
