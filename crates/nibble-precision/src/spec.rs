//! The `WxAyKVz` precision spec a user types (`w4a8-g128-kv4`), parsed once into types that the
//! quantizer, the checkpoint, the loader and kernel dispatch all share.
//!
//! Grammar: dash-separated tokens. The first names weights and activations (`w16a16`, `w8a16`,
//! `w8a8`, `fp8`, `w4a16`, `w4a8`, `w4a4a8`) or is a KV token alone (`kv8` = unquantized
//! weights with an 8-bit cache). Then, in any order, at most one each of: a group size `g32`,
//! `g64`, `g128`; `lqq` (LiquidQuant, with `w4a8` only); a KV token (see [`KvSpec`]).
//!
//! KV tokens: `kv16`, `kv8`, `kv4`, `kvfp8`, `kv4c`, `kv2c` (`kv2` is accepted for `kv2c`) store
//! keys and values alike. `k<K>v<V>` stores them apart, each side spelled as the uniform format's
//! suffix: `16`, `8`, `4`, `fp8`, `4c`, `2c` (`2` for `2c`), e.g. `k8v4`, `kfp8v4`, `k4cv2c`.
//! A side treats its data exactly as the uniform format of that suffix treats it: `k4c` keys are
//! channel-wise over a block, `v2c` values INT2 per token held in full precision until their
//! block fills (as in `kv2c`), `v4` values INT4 per token quantized as written. A mix of two
//! equal sides is the uniform format and prints as one (`k4v4` reads back as `kv4`).

use std::fmt;
use std::str::FromStr;

use nibble_core::{Error, Result};

/// Group sizes a 4-bit format may use along K.
pub const GROUP_SIZES: [u32; 3] = [32, 64, 128];

/// How the weights and the activations of every linear layer are stored and multiplied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LinearScheme {
    /// The checkpoint's own floats; 16-bit activations.
    W16A16,
    /// INT8 per output channel, dequantized to 16-bit; 16-bit activations.
    W8A16,
    /// INT8 per output channel x INT8 per token (SmoothQuant layout), INT32 accumulation.
    W8A8,
    /// FP8 e4m3 per output channel x FP8 e4m3 per token.
    Fp8,
    /// UINT4 per group with f16 scale and integer zero (AWQ/GPTQ); 16-bit activations.
    W4A16 { group: u32 },
    /// `group == 0`: QServe per-channel UINT4 with zero. `group > 0`: QoQ progressive
    /// (INT8 per channel in [-119, 119], then UINT4 per group with UINT8 scale and UINT4 zero).
    /// INT8 per-token activations; INT32 accumulation.
    W4A8 { group: u32 },
    /// LiquidQuant: INT8 per channel, shifted to UINT8, UINT4 per group with an integer scale
    /// and offset; INT8 per-token activations.
    W4A8Lqq { group: u32 },
    /// COMET: UINT4 per group weights; activations in `group`-channel blocks, outlier blocks
    /// INT8 and the rest INT4, after a calibrated channel permutation.
    W4A4A8 { group: u32 },
}

/// How the KV cache is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum KvFormat {
    /// Unquantized: the backend's activation type (f32 on the CPU, f16/bf16 on GPUs).
    #[default]
    F16,
    /// INT8 per token per head, asymmetric, f16 scale and zero (TurboMind/QServe).
    Int8,
    /// INT4 per token per head, asymmetric, f16 scale and zero (TurboMind/QServe).
    Int4,
    /// FP8 e4m3 per token per head with an f16 scale.
    Fp8,
    /// BitDecoding 4-bit: keys per channel and values per token over each full KV block; the
    /// block being filled stays in f16 (the residual buffer) until it is full.
    Int4Channel,
    /// BitDecoding 2-bit, laid out like [`KvFormat::Int4Channel`].
    Int2Channel,
}

/// How the KV cache stores keys (`k`) and values (`v`), each side in its own format (see the
/// module docs for the spelling). Byte layouts and sizes: [`crate::kv`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct KvSpec {
    pub k: KvFormat,
    pub v: KvFormat,
}

/// A whole deployment precision: linear layers plus KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PrecisionSpec {
    pub linear: LinearScheme,
    pub kv: KvSpec,
}

impl Default for PrecisionSpec {
    fn default() -> Self {
        PrecisionSpec {
            linear: LinearScheme::W16A16,
            kv: KvSpec::default(),
        }
    }
}

impl LinearScheme {
    /// Bits per weight element, not counting scales.
    pub fn weight_bits(self) -> u32 {
        match self {
            LinearScheme::W16A16 => 16,
            LinearScheme::W8A16 | LinearScheme::W8A8 | LinearScheme::Fp8 => 8,
            _ => 4,
        }
    }

    /// The group size along K, or `None` for per-channel and unquantized schemes.
    pub fn group(self) -> Option<u32> {
        match self {
            LinearScheme::W4A16 { group }
            | LinearScheme::W4A8Lqq { group }
            | LinearScheme::W4A4A8 { group } => Some(group),
            LinearScheme::W4A8 { group } if group > 0 => Some(group),
            _ => None,
        }
    }

    /// Whether weights are quantized at all.
    pub fn is_quantized(self) -> bool {
        self != LinearScheme::W16A16
    }

    /// Checks that a layer with `k` input channels can use this scheme.
    pub fn check_k(self, tensor: &str, k: usize) -> Result<()> {
        if let Some(g) = self.group()
            && !k.is_multiple_of(g as usize)
        {
            return Err(Error::InvalidArgument(format!(
                "tensor '{tensor}' has {k} input channels, which group size {g} does not divide; \
                 pick a group size from {GROUP_SIZES:?} that divides every layer's input size"
            )));
        }
        Ok(())
    }
}

impl fmt::Display for LinearScheme {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            LinearScheme::W16A16 => write!(f, "w16a16"),
            LinearScheme::W8A16 => write!(f, "w8a16"),
            LinearScheme::W8A8 => write!(f, "w8a8"),
            LinearScheme::Fp8 => write!(f, "fp8"),
            LinearScheme::W4A16 { group } => write!(f, "w4a16-g{group}"),
            LinearScheme::W4A8 { group: 0 } => write!(f, "w4a8"),
            LinearScheme::W4A8 { group } => write!(f, "w4a8-g{group}"),
            LinearScheme::W4A8Lqq { group } => write!(f, "w4a8-lqq-g{group}"),
            LinearScheme::W4A4A8 { group } => write!(f, "w4a4a8-g{group}"),
        }
    }
}

impl KvFormat {
    pub const ALL: [KvFormat; 6] = [
        KvFormat::F16,
        KvFormat::Int8,
        KvFormat::Int4,
        KvFormat::Fp8,
        KvFormat::Int4Channel,
        KvFormat::Int2Channel,
    ];

    pub fn token(self) -> &'static str {
        match self {
            KvFormat::F16 => "kv16",
            KvFormat::Int8 => "kv8",
            KvFormat::Int4 => "kv4",
            KvFormat::Fp8 => "kvfp8",
            KvFormat::Int4Channel => "kv4c",
            KvFormat::Int2Channel => "kv2c",
        }
    }

    /// Bits per cached element, not counting scales.
    pub fn bits(self) -> u32 {
        match self {
            KvFormat::F16 => 16,
            KvFormat::Int8 | KvFormat::Fp8 => 8,
            KvFormat::Int4 | KvFormat::Int4Channel => 4,
            KvFormat::Int2Channel => 2,
        }
    }

    /// The token without its `kv`: how one side of a [`KvSpec`] mix spells this format.
    pub fn side_token(self) -> &'static str {
        &self.token()[2..]
    }

    fn from_side_token(t: &str) -> Option<KvFormat> {
        if t == "2" {
            return Some(KvFormat::Int2Channel);
        }
        KvFormat::ALL.into_iter().find(|k| k.side_token() == t)
    }
}

impl fmt::Display for KvFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.token())
    }
}

impl FromStr for KvFormat {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let t = s.trim().to_ascii_lowercase();
        t.strip_prefix("kv")
            .and_then(KvFormat::from_side_token)
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "unknown KV cache format '{s}'; expected one of kv16, kv8, kv4, kvfp8, kv4c, \
                     kv2c"
                ))
            })
    }
}

const SIDE_TOKENS: &str = "16, 8, 4, fp8, 4c, 2c";

impl KvSpec {
    /// Keys and values both in `format`.
    pub const fn uniform(format: KvFormat) -> KvSpec {
        KvSpec {
            k: format,
            v: format,
        }
    }

    /// The one format of both sides, or `None` for a mix.
    pub fn as_uniform(self) -> Option<KvFormat> {
        (self.k == self.v).then_some(self.k)
    }

    /// Neither side quantized: the backend's own float.
    pub fn is_f16(self) -> bool {
        self.k == KvFormat::F16 && self.v == KvFormat::F16
    }

    pub fn is_quantized(self) -> bool {
        !self.is_f16()
    }

    /// Parses one KV token (`kv4`, `k8v4`, ...); the error says what is wrong with it.
    fn from_token(t: &str) -> std::result::Result<KvSpec, String> {
        if let Some(side) = t.strip_prefix("kv") {
            return KvFormat::from_side_token(side)
                .map(KvSpec::uniform)
                .ok_or_else(|| {
                    format!(
                        "unknown KV token '{t}': a uniform KV format is kv followed by one of \
                         {SIDE_TOKENS}"
                    )
                });
        }
        let Some(rest) = t.strip_prefix('k') else {
            return Err(format!("unknown KV token '{t}'"));
        };
        // No side suffix contains a 'v', so the first one ends the key side.
        let Some((k, v)) = rest.split_once('v') else {
            return Err(format!(
                "KV token '{t}' names the keys' format but not the values': write k<K>v<V>, \
                 each of {SIDE_TOKENS} (e.g. k8v4), or kv<F> for both"
            ));
        };
        let side = |s: &str, what: &str| {
            KvFormat::from_side_token(s).ok_or_else(|| {
                format!("unknown KV token '{t}': {what} format '{s}' is not one of {SIDE_TOKENS}")
            })
        };
        Ok(KvSpec {
            k: side(k, "key")?,
            v: side(v, "value")?,
        })
    }
}

impl From<KvFormat> for KvSpec {
    fn from(format: KvFormat) -> KvSpec {
        KvSpec::uniform(format)
    }
}

impl fmt::Display for KvSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.as_uniform() {
            Some(u) => f.write_str(u.token()),
            None => write!(f, "k{}v{}", self.k.side_token(), self.v.side_token()),
        }
    }
}

impl FromStr for KvSpec {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        KvSpec::from_token(&s.trim().to_ascii_lowercase()).map_err(|why| {
            Error::InvalidArgument(format!(
                "KV cache format '{s}': {why}. Examples: kv8, kv4c, k8v4, kfp8v4, k4cv2c"
            ))
        })
    }
}

impl fmt::Display for PrecisionSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.linear)?;
        if self.kv.is_quantized() {
            write!(f, "-{}", self.kv)?;
        }
        Ok(())
    }
}

impl FromStr for PrecisionSpec {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        parse(s).map_err(|why| {
            Error::InvalidArgument(format!(
                "precision '{s}': {why}. Examples: w4a16-g128, w8a8, w4a8-g128-kv4, \
                 w4a8-lqq-g64, w4a4a8, fp8-kvfp8, kv8, w4a8-g128-k8v4"
            ))
        })
    }
}

fn parse(s: &str) -> std::result::Result<PrecisionSpec, String> {
    let lower = s.trim().to_ascii_lowercase();
    let mut tokens = lower.split('-');
    let head = tokens
        .next()
        .filter(|t| !t.is_empty())
        .ok_or("empty spec")?;
    let mut kv = None;
    let base = match head {
        "w16a16" | "w16" | "bf16" | "f16" | "fp16" => "w16a16",
        "w8a16" | "w8a8" | "fp8" | "w4a16" | "w4a8" | "w4a4a8" => head,
        t if t.starts_with('k') => {
            kv = Some(KvSpec::from_token(t)?);
            "w16a16"
        }
        t => return Err(format!("unknown weight/activation token '{t}'")),
    };
    let (mut group, mut lqq) = (None, false);
    for t in tokens {
        if let Some(g) = t
            .strip_prefix('g')
            .filter(|g| g.chars().all(|c| c.is_ascii_digit()))
        {
            let g: u32 = g.parse().map_err(|_| format!("bad group size '{t}'"))?;
            if !GROUP_SIZES.contains(&g) {
                return Err(format!("group size {g} is not one of {GROUP_SIZES:?}"));
            }
            if group.replace(g).is_some() {
                return Err("more than one group size".into());
            }
        } else if t == "lqq" {
            if std::mem::replace(&mut lqq, true) {
                return Err("'lqq' given twice".into());
            }
        } else if t.starts_with('k') {
            if kv.replace(KvSpec::from_token(t)?).is_some() {
                return Err("more than one KV token".into());
            }
        } else {
            return Err(format!("unknown token '{t}'"));
        }
    }
    if lqq && base != "w4a8" {
        return Err("'lqq' (LiquidQuant) applies only to w4a8".into());
    }
    if group.is_some() && !base.starts_with("w4") {
        return Err(format!(
            "a group size applies only to 4-bit weights, not {base}"
        ));
    }
    let linear = match base {
        "w16a16" => LinearScheme::W16A16,
        "w8a16" => LinearScheme::W8A16,
        "w8a8" => LinearScheme::W8A8,
        "fp8" => LinearScheme::Fp8,
        "w4a16" => LinearScheme::W4A16 {
            group: group.unwrap_or(128),
        },
        "w4a8" if lqq => LinearScheme::W4A8Lqq {
            group: group.unwrap_or(64),
        },
        "w4a8" => LinearScheme::W4A8 {
            group: group.unwrap_or(0),
        },
        "w4a4a8" => LinearScheme::W4A4A8 {
            group: group.unwrap_or(128),
        },
        _ => unreachable!("base tokens are matched above"),
    };
    Ok(PrecisionSpec {
        linear,
        kv: kv.unwrap_or_default(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> PrecisionSpec {
        s.parse().unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    #[test]
    fn parses_the_documented_examples() {
        assert_eq!(p("w4a16-g128").linear, LinearScheme::W4A16 { group: 128 });
        assert_eq!(p("w8a8").linear, LinearScheme::W8A8);
        assert_eq!(p("w4a8-g128").linear, LinearScheme::W4A8 { group: 128 });
        assert_eq!(p("w4a8").linear, LinearScheme::W4A8 { group: 0 });
        assert_eq!(
            p("w4a8-lqq-g64").linear,
            LinearScheme::W4A8Lqq { group: 64 }
        );
        assert_eq!(p("w4a8-lqq").linear, LinearScheme::W4A8Lqq { group: 64 });
        assert_eq!(p("w4a4a8").linear, LinearScheme::W4A4A8 { group: 128 });
        assert_eq!(p("fp8").linear, LinearScheme::Fp8);
        let s = p("W4A8-G64-KV4");
        assert_eq!(s.linear, LinearScheme::W4A8 { group: 64 });
        assert_eq!(s.kv, KvFormat::Int4.into());
        assert_eq!(
            p("kv8"),
            PrecisionSpec {
                linear: LinearScheme::W16A16,
                kv: KvFormat::Int8.into()
            }
        );
        assert_eq!(p("fp8-kvfp8").kv, KvFormat::Fp8.into());
        assert_eq!(p("w4a16-kv2").kv, KvFormat::Int2Channel.into());
        assert_eq!(
            p("w4a16-kv4c-g32").linear,
            LinearScheme::W4A16 { group: 32 }
        );
    }

    #[test]
    fn display_round_trips() {
        for s in [
            "w16a16",
            "w8a16",
            "w8a8",
            "fp8",
            "w4a16-g32",
            "w4a16-g64",
            "w4a16-g128",
            "w4a8",
            "w4a8-g128",
            "w4a8-lqq-g64",
            "w4a4a8-g128",
            "w4a4a8-g64",
        ] {
            for k in KvFormat::ALL {
                for v in KvFormat::ALL {
                    let kv = KvSpec { k, v };
                    let spec = p(&format!("{s}-{kv}"));
                    assert_eq!(spec.kv, kv, "{s}-{kv}");
                    assert_eq!(p(&spec.to_string()), spec, "{spec}");
                }
            }
        }
    }

    #[test]
    fn kv_mixes_spell_each_side_and_uniform_ones_keep_their_name() {
        let kv = |s: &str| s.parse::<KvSpec>().unwrap_or_else(|e| panic!("{s}: {e}"));
        use KvFormat::*;
        for (text, k, v, shown) in [
            ("k8v4", Int8, Int4, "k8v4"),
            ("kfp8v4", Fp8, Int4, "kfp8v4"),
            ("k4cv2c", Int4Channel, Int2Channel, "k4cv2c"),
            ("k4v2", Int4, Int2Channel, "k4v2c"),
            ("k8v2c", Int8, Int2Channel, "k8v2c"),
            ("k16v4", F16, Int4, "k16v4"),
            ("K4CV16", Int4Channel, F16, "k4cv16"),
            ("k4v4", Int4, Int4, "kv4"),
            ("k2v2c", Int2Channel, Int2Channel, "kv2c"),
            ("kv4c", Int4Channel, Int4Channel, "kv4c"),
            ("kv2", Int2Channel, Int2Channel, "kv2c"),
            ("kv16", F16, F16, "kv16"),
        ] {
            let got = kv(text);
            assert_eq!(got, KvSpec { k, v }, "{text}");
            assert_eq!(got.to_string(), shown, "{text}");
            assert_eq!(kv(shown), got, "{shown} reads back");
        }
        assert_eq!(KvSpec::uniform(Int8).as_uniform(), Some(Int8));
        assert_eq!(kv("k8v4").as_uniform(), None);
        assert!(KvSpec::default().is_f16() && !KvSpec::default().is_quantized());
        assert!(kv("k16v4").is_quantized() && kv("k4v16").is_quantized());
        // Inside a full spec, anywhere after the head, or as the head itself.
        let s = p("w4a8-g128-k8v4");
        assert_eq!(s.linear, LinearScheme::W4A8 { group: 128 });
        assert_eq!(s.kv, kv("k8v4"));
        assert_eq!(s.to_string(), "w4a8-g128-k8v4");
        assert_eq!(p("w4a16-kfp8v4-g32").to_string(), "w4a16-g32-kfp8v4");
        assert_eq!(p("k4cv2").to_string(), "w16a16-k4cv2c");
        assert_eq!(p("w8a8-k4v4").to_string(), "w8a8-kv4");
        assert_eq!(p("w8a8-k16v16").to_string(), "w8a8");
    }

    #[test]
    fn bad_kv_tokens_are_named_in_the_error() {
        for (s, why) in [
            ("k8", "'k8' names the keys' format but not the values'"),
            ("k8v", "value format '' is not one of"),
            ("k3v4", "key format '3' is not one of"),
            ("k8v4cc", "value format '4cc'"),
            ("kv4v2", "unknown KV token 'kv4v2'"),
            ("k8vfp", "value format 'fp'"),
            ("kfp8v4c2", "'kfp8v4c2'"),
        ] {
            let err = s.parse::<KvSpec>().unwrap_err().to_string();
            assert!(err.contains(why), "{s}: {err}");
            let err = format!("w4a8-{s}").parse::<PrecisionSpec>().unwrap_err();
            assert!(err.to_string().contains(why), "w4a8-{s}: {err}");
        }
        let err = "w4a8-k8v4-kv8".parse::<PrecisionSpec>().unwrap_err();
        assert!(err.to_string().contains("more than one KV"), "{err}");
        assert!(
            "k8v4".parse::<KvFormat>().is_err(),
            "a mix is not one format"
        );
    }

    #[test]
    fn rejects_bad_specs_with_a_reason() {
        for (s, why) in [
            ("", "empty"),
            ("w3a16", "unknown weight"),
            ("w4a16-g100", "group size 100"),
            ("w4a16-g64-g32", "more than one group"),
            ("w8a8-g64", "only to 4-bit"),
            ("w4a16-lqq", "only to w4a8"),
            ("w4a8-kv3", "unknown KV token 'kv3'"),
            ("w4a8-kv8-kv4", "more than one KV"),
            ("w4a8-fast", "unknown token"),
        ] {
            let err = s.parse::<PrecisionSpec>().unwrap_err().to_string();
            assert!(err.contains(why), "{s}: {err}");
        }
        assert!("kv5".parse::<KvFormat>().is_err());
    }

    #[test]
    fn group_must_divide_k() {
        let s = p("w4a16-g128").linear;
        assert!(s.check_k("q", 4096).is_ok());
        let err = s
            .check_k("model.layers.0.self_attn.q_proj.weight", 576)
            .unwrap_err();
        assert!(err.to_string().contains("576"), "{err}");
        assert!(p("w4a8").linear.check_k("q", 576).is_ok());
    }
}
