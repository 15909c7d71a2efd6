//! GGUF v2/v3 container: header, metadata key/values, tensor table, aligned data section.
//!
//! The file is memory-mapped; tensors are byte ranges into the map, so opening a multi-gigabyte
//! file costs only the header parse. Every count and offset read from the file is checked against
//! the file's length before use, so a truncated or corrupt file yields `Error::CorruptFile`
//! instead of a panic or a huge allocation.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;
use nibble_core::{Error, Result};

use super::GgmlType;

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;

/// A metadata value as stored in the file.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<MetaValue>),
}

impl MetaValue {
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            MetaValue::U8(v) => Some(v as u64),
            MetaValue::U16(v) => Some(v as u64),
            MetaValue::U32(v) => Some(v as u64),
            MetaValue::U64(v) => Some(v),
            MetaValue::I8(v) if v >= 0 => Some(v as u64),
            MetaValue::I16(v) if v >= 0 => Some(v as u64),
            MetaValue::I32(v) if v >= 0 => Some(v as u64),
            MetaValue::I64(v) if v >= 0 => Some(v as u64),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetaValue::F32(v) => Some(v as f64),
            MetaValue::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            MetaValue::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            MetaValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// One entry of the tensor table.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    /// ggml order: `dims[0]` is the contiguous (innermost) dimension.
    pub dims: Vec<usize>,
    pub ty: GgmlType,
    /// Byte range of the tensor's data within the file.
    pub start: usize,
    pub len: usize,
}

impl TensorInfo {
    /// Row-major shape, outermost first (`[rows, cols]` for a matrix), as PyTorch/numpy print it.
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().copied().collect()
    }

    pub fn elems(&self) -> usize {
        self.dims.iter().product()
    }
}

/// An open GGUF file.
pub struct GgufFile {
    path: PathBuf,
    map: Arc<Mmap>,
    pub version: u32,
    pub alignment: usize,
    metadata: HashMap<String, MetaValue>,
    /// Keys in file order, for listing.
    keys: Vec<String>,
    tensors: Vec<TensorInfo>,
    by_name: HashMap<String, usize>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let file = File::open(&path).map_err(|e| Error::io(&path, e))?;
        // SAFETY: the map is read-only; nibble never writes model files while they are open. A file
        // truncated underneath us by another process would fault, as with every mmap reader.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(&path, e))?;
        Self::parse(path, Arc::new(map))
    }

    fn parse(path: PathBuf, map: Arc<Mmap>) -> Result<Self> {
        let mut cur = Cursor {
            bytes: &map[..],
            pos: 0,
            path: &path,
        };
        let magic = cur.take(4, "magic")?;
        if magic != MAGIC {
            return Err(Error::corrupt(
                &path,
                format!("not a GGUF file (magic {magic:02x?}, expected \"GGUF\")"),
            ));
        }
        let version = cur.u32("version")?;
        if !(2..=3).contains(&version) {
            return Err(Error::unsupported(
                format!("GGUF version {version} in {}", path.display()),
                "nibble reads GGUF v2 and v3",
            ));
        }
        let n_tensors = cur.u64("tensor count")?;
        let n_kv = cur.u64("metadata count")?;
        // Each entry needs at least a few bytes; a larger count means a corrupt header.
        cur.check_count(n_tensors, 24, "tensor count")?;
        cur.check_count(n_kv, 12, "metadata count")?;

        let mut metadata = HashMap::with_capacity(n_kv as usize);
        let mut keys = Vec::with_capacity(n_kv as usize);
        for _ in 0..n_kv {
            let key = cur.string("metadata key")?;
            let ty = cur.u32("metadata type")?;
            let value = cur.value(ty, &key, 0)?;
            keys.push(key.clone());
            metadata.insert(key, value);
        }

        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => match v.as_u64() {
                Some(a) if a > 0 && a.is_power_of_two() => a,
                _ => {
                    return Err(Error::corrupt(
                        &path,
                        format!("general.alignment {v:?} is not a power of two"),
                    ));
                }
            },
        };

        struct RawInfo {
            name: String,
            dims: Vec<usize>,
            ty: GgmlType,
            offset: u64,
        }
        let mut raw = Vec::with_capacity(n_tensors as usize);
        for _ in 0..n_tensors {
            let name = cur.string("tensor name")?;
            let n_dims = cur.u32("tensor rank")?;
            if n_dims == 0 || n_dims > 4 {
                return Err(Error::corrupt(
                    &path,
                    format!("tensor '{name}' has rank {n_dims} (expected 1 to 4)"),
                ));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                let d = cur.u64("tensor dimension")?;
                dims.push(usize::try_from(d).map_err(|_| {
                    Error::corrupt(&path, format!("tensor '{name}' dimension {d} overflows"))
                })?);
            }
            let ty = GgmlType::from_id(cur.u32("tensor type")?).map_err(|e| match e {
                Error::Unsupported { what, detail } => Error::Unsupported {
                    what: format!("{what} of tensor '{name}' in {}", path.display()),
                    detail,
                },
                other => other,
            })?;
            let offset = cur.u64("tensor offset")?;
            raw.push(RawInfo {
                name,
                dims,
                ty,
                offset,
            });
        }

        let data_start = (cur.pos as u64).div_ceil(alignment) * alignment;
        let file_len = map.len() as u64;
        let mut tensors = Vec::with_capacity(raw.len());
        let mut by_name = HashMap::with_capacity(raw.len());
        for r in raw {
            let elems = r
                .dims
                .iter()
                .try_fold(1usize, |acc, &d| acc.checked_mul(d))
                .ok_or_else(|| {
                    Error::corrupt(
                        &path,
                        format!("tensor '{}' element count overflows", r.name),
                    )
                })?;
            let len = r.ty.bytes_for(elems).map_err(|_| {
                Error::corrupt(
                    &path,
                    format!(
                        "tensor '{}' has {} columns, not a multiple of the {}-element {} block",
                        r.name,
                        r.dims[0],
                        r.ty.block_elems(),
                        r.ty
                    ),
                )
            })?;
            if r.dims[0] % r.ty.block_elems() != 0 {
                return Err(Error::corrupt(
                    &path,
                    format!(
                        "tensor '{}' rows of {} elements are not whole {} blocks",
                        r.name, r.dims[0], r.ty
                    ),
                ));
            }
            if r.offset % alignment != 0 {
                return Err(Error::corrupt(
                    &path,
                    format!(
                        "tensor '{}' offset {} is not aligned to {alignment}",
                        r.name, r.offset
                    ),
                ));
            }
            let start = data_start.checked_add(r.offset);
            let end = start.and_then(|s| s.checked_add(len as u64));
            match (start, end) {
                (Some(s), Some(e)) if e <= file_len => {
                    if by_name.insert(r.name.clone(), tensors.len()).is_some() {
                        return Err(Error::corrupt(
                            &path,
                            format!("tensor '{}' appears twice", r.name),
                        ));
                    }
                    tensors.push(TensorInfo {
                        name: r.name,
                        dims: r.dims,
                        ty: r.ty,
                        start: s as usize,
                        len,
                    });
                }
                _ => {
                    return Err(Error::corrupt(
                        &path,
                        format!(
                            "tensor '{}' ({} bytes at data offset {}) runs past the end of the \
                             {file_len}-byte file: the file is truncated",
                            r.name, len, r.offset
                        ),
                    ));
                }
            }
        }

        Ok(GgufFile {
            path,
            map,
            version,
            alignment: alignment as usize,
            metadata,
            keys,
            tensors,
            by_name,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn metadata(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.get(key)
    }

    /// Metadata keys in file order.
    pub fn metadata_keys(&self) -> &[String] {
        &self.keys
    }

    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.by_name.get(name).map(|&i| &self.tensors[i])
    }

    /// The tensor's bytes, borrowed from the map.
    pub fn tensor_bytes(&self, info: &TensorInfo) -> &[u8] {
        &self.map[info.start..info.start + info.len]
    }

    /// The shared map, so weights can borrow tensor bytes without copying.
    pub fn mmap(&self) -> &Arc<Mmap> {
        &self.map
    }

    // Typed metadata getters whose errors name the key and the file.

    pub fn get_u64(&self, key: &str) -> Result<u64> {
        self.require(key)?
            .as_u64()
            .ok_or_else(|| self.wrong_type(key, "an unsigned integer"))
    }

    pub fn get_f64(&self, key: &str) -> Result<f64> {
        self.require(key)?
            .as_f64()
            .ok_or_else(|| self.wrong_type(key, "a number"))
    }

    pub fn get_str(&self, key: &str) -> Result<&str> {
        self.require(key)?
            .as_str()
            .ok_or_else(|| self.wrong_type(key, "a string"))
    }

    pub fn get_str_array(&self, key: &str) -> Result<Vec<&str>> {
        let arr = self
            .require(key)?
            .as_array()
            .ok_or_else(|| self.wrong_type(key, "an array"))?;
        arr.iter()
            .map(|v| {
                v.as_str()
                    .ok_or_else(|| self.wrong_type(key, "an array of strings"))
            })
            .collect()
    }

    fn require(&self, key: &str) -> Result<&MetaValue> {
        self.metadata.get(key).ok_or_else(|| {
            Error::corrupt(
                &self.path,
                format!("required metadata key '{key}' is missing"),
            )
        })
    }

    fn wrong_type(&self, key: &str, expected: &str) -> Error {
        Error::corrupt(
            &self.path,
            format!(
                "metadata key '{key}' should be {expected}, found {:?}",
                self.metadata[key]
            ),
        )
    }
}

struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        match self.pos.checked_add(n) {
            Some(end) if end <= self.bytes.len() => {
                let s = &self.bytes[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            _ => Err(Error::corrupt(
                self.path,
                format!(
                    "file ends while reading {what} at byte {} (file is {} bytes): truncated",
                    self.pos,
                    self.bytes.len()
                ),
            )),
        }
    }

    fn check_count(&self, count: u64, min_bytes_each: u64, what: &str) -> Result<()> {
        let remaining = (self.bytes.len() - self.pos) as u64;
        if count.saturating_mul(min_bytes_each) > remaining {
            return Err(Error::corrupt(
                self.path,
                format!("{what} {count} cannot fit in the remaining {remaining} bytes"),
            ));
        }
        Ok(())
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        Ok(self
            .take(N, what)?
            .try_into()
            .expect("take returned N bytes"))
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let len = self.u64(what)?;
        self.check_count(len, 1, what)?;
        let bytes = self.take(len as usize, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| {
            Error::corrupt(
                self.path,
                format!("{what} at byte {} is not UTF-8", self.pos),
            )
        })
    }

    fn value(&mut self, ty: u32, key: &str, depth: u32) -> Result<MetaValue> {
        Ok(match ty {
            0 => MetaValue::U8(self.array::<1>(key)?[0]),
            1 => MetaValue::I8(self.array::<1>(key)?[0] as i8),
            2 => MetaValue::U16(u16::from_le_bytes(self.array(key)?)),
            3 => MetaValue::I16(i16::from_le_bytes(self.array(key)?)),
            4 => MetaValue::U32(u32::from_le_bytes(self.array(key)?)),
            5 => MetaValue::I32(i32::from_le_bytes(self.array(key)?)),
            6 => MetaValue::F32(f32::from_le_bytes(self.array(key)?)),
            7 => MetaValue::Bool(self.array::<1>(key)?[0] != 0),
            8 => MetaValue::String(self.string(key)?),
            9 => {
                if depth > 2 {
                    return Err(Error::corrupt(
                        self.path,
                        format!("metadata '{key}' nests arrays too deeply"),
                    ));
                }
                let item_ty = self.u32(key)?;
                let n = self.u64(key)?;
                self.check_count(n, 1, key)?;
                let mut items = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    items.push(self.value(item_ty, key, depth + 1)?);
                }
                MetaValue::Array(items)
            }
            10 => MetaValue::U64(u64::from_le_bytes(self.array(key)?)),
            11 => MetaValue::I64(i64::from_le_bytes(self.array(key)?)),
            12 => MetaValue::F64(f64::from_le_bytes(self.array(key)?)),
            other => {
                return Err(Error::corrupt(
                    self.path,
                    format!("metadata '{key}' has unknown value type {other}"),
                ));
            }
        })
    }
}
