//! Tensors of a Hugging Face model directory: `model.safetensors`, or shards listed in
//! `model.safetensors.index.json`. Every shard is memory-mapped; tensors borrow from the maps.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;
use nibble_core::{Error, Result};
use safetensors::{Dtype, SafeTensors};

use crate::gguf::GgmlType;
use crate::tensor::{HostTensor, TensorBytes, WeightFormat};

struct Entry {
    shard: usize,
    shape: Vec<usize>,
    format: WeightFormat,
    start: usize,
    len: usize,
}

pub struct SafetensorsDir {
    dir: PathBuf,
    shards: Vec<Arc<Mmap>>,
    entries: HashMap<String, Entry>,
}

impl SafetensorsDir {
    pub fn open(dir: &Path) -> Result<Self> {
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
                let format = match view.dtype() {
                    Dtype::F32 => WeightFormat::Ggml(GgmlType::F32),
                    Dtype::F16 => WeightFormat::Ggml(GgmlType::F16),
                    Dtype::BF16 => WeightFormat::Ggml(GgmlType::BF16),
                    other => {
                        return Err(Error::unsupported(
                            format!(
                                "safetensors dtype {other:?} of tensor '{name}' in {}",
                                path.display()
                            ),
                            "supported: F32, F16, BF16",
                        ));
                    }
                };
                let data = view.data();
                entries.insert(
                    name.clone(),
                    Entry {
                        shard: i,
                        shape: view.shape().to_vec(),
                        format,
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

    pub fn get(&self, name: &str) -> Option<HostTensor> {
        let e = self.entries.get(name)?;
        Some(HostTensor {
            name: name.to_string(),
            shape: e.shape.clone(),
            format: e.format,
            bytes: TensorBytes::Mapped {
                map: self.shards[e.shard].clone(),
                start: e.start,
                len: e.len,
            },
        })
    }
}
