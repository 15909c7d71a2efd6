//! The CPU backend with hooks on linear-layer inputs and attention inputs: what the calibration
//! capture ([`crate::capture`]) and the quantization simulation ([`crate::simulate`]) both need
//! from the ordinary `Transformer` forward pass. Everything else delegates to [`CpuBackend`], so
//! both see exactly the rotary, attention, norms and KV cache nibble serves with.

use nibble_core::Result;
use nibble_cpu::{CpuBackend, CpuKvCache, CpuTensor, CpuWeight};
use nibble_formats::HostTensor;
use nibble_model::{AttentionShape, Backend, BatchLayout};

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

    nibble_cpu::delegate_to_cpu!(cpu);

    fn name(&self) -> String {
        format!("{} with quantization hooks", self.cpu.name())
    }

    fn load_weight(&self, t: &HostTensor) -> Result<Self::Weight> {
        Ok(HookedWeight {
            inner: self.cpu.load_weight(t)?,
            tag: self.hooks.tag(&t.name),
        })
    }

    fn embed(&self, table: &Self::Weight, ids: &[u32]) -> Result<CpuTensor> {
        self.cpu.embed(&table.inner, ids)
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
}
