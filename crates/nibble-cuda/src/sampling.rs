//! Sampling on the GPU (`kernels/sampling.cu`): the batch's rows are sampled where the head GEMM
//! left the logits, and only token ids, plus the log-probabilities a request asked for, are
//! copied back. The arithmetic is `nibble_model::sampling`'s, so seeded requests draw the same
//! tokens on the CPU and the GPU.

use nibble_core::{Error, Result};
use nibble_model::sampling::{
    PendingSample, SampleSpec, Sampled, TokenLogprobs, additive_deltas, sample_rows,
};

use std::sync::Mutex;

use crate::context::CudaContext;
use crate::host::{Event, PinnedBuffer, copy_to_host};
use crate::runtime::{Arg, DeviceBuffer, DevicePtr};
use crate::tensor::{CudaTensor, Elem};

/// Top alternatives the kernel reports per token (`SAMPLE_TOP` in the kernel); a request for
/// more is sampled on the host from copied logits.
pub const TOP_LOGPROBS: usize = nibble_model::sampling::MAX_TOP_LOGPROBS;
const THREADS: u32 = 1024;

/// One row's parameters, laid out as the kernel's `SampleRow`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct SampleRow {
    seed: u64,
    draw: u64,
    row: i32,
    top_k: i32,
    hist_off: i32,
    hist_len: i32,
    temperature: f32,
    top_p: f32,
    min_p: f32,
    penalty: f32,
    logprobs: i32,
    mask_off: i32,
    delta_off: i32,
    delta_len: i32,
}

/// The kernel's `SampleOut`.
#[repr(C)]
#[derive(Clone, Copy)]
struct SampleOut {
    token: i32,
    logprob: f32,
    n: i32,
    pad: i32,
    ids: [i32; TOP_LOGPROBS],
    lps: [f32; TOP_LOGPROBS],
}

/// Ints per `SampleOut` record: the stride at which the next forward pass reads fed tokens.
pub(crate) const OUT_STRIDE: usize = size_of::<SampleOut>() / 4;

/// Device memory the sampler reuses from call to call (row parameters, outputs, histories,
/// allowed-token masks, additive deltas and the per-row bitsets), grown when a batch needs more, and the page-locked slots its
/// results come back to. The backend owns it rather than the context, since no other op reads
/// it.
#[derive(Default)]
pub(crate) struct SampleScratch {
    buf: Mutex<Option<DeviceBuffer>>,
    slots: Mutex<Slots>,
}

/// Two result slots: step n's results wait in one while step n+1 is queued into the other.
#[derive(Default)]
struct Slots {
    /// Launches so far; launch `g` uses slot `g % 2`.
    launches: u64,
    slot: [Option<Slot>; 2],
    /// Where the latest launch left its records on the device, and how many, while they are
    /// there.
    latest_out: Option<(DevicePtr, usize)>,
}

struct Slot {
    host: PinnedBuffer,
    done: Event,
    /// The launch whose results the slot holds, until collected.
    holds: Option<u64>,
}

/// Queues sampling of `specs`' rows of `logits`; the tokens come from [`collect`]. Requests for
/// more log-probabilities than the kernel reports are sampled on the host, now.
pub(crate) fn launch(
    ctx: &CudaContext,
    scratch: &SampleScratch,
    logits: &CudaTensor,
    vocab: usize,
    specs: &[SampleSpec],
) -> Result<PendingSample> {
    ctx.check_live(logits)?;
    if logits.elem != Elem::F32 || !logits.is_contiguous() || logits.cols != vocab {
        return Err(Error::InvalidArgument(format!(
            "sampling needs f32 logits of {vocab} columns, got {}x{} {:?}",
            logits.rows, logits.cols, logits.elem
        )));
    }
    if let Some(s) = specs.iter().find(|s| s.row >= logits.rows) {
        return Err(Error::InvalidArgument(format!(
            "sampling row {} of a {}-row batch",
            s.row, logits.rows
        )));
    }
    let mut slots = scratch.slots.lock().unwrap_or_else(|p| p.into_inner());
    slots.latest_out = None;
    if specs.is_empty() {
        return Ok(PendingSample::Ready(Vec::new()));
    }
    if specs
        .iter()
        .any(|s| s.logprobs.is_some_and(|n| n > TOP_LOGPROBS))
    {
        let host = ctx.to_host(logits)?;
        return sample_rows(&host, vocab, specs).map(PendingSample::Ready);
    }
    let too_big = |what: &str, v: usize| Error::LimitExceeded {
        what: format!("{what} for GPU sampling"),
        value: v,
        limit: i32::MAX as usize,
    };
    let words = vocab.div_ceil(32);
    if let Some(s) = specs
        .iter()
        .find(|s| s.allowed.is_some_and(|m| m.len() != words))
    {
        return Err(Error::InvalidArgument(format!(
            "an allowed-token mask of {} words for a vocabulary of {vocab} ({words} words)",
            s.allowed.map_or(0, <[u32]>::len)
        )));
    }
    let mut rows = Vec::with_capacity(specs.len());
    let mut history: Vec<u32> = Vec::new();
    let mut masks: Vec<u32> = Vec::new();
    let mut delta_ids: Vec<u32> = Vec::new();
    let mut delta_vals: Vec<f32> = Vec::new();
    for s in specs {
        let p = s.params;
        let deltas = additive_deltas(p, s.output, vocab);
        let delta_off = i32::try_from(delta_ids.len())
            .map_err(|_| too_big("logit adjustments", delta_ids.len()))?;
        delta_ids.extend(deltas.iter().map(|d| d.0));
        delta_vals.extend(deltas.iter().map(|d| d.1));
        let mask_off = match s.allowed {
            Some(m) => {
                let off = i32::try_from(masks.len()).map_err(|_| too_big("masks", masks.len()))?;
                masks.extend_from_slice(m);
                off
            }
            None => -1,
        };
        rows.push(SampleRow {
            seed: s.seed,
            draw: s.draw,
            row: s.row as i32,
            top_k: i32::try_from(p.top_k.min(vocab)).map_err(|_| too_big("top_k", p.top_k))?,
            hist_off: i32::try_from(history.len())
                .map_err(|_| too_big("history", history.len()))?,
            hist_len: if p.repetition_penalty == 1.0 {
                0
            } else {
                s.history.len() as i32
            },
            temperature: p.temperature,
            top_p: p.top_p,
            min_p: p.min_p,
            penalty: p.repetition_penalty,
            logprobs: s.logprobs.map_or(-1, |n| n as i32),
            mask_off,
            delta_off,
            delta_len: deltas.len() as i32,
        });
        if p.repetition_penalty != 1.0 {
            history.extend_from_slice(s.history);
        }
    }
    let n = specs.len();
    let rows_bytes = n * size_of::<SampleRow>();
    let out_bytes = n * size_of::<SampleOut>();
    let padded = |len: usize| (len * 4).div_ceil(16) * 16;
    let hist_bytes = padded(history.len());
    let mask_bytes = padded(masks.len());
    let ids_bytes = padded(delta_ids.len());
    let vals_bytes = padded(delta_vals.len());
    // Two bitsets per row: the history's and the tokens that have a delta.
    let bits_bytes = if history.is_empty() && delta_ids.is_empty() {
        0
    } else {
        n * 2 * words * 4
    };
    let need =
        rows_bytes + out_bytes + hist_bytes + mask_bytes + ids_bytes + vals_bytes + bits_bytes;

    let mut buf = scratch.buf.lock().unwrap_or_else(|p| p.into_inner());
    if buf.as_ref().is_none_or(|b| b.bytes < need) {
        // A queued forward pass may still read fed tokens from the old buffer.
        ctx.gpu.synchronize()?;
        *buf = None;
        *buf = Some(DeviceBuffer::alloc(&ctx.gpu, need * 2, "sampling scratch")?);
    }
    let base = buf.as_ref().expect("allocated above").ptr;
    drop(buf);
    let rows_ptr = base;
    let out_ptr = base + rows_bytes as u64;
    let hist_ptr = out_ptr + out_bytes as u64;
    let mask_ptr = hist_ptr + hist_bytes as u64;
    let ids_ptr = mask_ptr + mask_bytes as u64;
    let vals_ptr = ids_ptr + ids_bytes as u64;
    let bits_ptr = vals_ptr + vals_bytes as u64;
    ctx.stage_upload(rows_ptr, &rows)?;
    ctx.stage_upload(hist_ptr, &history)?;
    ctx.stage_upload(mask_ptr, &masks)?;
    ctx.stage_upload(ids_ptr, &delta_ids)?;
    ctx.stage_upload(vals_ptr, &delta_vals)?;
    ctx.kernel("sample_rows")?.launch(
        &ctx.gpu,
        (n as u32, 1, 1),
        THREADS,
        0,
        vec![
            Arg::Ptr(logits.ptr),
            Arg::I32(vocab as i32),
            Arg::I64(logits.ld as i64),
            Arg::Ptr(rows_ptr),
            Arg::Ptr(hist_ptr),
            Arg::Ptr(if bits_bytes == 0 { 0 } else { bits_ptr }),
            Arg::Ptr(mask_ptr),
            Arg::Ptr(ids_ptr),
            Arg::Ptr(vals_ptr),
            Arg::Ptr(out_ptr),
        ],
    )?;
    let launch = slots.launches;
    slots.launches += 1;
    let slot = match &mut slots.slot[(launch % 2) as usize] {
        Some(slot) if slot.host.bytes >= out_bytes => {
            // Results nobody collected (a failed step's) are given up.
            if slot.holds.is_some() {
                slot.done.wait()?;
            }
            slot
        }
        entry => {
            if let Some(old) = entry.as_ref()
                && old.holds.is_some()
            {
                old.done.wait()?;
            }
            entry.insert(Slot {
                host: PinnedBuffer::alloc(&ctx.gpu, (out_bytes * 2).max(64 << 10))?,
                done: Event::new(&ctx.gpu)?,
                holds: None,
            })
        }
    };
    // The page-locked slot is unread: results of launch - 2 were collected or given up above.
    unsafe { copy_to_host(&ctx.gpu, slot.host.addr_mut(), out_ptr, out_bytes)? };
    slot.done.record(&ctx.gpu)?;
    slot.holds = Some(launch);
    slots.latest_out = Some((out_ptr, n));
    Ok(PendingSample::Queued {
        slot: launch as usize,
        logprobs: specs.iter().map(|s| s.logprobs).collect(),
    })
}

/// Where the latest [`launch`] left its records on the device and how many, unless it sampled
/// on the host.
pub(crate) fn latest_on_device(scratch: &SampleScratch) -> Option<(DevicePtr, usize)> {
    scratch
        .slots
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .latest_out
}

/// Waits for a [`launch`]'s results and reads them.
pub(crate) fn collect(scratch: &SampleScratch, pending: PendingSample) -> Result<Vec<Sampled>> {
    let (launch, logprobs) = match pending {
        PendingSample::Ready(s) => return Ok(s),
        PendingSample::Queued { slot, logprobs } => (slot as u64, logprobs),
    };
    let mut slots = scratch.slots.lock().unwrap_or_else(|p| p.into_inner());
    let slot = slots.slot[(launch % 2) as usize]
        .as_mut()
        .filter(|s| s.holds == Some(launch))
        .ok_or_else(|| {
            Error::InvalidArgument(format!(
                "sampling {launch} was not collected before two later ones reused its slot"
            ))
        })?;
    slot.holds = None;
    slot.done.wait()?;
    // The event fired: the copy into the slot has run, and SampleOut is plain ints and floats.
    let outs: &[SampleOut] = unsafe { slot.host.read(0, logprobs.len()) };
    Ok(outs
        .iter()
        .zip(&logprobs)
        .map(|(o, lp)| Sampled {
            token: o.token as u32,
            logprobs: lp.map(|_| {
                let m = (o.n.max(0) as usize).min(TOP_LOGPROBS);
                TokenLogprobs {
                    logprob: o.logprob,
                    top: (0..m).map(|i| (o.ids[i] as u32, o.lps[i])).collect(),
                }
            }),
        })
        .collect())
}
