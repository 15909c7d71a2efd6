//! The paged KV pool: per layer, keys and values as `[block][slot][kv_head][head_dim]` f32.
//! Allocated zeroed, which the OS maps lazily, so an unused pool costs address space only.

use nibble_core::{Error, Result};
use nibble_model::KvShape;

pub struct CpuKvCache {
    pub shape: KvShape,
    pub block_size: usize,
    pub num_blocks: usize,
    pub k: Vec<Vec<f32>>,
    pub v: Vec<Vec<f32>>,
}

impl CpuKvCache {
    pub fn new(shape: KvShape, num_blocks: usize, block_size: usize) -> Result<Self> {
        let row = shape.num_kv_heads * shape.head_dim;
        let per_layer = num_blocks
            .checked_mul(block_size)
            .and_then(|t| t.checked_mul(row))
            .ok_or_else(|| Error::InvalidArgument("KV pool size overflows".into()))?;
        let alloc = || -> Result<Vec<f32>> {
            zeroed(per_layer).ok_or_else(|| Error::LimitExceeded {
                what: "KV pool bytes (the allocation failed)".into(),
                value: per_layer * 4 * 2 * shape.num_layers,
                limit: 0,
            })
        };
        Ok(CpuKvCache {
            shape,
            block_size,
            num_blocks,
            k: (0..shape.num_layers)
                .map(|_| alloc())
                .collect::<Result<_>>()?,
            v: (0..shape.num_layers)
                .map(|_| alloc())
                .collect::<Result<_>>()?,
        })
    }

    /// Offset (in floats) of position `pos` of a sequence with block table `blocks`.
    pub(crate) fn offset(&self, blocks: &[u32], pos: usize) -> usize {
        let row = self.shape.num_kv_heads * self.shape.head_dim;
        (blocks[pos / self.block_size] as usize * self.block_size + pos % self.block_size) * row
    }

    /// Checks that a block table covers `len` positions with blocks of this pool.
    pub(crate) fn check_table(&self, blocks: &[u32], len: usize) -> Result<()> {
        if blocks.len() * self.block_size < len {
            return Err(Error::InvalidArgument(format!(
                "{} blocks of {} cannot hold {len} positions",
                blocks.len(),
                self.block_size
            )));
        }
        if let Some(b) = blocks.iter().find(|&&b| b as usize >= self.num_blocks) {
            return Err(Error::InvalidArgument(format!(
                "block {b} is outside the {}-block KV pool",
                self.num_blocks
            )));
        }
        Ok(())
    }
}

/// A zeroed vector from `alloc_zeroed`, which the OS backs lazily: a large pool costs nothing
/// until used, and a failed allocation is an error instead of an abort.
fn zeroed(n: usize) -> Option<Vec<f32>> {
    if n == 0 {
        return Some(Vec::new());
    }
    let layout = std::alloc::Layout::array::<f32>(n).ok()?;
    // SAFETY: the layout is non-zero-sized; a non-null pointer from the global allocator with
    // the layout of `[f32; n]`, all zero bits (valid f32 0.0), is exactly what Vec expects.
    unsafe {
        let ptr = std::alloc::alloc_zeroed(layout) as *mut f32;
        (!ptr.is_null()).then(|| Vec::from_raw_parts(ptr, n, n))
    }
}
