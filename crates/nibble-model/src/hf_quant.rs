//! AutoAWQ and GPTQ checkpoints in their published Hugging Face layouts, converted at load to
//! nibble's `int4-gN/a16` rows (`WeightCodec::Int4Group`: u4 codes, f16 scale, u8 zero,
//! `w = (q - z) * s`), bit-exactly.
//!
//! Both store, per linear layer `X` with `in` inputs, `out` outputs and `G` groups:
//!
//! * AutoAWQ GEMM (`awq/modules/linear/gemm.py`): `X.qweight` int32 `[in, out/8]`,
//!   `X.qzeros` int32 `[G, out/8]`, `X.scales` f16 `[G, out]`. Eight output channels share a
//!   word in the order `[0, 2, 4, 6, 1, 3, 5, 7]`: bits `4i..4i+4` hold channel
//!   `8c + ORDER[i]`. Zeros are stored as they are.
//! * GPTQ (AutoGPTQ, GPTQModel): `X.qweight` int32 `[in/8, out]` packed along the input (bits
//!   `4j..` of word `[r, o]` hold input `8r + j`), `X.qzeros` int32 `[G, out/8]` packed along
//!   the output in plain order, `X.scales` f16 `[G, out]`, `X.g_idx` int32 `[in]` (the group of
//!   each input). Format v1 (`checkpoint_format` "gptq" or absent) stores `zero - 1`, which
//!   readers add back, so its zeros are 1..=16; v2 ("gptq_v2") stores the zero.
//!
//! A layer converts to `Int4Group` rows when its groups are contiguous (no act-order `g_idx`),
//! its group size is one nibble names (32, 64, 128, or the whole row), every zero fits a
//! nibble's 0..=15 and every scale is an f16. Otherwise (act-order GPTQ, other group sizes,
//! a v1 zero of 16, bf16/f32 scales that f16 cannot hold) it converts to dense f32 instead,
//! which is just as exact: `(q - z) * s` with `|q - z| <= 16` is exact in f32 for f16 scales.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use half::{bf16, f16};
use nibble_core::{Error, Result};
use nibble_formats::gguf::GgmlType;
use nibble_formats::safetensors_dir::{Dtype, RawTensor, SafetensorsDir};
use nibble_formats::{HostTensor, TensorBytes, WeightFormat};
use nibble_precision::spec::GROUP_SIZES;
use nibble_precision::{ActQuant, LinearFormat, LinearScheme, PrecisionSpec, WeightCodec};
use serde_json::Value;

use crate::source::TensorSource;

/// Bit position (in nibbles) of output channel `j` of an AutoAWQ word: the inverse of the
/// packing order `[0, 2, 4, 6, 1, 3, 5, 7]` (AutoAWQ's `AWQ_REVERSE_ORDER`).
const AWQ_NIBBLE_OF: [u32; 8] = [0, 4, 1, 5, 2, 6, 3, 7];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HfQuantMethod {
    /// AutoAWQ, GEMM layout.
    Awq,
    /// GPTQ; `v2`: zeros stored as they are (`gptq_v2`), else stored minus one.
    Gptq { v2: bool },
}

/// The parts of a `quantization_config` nibble needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HfQuantConfig {
    pub method: HfQuantMethod,
    /// Input channels per group; `None` for one group per output channel (`group_size: -1`).
    pub group: Option<usize>,
    /// GPTQ act-order: the layers carry a `g_idx` that need not be contiguous.
    pub desc_act: bool,
    /// Where the config came from, for messages.
    pub origin: PathBuf,
}

impl HfQuantConfig {
    /// The quantization of a Hugging Face directory whose `config.json` is `config`: its
    /// `quantization_config`, or for older GPTQ exports a `quantize_config.json` beside it.
    /// `None` for an unquantized model.
    pub fn detect(dir: &Path, config: &Value, config_path: &Path) -> Result<Option<Self>> {
        if let Some(qc) = config.get("quantization_config").filter(|q| !q.is_null()) {
            return Self::parse(qc, config_path, None).map(Some);
        }
        let path = dir.join("quantize_config.json");
        match std::fs::read_to_string(&path) {
            Ok(text) => {
                let qc: Value = serde_json::from_str(&text)
                    .map_err(|e| Error::corrupt(&path, format!("invalid JSON: {e}")))?;
                Self::parse(&qc, &path, Some("gptq")).map(Some)
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(Error::io(&path, e)),
        }
    }

    /// `default_method`: what a config without `quant_method` means (quantize_config.json is
    /// GPTQ's own file).
    fn parse(qc: &Value, origin: &Path, default_method: Option<&str>) -> Result<Self> {
        let corrupt = |m: String| Error::corrupt(origin, m);
        if !qc.is_object() {
            return Err(corrupt(
                "the quantization config is not a JSON object".into(),
            ));
        }
        let text = |k: &str| {
            qc.get(k)
                .and_then(Value::as_str)
                .map(str::to_ascii_lowercase)
        };
        let int = |keys: &[&str]| -> Result<Option<i64>> {
            for k in keys {
                match qc.get(*k) {
                    None | Some(Value::Null) => continue,
                    Some(v) => {
                        return v
                            .as_i64()
                            .map(Some)
                            .ok_or_else(|| corrupt(format!("'{k}' is {v}, not an integer")));
                    }
                }
            }
            Ok(None)
        };
        let method = text("quant_method")
            .or_else(|| default_method.map(str::to_string))
            .ok_or_else(|| corrupt("the quantization config has no 'quant_method'".into()))?;
        let method = match method.as_str() {
            "awq" => {
                let version = text("version").unwrap_or_else(|| "gemm".into());
                if version != "gemm" {
                    return Err(Error::unsupported(
                        format!("AWQ version '{version}' ({})", origin.display()),
                        "nibble reads AutoAWQ's GEMM layout",
                    ));
                }
                if let Some(b) = text("backend").filter(|b| b != "autoawq") {
                    return Err(Error::unsupported(
                        format!("AWQ backend '{b}' ({})", origin.display()),
                        "nibble reads checkpoints packed by AutoAWQ",
                    ));
                }
                HfQuantMethod::Awq
            }
            "gptq" => {
                if qc.get("is_marlin_format").and_then(Value::as_bool) == Some(true) {
                    return Err(Error::unsupported(
                        format!("Marlin-packed GPTQ ({})", origin.display()),
                        "nibble reads the plain GPTQ layout",
                    ));
                }
                if let Some(p) = text("pack_dtype").filter(|p| p != "int32") {
                    return Err(Error::unsupported(
                        format!("GPTQ pack_dtype '{p}' ({})", origin.display()),
                        "nibble reads weights packed in int32",
                    ));
                }
                let format = text("checkpoint_format").or_else(|| text("format"));
                match format.as_deref() {
                    None | Some("gptq") => HfQuantMethod::Gptq { v2: false },
                    Some("gptq_v2") => HfQuantMethod::Gptq { v2: true },
                    Some(other) => {
                        return Err(Error::unsupported(
                            format!("GPTQ checkpoint format '{other}' ({})", origin.display()),
                            "nibble reads 'gptq' (v1) and 'gptq_v2'",
                        ));
                    }
                }
            }
            other => {
                return Err(Error::unsupported(
                    format!("quantization method '{other}' ({})", origin.display()),
                    "nibble loads AutoAWQ (GEMM) and GPTQ checkpoints, and its own \
                     (nibble_quant.json)",
                ));
            }
        };
        let bits = int(&["bits", "w_bit"])?
            .ok_or_else(|| corrupt("the quantization config has no 'bits'".into()))?;
        if bits != 4 {
            return Err(Error::unsupported(
                format!("{bits}-bit weights ({})", origin.display()),
                "nibble converts 4-bit AWQ and GPTQ checkpoints only",
            ));
        }
        let group = match int(&["group_size", "q_group_size"])? {
            Some(-1) => None,
            Some(g) if g > 0 => Some(g as usize),
            Some(g) => {
                return Err(corrupt(format!(
                    "group_size {g} is neither -1 nor positive"
                )));
            }
            None => {
                return Err(corrupt(
                    "the quantization config has no 'group_size'".into(),
                ));
            }
        };
        Ok(HfQuantConfig {
            method,
            group,
            desc_act: qc.get("desc_act").and_then(Value::as_bool) == Some(true),
            origin: origin.to_path_buf(),
        })
    }

    /// The nibble spec these weights load as, when one names it (`w4a16-gN`).
    pub fn spec(&self) -> Option<PrecisionSpec> {
        let g = self.group? as u32;
        GROUP_SIZES.contains(&g).then_some(PrecisionSpec {
            linear: LinearScheme::W4A16 { group: g },
            kv: Default::default(),
        })
    }
}

/// One quantized linear layer, validated at open.
struct QModule {
    in_f: usize,
    out_f: usize,
    groups: usize,
    /// Input channels per group.
    group: usize,
    /// The group of each input when it is not `i / group` (GPTQ act-order).
    g_idx: Option<Vec<u32>>,
}

/// A Hugging Face directory of AWQ or GPTQ weights: `X.weight` of a quantized layer `X` is
/// converted from `X.qweight`/`X.qzeros`/`X.scales` when asked for; other tensors are served
/// as stored.
pub struct HfQuantSource {
    st: SafetensorsDir,
    cfg: HfQuantConfig,
    modules: HashMap<String, QModule>,
}

impl HfQuantSource {
    /// Opens `dir` and checks every quantized layer's tensors (presence, dtypes, shapes, g_idx
    /// range) so that conversion in [`TensorSource::get`] cannot fail.
    pub fn open(dir: &Path, cfg: HfQuantConfig) -> Result<Self> {
        let st = SafetensorsDir::open_any(dir)?;
        let mut modules = HashMap::new();
        let mut names: Vec<&str> = st.names().collect();
        names.sort_unstable();
        for name in &names {
            if let Some(prefix) = name.strip_suffix(".qweight") {
                let m = check_module(&st, &cfg, dir, prefix)?;
                modules.insert(prefix.to_string(), m);
            }
        }
        let packed_parts = ["qweight", "qzeros", "scales", "g_idx"];
        for name in names {
            let owned = name
                .rsplit_once('.')
                .is_some_and(|(p, s)| packed_parts.contains(&s) && modules.contains_key(p));
            let raw = st.raw(name).expect("listed names exist");
            if !owned && !matches!(raw.dtype, Dtype::F32 | Dtype::F16 | Dtype::BF16) {
                return Err(Error::unsupported(
                    format!(
                        "tensor '{name}' ({:?}) in {}",
                        raw.dtype,
                        st.file_of(name).unwrap_or(dir).display()
                    ),
                    "outside a quantized layer's qweight/qzeros/scales/g_idx, tensors must be \
                     F32, F16 or BF16",
                ));
            }
        }
        Ok(HfQuantSource { st, cfg, modules })
    }

    pub fn config(&self) -> &HfQuantConfig {
        &self.cfg
    }

    /// The layer `prefix` in nibble form: `Int4Group` rows when exact, else dense f32.
    fn convert(&self, prefix: &str, m: &QModule) -> Option<HostTensor> {
        let raw = |s: &str| self.st.raw(&format!("{prefix}.{s}"));
        let (qweight, qzeros, scales) = (raw("qweight")?, raw("qzeros")?, raw("scales")?);
        let (in_f, out_f, groups) = (m.in_f, m.out_f, m.groups);
        let zeros = self.zeros(&qzeros, groups, out_f);
        let scale_f32 = scales_f32(&scales);
        let scale_f16: Option<Vec<f16>> = match scales.dtype {
            Dtype::F16 => Some(scale_f32.iter().map(|&s| f16::from_f32(s)).collect()),
            _ => scale_f32
                .iter()
                .map(|&s| Some(f16::from_f32(s)).filter(|h| h.to_f32().to_bits() == s.to_bits()))
                .collect(),
        };
        let codes = self.codes(&qweight, in_f, out_f);
        // The checkpoint's own group size when nibble names it (so every layer matches the
        // spec); else 0, "the whole row", when one group spans it.
        let codec_group = match self.cfg.group {
            None => Some(0),
            Some(g) if GROUP_SIZES.contains(&(g as u32)) && in_f.is_multiple_of(g) => {
                Some(g as u32)
            }
            Some(_) => (groups == 1).then_some(0),
        };
        let int4 = codec_group
            .and_then(|group| {
                LinearFormat::new(WeightCodec::Int4Group { group }, ActQuant::F16).ok()
            })
            .filter(|f| f.row_bytes(in_f).is_ok())
            .filter(|_| m.g_idx.is_none() && zeros.iter().all(|&z| z <= 15));
        let (format, bytes) = match (int4, scale_f16) {
            (Some(format), Some(s16)) => {
                let rb = format.row_bytes(in_f).ok()?;
                let mut out = vec![0u8; out_f * rb];
                for (o, row) in out.chunks_exact_mut(rb).enumerate() {
                    let c = &codes[o * in_f..(o + 1) * in_f];
                    for (b, pair) in row[..in_f / 2].iter_mut().zip(c.chunks_exact(2)) {
                        *b = pair[0] | (pair[1] << 4);
                    }
                    for g in 0..groups {
                        let at = in_f / 2 + 2 * g;
                        row[at..at + 2].copy_from_slice(&s16[g * out_f + o].to_le_bytes());
                        row[in_f / 2 + 2 * groups + g] = zeros[g * out_f + o];
                    }
                }
                (WeightFormat::Quant(format), out)
            }
            _ => {
                let mut out = Vec::with_capacity(out_f * in_f * 4);
                for o in 0..out_f {
                    for k in 0..in_f {
                        let g = match &m.g_idx {
                            Some(idx) => idx[k] as usize,
                            None => k / m.group,
                        };
                        let q = codes[o * in_f + k] as i32 - zeros[g * out_f + o] as i32;
                        let w = q as f32 * scale_f32[g * out_f + o];
                        out.extend_from_slice(&w.to_le_bytes());
                    }
                }
                (WeightFormat::Ggml(GgmlType::F32), out)
            }
        };
        Some(HostTensor {
            name: format!("{prefix}.weight"),
            shape: vec![out_f, in_f],
            format,
            bytes: TensorBytes::Owned(Arc::new(bytes)),
        })
    }

    /// The 4-bit codes as `[out, in]` (row `o` is output channel `o`), one per byte.
    fn codes(&self, qweight: &RawTensor, in_f: usize, out_f: usize) -> Vec<u8> {
        let words = words(qweight);
        let mut codes = vec![0u8; in_f * out_f];
        // Tiles of input channels keep the strided writes to `codes` within cache.
        const TILE: usize = 64;
        match self.cfg.method {
            HfQuantMethod::Awq => {
                let w_row = out_f / 8;
                for k0 in (0..in_f).step_by(TILE) {
                    for o in 0..out_f {
                        let shift = 4 * AWQ_NIBBLE_OF[o % 8];
                        for k in k0..(k0 + TILE).min(in_f) {
                            codes[o * in_f + k] = ((words[k * w_row + o / 8] >> shift) & 15) as u8;
                        }
                    }
                }
            }
            HfQuantMethod::Gptq { .. } => {
                for k0 in (0..in_f).step_by(TILE) {
                    for o in 0..out_f {
                        for k in k0..(k0 + TILE).min(in_f) {
                            let word = words[(k / 8) * out_f + o];
                            codes[o * in_f + k] = ((word >> (4 * (k % 8))) & 15) as u8;
                        }
                    }
                }
            }
        }
        codes
    }

    /// The integer zeros `[groups, out]`, v1's stored offset undone.
    fn zeros(&self, qzeros: &RawTensor, groups: usize, out_f: usize) -> Vec<u8> {
        let words = words(qzeros);
        let w_row = out_f / 8;
        let mut z = vec![0u8; groups * out_f];
        for g in 0..groups {
            for o in 0..out_f {
                let word = words[g * w_row + o / 8];
                z[g * out_f + o] = match self.cfg.method {
                    HfQuantMethod::Awq => ((word >> (4 * AWQ_NIBBLE_OF[o % 8])) & 15) as u8,
                    HfQuantMethod::Gptq { v2 } => {
                        ((word >> (4 * (o % 8))) & 15) as u8 + u8::from(!v2)
                    }
                };
            }
        }
        z
    }
}

impl TensorSource for HfQuantSource {
    fn get(&self, name: &str) -> Option<HostTensor> {
        if let Some(prefix) = name.strip_suffix(".weight")
            && let Some(m) = self.modules.get(prefix)
        {
            return self.convert(prefix, m);
        }
        self.st.get(name)
    }

    fn origin(&self) -> String {
        self.st.dir().display().to_string()
    }
}

fn words(t: &RawTensor) -> Vec<u32> {
    t.bytes
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

fn scales_f32(t: &RawTensor) -> Vec<f32> {
    match t.dtype {
        Dtype::F16 => t
            .bytes
            .chunks_exact(2)
            .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        Dtype::BF16 => t
            .bytes
            .chunks_exact(2)
            .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        _ => t
            .bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
    }
}

fn check_module(
    st: &SafetensorsDir,
    cfg: &HfQuantConfig,
    dir: &Path,
    prefix: &str,
) -> Result<QModule> {
    let need = |part: &str| -> Result<RawTensor> {
        let name = format!("{prefix}.{part}");
        st.raw(&name).ok_or_else(|| Error::MissingTensor {
            name,
            source_name: dir.display().to_string(),
        })
    };
    let qweight = need("qweight")?;
    let file = st
        .file_of(&qweight.name)
        .unwrap_or(dir)
        .display()
        .to_string();
    let corrupt = |m: String| Error::corrupt(&file, m);
    let qzeros = need("qzeros")?;
    let scales = need("scales")?;
    if st.raw(&format!("{prefix}.weight")).is_some() {
        return Err(corrupt(format!(
            "layer '{prefix}' has both a quantized 'qweight' and a dense 'weight'"
        )));
    }
    for t in [&qweight, &qzeros] {
        if t.dtype != Dtype::I32 {
            return Err(Error::unsupported(
                format!("{:?} packing of '{}' in {file}", t.dtype, t.name),
                "AWQ/GPTQ weights and zeros must be packed in I32",
            ));
        }
    }
    if !matches!(scales.dtype, Dtype::F16 | Dtype::BF16 | Dtype::F32) {
        return Err(corrupt(format!(
            "'{}' is {:?}; scales must be F16, BF16 or F32",
            scales.name, scales.dtype
        )));
    }
    for t in [&qweight, &qzeros, &scales] {
        if t.shape.len() != 2 || t.shape.contains(&0) {
            return Err(corrupt(format!(
                "'{}' has shape {:?}; expected a non-empty matrix",
                t.name, t.shape
            )));
        }
    }
    let (in_f, out_f) = match cfg.method {
        HfQuantMethod::Awq => (qweight.shape[0], qweight.shape[1] * 8),
        HfQuantMethod::Gptq { .. } => (qweight.shape[0] * 8, qweight.shape[1]),
    };
    let group = cfg.group.unwrap_or(in_f);
    let groups = in_f.div_ceil(group);
    if matches!(cfg.method, HfQuantMethod::Awq) && !in_f.is_multiple_of(group) {
        return Err(corrupt(format!(
            "'{}': {in_f} input channels are not a multiple of group size {group}",
            qweight.name
        )));
    }
    if !out_f.is_multiple_of(8) {
        return Err(corrupt(format!(
            "'{}': {out_f} output channels do not fill whole packed zero words",
            qweight.name
        )));
    }
    let want = |t: &RawTensor, shape: [usize; 2]| -> Result<()> {
        if t.shape != shape {
            return Err(corrupt(format!(
                "'{}' has shape {:?}; a layer of {in_f} inputs, {out_f} outputs and group size \
                 {group} needs {shape:?} ({})",
                t.name,
                t.shape,
                match cfg.method {
                    HfQuantMethod::Awq => "AutoAWQ GEMM layout",
                    HfQuantMethod::Gptq { .. } => "GPTQ layout",
                }
            )));
        }
        Ok(())
    };
    want(&scales, [groups, out_f])?;
    want(&qzeros, [groups, out_f / 8])?;
    let g_idx_name = format!("{prefix}.g_idx");
    let g_idx = match (cfg.method, st.raw(&g_idx_name)) {
        (HfQuantMethod::Gptq { .. }, Some(t)) => {
            if t.dtype != Dtype::I32 || t.shape != [in_f] {
                return Err(corrupt(format!(
                    "'{g_idx_name}' is {:?} {:?}; expected I32 [{in_f}]",
                    t.dtype, t.shape
                )));
            }
            let idx = words(&t);
            if let Some((i, &g)) = idx.iter().enumerate().find(|&(_, &g)| g as usize >= groups) {
                return Err(corrupt(format!(
                    "'{g_idx_name}'[{i}] = {} is outside the {groups} groups",
                    g as i32
                )));
            }
            let contiguous = idx
                .iter()
                .enumerate()
                .all(|(i, &g)| g as usize == i / group);
            (!contiguous).then_some(idx)
        }
        (HfQuantMethod::Gptq { .. }, None) if cfg.desc_act => {
            return Err(Error::MissingTensor {
                name: g_idx_name,
                source_name: format!(
                    "{} (desc_act is set, so each layer needs one)",
                    dir.display()
                ),
            });
        }
        _ => None,
    };
    Ok(QModule {
        in_f,
        out_f,
        groups,
        group,
        g_idx,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::tests::fixture;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;
    use safetensors::tensor::TensorView;

    /// AutoAWQ's packing order (`WQLinear_GEMM.from_linear`): bits `4i` of a word hold output
    /// channel `8c + ORDER[i]`. Written from the Python, not from the loader's inverse table.
    const AWQ_ORDER: [usize; 8] = [0, 2, 4, 6, 1, 3, 5, 7];

    /// One layer's integers as a quantizer would produce them.
    struct Layer {
        out_f: usize,
        in_f: usize,
        group: usize,
        /// `[out][in]`, 0..=15.
        codes: Vec<u32>,
        /// `[G][out]`: the zero a reader must use.
        zeros: Vec<u32>,
        /// `[G][out]`.
        scales: Vec<f16>,
        /// `[in]`.
        g_idx: Vec<u32>,
    }

    impl Layer {
        fn random(
            rng: &mut ChaCha8Rng,
            out_f: usize,
            in_f: usize,
            group: usize,
            zero_lo: u32,
            act_order: bool,
        ) -> Self {
            let groups = in_f.div_ceil(group);
            let mut g_idx: Vec<u32> = (0..in_f).map(|i| (i / group) as u32).collect();
            if act_order {
                for i in (1..in_f).rev() {
                    g_idx.swap(i, rng.random_range(0..=i));
                }
            }
            Layer {
                out_f,
                in_f,
                group,
                codes: (0..out_f * in_f).map(|_| rng.random_range(0..16)).collect(),
                zeros: (0..groups * out_f)
                    .map(|_| rng.random_range(zero_lo..16))
                    .collect(),
                scales: (0..groups * out_f)
                    .map(|_| {
                        let s: f32 = rng.random_range(0.001..0.05);
                        f16::from_f32(if rng.random_bool(0.5) { s } else { -s })
                    })
                    .collect(),
                g_idx,
            }
        }

        /// `(q - z) * s` in f64, straight from the integers: `[out][in]`.
        fn expected(&self) -> Vec<f32> {
            let mut w = Vec::with_capacity(self.out_f * self.in_f);
            for o in 0..self.out_f {
                for k in 0..self.in_f {
                    let g = self.g_idx[k] as usize;
                    let q = self.codes[o * self.in_f + k] as f64
                        - self.zeros[g * self.out_f + o] as f64;
                    w.push((q * self.scales[g * self.out_f + o].to_f64()) as f32);
                }
            }
            w
        }

        fn groups(&self) -> usize {
            self.in_f.div_ceil(self.group)
        }

        /// `(qweight, qzeros)` as AutoAWQ's GEMM layout stores them.
        fn pack_awq(&self) -> (Vec<u32>, Vec<u32>) {
            let (o8, g) = (self.out_f / 8, self.groups());
            let mut qw = vec![0u32; self.in_f * o8];
            for k in 0..self.in_f {
                for c in 0..o8 {
                    for (i, &j) in AWQ_ORDER.iter().enumerate() {
                        qw[k * o8 + c] |= self.codes[(8 * c + j) * self.in_f + k] << (4 * i);
                    }
                }
            }
            let mut qz = vec![0u32; g * o8];
            for gi in 0..g {
                for c in 0..o8 {
                    for (i, &j) in AWQ_ORDER.iter().enumerate() {
                        qz[gi * o8 + c] |= self.zeros[gi * self.out_f + 8 * c + j] << (4 * i);
                    }
                }
            }
            (qw, qz)
        }

        /// `(qweight, qzeros)` as GPTQ stores them; v1 stores `zero - 1`.
        fn pack_gptq(&self, v1: bool) -> (Vec<u32>, Vec<u32>) {
            let (o8, g) = (self.out_f / 8, self.groups());
            let mut qw = vec![0u32; self.in_f / 8 * self.out_f];
            for r in 0..self.in_f / 8 {
                for o in 0..self.out_f {
                    for j in 0..8 {
                        qw[r * self.out_f + o] |= self.codes[o * self.in_f + 8 * r + j] << (4 * j);
                    }
                }
            }
            let mut qz = vec![0u32; g * o8];
            for gi in 0..g {
                for o in 0..self.out_f {
                    let z = self.zeros[gi * self.out_f + o] - u32::from(v1);
                    qz[gi * o8 + o / 8] |= (z & 15) << (4 * (o % 8));
                }
            }
            (qw, qz)
        }
    }

    fn le<T: Copy>(v: &[T], f: impl Fn(T) -> Vec<u8>) -> Vec<u8> {
        v.iter().flat_map(|&x| f(x)).collect()
    }

    type Tensors = Vec<(String, Dtype, Vec<usize>, Vec<u8>)>;

    fn save(path: &Path, tensors: &Tensors) {
        let views: Vec<(String, TensorView)> = tensors
            .iter()
            .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
            .collect();
        safetensors::serialize_to_file(views, None, path).unwrap();
    }

    #[derive(Clone, Copy, PartialEq)]
    enum Kind {
        Awq,
        GptqV1,
        GptqV2,
    }

    /// A whole tiny model (from a float fixture) in AWQ or GPTQ layout: every projection
    /// replaced by random integers, everything else stored as f16. Returns the directory and
    /// each projection's expected weights.
    fn quant_model(
        fixture_name: &str,
        kind: Kind,
        group: usize,
        act_order: bool,
        quantization_config: Value,
    ) -> (tempfile::TempDir, HashMap<String, Vec<f32>>) {
        let src = fixture(fixture_name);
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        for f in ["tokenizer.json", "tokenizer_config.json"] {
            std::fs::copy(src.join(f), dir.join(f)).unwrap();
        }
        let mut config: Value =
            serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap())
                .unwrap();
        config["quantization_config"] = quantization_config;
        std::fs::write(dir.join("config.json"), config.to_string()).unwrap();

        let st = SafetensorsDir::open(&src).unwrap();
        let mut names: Vec<&str> = st.names().collect();
        names.sort_unstable();
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        let mut tensors: Tensors = Vec::new();
        let mut expected = HashMap::new();
        for name in names {
            let t = st.get(name).unwrap();
            match name
                .strip_suffix(".weight")
                .filter(|_| name.contains("_proj"))
            {
                Some(prefix) => {
                    let (out_f, in_f) = (t.shape[0], t.shape[1]);
                    let zero_lo = if kind == Kind::GptqV1 { 1 } else { 0 };
                    let l = Layer::random(&mut rng, out_f, in_f, group, zero_lo, act_order);
                    let (qw, qz) = match kind {
                        Kind::Awq => l.pack_awq(),
                        Kind::GptqV1 => l.pack_gptq(true),
                        Kind::GptqV2 => l.pack_gptq(false),
                    };
                    let qw_shape = match kind {
                        Kind::Awq => vec![in_f, out_f / 8],
                        _ => vec![in_f / 8, out_f],
                    };
                    let g = l.groups();
                    let i32le = |v: &[u32]| le(v, |x| x.to_le_bytes().to_vec());
                    tensors.push((
                        format!("{prefix}.qweight"),
                        Dtype::I32,
                        qw_shape,
                        i32le(&qw),
                    ));
                    tensors.push((
                        format!("{prefix}.qzeros"),
                        Dtype::I32,
                        vec![g, out_f / 8],
                        i32le(&qz),
                    ));
                    tensors.push((
                        format!("{prefix}.scales"),
                        Dtype::F16,
                        vec![g, out_f],
                        le(&l.scales, |x| x.to_le_bytes().to_vec()),
                    ));
                    if kind != Kind::Awq {
                        tensors.push((
                            format!("{prefix}.g_idx"),
                            Dtype::I32,
                            vec![in_f],
                            i32le(&l.g_idx),
                        ));
                    }
                    expected.insert(name.to_string(), l.expected());
                }
                None => {
                    let v: Vec<f16> = t.to_f32().unwrap().into_iter().map(f16::from_f32).collect();
                    tensors.push((
                        name.to_string(),
                        Dtype::F16,
                        t.shape.clone(),
                        le(&v, |x| x.to_le_bytes().to_vec()),
                    ));
                }
            }
        }
        save(&dir.join("model.safetensors"), &tensors);
        (tmp, expected)
    }

    fn awq_config(group: i64) -> Value {
        serde_json::json!({"quant_method": "awq", "bits": 4, "group_size": group,
                           "zero_point": true, "version": "gemm"})
    }

    fn gptq_config(group: i64, desc_act: bool, format: &str) -> Value {
        serde_json::json!({"quant_method": "gptq", "bits": 4, "group_size": group,
                           "desc_act": desc_act, "sym": false, "checkpoint_format": format})
    }

    /// Every projection loads as `want` (a format name, "F32" for dense) with exactly `(q - z) * s`;
    /// every other tensor as stored.
    fn check_model(
        dir: &Path,
        expected: &HashMap<String, Vec<f32>>,
        want: &str,
    ) -> crate::ModelFiles {
        let files = crate::open_model(dir, None).unwrap();
        assert!(!expected.is_empty());
        for (name, w) in expected {
            let t = files.source.get(name).unwrap_or_else(|| panic!("{name}"));
            assert_eq!(t.format.to_string(), want, "{name}");
            assert_eq!(t.shape.iter().product::<usize>(), w.len(), "{name}");
            let got = t.to_f32().unwrap();
            for (i, (a, b)) in got.iter().zip(w).enumerate() {
                assert_eq!(a.to_bits(), b.to_bits(), "{name}[{i}]: {a} vs {b}");
            }
        }
        let norm = files.source.get("model.norm.weight").unwrap();
        assert_eq!(norm.format, WeightFormat::Ggml(GgmlType::F16));
        files
    }

    #[test]
    fn awq_gemm_loads_as_int4_rows_exactly() {
        let (tmp, expected) = quant_model("tiny-qwen2", Kind::Awq, 32, false, awq_config(32));
        let files = check_model(tmp.path(), &expected, "int4-g32/a16");
        assert_eq!(files.precision, Some("w4a16-g32".parse().unwrap()));
        // Qwen2's biases pass through.
        let b = files
            .source
            .get("model.layers.0.self_attn.q_proj.bias")
            .unwrap();
        assert_eq!(b.shape, vec![64]);
    }

    #[test]
    fn gptq_v1_and_v2_zeros_load_exactly() {
        for (kind, format) in [(Kind::GptqV1, "gptq"), (Kind::GptqV2, "gptq_v2")] {
            let cfg = gptq_config(32, false, format);
            let (tmp, expected) = quant_model("tiny-llama3", kind, 32, false, cfg);
            check_model(tmp.path(), &expected, "int4-g32/a16");
        }
        // The same v2 bytes read as v1 would be off by one zero: the flag is honoured.
        let (tmp, expected) = quant_model(
            "tiny-llama3",
            Kind::GptqV2,
            32,
            false,
            gptq_config(32, false, "gptq_v2"),
        );
        let p = tmp.path().join("config.json");
        let text = std::fs::read_to_string(&p)
            .unwrap()
            .replace("gptq_v2", "gptq");
        std::fs::write(&p, text).unwrap();
        let files = crate::open_model(tmp.path(), None).unwrap();
        let (name, w) = expected.iter().next().unwrap();
        assert_ne!(&files.source.get(name).unwrap().to_f32().unwrap(), w);
    }

    #[test]
    fn gptq_act_order_loads_as_exact_f32() {
        let (tmp, expected) = quant_model(
            "tiny-mistral",
            Kind::GptqV2,
            32,
            true,
            gptq_config(32, true, "gptq_v2"),
        );
        check_model(tmp.path(), &expected, "F32");
        // desc_act set but a layer without g_idx: refused, naming the tensor.
        let dir = tmp.path();
        let st = SafetensorsDir::open_any(dir).unwrap();
        let g = "model.layers.1.mlp.down_proj.g_idx";
        let kept: Tensors = st
            .names()
            .filter(|n| *n != g)
            .map(|n| {
                let r = st.raw(n).unwrap();
                (n.to_string(), r.dtype, r.shape, r.bytes.to_vec())
            })
            .collect();
        drop(st);
        save(&dir.join("model.safetensors"), &kept);
        let e = crate::open_model(dir, None).err().unwrap().to_string();
        assert!(
            e.contains(&format!("tensor '{g}' is missing")) && e.contains("desc_act"),
            "{e}"
        );
    }

    #[test]
    fn per_channel_and_odd_group_sizes() {
        // group_size -1: one group per row, nibble's int4-pc.
        let (tmp, expected) = quant_model(
            "tiny-llama3",
            Kind::GptqV2,
            usize::MAX,
            false,
            gptq_config(-1, false, "gptq_v2"),
        );
        let files = check_model(tmp.path(), &expected, "int4-pc/a16");
        assert_eq!(files.precision, None);
        // A group size nibble has no codec name for: exact f32.
        let (tmp, expected) = quant_model("tiny-llama3", Kind::Awq, 16, false, awq_config(16));
        check_model(tmp.path(), &expected, "F32");
    }

    fn open_err(dir: &Path) -> String {
        match crate::open_model(dir, None) {
            Ok(_) => panic!("{} opened", dir.display()),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn bad_configs_are_refused_with_the_reason() {
        let cases = [
            (
                serde_json::json!({"quant_method": "gptq", "bits": 3, "group_size": 32}),
                "3-bit weights",
            ),
            (
                serde_json::json!({"quant_method": "awq", "bits": 8, "group_size": 32}),
                "8-bit weights",
            ),
            (
                serde_json::json!({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"}),
                "AWQ version 'gemv'",
            ),
            (
                serde_json::json!({"quant_method": "gptq", "bits": 4, "group_size": 32, "checkpoint_format": "marlin"}),
                "GPTQ checkpoint format 'marlin'",
            ),
            (
                serde_json::json!({"quant_method": "gptq", "bits": 4, "group_size": 32, "pack_dtype": "int16"}),
                "pack_dtype 'int16'",
            ),
            (
                serde_json::json!({"quant_method": "bitsandbytes", "bits": 4}),
                "quantization method 'bitsandbytes'",
            ),
            (
                serde_json::json!({"quant_method": "gptq", "group_size": 32}),
                "no 'bits'",
            ),
            (
                serde_json::json!({"quant_method": "gptq", "bits": 4, "group_size": 0}),
                "group_size 0",
            ),
            (
                serde_json::json!({"quant_method": "gptq", "bits": "4", "group_size": 32}),
                "'bits' is \"4\"",
            ),
        ];
        let (tmp, _) = quant_model(
            "tiny-llama3",
            Kind::GptqV2,
            32,
            false,
            gptq_config(32, false, "gptq_v2"),
        );
        let p = tmp.path().join("config.json");
        let mut config: Value =
            serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        for (qc, want) in cases {
            config["quantization_config"] = qc;
            std::fs::write(&p, config.to_string()).unwrap();
            let e = open_err(tmp.path());
            assert!(
                e.contains(want) && e.contains("config.json"),
                "want '{want}': {e}"
            );
        }
        // The old layout: quantize_config.json beside a config.json without quantization_config.
        config
            .as_object_mut()
            .unwrap()
            .remove("quantization_config");
        std::fs::write(&p, config.to_string()).unwrap();
        let q = tmp.path().join("quantize_config.json");
        std::fs::write(&q, r#"{"bits": 2, "group_size": 32, "desc_act": false}"#).unwrap();
        let e = open_err(tmp.path());
        assert!(
            e.contains("2-bit weights") && e.contains("quantize_config.json"),
            "{e}"
        );
    }

    #[test]
    fn bad_layer_tensors_are_refused_naming_them() {
        type Edit = Box<dyn Fn(&mut Tensors)>;
        let find = |t: &mut Tensors, n: &str| t.iter().position(|x| x.0 == n).unwrap();
        let q = "model.layers.0.self_attn.q_proj";
        let cases: Vec<(Edit, String)> = vec![
            (
                Box::new(move |t| {
                    let i = find(t, &format!("{q}.qzeros"));
                    t.remove(i);
                }),
                format!("tensor '{q}.qzeros' is missing"),
            ),
            (
                Box::new(move |t| {
                    let i = find(t, &format!("{q}.scales"));
                    t.remove(i);
                }),
                format!("tensor '{q}.scales' is missing"),
            ),
            (
                Box::new(move |t| {
                    let i = find(t, &format!("{q}.scales"));
                    t[i].2 = vec![4, 32];
                    t[i].3.truncate(4 * 32 * 2);
                }),
                format!(
                    "'{q}.scales' has shape [4, 32]; a layer of 64 inputs, 64 outputs and group size 32 needs [2, 64]"
                ),
            ),
            (
                Box::new(move |t| {
                    let i = find(t, &format!("{q}.g_idx"));
                    t[i].3[4..8].copy_from_slice(&7u32.to_le_bytes());
                }),
                format!("'{q}.g_idx'[1] = 7 is outside the 2 groups"),
            ),
            (
                Box::new(move |t| {
                    let i = find(t, &format!("{q}.qweight"));
                    t[i].1 = Dtype::U32;
                }),
                format!("U32 packing of '{q}.qweight'"),
            ),
            (
                Box::new(move |t| {
                    t.push((format!("{q}.weight"), Dtype::F16, vec![1], vec![0, 0]));
                }),
                format!("layer '{q}' has both"),
            ),
            (
                Box::new(|t| {
                    t.push(("model.extra".into(), Dtype::I64, vec![1], vec![0; 8]));
                }),
                "tensor 'model.extra' (I64)".to_string(),
            ),
        ];
        for (edit, want) in cases {
            let (tmp, _) = quant_model(
                "tiny-llama3",
                Kind::GptqV2,
                32,
                false,
                gptq_config(32, false, "gptq_v2"),
            );
            let dir = tmp.path();
            let st = SafetensorsDir::open_any(dir).unwrap();
            let mut all: Tensors = st
                .names()
                .map(|n| {
                    let r = st.raw(n).unwrap();
                    (n.to_string(), r.dtype, r.shape, r.bytes.to_vec())
                })
                .collect();
            drop(st);
            edit(&mut all);
            save(&dir.join("model.safetensors"), &all);
            let e = open_err(dir);
            assert!(e.contains(&want), "want '{want}': {e}");
        }
    }

    /// The fixtures made by `scripts/gen_awq_gptq_fixtures.py`: packed by a numpy transcription
    /// of AutoAWQ's and AutoGPTQ's packing loops, expected weights from their unpacking code.
    #[test]
    fn python_packed_fixtures_match_their_reference_unpacking() {
        let root = fixture("awq-gptq");
        let mut seen = 0;
        for entry in std::fs::read_dir(&root).unwrap() {
            let dir = entry.unwrap().path();
            let config_path = dir.join("config.json");
            let config: Value = match std::fs::read_to_string(&config_path) {
                Ok(t) => serde_json::from_str(&t).unwrap(),
                Err(_) => Value::Null,
            };
            let cfg = HfQuantConfig::detect(&dir, &config, &config_path)
                .unwrap()
                .unwrap();
            let src = HfQuantSource::open(&dir, cfg).unwrap();
            let want_fmt: HashMap<String, String> =
                serde_json::from_str(&std::fs::read_to_string(dir.join("expect.json")).unwrap())
                    .unwrap();
            let exp = expected_tensors(&dir.join("expected.safetensors"));
            assert_eq!(exp.len(), want_fmt.len());
            for (prefix, fmt) in &want_fmt {
                let name = format!("{prefix}.weight");
                let t = src.get(&name).unwrap();
                assert_eq!(&t.format.to_string(), fmt, "{}: {name}", dir.display());
                let got = t.to_f32().unwrap();
                let w = &exp[&name];
                assert_eq!(got.len(), w.len());
                for (i, (a, b)) in got.iter().zip(w).enumerate() {
                    assert_eq!(a.to_bits(), b.to_bits(), "{}: {name}[{i}]", dir.display());
                }
                seen += 1;
            }
        }
        assert_eq!(seen, 10);
    }

    fn expected_tensors(path: &Path) -> HashMap<String, Vec<f32>> {
        let bytes = std::fs::read(path).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        st.tensors()
            .into_iter()
            .map(|(n, v)| {
                assert_eq!(v.dtype(), Dtype::F32);
                let w = v
                    .data()
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect();
                (n, w)
            })
            .collect()
    }
}
