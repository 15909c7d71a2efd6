//! Paged KV-cache bookkeeping: which physical blocks hold which sequence's keys and values.
//!
//! The KV pool is `num_blocks` blocks of `block_size` token slots each. A sequence owns a block
//! table (logical block i -> physical block). Blocks are reference-counted so sequences with a
//! common prompt prefix share them: every *full* block is identified by a hash chained over all
//! tokens up to its end, and a block whose last user left keeps its contents, parked in an LRU of
//! cached blocks, until the space is needed. Only the block manager decides placement; backends
//! just read and write the slots it names.

use std::collections::{HashMap, VecDeque};
use std::hash::{Hash, Hasher};

use nibble_core::{Error, Result};

pub type BlockId = u32;

/// How many leading full blocks of one sequence are hashed, and the hash of the last of them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HashChain {
    blocks: usize,
    last: Option<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct BlockState {
    refs: u32,
    /// Chained hash of the tokens up to the end of this block, once the block is full and
    /// registered in the prefix cache.
    hash: Option<u64>,
}

#[derive(Debug)]
pub struct BlockManager {
    block_size: usize,
    blocks: Vec<BlockState>,
    /// Blocks holding nothing worth keeping.
    free: Vec<BlockId>,
    /// Unreferenced blocks that still hold a cached prefix, least recently used first.
    evictable: VecDeque<BlockId>,
    by_hash: HashMap<u64, BlockId>,
    pub prefix_hits: u64,
    pub prefix_queries: u64,
}

/// Chained hash of one full block: depends on every token before it too.
pub fn block_hash(prev: Option<u64>, tokens: &[u32]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    prev.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

impl BlockManager {
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        assert!(block_size > 0, "block size must be positive");
        BlockManager {
            block_size,
            blocks: vec![
                BlockState {
                    refs: 0,
                    hash: None
                };
                num_blocks
            ],
            free: (0..num_blocks as BlockId).rev().collect(),
            evictable: VecDeque::new(),
            by_hash: HashMap::new(),
            prefix_hits: 0,
            prefix_queries: 0,
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks a new allocation can take (free plus evictable cached ones).
    pub fn available(&self) -> usize {
        self.free.len() + self.evictable.len()
    }

    /// Blocks referenced by at least one sequence.
    pub fn in_use(&self) -> usize {
        self.blocks.len() - self.available()
    }

    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    fn take_block(&mut self) -> Option<BlockId> {
        let id = match self.free.pop() {
            Some(id) => id,
            None => {
                let id = self.evictable.pop_front()?;
                if let Some(h) = self.blocks[id as usize].hash.take() {
                    self.by_hash.remove(&h);
                }
                id
            }
        };
        self.blocks[id as usize] = BlockState {
            refs: 1,
            hash: None,
        };
        Some(id)
    }

    fn retain(&mut self, id: BlockId) {
        let b = &mut self.blocks[id as usize];
        if b.refs == 0 {
            self.evictable.retain(|&e| e != id);
        }
        b.refs += 1;
    }

    /// Longest cached prefix of `tokens` in whole blocks, as the blocks holding it. At least one
    /// token is always left uncached so the caller has logits to sample from.
    pub fn match_prefix(&mut self, tokens: &[u32]) -> Vec<BlockId> {
        let mut hits = Vec::new();
        let mut prev = None;
        let full = tokens.len().saturating_sub(1) / self.block_size;
        for chunk in tokens.chunks(self.block_size).take(full) {
            let h = block_hash(prev, chunk);
            self.prefix_queries += 1;
            match self.by_hash.get(&h) {
                Some(&id) => {
                    self.prefix_hits += 1;
                    hits.push(id);
                    prev = Some(h);
                }
                None => break,
            }
        }
        hits
    }

    /// Builds the block table for a new sequence whose first `tokens` are known: reuses cached
    /// prefix blocks, allocates the rest. Returns the table and how many tokens are already
    /// cached. Fails (allocating nothing) when the pool cannot hold the sequence.
    pub fn allocate(&mut self, tokens: &[u32]) -> Result<(Vec<BlockId>, usize)> {
        let cached = self.match_prefix(tokens);
        let needed = self.blocks_for(tokens.len()).max(1) - cached.len();
        // Cached blocks about to be reused may sit in the evictable list: don't count them twice.
        let reusable_evictable = cached
            .iter()
            .filter(|&&id| self.blocks[id as usize].refs == 0)
            .count();
        if self.available() - reusable_evictable < needed {
            return Err(Error::LimitExceeded {
                what: "KV cache blocks".into(),
                value: self.in_use() + needed,
                limit: self.num_blocks(),
            });
        }
        for &id in &cached {
            self.retain(id);
        }
        let n_cached = cached.len() * self.block_size;
        let mut table = cached;
        for _ in 0..needed {
            table.push(self.take_block().expect("availability checked"));
        }
        Ok((table, n_cached))
    }

    /// Makes room for a sequence to grow to `new_len` tokens. Fails without change when the
    /// pool is exhausted (the scheduler then preempts someone).
    pub fn grow(&mut self, table: &mut Vec<BlockId>, new_len: usize) -> Result<()> {
        let needed = self.blocks_for(new_len).saturating_sub(table.len());
        if self.available() < needed {
            return Err(Error::LimitExceeded {
                what: "KV cache blocks".into(),
                value: self.in_use() + needed,
                limit: self.num_blocks(),
            });
        }
        for _ in 0..needed {
            table.push(self.take_block().expect("availability checked"));
        }
        Ok(())
    }

    /// Registers the full blocks among `tokens` (the sequence's tokens whose KV is written) in
    /// the prefix cache, so later requests with the same prefix can share them. `chain` remembers
    /// how far this sequence's blocks are hashed, so each block is hashed once, when it fills.
    pub fn register_full_blocks(
        &mut self,
        chain: &mut HashChain,
        table: &[BlockId],
        tokens: &[u32],
    ) {
        let full = (tokens.len() / self.block_size).min(table.len());
        for i in chain.blocks..full {
            let h = block_hash(
                chain.last,
                &tokens[i * self.block_size..(i + 1) * self.block_size],
            );
            chain.blocks = i + 1;
            chain.last = Some(h);
            let id = table[i];
            let b = &mut self.blocks[id as usize];
            if b.hash.is_none() && !self.by_hash.contains_key(&h) {
                b.hash = Some(h);
                self.by_hash.insert(h, id);
            }
        }
    }

    /// Releases a sequence's blocks; cached ones stay reusable until evicted.
    pub fn release(&mut self, table: &[BlockId]) {
        for &id in table {
            let b = &mut self.blocks[id as usize];
            debug_assert!(b.refs > 0, "double release of block {id}");
            b.refs = b.refs.saturating_sub(1);
            if b.refs == 0 {
                if b.hash.is_some() {
                    self.evictable.push_back(id);
                } else {
                    self.free.push(id);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocate_grow_release_accounting() {
        let mut bm = BlockManager::new(8, 4);
        let (mut t, cached) = bm.allocate(&[1, 2, 3, 4, 5]).unwrap();
        assert_eq!((t.len(), cached), (2, 0));
        assert_eq!(bm.in_use(), 2);
        bm.grow(&mut t, 9).unwrap();
        assert_eq!(t.len(), 3);
        bm.grow(&mut t, 12).unwrap();
        assert_eq!(t.len(), 3, "12 tokens still fit in 3 blocks of 4");
        bm.release(&t);
        assert_eq!((bm.in_use(), bm.available()), (0, 8));
    }

    #[test]
    fn exhaustion_is_an_error_and_allocates_nothing() {
        let mut bm = BlockManager::new(3, 4);
        let (_a, _) = bm.allocate(&[0; 8]).unwrap();
        let before = bm.available();
        assert!(bm.allocate(&[9; 9]).is_err());
        assert_eq!(bm.available(), before);
        let mut t = vec![];
        assert!(bm.grow(&mut t, 9).is_err());
        assert!(t.is_empty());
    }

    #[test]
    fn shared_prefix_reuses_blocks_and_survives_release() {
        let mut bm = BlockManager::new(16, 4);
        let prompt: Vec<u32> = (0..10).collect();
        let (a, cached) = bm.allocate(&prompt).unwrap();
        assert_eq!(cached, 0);
        bm.register_full_blocks(&mut HashChain::default(), &a, &prompt);
        // Same first 8 tokens, different tail: two blocks shared.
        let other: Vec<u32> = (0..8).chain([77, 78, 79]).collect();
        let (b, cached) = bm.allocate(&other).unwrap();
        assert_eq!(cached, 8);
        assert_eq!(&b[..2], &a[..2]);
        assert_ne!(b[2], a[2]);
        assert_eq!(bm.in_use(), 4, "2 shared + 1 tail each");
        bm.release(&a);
        bm.release(&b);
        assert_eq!(bm.in_use(), 0);
        // The prefix is still cached after everyone left...
        let (c, cached) = bm.allocate(&prompt).unwrap();
        assert_eq!((cached, &c[..2]), (8, &a[..2]));
        bm.release(&c);
        assert!(bm.prefix_hits >= 4);
    }

    #[test]
    fn different_earlier_tokens_never_match() {
        let mut bm = BlockManager::new(16, 2);
        let p: Vec<u32> = vec![1, 2, 3, 4, 5];
        let (a, _) = bm.allocate(&p).unwrap();
        bm.register_full_blocks(&mut HashChain::default(), &a, &p);
        // Second block equal ([3, 4]) but first differs: the chained hash must not match.
        let (_, cached) = bm.allocate(&[9, 9, 3, 4, 5]).unwrap();
        assert_eq!(cached, 0);
    }

    #[test]
    fn eviction_reclaims_cached_blocks_lru_first() {
        let mut bm = BlockManager::new(4, 2);
        let p1 = vec![1, 2, 3];
        let (a, _) = bm.allocate(&p1).unwrap();
        bm.register_full_blocks(&mut HashChain::default(), &a, &p1);
        bm.release(&a);
        assert_eq!(bm.available(), 4);
        // Needs all four blocks: the cached one is evicted and its hash forgotten.
        let (b, _) = bm.allocate(&[7; 8]).unwrap();
        assert_eq!(b.len(), 4);
        bm.release(&b);
        let (_, cached) = bm.allocate(&p1).unwrap();
        assert_eq!(cached, 0);
    }

    #[test]
    fn whole_prompt_cached_still_leaves_a_token_to_compute() {
        let mut bm = BlockManager::new(8, 4);
        let p: Vec<u32> = (0..8).collect();
        let (a, _) = bm.allocate(&p).unwrap();
        bm.register_full_blocks(&mut HashChain::default(), &a, &p);
        let (b, cached) = bm.allocate(&p).unwrap();
        assert_eq!(
            cached, 4,
            "the last block is recomputed so the final token has logits"
        );
        assert_eq!(b.len(), 2);
    }
}
