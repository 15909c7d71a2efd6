//! Decode steps as CUDA graphs. A decode step is hundreds of small launches whose gaps would
//! cost a large share of the step at batch 1; replaying a captured graph removes them.
//!
//! What makes replay valid: every op of a forward reads its integers (token ids, positions,
//! block tables) from one device buffer that `begin_forward` refills before the step, and every
//! activation comes from the arena, which hands out the same addresses for the same sequence of
//! allocations. So a graph is keyed by what changes kernel arguments or grid sizes: the model,
//! the KV pool, the number of sequences and the padded block-table width.

use std::collections::{HashMap, HashSet};

use cudarc::driver::result as cu;
use cudarc::driver::sys;
use nibble_core::Result;
use nibble_model::BatchLayout;

use crate::backend::{CudaBackend, CudaTensor, Elem};
use crate::runtime::{ArenaMark, DevicePtr, driver_err};

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

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GraphKey {
    model: usize,
    kv: u64,
    seqs: usize,
    max_blocks: usize,
}

struct Captured {
    exec: sys::CUgraphExec,
    graph: sys::CUgraph,
    out: (DevicePtr, usize, usize, Elem),
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
            unsafe {
                let _ = cu::graph::exec_destroy(c.exec);
                let _ = cu::graph::destroy(c.graph);
            }
        }
        self.refused.clear();
    }
}

unsafe impl Send for GraphCache {}

impl Drop for GraphCache {
    fn drop(&mut self) {
        self.clear();
    }
}

/// Runs one forward pass, through a graph when it is a decode step.
pub fn run_forward(
    be: &CudaBackend,
    model: usize,
    kv_id: u64,
    batch: &BatchLayout,
    body: &mut dyn FnMut() -> Result<CudaTensor>,
) -> Result<CudaTensor> {
    let decode = !batch.seqs.is_empty()
        && batch.seqs.len() <= GRAPH_MAX_SEQS
        && batch.seqs.iter().all(|s| s.len == 1);
    if !be.graphs_enabled || !decode {
        return body();
    }
    let key = GraphKey {
        model,
        kv: kv_id,
        seqs: batch.seqs.len(),
        max_blocks: be.with_meta(|m| m.max_blocks),
    };
    {
        let mut st = be.lock();
        if st.graphs.pool != kv_id {
            be.gpu.synchronize()?;
            st.graphs.clear();
            st.graphs.pool = kv_id;
        }
        if let Some(c) = st.graphs.graphs.get(&key) {
            let (exec, out, mark) = (c.exec, c.out, c.arena);
            unsafe { cu::graph::launch(exec, be.gpu.cu_stream()) }
                .map_err(|e| driver_err("graph launch", e))?;
            st.graphs.replays += 1;
            st.arena.restore(mark);
            let epoch = st.arena.epoch;
            return Ok(CudaTensor::view(out.0, out.1, out.2, out.3, epoch));
        }
        // Recorded at first sight once the arena has its size (the engine's warm-up gives it
        // the largest step's); before that, steps run eagerly and size it.
        if st.graphs.refused.contains(&key) || !st.arena.settled() {
            drop(st);
            return body();
        }
    }
    let stream = be.gpu.cu_stream();
    unsafe {
        cu::stream::begin_capture(
            stream,
            sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
        )
    }
    .map_err(|e| driver_err("graph capture", e))?;
    be.lock().graphs.recording = true;
    let out = body();
    be.lock().graphs.recording = false;
    let graph = unsafe { cu::stream::end_capture(stream) };
    let out = out?;
    let graph = graph.map_err(|e| driver_err("graph capture end", e))?;
    let exec = unsafe { cu::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0)) };
    let exec = match exec {
        Ok(e) => e,
        Err(e) => {
            unsafe {
                let _ = cu::graph::destroy(graph);
            }
            be.lock().graphs.refused.insert(key);
            return Err(driver_err("graph instantiate", e));
        }
    };
    // Capture records without running: run it now.
    unsafe { cu::graph::launch(exec, stream) }.map_err(|e| driver_err("graph launch", e))?;
    let mut st = be.lock();
    if st.arena.settled() {
        let arena = st.arena.mark();
        st.graphs.graphs.insert(
            key,
            Captured {
                exec,
                graph,
                out: (out.ptr, out.rows, out.cols, out.elem),
                arena,
            },
        );
        st.graphs.captures += 1;
    } else {
        // The step outgrew the arena while capturing: its extra buffers go at the next reset,
        // so this graph must not be replayed. It has run; destroy it once it finished.
        drop(st);
        be.gpu.synchronize()?;
        unsafe {
            let _ = cu::graph::exec_destroy(exec);
            let _ = cu::graph::destroy(graph);
        }
    }
    Ok(out)
}
