//! The peer sum: two tensor-parallel ranks sum a one-token row-parallel output without a
//! collective kernel (docs/tensor-parallel.md, "The peer sum").
//!
//! At batch 1 a decode step's 64 all-reduces (one 4,096-float row each) cost about as much as
//! their launches and NCCL's handshakes, not their bytes. Where both ranks' GPUs see each other's
//! memory (peer access over NVLink, ranks in one process), the layer's gemv stores its rows into
//! the other rank's receive slot as well as its own output and counts them there
//! (kernels/gemv_dense.cu, `dense_gemv1_push`); the next block's normed gemv waits for the peer's
//! count, then norms `res + (own + peer)` while its weights stream in
//! (`dense_gemv_norm1_peer`). Two floats sum to the same bits whichever rank adds them, as in
//! NCCL's two-rank sum, so both ranks keep the same bits.
//!
//! Any other row-parallel output of the two ranks (several tokens, a quantized layer) is summed
//! by one kernel in place of NCCL's all-reduce (`peer_sum_rows`): each rank pushes its output
//! into the other's receive slot, counts it there, waits for the peer's and adds it.
//!
//! NCCL stays the collective library: the group, its faults, the all-gather, outputs larger
//! than a slot and every sum of more than two ranks are its.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::sys;
use nibble_core::{Error, Result};

use crate::context::CudaContext;
use crate::runtime::{Arg, DeviceBuffer, DevicePtr, Gpu, driver_err};

/// Receive slots a rank keeps: a rank can be one sum ahead of its peer (its next push may land
/// while the peer still reads the last), so two would do; four leave a margin.
const SLOTS: usize = 4;

/// The widest row summed this way (f32): Llama-2-70B's hidden size is 8,192.
pub const ROW_MAX: usize = 16384;

/// A receive slot's size in f32: the largest piece of an output [`PeerSum::sum_rows`] sums in
/// one kernel (1,024 tokens of a 4,096-wide model; longer prefill chunks go in pieces). 64 MB a
/// rank for the four slots.
pub const SLOT_FLOATS: usize = 1 << 22;

/// Host memory mapped into every GPU: the group's abort flag, which a rank waiting for its peer
/// polls, so that a wait for a rank that failed ends when the group is aborted.
pub struct AbortFlag {
    host: *mut u32,
}

// SAFETY: the flag is one u32 of pinned memory, written with volatile stores and freed once.
unsafe impl Send for AbortFlag {}
unsafe impl Sync for AbortFlag {}

impl AbortFlag {
    /// A lowered flag; `gpu`'s context must be current (any GPU: the memory is portable).
    pub fn new(gpu: &Gpu) -> Result<AbortFlag> {
        gpu.bind()?;
        let mut host: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: a plain allocation of 4 bytes; checked before use.
        unsafe {
            sys::cuMemHostAlloc(
                &mut host,
                4,
                sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP,
            )
        }
        .result()
        .map_err(|e| driver_err("mapped host memory for the abort flag", e))?;
        let host = host as *mut u32;
        // SAFETY: the allocation holds one u32.
        unsafe { host.write_volatile(0) };
        Ok(AbortFlag { host })
    }

    /// The flag's address on `gpu` (whose context is bound).
    fn device_ptr(&self, gpu: &Gpu) -> Result<DevicePtr> {
        gpu.bind()?;
        let mut ptr: DevicePtr = 0;
        // SAFETY: `host` came from cuMemHostAlloc with DEVICEMAP.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut ptr, self.host as *mut _, 0) }
            .result()
            .map_err(|e| driver_err("the abort flag's device address", e))?;
        Ok(ptr)
    }

    /// Raises the flag: every wait for a peer ends (its sum is then garbage; the group is over).
    pub fn raise(&self) {
        // SAFETY: `host` is live until drop.
        unsafe { self.host.write_volatile(1) };
    }
}

impl Drop for AbortFlag {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemHostAlloc; no kernel runs once the group is dropped.
        let _ = unsafe { sys::cuMemFreeHost(self.host as *mut _) };
    }
}

/// A rank's receive slots and counters, and what its peer needs to reach them. They belong to
/// the group's [`PeerExchange`], not to the rank: a peer's kernels may still push here after
/// this rank has failed and dropped its backend.
struct RankSlots {
    /// `SLOTS` slots of `SLOT_FLOATS` f32 the peer pushes into.
    recv: DeviceBuffer,
    /// [arrivals, own, done]: what the peer has pushed here, what this rank has pushed (u64
    /// each, in rows for one token and in float4s for [`PeerSum::sum_rows`]), and
    /// `peer_sum_rows`'s count of its CTAs.
    counters: DeviceBuffer,
    gpu: Arc<Gpu>,
    ctx: usize,
    device: sys::CUdevice,
}

/// The group's meeting point for setting up peer sums (`GpuGroup`, and every rank's
/// [`PeerSum`]): each rank's slots, freed when the last of them is gone and every rank's GPU has
/// finished its work; and the group's abort flag.
pub struct PeerExchange {
    parts: Mutex<Vec<Option<RankSlots>>>,
    pub abort: AbortFlag,
}

impl PeerExchange {
    pub fn new(ranks: usize, gpu: &Gpu) -> Result<PeerExchange> {
        Ok(PeerExchange {
            parts: Mutex::new((0..ranks).map(|_| None).collect()),
            abort: AbortFlag::new(gpu)?,
        })
    }

    /// Frees rank `rank`'s slots (64 MB) where the two ranks will not sum peer to peer: neither
    /// has pushed to them, nor will. Called on the rank's own thread, its GPU bound.
    pub fn withdraw(&self, rank: usize) -> Result<()> {
        let part = self.parts.lock().unwrap_or_else(|p| p.into_inner())[rank].take();
        if let Some(p) = part {
            p.gpu.synchronize()?;
        }
        Ok(())
    }
}

impl Drop for PeerExchange {
    fn drop(&mut self) {
        // No kernel of any rank may still push into a slot being freed; the abort flag's free
        // (after this) needs a context bound.
        let parts = self.parts.get_mut().unwrap_or_else(|p| p.into_inner());
        for p in parts.iter().flatten() {
            let _ = p.gpu.synchronize();
        }
        if let Some(p) = parts.iter().flatten().next() {
            let _ = p.gpu.bind();
        }
    }
}

/// A sum whose consumer is to come: this rank's row and the slot the peer's arrives in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Pending {
    own: DevicePtr,
    slot: usize,
    n: usize,
}

/// One rank's side of the peer sum.
pub struct PeerSum {
    /// Holds every rank's slots alive while this rank may push or wait.
    _exchange: Arc<PeerExchange>,
    /// This rank's slots and counters ([`RankSlots`]).
    recv: DevicePtr,
    counters: DevicePtr,
    peer_recv: DevicePtr,
    peer_arrivals: DevicePtr,
    abort: DevicePtr,
    /// The slot of the next push, rewound at every forward pass (so a captured graph's slots are
    /// the ones its replays use, on both ranks alike).
    turn: AtomicUsize,
    pending: Mutex<Option<Pending>>,
    /// Sums their consumer's normed gemv finished, and sums settled on their own (tests read
    /// them: the two give the same bits by design).
    fused: AtomicUsize,
    settled: AtomicUsize,
    summed_rows: AtomicUsize,
}

/// Kernel arguments of a push: the peer's slot and arrivals, this rank's own count.
pub struct PushArgs {
    pub peer_y: DevicePtr,
    pub peer_arrivals: DevicePtr,
    pub own: DevicePtr,
}

/// Kernel arguments of a wait: this rank's slot (the peer's row) and counters, the abort flag.
pub struct WaitArgs {
    pub peer_part: DevicePtr,
    pub arrivals: DevicePtr,
    pub own: DevicePtr,
    pub abort: DevicePtr,
}

impl PeerSum {
    /// Sets up rank `rank` of two on `gpu`: its slots and counters (zeroed), published in
    /// `exchange`; after `barrier` (every rank has published), peer access to the other rank's
    /// GPU. `None` where that GPU is not a peer of this one.
    pub fn connect(
        gpu: &Arc<Gpu>,
        rank: usize,
        exchange: &Arc<PeerExchange>,
        barrier: impl Fn() -> Result<()>,
    ) -> Result<Option<PeerSum>> {
        let recv = DeviceBuffer::alloc(gpu, SLOTS * SLOT_FLOATS * 4, "peer-sum slots")?;
        let counters = DeviceBuffer::from_host(gpu, &[0u64; 4], "peer-sum counters")?;
        // Zero before the peer can count here.
        gpu.synchronize()?;
        let (my_recv, my_counters, my_device) = (recv.ptr, counters.ptr, gpu.ctx.cu_device());
        let me = RankSlots {
            recv,
            counters,
            gpu: gpu.clone(),
            ctx: gpu.ctx.cu_ctx() as usize,
            device: my_device,
        };
        exchange.parts.lock().unwrap_or_else(|p| p.into_inner())[rank] = Some(me);
        barrier()?;
        let (peer_recv, peer_arrivals, peer_ctx, peer_device) = {
            let parts = exchange.parts.lock().unwrap_or_else(|p| p.into_inner());
            let p = parts[1 - rank]
                .as_ref()
                .ok_or_else(|| Error::InvalidArgument("the peer rank published nothing".into()))?;
            (p.recv.ptr, p.counters.ptr, p.ctx, p.device)
        };
        let mut can = 0;
        // SAFETY: two valid device handles.
        unsafe { sys::cuDeviceCanAccessPeer(&mut can, my_device, peer_device) }
            .result()
            .map_err(|e| driver_err("peer access query", e))?;
        // The arrival counts are atomic adds on the peer's memory: peer access over PCIe need not
        // carry them (NVLink does), and a lost add would leave the peer waiting.
        let mut atomics = 0;
        // SAFETY: two valid device handles.
        unsafe {
            sys::cuDeviceGetP2PAttribute(
                &mut atomics,
                sys::CUdevice_P2PAttribute::CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED,
                my_device,
                peer_device,
            )
        }
        .result()
        .map_err(|e| driver_err("peer atomics query", e))?;
        if can == 0 || atomics == 0 {
            return Ok(None);
        }
        gpu.bind()?;
        // SAFETY: the peer's context outlives the group (its rank holds it); NCCL may have
        // enabled the same access already.
        match unsafe { sys::cuCtxEnablePeerAccess(peer_ctx as sys::CUcontext, 0) } {
            sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => {
            }
            e => return Err(driver_err("enabling peer access", e)),
        }
        Ok(Some(PeerSum {
            _exchange: exchange.clone(),
            recv: my_recv,
            counters: my_counters,
            peer_recv,
            peer_arrivals,
            abort: exchange.abort.device_ptr(gpu)?,
            turn: AtomicUsize::new(0),
            pending: Mutex::new(None),
            fused: AtomicUsize::new(0),
            settled: AtomicUsize::new(0),
            summed_rows: AtomicUsize::new(0),
        }))
    }

    /// Whether a one-token row of `n` floats can be summed this way.
    pub fn fits(n: usize) -> bool {
        n <= ROW_MAX
    }

    /// Back to the first slot: at the start of every forward pass. A pending sum left by a
    /// forward pass that failed is dropped (its buffer is the old pass's; the counters are
    /// cumulative, so later waits stay right).
    pub fn rewind(&self) {
        self.turn.store(0, Ordering::Relaxed);
        self.pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
    }

    /// Whether the forward pass's last push went to slot 0, the next pass's first: the pass
    /// must then end in a barrier with the peer (`CudaBackend::run_forward`), or the peer's
    /// first push could overwrite that slot while this rank still reads it. (Within a pass a
    /// rank is at most one sum ahead of its peer, so two slots apart is enough.)
    pub fn ends_on_the_first_slot(&self) -> bool {
        self.turn.load(Ordering::Relaxed) % SLOTS == 1
    }

    /// (fused, settled): how many sums the normed gemv finished and how many were settled.
    pub fn counts(&self) -> (usize, usize) {
        (
            self.fused.load(Ordering::Relaxed),
            self.settled.load(Ordering::Relaxed),
        )
    }

    /// The slot for the next push, and where the push goes.
    pub fn next_push(&self) -> (usize, PushArgs) {
        let slot = self.turn.fetch_add(1, Ordering::Relaxed) % SLOTS;
        let args = PushArgs {
            peer_y: self.peer_recv + (slot * SLOT_FLOATS * 4) as u64,
            peer_arrivals: self.peer_arrivals,
            own: self.counters + 8,
        };
        (slot, args)
    }

    /// What a consumer of the sum in `slot` waits on and reads.
    fn wait_args(&self, slot: usize) -> WaitArgs {
        WaitArgs {
            peer_part: self.recv + (slot * SLOT_FLOATS * 4) as u64,
            arrivals: self.counters,
            own: self.counters + 8,
            abort: self.abort,
        }
    }

    /// After a push of this rank's `n`-float row `own` into `slot`: with `defer` the sum is left
    /// to its consumer ([`PeerSum::take_wait`], else settled at its first other use), otherwise
    /// settled now.
    pub fn pushed(
        &self,
        ctx: &CudaContext,
        own: DevicePtr,
        slot: usize,
        n: usize,
        defer: bool,
    ) -> Result<()> {
        let p = Pending { own, slot, n };
        if defer {
            *self.pending.lock().unwrap_or_else(|e| e.into_inner()) = Some(p);
            Ok(())
        } else {
            self.settle(ctx, p)
        }
    }

    /// Takes the pending sum if `own` is its row: the consumer's normed gemv sums it itself,
    /// with these arguments.
    pub fn take_wait(&self, own: DevicePtr) -> Option<WaitArgs> {
        let mut g = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        match *g {
            Some(p) if p.own == own => {
                self.fused.fetch_add(1, Ordering::Relaxed);
                *g = None;
                Some(self.wait_args(p.slot))
            }
            _ => None,
        }
    }

    /// Finishes a pending sum in place (any consumer but the normed gemv).
    pub fn settle_pending(&self, ctx: &CudaContext) -> Result<()> {
        let p = self
            .pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        match p {
            Some(p) => self.settle(ctx, p),
            None => Ok(()),
        }
    }

    /// Whether [`PeerSum::sum_rows`] takes an f32 output of `n` values (16-byte aligned: the
    /// kernel moves float4s).
    pub fn rows_fit(n: usize) -> bool {
        n > 0 && n.is_multiple_of(4)
    }

    /// `y += the peer's y` in place, for an f32 output of `n` values (the caller checks
    /// [`PeerSum::rows_fit`]), by one kernel a slot's worth (kernels/gemv_dense.cu,
    /// `peer_sum_rows`): the bits of NCCL's two-rank sum, or with `bf16` the f32 sum of both
    /// addends rounded to bf16 (half the bytes over NVLink). A pending one-token sum is settled
    /// first.
    pub fn sum_rows(&self, ctx: &CudaContext, y: DevicePtr, n: usize, bf16: bool) -> Result<()> {
        self.settle_pending(ctx)?;
        let kernel = if bf16 {
            "peer_sum_rows_bf16"
        } else {
            "peer_sum_rows"
        };
        let mut start = 0;
        while start < n {
            let len = (n - start).min(SLOT_FLOATS);
            let (slot, push) = self.next_push();
            let w = self.wait_args(slot);
            let n4 = len / 4;
            // At most one CTA an SM, all resident: each waits for the peer's whole push.
            let grid = n4.div_ceil(1024).min(ctx.gpu.sm_count).max(1);
            ctx.launch(
                kernel,
                (grid as u32, 1, 1),
                1024,
                vec![
                    Arg::Ptr(y + (start * 4) as u64),
                    Arg::Ptr(push.peer_y),
                    Arg::Ptr(w.peer_part),
                    Arg::I64(n4 as i64),
                    Arg::Ptr(push.peer_arrivals),
                    Arg::Ptr(w.arrivals),
                    Arg::Ptr(w.own),
                    Arg::Ptr(self.counters + 16),
                    Arg::Ptr(w.abort),
                ],
            )?;
            start += len;
        }
        self.summed_rows.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// How many outputs [`PeerSum::sum_rows`] has summed.
    pub fn rows_summed(&self) -> usize {
        self.summed_rows.load(Ordering::Relaxed)
    }

    /// `own += the peer's row` once it has arrived (kernels/gemv_dense.cu, `peer_sum_settle`).
    fn settle(&self, ctx: &CudaContext, p: Pending) -> Result<()> {
        self.settled.fetch_add(1, Ordering::Relaxed);
        let w = self.wait_args(p.slot);
        ctx.launch(
            "peer_sum_settle",
            (1, 1, 1),
            1024,
            vec![
                Arg::Ptr(p.own),
                Arg::Ptr(w.peer_part),
                Arg::I32(p.n as i32),
                Arg::Ptr(w.arrivals),
                Arg::Ptr(w.own),
                Arg::Ptr(w.abort),
            ],
        )
    }
}
