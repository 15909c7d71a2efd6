//! Tensor parallelism's arithmetic (Megatron-LM's split): a model over `size` ranks, each holding
//! one shard. Column-parallel layers (q, k, v with their biases; gate and up) keep a contiguous
//! `1/size` of their output rows, so each rank owns whole attention heads (its share of the query
//! heads and of the KV heads, hence its own shard of the paged KV cache) and a slice of the
//! feed-forward width; row-parallel layers (o and down) keep the matching `1/size` of their input
//! columns, so each rank's output is a partial sum and one all-reduce per block half
//! ([`crate::Backend::all_reduce`]) makes it whole. Embeddings, norms and the output head are
//! replicated.
//!
//! The same shards run on one machine's CPUs (nibble-cpu's `tensor_parallel`: the arithmetic
//! checked against one rank) and are what a multi-GPU backend loads on each GPU.

use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use nibble_core::{Error, Result};
use nibble_formats::HostTensor;

use crate::config::ModelConfig;
use crate::source::TensorSource;
use crate::{Backend, Transformer};

/// Refuses a split that would not give each rank whole heads, whole KV heads and an equal
/// feed-forward slice; what it cannot cut in a weight (a quantization block) is refused when the
/// weight is read ([`ShardedSource`]).
pub fn check_split(config: &ModelConfig, size: usize) -> Result<()> {
    let refuse = |what: String| {
        Err(Error::unsupported(
            format!("tensor parallelism over {size} ranks"),
            what,
        ))
    };
    if size == 0 {
        return refuse("a tensor-parallel size must be at least 1".into());
    }
    // Mixture-of-experts layers split every expert (and the shared expert) the way a dense MLP
    // is split: each rank holds a slice of every expert's width, the router stays whole, so
    // every rank routes alike and the layer's output is a partial sum like a dense one's.
    let moe = config.moe.as_ref();
    for (field, n) in [
        ("num_attention_heads", Some(config.num_heads)),
        ("num_key_value_heads", Some(config.num_kv_heads)),
        ("intermediate_size", Some(config.intermediate_size)),
        (
            "moe_intermediate_size",
            moe.map(|m| m.expert_intermediate_size),
        ),
        (
            "shared_expert_intermediate_size",
            moe.and_then(|m| m.shared_expert_intermediate_size),
        ),
    ] {
        let Some(n) = n else { continue };
        if !n.is_multiple_of(size) {
            return refuse(format!(
                "{field} = {n} does not divide into {size} equal shards; pick a size that \
                 divides it"
            ));
        }
    }
    Ok(())
}

/// The configuration one rank's shard runs as: its heads, KV heads and feed-forward width.
pub fn shard_config(config: &ModelConfig, size: usize) -> Result<ModelConfig> {
    check_split(config, size)?;
    let mut c = config.clone();
    c.num_heads /= size;
    c.num_kv_heads /= size;
    c.intermediate_size /= size;
    if let Some(m) = c.moe.as_mut() {
        m.expert_intermediate_size /= size;
        m.shared_expert_intermediate_size = m.shared_expert_intermediate_size.map(|n| n / size);
    }
    Ok(c)
}

/// The tensors of rank `rank` of `size`, read from the whole model's source.
pub struct ShardedSource<'a> {
    inner: &'a dyn TensorSource,
    config: ModelConfig,
    rank: usize,
    size: usize,
    /// Whether an untied output head is split by vocabulary ([`ShardedSource::split_head`]).
    split_head: bool,
}

impl<'a> ShardedSource<'a> {
    pub fn new(
        inner: &'a dyn TensorSource,
        config: &ModelConfig,
        rank: usize,
        size: usize,
    ) -> Result<Self> {
        check_split(config, size)?;
        if rank >= size {
            return Err(Error::InvalidArgument(format!(
                "rank {rank} of a tensor-parallel group of {size}"
            )));
        }
        Ok(ShardedSource {
            inner,
            config: config.clone(),
            rank,
            size,
            split_head: false,
        })
    }

    /// Splits an untied output head by vocabulary (each rank computes its share of the logits
    /// and the ranks gather them) when `on` and the vocabulary divides: for backends that
    /// gather columns. A tied head stays whole (it is the embedding table every rank reads).
    pub fn split_head(mut self, on: bool) -> Self {
        self.split_head = on && self.config.vocab_size.is_multiple_of(self.size);
        self
    }

    /// How tensor `name` is split: by output rows or input columns of `len` in all, or not.
    fn split(&self, name: &str) -> Option<(bool, usize)> {
        let c = &self.config;
        let (qd, kvd, ff) = (c.q_dim(), c.kv_dim(), c.intermediate_size);
        let rows = |len| Some((true, len));
        let cols = |len| Some((false, len));
        if name == "lm_head.weight" && self.split_head {
            return rows(c.vocab_size);
        }
        let tail = name.split_once(".layers.").map(|(_, t)| t)?;
        let part = tail.split_once('.').map(|(_, p)| p)?;
        let moe = c.moe.as_ref();
        let expert_ff = moe.map_or(0, |m| m.expert_intermediate_size);
        let shared_ff = moe
            .and_then(|m| m.shared_expert_intermediate_size)
            .unwrap_or(0);
        // A routed expert's projection: `mlp.experts.E.*` (Qwen) or
        // `block_sparse_moe.experts.E.w1|w3|w2` (Mixtral).
        let expert = ["mlp.experts.", "block_sparse_moe.experts."]
            .iter()
            .find_map(|pre| part.strip_prefix(pre))
            .and_then(|rest| rest.split_once('.'))
            .filter(|(e, _)| e.parse::<usize>().is_ok())
            .map(|(_, proj)| proj);
        if let Some(proj) = expert {
            return match proj {
                "gate_proj.weight" | "up_proj.weight" | "w1.weight" | "w3.weight" => {
                    rows(expert_ff)
                }
                "down_proj.weight" | "w2.weight" => cols(expert_ff),
                _ => None,
            };
        }
        match part {
            "self_attn.q_proj.weight" | "self_attn.q_proj.bias" => rows(qd),
            "self_attn.k_proj.weight" | "self_attn.k_proj.bias" => rows(kvd),
            "self_attn.v_proj.weight" | "self_attn.v_proj.bias" => rows(kvd),
            "mlp.gate_proj.weight" | "mlp.up_proj.weight" => rows(ff),
            "self_attn.o_proj.weight" => cols(qd),
            "mlp.down_proj.weight" => cols(ff),
            "mlp.shared_expert.gate_proj.weight" | "mlp.shared_expert.up_proj.weight" => {
                rows(shared_ff)
            }
            "mlp.shared_expert.down_proj.weight" => cols(shared_ff),
            _ => None,
        }
    }

    fn range(&self, len: usize) -> (usize, usize) {
        let each = len / self.size;
        (self.rank * each, (self.rank + 1) * each)
    }
}

impl TensorSource for ShardedSource<'_> {
    fn get(&self, name: &str) -> Option<HostTensor> {
        match self.split(name) {
            None => self.inner.get(name),
            // A tensor that cannot be cut reads as missing here; `check_cuts` says why first.
            Some((by_rows, len)) => {
                let (a, b) = self.range(len);
                self.inner.get_part(name, by_rows, a, b)?.ok()
            }
        }
    }
    fn contains(&self, name: &str) -> bool {
        self.inner.contains(name)
    }
    fn layout_of(&self, name: &str) -> Option<(Vec<usize>, nibble_formats::WeightFormat)> {
        let (mut shape, format) = self.inner.layout_of(name)?;
        if let (Some((by_rows, len)), 2) = (self.split(name), shape.len()) {
            let (a, b) = self.range(len);
            shape[usize::from(!by_rows)] = b - a;
        }
        Some((shape, format))
    }
    fn origin(&self) -> String {
        format!(
            "{} (tensor-parallel rank {} of {})",
            self.inner.origin(),
            self.rank,
            self.size
        )
    }
}

impl ShardedSource<'_> {
    /// The first column cut this split cannot make (through a quantization block, or in a
    /// format that cannot be cut by columns), naming the tensor; checked before loading, where a
    /// failed cut would otherwise read as a missing tensor. Row cuts never fail, and every rank's
    /// column cut starts on a multiple of its width, so one rank's check holds for all. Reads
    /// no weight data.
    pub fn check_cuts(&self) -> Result<()> {
        let experts = self.config.moe.as_ref().map_or(0, |m| m.num_experts);
        for i in 0..self.config.num_layers {
            let p = format!("model.layers.{i}");
            let mut parts = vec![
                format!("{p}.self_attn.o_proj.weight"),
                format!("{p}.mlp.down_proj.weight"),
                format!("{p}.mlp.shared_expert.down_proj.weight"),
            ];
            parts.extend((0..experts).map(|e| {
                let [_, _, down] = crate::transformer::expert_names(self.config.arch, &p, e);
                format!("{down}.weight")
            }));
            for name in parts {
                if let (Some((_, len)), Some((shape, format))) =
                    (self.split(&name), self.inner.layout_of(&name))
                {
                    let (a, b) = self.range(len);
                    HostTensor::check_col_cut_of(&name, &shape, format, a, b)?;
                }
            }
        }
        Ok(())
    }
}

/// How long a rank waits for the others at an all-reduce before it gives up with an error (a
/// rank that died would otherwise hang the rest). Long enough for ranks that finish loading a
/// 70B shard minutes apart to meet at their first agreement.
const ALL_REDUCE_TIMEOUT: Duration = Duration::from_secs(600);

/// The all-reduce of `size` ranks in one process, on the host: each contributes its tensor, the
/// last to arrive sums them in rank order (so every rank gets the same bits), and all copy the
/// sum out.
pub struct HostComm {
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

impl HostComm {
    pub fn new(size: usize) -> Arc<HostComm> {
        Arc::new(HostComm {
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

    /// Waits until every rank has arrived (or one failed: an error).
    pub fn barrier(&self, rank: usize) -> Result<()> {
        self.all_reduce(rank, &mut [0.0])
    }

    /// Every rank's `part` (all of one length), concatenated in rank order, on every rank.
    pub fn all_gather(&self, rank: usize, part: &[f32]) -> Result<Vec<f32>> {
        // Each part in its own slot, zeros elsewhere: the rank-order sum is the parts exactly
        // (up to the sign of a zero).
        let mut slots = vec![0f32; part.len() * self.size()];
        slots[rank * part.len()..(rank + 1) * part.len()].copy_from_slice(part);
        self.all_reduce(rank, &mut slots)?;
        Ok(slots)
    }

    /// The smallest of the ranks' `value`s, on every rank: what the ranks must agree on before
    /// they act alike, e.g. how many KV blocks each GPU's pool holds (their free memory differs
    /// by a little, and ranks whose schedulers saw different pools would part ways).
    pub fn agree_min(&self, rank: usize, value: usize) -> Result<usize> {
        // Each rank's value in its own slot, exact in f32 below 2^24; the sum gathers them all.
        let (hi, lo) = ((value >> 24) as f32, (value & 0xFF_FFFF) as f32);
        let mut slots = vec![0f32; 2 * self.size()];
        slots[2 * rank] = hi;
        slots[2 * rank + 1] = lo;
        self.all_reduce(rank, &mut slots)?;
        Ok(slots
            .chunks_exact(2)
            .map(|p| ((p[0] as usize) << 24) | p[1] as usize)
            .min()
            .unwrap_or(value))
    }
}

/// Runs `body` on every rank of a `size`-way split of the model in `source`, each on its own
/// thread with the backend `make_backend(rank)` makes there and its shard loaded on it (handed
/// over, so a rank can build an engine of it), and returns each rank's result in rank order.
/// A rank that fails or panics calls `abort` with the reason (once its body has returned, its
/// backend dropped), so the others' collectives end with an error instead of waiting for it; the
/// first failure is the error returned.
pub fn run_ranks<B: Backend, R: Send>(
    size: usize,
    source: &dyn TensorSource,
    config: &ModelConfig,
    make_backend: impl Fn(usize) -> Result<B> + Sync,
    abort: impl Fn(&str) + Sync,
    body: impl Fn(usize, B, Transformer<B>) -> Result<R> + Sync,
) -> Result<Vec<R>> {
    let shard = shard_config(config, size)?;
    ShardedSource::new(source, config, 0, size)?.check_cuts()?;
    let results: Vec<Result<R>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..size)
            .map(|rank| {
                let (shard, make_backend, abort, body) =
                    (shard.clone(), &make_backend, &abort, &body);
                scope.spawn(move || {
                    let run = || -> Result<R> {
                        let be = make_backend(rank)?;
                        let src = ShardedSource::new(source, config, rank, size)?
                            .split_head(be.gathers_columns());
                        let model = Transformer::load(&be, shard, &src, &mut |_, _| {})?;
                        body(rank, be, model)
                    };
                    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(run)) {
                        Ok(Ok(r)) => Ok(r),
                        Ok(Err(e)) => {
                            abort(&format!("rank {rank} failed: {e}"));
                            Err(e)
                        }
                        Err(_) => {
                            abort(&format!("rank {rank} panicked"));
                            Err(Error::InvalidArgument(format!(
                                "tensor-parallel rank {rank} panicked"
                            )))
                        }
                    }
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
    });
    // The first rank's own failure, not a peer's "abandoned" echo of it, where there is one.
    let mut first_err = None;
    let mut out = Vec::with_capacity(size);
    for r in results {
        match r {
            Ok(v) => out.push(v),
            Err(e) => {
                let echo = e.to_string().contains("abandoned");
                if first_err
                    .as_ref()
                    .is_none_or(|(was_echo, _)| *was_echo && !echo)
                {
                    first_err = Some((echo, e));
                }
            }
        }
    }
    match first_err {
        Some((_, e)) => Err(e),
        None => Ok(out),
    }
}
