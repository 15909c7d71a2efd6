//! The paged KV pool on the GPU. Per layer, keys and values each as `[blocks][kv_heads]` pages of
//! one block of one head, in their side's [`PageFormat`]: the model dtype as `[block_size]
//! [head_dim]` (so one head's rows of a block are contiguous for attention), or the self-
//! describing pages of a per-token codec (codes, then each slot's scale and zero:
//! `nibble_precision::kv`, "Pages"). Which blocks a sequence owns is the engine's business; the
//! pool only stores what the batch's block tables name.
//!
//! It sits in the runtime layer beside the tensor types, not among the ops: it is storage that
//! attention writes and reads and benchmark fills write, so both can name it without naming each
//! other.

use std::sync::{Arc, OnceLock};

use nibble_core::{Error, Result};
use nibble_model::KvShape;
use nibble_precision::kv::{ChannelKeys, KeyLayout, TokenCodec, UintBits};
use nibble_precision::{KvFormat, KvSpec};

use cudarc::driver::sys;

use crate::kv_residual::{ResidualPlan, ResidualSlots};
use crate::runtime::{DeviceBuffer, DevicePtr, Gpu, TmaLayout, tensor_map};
use crate::tensor::Dtype;
use nibble_model::BatchLayout;

/// How one side (keys or values) of the GPU pool stores a token of one head.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PageFormat {
    /// The model dtype, unquantized.
    Float,
    /// Per-token records, quantized as they are written (or, for a deferred side, when their
    /// block fills).
    Token(TokenCodec),
    /// Channel-wise keys (`4c`, `2c`): one record a block, written when the block fills
    /// (`nibble_precision::kv`, "Byte layouts"; kernels/kv_pages.cuh `pack_block`).
    Channel(ChannelKeys),
}

impl PageFormat {
    /// The channel-wise formats' sides (docs/design/kv-channel-gpu.md): channel keys, and 2-bit
    /// values.
    pub const DEFERRED: [PageFormat; 3] = [
        PageFormat::Channel(ChannelKeys(UintBits::B4)),
        PageFormat::Channel(ChannelKeys(UintBits::B2)),
        PageFormat::Token(TokenCodec::Uint(UintBits::B2)),
    ];

    /// Every side format the GPU pool stores.
    pub const ALL: [PageFormat; 4] = [
        PageFormat::Float,
        PageFormat::Token(TokenCodec::Uint(UintBits::B8)),
        PageFormat::Token(TokenCodec::Uint(UintBits::B4)),
        PageFormat::Token(TokenCodec::Fp8),
    ];

    /// The GPU format of keys (`keys`) or values of a side stored as `format` says.
    fn of(format: KvFormat, keys: bool) -> PageFormat {
        if keys {
            match format.keys() {
                KeyLayout::Float => PageFormat::Float,
                KeyLayout::PerToken(codec) => PageFormat::Token(codec),
                KeyLayout::PerChannel(c) => PageFormat::Channel(c),
            }
        } else {
            format.values().map_or(PageFormat::Float, PageFormat::Token)
        }
    }

    /// The formats of keys and values of `spec` on the GPU.
    pub fn of_spec(spec: KvSpec) -> [PageFormat; 2] {
        [Self::of(spec.k, true), Self::of(spec.v, false)]
    }

    /// Bytes of one page (one block of one head) of `head_dim`-wide rows.
    pub fn page_bytes(self, head_dim: usize, block: usize) -> usize {
        match self {
            PageFormat::Float => block * head_dim * 2,
            PageFormat::Token(codec) => codec.page_bytes(head_dim, block),
            PageFormat::Channel(keys) => keys.block_bytes(head_dim, block),
        }
    }

    /// The kernels' name of the format (kernels/kv_pages.cuh `PAGE_*`).
    pub fn kernel_code(self) -> u32 {
        match self {
            PageFormat::Float => 0,
            PageFormat::Token(TokenCodec::Uint(UintBits::B8)) => 1,
            PageFormat::Token(TokenCodec::Uint(UintBits::B4)) => 2,
            PageFormat::Token(TokenCodec::Fp8) => 3,
            PageFormat::Token(TokenCodec::Uint(UintBits::B2)) => 4,
            PageFormat::Channel(ChannelKeys(UintBits::B4)) => 5,
            PageFormat::Channel(ChannelKeys(UintBits::B2)) => 6,
            PageFormat::Channel(ChannelKeys(UintBits::B8)) => {
                unreachable!("no KV format keeps 8-bit keys per channel")
            }
        }
    }
}

/// The f32 residual of a pool with a deferred side: per layer `[slots][kv_heads][16]
/// [head_dim]` f32 rows for each deferred side (kernels/kv_pages.cuh `residual_row`), the slots'
/// bookkeeping, and the device copy of the current call's residual tables.
struct Residual {
    /// Each layer's slots. A forward pass gives every layer the same batches, so their plans
    /// agree; a direct `attention` call (tests) moves one layer alone, as the CPU's per-layer
    /// residual does.
    slots: Vec<ResidualSlots>,
    /// Keys', values' rows (`None` for a side quantized as it is written).
    sides: [Option<DeviceBuffer>; 2],
    /// Each layer's residual table of the current call, `entries` i32 apart (0: one table that
    /// every layer reads, when their slots agree).
    tables: DeviceBuffer,
    entries: usize,
    /// The plans of the forward pass in flight (`plan_residual`), applied by `finish_residual`.
    pending: Option<Plans>,
    /// A direct call moved a layer alone: the layers' slots may differ from then on, so forward
    /// passes plan each layer (cleared when they are compared equal again).
    diverged: bool,
}

/// A call's residual plans: one that every layer shares (a forward pass, whose layers' slots
/// agree), or one a layer.
enum Plans {
    Shared(ResidualPlan),
    PerLayer(Vec<ResidualPlan>),
}

pub struct CudaKv {
    pub shape: KvShape,
    pub num_blocks: usize,
    pub block_size: usize,
    pub dtype: Dtype,
    /// How keys and values are stored.
    pub formats: [PageFormat; 2],
    k: DeviceBuffer,
    v: DeviceBuffer,
    /// Bytes per layer of `k` and of `v`.
    layer_bytes: [usize; 2],
    /// Distinguishes pools in the graph cache (a graph bakes in the pool's addresses).
    pub id: u64,
    /// Each layer's TMA descriptors of keys and values, made on first use (Hopper prefill).
    tma: OnceLock<Vec<[sys::CUtensorMap; 2]>>,
    /// Which sides wait for their block to fill (`KvSpec::keys_deferred`, `values_deferred`).
    pub deferred: [bool; 2],
    /// Their residual (`Some` iff a side is deferred).
    residual: Option<Residual>,
}

/// Residual slots a deferred pool starts with; it grows when a call needs more.
const RESIDUAL_SLOTS: usize = 64;

fn next_id() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// Tokens a residual slot holds: the quantized pools' block (kernels/kv_pages.cuh `KV_BS`).
const KV_RESIDUAL_BLOCK: usize = 16;

impl CudaKv {
    pub fn new(
        gpu: &Arc<Gpu>,
        shape: KvShape,
        num_blocks: usize,
        block_size: usize,
        dtype: Dtype,
    ) -> Result<CudaKv> {
        if num_blocks == 0 || block_size == 0 {
            return Err(Error::InvalidArgument(format!(
                "a KV pool of {num_blocks} blocks of {block_size} tokens"
            )));
        }
        let formats = PageFormat::of_spec(shape.format);
        if shape.format.buffered() && block_size != KV_RESIDUAL_BLOCK {
            return Err(Error::InvalidArgument(format!(
                "a {} KV cache on the GPU takes blocks of {KV_RESIDUAL_BLOCK} tokens, not {block_size}",
                shape.format
            )));
        }
        let pages = num_blocks * shape.num_kv_heads;
        let layer_bytes = formats.map(|f| pages * f.page_bytes(shape.head_dim, block_size));
        let alloc = |i: usize, what: &str| -> Result<DeviceBuffer> {
            let bytes = layer_bytes[i]
                .checked_mul(shape.num_layers)
                .ok_or_else(|| Error::InvalidArgument("KV pool size overflows".into()))?;
            let buf = DeviceBuffer::alloc(gpu, bytes, what)?;
            // Attention kernels read whole blocks and mask the slots past a sequence's end; a
            // masked value still multiplies a zero probability, so it must not be NaN: never-
            // written slots start as zeros (a quantized page of zeros reads back as zeros).
            unsafe { cudarc::driver::result::memset_d8_sync(buf.ptr, 0, bytes) }
                .map_err(|e| crate::runtime::driver_err("clearing the KV cache", e))?;
            Ok(buf)
        };
        let k = alloc(0, "the KV cache (keys)")?;
        let v = alloc(1, "the KV cache (values)")?;
        let deferred = [shape.format.keys_deferred(), shape.format.values_deferred()];
        let residual = if deferred.contains(&true) {
            let slots = RESIDUAL_SLOTS.min(num_blocks);
            Some(Residual {
                sides: Self::residual_sides(gpu, shape, deferred, slots)?,
                slots: (0..shape.num_layers)
                    .map(|_| ResidualSlots::new(slots, block_size))
                    .collect(),
                tables: DeviceBuffer::alloc(gpu, 4 * 1024, "the KV residual tables")?,
                entries: 0,
                pending: None,
                diverged: false,
            })
        } else {
            None
        };
        Ok(CudaKv {
            shape,
            num_blocks,
            block_size,
            dtype,
            formats,
            k,
            v,
            layer_bytes,
            id: next_id(),
            tma: OnceLock::new(),
            deferred,
            residual,
        })
    }

    /// Bytes the residual of a pool of `shape` reaches under an engine of these limits (0 for
    /// a pool without a deferred side): a slot for every block a step can touch
    /// (`max_batched_tokens / 16` plus one more a sequence) and every partly filled block of a
    /// running sequence, and the padding block's.
    pub fn residual_bytes_for(
        shape: KvShape,
        max_num_seqs: usize,
        max_batched_tokens: usize,
    ) -> usize {
        let sides = [shape.format.keys_deferred(), shape.format.values_deferred()]
            .iter()
            .filter(|&&d| d)
            .count();
        let slots = max_batched_tokens.div_ceil(KV_RESIDUAL_BLOCK) + 2 * max_num_seqs + 1;
        sides * shape.num_layers * slots * Self::residual_slot_bytes(shape, KV_RESIDUAL_BLOCK)
    }

    /// Bytes of one residual slot of one layer and side.
    fn residual_slot_bytes(shape: KvShape, block: usize) -> usize {
        shape.num_kv_heads * block * shape.head_dim * 4
    }

    fn residual_sides(
        gpu: &Arc<Gpu>,
        shape: KvShape,
        deferred: [bool; 2],
        slots: usize,
    ) -> Result<[Option<DeviceBuffer>; 2]> {
        let bytes = shape.num_layers * slots * Self::residual_slot_bytes(shape, KV_RESIDUAL_BLOCK);
        let side = |on: bool, what| {
            on.then(|| DeviceBuffer::alloc(gpu, bytes, what))
                .transpose()
        };
        Ok([
            side(deferred[0], "the KV residual (keys)")?,
            side(deferred[1], "the KV residual (values)")?,
        ])
    }

    /// Layer `layer`'s residual rows of keys and values (null for a side quantized as it is
    /// written, and for pools without a deferred side).
    pub fn residual_layer(&self, layer: usize) -> (DevicePtr, DevicePtr) {
        let Some(r) = &self.residual else {
            return (0, 0);
        };
        let per_layer =
            r.slots[0].capacity() * Self::residual_slot_bytes(self.shape, self.block_size);
        let at =
            |b: &Option<DeviceBuffer>| b.as_ref().map_or(0, |b| b.ptr + (layer * per_layer) as u64);
        (at(&r.sides[0]), at(&r.sides[1]))
    }

    /// Layer `layer`'s residual table of the current call ([`Self::plan_residual`]).
    pub fn residual_tables(&self, layer: usize) -> DevicePtr {
        self.residual
            .as_ref()
            .map_or(0, |r| r.tables.ptr + (layer * r.entries * 4) as u64)
    }

    /// Whether a side waits in the residual until its block fills (the channel-wise formats).
    pub fn defers(&self) -> bool {
        self.residual.is_some()
    }

    /// Whether a forward pass planned the residual ([`Self::plan_residual`]); a direct
    /// `attention` call plans its own layer otherwise ([`Self::plan_residual_layer`]).
    pub fn residual_planned(&self) -> bool {
        self.residual.as_ref().is_none_or(|r| r.pending.is_some())
    }

    /// Plans the residual of a forward pass over `batch` for every layer (block tables `width`
    /// wide) and queues its tables' upload; nothing for a pool without a deferred side.
    /// [`Self::finish_residual`] applies it once the pass is queued. A refusal changes nothing.
    pub fn plan_residual(
        &mut self,
        gpu: &Arc<Gpu>,
        batch: &BatchLayout,
        width: usize,
        upload: &mut dyn FnMut(DevicePtr, &[i32]) -> Result<()>,
    ) -> Result<()> {
        let layers: Vec<usize> = (0..self.shape.num_layers).collect();
        if let Some(plans) = self.plan_layers(gpu, batch, width, &layers, upload)? {
            self.residual.as_mut().expect("planned").pending = Some(plans);
        }
        Ok(())
    }

    /// A direct `attention` call's plan of layer `layer` alone; apply it with
    /// [`Self::finish_residual_layer`] once the call's kernels are queued.
    pub fn plan_residual_layer(
        &mut self,
        gpu: &Arc<Gpu>,
        layer: usize,
        batch: &BatchLayout,
        width: usize,
        upload: &mut dyn FnMut(DevicePtr, &[i32]) -> Result<()>,
    ) -> Result<Option<ResidualPlan>> {
        Ok(
            match self.plan_layers(gpu, batch, width, &[layer], upload)? {
                Some(Plans::Shared(plan)) => Some(plan),
                Some(Plans::PerLayer(mut plans)) => plans.pop(),
                None => None,
            },
        )
    }

    /// Plans `layers` and uploads their tables, growing the residual (and the tables' buffer)
    /// when the call needs more than it holds, the held slots copied: the pool then takes a new
    /// id, so graphs made with the old addresses are dropped.
    fn plan_layers(
        &mut self,
        gpu: &Arc<Gpu>,
        batch: &BatchLayout,
        width: usize,
        layers: &[usize],
        upload: &mut dyn FnMut(DevicePtr, &[i32]) -> Result<()>,
    ) -> Result<Option<Plans>> {
        let (shape, block, blocks, deferred) =
            (self.shape, self.block_size, self.num_blocks, self.deferred);
        let Some(r) = &mut self.residual else {
            return Ok(None);
        };
        let capacity = r.slots[0].capacity();
        let want = layers
            .iter()
            .map(|&l| r.slots[l].held() + r.slots[l].needed(batch))
            .max()
            .unwrap_or(0);
        let entries = batch.seqs.len() * width;
        let table_bytes = shape.num_layers * entries * 4;
        // Growth first, and the new id with it: a plan refused after it must not leave graphs
        // that hold the freed buffers' addresses.
        let mut grown = false;
        if want > capacity {
            let new_capacity = want.max(2 * capacity).min(blocks.max(want));
            let sides = Self::residual_sides(gpu, shape, deferred, new_capacity)?;
            let slot = Self::residual_slot_bytes(shape, block);
            for (new, old) in sides.iter().zip(&r.sides) {
                if let (Some(new), Some(old)) = (new, old) {
                    crate::runtime::copy_2d(
                        new.ptr,
                        new_capacity * slot,
                        old.ptr,
                        capacity * slot,
                        capacity * slot,
                        shape.num_layers,
                        gpu.cu_stream(),
                    )?;
                }
            }
            // The old buffers go once the copies are done.
            gpu.synchronize()?;
            r.sides = sides;
            r.slots.iter_mut().for_each(|s| s.grow(new_capacity));
            grown = true;
        }
        if r.tables.bytes < table_bytes {
            gpu.synchronize()?;
            r.tables = DeviceBuffer::alloc(gpu, 2 * table_bytes, "the KV residual tables")?;
            grown = true;
        }
        if grown {
            self.id = next_id();
        }
        let r = self.residual.as_mut().expect("checked above");
        // A forward pass gives every layer the same batches, so their slots agree and one plan
        // and one table serve them all; a direct call (tests) may have moved a layer alone, and
        // only then are the layers compared.
        if r.diverged && layers.len() > 1 {
            r.diverged = !layers.iter().all(|&l| r.slots[l] == r.slots[layers[0]]);
        }
        let shared = layers.len() > 1 && !r.diverged;
        let plans = if shared {
            let plan = r.slots[layers[0]].plan(batch, width)?;
            upload(r.tables.ptr, &plan.tables)?;
            Plans::Shared(plan)
        } else {
            let plans = layers
                .iter()
                .map(|&l| r.slots[l].plan(batch, width))
                .collect::<Result<Vec<_>>>()?;
            for (&l, p) in layers.iter().zip(&plans) {
                upload(r.tables.ptr + (l * entries * 4) as u64, &p.tables)?;
            }
            Plans::PerLayer(plans)
        };
        r.entries = if shared { 0 } else { entries };
        Ok(Some(plans))
    }

    /// Applies the forward pass's plans once its kernels are queued (or drops them, `ok` false,
    /// when it failed).
    pub fn finish_residual(&mut self, ok: bool) {
        if let Some(r) = &mut self.residual
            && let Some(plans) = r.pending.take()
            && ok
        {
            match plans {
                Plans::Shared(plan) => ResidualSlots::finish_shared(&mut r.slots, plan),
                Plans::PerLayer(plans) => {
                    for (slots, plan) in r.slots.iter_mut().zip(plans) {
                        slots.finish(plan);
                    }
                }
            }
        }
    }

    /// Applies a direct call's plan of layer `layer`.
    pub fn finish_residual_layer(&mut self, layer: usize, plan: ResidualPlan) {
        if let Some(r) = &mut self.residual {
            r.slots[layer].finish(plan);
            r.diverged = true;
        }
    }

    /// The engine let go of these blocks: partly filled ones drop their residual slots.
    pub fn release_residual(&mut self, blocks: &[u32]) {
        if let Some(r) = &mut self.residual {
            r.slots.iter_mut().for_each(|s| s.release(blocks));
        }
    }

    /// Both sides in the model dtype (kv16): the layout every attention kernel reads.
    pub fn is_float(&self) -> bool {
        self.formats == [PageFormat::Float; 2]
    }

    /// Device addresses of layer `layer`'s keys and values.
    pub fn layer(&self, layer: usize) -> (DevicePtr, DevicePtr) {
        (
            self.k.ptr + (layer * self.layer_bytes[0]) as u64,
            self.v.ptr + (layer * self.layer_bytes[1]) as u64,
        )
    }

    /// Bytes of layer `layer`'s keys and values pages, copied to the host (tests read the
    /// quantized records back).
    pub fn download_layer(&self, gpu: &Gpu, layer: usize) -> Result<[Vec<u8>; 2]> {
        let (k, v) = self.layer(layer);
        let mut out = [
            vec![0u8; self.layer_bytes[0]],
            vec![0u8; self.layer_bytes[1]],
        ];
        for (ptr, buf) in [k, v].into_iter().zip(out.iter_mut()) {
            gpu.download(buf, ptr)?;
        }
        Ok(out)
    }

    /// TMA descriptors of layer `layer`'s keys and values, `[blocks][kv_heads][block][head_dim]`
    /// read in boxes of one block of one head, 64 channels wide (a 128-byte swizzled row per
    /// token). Made for every layer the first time any is asked for: they only change with the
    /// pool.
    pub fn tensor_maps(&self, layer: usize) -> Result<[sys::CUtensorMap; 2]> {
        if let Some(maps) = self.tma.get() {
            return Ok(maps[layer]);
        }
        let (heads, hd, block) = (
            self.shape.num_kv_heads,
            self.shape.head_dim,
            self.block_size,
        );
        let map = |ptr| {
            tensor_map(
                ptr,
                2,
                &[hd, block, heads, self.num_blocks],
                &[hd * 2, block * hd * 2, heads * block * hd * 2],
                &[64, block, 1, 1],
                TmaLayout::Swizzle128,
            )
        };
        let maps = (0..self.shape.num_layers)
            .map(|l| {
                let (k, v) = self.layer(l);
                Ok([map(k)?, map(v)?])
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(self.tma.get_or_init(|| maps)[layer])
    }

    /// Bytes one token takes in the pool over all layers (K and V).
    pub fn bytes_per_token(&self) -> usize {
        Self::bytes_per_token_of(self.shape)
    }

    /// Bytes per token of a pool of `shape` (a 16-bit side takes 2 bytes an element, a quantized
    /// side its record, a channel-wise side its page averaged over the block).
    pub fn bytes_per_token_of(shape: KvShape) -> usize {
        let formats = PageFormat::of_spec(shape.format);
        // Over a whole block: channel-wise keys keep their parameters once a block.
        let per_head: usize = formats
            .iter()
            .map(|f| f.page_bytes(shape.head_dim, KV_RESIDUAL_BLOCK) / KV_RESIDUAL_BLOCK)
            .sum();
        shape.num_layers * shape.num_kv_heads * per_head
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(format: &str) -> KvShape {
        KvShape {
            num_layers: 32,
            num_kv_heads: 8,
            head_dim: 128,
            format: format.parse().unwrap(),
        }
    }

    #[test]
    fn the_residual_reservation_counts_deferred_sides_only() {
        assert_eq!(CudaKv::residual_bytes_for(shape("kv4"), 256, 512), 0);
        assert_eq!(CudaKv::residual_bytes_for(shape("kv16"), 256, 512), 0);
        // 512 / 16 + 2 * 256 + 1 = 545 slots of 8 heads x 16 rows x 128 f32, 32 layers.
        let side = 32 * 545 * 8 * 16 * 128 * 4;
        assert_eq!(
            CudaKv::residual_bytes_for(shape("kv4c"), 256, 512),
            2 * side
        );
        assert_eq!(CudaKv::residual_bytes_for(shape("k4cv8"), 256, 512), side);
        assert_eq!(CudaKv::residual_bytes_for(shape("k8v4c"), 256, 512), side);
    }

    #[test]
    fn channel_pages_average_their_parameters_over_the_block() {
        // kv4c: keys 64 code bytes a token plus 512 parameter bytes a block (32 a token), values
        // 64 + 4 a token.
        let kv4c = shape("kv4c");
        assert_eq!(CudaKv::bytes_per_token_of(kv4c), 32 * 8 * (96 + 68));
        let [k, v] = PageFormat::of_spec(kv4c.format);
        assert_eq!(k.page_bytes(128, 16), 16 * 64 + 512);
        assert_eq!(v.page_bytes(128, 16), 16 * (64 + 4));
        assert_eq!((k.kernel_code(), v.kernel_code()), (5, 2));
        let [k, v] = PageFormat::of_spec(shape("kv2c").format);
        assert_eq!((k.kernel_code(), v.kernel_code()), (6, 4));
    }
}
