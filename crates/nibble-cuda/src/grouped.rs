//! Grouped expert GEMMs: the routed experts of a mixture-of-experts layer in one launch, each
//! over its own run of rows of an input gathered in expert order, f32 products in the same rows.
//!
//! | experts' weights | kernel | rows an item |
//! |---|---|---|
//! | W4A16, groups of 64, a power of two past it or a whole row | `w4a16_gdec{1,2}[_g64]` (sm_90, kernels/qgemv_grouped.cu) | 16 |
//! | the same, 17 to 32 rows an expert | `w4a16_gdec4[_g64]` (sm_90) | 32 |
//! | the same past 32 rows, other groups, or the mma.sync tier | `w4a16_grouped{1,2,4,8}` (kernels/qgemm.cu) | 64 |
//! | W8A8, W4A8, FP8 | `{w8a8,w4a8,fp8}_gdec{1,2,4}` (W4A8 in groups of 32: `w4a8_gdec{1,2,4}_g32`; sm_90) | 32 |
//! | 16-bit (the model dtype) | `b16_gdec{1,2}` (sm_90) | 16 |
//!
//! The `gdec` kernels are the persistent decode gemv (kernels/qgemv.cu) over an item table: the
//! grid is `items x ctas_per_item` CTAs, each one item's stream-K slice, and [`plan`] sizes the
//! slices so the launch fills whole waves of SMs. An expert routed more rows than an item takes
//! runs as several items (its weights read once each). Input widths must be multiples of 256.

use nibble_core::{Error, Result};

use crate::context::{CudaContext, KernelTier, SPLIT_COUNTERS, StepUpload};
use crate::qlinear::{
    self, Act8, DECODE_BATCH as BATCH, DECODE_BLOCK_TILES as BLOCK_TILES, DECODE_MAX_M,
    DECODE_MAX_M_INT8, DECODE_SMEM, QFamily, QKernel, QuantWeight, gemv_smem, token_tiles,
};
use crate::runtime::Arg;
use crate::tensor::{CudaTensor, CudaWeight, Dtype, Elem, WeightData};

/// Most rows an item of the mma.sync grouped gemv takes: its 64-token variant.
pub const GROUPED_MMA_MAX_M: usize = 64;

/// One item of a grouped launch as the kernels read it (`GroupedItem` in kernels/qgemm.cu).
#[repr(C)]
#[derive(Clone, Copy)]
struct GroupedItem {
    codes: u64,
    params: u64,
    scales: u64,
    row: i64,
    m: i32,
    pad: i32,
}
const _: () = assert!(std::mem::size_of::<GroupedItem>() == 40);

/// One expert's GEMM in a grouped launch: its weight, and the run of rows of the gathered input
/// (`first..first + rows`) it multiplies; its products go to the same rows of the output.
#[derive(Clone, Copy)]
pub struct GroupedRun<'a> {
    pub weight: &'a CudaWeight,
    pub first: usize,
    pub rows: usize,
}

/// Consecutive runs of rows, one per `(weight, rows)` in order, from row 0: the experts' rows as
/// gathered in expert order.
pub fn runs_in_order<'a>(
    parts: impl IntoIterator<Item = (&'a CudaWeight, usize)>,
) -> Vec<GroupedRun<'a>> {
    let mut first = 0;
    parts
        .into_iter()
        .map(|(weight, rows)| {
            let run = GroupedRun {
                weight,
                first,
                rows,
            };
            first += rows;
            run
        })
        .collect()
}

/// What every expert of a grouped launch shares: the family and the packed geometry.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Geometry {
    W4A16 {
        group_len: usize,
        groups: usize,
        tiles: usize,
        chunks: usize,
    },
    /// INT8 codes made 16-bit in registers, 16-bit activations.
    W8A16 {
        tiles: usize,
        chunks: usize,
    },
    /// W8A8, W4A8 or FP8: 8-bit activations.
    Act8 {
        family: QFamily,
        groups: usize,
        group_shift: u32,
        tiles: usize,
        chunks: usize,
    },
    Dense {
        dtype: Dtype,
    },
}

/// `None` for a SwiGLU or COMET weight, which no grouped kernel reads.
fn geometry(w: &CudaWeight) -> Option<Geometry> {
    Some(match &w.data {
        WeightData::Dense(_) => Geometry::Dense { dtype: w.dtype },
        WeightData::SwiGlu(_) | WeightData::Comet(_) | WeightData::DenseSwiGlu(_) => return None,
        WeightData::Quant(q) => match *q {
            QuantWeight::W4 {
                group_len,
                tiles,
                chunks,
                groups,
                ..
            } => Geometry::W4A16 {
                group_len,
                groups,
                tiles,
                chunks,
            },
            QuantWeight::W8A16 { tiles, chunks, .. } => Geometry::W8A16 { tiles, chunks },
            QuantWeight::W8 { tiles, chunks, .. } => Geometry::Act8 {
                family: QFamily::W8A8,
                groups: 0,
                group_shift: 0,
                tiles,
                chunks,
            },
            QuantWeight::Fp8 { tiles, chunks, .. } => Geometry::Act8 {
                family: QFamily::Fp8,
                groups: 0,
                group_shift: 0,
                tiles,
                chunks,
            },
            QuantWeight::W4A8 {
                tiles,
                chunks,
                groups,
                group_shift,
                ..
            } => Geometry::Act8 {
                family: QFamily::W4A8,
                groups,
                group_shift,
                tiles,
                chunks,
            },
        },
    })
}

/// The kernel a grouped GEMM runs.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum GroupedKernel {
    /// The grouped persistent decode gemv, items of at most `item_rows` rows.
    Decode { item_rows: usize },
    /// The mma.sync grouped gemv (W4A16 only).
    MmaSync,
}

/// Most rows a W4A16 expert takes in one item of the grouped decode gemv: its four-token-tile
/// entries (`w4a16_gdec4`), for 17 to 32 rows an expert (up to 128 tokens of an evenly routed
/// top-2-of-8 layer).
pub const W4A16_WIDE_ROWS: usize = 32;

/// The kernel that runs these experts' GEMMs of at most `max_rows` rows each in one launch, if
/// any: all of one shape and geometry, a geometry with a grouped kernel compiled for this GPU,
/// and the [`KernelTier`] allowing it. Auto takes the decode gemv for W4A16 up to
/// [`W4A16_WIDE_ROWS`] rows an expert and the mma.sync gemv past that (where splitting would read
/// the weights twice).
pub fn pick(ctx: &CudaContext, weights: &[&CudaWeight], max_rows: usize) -> Option<GroupedKernel> {
    let first = weights.first()?;
    let geo = geometry(first)?;
    let same = weights
        .iter()
        .all(|w| (w.rows, w.cols) == (first.rows, first.cols) && geometry(w) == Some(geo));
    if !same {
        return None;
    }
    let (n, k) = (first.rows, first.cols);
    let tier = ctx.tier();
    let whole_batches = k.is_multiple_of(64 * BATCH);
    let decode = |item_rows: usize| {
        let name = kernel_name(geo, token_tiles(item_rows), ctx.dtype);
        (tier != KernelTier::MmaSync && whole_batches && ctx.has_kernel(&name))
            .then_some(GroupedKernel::Decode { item_rows })
    };
    match geo {
        Geometry::W4A16 {
            group_len, groups, ..
        } => {
            // Items of 16 rows, or of 32 (four token tiles) where an expert has more.
            let item_rows = if max_rows <= DECODE_MAX_M {
                DECODE_MAX_M
            } else {
                W4A16_WIDE_ROWS
            };
            let decode = qlinear::w4_decode_kernel(group_len, groups)
                .and_then(|_| decode(item_rows))
                .filter(|_| max_rows <= W4A16_WIDE_ROWS || tier == KernelTier::Hopper);
            decode.or(Some(GroupedKernel::MmaSync))
        }
        Geometry::W8A16 { .. } => decode(DECODE_MAX_M),
        Geometry::Act8 { .. } => decode(DECODE_MAX_M_INT8),
        Geometry::Dense { dtype } => {
            // The kernel reads whole 16-byte rows of the model dtype.
            (dtype == ctx.dtype && n > 0)
                .then(|| decode(DECODE_MAX_M))
                .flatten()
        }
    }
}

/// The `gdec` entry point of `geo` for `tt` tiles of 8 rows.
fn kernel_name(geo: Geometry, tt: usize, dtype: Dtype) -> String {
    let sfx = dtype.suffix();
    match geo {
        Geometry::W4A16 { group_len, .. } => {
            let g64 = if group_len == 64 { "_g64" } else { "" };
            format!("w4a16_gdec{tt}{g64}_{sfx}")
        }
        Geometry::Act8 {
            family,
            group_shift,
            ..
        } => {
            let p = match family {
                QFamily::W8A8 => "w8a8",
                QFamily::Fp8 => "fp8",
                _ => "w4a8",
            };
            // W4A8 in groups of 32: two parameter pairs a chunk (qlinear::w4a8_decode_kernel).
            let g32 = if family == QFamily::W4A8
                && qlinear::w4a8_decode_kernel(group_shift) == QKernel::DecodeG32
            {
                "_g32"
            } else {
                ""
            };
            format!("{p}_gdec{tt}{g32}")
        }
        Geometry::W8A16 { .. } => format!("w8a16_gdec{tt}_{sfx}"),
        Geometry::Dense { .. } => format!("b16_gdec{tt}_{sfx}"),
    }
}

/// Launch plan of a grouped decode gemv.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct GroupedPlan {
    /// CTAs per item: the grid is `items x ctas_per_item`.
    pub ctas_per_item: usize,
    /// `row block x chunk` units per CTA, a multiple of the register batch.
    pub per_cta: usize,
    /// The most CTAs a row block's units are cut between: partial-sum slots per tile.
    pub max_pieces: usize,
    /// Dynamic shared memory: a CTA's window of activation chunks (and W4A16's sums).
    pub smem: usize,
}

/// The plan of `items` items of at most `max_m` rows of `elem`-byte activations (W4A16 staging
/// activation sums too: `sums`) over `tiles` 16-row tiles of `chunks` 64-channel chunks: the
/// fewest waves of `sms` CTAs whose activation windows fit in [`DECODE_SMEM`], each item's units
/// cut into equal slices, slices as even as the waves allow. `None` where no window fits.
pub fn plan(
    items: usize,
    tiles: usize,
    chunks: usize,
    sms: usize,
    max_m: usize,
    elem: usize,
    sums: bool,
) -> Option<GroupedPlan> {
    if items == 0 || max_m == 0 || chunks == 0 || !chunks.is_multiple_of(BATCH) {
        return None;
    }
    let sms = sms.max(1);
    // The window's rows as the gemv pads them, and W4A16's f32 sums per span and token row.
    let smem = |window: usize| {
        let sums = if sums {
            window * token_tiles(max_m) * 32
        } else {
            0
        };
        gemv_smem(max_m, window, 64 * elem) + sums
    };
    // The largest window (a multiple of the batch) that fits; a CTA whose slice is shorter than a
    // row stages only its slice.
    let cap = if smem(chunks) <= DECODE_SMEM {
        usize::MAX
    } else {
        (BATCH..chunks)
            .step_by(BATCH)
            .take_while(|&w| smem(w) <= DECODE_SMEM)
            .last()?
    };
    let units = tiles.div_ceil(BLOCK_TILES) * chunks;
    let total = items * units;
    let mut waves = if cap == usize::MAX {
        1
    } else {
        total.div_ceil(sms * cap).max(1)
    };
    loop {
        let mut per_cta = total
            .div_ceil(waves * sms)
            .next_multiple_of(BATCH)
            .max(BATCH);
        while per_cta <= cap && items * units.div_ceil(per_cta) > waves * sms {
            per_cta += BATCH;
        }
        if per_cta <= cap {
            let per_cta = per_cta.min(units.next_multiple_of(BATCH));
            return Some(GroupedPlan {
                ctas_per_item: units.div_ceil(per_cta),
                per_cta,
                max_pieces: chunks.div_ceil(per_cta) + 1,
                smem: smem(per_cta.min(chunks)),
            });
        }
        waves += 1;
    }
}

/// The GEMMs of `runs` (one per routed expert, as [`pick`] accepts them) in one launch: `x` holds
/// every run's input rows, `out` (f32, `[x.rows, n]`) gets each run's products in the same rows.
pub fn grouped_gemm(
    ctx: &CudaContext,
    x: &CudaTensor,
    runs: &[GroupedRun<'_>],
    out: &CudaTensor,
) -> Result<()> {
    let mut up = StepUpload::default();
    let gemm = GroupedGemm::new(ctx, x.rows, runs, &mut up)?;
    let tables = ctx.stage_upload_all(&up)?;
    gemm.launch(ctx, tables, x, out)
}

/// A grouped GEMM whose item table is made and queued in a [`StepUpload`]: a layer puts its
/// grouped GEMMs' tables (and its gather indices) on the device in one copy ahead of its kernels,
/// so that those kernels follow one another with nothing between them and each may start its
/// weight loads while the previous one finishes (they read their table before the grid
/// dependency: programmatic dependent launch).
pub struct GroupedGemm {
    kernel: GroupedKernel,
    geo: Geometry,
    items: Vec<GroupedItem>,
    rows: usize,
    n: usize,
    k: usize,
    /// Byte offset of the item table in the upload.
    table_at: usize,
}

impl GroupedGemm {
    /// The item table of `runs` over an input of `rows` rows, pushed onto `up`.
    pub fn new(
        ctx: &CudaContext,
        rows: usize,
        runs: &[GroupedRun<'_>],
        up: &mut StepUpload,
    ) -> Result<GroupedGemm> {
        ctx.check_err()?;
        let weights: Vec<&CudaWeight> = runs.iter().map(|r| r.weight).collect();
        let max_rows = runs.iter().map(|r| r.rows).max().unwrap_or(0);
        let (Some(first), Some(kernel)) = (runs.first(), pick(ctx, &weights, max_rows)) else {
            return Err(Error::InvalidArgument(format!(
                "a grouped GEMM of {} experts: weights of one shape and a format with a grouped \
                 kernel on this GPU, input width a multiple of 256",
                runs.len()
            )));
        };
        if let Some(r) = runs.iter().find(|r| r.first + r.rows > rows) {
            return Err(Error::InvalidArgument(format!(
                "grouped GEMM: rows {}..{} of {rows}",
                r.first,
                r.first + r.rows,
            )));
        }
        let item_rows = match kernel {
            GroupedKernel::Decode { item_rows } => item_rows,
            GroupedKernel::MmaSync => GROUPED_MMA_MAX_M,
        };
        let geo = geometry(first.weight).ok_or_else(|| {
            Error::InvalidArgument("grouped GEMM of a SwiGLU or COMET weight".into())
        })?;
        let items = items(runs, item_rows)?;
        Ok(GroupedGemm {
            kernel,
            geo,
            table_at: up.push(&items),
            items,
            rows,
            n: first.weight.rows,
            k: first.weight.cols,
        })
    }

    /// Runs it: `x` `[rows, k]`, `out` f32 `[rows, n]`; `tables` is where its upload went
    /// ([`CudaContext::stage_upload_all`]).
    pub fn launch(
        &self,
        ctx: &CudaContext,
        tables: u64,
        x: &CudaTensor,
        out: &CudaTensor,
    ) -> Result<()> {
        let (n, k) = (self.n, self.k);
        if x.cols != k || x.rows != self.rows {
            return Err(Error::InvalidArgument(format!(
                "grouped GEMM: a [{}, {}] input for {} rows of {k}",
                x.rows, x.cols, self.rows
            )));
        }
        if out.elem != Elem::F32 || out.rows != x.rows || out.cols != n || !out.is_contiguous() {
            return Err(Error::InvalidArgument(format!(
                "grouped GEMM: a [{}, {}] {:?} output for {} rows of {n}",
                out.rows, out.cols, out.elem, x.rows
            )));
        }
        if self.items.is_empty() {
            return Ok(());
        }
        let table = tables + self.table_at as u64;
        match self.kernel {
            GroupedKernel::Decode { .. } => launch_decode(ctx, self, table, x, out),
            GroupedKernel::MmaSync => launch_mma_sync(ctx, self, table, x, out),
        }
    }
}

/// The item table: each run cut into items of at most `item_rows` rows.
fn items(runs: &[GroupedRun<'_>], item_rows: usize) -> Result<Vec<GroupedItem>> {
    let mut items = Vec::new();
    for r in runs {
        let (codes, params, scales) = match &r.weight.data {
            WeightData::Dense(b) => (b.ptr, 0, 0),
            WeightData::SwiGlu(_) | WeightData::Comet(_) | WeightData::DenseSwiGlu(_) => {
                return Err(Error::InvalidArgument(
                    "grouped GEMM of a SwiGLU or COMET weight".into(),
                ));
            }
            WeightData::Quant(QuantWeight::W4 { codes, params, .. }) => (codes.ptr, params.ptr, 0),
            WeightData::Quant(
                QuantWeight::W8 { codes, scales, .. }
                | QuantWeight::W8A16 { codes, scales, .. }
                | QuantWeight::Fp8 { codes, scales, .. },
            ) => (codes.ptr, 0, scales.ptr),
            WeightData::Quant(QuantWeight::W4A8 {
                codes,
                params,
                scales,
                ..
            }) => (codes.ptr, params.ptr, scales.ptr),
        };
        items.extend(
            cuts(r.first, r.rows, item_rows).map(|(row, m)| GroupedItem {
                codes,
                params,
                scales,
                row: row as i64,
                m: m as i32,
                pad: 0,
            }),
        );
    }
    Ok(items)
}

/// Rows `first..first + rows` as `(first row, rows)` pieces of at most `item_rows`.
fn cuts(first: usize, rows: usize, item_rows: usize) -> impl Iterator<Item = (usize, usize)> {
    (first..first + rows)
        .step_by(item_rows.max(1))
        .map(move |row| (row, (first + rows - row).min(item_rows)))
}

fn launch_decode(
    ctx: &CudaContext,
    gemm: &GroupedGemm,
    table: u64,
    x: &CudaTensor,
    out: &CudaTensor,
) -> Result<()> {
    let GroupedGemm {
        geo, items, n, k, ..
    } = gemm;
    let (geo, items, n, k) = (*geo, items.as_slice(), *n, *k);
    let (tiles, chunks) = (n.div_ceil(16), k / 64);
    let max_m = items.iter().map(|i| i.m as usize).max().unwrap_or(1);
    let (elem, sums) = match geo {
        Geometry::W4A16 { .. } => (2, true),
        Geometry::W8A16 { .. } | Geometry::Dense { .. } => (2, false),
        Geometry::Act8 { .. } => (1, false),
    };
    let plan = plan(
        items.len(),
        tiles,
        chunks,
        ctx.gpu.sm_count,
        max_m,
        elem,
        sums,
    )
    .ok_or_else(|| {
        Error::InvalidArgument(format!(
            "grouped GEMM: no activation window of {max_m} rows of {k} fits"
        ))
    })?;
    if items.len() * tiles > SPLIT_COUNTERS || items.len() * plan.ctas_per_item > i32::MAX as usize
    {
        return Err(Error::InvalidArgument(format!(
            "grouped GEMM: {} items of {tiles} tiles exceed the split counters",
            items.len()
        )));
    }
    // The input: 16-bit rows, or their 8-bit codes and per-row scales.
    let (xp, ldx, sx) = match geo {
        Geometry::Act8 { family, .. } => {
            let kind = if family == QFamily::Fp8 {
                Act8::Fp8
            } else {
                Act8::Int8
            };
            let q = qlinear::act8_input(ctx, x, k, kind)?;
            (q.codes, k, q.scales)
        }
        _ => {
            let xh = qlinear::half_input(ctx, x, "grouped")?;
            (xh.ptr, xh.ld, 0)
        }
    };
    let (groups, shift) = match geo {
        Geometry::W4A16 {
            group_len, groups, ..
        } => (groups, group_len.trailing_zeros()),
        Geometry::Act8 {
            groups,
            group_shift,
            ..
        } => (groups, group_shift),
        Geometry::W8A16 { .. } | Geometry::Dense { .. } => (0, 0),
    };
    let partial = ctx
        .alloc(items.len() * tiles * plan.max_pieces * max_m, 16, Elem::F32)?
        .ptr;
    let tt = token_tiles(max_m);
    let mut args = vec![
        Arg::Ptr(table),
        Arg::I32(plan.ctas_per_item as i32),
        Arg::Ptr(xp),
        Arg::I64(ldx as i64),
        Arg::Ptr(sx),
        Arg::Ptr(out.ptr),
        Arg::I64(out.ld as i64),
        Arg::Ptr(partial),
        Arg::Ptr(ctx.split_counters()),
    ];
    args.extend([max_m, n, k, tiles, chunks, groups, shift as usize].map(|v| Arg::I32(v as i32)));
    args.push(Arg::I32(plan.per_cta as i32));
    args.push(Arg::I32(plan.max_pieces as i32));
    ctx.count_grouped_launch();
    ctx.launch_block(
        &kernel_name(geo, tt, ctx.dtype),
        ((items.len() * plan.ctas_per_item) as u32, 1, 1),
        32 * BLOCK_TILES as u32,
        plan.smem as u32,
        args,
    )
}

fn launch_mma_sync(
    ctx: &CudaContext,
    gemm: &GroupedGemm,
    table: u64,
    x: &CudaTensor,
    out: &CudaTensor,
) -> Result<()> {
    let (items, n, k) = (gemm.items.as_slice(), gemm.n, gemm.k);
    let Geometry::W4A16 {
        group_len,
        tiles,
        chunks,
        groups,
    } = gemm.geo
    else {
        return Err(Error::InvalidArgument(
            "the mma.sync grouped gemv takes W4A16 weights".into(),
        ));
    };
    let xh = qlinear::half_input(ctx, x, "grouped W4A16")?;
    let max_m = items.iter().map(|i| i.m as usize).max().unwrap_or(1);
    let tt = token_tiles(max_m);
    let (_, splits, cps) =
        qlinear::plan_gemv(tiles * items.len(), chunks, ctx.gpu.sm_count, max_m, 128);
    let blocks = tiles.div_ceil(8);
    if blocks * items.len() > SPLIT_COUNTERS || items.len() > 65535 {
        return Err(Error::InvalidArgument(format!(
            "grouped W4A16 GEMM: {} items of {blocks} row blocks exceed the split counters or \
             the grid",
            items.len()
        )));
    }
    let partial = if splits > 1 {
        ctx.alloc(items.len() * splits * max_m, tiles * 16, Elem::F32)?
            .ptr
    } else {
        0
    };
    let shift = if group_len.is_power_of_two() {
        group_len.trailing_zeros() as i32
    } else {
        -1
    };
    let mut args = vec![
        Arg::Ptr(table),
        Arg::Ptr(xh.ptr),
        Arg::I64(xh.ld as i64),
        Arg::Ptr(out.ptr),
        Arg::I64(out.ld as i64),
        Arg::Ptr(partial),
        Arg::Ptr(ctx.split_counters()),
    ];
    args.extend([max_m, n, k, tiles, chunks, groups, group_len].map(|v| Arg::I32(v as i32)));
    args.push(Arg::I32(shift));
    args.push(Arg::I32(cps as i32));
    ctx.count_grouped_launch();
    ctx.kernel(&mma_sync_name(tt, ctx.dtype))?.launch(
        &ctx.gpu,
        (blocks as u32, splits as u32, items.len() as u32),
        256,
        gemv_smem(max_m, cps, 128) as u32,
        args,
    )
}

/// `x` in the model dtype, rows 16-byte aligned as the kernels read them.
/// The mma.sync grouped gemv's entry point for `tt` tiles of 8 rows.
fn mma_sync_name(tt: usize, dtype: Dtype) -> String {
    format!("w4a16_grouped{tt}_{}", dtype.suffix())
}

/// The kernels [`grouped_gemm`] may launch (for `kernels_compile`).
pub fn kernel_names() -> Vec<String> {
    let w4 = |group_len| Geometry::W4A16 {
        group_len,
        groups: 0,
        tiles: 0,
        chunks: 0,
    };
    let act8 = |family, group_shift| Geometry::Act8 {
        family,
        groups: 0,
        group_shift,
        tiles: 0,
        chunks: 0,
    };
    let mut names = Vec::new();
    for dtype in [Dtype::Bf16, Dtype::F16] {
        for tt in [1, 2] {
            let w8a16 = Geometry::W8A16 {
                tiles: 0,
                chunks: 0,
            };
            for geo in [w4(128), w4(64), w8a16, Geometry::Dense { dtype }] {
                names.push(kernel_name(geo, tt, dtype));
            }
        }
        names.extend([w4(128), w4(64)].map(|geo| kernel_name(geo, 4, dtype)));
        names.extend([1, 2, 4, 8].map(|tt| mma_sync_name(tt, dtype)));
        for (family, group_shift) in [
            (QFamily::W8A8, 0),
            (QFamily::W4A8, 7),
            (QFamily::W4A8, 5),
            (QFamily::Fp8, 0),
        ] {
            names.extend([1, 2, 4].map(|tt| kernel_name(act8(family, group_shift), tt, dtype)));
        }
    }
    names.sort();
    names.dedup();
    names
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_fill_whole_waves_and_fit_the_window() {
        let sms = 132;
        // Mixtral's experts: gate/up 28672x4096 and down 4096x14336, 1 to 16 rows an item.
        for (tiles, chunks) in [(1792, 64), (256, 224), (24, 4), (1, 8)] {
            for items in [1, 2, 3, 5, 8, 16] {
                for (max_m, elem, sums) in [
                    (1, 2, true),
                    (16, 2, true),
                    (32, 2, true),
                    (16, 2, false),
                    (32, 1, false),
                ] {
                    let p = plan(items, tiles, chunks, sms, max_m, elem, sums).unwrap();
                    let units = tiles.div_ceil(16) * chunks;
                    assert_eq!(p.per_cta % BATCH, 0);
                    assert!(p.ctas_per_item * p.per_cta >= units, "{p:?}");
                    assert!((p.ctas_per_item - 1) * p.per_cta < units, "{p:?}");
                    assert!(p.smem <= DECODE_SMEM, "{p:?}");
                    // The row blocks a slice touches bound its pieces.
                    assert!(p.max_pieces > chunks.div_ceil(p.per_cta));
                    let ctas = items * p.ctas_per_item;
                    let waves = ctas.div_ceil(sms);
                    if units * items >= 4 * sms * BATCH {
                        // Large launches: at most one wave more than the window forces, and the
                        // last wave at least half full where more than one is needed.
                        assert!(ctas <= waves * sms, "{p:?}");
                        if waves > 1 {
                            assert!(
                                ctas * 2 > waves * sms,
                                "{items} items {tiles}x{chunks}: {p:?}"
                            );
                        }
                    }
                }
            }
        }
        // Two experts of one row: one wave, nearly every SM.
        let p = plan(2, 1792, 64, sms, 1, 2, true).unwrap();
        assert!(
            2 * p.ctas_per_item <= sms && 2 * p.ctas_per_item >= sms - 8,
            "{p:?}"
        );
        // Eight experts of 16 rows over K = 14336: the window caps the slice, three waves.
        let p = plan(8, 256, 224, sms, 16, 2, true).unwrap();
        assert!(
            p.per_cta < 224 && (8 * p.ctas_per_item).div_ceil(sms) == 3,
            "{p:?}"
        );
        assert!(plan(1, 16, 6, sms, 1, 2, true).is_none());
        assert!(plan(0, 16, 8, sms, 1, 2, true).is_none());
    }

    #[test]
    fn runs_cut_into_items_of_at_most_the_item_rows() {
        let pieces = |first, rows, item| cuts(first, rows, item).collect::<Vec<_>>();
        assert_eq!(pieces(3, 40, 16), [(3, 16), (19, 16), (35, 8)]);
        assert_eq!(pieces(0, 16, 16), [(0, 16)]);
        assert_eq!(pieces(5, 1, 32), [(5, 1)]);
        assert!(pieces(7, 0, 16).is_empty());
    }
}
