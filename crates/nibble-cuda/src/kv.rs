//! The paged KV pool on the GPU: per layer, keys and values as `[blocks, kv_heads, block_size,
//! head_dim]` in the model dtype, so one head's rows of a block are contiguous for attention. Which blocks a sequence
//! owns is the engine's business; the pool only stores what the batch's block tables name.
//!
//! It sits in the runtime layer beside the tensor types, not among the ops: it is storage that
//! attention writes and reads and benchmark fills write, so both can name it without naming each
//! other.

use std::sync::{Arc, OnceLock};

use nibble_core::{Error, Result};
use nibble_model::KvShape;

use cudarc::driver::sys;

use crate::runtime::{DeviceBuffer, DevicePtr, Gpu, TmaLayout, tensor_map};
use crate::tensor::Dtype;

pub struct CudaKv {
    pub shape: KvShape,
    pub num_blocks: usize,
    pub block_size: usize,
    pub dtype: Dtype,
    k: DeviceBuffer,
    v: DeviceBuffer,
    /// Elements per layer in each of `k` and `v`.
    layer_elems: usize,
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
        let layer_elems = num_blocks * block_size * shape.num_kv_heads * shape.head_dim;
        let bytes = layer_elems
            .checked_mul(shape.num_layers * 2)
            .ok_or_else(|| Error::InvalidArgument("KV pool size overflows".into()))?;
        let k = DeviceBuffer::alloc(gpu, bytes, "the KV cache (keys)")?;
        let v = DeviceBuffer::alloc(gpu, bytes, "the KV cache (values)")?;
        // Attention kernels read whole blocks and mask the slots past a sequence's end; a masked
        // value still multiplies a zero probability, so it must not be NaN: never-written slots
        // start as zeros.
        for buf in [&k, &v] {
            unsafe { cudarc::driver::result::memset_d8_sync(buf.ptr, 0, bytes) }
                .map_err(|e| crate::runtime::driver_err("clearing the KV cache", e))?;
        }
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        Ok(CudaKv {
            shape,
            num_blocks,
            block_size,
            dtype,
            k,
            v,
            layer_elems,
            id: NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            tma: OnceLock::new(),
        })
    }

    /// Device addresses of layer `layer`'s keys and values.
    pub fn layer(&self, layer: usize) -> (DevicePtr, DevicePtr) {
        let off = (layer * self.layer_elems * 2) as u64;
        (self.k.ptr + off, self.v.ptr + off)
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

    /// Bytes per token of a pool of `shape` (16-bit keys and values).
    pub fn bytes_per_token_of(shape: KvShape) -> usize {
        shape.num_layers * 2 * shape.num_kv_heads * shape.head_dim * 2
    }
}
