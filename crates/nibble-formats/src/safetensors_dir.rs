//! Tensors of a Hugging Face model directory: `model.safetensors`, or shards listed in
//! `model.safetensors.index.json`. Every shard is memory-mapped; tensors borrow from the maps.
//!
//! [`SafetensorsDir::open`] accepts float tensors only (a plain model); readers of quantized
//! layouts open with [`SafetensorsDir::open_any`] and read integer tensors through
//! [`SafetensorsDir::raw`].

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;
use nibble_core::{Error, Result};
pub use safetensors::Dtype;
use safetensors::SafeTensors;

use crate::gguf::GgmlType;
use crate::tensor::{HostTensor, TensorBytes, WeightFormat};

struct Entry {
    shard: usize,
    shape: Vec<usize>,
    dtype: Dtype,
    start: usize,
    len: usize,
}

/// A tensor of any safetensors dtype, as stored.
#[derive(Clone)]
pub struct RawTensor {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub bytes: TensorBytes,
}

/// The weight format of a float dtype; `None` for the others.
fn float_format(dtype: Dtype) -> Option<WeightFormat> {
    Some(WeightFormat::Ggml(match dtype {
        Dtype::F32 => GgmlType::F32,
        Dtype::F16 => GgmlType::F16,
        Dtype::BF16 => GgmlType::BF16,
        _ => return None,
    }))
}

pub struct SafetensorsDir {
    dir: PathBuf,
    shards: Vec<Arc<Mmap>>,
    shard_files: Vec<PathBuf>,
    entries: HashMap<String, Entry>,
}

impl SafetensorsDir {
    /// Opens a plain model: every tensor must be F32, F16 or BF16.
    pub fn open(dir: &Path) -> Result<Self> {
        let st = Self::open_any(dir)?;
        if let Some((name, e)) = st
            .entries
            .iter()
            .find(|(_, e)| float_format(e.dtype).is_none())
        {
            return Err(Error::unsupported(
                format!(
                    "safetensors dtype {:?} of tensor '{name}' in {}",
                    e.dtype,
                    st.shard_files[e.shard].display()
                ),
                "supported: F32, F16, BF16",
            ));
        }
        Ok(st)
    }

    /// Opens a directory whatever its tensors' dtypes; [`SafetensorsDir::get`] serves the float
    /// ones, [`SafetensorsDir::raw`] every one.
    pub fn open_any(dir: &Path) -> Result<Self> {
        let index = dir.join("model.safetensors.index.json");
        let files: Vec<PathBuf> = if index.exists() {
            let text = std::fs::read_to_string(&index).map_err(|e| Error::io(&index, e))?;
            let v: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| Error::corrupt(&index, format!("invalid JSON: {e}")))?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| Error::corrupt(&index, "no 'weight_map' object"))?;
            let mut names: Vec<&str> = map.values().filter_map(|f| f.as_str()).collect();
            names.sort_unstable();
            names.dedup();
            names.into_iter().map(|n| dir.join(n)).collect()
        } else {
            let single = dir.join("model.safetensors");
            if !single.exists() {
                return Err(Error::io(
                    &single,
                    std::io::Error::new(
                        std::io::ErrorKind::NotFound,
                        "no model.safetensors or model.safetensors.index.json in the directory",
                    ),
                ));
            }
            vec![single]
        };

        let mut shards = Vec::with_capacity(files.len());
        let mut entries = HashMap::new();
        for (i, path) in files.iter().enumerate() {
            let file = File::open(path).map_err(|e| Error::io(path, e))?;
            // SAFETY: read-only map of a file nibble does not modify while it is open.
            let map = Arc::new(unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?);
            let st = SafeTensors::deserialize(&map)
                .map_err(|e| Error::corrupt(path, format!("invalid safetensors: {e}")))?;
            let base = map.as_ptr() as usize;
            for (name, view) in st.tensors() {
                let data = view.data();
                entries.insert(
                    name.clone(),
                    Entry {
                        shard: i,
                        shape: view.shape().to_vec(),
                        dtype: view.dtype(),
                        start: data.as_ptr() as usize - base,
                        len: data.len(),
                    },
                );
            }
            shards.push(map);
        }
        Ok(SafetensorsDir {
            dir: dir.to_path_buf(),
            shards,
            shard_files: files,
            entries,
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(String::as_str)
    }

    /// The file holding tensor `name`, for error messages.
    pub fn file_of(&self, name: &str) -> Option<&Path> {
        let e = self.entries.get(name)?;
        Some(&self.shard_files[e.shard])
    }

    /// Any tensor, as stored.
    pub fn raw(&self, name: &str) -> Option<RawTensor> {
        let e = self.entries.get(name)?;
        Some(RawTensor {
            name: name.to_string(),
            dtype: e.dtype,
            shape: e.shape.clone(),
            bytes: TensorBytes::Mapped {
                map: self.shards[e.shard].clone(),
                start: e.start,
                len: e.len,
            },
        })
    }

    /// A float tensor (F32, F16, BF16); `None` when absent or of another dtype.
    pub fn get(&self, name: &str) -> Option<HostTensor> {
        let e = self.entries.get(name)?;
        Some(HostTensor {
            name: name.to_string(),
            shape: e.shape.clone(),
            format: float_format(e.dtype)?,
            bytes: TensorBytes::Mapped {
                map: self.shards[e.shard].clone(),
                start: e.start,
                len: e.len,
            },
        })
    }
}
