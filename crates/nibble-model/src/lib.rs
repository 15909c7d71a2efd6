//! nibble-model
