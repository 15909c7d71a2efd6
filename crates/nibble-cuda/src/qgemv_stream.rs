//! The W4A16 decode gemv fed by TMA bulk copies (kernels/qgemv_stream.cu, sm_90a): its launch
//! plan, entry names and launch. `qlinear` routes W4A16 decode sizes here on Hopper; the
//! register-streamed decode gemv of kernels/qgemv.cu stays the fallback.

use nibble_core::Result;

use crate::context::{CudaContext, SPLIT_COUNTERS};
use crate::runtime::Arg;
use crate::tensor::Elem;

/// `tile x chunk` units (512 bytes of codes each) a stage streams.
const STAGE_UNITS: usize = 64;
/// Ring bytes a stage takes: its codes and, at most, one 64-byte group parameter row a unit.
const STAGE_BYTES: usize = STAGE_UNITS * (512 + 64);
/// Ring slots: the kernel's `TS_MAX_SLOTS`, and the fewest that still overlap copy and math.
const MAX_SLOTS: usize = 5;
const MIN_SLOTS: usize = 2;
/// Dynamic shared memory a CTA may take (an sm_90 SM has 227 KB; the barriers are static).
const SMEM_LIMIT: usize = 227 * 1024 - 256;
/// Units a CTA's range is a multiple of: a consumer warp's batch, which never straddles a tile.
const BATCH: usize = 4;
/// Threads a CTA: 16 consumer warps and the producer warp.
const THREADS: u32 = 17 * 32;
/// Tokens the kernel takes (one 8-token MMA tile).
pub const MAX_TOKENS: usize = 8;

/// Launch plan of the stream.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct StreamPlan {
    /// CTAs, at most one per SM.
    pub ctas: usize,
    /// Units per CTA, a multiple of 4.
    pub per_cta: usize,
    /// The most CTAs a tile's units are cut between: partial-sum slots per tile.
    pub max_pieces: usize,
    /// Ring bytes (slots of [`STAGE_BYTES`]).
    pub ring_bytes: usize,
    /// Dynamic shared memory: the ring, the activations, their span sums, the partial sums.
    pub smem: usize,
}

/// The plan for `m` tokens over `tiles` 16-row tiles of `chunks` 64-channel chunks, scales applied
/// every `span` chunks (1 for groups of 64, else 2), or `None` where the kernel does not apply.
pub fn plan(tiles: usize, chunks: usize, span: usize, sms: usize, m: usize) -> Option<StreamPlan> {
    if m == 0 || m > MAX_TOKENS || !chunks.is_multiple_of(BATCH) || tiles > SPLIT_COUNTERS {
        return None;
    }
    let units = tiles * chunks;
    let per_cta = units
        .div_ceil(sms.max(1))
        .next_multiple_of(BATCH)
        .max(BATCH);
    // The most tiles a CTA's range touches: whole ones plus a piece at each end.
    let local_tiles = per_cta.div_ceil(chunks) + 1;
    let k = chunks * 64;
    let fixed = m * (2 * k + 16) + chunks / span * 8 * 4 + local_tiles * 16 * 16 * m * 4;
    let slots = (SMEM_LIMIT.checked_sub(fixed)? / STAGE_BYTES).min(MAX_SLOTS);
    (slots >= MIN_SLOTS).then_some(StreamPlan {
        ctas: units.div_ceil(per_cta),
        per_cta,
        max_pieces: chunks.div_ceil(per_cta) + 1,
        ring_bytes: slots * STAGE_BYTES,
        smem: slots * STAGE_BYTES + fixed,
    })
}

/// The entry for groups of 64 (`g64`) or larger, with an output in the model dtype (`out_half`,
/// dtype suffix `sfx`) or f32.
pub fn kernel_name(g64: bool, out_half: bool, sfx: &str) -> String {
    let h = if out_half { "_h" } else { "" };
    let g = if g64 { "_g64" } else { "" };
    format!("w4a16_tdec{h}{g}_{sfx}")
}

/// Launches the stream: `head` are the decode gemv's pointer arguments before the partial sums
/// (codes, params, x, ldx, y, ldy), `ints` its integers after the counters (m, n, k, tiles, chunks,
/// groups, group_len, group_shift).
pub(crate) fn launch(
    ctx: &CudaContext,
    name: &str,
    mut args: Vec<Arg>,
    ints: Vec<Arg>,
    tiles: usize,
    m: usize,
    plan: StreamPlan,
) -> Result<()> {
    let partial = if plan.max_pieces > 1 {
        ctx.alloc(tiles * plan.max_pieces * m, 16, Elem::F32)?.ptr
    } else {
        0
    };
    args.push(Arg::Ptr(partial));
    args.push(Arg::Ptr(ctx.split_counters()));
    args.extend(ints);
    args.push(Arg::I32(plan.per_cta as i32));
    args.push(Arg::I32(plan.max_pieces as i32));
    args.push(Arg::I32(plan.ring_bytes as i32));
    // Its bulk copies start before the previous kernel ends (compile::GRID_WAITING_KERNELS).
    ctx.launch_block(
        name,
        (plan.ctas as u32, 1, 1),
        THREADS,
        plan.smem as u32,
        args,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_cover_the_units_in_whole_batches_and_fit_shared_memory() {
        for (tiles, chunks) in [
            (1792, 64),
            (256, 224),
            (384, 64),
            (256, 64),
            (8016, 64),
            (3, 4),
        ] {
            for span in [1, 2] {
                for m in 1..=MAX_TOKENS {
                    let Some(p) = plan(tiles, chunks, span, 132, m) else {
                        // Only several tokens run out of shared memory (activations and partial
                        // sums: an output head's 62 tiles a CTA past 2 tokens).
                        assert!(m > 2, "{tiles}x{chunks} m {m}");
                        continue;
                    };
                    let units = tiles * chunks;
                    assert!(p.per_cta.is_multiple_of(BATCH) && p.ctas <= 132);
                    assert!(p.ctas * p.per_cta >= units && (p.ctas - 1) * p.per_cta < units);
                    assert!(p.smem <= SMEM_LIMIT && p.ring_bytes >= MIN_SLOTS * STAGE_BYTES);
                    for t in 0..tiles {
                        let (first, last) =
                            (t * chunks / p.per_cta, ((t + 1) * chunks - 1) / p.per_cta);
                        assert!(last - first < p.max_pieces, "{tiles}x{chunks} tile {t}");
                    }
                    // Every CTA's tiles fit the partial sums the plan sized.
                    for c in 0..p.ctas {
                        let (u0, u1) = (c * p.per_cta, ((c + 1) * p.per_cta).min(units));
                        let touched = (u1 - 1) / chunks - u0 / chunks + 1;
                        assert!(touched <= p.per_cta.div_ceil(chunks) + 1);
                    }
                }
            }
        }
        // Llama-3-8B's gate/up at one token: the whole ring.
        let p = plan(1792, 64, 2, 132, 1).unwrap();
        assert_eq!(
            (p.ctas, p.per_cta, p.ring_bytes),
            (132, 872, 5 * STAGE_BYTES)
        );
        assert!(plan(1792, 64, 2, 132, 0).is_none());
        assert!(plan(1792, 64, 2, 132, 9).is_none());
        assert!(plan(1792, 66, 2, 132, 1).is_none());
    }

    #[test]
    fn names_follow_the_entry_macros() {
        assert_eq!(kernel_name(false, true, "bf16"), "w4a16_tdec_h_bf16");
        assert_eq!(kernel_name(true, false, "f16"), "w4a16_tdec_g64_f16");
    }
}
