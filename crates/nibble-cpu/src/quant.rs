//! `y = x · Wᵀ` for nibble's quantized linear formats (`WeightFormat::Quant`), bit for bit
//! `nibble_precision::reference_matmul`.
//!
//! A weight is expanded once, on its first matmul, into the operands the tile kernels of
//! [`crate::qkern`] read, without changing any value:
//! - integer activations: every row's exact integers (`WeightCodec::integer_row`) as INT8,
//!   padded with zeros to a multiple of 16 channels, and the scales as f32, laid out
//!   `[panel of 8 rows][group][8]` so a tile loads its lanes' scales at once;
//! - float activations: every weight as the f16 the reference multiplies (decoded e4m3 codes for
//!   FP8 x FP8, f16-rounded dequantized values for `a16`), in panels of 8 rows, channel-major.
//!
//! The expansion is lazy because a weight that is only ever an embedding table (an untied
//! `embed_tokens`) would otherwise double its memory for nothing; embedding rows are decoded
//! from the stored bytes.
//!
//! Activations are quantized one row at a time by `nibble_precision::act`, the same functions
//! the reference calls, so every row's codes and scales are independent of the batch; each
//! output lane of a tile is computed by the same operations whatever tile shape runs it, so an
//! output row is bitwise the same for any `m` (batch invariance) and any tiling.

use half::f16;
use nibble_core::{Error, Result};
use nibble_precision::act;
use nibble_precision::reference::{MAX_INT_K, f16_weight_row, fp8_row};
use nibble_precision::{ActQuant, LinearFormat, WeightCodec};

use crate::CpuTensor;
use crate::linear::{OutPtr, run_tiles};
use crate::qkern::{self, Epilogue, IntTile};

/// Weight bytes a task applies to every group of activation rows before moving on (stays in
/// L1/L2 while the activation rows stream past it).
const PANEL_BYTES: usize = 48 * 1024;

/// Below this much work (expanded weight bytes times groups of 4 activation rows) a matmul runs
/// on the calling thread.
const SERIAL_BYTES: usize = 256 * 1024;

/// A quantized weight in the form the tile kernels read.
pub struct QuantWeight {
    n: usize,
    k: usize,
    body: Body,
}

enum Body {
    Int {
        act: ActQuant,
        epi: Epilogue,
        /// Channels per scale group and the number of groups.
        gl: usize,
        groups: usize,
        /// K padded to a multiple of 16.
        kp: usize,
        /// `n` rounded up to 8 rows of `kp` integers (the extra rows are zero).
        ints: Vec<i8>,
        /// `[n / 8][groups][8]`.
        scales: Vec<f32>,
    },
    Float {
        fp8: bool,
        /// `[n / 8][k][8]` f16 bits.
        panels: Vec<u16>,
        /// FP8 per-row scales (`n` rounded up to 8); empty for `a16`.
        scales: Vec<f32>,
    },
}

/// Checks that a quantized weight of `n x k` in `format` can be multiplied, so that expanding
/// it later cannot fail.
pub fn check(format: LinearFormat, k: usize) -> Result<()> {
    LinearFormat::new(format.codec, format.act)?;
    format.row_bytes(k)?;
    if k > MAX_INT_K
        && matches!(
            format.act,
            ActQuant::Int8PerToken | ActQuant::Mixed4x8 { .. }
        )
    {
        return Err(Error::InvalidArgument(format!(
            "{format}: {k} input channels overflow the i32 accumulator (at most {MAX_INT_K})"
        )));
    }
    Ok(())
}

impl QuantWeight {
    /// Expands `n` stored rows of `k` channels (`bytes` is `n` rows of `format.row_bytes(k)`).
    pub fn new(format: LinearFormat, bytes: &[u8], n: usize, k: usize) -> Result<QuantWeight> {
        check(format, k)?;
        let rb = format.row_bytes(k)?;
        if bytes.len() != n * rb {
            return Err(Error::InvalidArgument(format!(
                "{format}: {} bytes for {n} rows of {rb}",
                bytes.len()
            )));
        }
        let np = n.next_multiple_of(8);
        let codec = format.codec;
        let body = match format.act {
            ActQuant::Int8PerToken | ActQuant::Mixed4x8 { .. } => {
                let epi = match (codec, format.act) {
                    (_, ActQuant::Mixed4x8 { .. }) => Epilogue::Mixed,
                    (WeightCodec::Int4Group { group }, _) if group > 0 => Epilogue::Groups,
                    _ => Epilogue::PerChannel,
                };
                let (gl, groups, kp) = if epi == Epilogue::PerChannel {
                    let kp = k.next_multiple_of(16);
                    (kp, 1, kp)
                } else {
                    let gl = k / codec.groups(k);
                    (gl, k / gl, k.next_multiple_of(16))
                };
                let mut ints = vec![0i8; np * kp];
                let mut scales = vec![0f32; np * groups];
                let mut row_scales = Vec::with_capacity(groups);
                for (r, src) in bytes.chunks_exact(rb).enumerate() {
                    codec.integer_row(src, k, &mut ints[r * kp..r * kp + k], &mut row_scales);
                    for (g, &s) in row_scales.iter().enumerate() {
                        scales[(r / 8) * groups * 8 + g * 8 + r % 8] = s;
                    }
                }
                Body::Int {
                    act: format.act,
                    epi,
                    gl,
                    groups,
                    kp,
                    ints,
                    scales,
                }
            }
            ActQuant::F16 | ActQuant::Fp8PerToken => {
                let fp8 = format.act == ActQuant::Fp8PerToken;
                let mut panels = vec![0u16; np * k];
                let mut scales = vec![0f32; if fp8 { np } else { 0 }];
                let mut vals = vec![0f32; k];
                for (r, src) in bytes.chunks_exact(rb).enumerate() {
                    if fp8 {
                        scales[r] = fp8_row(src, k, &mut vals);
                    } else {
                        f16_weight_row(codec, src, k, &mut vals)?;
                    }
                    let panel = &mut panels[(r / 8) * k * 8..][..k * 8];
                    for (c, &v) in vals.iter().enumerate() {
                        // Exact: both kinds of values are f16 values already.
                        panel[c * 8 + r % 8] = f16::from_f32(v).to_bits();
                    }
                }
                Body::Float {
                    fp8,
                    panels,
                    scales,
                }
            }
        };
        Ok(QuantWeight { n, k, body })
    }
}

/// One matmul's activations, quantized row by row.
enum Acts {
    /// `m` rows of `kp` i16 codes (zero padded) and `ns` scales per row.
    Int {
        codes: Vec<i16>,
        scales: Vec<f32>,
        ns: usize,
    },
    /// `m` rows of `k` values (f16-rounded, or decoded e4m3 codes) and, for FP8, a scale per row.
    Float { vals: Vec<f32>, scales: Vec<f32> },
}

fn quantize_acts(x: &CpuTensor, w: &QuantWeight) -> Acts {
    let (m, k) = (x.rows, x.cols);
    match &w.body {
        Body::Int {
            act, kp, groups, ..
        } => {
            let ns = if matches!(act, ActQuant::Mixed4x8 { .. }) {
                *groups
            } else {
                1
            };
            let mut codes = vec![0i16; m * kp];
            let mut scales = vec![0f32; m * ns];
            let mut q = vec![0i8; k];
            for i in 0..m {
                let s = &mut scales[i * ns..(i + 1) * ns];
                match *act {
                    ActQuant::Mixed4x8 { block, int8_blocks } => act::quantize_mixed(
                        x.row(i),
                        block as usize,
                        int8_blocks as usize,
                        &mut q,
                        s,
                    ),
                    _ => s[0] = act::quantize_int8(x.row(i), &mut q),
                }
                for (c, &v) in codes[i * kp..].iter_mut().zip(&q) {
                    *c = v as i16;
                }
            }
            Acts::Int { codes, scales, ns }
        }
        Body::Float { fp8, .. } => {
            let mut vals = vec![0f32; m * k];
            let mut scales = Vec::new();
            let mut q = vec![0u8; k];
            for i in 0..m {
                let v = &mut vals[i * k..(i + 1) * k];
                if *fp8 {
                    scales.push(act::quantize_fp8(x.row(i), &mut q));
                    for (v, &c) in v.iter_mut().zip(&q) {
                        *v = act::fp8_value(c);
                    }
                } else {
                    act::round_f16(x.row(i), v);
                }
            }
            Acts::Float { vals, scales }
        }
    }
}

/// `y = x · Wᵀ` into `y` (`x.rows x w.n`, every element written). `portable` forces the
/// portable kernels (for tests: they must give the same bits).
pub(crate) fn matmul(
    pool: &crate::Threads,
    x: &CpuTensor,
    w: &QuantWeight,
    y: &mut [f32],
    portable: bool,
) -> Result<()> {
    let (m, n) = (x.rows, w.n);
    if x.cols != w.k || y.len() != m * n {
        return Err(Error::InvalidArgument(format!(
            "quantized linear: {}x{} input and {} outputs for a {n}x{} weight",
            x.rows,
            x.cols,
            y.len(),
            w.k
        )));
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    let acts = quantize_acts(x, w);
    let out = OutPtr::new(y.as_mut_ptr());
    let np = n.next_multiple_of(8);
    let (row_bytes, tiles): (usize, &(dyn Fn(usize, usize) + Sync)) = match (&w.body, &acts) {
        (Body::Int { kp, .. }, Acts::Int { .. }) => (*kp, &|c0, nc| {
            int_columns(w, &acts, m, c0, c0 + nc, &out, portable)
        }),
        (Body::Float { .. }, Acts::Float { .. }) => (2 * w.k, &|c0, nc| {
            float_columns(w, &acts, m, c0, c0 + nc, &out, portable)
        }),
        _ => unreachable!("activations are quantized for their weight's body"),
    };
    let serial = np * row_bytes * m.div_ceil(4) < SERIAL_BYTES;
    run_tiles(pool, np, 8, serial, &|c0, nc| {
        tiles(c0, nc);
        Ok(())
    })
}

/// Writes lane `l` of a tile row to `y[i][c0 + l]` for the columns inside `n`.
#[inline(always)]
fn store(out: &OutPtr, n: usize, i: usize, c0: usize, lanes: &[f32]) {
    for (l, &v) in lanes.iter().enumerate().take(n.saturating_sub(c0)) {
        // SAFETY: i < m and c0 + l < n, so the element is inside y; columns c0.. belong to the
        // task running this tile only (see `run_tiles`).
        unsafe { *out.at(i * n + c0 + l) = v };
    }
}

/// Output columns `c0..c1` (multiples of 8) of every row, integer kernels.
fn int_columns(
    w: &QuantWeight,
    acts: &Acts,
    m: usize,
    c0: usize,
    c1: usize,
    out: &OutPtr,
    portable: bool,
) {
    let Body::Int {
        epi,
        gl,
        groups,
        kp,
        ints,
        scales,
        ..
    } = &w.body
    else {
        unreachable!("integer weights")
    };
    let Acts::Int {
        codes,
        scales: xscales,
        ns,
    } = acts
    else {
        unreachable!("integer activations")
    };
    let (kp, gl, groups, ns) = (*kp, *gl, *groups, *ns);
    let portable = portable || !qkern::simd_group_ok(gl);
    let panel = (PANEL_BYTES / kp).next_multiple_of(8).max(8);
    // MR activation rows by NR weight rows starting at column j.
    fn run<const MR: usize, const NR: usize>(
        tile: IntTile,
        x: [&[i16]; MR],
        xs: [&[f32]; MR],
        portable: bool,
    ) -> [f32; 8] {
        if portable {
            qkern::portable::int_tile::<MR, NR>(&tile, x, xs)
        } else {
            qkern::imp::int_tile::<MR, NR>(&tile, x, xs)
        }
    }
    let tile = |j: usize, nr: usize| IntTile {
        w: &ints[j * kp..(j + nr) * kp],
        kp,
        gl,
        groups,
        wscales: &scales[(j / 8) * groups * 8..][..groups * 8],
        wlane: j % 8,
        epi: *epi,
    };
    let x = |i: usize| &codes[i * kp..(i + 1) * kp];
    let xs = |i: usize| &xscales[i * ns..(i + 1) * ns];
    for p0 in (c0..c1).step_by(panel) {
        let p1 = (p0 + panel).min(c1);
        let mut i = 0;
        while i < m {
            match m - i {
                1 => {
                    for j in (p0..p1).step_by(8) {
                        let v = run::<1, 8>(tile(j, 8), [x(i)], [xs(i)], portable);
                        store(out, w.n, i, j, &v);
                    }
                    i += 1;
                }
                2 | 3 => {
                    for j in (p0..p1).step_by(4) {
                        let v =
                            run::<2, 4>(tile(j, 4), [x(i), x(i + 1)], [xs(i), xs(i + 1)], portable);
                        store(out, w.n, i, j, &v[..4]);
                        store(out, w.n, i + 1, j, &v[4..]);
                    }
                    i += 2;
                }
                _ => {
                    for j in (p0..p1).step_by(2) {
                        let v = run::<4, 2>(
                            tile(j, 2),
                            std::array::from_fn(|r| x(i + r)),
                            std::array::from_fn(|r| xs(i + r)),
                            portable,
                        );
                        for r in 0..4 {
                            store(out, w.n, i + r, j, &v[r * 2..r * 2 + 2]);
                        }
                    }
                    i += 4;
                }
            }
        }
    }
}

/// What the float tiles of one matmul read and where they write.
struct FloatJob<'a> {
    n: usize,
    k: usize,
    panels: &'a [u16],
    /// FP8 scales (weight rows, activation rows); `None` for `a16`.
    fp8: Option<(&'a [f32], &'a [f32])>,
    vals: &'a [f32],
    out: &'a OutPtr,
    portable: bool,
}

impl FloatJob<'_> {
    fn tile<const MR: usize, const P: usize>(&self, i: usize, q: usize) {
        let (k, panels) = (self.k, &self.panels[q * self.k * 8..(q + P) * self.k * 8]);
        let x = std::array::from_fn(|r| &self.vals[(i + r) * k..(i + r + 1) * k]);
        let t = if self.portable {
            qkern::portable::float_tile::<MR, P>(panels, k, x)
        } else {
            qkern::imp::float_tile::<MR, P>(panels, k, x)
        };
        for (r, row) in t.iter().enumerate() {
            for (p, lanes) in row.iter().enumerate() {
                let mut v = *lanes;
                if let Some((ws, xs)) = self.fp8 {
                    for (l, v) in v.iter_mut().enumerate() {
                        *v *= xs[i + r] * ws[(q + p) * 8 + l];
                    }
                }
                store(self.out, self.n, i + r, (q + p) * 8, &v);
            }
        }
    }

    /// Rows `i..i + MR` by panels `q0..q1`, `P` panels per call and the rest one at a time.
    fn rows<const MR: usize, const P: usize>(&self, i: usize, q0: usize, q1: usize) {
        let mut q = q0;
        while q + P <= q1 {
            self.tile::<MR, P>(i, q);
            q += P;
        }
        for q in q..q1 {
            self.tile::<MR, 1>(i, q);
        }
    }
}

/// Output columns `c0..c1` (multiples of 8) of every row, float kernels.
fn float_columns(
    w: &QuantWeight,
    acts: &Acts,
    m: usize,
    c0: usize,
    c1: usize,
    out: &OutPtr,
    portable: bool,
) {
    let Body::Float {
        fp8,
        panels,
        scales: wscales,
    } = &w.body
    else {
        unreachable!("float weights")
    };
    let Acts::Float {
        vals,
        scales: xscales,
    } = acts
    else {
        unreachable!("float activations")
    };
    let job = FloatJob {
        n: w.n,
        k: w.k,
        panels,
        fp8: fp8.then_some((wscales.as_slice(), xscales.as_slice())),
        vals,
        out,
        portable,
    };
    let panel = (PANEL_BYTES / (16 * w.k)).max(1);
    for q0 in (c0 / 8..c1 / 8).step_by(panel) {
        let q1 = (q0 + panel).min(c1 / 8);
        let mut i = 0;
        while i < m {
            // Eight independent accumulator chains per call, whatever the rows left.
            let mr = match m - i {
                1 => 1,
                2 | 3 => 2,
                4..=7 => 4,
                _ => 8,
            };
            match mr {
                1 => job.rows::<1, 8>(i, q0, q1),
                2 => job.rows::<2, 4>(i, q0, q1),
                4 => job.rows::<4, 2>(i, q0, q1),
                _ => job.rows::<8, 1>(i, q0, q1),
            }
            i += mr;
        }
    }
}

#[cfg(test)]
#[path = "quant_tests.rs"]
mod tests;
