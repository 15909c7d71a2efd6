//! Channel permutations folded into the weights, so that channels can be regrouped for
//! quantization (QoQ's reordering, COMET's outlier blocks) at no run-time cost.
//!
//! Convention everywhere: after applying `perm`, channel `j` is channel `perm[j]` of before.
//!
//! * The residual stream: a permutation matrix is orthogonal and commutes with RMSNorm when the
//!   norm gains are permuted with it, so norms need not be folded and a tied head stays tied.
//! * down_proj's input `silu(gate) * up` is elementwise: permuting gate and up rows permutes it.
//! * o_proj's input is the concatenated attention heads. A channel there is `(query head,
//!   dim)`, and the dim comes from v_proj's row of the head's KV group, so within a head only a
//!   permutation shared by all query heads of a KV group can be folded (into v_proj's rows).
//!   Whole heads can move too: KV heads with their q/k/v rows, and query heads inside their KV
//!   group (attention is computed per head, and a query head must keep its KV head).

use nibble_core::{Error, Result};

use crate::dense::{DenseModel, Expert, LinearKind};

/// Checks that `perm` is a permutation of `0..n`.
pub fn check_perm(perm: &[usize], n: usize, what: &str) -> Result<()> {
    let mut seen = vec![false; n];
    if perm.len() != n
        || !perm
            .iter()
            .all(|&p| p < n && !std::mem::replace(&mut seen[p], true))
    {
        return Err(Error::InvalidArgument(format!(
            "{what}: not a permutation of {n} channels"
        )));
    }
    Ok(())
}

fn permute_vec(v: &mut Vec<f32>, perm: &[usize]) {
    *v = perm.iter().map(|&p| v[p]).collect();
}

/// The channel order that sorts `score` descending (ties by index, so it is deterministic).
pub fn sort_desc(score: &[f32]) -> Vec<usize> {
    let mut perm: Vec<usize> = (0..score.len()).collect();
    perm.sort_by(|&a, &b| score[b].total_cmp(&score[a]).then(a.cmp(&b)));
    perm
}

/// Permutes the residual stream's channels: embedding and head columns, norm gains, readers'
/// input columns (q/k/v, gate/up) and writers' output rows (o_proj, down_proj).
pub fn permute_residual(model: &mut DenseModel, perm: &[usize]) -> Result<()> {
    check_perm(perm, model.config.hidden_size, "residual permutation")?;
    model.embed.permute_cols(perm);
    if let Some(head) = &mut model.lm_head {
        head.permute_cols(perm);
    }
    permute_vec(&mut model.final_norm, perm);
    for l in &mut model.layers {
        permute_vec(&mut l.attn_norm, perm);
        permute_vec(&mut l.mlp_norm, perm);
        for m in l.residual_readers_mut() {
            m.permute_cols(perm);
        }
        for m in l.residual_writers_mut() {
            m.permute_rows(perm);
        }
    }
    Ok(())
}

/// Permutes down_proj's input channels in `layer` (gate and up rows, down columns), of the
/// dense MLP or of one expert.
pub fn permute_down_input(
    model: &mut DenseModel,
    layer: usize,
    expert: Option<Expert>,
    perm: &[usize],
) -> Result<()> {
    let l = model
        .layers
        .get_mut(layer)
        .ok_or_else(|| Error::InvalidArgument(format!("no layer {layer}")))?;
    let width = l
        .linear(LinearKind::Down, expert)
        .ok_or_else(|| Error::InvalidArgument(format!("layer {layer} has no MLP {expert:?}")))?
        .cols;
    check_perm(perm, width, "down_proj input permutation")?;
    for kind in [LinearKind::Gate, LinearKind::Up] {
        l.linear_mut(kind, expert)
            .expect("a down_proj has its gate and up")
            .permute_rows(perm);
    }
    l.linear_mut(LinearKind::Down, expert)
        .expect("checked above")
        .permute_cols(perm);
    Ok(())
}

/// A permutation of one layer's attention heads and of the dims inside its value heads.
#[derive(Debug, Clone, PartialEq)]
pub struct HeadPermutation {
    /// New KV head slot `s` holds old KV head `kv_heads[s]`.
    pub kv_heads: Vec<usize>,
    /// New query head slot `s` holds old query head `q_heads[s]`; it must belong to the KV head
    /// now in slot `s / group`.
    pub q_heads: Vec<usize>,
    /// Per new KV slot, the order of the dims of its value head (shared by its query heads).
    pub within: Vec<Vec<usize>>,
}

impl HeadPermutation {
    pub fn identity(model: &DenseModel) -> HeadPermutation {
        let c = &model.config;
        HeadPermutation {
            kv_heads: (0..c.num_kv_heads).collect(),
            q_heads: (0..c.num_heads).collect(),
            within: vec![(0..c.head_dim).collect(); c.num_kv_heads],
        }
    }

    fn check(&self, model: &DenseModel) -> Result<()> {
        let c = &model.config;
        let group = c.num_heads / c.num_kv_heads;
        check_perm(&self.kv_heads, c.num_kv_heads, "KV head permutation")?;
        check_perm(&self.q_heads, c.num_heads, "query head permutation")?;
        if self.within.len() != c.num_kv_heads {
            return Err(Error::InvalidArgument(
                "one within-head order per KV head".into(),
            ));
        }
        for w in &self.within {
            check_perm(w, c.head_dim, "within-head permutation")?;
        }
        for (s, &q) in self.q_heads.iter().enumerate() {
            if q / group != self.kv_heads[s / group] {
                return Err(Error::InvalidArgument(format!(
                    "query head {q} moved to slot {s}, away from its KV head"
                )));
            }
        }
        Ok(())
    }

    /// The induced permutation of o_proj's input channels (`q_dim`).
    pub fn o_input(&self, model: &DenseModel) -> Vec<usize> {
        let c = &model.config;
        let (hd, group) = (c.head_dim, c.num_heads / c.num_kv_heads);
        (0..c.q_dim())
            .map(|j| {
                let (slot, d) = (j / hd, j % hd);
                self.q_heads[slot] * hd + self.within[slot / group][d]
            })
            .collect()
    }

    /// Applies the permutation to layer `layer`: q rows and bias by query head, k rows and bias
    /// by KV head, v rows and bias by KV head and within-head order, o columns by both.
    pub fn apply(&self, model: &mut DenseModel, layer: usize) -> Result<()> {
        self.check(model)?;
        let c = model.config.clone();
        let hd = c.head_dim;
        let q_rows: Vec<usize> = (0..c.q_dim())
            .map(|j| self.q_heads[j / hd] * hd + j % hd)
            .collect();
        let k_rows: Vec<usize> = (0..c.kv_dim())
            .map(|j| self.kv_heads[j / hd] * hd + j % hd)
            .collect();
        let v_rows: Vec<usize> = (0..c.kv_dim())
            .map(|j| self.kv_heads[j / hd] * hd + self.within[j / hd][j % hd])
            .collect();
        let o_cols = self.o_input(model);
        let l = &mut model.layers[layer];
        l.q.permute_rows(&q_rows);
        l.k.permute_rows(&k_rows);
        l.v.permute_rows(&v_rows);
        l.o.permute_cols(&o_cols);
        for (b, rows) in [
            (&mut l.q_bias, &q_rows),
            (&mut l.k_bias, &k_rows),
            (&mut l.v_bias, &v_rows),
        ] {
            if let Some(b) = b {
                permute_vec(b, rows);
            }
        }
        Ok(())
    }
}
