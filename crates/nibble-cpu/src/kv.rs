//! The paged KV pool, stored per layer as the pool's [`KvFormat`] says (byte layouts of the
//! records: `nibble_precision::kv`):
//!
//! * `kv16`: keys and values as `[block][slot][kv_head][head_dim]` f32, the CPU's float.
//! * `kv8`, `kv4`, `kvfp8`: keys and values as `[block][slot][kv_head]` records, quantized as
//!   they are written.
//! * `kv4c`, `kv2c`: keys as `[block][kv_head]` channel-wise block records, values as
//!   `[block][slot][kv_head]` records. Both are written only when a block's last slot is; until
//!   then the block's keys and values sit in an f32 residual owned by that block, allocated at
//!   its slot-0 write and dropped once the block is packed (or released half-filled), so
//!   full-precision memory is only spent on blocks being filled.
//!
//! Attention reads a quantized pool through [`SeqView`]: the rows of one sequence dequantized
//! into a scratch buffer once per call (not once per query head), plus, for the channel-wise
//! formats, the residual of the block each query sits in.
//!
//! The pool is allocated zeroed, which the OS maps lazily, so an unused pool costs address
//! space only.

use std::collections::HashMap;

use nibble_core::{Error, Result};
use nibble_model::{BatchLayout, KvShape, SeqSpan};
use nibble_precision::KvFormat;
use nibble_precision::kv::{ChannelKeys, KeyLayout, TokenCodec, first_unstorable};
use rayon::prelude::*;

/// Below this many elements, a sequence's rows are dequantized on the calling thread.
const SERIAL_DEQUANT: usize = 32 * 1024;

pub struct CpuKvCache {
    pub shape: KvShape,
    pub block_size: usize,
    pub num_blocks: usize,
    layers: Vec<Layer>,
    scratch: Scratch,
}

enum Layer {
    Float {
        k: Vec<f32>,
        v: Vec<f32>,
    },
    Tokens {
        codec: TokenCodec,
        k: Vec<u8>,
        v: Vec<u8>,
    },
    Channel {
        keys: ChannelKeys,
        values: TokenCodec,
        k: Vec<u8>,
        v: Vec<u8>,
        /// Whether a block's records hold its current contents (it was filled since its last
        /// slot-0 write).
        packed: Vec<bool>,
        residual: HashMap<u32, Residual>,
    },
}

/// Full-precision keys and values of a block being filled: `[slot][kv_head][head_dim]`.
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

/// Dequantizes the key and value rows of one block index of a sequence into the given rows.
type FillBlock<'f> = dyn Fn(usize, &mut [f32], &mut [f32]) + Sync + 'f;

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
    /// Channel-wise formats: the residual (keys, values) of each block holding a query of this
    /// call, from block index `own_first`.
    own: Vec<(&'a [f32], &'a [f32])>,
    own_first: usize,
    block_size: usize,
    channelwise: bool,
}

impl<'a> SeqView<'a> {
    /// A query at `pos` reads positions `..split(pos)` through [`Self::key`]/[`Self::value`] and
    /// the rest, up to `pos`, from [`Self::own`]: its own block in full precision for the
    /// channel-wise formats (so a query sees the same values whether its block filled in this
    /// call or not), nothing for the others.
    #[inline]
    pub fn split(&self, pos: usize) -> usize {
        if self.channelwise {
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
        if self.channelwise {
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
        let mut layers = Vec::with_capacity(shape.num_layers);
        for _ in 0..shape.num_layers {
            layers.push(match (shape.format.keys(), shape.format.values()) {
                (KeyLayout::Float, _) => Layer::Float {
                    k: floats(slots)?,
                    v: floats(slots)?,
                },
                (KeyLayout::PerToken(codec), _) => Layer::Tokens {
                    codec,
                    k: bytes(slots, codec.record_bytes(hd))?,
                    v: bytes(slots, codec.record_bytes(hd))?,
                },
                (KeyLayout::PerChannel(keys), Some(values)) => Layer::Channel {
                    keys,
                    values,
                    k: bytes(num_blocks * heads, keys.block_bytes(hd, block_size))?,
                    v: bytes(slots, values.record_bytes(hd))?,
                    packed: vec![false; num_blocks],
                    residual: HashMap::new(),
                },
                (KeyLayout::PerChannel(_), None) => {
                    return Err(Error::unsupported(
                        format!("KV format {}", shape.format),
                        "channel-wise keys without quantized values",
                    ));
                }
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
            .map(|l| match l {
                Layer::Float { k, v } => 4 * (k.len() + v.len()),
                Layer::Tokens { k, v, .. } => k.len() + v.len(),
                Layer::Channel { k, v, packed, .. } => k.len() + v.len() + packed.len(),
            })
            .sum()
    }

    /// Bytes held by full-precision residuals of blocks being filled, all layers.
    pub fn residual_bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| match l {
                Layer::Channel { residual, .. } => {
                    residual.values().map(|r| 4 * (r.k.len() + r.v.len())).sum()
                }
                _ => 0,
            })
            .sum()
    }

    /// Drops the residuals of released blocks (see `Backend::release_kv_blocks`). Packed
    /// contents stay: a full block may live on in the prefix cache.
    pub fn release_blocks(&mut self, blocks: &[u32]) {
        for layer in &mut self.layers {
            if let Layer::Channel { residual, .. } = layer {
                for b in blocks {
                    residual.remove(b);
                }
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
        if format.is_quantized() {
            for (what, xs) in [("key", &k[..n]), ("value", &v[..n])] {
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
        }
        let layer_store = self.layers.get_mut(layer).ok_or_else(|| {
            Error::InvalidArgument(format!("layer {layer} is outside the KV pool"))
        })?;
        let mut packed_now = Vec::new();
        match layer_store {
            Layer::Float { k: pk, v: pv } => {
                let mut src = 0;
                for s in &batch.seqs {
                    for pos in s.start_pos..s.start_pos + s.len {
                        let at = (s.blocks[pos / bs] as usize * bs + pos % bs) * row;
                        pk[at..at + row].copy_from_slice(&k[src..src + row]);
                        pv[at..at + row].copy_from_slice(&v[src..src + row]);
                        src += row;
                    }
                }
            }
            Layer::Tokens {
                codec,
                k: pk,
                v: pv,
            } => {
                let rb = codec.record_bytes(hd);
                let mut src = 0;
                for s in &batch.seqs {
                    for pos in s.start_pos..s.start_pos + s.len {
                        let at = (s.blocks[pos / bs] as usize * bs + pos % bs) * heads * rb;
                        for h in 0..heads {
                            let x = src + h * hd..src + (h + 1) * hd;
                            let out = at + h * rb..at + (h + 1) * rb;
                            codec.quantize(&k[x.clone()], &mut pk[out.clone()])?;
                            codec.quantize(&v[x], &mut pv[out])?;
                        }
                        src += row;
                    }
                }
            }
            Layer::Channel {
                keys,
                values,
                k: pk,
                v: pv,
                packed,
                residual,
            } => {
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
                                return Err(out_of_order(
                                    format,
                                    block,
                                    slot,
                                    r.map_or(0, |r| r.filled),
                                ));
                            }
                        };
                        r.k[slot * row..(slot + 1) * row].copy_from_slice(&k[src..src + row]);
                        r.v[slot * row..(slot + 1) * row].copy_from_slice(&v[src..src + row]);
                        r.filled += 1;
                        src += row;
                        if r.filled == bs {
                            let b = block as usize;
                            let kb = keys.block_bytes(hd, bs);
                            let vb = values.record_bytes(hd);
                            for h in 0..heads {
                                let out = &mut pk[(b * heads + h) * kb..(b * heads + h + 1) * kb];
                                keys.quantize(&r.k[h * hd..], row, bs, hd, out)?;
                            }
                            for (i, x) in r.v.chunks_exact(hd).enumerate() {
                                let at = (b * bs * heads + i) * vb;
                                values.quantize(x, &mut pv[at..at + vb])?;
                            }
                            packed[b] = true;
                            packed_now.push(block);
                        }
                    }
                }
            }
        }
        Ok(packed_now)
    }

    /// Drops the residuals of blocks packed by the last [`Self::write`], after attention read
    /// them for the queries inside those blocks.
    pub(crate) fn finish_write(&mut self, layer: usize, packed_now: &[u32]) {
        if let Some(Layer::Channel { residual, .. }) = self.layers.get_mut(layer) {
            for b in packed_now {
                residual.remove(b);
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
    /// sliding window's start for the call's first query; 0 without one): the f32 pool directly,
    /// or its rows from `first`'s block on dequantized into `scratch`.
    pub(crate) fn view<'a>(
        &'a self,
        layer: usize,
        s: &'a SeqSpan,
        first: usize,
        scratch: &'a mut Scratch,
        pool: &rayon::ThreadPool,
    ) -> Result<SeqView<'a>> {
        let row = self.row();
        let (bs, heads, hd) = (
            self.block_size,
            self.shape.num_kv_heads,
            self.shape.head_dim,
        );
        let ctx = s.start_pos + s.len;
        // Blocks before the window's first are never read: not dequantized either.
        let first_block = first.min(ctx.saturating_sub(1)) / bs;
        let plain = |keys, values| SeqView {
            keys,
            values,
            own: Vec::new(),
            own_first: 0,
            block_size: bs,
            channelwise: false,
        };
        match &self.layers[layer] {
            Layer::Float { k, v } => {
                let paged = |data| Rows::Paged {
                    data,
                    blocks: &s.blocks,
                    block_size: bs,
                    row,
                };
                Ok(plain(paged(k), paged(v)))
            }
            Layer::Tokens { codec, k, v } => {
                let rb = codec.record_bytes(hd);
                let (keys, values) =
                    self.dequantize_rows(first_block, ctx, scratch, pool, &|j, ck, cv| {
                        let first = (s.blocks[j] as usize * bs) * heads;
                        for (i, (ok, ov)) in ck
                            .chunks_exact_mut(hd)
                            .zip(cv.chunks_exact_mut(hd))
                            .enumerate()
                        {
                            let at = (first + i) * rb;
                            codec.dequantize(&k[at..at + rb], ok);
                            codec.dequantize(&v[at..at + rb], ov);
                        }
                    });
                Ok(plain(keys, values))
            }
            Layer::Channel {
                keys: kc,
                values: vc,
                k,
                v,
                packed,
                residual,
            } => {
                // Queries of this call sit in blocks own_first..=own_last; everything before
                // their own block is read packed.
                let (own_first, own_last) = (s.start_pos / bs, (ctx - 1) / bs);
                let first_block = first_block.min(own_last);
                if let Some(j) = (first_block..own_last).find(|&j| !packed[s.blocks[j] as usize]) {
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
                        match residual.get(&s.blocks[j]) {
                            Some(r) if r.filled >= need => Ok((&r.k[..], &r.v[..])),
                            _ => Err(Error::InvalidArgument(format!(
                                "KV block {} lost the full-precision keys its queries read",
                                s.blocks[j]
                            ))),
                        }
                    })
                    .collect::<Result<Vec<_>>>()?;
                let (kb, vb) = (kc.block_bytes(hd, bs), vc.record_bytes(hd));
                let (keys, values) = self.dequantize_rows(
                    first_block,
                    own_last * bs,
                    scratch,
                    pool,
                    &|j, ck, cv| {
                        let b = s.blocks[j] as usize;
                        for h in 0..heads {
                            let rec = &k[(b * heads + h) * kb..(b * heads + h + 1) * kb];
                            kc.dequantize(rec, bs, hd, &mut ck[h * hd..], row);
                        }
                        for (i, ov) in cv.chunks_exact_mut(hd).enumerate() {
                            let at = (b * bs * heads + i) * vb;
                            vc.dequantize(&v[at..at + vb], ov);
                        }
                    },
                );
                Ok(SeqView {
                    keys,
                    values,
                    own,
                    own_first,
                    block_size: bs,
                    channelwise: true,
                })
            }
        }
    }
}

impl CpuKvCache {
    /// Fills `scratch` with the rows of positions `..n`, calling `fill(j, keys, values)` for the
    /// rows of block index `j` (one task per block), and returns them as dense rows.
    fn dequantize_rows<'a>(
        &self,
        first_block: usize,
        end: usize,
        scratch: &'a mut Scratch,
        pool: &rayon::ThreadPool,
        fill: &FillBlock<'_>,
    ) -> (Rows<'a>, Rows<'a>) {
        let (row, bs) = (self.row(), self.block_size);
        let first = (first_block * bs).min(end);
        let n = end - first;
        scratch.k.resize(n * row, 0.0);
        scratch.v.resize(n * row, 0.0);
        let (sk, sv) = (&mut scratch.k[..n * row], &mut scratch.v[..n * row]);
        let task = |(j, (ck, cv)): (usize, (&mut [f32], &mut [f32]))| fill(first_block + j, ck, cv);
        if n * row < SERIAL_DEQUANT {
            sk.chunks_mut(bs * row)
                .zip(sv.chunks_mut(bs * row))
                .enumerate()
                .for_each(task);
        } else {
            pool.install(|| {
                sk.par_chunks_mut(bs * row)
                    .zip(sv.par_chunks_mut(bs * row))
                    .enumerate()
                    .for_each(task)
            });
        }
        let scratch: &'a Scratch = scratch;
        (
            Rows::Dense {
                data: &scratch.k[..n * row],
                row,
                first,
            },
            Rows::Dense {
                data: &scratch.v[..n * row],
                row,
                first,
            },
        )
    }
}

fn out_of_order(format: KvFormat, block: u32, slot: usize, filled: usize) -> Error {
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
