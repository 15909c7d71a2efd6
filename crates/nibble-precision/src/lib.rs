//! nibble's one precision vocabulary. A `WxAyKVz` spec ([`spec`]) names a deployment; each
//! quantized tensor carries a [`LinearFormat`] (weight codec plus activation quantization) and the
//! KV cache a [`KvSpec`] (a [`KvFormat`] for keys and one for values). Every format has its packing and a CPU reference of the arithmetic the
//! GPU kernels do; adding a format means adding it here, to its kernels, and to the backends'
//! dispatch on these enums.

pub mod act;
pub mod kv;
pub mod reference;
pub mod spec;
pub mod weight;

pub use act::QuantizedRow;
pub use kv::{ChannelKeys, KeyLayout, TokenCodec, UintBits};
pub use reference::reference_matmul;
pub use spec::{KvFormat, KvSpec, LinearScheme, PrecisionSpec};
pub use weight::{ActQuant, ByteAffine, LinearFormat, WeightCodec, byte_affine_word};

impl LinearScheme {
    /// The per-tensor format this scheme gives a layer. `int8_blocks` is the number of INT8
    /// activation blocks COMET's calibration chose for the layer (ignored by other schemes);
    /// `None` for unquantized weights.
    pub fn linear_format(self, int8_blocks: u16) -> Option<LinearFormat> {
        let (codec, act) = match self {
            LinearScheme::W16A16 => return None,
            LinearScheme::W8A16 => (WeightCodec::Int8PerChannel, ActQuant::F16),
            LinearScheme::W8A8 => (WeightCodec::Int8PerChannel, ActQuant::Int8PerToken),
            LinearScheme::Fp8 => (WeightCodec::Fp8PerChannel, ActQuant::Fp8PerToken),
            LinearScheme::W4A16 { group } => (WeightCodec::Int4Group { group }, ActQuant::F16),
            LinearScheme::W4A8 { group: 0 } => {
                (WeightCodec::Int4Group { group: 0 }, ActQuant::Int8PerToken)
            }
            LinearScheme::W4A8 { group } => (WeightCodec::Qoq { group }, ActQuant::Int8PerToken),
            LinearScheme::W4A8Lqq { group } => (WeightCodec::Lqq { group }, ActQuant::Int8PerToken),
            LinearScheme::W4A4A8 { group } => (
                WeightCodec::Int4Group { group },
                ActQuant::Mixed4x8 {
                    block: group as u16,
                    int8_blocks,
                },
            ),
        };
        Some(LinearFormat { codec, act })
    }
}
