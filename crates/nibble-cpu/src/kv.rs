//! The paged KV pool, stored per layer as the pool's [`KvSpec`] says, keys and values each in
//! their own side's format (byte layouts of the records: `nibble_precision::kv`):
//!
//! * a `16` side: `[block][slot][kv_head][head_dim]` f32, the CPU's float.
//! * an `8`, `4`, `fp8` side, and values of a `4c`/`2c` side: `[block][slot][kv_head]` records.
//! * keys of a `4c`/`2c` side: `[block][kv_head]` channel-wise block records.
//!
//! A deferred side (channel-wise keys, `4c`/`2c` values) is written only when a block's last slot
//! is; until then the block's keys and values sit in an f32 residual owned by that block,
//! allocated at its slot-0 write and dropped once the block is packed (or released half-filled),
//! so full-precision memory is only spent on blocks being filled. The residual holds what the
//! block's own queries read: the raw rows of a deferred side, and the dequantized records of a
//! side quantized as written (`k8` next to `v2c`), so a query reads the same values whether its
//! block filled in this call or not.
//!
//! Attention reads a quantized side through [`SeqView`]: the rows of one sequence dequantized
//! into a scratch buffer once per call (not once per query head), plus, for a buffered pool, the
//! residual of the block each query sits in. An f32 side is read in place.
//!
//! The pool is allocated zeroed, which the OS maps lazily, so an unused pool costs address
//! space only.

use std::collections::HashMap;

use nibble_core::{Error, Result};
use nibble_model::{BatchLayout, KvShape, SeqSpan};
use nibble_precision::KvSpec;
use nibble_precision::kv::{ChannelKeys, KeyLayout, TokenCodec, first_unstorable};

/// Below this many elements, a sequence's rows are dequantized on the calling thread.
const SERIAL_DEQUANT: usize = 32 * 1024;

pub struct CpuKvCache {
    pub shape: KvShape,
    pub block_size: usize,
    pub num_blocks: usize,
    layers: Vec<Layer>,
    scratch: Scratch,
}

/// How one side (keys or values) of a layer is stored.
enum Store {
    /// `[block][slot][kv_head][head_dim]` f32.
    Float(Vec<f32>),
    /// `[block][slot][kv_head]` records; `deferred`: written when the block fills.
    Tokens {
        codec: TokenCodec,
        data: Vec<u8>,
        deferred: bool,
    },
    /// `[block][kv_head]` block records, written when the block fills.
    Channel { codec: ChannelKeys, data: Vec<u8> },
}

struct Layer {
    k: Store,
    v: Store,
    /// Buffered pools: whether a block's deferred records hold its current contents (it was
    /// filled since its last slot-0 write). Empty otherwise.
    packed: Vec<bool>,
    residual: HashMap<u32, Residual>,
}

/// What the queries inside a block being filled read, `[slot][kv_head][head_dim]`.
struct Residual {
    k: Vec<f32>,
    v: Vec<f32>,
    filled: usize,
}

/// Dequantized rows of one sequence, `[position][kv_head][head_dim]`, reused across calls.
#[derive(Default)]
pub(crate) struct Scratch {
    k: Vec<f32>,
    v: Vec<f32>,
}

impl Store {
    fn bytes(&self) -> usize {
        match self {
            Store::Float(d) => 4 * d.len(),
            Store::Tokens { data, .. } | Store::Channel { data, .. } => data.len(),
        }
    }

    /// Writes the row `x` (`[kv_head][head_dim]`) of pool slot `slot` (block * block_size +
    /// slot in block) if this side is written as it comes; `seen`, when given, gets the values
    /// attention will read back for it.
    fn write_row(
        &mut self,
        slot: usize,
        x: &[f32],
        hd: usize,
        seen: Option<&mut [f32]>,
    ) -> Result<()> {
        let row = x.len();
        match self {
            Store::Float(d) => {
                d[slot * row..(slot + 1) * row].copy_from_slice(x);
                if let Some(seen) = seen {
                    seen.copy_from_slice(x);
                }
            }
            Store::Tokens {
                codec,
                data,
                deferred: false,
            } => {
                let rb = codec.record_bytes(hd);
                let heads = row / hd;
                let recs = &mut data[slot * heads * rb..(slot + 1) * heads * rb];
                for (rec, xh) in recs.chunks_exact_mut(rb).zip(x.chunks_exact(hd)) {
                    codec.quantize(xh, rec)?;
                }
                if let Some(seen) = seen {
                    for (rec, o) in recs.chunks_exact(rb).zip(seen.chunks_exact_mut(hd)) {
                        codec.dequantize(rec, o);
                    }
                }
            }
            Store::Tokens { deferred: true, .. } | Store::Channel { .. } => {
                if let Some(seen) = seen {
                    seen.copy_from_slice(x);
                }
            }
        }
        Ok(())
    }

    /// Packs block `b` of a deferred side from its raw rows `r` (`[slot][kv_head][head_dim]`).
    fn pack_block(
        &mut self,
        b: usize,
        r: &[f32],
        heads: usize,
        hd: usize,
        bs: usize,
    ) -> Result<()> {
        let row = heads * hd;
        match self {
            Store::Tokens {
                codec,
                data,
                deferred: true,
            } => {
                let rb = codec.record_bytes(hd);
                let recs = &mut data[b * bs * heads * rb..(b + 1) * bs * heads * rb];
                for (rec, x) in recs.chunks_exact_mut(rb).zip(r.chunks_exact(hd)) {
                    codec.quantize(x, rec)?;
                }
            }
            Store::Channel { codec, data } => {
                let kb = codec.block_bytes(hd, bs);
                for h in 0..heads {
                    let out = &mut data[(b * heads + h) * kb..(b * heads + h + 1) * kb];
                    codec.quantize(&r[h * hd..], row, bs, hd, out)?;
                }
            }
            Store::Float(_)
            | Store::Tokens {
                deferred: false, ..
            } => {}
        }
        Ok(())
    }

    /// Dequantizes the rows of block `b` into `out` (`[slot][kv_head][head_dim]`, as many slots
    /// as it holds; a channel-wise side is only read whole).
    fn dequantize_block(&self, b: usize, out: &mut [f32], heads: usize, hd: usize, bs: usize) {
        match self {
            Store::Tokens { codec, data, .. } => {
                let rb = codec.record_bytes(hd);
                let first = b * bs * heads;
                for (i, o) in out.chunks_exact_mut(hd).enumerate() {
                    let at = (first + i) * rb;
                    codec.dequantize(&data[at..at + rb], o);
                }
            }
            Store::Channel { codec, data } => {
                let kb = codec.block_bytes(hd, bs);
                for h in 0..heads {
                    let rec = &data[(b * heads + h) * kb..(b * heads + h + 1) * kb];
                    codec.dequantize(rec, bs, hd, &mut out[h * hd..], heads * hd);
                }
            }
            Store::Float(_) => unreachable!("an f32 side is read in place"),
        }
    }
}

/// Where the key or value row of a position is.
#[derive(Clone, Copy)]
enum Rows<'a> {
    /// The f32 pool itself, through the block table.
    Paged {
        data: &'a [f32],
        blocks: &'a [u32],
        block_size: usize,
        row: usize,
    },
    /// Dequantized rows from position `first` (a sliding window's first block).
    Dense {
        data: &'a [f32],
        row: usize,
        first: usize,
    },
}

impl<'a> Rows<'a> {
    #[inline]
    fn at(&self, p: usize, off: usize, len: usize) -> &'a [f32] {
        match *self {
            Rows::Paged {
                data,
                blocks,
                block_size,
                row,
            } => {
                let slot = blocks[p / block_size] as usize * block_size + p % block_size;
                &data[slot * row + off..][..len]
            }
            Rows::Dense { data, row, first } => &data[(p - first) * row + off..][..len],
        }
    }
}

/// What the queries of one sequence read in one attention call.
pub(crate) struct SeqView<'a> {
    keys: Rows<'a>,
    values: Rows<'a>,
    /// Buffered pools: the residual (keys, values) of each block holding a query of this call,
    /// from block index `own_first`.
    own: Vec<(&'a [f32], &'a [f32])>,
    own_first: usize,
    block_size: usize,
    buffered: bool,
}

impl<'a> SeqView<'a> {
    /// A query at `pos` reads positions `..split(pos)` through [`Self::key`]/[`Self::value`] and
    /// the rest, up to `pos`, from [`Self::own`]: its own block's residual for a buffered pool
    /// (so a query sees the same values whether its block filled in this call or not), nothing
    /// for the others.
    #[inline]
    pub fn split(&self, pos: usize) -> usize {
        if self.buffered {
            pos / self.block_size * self.block_size
        } else {
            pos + 1
        }
    }

    #[inline]
    pub fn key(&self, p: usize, off: usize, len: usize) -> &'a [f32] {
        self.keys.at(p, off, len)
    }

    #[inline]
    pub fn value(&self, p: usize, off: usize, len: usize) -> &'a [f32] {
        self.values.at(p, off, len)
    }

    /// Residual (keys, values) of the block holding `pos`, `[slot][kv_head][head_dim]` from
    /// slot 0; empty when `split(pos) == pos + 1`.
    #[inline]
    pub fn own(&self, pos: usize) -> (&'a [f32], &'a [f32]) {
        if self.buffered {
            self.own[pos / self.block_size - self.own_first]
        } else {
            (&[], &[])
        }
    }
}

impl CpuKvCache {
    pub fn new(shape: KvShape, num_blocks: usize, block_size: usize) -> Result<Self> {
        shape.format.check_block_size(block_size)?;
        if shape.num_kv_heads == 0 || shape.head_dim == 0 {
            return Err(Error::InvalidArgument(format!(
                "a KV pool needs KV heads and a head dim: {shape:?}"
            )));
        }
        let (heads, hd) = (shape.num_kv_heads, shape.head_dim);
        let slots = num_blocks
            .checked_mul(block_size)
            .and_then(|t| t.checked_mul(heads))
            .ok_or_else(|| Error::InvalidArgument("KV pool size overflows".into()))?;
        let total = shape.format.bytes_per_token(heads, hd, block_size, 4)
            * (num_blocks * block_size * shape.num_layers) as f64;
        let failed = || Error::LimitExceeded {
            what: format!("{} KV pool bytes (the allocation failed)", shape.format),
            value: total as usize,
            limit: 0,
        };
        let floats = |n: usize| -> Result<Vec<f32>> {
            let n = n.checked_mul(hd).ok_or_else(failed)?;
            zeroed(n).ok_or_else(failed)
        };
        let bytes = |n: usize, each: usize| -> Result<Vec<u8>> {
            let n = n.checked_mul(each).ok_or_else(failed)?;
            zeroed(n).ok_or_else(failed)
        };
        let tokens = |codec: TokenCodec, deferred| -> Result<Store> {
            Ok(Store::Tokens {
                codec,
                data: bytes(slots, codec.record_bytes(hd))?,
                deferred,
            })
        };
        let buffered = shape.format.buffered();
        let mut layers = Vec::with_capacity(shape.num_layers);
        for _ in 0..shape.num_layers {
            let k = match shape.format.keys() {
                KeyLayout::Float => Store::Float(floats(slots)?),
                KeyLayout::PerToken(codec) => tokens(codec, false)?,
                KeyLayout::PerChannel(codec) => Store::Channel {
                    codec,
                    data: bytes(num_blocks * heads, codec.block_bytes(hd, block_size))?,
                },
            };
            let v = match shape.format.values() {
                None => Store::Float(floats(slots)?),
                Some(codec) => tokens(codec, shape.format.values_deferred())?,
            };
            layers.push(Layer {
                k,
                v,
                packed: vec![false; if buffered { num_blocks } else { 0 }],
                residual: HashMap::new(),
            });
        }
        Ok(CpuKvCache {
            shape,
            block_size,
            num_blocks,
            layers,
            scratch: Scratch::default(),
        })
    }

    /// Bytes one token takes in the pool, all layers, keys and values (a full block's share of
    /// the channel-wise parameters included, residual buffers not).
    pub fn bytes_per_token(&self) -> f64 {
        Self::bytes_per_token_of(self.shape, self.block_size)
    }

    /// [`Self::bytes_per_token`] of a pool of this shape and block size.
    pub fn bytes_per_token_of(shape: KvShape, block_size: usize) -> f64 {
        shape
            .format
            .bytes_per_token(shape.num_kv_heads, shape.head_dim, block_size, 4)
            * shape.num_layers as f64
    }

    /// Bytes the pool's storage occupies (what it reserved; the OS commits pages as used).
    pub fn pool_bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| l.k.bytes() + l.v.bytes() + l.packed.len())
            .sum()
    }

    /// Bytes held by full-precision residuals of blocks being filled, all layers.
    pub fn residual_bytes(&self) -> usize {
        self.layers
            .iter()
            .flat_map(|l| l.residual.values())
            .map(|r| 4 * (r.k.len() + r.v.len()))
            .sum()
    }

    /// Drops the residuals of released blocks (see `Backend::release_kv_blocks`). Packed
    /// contents stay: a full block may live on in the prefix cache.
    pub fn release_blocks(&mut self, blocks: &[u32]) {
        for layer in &mut self.layers {
            for b in blocks {
                layer.residual.remove(b);
            }
        }
    }

    fn row(&self) -> usize {
        self.shape.num_kv_heads * self.shape.head_dim
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

    /// Writes the batch's keys and values (`[token][kv_head][head_dim]`, batch order) into
    /// `layer`. Everything is checked before anything is written. Returns the blocks this call
    /// packed, whose residuals [`Self::finish_write`] drops once attention has read them.
    pub(crate) fn write(
        &mut self,
        layer: usize,
        batch: &BatchLayout,
        k: &[f32],
        v: &[f32],
    ) -> Result<Vec<u32>> {
        let row = self.row();
        let (bs, heads, hd) = (
            self.block_size,
            self.shape.num_kv_heads,
            self.shape.head_dim,
        );
        let format = self.shape.format;
        for s in &batch.seqs {
            self.check_table(&s.blocks, s.start_pos + s.len)?;
        }
        let n = batch.num_tokens() * row;
        for (what, xs, quantized) in [
            ("key", &k[..n], format.k.is_quantized()),
            ("value", &v[..n], format.v.is_quantized()),
        ] {
            // An f32 side stores whatever it is given, NaN included, as any float cache does.
            if !quantized {
                continue;
            }
            if let Some(i) = first_unstorable(xs) {
                return Err(Error::InvalidArgument(format!(
                    "layer {layer}: {what} {} (batch row {}, element {}) cannot be stored \
                     in a {format} KV cache, which takes finite values within ±65504",
                    xs[i],
                    i / row,
                    i % row
                )));
            }
        }
        let Layer {
            k: pk,
            v: pv,
            packed,
            residual,
        } = self.layers.get_mut(layer).ok_or_else(|| {
            Error::InvalidArgument(format!("layer {layer} is outside the KV pool"))
        })?;
        let mut packed_now = Vec::new();
        if !format.buffered() {
            let mut src = 0;
            for s in &batch.seqs {
                for pos in s.start_pos..s.start_pos + s.len {
                    let slot = s.blocks[pos / bs] as usize * bs + pos % bs;
                    pk.write_row(slot, &k[src..src + row], hd, None)?;
                    pv.write_row(slot, &v[src..src + row], hd, None)?;
                    src += row;
                }
            }
            return Ok(packed_now);
        }
        // Slot order is what lets a block be quantized as a whole when its last slot is
        // written; a sequence resuming mid-block must find that block's residual.
        for s in &batch.seqs {
            let slot = s.start_pos % bs;
            let block = s.blocks[s.start_pos / bs];
            let filled = residual.get(&block).map_or(0, |r| r.filled);
            if slot != 0 && filled != slot {
                return Err(out_of_order(format, block, slot, filled));
            }
        }
        let mut src = 0;
        for s in &batch.seqs {
            for pos in s.start_pos..s.start_pos + s.len {
                let (slot, block) = (pos % bs, s.blocks[pos / bs]);
                if slot == 0 {
                    residual.insert(
                        block,
                        Residual {
                            k: vec![0.0; bs * row],
                            v: vec![0.0; bs * row],
                            filled: 0,
                        },
                    );
                    packed[block as usize] = false;
                }
                // A batch naming one block twice would get here out of order.
                let r = match residual.get_mut(&block) {
                    Some(r) if r.filled == slot => r,
                    r => {
                        return Err(out_of_order(format, block, slot, r.map_or(0, |r| r.filled)));
                    }
                };
                let at = block as usize * bs + slot;
                let own = slot * row..(slot + 1) * row;
                pk.write_row(at, &k[src..src + row], hd, Some(&mut r.k[own.clone()]))?;
                pv.write_row(at, &v[src..src + row], hd, Some(&mut r.v[own]))?;
                r.filled += 1;
                src += row;
                if r.filled == bs {
                    let b = block as usize;
                    pk.pack_block(b, &r.k, heads, hd, bs)?;
                    pv.pack_block(b, &r.v, heads, hd, bs)?;
                    packed[b] = true;
                    packed_now.push(block);
                }
            }
        }
        Ok(packed_now)
    }

    /// Drops the residuals of blocks packed by the last [`Self::write`], after attention read
    /// them for the queries inside those blocks.
    pub(crate) fn finish_write(&mut self, layer: usize, packed_now: &[u32]) {
        if let Some(l) = self.layers.get_mut(layer) {
            for b in packed_now {
                l.residual.remove(b);
            }
        }
    }

    pub(crate) fn take_scratch(&mut self) -> Scratch {
        std::mem::take(&mut self.scratch)
    }

    pub(crate) fn put_scratch(&mut self, scratch: Scratch) {
        self.scratch = scratch;
    }

    /// What the queries of `s` (already written) read in `layer`, from position `first` on (a
    /// sliding window's start for the call's first query; 0 without one): an f32 side in
    /// place, a quantized side's rows from `first`'s block on dequantized into `scratch`.
    pub(crate) fn view<'a>(
        &'a self,
        layer: usize,
        s: &'a SeqSpan,
        first: usize,
        scratch: &'a mut Scratch,
        pool: &crate::Threads,
    ) -> Result<SeqView<'a>> {
        let bs = self.block_size;
        let ctx = s.start_pos + s.len;
        // Blocks before the window's first are never read: not dequantized either.
        let first_block = first.min(ctx.saturating_sub(1)) / bs;
        let l = &self.layers[layer];
        let Scratch { k: sk, v: sv } = scratch;
        if !self.shape.format.buffered() {
            return Ok(SeqView {
                keys: self.side_rows(&l.k, &s.blocks, first_block, ctx, sk, pool),
                values: self.side_rows(&l.v, &s.blocks, first_block, ctx, sv, pool),
                own: Vec::new(),
                own_first: 0,
                block_size: bs,
                buffered: false,
            });
        }
        // Queries of this call sit in blocks own_first..=own_last; everything before their own
        // block is read packed.
        let (own_first, own_last) = (s.start_pos / bs, (ctx - 1) / bs);
        let first_block = first_block.min(own_last);
        if let Some(j) = (first_block..own_last).find(|&j| !l.packed[s.blocks[j] as usize]) {
            return Err(Error::InvalidArgument(format!(
                "KV block {} (positions {}..{}) is read before it was filled",
                s.blocks[j],
                j * bs,
                (j + 1) * bs
            )));
        }
        let own = (own_first..=own_last)
            .map(|j| {
                let need = bs.min(ctx - j * bs);
                match l.residual.get(&s.blocks[j]) {
                    Some(r) if r.filled >= need => Ok((&r.k[..], &r.v[..])),
                    _ => Err(Error::InvalidArgument(format!(
                        "KV block {} lost the full-precision keys its queries read",
                        s.blocks[j]
                    ))),
                }
            })
            .collect::<Result<Vec<_>>>()?;
        let end = own_last * bs;
        Ok(SeqView {
            keys: self.side_rows(&l.k, &s.blocks, first_block, end, sk, pool),
            values: self.side_rows(&l.v, &s.blocks, first_block, end, sv, pool),
            own,
            own_first,
            block_size: bs,
            buffered: true,
        })
    }

    /// One side's rows of positions `first_block * block_size..end` of the sequence with block
    /// table `blocks`: an f32 side in place, a quantized one dequantized into `buf` (one task
    /// per block).
    fn side_rows<'a>(
        &self,
        side: &'a Store,
        blocks: &'a [u32],
        first_block: usize,
        end: usize,
        buf: &'a mut Vec<f32>,
        pool: &crate::Threads,
    ) -> Rows<'a> {
        let (row, bs) = (self.row(), self.block_size);
        let (heads, hd) = (self.shape.num_kv_heads, self.shape.head_dim);
        if let Store::Float(data) = side {
            return Rows::Paged {
                data,
                blocks,
                block_size: bs,
                row,
            };
        }
        let first = (first_block * bs).min(end);
        let n = end - first;
        buf.resize(n * row, 0.0);
        let task = |(j, out): (usize, &mut [f32])| {
            side.dequantize_block(blocks[first_block + j] as usize, out, heads, hd, bs)
        };
        if n * row < SERIAL_DEQUANT {
            buf[..n * row]
                .chunks_mut(bs * row)
                .enumerate()
                .for_each(task);
        } else {
            pool.par_chunks_mut(&mut buf[..n * row], bs * row, task);
        }
        Rows::Dense {
            data: &buf[..n * row],
            row,
            first,
        }
    }
}

fn out_of_order(format: KvSpec, block: u32, slot: usize, filled: usize) -> Error {
    Error::InvalidArgument(format!(
        "KV block {block} is written at slot {slot} but holds {filled} tokens: a {format} cache \
         quantizes a block when it fills, so blocks are written in slot order from slot 0"
    ))
}

/// Element types whose all-zero bit pattern is a valid value.
trait Zeroable: Copy {}
impl Zeroable for f32 {}
impl Zeroable for u8 {}

/// A zeroed vector from `alloc_zeroed`, which the OS backs lazily: a large pool costs nothing
/// until used, and a failed allocation is an error instead of an abort.
fn zeroed<T: Zeroable>(n: usize) -> Option<Vec<T>> {
    if n == 0 {
        return Some(Vec::new());
    }
    let layout = std::alloc::Layout::array::<T>(n).ok()?;
    // SAFETY: the layout is non-zero-sized; a non-null pointer from the global allocator with
    // the layout of `[T; n]`, all zero bits (a valid `T` for every `Zeroable`), is exactly what
    // Vec expects.
    unsafe {
        let ptr = std::alloc::alloc_zeroed(layout) as *mut T;
        (!ptr.is_null()).then(|| Vec::from_raw_parts(ptr, n, n))
    }
}
