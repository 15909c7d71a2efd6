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

use crate::config::{ModelConfig, TensorLayout};
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

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use nibble_formats::safetensors_dir::SafetensorsDir;
    use nibble_precision::{ActQuant, WeightCodec};

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
}
