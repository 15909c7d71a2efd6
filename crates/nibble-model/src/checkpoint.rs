//! nibble's quantized checkpoint: a Hugging Face model directory (`config.json`, tokenizer files,
//! `model.safetensors`) whose quantized linear weights are stored as `U8 [rows, row_bytes]`
//! byte matrices in the layout of their nibble codec, described by `nibble_quant.json`.
//! `docs/checkpoint-format.md` is the specification; this module writes and reads it.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use nibble_core::{Error, Result};
use nibble_formats::tokenizer::Tokenizer;
use nibble_precision::{LinearFormat, PrecisionSpec};
use safetensors::Dtype;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use nibble_formats::safetensors_dir::SafetensorsDir;
use nibble_formats::{HostTensor, WeightFormat};

use crate::config::{ModelConfig, TensorLayout};
use crate::source::TensorSource;
use crate::transformer::{TensorRole, model_tensors};

/// The `nibble_quant.json` schema version this build writes and the only one it reads.
pub const CHECKPOINT_VERSION: u32 = 1;
/// The file whose presence marks a directory as a nibble checkpoint.
pub const QUANT_FILE: &str = "nibble_quant.json";
/// The `format` field of `nibble_quant.json`.
const FORMAT_NAME: &str = "nibble-quant";
const WEIGHTS_FILE: &str = "model.safetensors";

/// One tensor to write, under its Hugging Face name.
#[derive(Debug, Clone)]
pub struct CheckpointTensor {
    /// e.g. `model.layers.0.self_attn.q_proj.weight`.
    pub name: String,
    /// The logical shape: `[rows, cols]` (`[out, in]`) for a linear weight, whatever the
    /// storage.
    pub shape: Vec<usize>,
    pub data: CheckpointData,
}

#[derive(Debug, Clone)]
pub enum CheckpointData {
    F32(Vec<f32>),
    F16(Vec<f16>),
    Bf16(Vec<bf16>),
    /// `rows` rows of `format.row_bytes(cols)` bytes each, in the codec's row layout.
    Quant {
        format: LinearFormat,
        bytes: Vec<u8>,
    },
}

impl CheckpointData {
    fn dtype(&self) -> Dtype {
        match self {
            CheckpointData::F32(_) => Dtype::F32,
            CheckpointData::F16(_) => Dtype::F16,
            CheckpointData::Bf16(_) => Dtype::BF16,
            CheckpointData::Quant { .. } => Dtype::U8,
        }
    }

    /// Dense values held (0 for quantized data, whose size is checked in bytes).
    fn values(&self) -> usize {
        match self {
            CheckpointData::F32(v) => v.len(),
            CheckpointData::F16(v) => v.len(),
            CheckpointData::Bf16(v) => v.len(),
            CheckpointData::Quant { .. } => 0,
        }
    }

    fn byte_len(&self) -> usize {
        match self {
            CheckpointData::F32(v) => v.len() * 4,
            CheckpointData::F16(v) => v.len() * 2,
            CheckpointData::Bf16(v) => v.len() * 2,
            CheckpointData::Quant { bytes, .. } => bytes.len(),
        }
    }
}

/// `nibble_quant.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct QuantManifest {
    /// Always `"nibble-quant"`.
    pub format: String,
    pub version: u32,
    /// The deployment's `WxAyKVz` spec, e.g. `w4a8-g128-kv4`.
    pub spec: String,
    /// Method, calibration data, tool versions: free-form, for people.
    #[serde(default)]
    pub provenance: Value,
    pub tensors: BTreeMap<String, ManifestTensor>,
}

/// One tensor's entry in `nibble_quant.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ManifestTensor {
    /// Logical shape (`[out, in]` for a linear weight).
    pub shape: Vec<usize>,
    /// `CODEC/ACT` (`LinearFormat`'s name) for a quantized tensor; absent for a dense one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format: Option<String>,
    /// The safetensors dtype it is stored as: `U8` when quantized, else `F32`, `F16`, `BF16`.
    pub dtype: String,
    /// The safetensors shape: `[rows, row_bytes]` when quantized, else the logical shape.
    pub stored_shape: Vec<usize>,
}

/// Writes a nibble checkpoint directory at `dir`: every file is written into a fresh sibling
/// directory which is renamed onto `dir` only when complete, so a failure leaves no partial
/// checkpoint. An existing non-empty `dir` is refused unless `overwrite`.
///
/// `tensors` must be exactly the set the architecture loads (see [`model_tensors`]), with
/// their logical shapes; quantized data is accepted only for weights. `provenance` (an object
/// or null) is stored as given plus `nibble_version`.
pub fn write_checkpoint(
    dir: &Path,
    config: &ModelConfig,
    tokenizer: &Tokenizer,
    spec: &PrecisionSpec,
    tensors: &[CheckpointTensor],
    provenance: Value,
    overwrite: bool,
) -> Result<()> {
    check_target(dir, overwrite)?;
    let manifest = build_manifest(config, spec, tensors, provenance)?;
    let layout = TensorLayout::from_names(tensors.iter().map(|t| t.name.as_str()));
    let mut hf = config.to_hf_json(&layout)?;
    let o = hf.as_object_mut().expect("to_hf_json returns an object");
    o.insert("torch_dtype".into(), torch_dtype(tensors).into());
    if let Some(id) = tokenizer
        .bos_token
        .as_deref()
        .and_then(|t| tokenizer.token_to_id(t))
    {
        o.insert("bos_token_id".into(), id.into());
    }
    match tokenizer.eos_ids.as_slice() {
        [] => {}
        [one] => {
            o.insert("eos_token_id".into(), (*one).into());
        }
        many => {
            o.insert("eos_token_id".into(), many.to_vec().into());
        }
    }

    let parent = match dir.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    std::fs::create_dir_all(&parent).map_err(|e| Error::io(&parent, e))?;
    let tmp = sibling(dir, "tmp");
    std::fs::create_dir(&tmp).map_err(|e| Error::io(&tmp, e))?;
    let written = (|| -> Result<()> {
        write_json(&tmp.join("config.json"), &hf)?;
        tokenizer.write_hf_files(&tmp)?;
        write_safetensors(&tmp.join(WEIGHTS_FILE), tensors)?;
        let m = serde_json::to_value(&manifest)
            .map_err(|e| Error::InvalidArgument(format!("cannot serialize {QUANT_FILE}: {e}")))?;
        write_json(&tmp.join(QUANT_FILE), &m)?;
        for name in [
            "config.json",
            "tokenizer.json",
            "tokenizer_config.json",
            WEIGHTS_FILE,
            QUANT_FILE,
        ] {
            sync_file(&tmp.join(name))?;
        }
        Ok(())
    })();
    if let Err(e) = written.and_then(|()| publish(&tmp, dir)) {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    Ok(())
}

fn check_target(dir: &Path, overwrite: bool) -> Result<()> {
    match std::fs::metadata(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Error::io(dir, e)),
        Ok(m) if !m.is_dir() => Err(Error::InvalidArgument(format!(
            "checkpoint output {} exists and is not a directory",
            dir.display()
        ))),
        Ok(_) => {
            let empty = std::fs::read_dir(dir)
                .map_err(|e| Error::io(dir, e))?
                .next()
                .is_none();
            if empty || overwrite {
                Ok(())
            } else {
                Err(Error::InvalidArgument(format!(
                    "checkpoint output {} exists and is not empty; choose another directory or \
                     ask to overwrite it",
                    dir.display()
                )))
            }
        }
    }
}

/// A fresh hidden path beside `dir` for staging or for the replaced checkpoint.
fn sibling(dir: &Path, what: &str) -> PathBuf {
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "checkpoint".into());
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    dir.with_file_name(format!(
        ".{name}.nibble-{what}-{}-{nanos}",
        std::process::id()
    ))
}

/// Moves the finished `tmp` directory to `dir`. An existing `dir` is first moved aside (and
/// restored if the second rename fails), so `dir` always holds a whole checkpoint or its
/// previous contents.
fn publish(tmp: &Path, dir: &Path) -> Result<()> {
    let old = if dir.exists() {
        let old = sibling(dir, "old");
        std::fs::rename(dir, &old).map_err(|e| Error::io(dir, e))?;
        Some(old)
    } else {
        None
    };
    if let Err(e) = std::fs::rename(tmp, dir) {
        if let Some(old) = &old {
            let _ = std::fs::rename(old, dir);
        }
        return Err(Error::io(dir, e));
    }
    if let Some(old) = old {
        std::fs::remove_dir_all(&old).map_err(|e| Error::io(&old, e))?;
    }
    if let Some(parent) = dir.parent()
        && let Ok(d) = std::fs::File::open(parent)
    {
        // Best effort: make the rename itself durable where the platform allows it.
        let _ = d.sync_all();
    }
    Ok(())
}

fn build_manifest(
    config: &ModelConfig,
    spec: &PrecisionSpec,
    tensors: &[CheckpointTensor],
    provenance: Value,
) -> Result<QuantManifest> {
    let bad = |m: String| Err(Error::InvalidArgument(m));
    let spec_name = spec.to_string();
    if spec_name.parse::<PrecisionSpec>().ok() != Some(*spec) {
        return bad(format!(
            "precision {spec_name} cannot be written: it does not read back as the same spec"
        ));
    }
    let mut provenance = match provenance {
        Value::Null => serde_json::Map::new(),
        Value::Object(o) => o,
        other => {
            return bad(format!(
                "checkpoint provenance must be a JSON object, got {other}"
            ));
        }
    };
    provenance.insert(
        "nibble_version".into(),
        env!("CARGO_PKG_VERSION").to_string().into(),
    );

    let layout = TensorLayout::from_names(tensors.iter().map(|t| t.name.as_str()));
    let expected: HashMap<String, (Vec<usize>, TensorRole)> = model_tensors(config, &layout)
        .into_iter()
        .map(|(n, s, r)| (n, (s, r)))
        .collect();
    let mut entries = BTreeMap::new();
    for t in tensors {
        let Some((shape, role)) = expected.get(&t.name) else {
            return bad(format!(
                "tensor '{}' is not one a {:?} model with this config loads",
                t.name, config.arch
            ));
        };
        if &t.shape != shape {
            return Err(Error::ShapeMismatch {
                name: t.name.clone(),
                expected: shape.clone(),
                found: t.shape.clone(),
            });
        }
        let elems: usize = t.shape.iter().product();
        let (format, stored_shape) = match &t.data {
            CheckpointData::Quant { format, bytes } => {
                if *role != TensorRole::Weight {
                    return bad(format!(
                        "tensor '{}' is a norm or bias and cannot be stored quantized",
                        t.name
                    ));
                }
                let name = format.to_string();
                if name.parse::<LinearFormat>().ok() != Some(*format) {
                    return bad(format!(
                        "tensor '{}': format {name} does not read back as the same format",
                        t.name
                    ));
                }
                let (rows, cols) = (t.shape[0], t.shape[1]);
                let rb = format
                    .row_bytes(cols)
                    .map_err(|e| Error::InvalidArgument(format!("tensor '{}': {e}", t.name)))?;
                if bytes.len() != rows * rb {
                    return bad(format!(
                        "tensor '{}': {} bytes for {rows} rows of {rb} bytes ({name})",
                        t.name,
                        bytes.len()
                    ));
                }
                (Some(name), vec![rows, rb])
            }
            dense => {
                if dense.values() != elems {
                    return bad(format!(
                        "tensor '{}': {} values for shape {:?}",
                        t.name,
                        dense.values(),
                        t.shape
                    ));
                }
                (None, t.shape.clone())
            }
        };
        let entry = ManifestTensor {
            shape: t.shape.clone(),
            format,
            dtype: dtype_name(t.data.dtype()).to_string(),
            stored_shape,
        };
        if entries.insert(t.name.clone(), entry).is_some() {
            return bad(format!("tensor '{}' is given twice", t.name));
        }
    }
    let given: HashSet<&str> = tensors.iter().map(|t| t.name.as_str()).collect();
    let mut missing: Vec<&str> = expected
        .keys()
        .map(String::as_str)
        .filter(|n| !given.contains(n))
        .collect();
    if !missing.is_empty() {
        missing.sort_unstable();
        return bad(format!(
            "the checkpoint lacks {} tensor(s) the model needs, first '{}'",
            missing.len(),
            missing[0]
        ));
    }
    Ok(QuantManifest {
        format: FORMAT_NAME.into(),
        version: CHECKPOINT_VERSION,
        spec: spec_name,
        provenance: Value::Object(provenance),
        tensors: entries,
    })
}

/// HF's `torch_dtype`: the widest-spread dense type among the tensors.
fn torch_dtype(tensors: &[CheckpointTensor]) -> &'static str {
    let has = |d: Dtype| tensors.iter().any(|t| t.data.dtype() == d);
    if has(Dtype::BF16) {
        "bfloat16"
    } else if has(Dtype::F16) {
        "float16"
    } else {
        "float32"
    }
}

fn dtype_name(d: Dtype) -> &'static str {
    match d {
        Dtype::F32 => "F32",
        Dtype::F16 => "F16",
        Dtype::BF16 => "BF16",
        Dtype::U8 => "U8",
        _ => "?",
    }
}

fn write_json(path: &Path, v: &Value) -> Result<()> {
    let text = serde_json::to_string_pretty(v)
        .map_err(|e| Error::InvalidArgument(format!("cannot serialize {}: {e}", path.display())))?;
    std::fs::write(path, text + "\n").map_err(|e| Error::io(path, e))
}

fn sync_file(path: &Path) -> Result<()> {
    std::fs::File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(|e| Error::io(path, e))
}

/// A tensor as safetensors sees it; float data is converted to little-endian bytes one tensor
/// at a time while the file is written, so the whole model is never copied at once.
struct StView<'a> {
    shape: Vec<usize>,
    data: &'a CheckpointData,
}

impl safetensors::View for StView<'_> {
    fn dtype(&self) -> Dtype {
        self.data.dtype()
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        match self.data {
            CheckpointData::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            CheckpointData::F16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            CheckpointData::Bf16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            CheckpointData::Quant { bytes, .. } => Cow::Borrowed(bytes),
        }
    }
    fn data_len(&self) -> usize {
        self.data.byte_len()
    }
}

fn write_safetensors(path: &Path, tensors: &[CheckpointTensor]) -> Result<()> {
    let views = tensors.iter().map(|t| {
        let shape = match &t.data {
            CheckpointData::Quant { bytes, .. } => {
                let rows = t.shape[0];
                vec![rows, bytes.len() / rows.max(1)]
            }
            _ => t.shape.clone(),
        };
        (
            t.name.as_str(),
            StView {
                shape,
                data: &t.data,
            },
        )
    });
    // transformers refuses safetensors files without a `format` entry in the metadata.
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(views, Some(meta), path)
        .map_err(|e| Error::io(path, std::io::Error::other(e.to_string())))
}

/// A nibble checkpoint opened for loading: float tensors as stored, quantized ones as
/// [`WeightFormat::Quant`] host tensors with their logical shape, borrowing the memory map.
pub struct CheckpointSource {
    st: SafetensorsDir,
    quant: HashMap<String, (LinearFormat, Vec<usize>)>,
    manifest: QuantManifest,
    spec: PrecisionSpec,
}

impl CheckpointSource {
    /// Opens and validates the checkpoint at `dir` (which holds [`QUANT_FILE`]): the manifest's
    /// schema and version, every format name, and each tensor's dtype and stored size against
    /// `model.safetensors`, both ways.
    pub fn open(dir: &Path) -> Result<Self> {
        let path = dir.join(QUANT_FILE);
        let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
        let manifest = parse_manifest(&text, &path)?;
        let corrupt = |m: String| Error::corrupt(&path, m);
        let spec: PrecisionSpec = manifest
            .spec
            .parse()
            .map_err(|e| corrupt(format!("field 'spec': {e}")))?;
        let st = SafetensorsDir::open_any(dir)?;
        let mut quant = HashMap::new();
        for (name, t) in &manifest.tensors {
            let stored = st.raw(name).ok_or_else(|| Error::MissingTensor {
                name: name.clone(),
                source_name: format!(
                    "the safetensors files of {} (listed in {QUANT_FILE})",
                    dir.display()
                ),
            })?;
            let file = st.file_of(name).unwrap_or(&path).display().to_string();
            let stored_dtype = dtype_name(stored.dtype);
            if stored_dtype != t.dtype || stored.shape != t.stored_shape {
                return Err(corrupt(format!(
                    "tensor '{name}' is listed as {} {:?} but {file} stores {:?} {:?}",
                    t.dtype, t.stored_shape, stored.dtype, stored.shape
                )));
            }
            match &t.format {
                Some(f) => {
                    let format: LinearFormat = f
                        .parse()
                        .map_err(|e| corrupt(format!("tensor '{name}' has format '{f}': {e}")))?;
                    let [rows, cols] = t.shape[..] else {
                        return Err(corrupt(format!(
                            "tensor '{name}' is quantized but its shape {:?} is not [rows, cols]",
                            t.shape
                        )));
                    };
                    let rb = format
                        .row_bytes(cols)
                        .map_err(|e| corrupt(format!("tensor '{name}': {e}")))?;
                    if t.dtype != "U8" || t.stored_shape != [rows, rb] {
                        return Err(corrupt(format!(
                            "tensor '{name}' ({f}, shape {:?}) must be stored as U8 [{rows}, \
                             {rb}] ({rows} rows of {rb} bytes), not {} {:?}",
                            t.shape, t.dtype, t.stored_shape
                        )));
                    }
                    if stored.bytes.len() != rows * rb {
                        return Err(corrupt(format!(
                            "tensor '{name}' holds {} bytes in {file}, not {rows} x {rb}",
                            stored.bytes.len()
                        )));
                    }
                    quant.insert(name.clone(), (format, t.shape.clone()));
                }
                None => {
                    if !matches!(t.dtype.as_str(), "F32" | "F16" | "BF16") {
                        return Err(corrupt(format!(
                            "tensor '{name}' has no format, so it must be F32, F16 or BF16, \
                             not {}",
                            t.dtype
                        )));
                    }
                    if t.stored_shape != t.shape {
                        return Err(corrupt(format!(
                            "dense tensor '{name}' has shape {:?} but stored shape {:?}",
                            t.shape, t.stored_shape
                        )));
                    }
                }
            }
        }
        let mut unlisted: Vec<&str> = st
            .names()
            .filter(|n| !manifest.tensors.contains_key(*n))
            .collect();
        if !unlisted.is_empty() {
            unlisted.sort_unstable();
            return Err(corrupt(format!(
                "{} tensor(s) in the safetensors files are not listed, first '{}'",
                unlisted.len(),
                unlisted[0]
            )));
        }
        Ok(CheckpointSource {
            st,
            quant,
            manifest,
            spec,
        })
    }

    /// The deployment spec the checkpoint was made for.
    pub fn spec(&self) -> PrecisionSpec {
        self.spec
    }

    pub fn manifest(&self) -> &QuantManifest {
        &self.manifest
    }
}

impl TensorSource for CheckpointSource {
    fn get(&self, name: &str) -> Option<HostTensor> {
        match self.quant.get(name) {
            Some((format, shape)) => Some(HostTensor {
                name: name.to_string(),
                shape: shape.clone(),
                format: WeightFormat::Quant(*format),
                bytes: self.st.raw(name)?.bytes,
            }),
            None => self.st.get(name),
        }
    }

    fn origin(&self) -> String {
        self.st.dir().display().to_string()
    }
}

/// Parses `nibble_quant.json`, checking the format name and version before the schema, so a
/// newer file is reported as newer rather than as malformed.
fn parse_manifest(text: &str, path: &Path) -> Result<QuantManifest> {
    let corrupt = |m: String| Error::corrupt(path, m);
    let v: Value = serde_json::from_str(text).map_err(|e| corrupt(format!("invalid JSON: {e}")))?;
    if v.get("format").and_then(Value::as_str) != Some(FORMAT_NAME) {
        return Err(corrupt(format!(
            "field 'format' must be \"{FORMAT_NAME}\", found {}",
            v.get("format").unwrap_or(&Value::Null)
        )));
    }
    match v.get("version").and_then(Value::as_u64) {
        Some(n) if n == CHECKPOINT_VERSION as u64 => {}
        Some(n) => {
            return Err(Error::unsupported(
                format!("{} version {n}", path.display()),
                format!(
                    "this nibble reads nibble_quant.json version {CHECKPOINT_VERSION}; {}",
                    if n > CHECKPOINT_VERSION as u64 {
                        "the checkpoint was written by a newer nibble"
                    } else {
                        "re-create the checkpoint"
                    }
                ),
            ));
        }
        None => {
            return Err(corrupt(format!(
                "field 'version' must be a non-negative integer, found {}",
                v.get("version").unwrap_or(&Value::Null)
            )));
        }
    }
    serde_json::from_value(v).map_err(|e| corrupt(format!("schema: {e}")))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use nibble_formats::safetensors_dir::SafetensorsDir;
    use nibble_precision::{ActQuant, KvFormat, KvSpec, WeightCodec};

    pub(crate) fn fixture(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures")
            .join(name)
    }

    /// A fixture model as checkpoint tensors: projections quantized with `format` (when given),
    /// everything else f32.
    pub(crate) fn fixture_tensors(
        name: &str,
        format: Option<LinearFormat>,
    ) -> (ModelConfig, Tokenizer, Vec<CheckpointTensor>) {
        let dir = fixture(name);
        let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
        let config = ModelConfig::from_hf_json(&text, "config.json").unwrap();
        let tokenizer = Tokenizer::from_hf_dir(&dir).unwrap();
        let st = SafetensorsDir::open(&dir).unwrap();
        let mut names: Vec<&str> = st.names().collect();
        names.sort_unstable();
        let tensors = names
            .into_iter()
            .map(|n| {
                let t = st.get(n).unwrap();
                let values = t.to_f32().unwrap();
                let data = match format {
                    Some(f) if n.contains("_proj.weight") => {
                        let (rows, cols) = t.rows_cols();
                        let rb = f.row_bytes(cols).unwrap();
                        let mut bytes = vec![0u8; rows * rb];
                        for (row, out) in values.chunks(cols).zip(bytes.chunks_mut(rb)) {
                            f.codec.quantize_row(row, 1.0, out).unwrap();
                        }
                        CheckpointData::Quant { format: f, bytes }
                    }
                    _ => CheckpointData::F32(values),
                };
                CheckpointTensor {
                    name: n.to_string(),
                    shape: t.shape.clone(),
                    data,
                }
            })
            .collect();
        (config, tokenizer, tensors)
    }

    pub(crate) fn int4_g32() -> LinearFormat {
        LinearFormat::new(WeightCodec::Int4Group { group: 32 }, ActQuant::F16).unwrap()
    }

    #[test]
    fn written_directory_is_a_readable_hf_model() {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("ckpt");
        let (config, tok, tensors) = fixture_tensors("tiny-qwen2", Some(int4_g32()));
        let spec: PrecisionSpec = "w4a16-g32-kv8".parse().unwrap();
        let prov = serde_json::json!({"method": "rtn"});
        write_checkpoint(&out, &config, &tok, &spec, &tensors, prov, false).unwrap();

        let text = std::fs::read_to_string(out.join("config.json")).unwrap();
        assert_eq!(ModelConfig::from_hf_json(&text, "c").unwrap(), config);
        let hf: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(hf["eos_token_id"], 257);
        assert_eq!(hf["bos_token_id"], 256);
        assert_eq!(hf["tie_word_embeddings"], false);

        let back = Tokenizer::from_hf_dir(&out).unwrap();
        assert_eq!(back.eos_ids, tok.eos_ids);
        assert_eq!(back.bos_token, tok.bos_token);
        assert_eq!(back.chat_template, tok.chat_template);
        let text = "Hello <|im_start|> world, 123!";
        assert_eq!(
            back.encode(text, true).unwrap(),
            tok.encode(text, true).unwrap()
        );

        let m: QuantManifest =
            serde_json::from_str(&std::fs::read_to_string(out.join(QUANT_FILE)).unwrap()).unwrap();
        assert_eq!(m.version, CHECKPOINT_VERSION);
        assert_eq!(m.spec, "w4a16-g32-kv8");
        assert_eq!(m.provenance["method"], "rtn");
        assert_eq!(m.provenance["nibble_version"], env!("CARGO_PKG_VERSION"));
        let q = &m.tensors["model.layers.1.mlp.down_proj.weight"];
        assert_eq!(q.shape, vec![64, 96]);
        assert_eq!(q.format.as_deref(), Some("int4-g32/a16"));
        assert_eq!(
            (q.dtype.as_str(), q.stored_shape.clone()),
            ("U8", vec![64, 48 + 9])
        );
        let n = &m.tensors["model.norm.weight"];
        assert_eq!((n.format.clone(), n.dtype.as_str()), (None, "F32"));
        // Nothing but the checkpoint is left beside it.
        let names: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().collect();
        assert_eq!(names.len(), 1);
    }

    #[test]
    fn refuses_a_non_empty_directory_unless_asked() {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("ckpt");
        std::fs::create_dir(&out).unwrap();
        std::fs::write(out.join("keep.txt"), "x").unwrap();
        let (config, tok, tensors) = fixture_tensors("tiny-llama3", None);
        let spec = PrecisionSpec::default();
        let e =
            write_checkpoint(&out, &config, &tok, &spec, &tensors, Value::Null, false).unwrap_err();
        assert!(e.to_string().contains("not empty"), "{e}");
        assert!(out.join("keep.txt").exists());
        write_checkpoint(&out, &config, &tok, &spec, &tensors, Value::Null, true).unwrap();
        assert!(!out.join("keep.txt").exists());
        assert!(out.join(QUANT_FILE).exists());
        assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 1);
    }

    #[test]
    fn a_failed_write_leaves_nothing() {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("ckpt");
        let (config, tok, mut tensors) = fixture_tensors("tiny-llama3", Some(int4_g32()));
        let spec = PrecisionSpec::default();
        type Corrupt = Box<dyn Fn(&mut Vec<CheckpointTensor>)>;
        let cases: Vec<(Corrupt, &str)> = vec![
            (
                Box::new(|t| {
                    t.retain(|t| t.name != "model.layers.1.mlp.up_proj.weight");
                }),
                "lacks 1 tensor(s) the model needs, first 'model.layers.1.mlp.up_proj.weight'",
            ),
            (
                Box::new(|t| {
                    let x = t[0].clone();
                    t.push(x);
                }),
                "given twice",
            ),
            (
                Box::new(|t| {
                    let i = t
                        .iter()
                        .position(|t| t.name.ends_with("q_proj.weight"))
                        .unwrap();
                    if let CheckpointData::Quant { bytes, .. } = &mut t[i].data {
                        bytes.pop();
                    }
                }),
                "2431 bytes for 64 rows of 38 bytes",
            ),
            (
                Box::new(|t| {
                    let i = t
                        .iter()
                        .position(|t| t.name == "model.norm.weight")
                        .unwrap();
                    t[i].data = CheckpointData::Quant {
                        format: int4_g32(),
                        bytes: vec![],
                    };
                }),
                "cannot be stored quantized",
            ),
            (
                Box::new(|t| {
                    t.push(CheckpointTensor {
                        name: "model.layers.0.self_attn.rotary_emb.inv_freq".into(),
                        shape: vec![8],
                        data: CheckpointData::F32(vec![0.0; 8]),
                    })
                }),
                "not one a Llama model",
            ),
            (
                Box::new(|t| {
                    let i = t
                        .iter()
                        .position(|t| t.name == "model.norm.weight")
                        .unwrap();
                    t[i].data = CheckpointData::F16(vec![f16::ZERO; 3]);
                }),
                "3 values for shape [64]",
            ),
        ];
        for (corrupt, want) in cases {
            let mut bad = tensors.clone();
            corrupt(&mut bad);
            let e =
                write_checkpoint(&out, &config, &tok, &spec, &bad, Value::Null, false).unwrap_err();
            assert!(e.to_string().contains(want), "want '{want}': {e}");
            assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0);
        }
        tensors.truncate(0);
        let e =
            write_checkpoint(&out, &config, &tok, &spec, &tensors, "x".into(), false).unwrap_err();
        assert!(e.to_string().contains("provenance"), "{e}");
    }

    fn write_fixture(
        name: &str,
        spec: &str,
    ) -> (tempfile::TempDir, PathBuf, Vec<CheckpointTensor>) {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("ckpt");
        let (config, tok, tensors) = fixture_tensors(name, Some(int4_g32()));
        let spec: PrecisionSpec = spec.parse().unwrap();
        write_checkpoint(&out, &config, &tok, &spec, &tensors, Value::Null, false).unwrap();
        (tmp, out, tensors)
    }

    #[test]
    fn open_model_reads_every_tensor_back() {
        let (_tmp, out, tensors) = write_fixture("tiny-qwen3", "w4a16-g32-kv4");
        let files = crate::open_model(&out, None).unwrap();
        assert_eq!(files.precision, Some("w4a16-g32-kv4".parse().unwrap()));
        for t in &tensors {
            let got = files.source.get(&t.name).unwrap();
            assert_eq!(got.shape, t.shape, "{}", t.name);
            let want = match &t.data {
                CheckpointData::Quant { format, bytes } => {
                    assert_eq!(got.format, WeightFormat::Quant(*format), "{}", t.name);
                    assert_eq!(&got.bytes[..], &bytes[..], "{}", t.name);
                    let mut w = vec![0f32; t.shape.iter().product()];
                    format.codec.dequantize(bytes, t.shape[1], &mut w).unwrap();
                    w
                }
                CheckpointData::F32(v) => v.clone(),
                _ => unreachable!("the fixture writes f32 and int4"),
            };
            assert_eq!(got.to_f32().unwrap(), want, "{}", t.name);
            // Quantized data is served from the map, not copied.
            assert!(matches!(
                got.bytes,
                nibble_formats::TensorBytes::Mapped { .. }
            ));
        }
        assert!(
            files
                .source
                .get("model.layers.0.self_attn.q_proj.qweight")
                .is_none()
        );
    }

    /// The spec field carries a KV mix as its own token, and an older checkpoint's uniform
    /// token, the `kv2` alias included, still reads back as both sides in one format.
    #[test]
    fn the_spec_field_stores_a_kv_mix_and_old_uniform_tokens_still_load() {
        let (_tmp, out, _) = write_fixture("tiny-qwen3", "w4a16-g32-k8v4");
        let m: QuantManifest =
            serde_json::from_str(&std::fs::read_to_string(out.join(QUANT_FILE)).unwrap()).unwrap();
        assert_eq!(m.spec, "w4a16-g32-k8v4");
        let files = crate::open_model(&out, None).unwrap();
        let kv = files.precision.unwrap().kv;
        assert_eq!((kv.k, kv.v), (KvFormat::Int8, KvFormat::Int4));

        let path = out.join(QUANT_FILE);
        let text = std::fs::read_to_string(&path).unwrap();
        std::fs::write(&path, text.replace("w4a16-g32-k8v4", "w4a16-g32-kv2")).unwrap();
        let files = crate::open_model(&out, None).unwrap();
        assert_eq!(
            files.precision.unwrap().kv,
            KvSpec::uniform(KvFormat::Int2Channel)
        );
    }

    /// Rewrites `model.safetensors` of `dir` after `edit` changes its tensor list.
    fn rewrite_weights(
        dir: &Path,
        edit: impl FnOnce(&mut Vec<(String, Dtype, Vec<usize>, Vec<u8>)>),
    ) {
        let st = SafetensorsDir::open_any(dir).unwrap();
        let mut all: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = st
            .names()
            .map(|n| {
                let r = st.raw(n).unwrap();
                (n.to_string(), r.dtype, r.shape, r.bytes.to_vec())
            })
            .collect();
        drop(st);
        edit(&mut all);
        let views: Vec<(String, safetensors::tensor::TensorView)> = all
            .iter()
            .map(|(n, d, s, b)| {
                (
                    n.clone(),
                    safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
                )
            })
            .collect();
        safetensors::serialize_to_file(views, None, &dir.join(WEIGHTS_FILE)).unwrap();
    }

    fn edit_manifest(dir: &Path, edit: impl FnOnce(&mut Value)) {
        let p = dir.join(QUANT_FILE);
        let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        edit(&mut v);
        std::fs::write(&p, v.to_string()).unwrap();
    }

    fn open_err(dir: &Path) -> String {
        match crate::open_model(dir, None) {
            Ok(_) => panic!("{} opened", dir.display()),
            Err(e) => e.to_string(),
        }
    }

    const Q: &str = "model.layers.0.self_attn.q_proj.weight";

    #[test]
    fn manifest_errors_name_the_file_and_field() {
        type Edit = Box<dyn Fn(&mut Value)>;
        let cases: Vec<(Edit, &str)> = vec![
            (
                Box::new(|v| v["version"] = 2.into()),
                "version 2 is not supported: this nibble reads nibble_quant.json version 1; the \
                 checkpoint was written by a newer nibble",
            ),
            (Box::new(|v| v["version"] = "1".into()), "field 'version'"),
            (
                Box::new(|v| v["format"] = "safetensors".into()),
                "field 'format'",
            ),
            (
                Box::new(|v| {
                    v.as_object_mut().unwrap().remove("spec");
                }),
                "schema: missing field `spec`",
            ),
            (Box::new(|v| v["spec"] = "w5a16".into()), "field 'spec'"),
            (
                Box::new(|v| v["tensors"][Q]["scale"] = 1.into()),
                "unknown field `scale`",
            ),
            (
                Box::new(|v| v["tensors"][Q]["shape"] = "x".into()),
                "schema: invalid type",
            ),
            (
                Box::new(|v| v["tensors"][Q]["format"] = "int9-g32/a16".into()),
                "tensor 'model.layers.0.self_attn.q_proj.weight' has format 'int9-g32/a16'",
            ),
            (
                Box::new(|v| v["tensors"][Q]["format"] = "int4-g64/a16".into()),
                "must be stored as U8 [64, 35] (64 rows of 35 bytes), not U8 [64, 38]",
            ),
            (
                Box::new(|v| v["tensors"][Q]["stored_shape"] = serde_json::json!([64, 37])),
                "is listed as U8 [64, 37] but",
            ),
            (
                Box::new(|v| v["tensors"]["model.norm.weight"]["dtype"] = "U8".into()),
                "is listed as U8 [64] but",
            ),
            (
                Box::new(|v| {
                    v["tensors"].as_object_mut().unwrap().remove(Q);
                }),
                "1 tensor(s) in the safetensors files are not listed, first \
                 'model.layers.0.self_attn.q_proj.weight'",
            ),
        ];
        for (edit, want) in cases {
            let (_tmp, out, _) = write_fixture("tiny-llama3", "w4a16-g32");
            edit_manifest(&out, edit);
            let e = open_err(&out);
            assert!(e.contains(want), "want '{want}': {e}");
            assert!(e.contains(QUANT_FILE), "{e}");
        }
        let (_tmp, out, _) = write_fixture("tiny-llama3", "w4a16-g32");
        std::fs::write(out.join(QUANT_FILE), "{\"format\": ").unwrap();
        let e = open_err(&out);
        assert!(
            e.contains("nibble_quant.json") && e.contains("invalid JSON"),
            "{e}"
        );
    }

    #[test]
    fn weight_file_errors_name_the_tensor() {
        // A tensor the manifest lists is gone.
        let (_tmp, out, _) = write_fixture("tiny-llama3", "w4a16-g32");
        rewrite_weights(&out, |all| all.retain(|t| t.0 != Q));
        let e = open_err(&out);
        assert!(e.contains(&format!("tensor '{Q}' is missing")), "{e}");

        // Stored bytes that are not rows x row_bytes: one row short.
        let (_tmp, out, _) = write_fixture("tiny-llama3", "w4a16-g32");
        rewrite_weights(&out, |all| {
            let t = all.iter_mut().find(|t| t.0 == Q).unwrap();
            t.2 = vec![63, 38];
            t.3.truncate(63 * 38);
        });
        let e = open_err(&out);
        assert!(
            e.contains("is listed as U8 [64, 38] but") && e.contains("[63, 38]"),
            "{e}"
        );

        // A truncated file.
        let (_tmp, out, _) = write_fixture("tiny-llama3", "w4a16-g32");
        let p = out.join(WEIGHTS_FILE);
        let len = std::fs::metadata(&p).unwrap().len();
        let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
        f.set_len(len - 100).unwrap();
        let e = open_err(&out);
        assert!(
            e.contains("model.safetensors") && e.contains("invalid safetensors"),
            "{e}"
        );
    }
}
