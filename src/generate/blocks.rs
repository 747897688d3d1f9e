//! The paged KV cache's bookkeeping: a pool of fixed-size blocks (each `block_size` token positions of
//! every layer's keys and values), handed out to sequences whose block tables list them in order. Blocks
//! are reference-counted so that sequences share them (the n samples of a problem share their prompt's),
//! and a full block of prompt or generated tokens is remembered by a hash of its tokens and of every token
//! before it (its parent's hash), as vLLM's automatic prefix caching does: a later sequence that starts
//! with the same tokens takes the cached blocks instead of computing them again. A block whose last user
//! lets go stays cached (least recently used first out) until its space is needed.
//!
//! Nothing here touches a tensor: the engine writes and reads the pool's storage by the slots this module
//! hands out (`block * block_size + offset`).

use std::collections::{BTreeMap, HashMap};

/// A block's index in the pool.
pub type BlockId = u32;

/// The hash that names a full block: its tokens and (through the parent's hash) every token before it.
pub fn block_hash(parent: Option<u64>, tokens: &[u32]) -> u64 {
    use crate::checksum::splitmix64;
    let mut h = splitmix64(parent.unwrap_or(0x243F_6A88_85A3_08D3) ^ tokens.len() as u64);
    for &t in tokens {
        h = splitmix64(h ^ u64::from(t));
    }
    h
}

/// What a cached block holds, to tell a hash collision from a hit.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Cached {
    hash: u64,
    parent: Option<u64>,
    tokens: Vec<u32>,
}

/// The pool's blocks: reference counts, the never-used and the cached-but-unused ones.
#[derive(Debug)]
pub struct BlockPool {
    block_size: usize,
    refs: Vec<u32>,
    /// Blocks that hold nothing worth keeping, taken first.
    free: Vec<BlockId>,
    /// Per block, what it caches (set once the block is full).
    cached: Vec<Option<Cached>>,
    by_hash: HashMap<u64, BlockId>,
    /// Cached blocks nobody uses, by the tick they were let go (oldest first out).
    idle: BTreeMap<u64, BlockId>,
    idle_tick: Vec<u64>,
    tick: u64,
    /// Counts for the report: blocks reused from the prefix cache, and evicted from it.
    pub hits: usize,
    pub evictions: usize,
}

impl BlockPool {
    /// A pool of `blocks` blocks of `block_size` positions.
    pub fn new(blocks: usize, block_size: usize) -> Self {
        assert!(block_size > 0, "a block holds at least one position");
        BlockPool {
            block_size,
            refs: vec![0; blocks],
            free: (0..blocks as BlockId).rev().collect(),
            cached: vec![None; blocks],
            by_hash: HashMap::new(),
            idle: BTreeMap::new(),
            idle_tick: vec![0; blocks],
            tick: 0,
            hits: 0,
            evictions: 0,
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks in the pool.
    pub fn capacity(&self) -> usize {
        self.refs.len()
    }

    /// Blocks that can be handed out now (never used, or cached but unused).
    pub fn available(&self) -> usize {
        self.free.len() + self.idle.len()
    }

    /// Blocks some sequence holds.
    pub fn in_use(&self) -> usize {
        self.capacity() - self.available()
    }

    /// The users of `block`.
    pub fn refs(&self, block: BlockId) -> u32 {
        self.refs[block as usize]
    }

    /// A block for one user: a never-used one, else the least recently used cached one (forgotten).
    pub fn allocate(&mut self) -> Option<BlockId> {
        let block = match self.free.pop() {
            Some(b) => b,
            None => {
                let (_, b) = self.idle.pop_first()?;
                self.forget(b);
                self.evictions += 1;
                b
            }
        };
        self.refs[block as usize] = 1;
        Some(block)
    }

    /// One more user of `block` (a forked sequence sharing it).
    pub fn share(&mut self, block: BlockId) {
        let r = &mut self.refs[block as usize];
        assert!(*r > 0, "block {block} shared while free");
        *r += 1;
    }

    /// One user fewer; the last one's leaving keeps a cached block for reuse, frees any other.
    pub fn release(&mut self, block: BlockId) {
        let r = &mut self.refs[block as usize];
        assert!(*r > 0, "block {block} released while free");
        *r -= 1;
        if *r > 0 {
            return;
        }
        if self.cached[block as usize].is_some() {
            self.tick += 1;
            self.idle.insert(self.tick, block);
            self.idle_tick[block as usize] = self.tick;
        } else {
            self.free.push(block);
        }
    }

    /// The cached block of `tokens` after the blocks of hash `parent`, taken for one more user.
    pub fn lookup(&mut self, parent: Option<u64>, tokens: &[u32]) -> Option<(BlockId, u64)> {
        let hash = block_hash(parent, tokens);
        let &block = self.by_hash.get(&hash)?;
        let c = self.cached[block as usize].as_ref()?;
        if c.parent != parent || c.tokens != tokens {
            return None;
        }
        if self.refs[block as usize] == 0 {
            self.idle.remove(&self.idle_tick[block as usize]);
        }
        self.refs[block as usize] += 1;
        self.hits += 1;
        Some((block, hash))
    }

    /// Remember `block`, now full with `tokens` after the blocks of hash `parent`; returns its hash. A
    /// block of the same tokens already cached keeps its place (this one stays uncached).
    pub fn register(&mut self, block: BlockId, parent: Option<u64>, tokens: &[u32]) -> u64 {
        debug_assert_eq!(tokens.len(), self.block_size);
        let hash = block_hash(parent, tokens);
        if self.cached[block as usize].is_none() && !self.by_hash.contains_key(&hash) {
            self.by_hash.insert(hash, block);
            self.cached[block as usize] = Some(Cached { hash, parent, tokens: tokens.to_vec() });
        }
        hash
    }

    fn forget(&mut self, block: BlockId) {
        if let Some(c) = self.cached[block as usize].take() {
            self.by_hash.remove(&c.hash);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// 10,000 sequences of random lengths come and go, sharing and caching blocks: every block comes back,
    /// and no block is ever handed to two users that did not share it.
    #[test]
    fn no_block_leaks_after_ten_thousand_sequences() {
        let mut pool = BlockPool::new(64, 4);
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
        let mut live: Vec<Vec<BlockId>> = Vec::new();
        for _ in 0..10_000 {
            if live.len() > 6 || (!live.is_empty() && rng.gen_bool(0.4)) {
                let i = rng.gen_range(0..live.len());
                live.swap_remove(i).into_iter().for_each(|b| pool.release(b));
                continue;
            }
            let prefix: Vec<u32> = (0..4).map(|_| rng.gen_range(0..3)).collect();
            let mut blocks = Vec::new();
            match pool.lookup(None, &prefix) {
                Some((b, _)) => blocks.push(b),
                None => {
                    let Some(b) = pool.allocate() else { continue };
                    pool.register(b, None, &prefix);
                    blocks.push(b);
                }
            }
            for _ in 0..rng.gen_range(0..6) {
                match pool.allocate() {
                    Some(b) => blocks.push(b),
                    None => break,
                }
            }
            if rng.gen_bool(0.3) {
                let fork = blocks.clone();
                fork.iter().for_each(|&b| pool.share(b));
                live.push(fork);
            }
            live.push(blocks);
            let mut users = vec![0u32; pool.capacity()];
            live.iter().flatten().for_each(|&b| users[b as usize] += 1);
            for (b, &n) in users.iter().enumerate() {
                assert_eq!(pool.refs(b as BlockId), n, "block {b}");
            }
        }
        live.into_iter().flatten().for_each(|b| pool.release(b));
        assert_eq!(pool.available(), pool.capacity());
        assert_eq!(pool.in_use(), 0);
        assert!(pool.hits > 1000 && pool.evictions > 0, "hits {} evictions {}", pool.hits, pool.evictions);
    }

    /// A released cached block is found again by its tokens and parent, until a shortage evicts it (the
    /// least recently released first); a different parent or a collision with other tokens is no hit.
    #[test]
    fn cached_blocks_are_found_by_their_prefix_and_evicted_oldest_first() {
        let mut pool = BlockPool::new(3, 2);
        let a = pool.allocate().unwrap();
        let ha = pool.register(a, None, &[1, 2]);
        let b = pool.allocate().unwrap();
        pool.register(b, Some(ha), &[3, 4]);
        pool.release(a);
        pool.release(b);
        assert_eq!(pool.available(), 3);
        assert_eq!(pool.lookup(Some(ha), &[3, 4]).map(|x| x.0), Some(b));
        assert_eq!(pool.lookup(None, &[3, 4]), None, "another parent");
        pool.release(b);
        // One never-used block, then the oldest idle (a), then b.
        let c = pool.allocate().unwrap();
        assert!(c != a && c != b);
        assert_eq!(pool.allocate(), Some(a));
        assert_eq!(pool.lookup(None, &[1, 2]), None, "a was evicted");
        assert_eq!(pool.lookup(Some(ha), &[3, 4]).map(|x| x.0), Some(b));
        assert_eq!(pool.allocate(), None);
        assert_eq!(pool.evictions, 1);
    }
}
