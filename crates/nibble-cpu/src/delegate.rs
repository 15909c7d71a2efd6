//! For backends that wrap [`crate::CpuBackend`] and change only some of its ops (the quantization
//! hooks, test doubles): the rest pass through here, so a new op of the `Backend` trait is
//! forwarded in one place rather than in every wrapper.

/// Expands, inside `impl Backend for W` (whose `Tensor` is `CpuTensor` and `Kv` `CpuKvCache`), to
/// the ops that pass through unchanged to the `CpuBackend` in field `$cpu`: vectors, the KV pool,
/// the norms, rotary, SiLU gate, adds, row gathers and scatters, and host copies. The wrapper
/// writes the ops it changes (and those its `Weight` type touches: `load_weight`, `embed`,
/// `linear`) itself, along with `name` and `attention`.
#[macro_export]
macro_rules! delegate_to_cpu {
    ($cpu:ident) => {
        fn load_vector(&self, v: &[f32]) -> ::nibble_core::Result<$crate::CpuTensor> {
            self.$cpu.load_vector(v)
        }
        fn new_kv_pool(
            &self,
            shape: ::nibble_model::KvShape,
            blocks: usize,
            block_size: usize,
        ) -> ::nibble_core::Result<$crate::CpuKvCache> {
            self.$cpu.new_kv_pool(shape, blocks, block_size)
        }
        fn release_kv_blocks(&self, kv: &mut $crate::CpuKvCache, blocks: &[u32]) {
            self.$cpu.release_kv_blocks(kv, blocks)
        }
        fn rms_norm(
            &self,
            x: &$crate::CpuTensor,
            w: &$crate::CpuTensor,
            eps: f32,
        ) -> $crate::CpuTensor {
            self.$cpu.rms_norm(x, w, eps)
        }
        fn add_rms_norm(
            &self,
            x: &mut $crate::CpuTensor,
            d: &$crate::CpuTensor,
            w: &$crate::CpuTensor,
            eps: f32,
        ) -> $crate::CpuTensor {
            self.$cpu.add_rms_norm(x, d, w, eps)
        }
        fn head_rms_norm(
            &self,
            x: &mut $crate::CpuTensor,
            w: &$crate::CpuTensor,
            head_dim: usize,
            eps: f32,
        ) {
            self.$cpu.head_rms_norm(x, w, head_dim, eps)
        }
        fn rope(
            &self,
            x: &mut $crate::CpuTensor,
            head_dim: usize,
            batch: &::nibble_model::BatchLayout,
            inv_freq: &$crate::CpuTensor,
            layout: ::nibble_model::RopeLayout,
        ) {
            self.$cpu.rope(x, head_dim, batch, inv_freq, layout)
        }
        fn silu_mul(&self, gate: &$crate::CpuTensor, up: &$crate::CpuTensor) -> $crate::CpuTensor {
            self.$cpu.silu_mul(gate, up)
        }
        fn gelu_tanh_mul(
            &self,
            gate: &$crate::CpuTensor,
            up: &$crate::CpuTensor,
        ) -> $crate::CpuTensor {
            self.$cpu.gelu_tanh_mul(gate, up)
        }
        fn residual_rms_norm(
            &self,
            x: &$crate::CpuTensor,
            w: &$crate::CpuTensor,
            eps: f32,
        ) -> $crate::CpuTensor {
            self.$cpu.residual_rms_norm(x, w, eps)
        }
        fn scale(&self, x: &mut $crate::CpuTensor, factor: f32) {
            self.$cpu.scale(x, factor)
        }
        fn add(&self, x: &mut $crate::CpuTensor, d: &$crate::CpuTensor) {
            self.$cpu.add(x, d)
        }
        fn gather_rows(&self, x: &$crate::CpuTensor, rows: &[usize]) -> $crate::CpuTensor {
            self.$cpu.gather_rows(x, rows)
        }
        fn scatter_add_scaled(
            &self,
            rows: usize,
            cols: usize,
            parts: &[::nibble_model::ScaledRows<'_, $crate::CpuTensor>],
        ) -> ::nibble_core::Result<$crate::CpuTensor> {
            self.$cpu.scatter_add_scaled(rows, cols, parts)
        }
        fn to_host(&self, x: &$crate::CpuTensor) -> ::nibble_core::Result<Vec<f32>> {
            self.$cpu.to_host(x)
        }
    };
}

/// Expands, beside [`delegate_to_cpu!`], to attention and the linear layer passed through to the
/// `CpuBackend` in field `$cpu`, for wrappers that change neither (they still write `name`,
/// `load_weight` and `embed`).
#[macro_export]
macro_rules! delegate_attention_and_linear_to_cpu {
    ($cpu:ident) => {
        fn linear(
            &self,
            x: &$crate::CpuTensor,
            w: &$crate::CpuWeight,
            bias: Option<&$crate::CpuTensor>,
        ) -> ::nibble_core::Result<$crate::CpuTensor> {
            self.$cpu.linear(x, w, bias)
        }
        #[allow(clippy::too_many_arguments)]
        fn attention(
            &self,
            q: &$crate::CpuTensor,
            k: &$crate::CpuTensor,
            v: &$crate::CpuTensor,
            kv: &mut $crate::CpuKvCache,
            layer: usize,
            batch: &::nibble_model::BatchLayout,
            shape: ::nibble_model::AttentionShape,
        ) -> ::nibble_core::Result<$crate::CpuTensor> {
            self.$cpu.attention(q, k, v, kv, layer, batch, shape)
        }
    };
}
