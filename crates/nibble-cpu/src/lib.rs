//! The CPU backend. It is both a way to run models without a GPU and the reference every GPU
//! kernel is tested against, so its arithmetic is plain f32 with documented accumulation order.
//!
//! Weights stay in their storage format (f16, bf16, ggml blocks) and are decoded a tile of rows at
//! a time inside the matmul, so memory stays near the file size. nibble's own quantized formats
//! are the exception: they are expanded once to what their integer or f16 kernels read
//! ([`quant`]), since their reference arithmetic is what every GPU kernel is checked against.

mod attention;
mod delegate;
mod kv;
mod linear;
mod ops;
mod qdot;
mod qkern;
mod quant;
mod spin;
pub mod tensor_parallel;

use std::sync::OnceLock;

use nibble_core::{Error, Result};
use nibble_formats::{HostTensor, TensorBytes, WeightFormat};
use nibble_model::{AttentionShape, Backend, BatchLayout, KvShape, RopeLayout, ScaledRows};

pub use kv::CpuKvCache;

/// A row-major f32 matrix.
#[derive(Debug, Clone, PartialEq)]
pub struct CpuTensor {
    pub data: Vec<f32>,
    pub rows: usize,
    pub cols: usize,
}

impl CpuTensor {
    pub fn new(data: Vec<f32>, rows: usize, cols: usize) -> Self {
        assert_eq!(data.len(), rows * cols, "tensor data length");
        CpuTensor { data, rows, cols }
    }

    pub fn zeros(rows: usize, cols: usize) -> Self {
        CpuTensor::new(vec![0.0; rows * cols], rows, cols)
    }

    pub fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }
}

/// A weight matrix `[rows, cols]` in its storage format.
pub struct CpuWeight {
    pub rows: usize,
    pub cols: usize,
    pub format: WeightFormat,
    bytes: TensorBytes,
    /// A fused weight's further parts (see [`Backend::load_fused_weight`]), each with the first
    /// row it holds, their rows stacked after those of `bytes`: they stay where they were
    /// loaded (a mapped file) instead of being copied together.
    more: Vec<(usize, TensorBytes)>,
    row_bytes: usize,
    /// The kernel form of a `WeightFormat::Quant` weight, built by its first matmul.
    quant: OnceLock<std::result::Result<quant::QuantWeight, String>>,
}

impl CpuWeight {
    /// Decodes rows `start..start + n` into `out` (`n * cols` floats).
    pub fn dequantize_rows(&self, start: usize, n: usize, out: &mut [f32]) -> Result<()> {
        if self.more.is_empty() {
            let src = &self.bytes[start * self.row_bytes..(start + n) * self.row_bytes];
            return self
                .format
                .dequantize(src, self.cols, &mut out[..n * self.cols]);
        }
        for (i, o) in out[..n * self.cols].chunks_exact_mut(self.cols).enumerate() {
            self.format.dequantize(self.row(start + i), self.cols, o)?;
        }
        Ok(())
    }

    /// The storage bytes of row `r`.
    pub fn row(&self, r: usize) -> &[u8] {
        self.rows_view().row(r)
    }

    /// The rows' bytes, looked up once for a whole matmul.
    pub(crate) fn rows_view(&self) -> RowsView<'_> {
        let mut parts = [(usize::MAX, &[][..]); MAX_PARTS];
        parts[0] = (0, &self.bytes[..]);
        for (p, (first, b)) in parts[1..].iter_mut().zip(&self.more) {
            *p = (*first, &b[..]);
        }
        RowsView {
            parts,
            row_bytes: self.row_bytes,
        }
    }

    /// The expanded form of a quantized weight (built on first use).
    fn quant(&self) -> Result<&quant::QuantWeight> {
        let WeightFormat::Quant(format) = self.format else {
            return Err(Error::InvalidArgument(format!(
                "{} is not a nibble quantized format",
                self.format
            )));
        };
        self.quant
            .get_or_init(|| {
                quant::QuantWeight::new(format, &self.bytes, self.rows, self.cols)
                    .map_err(|e| e.to_string())
            })
            .as_ref()
            .map_err(|e| Error::InvalidArgument(e.clone()))
    }
}

/// The backend's threads: the spinning workers of the matmuls and attention ([`spin`]), and a
/// rayon pool for when another caller holds those; `threads` of each, counting the caller.
pub(crate) struct Threads {
    rayon: rayon::ThreadPool,
    spin: spin::SpinPool,
}

impl Threads {
    /// `threads` of each kind (0: every core).
    pub(crate) fn new(threads: usize) -> Result<Threads> {
        let start = |e: &dyn std::fmt::Display| {
            Error::InvalidArgument(format!("cannot start {threads} threads: {e}"))
        };
        let rayon = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("nibble-cpu-{i}"))
            .build()
            .map_err(|e| start(&e))?;
        let spin = spin::SpinPool::new(rayon.current_num_threads()).map_err(|e| start(&e))?;
        Ok(Threads { rayon, spin })
    }

    /// `f((i, chunk))` for each `chunk`-long piece `i` of `data` (the last may be shorter),
    /// shared among the threads: the spinning workers when free, else the rayon pool, so that a
    /// decode step's attention does not wake a second set of threads while the spinning ones
    /// hold the cores.
    pub(crate) fn par_chunks_mut<F>(&self, data: &mut [f32], chunk: usize, f: F)
    where
        F: Fn((usize, &mut [f32])) + Sync + Send,
    {
        use rayon::prelude::*;
        use std::sync::atomic::{AtomicUsize, Ordering};
        let (len, pieces) = (data.len(), data.len().div_ceil(chunk.max(1)));
        let out = linear::OutPtr::new(data.as_mut_ptr());
        let next = AtomicUsize::new(0);
        let job = || {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= pieces {
                    return;
                }
                let (start, end) = (i * chunk, ((i + 1) * chunk).min(len));
                // SAFETY: pieces are disjoint ranges inside `data`, each taken by one thread
                // (the counter hands out every index once), and `data` is borrowed mutably for
                // the whole call.
                f((i, unsafe {
                    std::slice::from_raw_parts_mut(out.at(start), end - start)
                }));
            }
        };
        if self.spin.try_run(&job).is_none() {
            self.rayon
                .install(|| data.par_chunks_mut(chunk).enumerate().for_each(f));
        }
    }
}

impl std::ops::Deref for Threads {
    type Target = rayon::ThreadPool;

    fn deref(&self) -> &rayon::ThreadPool {
        &self.rayon
    }
}

impl std::fmt::Debug for Threads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Threads({})", self.rayon.current_num_threads())
    }
}

/// The most weights [`Backend::load_fused_weight`] stacks (q, k, v).
const MAX_PARTS: usize = 3;

/// The bytes of a weight's rows, each part with its first row (unused parts start at
/// `usize::MAX`).
#[derive(Clone, Copy)]
pub(crate) struct RowsView<'a> {
    parts: [(usize, &'a [u8]); MAX_PARTS],
    row_bytes: usize,
}

impl<'a> RowsView<'a> {
    #[inline(always)]
    pub(crate) fn row(&self, r: usize) -> &'a [u8] {
        let p = self.parts[1..]
            .iter()
            .take_while(|(first, _)| r >= *first)
            .count();
        let (first, b) = self.parts[p];
        &b[(r - first) * self.row_bytes..(r - first + 1) * self.row_bytes]
    }
}

#[derive(Debug, Clone)]
pub struct CpuBackend {
    pool: std::sync::Arc<Threads>,
}

impl CpuBackend {
    /// `threads = 0` uses every core.
    pub fn new(threads: usize) -> Result<Self> {
        Ok(CpuBackend {
            pool: std::sync::Arc::new(Threads::new(threads)?),
        })
    }

    pub fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }
}

impl Backend for CpuBackend {
    type Tensor = CpuTensor;
    type Weight = CpuWeight;
    type Kv = CpuKvCache;

    fn name(&self) -> String {
        format!("cpu ({} threads)", self.threads())
    }

    fn load_weight(&self, t: &HostTensor) -> Result<CpuWeight> {
        let (rows, cols, row_bytes) = t.matrix_geometry()?;
        if let WeightFormat::Quant(format) = t.format {
            quant::check(format, cols)
                .map_err(|e| Error::unsupported(format!("tensor '{}'", t.name), e.to_string()))?;
        }
        Ok(CpuWeight {
            rows,
            cols,
            format: t.format,
            bytes: t.bytes.clone(),
            more: Vec::new(),
            row_bytes,
            quant: OnceLock::new(),
        })
    }

    fn load_fused_weight(&self, parts: &[HostTensor]) -> Result<Option<CpuWeight>> {
        // One matmul instead of two or three over the same input: the activations are quantized
        // once, and the pool is woken once; every output row is computed exactly as in its own
        // weight (rows are independent), so the results are the same bits. nibble's quantized
        // formats are expanded per weight on first use and are left separate.
        let Some(first) = parts.first() else {
            return Ok(None);
        };
        if parts.len() > MAX_PARTS
            || parts.iter().any(|t| {
                matches!(t.format, WeightFormat::Quant(_))
                    || t.format != first.format
                    || t.shape.len() != 2
                    || t.shape.get(1) != first.shape.get(1)
            })
        {
            return Ok(None);
        }
        let mut w = self.load_weight(first)?;
        for t in &parts[1..] {
            let (rows, _, _) = t.matrix_geometry()?;
            w.more.push((w.rows, t.bytes.clone()));
            w.rows += rows;
        }
        Ok(Some(w))
    }

    fn split_cols(&self, x: &CpuTensor, widths: &[usize]) -> Result<Vec<CpuTensor>> {
        if widths.iter().sum::<usize>() != x.cols {
            return Err(Error::InvalidArgument(format!(
                "split_cols: widths {widths:?} of a {}-column tensor",
                x.cols
            )));
        }
        let mut out: Vec<Vec<f32>> = widths
            .iter()
            .map(|&w| Vec::with_capacity(x.rows * w))
            .collect();
        for r in 0..x.rows {
            let mut c = 0;
            for (o, &w) in out.iter_mut().zip(widths) {
                o.extend_from_slice(&x.row(r)[c..c + w]);
                c += w;
            }
        }
        Ok(out
            .into_iter()
            .zip(widths)
            .map(|(d, &w)| CpuTensor::new(d, x.rows, w))
            .collect())
    }

    fn load_vector(&self, values: &[f32]) -> Result<CpuTensor> {
        Ok(CpuTensor::new(values.to_vec(), 1, values.len()))
    }

    fn new_kv_pool(
        &self,
        shape: KvShape,
        num_blocks: usize,
        block_size: usize,
    ) -> Result<CpuKvCache> {
        CpuKvCache::new(shape, num_blocks, block_size)
    }

    fn release_kv_blocks(&self, kv: &mut CpuKvCache, blocks: &[u32]) {
        kv.release_blocks(blocks);
    }

    fn embed(&self, table: &CpuWeight, ids: &[u32]) -> Result<CpuTensor> {
        let mut out = CpuTensor::zeros(ids.len(), table.cols);
        for (row, &id) in out.data.chunks_exact_mut(table.cols).zip(ids) {
            if id as usize >= table.rows {
                return Err(Error::InvalidArgument(format!(
                    "token id {id} outside the {}-row embedding table",
                    table.rows
                )));
            }
            table.dequantize_rows(id as usize, 1, row)?;
        }
        Ok(out)
    }

    fn rms_norm(&self, x: &CpuTensor, weight: &CpuTensor, eps: f32) -> CpuTensor {
        let mut out = x.clone();
        for row in out.data.chunks_exact_mut(x.cols) {
            ops::rms_norm_in_place(row, &weight.data, eps);
        }
        out
    }

    fn residual_rms_norm(&self, x: &CpuTensor, weight: &CpuTensor, eps: f32) -> CpuTensor {
        self.rms_norm(x, weight, eps)
    }

    fn add_rms_norm(
        &self,
        x: &mut CpuTensor,
        delta: &CpuTensor,
        weight: &CpuTensor,
        eps: f32,
    ) -> CpuTensor {
        self.add(x, delta);
        self.rms_norm(x, weight, eps)
    }

    fn head_rms_norm(&self, x: &mut CpuTensor, weight: &CpuTensor, head_dim: usize, eps: f32) {
        // Whole heads of each row (a row is num_heads * head_dim wide in every model).
        for row in x.data.chunks_exact_mut(x.cols) {
            for head in row.chunks_exact_mut(head_dim) {
                ops::rms_norm_in_place(head, &weight.data, eps);
            }
        }
    }

    fn linear(&self, x: &CpuTensor, w: &CpuWeight, bias: Option<&CpuTensor>) -> Result<CpuTensor> {
        if x.cols != w.cols {
            return Err(Error::InvalidArgument(format!(
                "linear: input has {} features, weight expects {}",
                x.cols, w.cols
            )));
        }
        let mut out = linear::matmul_transposed(&self.pool, x, w)?;
        if let Some(b) = bias {
            for row in out.data.chunks_exact_mut(out.cols) {
                for (o, b) in row.iter_mut().zip(&b.data) {
                    *o += b;
                }
            }
        }
        Ok(out)
    }

    fn rope(
        &self,
        x: &mut CpuTensor,
        head_dim: usize,
        batch: &BatchLayout,
        inv_freq: &CpuTensor,
        layout: RopeLayout,
    ) {
        let positions = batch.positions();
        let cols = x.cols;
        for (row, &pos) in x.data.chunks_exact_mut(cols).zip(&positions) {
            ops::rope_row(row, head_dim, pos, &inv_freq.data, layout);
        }
    }

    fn attention(
        &self,
        q: &CpuTensor,
        k: &CpuTensor,
        v: &CpuTensor,
        kv: &mut CpuKvCache,
        layer: usize,
        batch: &BatchLayout,
        shape: AttentionShape,
    ) -> Result<CpuTensor> {
        attention::attention(&self.pool, q, k, v, kv, layer, batch, shape)
    }

    fn silu_mul(&self, gate: &CpuTensor, up: &CpuTensor) -> CpuTensor {
        let data = gate
            .data
            .iter()
            .zip(&up.data)
            .map(|(&g, &u)| g / (1.0 + (-g).exp()) * u)
            .collect();
        CpuTensor::new(data, gate.rows, gate.cols)
    }

    fn gelu_tanh_mul(&self, gate: &CpuTensor, up: &CpuTensor) -> CpuTensor {
        let data = gate
            .data
            .iter()
            .zip(&up.data)
            .map(|(&g, &u)| ops::gelu_tanh(g) * u)
            .collect();
        CpuTensor::new(data, gate.rows, gate.cols)
    }

    fn scale(&self, x: &mut CpuTensor, factor: f32) {
        x.data.iter_mut().for_each(|a| *a *= factor);
    }

    fn add(&self, x: &mut CpuTensor, delta: &CpuTensor) {
        for (a, b) in x.data.iter_mut().zip(&delta.data) {
            *a += b;
        }
    }

    fn gather_rows(&self, x: &CpuTensor, rows: &[usize]) -> CpuTensor {
        let mut data = Vec::with_capacity(rows.len() * x.cols);
        for &r in rows {
            data.extend_from_slice(x.row(r));
        }
        CpuTensor::new(data, rows.len(), x.cols)
    }

    fn scatter_add_scaled(
        &self,
        rows: usize,
        cols: usize,
        parts: &[ScaledRows<'_, CpuTensor>],
    ) -> Result<CpuTensor> {
        let mut out = CpuTensor::zeros(rows, cols);
        for (n, p) in parts.iter().enumerate() {
            p.check(n, (p.x.rows, p.x.cols), rows, cols)?;
            for ((i, &r), &s) in p.rows.iter().enumerate().zip(p.scales) {
                let dst = &mut out.data[r * cols..(r + 1) * cols];
                for (o, &v) in dst.iter_mut().zip(p.x.row(i)) {
                    *o = s.mul_add(v, *o);
                }
            }
        }
        Ok(out)
    }

    fn to_host(&self, x: &CpuTensor) -> Result<Vec<f32>> {
        Ok(x.data.clone())
    }
}
