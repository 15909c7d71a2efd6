//! Decode steps as CUDA graphs. A decode step is hundreds of small launches whose gaps would
//! cost a large share of the step at batch 1; replaying a captured graph removes them.
//!
//! What makes replay valid: every op of a forward reads its integers (token ids, positions,
//! block tables) from one device buffer that `begin_forward` refills before the step, and every
//! activation comes from the arena, which hands out the same addresses for the same sequence of
//! allocations. So a graph is keyed by what changes kernel arguments or grid sizes: the model,
//! the KV pool, the number of sequences and the padded block-table width.
//!
//! The cache and the capture primitives are here; the context drives them (`CudaContext::
//! run_forward`), since the arena and the metadata a graph bakes in are the context's and the
//! cache must be dropped whenever they move.

use std::collections::{HashMap, HashSet};

use cudarc::driver::result as cu;
use cudarc::driver::sys;
use nibble_core::Result;
use nibble_model::BatchLayout;

use crate::runtime::{ArenaMark, DevicePtr, Gpu, driver_err};
use crate::tensor::Elem;

/// Decode steps of more sequences run eagerly. Up to here queueing a step's few hundred launches
/// costs the host 3 to 4.5 ms against 8 to 10 ms of GPU time (Llama-3-8B on an H100), which a
/// graph replay saves.
pub const GRAPH_MAX_SEQS: usize = 1024;

/// The size a decode step of `n` sequences is padded to, so that a few graphs serve every batch:
/// powers of two to 8, then multiples of 8 to 32, of 16 to 128, of 32 to 512 and of 64 to
/// [`GRAPH_MAX_SEQS`]; larger steps run eagerly at their own size.
pub fn decode_bucket(n: usize) -> usize {
    match n {
        0..=8 => n.next_power_of_two(),
        9..=32 => n.div_ceil(8) * 8,
        33..=128 => n.div_ceil(16) * 16,
        129..=512 => n.div_ceil(32) * 32,
        513..=GRAPH_MAX_SEQS => n.div_ceil(64) * 64,
        _ => n,
    }
}

/// Whether `batch` is a decode step small enough to replay as a graph.
pub fn is_graph_step(batch: &BatchLayout) -> bool {
    !batch.seqs.is_empty()
        && batch.seqs.len() <= GRAPH_MAX_SEQS
        && batch.seqs.iter().all(|s| s.len == 1)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GraphKey {
    pub model: usize,
    pub kv: u64,
    pub seqs: usize,
    pub max_blocks: usize,
}

/// A graph's output tensor, as its parts: the tensor itself belongs to the step that made it.
pub type GraphOut = (DevicePtr, usize, usize, Elem);

struct Captured {
    exec: sys::CUgraphExec,
    graph: sys::CUgraph,
    out: GraphOut,
    arena: ArenaMark,
}

#[derive(Default)]
pub struct GraphCache {
    graphs: HashMap<GraphKey, Captured>,
    /// Keys whose capture failed; they run eagerly from then on.
    refused: HashSet<GraphKey>,
    /// The KV pool the cached graphs write; graphs of an earlier pool are dropped when another
    /// one is used (one-shot generation makes a pool per request).
    pool: u64,
    pub replays: u64,
    pub captures: u64,
    /// A capture is under way: nothing may synchronize the stream.
    pub recording: bool,
}

impl GraphCache {
    /// Drops every graph: needed whenever an address they bake in (arena, metadata) moves.
    pub(crate) fn clear(&mut self) {
        for (_, c) in self.graphs.drain() {
            destroy(Some(c.exec), c.graph);
        }
        self.refused.clear();
    }

    /// Drops the graphs of another KV pool than `key`'s once the GPU has finished with them;
    /// before [`Self::replay`].
    pub(crate) fn serve_pool(&mut self, gpu: &Gpu, key: &GraphKey) -> Result<()> {
        if self.pool != key.kv {
            gpu.synchronize()?;
            self.clear();
            self.pool = key.kv;
        }
        Ok(())
    }

    /// Launches the graph recorded for `key`, if there is one ([`Self::serve_pool`] first): its
    /// output and the arena as the step left it. Nothing here waits on the GPU, so a caller may
    /// hold a lock that an abort needs around it.
    pub(crate) fn replay(
        &mut self,
        gpu: &Gpu,
        key: &GraphKey,
    ) -> Result<Option<(GraphOut, ArenaMark)>> {
        debug_assert_eq!(self.pool, key.kv, "serve_pool before replay");
        let Some(c) = self.graphs.get(key) else {
            return Ok(None);
        };
        let (exec, out, mark) = (c.exec, c.out, c.arena);
        launch(exec, gpu.cu_stream())?;
        self.replays += 1;
        Ok(Some((out, mark)))
    }

    /// Whether an earlier capture of `key` failed (it then runs eagerly).
    pub(crate) fn refused(&self, key: &GraphKey) -> bool {
        self.refused.contains(key)
    }

    pub(crate) fn refuse(&mut self, key: GraphKey) {
        self.refused.insert(key);
    }

    /// Keeps a captured step for replay.
    pub(crate) fn keep(
        &mut self,
        key: GraphKey,
        (exec, graph): (sys::CUgraphExec, sys::CUgraph),
        out: GraphOut,
        arena: ArenaMark,
    ) {
        self.graphs.insert(
            key,
            Captured {
                exec,
                graph,
                out,
                arena,
            },
        );
        self.captures += 1;
    }
}

unsafe impl Send for GraphCache {}

impl Drop for GraphCache {
    fn drop(&mut self) {
        self.clear();
    }
}

/// Starts recording what the stream is given, instead of running it.
pub(crate) fn begin_capture(stream: sys::CUstream, what: &str) -> Result<()> {
    unsafe {
        cu::stream::begin_capture(
            stream,
            sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
        )
    }
    .map_err(|e| driver_err(what, e))
}

/// Ends a recording; the raw result, so that callers decide what fails first.
pub(crate) fn end_capture(
    stream: sys::CUstream,
) -> std::result::Result<sys::CUgraph, cudarc::driver::DriverError> {
    unsafe { cu::stream::end_capture(stream) }
}

pub(crate) fn instantiate(
    graph: sys::CUgraph,
) -> std::result::Result<sys::CUgraphExec, cudarc::driver::DriverError> {
    unsafe { cu::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0)) }
}

pub(crate) fn launch(exec: sys::CUgraphExec, stream: sys::CUstream) -> Result<()> {
    unsafe { cu::graph::launch(exec, stream) }.map_err(|e| driver_err("graph launch", e))
}

/// Frees a graph and, if it was instantiated, its executable.
pub(crate) fn destroy(exec: Option<sys::CUgraphExec>, graph: sys::CUgraph) {
    unsafe {
        if let Some(exec) = exec {
            let _ = cu::graph::exec_destroy(exec);
        }
        let _ = cu::graph::destroy(graph);
    }
}

/// `CudaContext::time_graph`: here, beside the capture it shares with decode steps.
pub fn time_graph(gpu: &Gpu, reps: usize, f: &mut dyn FnMut() -> Result<()>) -> Result<f64> {
    let stream = gpu.cu_stream();
    let err = |what: &str, e: cudarc::driver::DriverError| driver_err(what, e);
    begin_capture(stream, "capture")?;
    let body = f();
    let graph = end_capture(stream).map_err(|e| err("capture end", e))?;
    body?;
    let exec = instantiate(graph).map_err(|e| err("instantiate", e))?;
    let mut times = Vec::with_capacity(reps);
    let run = || launch(exec, stream);
    run()?;
    gpu.synchronize()?;
    for _ in 0..reps {
        let t0 = std::time::Instant::now();
        run()?;
        gpu.synchronize()?;
        times.push(t0.elapsed().as_secs_f64());
    }
    destroy(Some(exec), graph);
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}
