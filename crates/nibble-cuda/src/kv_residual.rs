//! The residual slots of a GPU pool whose format defers a side (`kv4c`, `kv2c`, mixes with a `4c`
//! or `2c` side): which slot of the 16-bit residual area holds the raw rows of each block being
//! filled. Host bookkeeping only; the slots themselves live in [`crate::kv::CudaKv`].
//!
//! The CPU reference (`nibble_cpu::kv`) keeps a block's raw keys and values from its slot-0 write
//! until its last slot is written, when it quantizes the block as a whole; a query reads its own
//! block raw and every earlier block quantized, whether that block filled in this call or
//! before. On the GPU the append writes every token's raw rows into its block's residual slot, a
//! pack kernel quantizes the blocks whose last slot this call wrote, and attention reads a
//! query's own block from the residual. So every block a call touches needs a slot for that
//! call, and a block left partly filled keeps its slot until a later call fills it or the
//! engine releases it.
//!
//! [`ResidualSlots::plan`] checks a whole batch before it changes anything (slot order, a block
//! named twice, capacity), so a refused call loses nothing; [`ResidualSlots::finish`] gives back
//! the slots of the blocks the call filled once its kernels are queued (the stream orders their
//! reuse after this call's reads).

use std::collections::HashMap;

use nibble_core::{Error, Result};
use nibble_model::BatchLayout;

/// Marks a block of a residual table that has no slot (a block the call does not touch).
pub const NO_SLOT: i32 = -1;

/// A block being filled: its residual slot and how many of its slots hold rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Filling {
    slot: u32,
    filled: usize,
}

/// The residual slots of one layer of a pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResidualSlots {
    block_size: usize,
    capacity: usize,
    /// Slots not held by any block, popped from the end.
    free: Vec<u32>,
    filling: HashMap<u32, Filling>,
}

/// What one forward call writes where: per sequence of the batch, its block table's residual
/// slots (`NO_SLOT` for blocks the call does not touch), row-major with `max_blocks` columns,
/// the layout of the block tables the kernels read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResidualPlan {
    pub max_blocks: usize,
    pub tables: Vec<i32>,
    /// Blocks whose last slot this call writes: packed by the call, their slots free after it.
    pub filled: Vec<u32>,
    /// The holdings after the call, applied by [`ResidualSlots::finish`].
    after: HashMap<u32, Filling>,
    free_after: Vec<u32>,
}

impl ResidualSlots {
    /// `capacity` slots for blocks of `block_size` tokens.
    pub fn new(capacity: usize, block_size: usize) -> ResidualSlots {
        ResidualSlots {
            block_size,
            capacity,
            free: (0..capacity as u32).rev().collect(),
            filling: HashMap::new(),
        }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Slots held by blocks being filled.
    pub fn held(&self) -> usize {
        self.filling.len()
    }

    /// The slots `batch` needs beyond those its partly filled blocks already hold: what a caller
    /// must make room for before [`Self::plan`] can succeed.
    pub fn needed(&self, batch: &BatchLayout) -> usize {
        let bs = self.block_size;
        batch
            .seqs
            .iter()
            .filter(|s| s.len > 0)
            .map(|s| {
                let (first, last) = (s.start_pos / bs, (s.start_pos + s.len - 1) / bs);
                let carried = s.start_pos % bs != 0
                    && s.blocks
                        .get(first)
                        .is_some_and(|b| self.filling.contains_key(b));
                last - first + 1 - carried as usize
            })
            .sum()
    }

    /// Grows the area to `capacity` slots (the caller has grown the device memory and copied the
    /// held slots, which keep their numbers).
    pub fn grow(&mut self, capacity: usize) {
        if capacity > self.capacity {
            self.free
                .splice(0..0, (self.capacity as u32..capacity as u32).rev());
            self.capacity = capacity;
        }
    }

    /// Assigns the slots of a forward call over `batch`, without changing anything: a block
    /// written from slot 0 gets a free slot, a block continued mid-way must hold one already and
    /// be continued at its next slot. The tables are `width` columns wide: the width of the block
    /// tables the kernels read with them (`max_blocks` there), at least every sequence's block
    /// count. Errors name the block and leave the holdings as they were.
    pub fn plan(&self, batch: &BatchLayout, width: usize) -> Result<ResidualPlan> {
        let bs = self.block_size;
        let max_blocks = width;
        if let Some(s) = batch.seqs.iter().find(|s| s.blocks.len() > width) {
            return Err(Error::InvalidArgument(format!(
                "a block table of {} blocks in residual tables {width} wide",
                s.blocks.len()
            )));
        }
        let mut tables = vec![NO_SLOT; batch.seqs.len() * max_blocks];
        let mut after = self.filling.clone();
        let mut free = self.free.clone();
        let mut filled = Vec::new();
        // Slots of blocks this call fills: free only after it, since its append writes every
        // touched block's rows before its pack and attention read them.
        let mut released = Vec::new();
        // Blocks this call writes: the sequence that wrote each, and its slot.
        let mut touched: HashMap<u32, (usize, u32)> = HashMap::new();
        for (i, s) in batch.seqs.iter().enumerate() {
            if s.len == 0 {
                continue;
            }
            let end = s.start_pos + s.len;
            if end.div_ceil(bs) > s.blocks.len() {
                return Err(Error::InvalidArgument(format!(
                    "a sequence writing positions {}..{end} has {} KV blocks of {bs} tokens",
                    s.start_pos,
                    s.blocks.len()
                )));
            }
            for bi in s.start_pos / bs..end.div_ceil(bs) {
                let block = s.blocks[bi];
                let from = s.start_pos.max(bi * bs) - bi * bs;
                let to = end.min((bi + 1) * bs) - bi * bs;
                let again = touched.get(&block).copied();
                if let Some((other, _)) = again
                    && (from != 0 || to == bs)
                {
                    return Err(Error::InvalidArgument(format!(
                        "KV block {block} is written by sequences {other} and {i} of one batch"
                    )));
                }
                let entry = if from == 0 {
                    // A block started afresh (a reused block drops what it held). The serving
                    // engine's padding sequences restart one spare block, slot 0 each, in one
                    // step: they share its slot, as the CPU lets each restart it.
                    let slot = match (again, after.get(&block)) {
                        (Some((_, slot)), _) => slot,
                        (None, Some(f)) => f.slot,
                        (None, None) => free.pop().ok_or_else(|| {
                            Error::InvalidArgument(format!(
                                "the KV pool's residual area holds {} blocks being filled, all \
                                 taken",
                                self.capacity
                            ))
                        })?,
                    };
                    Filling { slot, filled: 0 }
                } else {
                    match after.get(&block) {
                        Some(f) if f.filled == from => *f,
                        f => {
                            return Err(Error::InvalidArgument(format!(
                                "KV block {block} is written at slot {from} but holds {} tokens: \
                                 a cache with channel-wise keys quantizes a block when it fills, \
                                 so blocks are written in slot order from slot 0",
                                f.map_or(0, |f| f.filled)
                            )));
                        }
                    }
                };
                touched.insert(block, (i, entry.slot));
                tables[i * max_blocks + bi] = entry.slot as i32;
                if to == bs {
                    filled.push(block);
                    after.remove(&block);
                    released.push(entry.slot);
                } else {
                    after.insert(
                        block,
                        Filling {
                            slot: entry.slot,
                            filled: to,
                        },
                    );
                }
            }
        }
        free.extend(released);
        Ok(ResidualPlan {
            max_blocks,
            tables,
            filled,
            after,
            free_after: free,
        })
    }

    /// Applies a plan once its call is queued: the blocks it filled give their slots back, the
    /// rest keep theirs with their new fill.
    pub fn finish(&mut self, plan: ResidualPlan) {
        self.filling = plan.after;
        self.free = plan.free_after;
    }

    /// Applies `plan`, made on the first of `layers` when every layer's slots were equal (a
    /// forward pass), to all of them: one finish, its holdings copied, the plan's tables not.
    pub fn finish_shared(layers: &mut [ResidualSlots], plan: ResidualPlan) {
        if let Some((first, rest)) = layers.split_first_mut() {
            first.finish(plan);
            rest.iter_mut().for_each(|s| s.clone_from(first));
        }
    }

    /// The engine let go of these blocks: a partly filled one drops its slot (whoever gets the
    /// block next starts it at slot 0).
    pub fn release(&mut self, blocks: &[u32]) {
        for b in blocks {
            if let Some(f) = self.filling.remove(b) {
                self.free.push(f.slot);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nibble_model::SeqSpan;

    fn seq(blocks: &[u32], start_pos: usize, len: usize) -> SeqSpan {
        SeqSpan {
            blocks: blocks.to_vec(),
            start_pos,
            len,
        }
    }

    fn batch(seqs: Vec<SeqSpan>) -> BatchLayout {
        BatchLayout { seqs }
    }

    #[test]
    fn a_shared_plan_leaves_every_layer_as_finishing_each_would() {
        let mut alone = ResidualSlots::new(8, 16);
        alone.finish(alone.plan(&batch(vec![seq(&[5, 6], 0, 20)]), 3).unwrap());
        let mut layers = vec![alone.clone(); 3];
        let b = batch(vec![seq(&[5, 6], 20, 12), seq(&[2], 0, 4)]);
        let plan = alone.plan(&b, 3).unwrap();
        alone.finish(plan.clone());
        ResidualSlots::finish_shared(&mut layers, plan);
        assert!(
            layers.iter().all(|l| *l == alone),
            "{layers:?} against {alone:?}"
        );
        assert_eq!(alone.held(), 1, "block 6 filled, block 2 holds 4 rows");
    }

    #[test]
    fn a_prompt_holds_a_slot_per_block_and_keeps_only_the_partial_ones() {
        let mut r = ResidualSlots::new(8, 16);
        // 40 tokens: blocks 7 and 3 fill, block 9 keeps 8 rows.
        let b = batch(vec![seq(&[7, 3, 9], 0, 40)]);
        assert_eq!(r.needed(&b), 3);
        let p = r.plan(&b, 4).unwrap();
        assert_eq!(p.max_blocks, 4);
        assert!(p.tables[..3].iter().all(|&s| s >= 0) && p.tables[3] == NO_SLOT);
        let mut slots = p.tables[..3].to_vec();
        slots.sort();
        slots.dedup();
        assert_eq!(slots.len(), 3, "three distinct slots: {:?}", p.tables);
        assert_eq!(p.filled, vec![7, 3]);
        let kept = p.tables[2];
        r.finish(p);
        assert_eq!(r.held(), 1);
        // Decode steps continue block 9 in its slot until it fills.
        for pos in 40..48 {
            let b = batch(vec![seq(&[7, 3, 9], pos, 1)]);
            assert_eq!(r.needed(&b), 0);
            let p = r.plan(&b, 4).unwrap();
            assert_eq!(p.tables, vec![NO_SLOT, NO_SLOT, kept, NO_SLOT]);
            assert_eq!(p.filled, if pos == 47 { vec![9] } else { vec![] });
            r.finish(p);
        }
        assert_eq!(r.held(), 0);
        assert_eq!(r.free.len(), 8);
    }

    #[test]
    fn a_batch_of_sequences_gets_distinct_slots() {
        let mut r = ResidualSlots::new(4, 16);
        let b = batch(vec![seq(&[0], 0, 5), seq(&[1], 0, 16), seq(&[2, 4], 0, 20)]);
        let p = r.plan(&b, 4).unwrap();
        let live: Vec<i32> = p.tables.iter().copied().filter(|&s| s >= 0).collect();
        let mut d = live.clone();
        d.sort();
        d.dedup();
        assert_eq!(d.len(), live.len());
        assert_eq!(live.len(), 4);
        assert_eq!(p.filled, vec![1, 2]);
        r.finish(p);
        assert_eq!(r.held(), 2);
    }

    #[test]
    fn tables_are_as_wide_as_the_kernels_block_tables() {
        let r = ResidualSlots::new(8, 16);
        let b = batch(vec![seq(&[0, 1, 2], 0, 40), seq(&[3, 4, 5], 0, 33)]);
        let p = r.plan(&b, 4).unwrap();
        assert_eq!(p.tables.len(), 8);
        assert!(p.tables[..3].iter().all(|&s| s >= 0) && p.tables[3] == NO_SLOT);
        assert!(p.tables[4..7].iter().all(|&s| s >= 0) && p.tables[7] == NO_SLOT);
        let err = r.plan(&b, 2).unwrap_err().to_string();
        assert!(err.contains("3 blocks") && err.contains("2 wide"), "{err}");
    }

    #[test]
    fn padding_sequences_share_the_spare_block() {
        let mut r = ResidualSlots::new(4, 16);
        // Two decodes, then three padding sequences at slot 0 of spare block 9.
        r.finish(
            r.plan(&batch(vec![seq(&[1], 0, 5), seq(&[2], 0, 7)]), 2)
                .unwrap(),
        );
        let b = batch(vec![
            seq(&[1], 5, 1),
            seq(&[2], 7, 1),
            seq(&[9], 0, 1),
            seq(&[9], 0, 1),
            seq(&[9], 0, 1),
        ]);
        let p = r.plan(&b, 2).unwrap();
        let pad: Vec<i32> = (2..5).map(|i| p.tables[i * 2]).collect();
        assert!(pad.iter().all(|&s| s >= 0 && s == pad[0]), "{:?}", p.tables);
        r.finish(p);
        assert_eq!(r.held(), 3);
        // Writing past slot 0 of a block another sequence writes is still refused.
        let err = r
            .plan(&batch(vec![seq(&[9], 0, 1), seq(&[9], 1, 1)]), 2)
            .unwrap_err()
            .to_string();
        assert!(err.contains("block 9"), "{err}");
    }

    #[test]
    fn refusals_change_nothing() {
        let mut r = ResidualSlots::new(2, 16);
        r.finish(r.plan(&batch(vec![seq(&[5], 0, 3)]), 4).unwrap());
        let before = (r.free.clone(), r.filling.clone());
        // Out of order: block 5 holds 3 rows.
        let err = r
            .plan(&batch(vec![seq(&[5], 4, 1)]), 4)
            .unwrap_err()
            .to_string();
        assert!(err.contains("block 5") && err.contains("slot 4"), "{err}");
        // Continuing a block that holds nothing.
        let err = r
            .plan(&batch(vec![seq(&[6], 2, 1)]), 4)
            .unwrap_err()
            .to_string();
        assert!(err.contains("block 6"), "{err}");
        // A block two sequences write, the second past slot 0.
        let err = r
            .plan(&batch(vec![seq(&[8], 0, 1), seq(&[8], 1, 1)]), 4)
            .unwrap_err()
            .to_string();
        assert!(err.contains("block 8"), "{err}");
        // More blocks than slots: one is held, two more asked for.
        let b = batch(vec![seq(&[1, 2], 0, 20)]);
        assert_eq!(r.needed(&b), 2);
        let err = r.plan(&b, 4).unwrap_err().to_string();
        assert!(err.contains("residual"), "{err}");
        // A table too short for the positions.
        let err = r.plan(&batch(vec![seq(&[1], 10, 10)]), 4).unwrap_err();
        assert!(err.to_string().contains("KV blocks"), "{err}");
        assert_eq!((r.free.clone(), r.filling.clone()), before);
        // Growing makes room; held slots keep their numbers.
        r.grow(4);
        let p = r.plan(&b, 4).unwrap();
        assert!(p.tables.iter().all(|&s| s != r.filling[&5].slot as i32));
        r.finish(p);
        assert_eq!(r.held(), 2);
    }

    #[test]
    fn a_released_or_restarted_block_gives_its_slot_back() {
        let mut r = ResidualSlots::new(2, 16);
        r.finish(r.plan(&batch(vec![seq(&[5], 0, 3)]), 4).unwrap());
        let slot = r.filling[&5].slot;
        // Written again from slot 0 (the engine reused it): the same slot, fill restarted.
        let p = r.plan(&batch(vec![seq(&[5], 0, 2)]), 4).unwrap();
        assert_eq!(p.tables, vec![slot as i32, NO_SLOT, NO_SLOT, NO_SLOT]);
        r.finish(p);
        assert_eq!(r.filling[&5].filled, 2);
        r.release(&[5, 11]);
        assert_eq!(r.held(), 0);
        assert_eq!(r.free.len(), 2);
    }
}
