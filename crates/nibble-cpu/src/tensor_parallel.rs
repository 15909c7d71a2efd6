//! Tensor parallelism on one machine's CPUs: `size` ranks, each a [`TpCpuBackend`] holding one
//! shard of the model (`nibble_model::tensor_parallel`) on its own thread, with a
//! [`CpuComm`] for their all-reduce. It checks the sharded arithmetic against one rank without
//! GPUs, and it is the in-process stand-in for NCCL: a multi-GPU backend implements the same
//! `Backend::all_reduce` over its collective library.

use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use nibble_core::{Error, Result};
use nibble_formats::HostTensor;
use nibble_model::Backend;

use crate::{CpuBackend, CpuKvCache, CpuTensor, CpuWeight};

/// How long a rank waits for the others at an all-reduce before it gives up with an error (a
/// rank that died would otherwise hang the rest).
const ALL_REDUCE_TIMEOUT: Duration = Duration::from_secs(120);

/// The all-reduce of `size` ranks in one process: each contributes its tensor, the last to
/// arrive sums them in rank order (so every rank gets the same bits), and all copy the sum out.
pub struct CpuComm {
    size: usize,
    state: Mutex<Round>,
    cv: Condvar,
}

#[derive(Default)]
struct Round {
    parts: Vec<Option<Vec<f32>>>,
    arrived: usize,
    /// Ranks yet to copy the last round's sum out; a new round waits for them.
    departing: usize,
    sum: Vec<f32>,
    generation: u64,
    /// Set when a rank failed: everyone waiting, or arriving later, gets this error.
    aborted: Option<String>,
}

impl CpuComm {
    pub fn new(size: usize) -> Arc<CpuComm> {
        Arc::new(CpuComm {
            size,
            state: Mutex::new(Round {
                parts: vec![None; size],
                ..Round::default()
            }),
            cv: Condvar::new(),
        })
    }

    pub fn size(&self) -> usize {
        self.size
    }

    /// Ends every pending and later all-reduce with an error naming `why` (a rank failed).
    pub fn abort(&self, why: &str) {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        st.aborted.get_or_insert_with(|| why.to_string());
        self.cv.notify_all();
    }

    fn wait<'a>(
        &self,
        st: std::sync::MutexGuard<'a, Round>,
        until: impl Fn(&Round) -> bool,
    ) -> Result<std::sync::MutexGuard<'a, Round>> {
        let (st, timeout) = self
            .cv
            .wait_timeout_while(st, ALL_REDUCE_TIMEOUT, |r| r.aborted.is_none() && !until(r))
            .unwrap_or_else(|p| p.into_inner());
        if let Some(why) = &st.aborted {
            return Err(Error::InvalidArgument(format!(
                "tensor-parallel all-reduce abandoned: {why}"
            )));
        }
        if timeout.timed_out() {
            return Err(Error::InvalidArgument(format!(
                "tensor-parallel all-reduce: the other ranks did not arrive within {}s",
                ALL_REDUCE_TIMEOUT.as_secs()
            )));
        }
        Ok(st)
    }

    /// Replaces `x` (rank `rank`'s part) by the sum over all ranks.
    pub fn all_reduce(&self, rank: usize, x: &mut [f32]) -> Result<()> {
        if self.size == 1 {
            return Ok(());
        }
        let st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let mut st = self.wait(st, |r| r.departing == 0)?;
        if st.parts[rank].is_some() {
            return Err(Error::InvalidArgument(format!(
                "rank {rank} entered an all-reduce twice"
            )));
        }
        st.parts[rank] = Some(x.to_vec());
        st.arrived += 1;
        if st.arrived == self.size {
            let mut parts = std::mem::take(&mut st.parts);
            let mut sum = parts[0].take().unwrap_or_default();
            for p in parts.iter_mut().skip(1) {
                let p = p.take().unwrap_or_default();
                if p.len() != sum.len() {
                    drop(st);
                    self.abort("ranks contributed tensors of different sizes");
                    return Err(Error::InvalidArgument(
                        "tensor-parallel all-reduce: ranks contributed tensors of different sizes"
                            .into(),
                    ));
                }
                for (s, v) in sum.iter_mut().zip(&p) {
                    *s += v;
                }
            }
            st.parts = vec![None; self.size];
            st.sum = sum;
            st.arrived = 0;
            st.departing = self.size;
            st.generation += 1;
            self.cv.notify_all();
        } else {
            let round = st.generation;
            st = self.wait(st, |r| r.generation != round)?;
        }
        if st.sum.len() != x.len() {
            return Err(Error::InvalidArgument(
                "tensor-parallel all-reduce: ranks contributed tensors of different sizes".into(),
            ));
        }
        x.copy_from_slice(&st.sum);
        st.departing -= 1;
        if st.departing == 0 {
            self.cv.notify_all();
        }
        Ok(())
    }
}

/// One rank: the CPU backend over its shard, summing row-parallel outputs through `comm`.
pub struct TpCpuBackend {
    cpu: CpuBackend,
    comm: Arc<CpuComm>,
    rank: usize,
}

impl TpCpuBackend {
    pub fn new(cpu: CpuBackend, comm: Arc<CpuComm>, rank: usize) -> Result<Self> {
        if rank >= comm.size() {
            return Err(Error::InvalidArgument(format!(
                "rank {rank} of a tensor-parallel group of {}",
                comm.size()
            )));
        }
        Ok(TpCpuBackend { cpu, comm, rank })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }
}

impl Backend for TpCpuBackend {
    type Tensor = CpuTensor;
    type Weight = CpuWeight;
    type Kv = CpuKvCache;

    crate::delegate_to_cpu!(cpu);
    crate::delegate_attention_and_linear_to_cpu!(cpu);

    fn name(&self) -> String {
        format!(
            "{} (tensor-parallel rank {} of {})",
            self.cpu.name(),
            self.rank,
            self.comm.size()
        )
    }
    fn load_weight(&self, t: &HostTensor) -> Result<CpuWeight> {
        self.cpu.load_weight(t)
    }
    fn embed(&self, table: &CpuWeight, ids: &[u32]) -> Result<CpuTensor> {
        self.cpu.embed(table, ids)
    }
    fn all_reduce(&self, x: &mut CpuTensor) -> Result<()> {
        self.comm
            .all_reduce(self.rank, &mut x.data)
            .inspect_err(|e| {
                self.comm.abort(&e.to_string());
            })
    }
}

/// Runs `body` on every rank of a `size`-way split of the model in `source`, each on its own
/// thread with its own CPU backend (`threads` matmul threads) and shard (handed over, so a rank
/// can build an engine of it), and returns each rank's result in rank order. A rank that fails
/// aborts the others' all-reduces, so none hangs.
pub fn run_sharded<R: Send>(
    size: usize,
    threads: usize,
    source: &dyn nibble_model::source::TensorSource,
    config: &nibble_model::ModelConfig,
    body: impl Fn(TpCpuBackend, nibble_model::Transformer<TpCpuBackend>) -> Result<R> + Sync,
) -> Result<Vec<R>> {
    use nibble_model::tensor_parallel::{ShardedSource, shard_config};
    let shard = shard_config(config, size)?;
    ShardedSource::new(source, config, 0, size)?.check_cuts()?;
    let comm = CpuComm::new(size);
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..size)
            .map(|rank| {
                let (comm, shard, body) = (comm.clone(), shard.clone(), &body);
                scope.spawn(move || {
                    let run = || -> Result<R> {
                        let src = ShardedSource::new(source, config, rank, size)?;
                        let be = TpCpuBackend::new(CpuBackend::new(threads)?, comm.clone(), rank)?;
                        let model =
                            nibble_model::Transformer::load(&be, shard, &src, &mut |_, _| {})?;
                        body(be, model)
                    };
                    run().inspect_err(|e| comm.abort(&format!("rank {rank} failed: {e}")))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(Error::InvalidArgument(
                        "a tensor-parallel rank panicked".into(),
                    ))
                })
            })
            .collect()
    })
}
