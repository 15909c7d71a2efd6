//! The CPU backend with hooks on linear-layer inputs and attention inputs: what the calibration
//! capture ([`crate::capture`]) and the quantization simulation ([`crate::simulate`]) both need
//! from the ordinary `Transformer` forward pass. Everything else delegates to [`CpuBackend`], so
//! both see exactly the rotary, attention, norms and KV cache nibble serves with.

use nibble_core::Result;
use nibble_cpu::{CpuBackend, CpuKvCache, CpuTensor, CpuWeight};
use nibble_formats::HostTensor;
use nibble_model::{AttentionShape, Backend, BatchLayout, KvShape, RopeLayout, ScaledRows};

/// What a [`Hooked`] backend does besides the CPU backend's arithmetic.
pub trait Hooks: Send + Sync {
    /// Per-weight data the hooks keep, decided from the tensor's HF name at load.
    type Tag: Copy + Send + Sync;

    fn tag(&self, name: &str) -> Self::Tag;

    /// Sees a linear layer's input before it is multiplied, and returns the input to multiply
    /// instead (`None`: `x` itself).
    fn linear_input(&self, tag: Self::Tag, x: &CpuTensor) -> Option<CpuTensor>;

    /// Sees layer `layer`'s attention inputs, queries and keys rotary-embedded, before the keys
    /// and values are written to the cache.
    fn attention_inputs(&self, _layer: usize, _q: &CpuTensor, _k: &CpuTensor, _v: &CpuTensor) {}
}

/// [`CpuBackend`] with [`Hooks`].
pub struct Hooked<H> {
    pub cpu: CpuBackend,
    pub hooks: H,
}

pub struct HookedWeight<T> {
    inner: CpuWeight,
    tag: T,
}

impl<H: Hooks> Backend for Hooked<H> {
    type Tensor = CpuTensor;
    type Weight = HookedWeight<H::Tag>;
    type Kv = CpuKvCache;

    fn name(&self) -> String {
        format!("{} with quantization hooks", self.cpu.name())
    }

    fn load_weight(&self, t: &HostTensor) -> Result<Self::Weight> {
        Ok(HookedWeight {
            inner: self.cpu.load_weight(t)?,
            tag: self.hooks.tag(&t.name),
        })
    }

    fn load_vector(&self, values: &[f32]) -> Result<CpuTensor> {
        self.cpu.load_vector(values)
    }

    fn new_kv_pool(&self, shape: KvShape, blocks: usize, block_size: usize) -> Result<CpuKvCache> {
        self.cpu.new_kv_pool(shape, blocks, block_size)
    }

    fn release_kv_blocks(&self, kv: &mut CpuKvCache, blocks: &[u32]) {
        self.cpu.release_kv_blocks(kv, blocks)
    }

    fn embed(&self, table: &Self::Weight, ids: &[u32]) -> Result<CpuTensor> {
        self.cpu.embed(&table.inner, ids)
    }

    fn rms_norm(&self, x: &CpuTensor, w: &CpuTensor, eps: f32) -> CpuTensor {
        self.cpu.rms_norm(x, w, eps)
    }

    fn add_rms_norm(&self, x: &mut CpuTensor, d: &CpuTensor, w: &CpuTensor, eps: f32) -> CpuTensor {
        self.cpu.add_rms_norm(x, d, w, eps)
    }

    fn head_rms_norm(&self, x: &mut CpuTensor, w: &CpuTensor, head_dim: usize, eps: f32) {
        self.cpu.head_rms_norm(x, w, head_dim, eps)
    }

    fn linear(
        &self,
        x: &CpuTensor,
        w: &Self::Weight,
        bias: Option<&CpuTensor>,
    ) -> Result<CpuTensor> {
        match self.hooks.linear_input(w.tag, x) {
            Some(xq) => self.cpu.linear(&xq, &w.inner, bias),
            None => self.cpu.linear(x, &w.inner, bias),
        }
    }

    fn rope(
        &self,
        x: &mut CpuTensor,
        head_dim: usize,
        batch: &BatchLayout,
        inv_freq: &CpuTensor,
        layout: RopeLayout,
    ) {
        self.cpu.rope(x, head_dim, batch, inv_freq, layout)
    }

    fn attention(
        &self,
        q: &CpuTensor,
        k: &CpuTensor,
        v: &CpuTensor,
        kv: &mut CpuKvCache,
        layer: usize,
        batch: &BatchLayout,
        shape: AttentionShape,
    ) -> Result<CpuTensor> {
        self.hooks.attention_inputs(layer, q, k, v);
        self.cpu.attention(q, k, v, kv, layer, batch, shape)
    }

    fn silu_mul(&self, gate: &CpuTensor, up: &CpuTensor) -> CpuTensor {
        self.cpu.silu_mul(gate, up)
    }

    fn add(&self, x: &mut CpuTensor, d: &CpuTensor) {
        self.cpu.add(x, d)
    }

    fn gather_rows(&self, x: &CpuTensor, rows: &[usize]) -> CpuTensor {
        self.cpu.gather_rows(x, rows)
    }

    fn scatter_add_scaled(
        &self,
        rows: usize,
        cols: usize,
        parts: &[ScaledRows<'_, CpuTensor>],
    ) -> Result<CpuTensor> {
        self.cpu.scatter_add_scaled(rows, cols, parts)
    }

    fn to_host(&self, x: &CpuTensor) -> Result<Vec<f32>> {
        self.cpu.to_host(x)
    }
}
