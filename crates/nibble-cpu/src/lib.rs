//! nibble-cpu
