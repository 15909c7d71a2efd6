//! Tensor parallelism on several GPUs: one rank per GPU, each a thread driving its own
//! [`CudaBackend`] over its shard of the model (`nibble_model::tensor_parallel`), the row-parallel
//! outputs summed by NCCL on each GPU's stream (so a decode step's graph holds its all-reduces).
//!
//! Every rank runs the same engine loop on the same inputs (SPMD, as SGLang's ranks do): the
//! logits after the last all-reduce are the same bits on every rank, so every rank samples the
//! same tokens, schedules the same next step and issues the same collectives. What the host
//! decides from local facts (the KV pool's size from free memory) is agreed first
//! ([`GpuGroup::host`]). Rank 0 talks to the user.
//!
//! Faults: a rank that fails or panics aborts every rank's communicator (NCCL's
//! `ncclCommAbort`), which stops collectives in flight, so a rank blocked on its stream waiting
//! for the failed one gets its stream back, sees the group aborted and ends with an error; the
//! first failure is what the run returns. Nothing here assumes one host: across hosts the
//! unique id would travel over TCP and each host would run its local ranks (docs/tensor-parallel.md).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nibble_core::{Error, Result};
use nibble_model::source::TensorSource;
use nibble_model::tensor_parallel::{HostComm, run_ranks};
use nibble_model::{ModelConfig, Transformer};

use crate::backend::CudaBackend;
use crate::nccl::{self, Communicator, ReduceType, UniqueId};
use crate::peer_sum::{PeerExchange, PeerSum};
use crate::runtime::DeviceBuffer;
use crate::tensor::Dtype;

/// The ranks of one tensor-parallel run in this process: their GPUs, their NCCL communicators
/// (held here too, so a failure can abort them all), and a host-side channel for agreeing.
pub struct GpuGroup {
    gpus: Vec<usize>,
    dtype: Dtype,
    id: UniqueId,
    comms: Vec<Mutex<Option<Arc<Communicator>>>>,
    /// Whether the ranks split the output head by vocabulary (on unless `NIBBLE_TP_SPLIT_HEAD=0`,
    /// or [`GpuGroup::split_head`]).
    split_head: bool,
    /// Bytes of NCCL symmetric memory each rank sums its row-parallel outputs in
    /// (`Backend::linear_summed`); 0 for none. Off unless asked for
    /// ([`GpuGroup::symmetric_window`]): NCCL's symmetric kernels do not stop at an abort, so a
    /// rank waiting in one for a peer that failed stays blocked (seen on two H200s); pair it
    /// with [`GpuGroup::exit_if_stuck`].
    window_bytes: usize,
    /// Whether two ranks on peer GPUs sum one-token row-parallel outputs in their gemvs
    /// (`crate::peer_sum`; on unless `NIBBLE_TP_PEER_SUM=0`, or [`GpuGroup::peer_sum`]).
    peer_sum: bool,
    /// Where the ranks meet to set the peer sum up, and its abort flag (made by the first rank
    /// to get there, on its GPU).
    exchange: Mutex<Option<Arc<PeerExchange>>>,
    /// After an abort, how long the ranks get to unwind before the process exits with the
    /// failure ([`GpuGroup::exit_if_stuck`]); `None` waits for them.
    stuck_grace: Option<Duration>,
    /// How long a rank may wait for its GPU before the group counts a peer as gone and aborts
    /// ([`GpuGroup::step_deadline`]); `None` waits for ever.
    step_deadline: Option<Duration>,
    /// Whether [`run_sharded`] has every rank back: what the step-deadline monitor and the
    /// abort's watchdog wait for.
    finished: Arc<AtomicBool>,
    /// Whether the group was aborted: the monitor stops, and only the first abort starts the
    /// watchdog.
    aborted: AtomicBool,
    /// Host-side agreement between the ranks (a barrier before NCCL's blocking init, the KV pool
    /// size), with the same abort.
    pub host: Arc<HostComm>,
}

impl GpuGroup {
    /// A group over the GPUs `gpus` (rank r on `gpus[r]`), in `dtype`.
    pub fn new(gpus: &[usize], dtype: Dtype) -> Result<GpuGroup> {
        if gpus.len() < 2 {
            return Err(Error::InvalidArgument(
                "a tensor-parallel group of GPUs needs at least two".into(),
            ));
        }
        let mut seen = gpus.to_vec();
        seen.sort_unstable();
        seen.dedup();
        if seen.len() != gpus.len() {
            return Err(Error::InvalidArgument(format!(
                "tensor-parallel ranks need a GPU each; {gpus:?} names one twice"
            )));
        }
        crate::probe::ensure_driver()?;
        let count = cudarc::driver::result::device::get_count()
            .map_err(|e| Error::unsupported("counting GPUs", format!("{e:?}")))?
            as usize;
        if let Some(&bad) = gpus.iter().find(|&&g| g >= count) {
            return Err(Error::unsupported(
                format!("tensor parallelism over {} GPUs", gpus.len()),
                format!("it needs cuda:{bad}, but the driver sees {count} GPU(s)"),
            ));
        }
        Ok(GpuGroup {
            gpus: gpus.to_vec(),
            dtype,
            id: nccl::unique_id()?,
            comms: gpus.iter().map(|_| Mutex::new(None)).collect(),
            split_head: std::env::var("NIBBLE_TP_SPLIT_HEAD").map_or(true, |v| v != "0"),
            window_bytes: 0,
            peer_sum: std::env::var("NIBBLE_TP_PEER_SUM").map_or(true, |v| v != "0"),
            exchange: Mutex::new(None),
            stuck_grace: None,
            step_deadline: Some(
                std::env::var("NIBBLE_TP_STEP_DEADLINE")
                    .ok()
                    .and_then(|v| v.parse().ok())
                    .map_or(STEP_DEADLINE, Duration::from_secs),
            ),
            finished: Arc::default(),
            aborted: AtomicBool::new(false),
            host: HostComm::new(gpus.len()),
        })
    }

    /// Whether every rank takes a share of the output head's vocabulary (and gathers the
    /// logits) instead of the whole head.
    pub fn split_head(mut self, on: bool) -> GpuGroup {
        self.split_head = on;
        self
    }

    /// Whether the ranks sum their row-parallel outputs in NCCL symmetric memory where NCCL
    /// has it (NCCL 2.27 on), or in activations with NCCL's default kernels (see
    /// `window_bytes` for the catch).
    pub fn symmetric_window(mut self, on: bool) -> GpuGroup {
        self.window_bytes = if on { WINDOW_BYTES } else { 0 };
        self
    }

    /// Whether two ranks on peer GPUs sum one-token row-parallel outputs in their gemvs
    /// (`crate::peer_sum`) instead of NCCL's all-reduce.
    pub fn peer_sum(mut self, on: bool) -> GpuGroup {
        self.peer_sum = on;
        self
    }

    /// The group's peer-sum meeting point, made on `gpu` by the first rank to ask.
    fn exchange(&self, gpu: &crate::runtime::Gpu) -> Result<Arc<PeerExchange>> {
        let mut g = self.exchange.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(e) = &*g {
            return Ok(e.clone());
        }
        let e = Arc::new(PeerExchange::new(self.size(), gpu)?);
        *g = Some(e.clone());
        Ok(e)
    }

    /// After an abort, gives the ranks `grace` to unwind, then ends the process with the
    /// failure (exit status 1) if one is still blocked: a rank whose stream waits in NCCL's
    /// symmetric kernels for a failed peer never returns. For a program the group is all of
    /// (nibble's CLI and server), where an exit with the error beats a hang.
    pub fn exit_if_stuck(mut self, grace: Duration) -> GpuGroup {
        self.stuck_grace = Some(grace);
        self
    }

    /// How long a rank may be blocked waiting for its GPU before the group aborts: a rank
    /// whose peer hangs (stops taking part in the collectives without failing) waits in its
    /// next collective for ever. `None` waits for ever.
    pub fn step_deadline(mut self, deadline: Option<Duration>) -> GpuGroup {
        self.step_deadline = deadline;
        self
    }

    pub fn size(&self) -> usize {
        self.gpus.len()
    }

    /// Aborts the group if a rank has been waiting for its GPU past the step deadline.
    fn check_deadline(&self, deadline: Duration) {
        for (rank, slot) in self.comms.iter().enumerate() {
            let comm = slot.lock().unwrap_or_else(|p| p.into_inner()).clone();
            let Some(waited) = comm.and_then(|c| c.gpu_waiting_for()) else {
                continue;
            };
            if waited > deadline {
                self.abort(&format!(
                    "rank {rank} has waited {}s for its GPU, past the {}s step deadline \
                     (NIBBLE_TP_STEP_DEADLINE): a peer stopped taking part in the collectives",
                    waited.as_secs(),
                    deadline.as_secs()
                ));
                return;
            }
        }
    }

    /// Rank `rank`'s backend, on its thread: the GPU opened, then (once every rank has one, so
    /// a rank that could not open its GPU fails the others instead of leaving them in NCCL's
    /// blocking init) its communicator joined and connected by a first all-reduce.
    pub fn rank_backend(&self, rank: usize) -> Result<CudaBackend> {
        let be = CudaBackend::new(self.gpus[rank], self.dtype)?;
        self.host.barrier(rank)?;
        let comm = Arc::new(Communicator::join(&be.gpu, &self.id, rank, self.size())?);
        // Held by the group from now on, so a failure anywhere after can abort it.
        *self.comms[rank].lock().unwrap_or_else(|p| p.into_inner()) = Some(comm.clone());
        // NCCL connects its peers on the first collective; do it now, outside any graph capture.
        let probe = DeviceBuffer::from_host(&be.gpu, &[rank as f32 + 1.0], "all-reduce probe")?;
        comm.all_reduce_sum(probe.ptr, 1, ReduceType::F32)?;
        let mut sum = [0f32];
        be.gpu.download(&mut sum, probe.ptr)?;
        let want = (self.size() * (self.size() + 1) / 2) as f32;
        if sum[0] != want {
            return Err(Error::InvalidArgument(format!(
                "NCCL's first all-reduce on rank {rank} gave {} instead of {want}",
                sum[0]
            )));
        }
        // Two slots of the symmetric window, each for a step's whole row-parallel output
        // (`CudaBackend::linear_summed`); larger ones (long prefill chunks) reduce in place.
        let window = match self.window_bytes {
            0 => None,
            bytes => comm
                .symmetric_window(bytes, |ok| Ok(self.host.agree_min(rank, ok as usize)? == 1))?
                .map(|ptr| (ptr, bytes)),
        };
        if rank == 0 && self.window_bytes > 0 && window.is_none() {
            eprintln!(
                "nibble: NCCL has no symmetric memory here (NCCL 2.27 or later with cuMem); \
                 all-reduces run NCCL's default kernels"
            );
        }
        // The peer sum: two ranks on Hopper GPUs that see each other's memory, both or neither.
        let peer = if self.peer_sum && self.size() == 2 && be.gpu.cc == (9, 0) && be.dense_gemv {
            let ex = self.exchange(&be.gpu)?;
            let p = PeerSum::connect(&be.gpu, rank, &ex, || self.host.barrier(rank))?;
            let both = self.host.agree_min(rank, p.is_some() as usize)? == 1;
            if !both {
                if rank == 0 {
                    eprintln!(
                        "nibble: the two GPUs have no peer access; row-parallel sums run NCCL's \
                         all-reduce"
                    );
                }
                drop(p);
                ex.withdraw(rank)?;
                None
            } else {
                p
            }
        } else {
            None
        };
        Ok(be
            .with_collective(comm, self.split_head, window)
            .with_peer_sum(peer))
    }

    /// Ends the group after a failure: every communicator aborted (collectives in flight stop,
    /// later ones are errors) and every host-side wait ended with `why`.
    pub fn abort(&self, why: &str) {
        eprintln!("nibble: tensor-parallel group aborted: {why}");
        let first = !self.aborted.swap(true, Ordering::AcqRel);
        // The watchdog starts first: aborting a communicator whose kernel waits for the failed
        // peer may itself block.
        if let Some(grace) = self.stuck_grace
            && first
        {
            let (finished, why) = (self.finished.clone(), why.to_string());
            std::thread::spawn(move || {
                std::thread::sleep(grace);
                if !finished.load(Ordering::Acquire) {
                    eprintln!(
                        "nibble: a tensor-parallel rank is still blocked {}s after the group's \
                         abort (a collective waits for a rank that failed or hung); exiting. Error: {why}",
                        grace.as_secs()
                    );
                    // `_exit`, not `exit`: the CUDA and NCCL teardown that `exit` runs would
                    // wait for the same blocked kernel.
                    unsafe extern "C" {
                        fn _exit(status: std::ffi::c_int) -> !;
                    }
                    unsafe { _exit(1) }
                }
            });
        }
        self.host.abort(why);
        // Ends every wait for a peer's half of a sum (a kernel polling the flag).
        if let Some(e) = &*self.exchange.lock().unwrap_or_else(|p| p.into_inner()) {
            e.abort.raise();
        }
        // Outside the slots' locks: an abort may wait for NCCL.
        let comms: Vec<Arc<Communicator>> = self
            .comms
            .iter()
            .filter_map(|c| c.lock().unwrap_or_else(|p| p.into_inner()).clone())
            .collect();
        for c in comms {
            c.abort();
        }
    }

    /// Lets go of rank `rank`'s communicator, on that rank's thread once it is done (NCCL's
    /// destroy may wait for its peers, so the ranks do it side by side, never one after another).
    fn release(&self, rank: usize) {
        self.comms[rank]
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
    }
}

/// The symmetric window each rank registers: two slots of 16 MiB, a step's row-parallel output
/// of up to 1,024 rows of 4,096 f32 (512 of Llama-2-70B's 8,192). Decode steps and short chunks
/// fit; longer prefill chunks, whose all-reduces are bandwidth-bound anyway, reduce in place.
const WINDOW_BYTES: usize = 32 << 20;

/// How long a rank may wait for its GPU by default (`NIBBLE_TP_STEP_DEADLINE` seconds): far
/// beyond any step (a prefill chunk takes well under a second), short of a user giving up.
const STEP_DEADLINE: Duration = Duration::from_secs(300);

/// Runs `body` on every rank of `group`, each on its own thread with its GPU's backend and its
/// shard of the model in `source` loaded there, and returns each rank's result in rank order;
/// the first failure of any rank is the error (the others' collectives aborted, not hung).
pub fn run_sharded<R: Send>(
    group: &GpuGroup,
    source: &dyn TensorSource,
    config: &ModelConfig,
    body: impl Fn(usize, CudaBackend, Transformer<CudaBackend>) -> Result<R> + Sync,
) -> Result<Vec<R>> {
    group.finished.store(false, Ordering::Release);
    std::thread::scope(|scope| {
        if let Some(deadline) = group.step_deadline {
            scope.spawn(move || {
                while !group.finished.load(Ordering::Acquire)
                    && !group.aborted.load(Ordering::Acquire)
                {
                    std::thread::sleep(Duration::from_millis(500));
                    group.check_deadline(deadline);
                }
            });
        }
        let out = run_ranks(
            group.size(),
            source,
            config,
            |rank| group.rank_backend(rank),
            |why| group.abort(why),
            |rank, be, model| {
                let r = body(rank, be, model);
                if r.is_ok() {
                    group.release(rank);
                }
                r
            },
        );
        group.finished.store(true, Ordering::Release);
        out
    })
}
