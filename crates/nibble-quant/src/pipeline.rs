//! The quantization entry point: a dense model, a precision spec and a method in; every linear
//! layer encoded in its format out. Embeddings, norms and the output head stay unquantized (the
//! head reads the full vocabulary's logits, where 4-bit error shows most and costs least to avoid).
//! In a mixture-of-experts model every expert's gate/up/down (and a shared expert's) is a linear
//! layer like a dense MLP's; the router and the shared expert's gate stay unquantized too: one
//! row per expert, whose rounding would change which experts a token runs.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use nibble_core::{Error, Result};
use nibble_model::checkpoint::{CheckpointData, CheckpointTensor};
use nibble_precision::{LinearFormat, LinearScheme, PrecisionSpec};

use crate::dense::{DenseModel, LinearId};
use crate::search::{SEARCH_ROWS, calibrate};

/// How weights (and the transforms before them) are chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Method {
    /// Round to nearest on each weight's own range: the baseline every method must beat.
    Rtn,
    /// AWQ: per-channel scales searched on calibration activations, plus clipping.
    Awq,
    /// GPTQ: column-by-column rounding with Hessian-based error compensation.
    Gptq,
    /// SmoothQuant: activation outliers migrated into the weights before quantizing both.
    SmoothQuant,
    /// QServe's QoQ: rotation, SmoothAttention, output smoothing, reordering, clipping search;
    /// for W4A8, and with per-channel INT8 weights for W8A8.
    Qoq,
    /// LiquidQuant: SmoothQuant smoothing with a searched strength, then LQQ encoding.
    Lqq,
    /// COMET's FMPQ: outlier channel blocks found, permuted together and kept at INT8.
    Fmpq,
}

impl Method {
    pub const ALL: [Method; 7] = [
        Method::Rtn,
        Method::Awq,
        Method::Gptq,
        Method::SmoothQuant,
        Method::Qoq,
        Method::Lqq,
        Method::Fmpq,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Method::Rtn => "rtn",
            Method::Awq => "awq",
            Method::Gptq => "gptq",
            Method::SmoothQuant => "smoothquant",
            Method::Qoq => "qoq",
            Method::Lqq => "lqq",
            Method::Fmpq => "fmpq",
        }
    }

    /// Whether the method needs calibration text.
    pub fn calibrated(self) -> bool {
        self != Method::Rtn
    }

    /// Checks that the method applies to the spec's linear scheme.
    pub fn check(self, spec: &PrecisionSpec) -> Result<()> {
        use LinearScheme as S;
        let ok = match self {
            Method::Rtn => true,
            Method::Awq | Method::Gptq => matches!(
                spec.linear,
                S::W4A16 { .. } | S::W8A16 | S::W4A8 { group: 0 }
            ),
            Method::SmoothQuant => matches!(spec.linear, S::W8A8 | S::Fp8 | S::W4A8 { group: 0 }),
            Method::Qoq => matches!(spec.linear, S::W4A8 { .. } | S::W8A8),
            Method::Lqq => matches!(spec.linear, S::W4A8Lqq { .. }),
            Method::Fmpq => matches!(spec.linear, S::W4A4A8 { .. }),
        };
        if !ok {
            return Err(Error::InvalidArgument(format!(
                "method {self} does not apply to {}; use it with {}",
                spec.linear,
                match self {
                    Method::Awq | Method::Gptq => "w4a16, w8a16 or per-channel w4a8",
                    Method::SmoothQuant => "w8a8, fp8 or per-channel w4a8",
                    Method::Qoq => "w4a8, w4a8-gN or w8a8",
                    Method::Lqq => "w4a8-lqq-gN",
                    Method::Fmpq => "w4a4a8",
                    Method::Rtn => unreachable!("rtn applies to every scheme"),
                }
            )));
        }
        Ok(())
    }
}

impl fmt::Display for Method {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Method {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let t = s.trim().to_ascii_lowercase();
        let t = match t.as_str() {
            "sq" => "smoothquant",
            "liquidquant" => "lqq",
            "comet" => "fmpq",
            other => other,
        };
        Method::ALL.into_iter().find(|m| m.name() == t).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "unknown quantization method '{s}'; expected one of rtn, awq, gptq, smoothquant, \
                 qoq, lqq, fmpq"
            ))
        })
    }
}

/// Knobs shared by every method.
#[derive(Debug, Clone, Default)]
pub struct QuantOptions {
    /// Worker threads for calibration forwards and searches (0: every core).
    pub threads: usize,
    /// Seed for anything random (rotation signs).
    pub seed: u64,
}

/// The result: the (possibly transformed) dense model for everything left unquantized, and each
/// linear layer's encoding.
#[derive(Debug, Clone)]
pub struct QuantizedModel {
    pub spec: PrecisionSpec,
    pub method: Method,
    pub dense: DenseModel,
    /// Rows of `format.row_bytes(cols)` bytes per linear layer (all of them for a quantized
    /// scheme, none for w16a16).
    pub linears: BTreeMap<LinearId, (LinearFormat, Vec<u8>)>,
}

impl QuantizedModel {
    /// Every tensor of the model as a checkpoint holds it: quantized linears as codec rows, the
    /// rest (embeddings, norms, biases, head, routers) dense, in f16 or f32.
    pub fn checkpoint_tensors(&self, f16: bool) -> Vec<CheckpointTensor> {
        self.dense
            .tensor_names()
            .into_iter()
            .map(|name| {
                let quant = LinearId::parse(&name).and_then(|id| self.linears.get(&id));
                let (shape, values) = self.dense.tensor(&name).expect("named by tensor_names");
                let data = match quant {
                    Some((format, bytes)) => CheckpointData::Quant {
                        format: *format,
                        bytes: bytes.clone(),
                    },
                    None if f16 => CheckpointData::F16(
                        values.iter().map(|&v| half::f16::from_f32(v)).collect(),
                    ),
                    None => CheckpointData::F32(values.to_vec()),
                };
                CheckpointTensor { name, shape, data }
            })
            .collect()
    }
}

/// Quantizes `model` to `spec` with `method`, calibrating on `calibration` (token sequences;
/// ignored by RTN). `progress(stage, done, total)` reports each stage.
pub fn quantize(
    model: DenseModel,
    spec: PrecisionSpec,
    method: Method,
    calibration: &[Vec<u32>],
    opts: &QuantOptions,
    progress: &mut dyn FnMut(&str, usize, usize),
) -> Result<QuantizedModel> {
    method.check(&spec)?;
    for id in model.linear_ids() {
        spec.linear
            .check_k(&model.linear_name(id), model.linear(id).cols)?;
    }
    if method.calibrated() {
        let tokens: usize = calibration.iter().map(Vec::len).sum();
        if tokens < crate::data::MIN_CALIBRATION_TOKENS {
            return Err(Error::InvalidArgument(format!(
                "{method} needs at least {} calibration tokens, got {tokens}",
                crate::data::MIN_CALIBRATION_TOKENS
            )));
        }
    }
    let threads = opts.threads;
    match method {
        Method::Rtn => rtn(model, spec, progress),
        Method::Awq => {
            let calib = calibrate(&model, calibration, SEARCH_ROWS, false, threads, progress)?;
            crate::awq::awq(model, spec, calib, &Default::default(), progress)
        }
        Method::Gptq => {
            // Only the Gram matrices, as many windows of layers as the budget needs.
            let budget = std::env::var("NIBBLE_GPTQ_HESSIAN_BYTES")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(GPTQ_HESSIAN_BUDGET);
            crate::gptq::gptq_windowed(
                model,
                spec,
                calibration,
                threads,
                budget,
                &Default::default(),
                progress,
            )
        }
        Method::SmoothQuant => {
            let calib = calibrate(&model, calibration, SEARCH_ROWS, false, threads, progress)?;
            crate::smoothquant::smoothquant(
                model,
                spec,
                calib,
                calibration,
                threads,
                &crate::smoothquant::SmoothQuantOptions::for_scheme(spec.linear),
                progress,
            )
        }
        Method::Qoq => crate::qoq::quantize(model, spec, calibration, opts, progress),
        Method::Lqq => crate::lqq::quantize(model, spec, calibration, opts, progress),
        Method::Fmpq => crate::fmpq::quantize(model, spec, calibration, opts, progress),
    }
}

/// Bytes of GPTQ Hessians held at once (`NIBBLE_GPTQ_HESSIAN_BYTES` overrides): past it, the
/// calibration runs once per window of layers (`gptq::gptq_windowed`).
pub const GPTQ_HESSIAN_BUDGET: usize = 8 << 30;

/// Round-to-nearest: every row encoded on its own range, no calibration. For COMET's mixed
/// activations RTN keeps every block INT4 (no outlier handling is what RTN means).
pub fn rtn(
    model: DenseModel,
    spec: PrecisionSpec,
    progress: &mut dyn FnMut(&str, usize, usize),
) -> Result<QuantizedModel> {
    let mut linears = BTreeMap::new();
    if let Some(format) = spec.linear.linear_format(0) {
        let ids = model.linear_ids();
        for (i, &id) in ids.iter().enumerate() {
            let clips = vec![1.0; model.linear(id).rows];
            linears.insert(id, (format, encode(&model, id, format, &clips)?));
            progress("rtn", i + 1, ids.len());
        }
    }
    Ok(QuantizedModel {
        spec,
        method: Method::Rtn,
        dense: model,
        linears,
    })
}

/// Encodes linear `id` of `model` row by row, row `r` with clip ratio `clips[r]`.
pub fn encode(
    model: &DenseModel,
    id: LinearId,
    format: LinearFormat,
    clips: &[f32],
) -> Result<Vec<u8>> {
    encode_matrix(model.linear(id), format, clips)
        .map_err(|e| Error::InvalidArgument(format!("{}: {e}", model.linear_name(id))))
}

/// Encodes a weight matrix row by row, row `r` with clip ratio `clips[r]`.
pub fn encode_matrix(
    w: &crate::dense::Mat,
    format: LinearFormat,
    clips: &[f32],
) -> Result<Vec<u8>> {
    use rayon::prelude::*;
    let rb = format.row_bytes(w.cols)?;
    let mut out = vec![0u8; rb * w.rows];
    out.par_chunks_mut(rb)
        .enumerate()
        .try_for_each(|(r, o)| format.codec.quantize_row(w.row(r), clips[r], o))?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn methods_parse_and_check_their_schemes() {
        for m in Method::ALL {
            assert_eq!(m.name().parse::<Method>().unwrap(), m);
        }
        assert_eq!("SQ".parse::<Method>().unwrap(), Method::SmoothQuant);
        let err = "magic".parse::<Method>().unwrap_err().to_string();
        assert!(err.contains("unknown quantization method"), "{err}");
        let spec = |s: &str| s.parse::<PrecisionSpec>().unwrap();
        assert!(Method::Awq.check(&spec("w4a16-g64")).is_ok());
        assert!(Method::Qoq.check(&spec("w4a8-g64-kv4")).is_ok());
        assert!(Method::Qoq.check(&spec("w8a8")).is_ok());
        let err = Method::Qoq.check(&spec("fp8")).unwrap_err().to_string();
        assert!(err.contains("w4a8, w4a8-gN or w8a8"), "{err}");
        let err = Method::Qoq.check(&spec("w4a16")).unwrap_err().to_string();
        assert!(err.contains("does not apply"), "{err}");
        assert!(Method::Fmpq.check(&spec("w8a8")).is_err());
        assert!(Method::Lqq.check(&spec("w4a8-lqq")).is_ok());
    }
}
