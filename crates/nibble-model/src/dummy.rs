//! Placeholder until the dummy-weights source lands.
use nibble_core::{Error, Result};

use crate::loader::ModelFiles;

pub fn open_dummy(name: &str, _seed: u64) -> Result<ModelFiles> {
    Err(Error::unsupported("dummy weights", format!("'{name}'")))
}
