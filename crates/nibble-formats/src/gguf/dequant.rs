//! Dequantization of ggml blocks to f32 (owned by the dequant helper; placeholder until merged).
