//! nibble-engine
