//! The ggml tensor element types nibble can read, with their block geometry.
//!
//! Quantized ggml types store a row as a sequence of fixed-size blocks; a row's element count must
//! be a multiple of the block's element count. Ids are those of ggml's `enum ggml_type`.

use nibble_core::{Error, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q4K,
    Q5K,
    Q6K,
}

impl GgmlType {
    pub const ALL: [GgmlType; 11] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
    ];

    /// Maps ggml's numeric type id; unknown or unsupported ids give an error naming the id.
    pub fn from_id(id: u32) -> Result<Self> {
        Ok(match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            6 => GgmlType::Q5_0,
            7 => GgmlType::Q5_1,
            8 => GgmlType::Q8_0,
            12 => GgmlType::Q4K,
            13 => GgmlType::Q5K,
            14 => GgmlType::Q6K,
            30 => GgmlType::BF16,
            other => {
                let name = match other {
                    9 => "Q8_1",
                    10 => "Q2_K",
                    11 => "Q3_K",
                    15 => "Q8_K",
                    16..=23 => "an IQ type",
                    24 => "I8",
                    25 => "I16",
                    26 => "I32",
                    27 => "I64",
                    28 => "F64",
                    29 => "IQ1_M",
                    34 | 35 => "TQ1_0/TQ2_0",
                    39 => "MXFP4",
                    _ => "unknown",
                };
                return Err(Error::unsupported(
                    format!("ggml tensor type {other} ({name})"),
                    "supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K",
                ));
            }
        })
    }

    pub fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q4_1 => 3,
            GgmlType::Q5_0 => 6,
            GgmlType::Q5_1 => 7,
            GgmlType::Q8_0 => 8,
            GgmlType::Q4K => 12,
            GgmlType::Q5K => 13,
            GgmlType::Q6K => 14,
            GgmlType::BF16 => 30,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::BF16 => "BF16",
            GgmlType::Q4_0 => "Q4_0",
            GgmlType::Q4_1 => "Q4_1",
            GgmlType::Q5_0 => "Q5_0",
            GgmlType::Q5_1 => "Q5_1",
            GgmlType::Q8_0 => "Q8_0",
            GgmlType::Q4K => "Q4_K",
            GgmlType::Q5K => "Q5_K",
            GgmlType::Q6K => "Q6_K",
        }
    }

    /// Elements per block (1 for plain float types).
    pub fn block_elems(self) -> usize {
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => 1,
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q8_0 => {
                32
            }
            GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K => 256,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            GgmlType::F32 => 4,
            GgmlType::F16 | GgmlType::BF16 => 2,
            GgmlType::Q4_0 => 18,
            GgmlType::Q4_1 => 20,
            GgmlType::Q5_0 => 22,
            GgmlType::Q5_1 => 24,
            GgmlType::Q8_0 => 34,
            GgmlType::Q4K => 144,
            GgmlType::Q5K => 176,
            GgmlType::Q6K => 210,
        }
    }

    /// Bytes needed for `elems` elements, or an error if `elems` is not whole blocks.
    pub fn bytes_for(self, elems: usize) -> Result<usize> {
        let b = self.block_elems();
        if !elems.is_multiple_of(b) {
            return Err(Error::unsupported(
                format!("a {} row of {elems} elements", self.name()),
                format!("rows must be a multiple of the {b}-element block"),
            ));
        }
        Ok(elems / b * self.block_bytes())
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
