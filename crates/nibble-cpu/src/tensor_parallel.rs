//! Tensor parallelism on one machine's CPUs: `size` ranks, each a [`TpCpuBackend`] holding one
//! shard of the model (`nibble_model::tensor_parallel`) on its own thread, with a
//! [`CpuComm`] for their all-reduce. It checks the sharded arithmetic against one rank without
//! GPUs; nibble-cuda's `tensor_parallel` runs the same ranks on GPUs over NCCL.

use std::sync::Arc;

use nibble_core::{Error, Result};
use nibble_formats::HostTensor;
use nibble_model::Backend;
/// The in-process all-reduce the CPU ranks sum through (summing in rank order).
pub use nibble_model::tensor_parallel::HostComm as CpuComm;

use crate::{CpuBackend, CpuKvCache, CpuTensor, CpuWeight};

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
    fn gathers_columns(&self) -> bool {
        true
    }
    fn all_gather_cols(&self, x: &CpuTensor) -> Result<CpuTensor> {
        let (rows, cols) = (x.rows, x.cols);
        let all = self
            .comm
            .all_gather(self.rank, &x.data)
            .inspect_err(|e| self.comm.abort(&e.to_string()))?;
        let size = self.comm.size();
        let mut data = Vec::with_capacity(all.len());
        for r in 0..rows {
            for part in all.chunks_exact(rows * cols) {
                data.extend_from_slice(&part[r * cols..(r + 1) * cols]);
            }
        }
        Ok(CpuTensor {
            data,
            rows,
            cols: cols * size,
        })
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
    let comm = CpuComm::new(size);
    nibble_model::tensor_parallel::run_ranks(
        size,
        source,
        config,
        |rank| TpCpuBackend::new(CpuBackend::new(threads)?, comm.clone(), rank),
        |why| comm.abort(why),
        |_, be, model| body(be, model),
    )
}
