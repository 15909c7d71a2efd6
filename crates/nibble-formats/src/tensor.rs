//! A weight tensor as it comes off disk: its bytes (borrowed from a memory map when possible), its
//! shape and its storage format. Backends turn these into their own weight objects; the format
//! travels with the bytes so a quantized tensor is never silently widened.

use std::ops::Deref;
use std::sync::Arc;

use memmap2::Mmap;
use nibble_core::{Error, Result};

use nibble_precision::LinearFormat;

use crate::gguf::{GgmlType, dequant};

/// How a tensor's elements are encoded. New weight formats are added here and in the backends'
/// registries; model code never looks inside.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WeightFormat {
    /// Plain floats or ggml quantization blocks along each row.
    Ggml(GgmlType),
    /// A nibble quantized linear layer: each row is one self-contained byte string in the
    /// layout of its codec (see `nibble_precision::weight`).
    Quant(LinearFormat),
}

impl WeightFormat {
    /// Bytes of one row of `cols` elements.
    pub fn row_bytes(self, cols: usize) -> Result<usize> {
        match self {
            WeightFormat::Ggml(t) => t.bytes_for(cols),
            WeightFormat::Quant(f) => f.row_bytes(cols),
        }
    }

    /// Decodes whole rows of `cols` elements to f32: the reference every backend kernel is
    /// checked against.
    pub fn dequantize(self, src: &[u8], cols: usize, dst: &mut [f32]) -> Result<()> {
        match self {
            WeightFormat::Ggml(t) => dequant::dequantize(t, src, dst),
            WeightFormat::Quant(f) => f.codec.dequantize(src, cols, dst),
        }
    }
}

impl std::fmt::Display for WeightFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WeightFormat::Ggml(t) => write!(f, "{t}"),
            WeightFormat::Quant(q) => write!(f, "{q}"),
        }
    }
}

#[derive(Clone)]
pub enum TensorBytes {
    Mapped {
        map: Arc<Mmap>,
        start: usize,
        len: usize,
    },
    Owned(Arc<Vec<u8>>),
}

impl Deref for TensorBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            TensorBytes::Mapped { map, start, len } => &map[*start..*start + *len],
            TensorBytes::Owned(v) => v,
        }
    }
}

#[derive(Clone)]
pub struct HostTensor {
    pub name: String,
    /// Row-major, outermost first: `[rows, cols]` for a linear weight `[out, in]`.
    pub shape: Vec<usize>,
    pub format: WeightFormat,
    pub bytes: TensorBytes,
}

impl std::fmt::Debug for HostTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "HostTensor({} {:?} {})",
            self.name, self.shape, self.format
        )
    }
}

impl HostTensor {
    pub fn elems(&self) -> usize {
        self.shape.iter().product()
    }

    /// `(rows, cols)` viewing every leading dimension as rows.
    pub fn rows_cols(&self) -> (usize, usize) {
        let cols = self.shape.last().copied().unwrap_or(1);
        (self.elems() / cols.max(1), cols)
    }

    /// Checks the shape against what the architecture expects, naming the tensor on mismatch.
    pub fn expect_shape(&self, expected: &[usize]) -> Result<()> {
        if self.shape != expected {
            return Err(Error::ShapeMismatch {
                name: self.name.clone(),
                expected: expected.to_vec(),
                found: self.shape.clone(),
            });
        }
        Ok(())
    }

    /// The whole tensor as f32 (for norms, biases, and reference checks).
    /// `(rows, cols, row_bytes)` of a 2-D weight whose byte length matches its shape and format:
    /// what every backend checks before taking a weight.
    pub fn matrix_geometry(&self) -> Result<(usize, usize, usize)> {
        if self.shape.len() != 2 {
            return Err(Error::ShapeMismatch {
                name: self.name.clone(),
                expected: vec![0, 0],
                found: self.shape.clone(),
            });
        }
        let (rows, cols) = (self.shape[0], self.shape[1]);
        let row_bytes = self
            .format
            .row_bytes(cols)
            .map_err(|e| Error::unsupported(format!("tensor '{}'", self.name), e.to_string()))?;
        if self.bytes.len() != rows * row_bytes {
            return Err(Error::corrupt(
                &self.name,
                format!(
                    "{} bytes of data for a {rows}x{cols} {} tensor that needs {}",
                    self.bytes.len(),
                    self.format,
                    rows * row_bytes
                ),
            ));
        }
        Ok((rows, cols, row_bytes))
    }

    pub fn to_f32(&self) -> Result<Vec<f32>> {
        let mut out = vec![0f32; self.elems()];
        self.format
            .dequantize(&self.bytes, self.rows_cols().1, &mut out)?;
        Ok(out)
    }

    /// Rows `r0..r1` of a matrix, in any row-wise format, or elements `r0..r1` of a vector (a
    /// tensor-parallel shard of a column-parallel layer and its bias).
    pub fn slice_rows(&self, r0: usize, r1: usize) -> Result<HostTensor> {
        let (rows, cols) = match self.shape.as_slice() {
            [n] => (*n, 1),
            _ => self.rows_cols(),
        };
        if r0 > r1 || r1 > rows {
            return Err(Error::InvalidArgument(format!(
                "rows {r0}..{r1} of '{}' ({rows} rows)",
                self.name
            )));
        }
        let rb = self.format.row_bytes(cols)?;
        let mut shape = self.shape.clone();
        shape[0] = r1 - r0;
        Ok(HostTensor {
            shape,
            bytes: TensorBytes::Owned(Arc::new(self.bytes[r0 * rb..r1 * rb].to_vec())),
            ..self.clone()
        })
    }

    /// Why columns `c0..c1` of this `[rows, cols]` matrix cannot be cut out, if they cannot:
    /// plain floats cut anywhere, ggml blocks on block boundaries, nibble quantized rows on whole
    /// groups where their format allows it (`LinearFormat::check_col_cut`); other cuts are refused.
    /// Reads no data.
    pub fn check_col_cut(&self, c0: usize, c1: usize) -> Result<()> {
        self.matrix_geometry()?;
        Self::check_col_cut_of(&self.name, &self.shape, self.format, c0, c1)
    }

    /// [`Self::check_col_cut`] from a tensor's name, shape and format alone (no data read).
    pub fn check_col_cut_of(
        name: &str,
        shape: &[usize],
        format: WeightFormat,
        c0: usize,
        c1: usize,
    ) -> Result<()> {
        let [_, cols] = shape[..] else {
            return Err(Error::ShapeMismatch {
                name: name.to_string(),
                expected: vec![0, 0],
                found: shape.to_vec(),
            });
        };
        if c0 > c1 || c1 > cols {
            return Err(Error::InvalidArgument(format!(
                "columns {c0}..{c1} of '{name}' ({cols} columns)"
            )));
        }
        let t = match format {
            WeightFormat::Ggml(t) => t,
            WeightFormat::Quant(f) => {
                return f
                    .check_col_cut(cols, c0, c1)
                    .map_err(|e| Error::InvalidArgument(format!("'{name}': {e}")));
            }
        };
        let b = t.block_elems();
        if !c0.is_multiple_of(b) || !c1.is_multiple_of(b) {
            return Err(Error::unsupported(
                format!(
                    "splitting '{name}' at columns {c0}..{c1}: it would cut a {}-element {} block",
                    b,
                    t.name()
                ),
                "pick a tensor-parallel size that divides the layer into whole blocks",
            ));
        }
        Ok(())
    }

    /// Columns `c0..c1` of a `[rows, cols]` matrix (a tensor-parallel shard of a row-parallel
    /// layer), where [`Self::check_col_cut`] allows the cut.
    pub fn slice_cols(&self, c0: usize, c1: usize) -> Result<HostTensor> {
        self.check_col_cut(c0, c1)?;
        let (rows, cols, _) = self.matrix_geometry()?;
        let mut out = Vec::new();
        match self.format {
            WeightFormat::Ggml(t) => {
                let rb = t.bytes_for(cols)?;
                let (o0, o1) = (t.bytes_for(c0)?, t.bytes_for(c1)?);
                out.reserve(rows * (o1 - o0));
                for r in 0..rows {
                    out.extend_from_slice(&self.bytes[r * rb + o0..r * rb + o1]);
                }
            }
            WeightFormat::Quant(f) => {
                let rb = f.row_bytes(cols)?;
                out.reserve(rows * f.row_bytes(c1 - c0)?);
                for row in self.bytes.chunks_exact(rb) {
                    f.cut_cols(row, cols, c0, c1, &mut out)?;
                }
            }
        }
        Ok(HostTensor {
            shape: vec![rows, c1 - c0],
            bytes: TensorBytes::Owned(Arc::new(out)),
            ..self.clone()
        })
    }

    /// Rows `a..b` (`by_rows`) or columns `a..b`: a tensor-parallel shard of a matrix.
    pub fn slice_part(&self, by_rows: bool, a: usize, b: usize) -> Result<HostTensor> {
        if by_rows {
            self.slice_rows(a, b)
        } else {
            self.slice_cols(a, b)
        }
    }

    /// Reorders rows: row `i` of the result is row `order[i]` of `self`. Works on any row-wise
    /// format because quantization blocks never straddle rows.
    pub fn permute_rows(&self, order: &[usize]) -> Result<HostTensor> {
        let (rows, cols) = self.rows_cols();
        assert_eq!(order.len(), rows, "permutation length");
        let rb = self.format.row_bytes(cols)?;
        let src: &[u8] = &self.bytes;
        let mut out = Vec::with_capacity(src.len());
        for &r in order {
            out.extend_from_slice(&src[r * rb..(r + 1) * rb]);
        }
        Ok(HostTensor {
            bytes: TensorBytes::Owned(Arc::new(out)),
            ..self.clone()
        })
    }
}
