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

use crate::runtime::{DeviceBuffer, DevicePtr, Gpu, TmaLayout, tensor_map};
use crate::tensor::Dtype;

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
    /// The channel-wise formats' sides, whose kernels exist but whose pools are not wired yet
    /// (docs/design/kv-channel-gpu.md): channel keys, and 2-bit values.
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

    /// The GPU format of keys (`keys`) or values of a side stored as `format` says, or why the
    /// GPU cannot store it yet.
    fn of(format: KvFormat, keys: bool) -> Option<PageFormat> {
        if format.is_channelwise() {
            return None;
        }
        let codec = if keys {
            match format.keys() {
                KeyLayout::PerToken(codec) => Some(codec),
                _ => None,
            }
        } else {
            format.values()
        };
        Some(codec.map_or(PageFormat::Float, PageFormat::Token))
    }

    /// The formats of keys and values of `spec` on the GPU, or why the GPU cannot store it.
    pub fn of_spec(spec: KvSpec) -> Result<[PageFormat; 2]> {
        match (Self::of(spec.k, true), Self::of(spec.v, false)) {
            (Some(k), Some(v)) => Ok([k, v]),
            _ => Err(Error::unsupported(
                format!("KV cache format {spec} on the CUDA backend"),
                "the GPU stores kv16, kv8, kvfp8 and kv4 sides (and mixes of them, e.g. k8v4); \
                 the channel-wise formats (kv4c, kv2c, and mixes with a 4c or 2c side) run with \
                 --device cpu",
            )),
        }
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
}

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
        let formats = PageFormat::of_spec(shape.format)?;
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
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        Ok(CudaKv {
            shape,
            num_blocks,
            block_size,
            dtype,
            formats,
            k,
            v,
            layer_bytes,
            id: NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            tma: OnceLock::new(),
        })
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
    /// side its record; 0 for a format the GPU does not store).
    pub fn bytes_per_token_of(shape: KvShape) -> usize {
        let Ok(formats) = PageFormat::of_spec(shape.format) else {
            return 0;
        };
        let per_head: usize = formats
            .iter()
            .map(|f| f.page_bytes(shape.head_dim, 1))
            .sum();
        shape.num_layers * shape.num_kv_heads * per_head
    }
}
