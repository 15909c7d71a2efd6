//! KV cache formats: packing of keys and values and the CPU reference of what attention reads.
