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

use nibble_core::{Error, Result};
use nibble_formats::HostTensor;

use crate::config::ModelConfig;
use crate::source::TensorSource;

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
    if config.moe.is_some() {
        return refuse(
            "mixture-of-experts layers are not split yet (experts would be spread over ranks)"
                .into(),
        );
    }
    for (field, n) in [
        ("num_attention_heads", config.num_heads),
        ("num_key_value_heads", config.num_kv_heads),
        ("intermediate_size", config.intermediate_size),
    ] {
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
    Ok(c)
}

/// The tensors of rank `rank` of `size`, read from the whole model's source.
pub struct ShardedSource<'a> {
    inner: &'a dyn TensorSource,
    config: ModelConfig,
    rank: usize,
    size: usize,
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
        })
    }

    /// How tensor `name` is split: by output rows or input columns of `len` in all, or not.
    fn split(&self, name: &str) -> Option<(bool, usize)> {
        let c = &self.config;
        let (qd, kvd, ff) = (c.q_dim(), c.kv_dim(), c.intermediate_size);
        let rows = |len| Some((true, len));
        let cols = |len| Some((false, len));
        let tail = name.split_once(".layers.").map(|(_, t)| t)?;
        let part = tail.split_once('.').map(|(_, p)| p)?;
        match part {
            "self_attn.q_proj.weight" | "self_attn.q_proj.bias" => rows(qd),
            "self_attn.k_proj.weight" | "self_attn.k_proj.bias" => rows(kvd),
            "self_attn.v_proj.weight" | "self_attn.v_proj.bias" => rows(kvd),
            "mlp.gate_proj.weight" | "mlp.up_proj.weight" => rows(ff),
            "self_attn.o_proj.weight" => cols(qd),
            "mlp.down_proj.weight" => cols(ff),
            _ => None,
        }
    }

    fn shard(&self, t: HostTensor, by_rows: bool, len: usize) -> nibble_core::Result<HostTensor> {
        let each = len / self.size;
        let (a, b) = (self.rank * each, (self.rank + 1) * each);
        if by_rows {
            t.slice_rows(a, b)
        } else {
            t.slice_cols(a, b)
        }
    }
}

impl TensorSource for ShardedSource<'_> {
    fn get(&self, name: &str) -> Option<HostTensor> {
        let t = self.inner.get(name)?;
        match self.split(name) {
            None => Some(t),
            // A tensor that cannot be cut reads as missing here; `get_checked` says why.
            Some((by_rows, len)) => self.shard(t, by_rows, len).ok(),
        }
    }
    fn contains(&self, name: &str) -> bool {
        self.inner.contains(name)
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
        for i in 0..self.config.num_layers {
            for part in ["self_attn.o_proj.weight", "mlp.down_proj.weight"] {
                let name = format!("model.layers.{i}.{part}");
                if let (Some((_, len)), Some(t)) = (self.split(&name), self.inner.get(&name)) {
                    let each = len / self.size;
                    t.check_col_cut(self.rank * each, (self.rank + 1) * each)?;
                }
            }
        }
        Ok(())
    }
}
