//! COMET's FMPQ (W4A4A8): INT4 weights per group; activations in channel blocks of the group
//! size, INT8 for the blocks holding outlier channels and INT4 for the rest, after a channel
//! permutation that gathers the outliers into the leading blocks (`Mixed4x8` makes the first
//! `int8_blocks` blocks INT8).
//!
//! **Outlier criterion** (the paper leaves it open): channel `c` of an input site is an outlier
//! when its calibration `max|x_c|` exceeds [`OUTLIER_RATIO`] times the site's median channel
//! max. In an INT4 block the step is `max|x_b| / 7`, so a channel [`OUTLIER_RATIO`] times the
//! typical one leaves the typical channels fewer than `7 / OUTLIER_RATIO` levels; those blocks
//! go INT8. A site's `int8_blocks` is the smallest number of leading blocks holding all of its
//! outliers in the permuted order.
//!
//! **Permutations**, each folded into the weights (see [`crate::permute`]):
//! * down_proj's input, per layer: channels sorted by `max|x|` descending (gate/up rows, down
//!   columns), so the outliers fill `ceil(outliers / block)` blocks exactly and the INT4 blocks
//!   hold channels of similar range.
//! * the residual stream (read by q/k/v and gate/up): one permutation for all layers, since the
//!   stream is shared. Channels are sorted by their largest ratio `max|x_c| / median` over every
//!   layer's two sites; each site then takes its own `int8_blocks` in that shared order. Norm
//!   gains are permuted along, so nothing is folded or untied.
//! * o_proj's input: only whole heads can move (KV heads with their query heads, query heads
//!   inside their KV group) plus one dim order per value head shared by its query heads (folded
//!   into v_proj rows). Dims are sorted by their largest ratio over the group's query heads,
//!   KV groups with more outlier heads go first and, inside a group, heads whose outliers
//!   reach furthest into the head go first, so the outliers end as early as these moves allow.
//!
//! **Weights**: `Int4Group { group }` per output row with the clip ratio minimizing the layer's
//! output error under the layer's own mixed activation quantization.
//!
//! **Mixture-of-experts blocks**: the router reads the residual stream and takes its
//! permutation like q/k/v; every expert's gate/up takes the INT8 block count of the block's MLP
//! input over all its tokens (an outlier channel is one wherever it is routed); each expert's
//! down_proj input is permuted and planned on its own routed rows. An expert routed fewer than
//! [`crate::search::MIN_EXPERT_TOKENS`] calibration tokens keeps its down_proj input order with
//! every block INT4 and clip 1, as RTN encodes it.

use std::collections::BTreeMap;

use nibble_core::{Error, Result};
use nibble_precision::{LinearScheme, PrecisionSpec};

use crate::dense::{DenseModel, LinearId, LinearKind, Site, SiteKind};
use crate::permute::{HeadPermutation, permute_down_input, permute_residual, sort_desc};
use crate::pipeline::{Method, QuantOptions, QuantizedModel};
use crate::qoq::site_mut;
use crate::sim::{Sites, calibrate, clip_and_encode, clip_grid};

/// A channel whose calibration max exceeds this multiple of its site's median channel max is an
/// outlier and goes to an INT8 block. Measured on SmolLM2-135M (w4a4a8-g64, 8x256 calibration
/// tokens, simulated perplexity on 6x256 held-out ShareGPT tokens, float 6.85): 8 keeps 4.5% of
/// channels INT8 at perplexity 13.8, 4 keeps 8.2% at 10.7 (all-INT4 RTN: 27.7). COMET reports
/// about 16% INT8 on Llama-class models.
pub const OUTLIER_RATIO: f32 = 4.0;

/// The median of the values (the upper one for an even count).
fn median(v: &[f32]) -> f32 {
    let mut s = v.to_vec();
    s.sort_by(f32::total_cmp);
    s.get(s.len() / 2).copied().unwrap_or(0.0)
}

/// `max|x_c| / median` per channel; a dead site (median 0) rates its live channels infinite.
pub fn outlier_score(absmax: &[f32]) -> Vec<f32> {
    let med = median(absmax);
    absmax
        .iter()
        .map(|&a| {
            if med > 0.0 {
                a / med
            } else if a > 0.0 {
                f32::INFINITY
            } else {
                0.0
            }
        })
        .collect()
}

/// The smallest number of leading `block`-channel blocks holding every channel whose score
/// exceeds `ratio`, given the scores in the (already permuted) channel order.
pub fn int8_blocks_needed(score: &[f32], block: usize, ratio: f32) -> usize {
    score
        .iter()
        .rposition(|&s| s > ratio)
        .map_or(0, |last| (last + 1).div_ceil(block))
}

/// The per-site number of INT8 blocks chosen by [`plan_and_permute`] (a sparse block's MLP
/// input once, for every expert).
pub type Int8Blocks = BTreeMap<Site, usize>;

/// The INT8 blocks of the input `id` reads (none planned: an expert calibration (nearly)
/// never routed to, all INT4 as RTN has it).
pub fn int8_blocks_of(blocks: &Int8Blocks, id: LinearId) -> usize {
    let site = match id.kind {
        LinearKind::Down => id.input(),
        _ => Site::dense(id.layer, id.kind.site()),
    };
    blocks.get(&site).copied().unwrap_or(0)
}

/// Permutes `model` (and the calibration view) so outliers lead, and returns every site's
/// number of INT8 blocks of `block` channels.
pub fn plan_and_permute(
    model: &mut DenseModel,
    sites: &mut Sites,
    block: usize,
    ratio: f32,
) -> Result<Int8Blocks> {
    let layers = model.layers.len();
    let mut blocks = Int8Blocks::new();

    // The residual stream: one order for every layer.
    let residual = [SiteKind::AttnIn, SiteKind::MlpIn];
    let mut score = vec![0f32; model.config.hidden_size];
    for layer in 0..layers {
        for site in residual {
            let s = outlier_score(&site_mut(sites, layer, site)?.absmax);
            score.iter_mut().zip(s).for_each(|(a, b)| *a = a.max(b));
        }
    }
    let perm = sort_desc(&score);
    permute_residual(model, &perm)?;
    for layer in 0..layers {
        for site in residual {
            let data = site_mut(sites, layer, site)?;
            data.permute(&perm);
            let n = int8_blocks_needed(&outlier_score(&data.absmax), block, ratio);
            blocks.insert(Site::dense(layer, site), n);
        }
    }
    // Each expert's share of a sparse block's MLP input is the same residual channels.
    for (_, data) in sites
        .iter_mut()
        .filter(|(s, _)| s.kind == SiteKind::MlpIn && s.expert.is_some())
    {
        data.permute(&perm);
    }

    for site in model.sites() {
        if site.kind != SiteKind::DownIn {
            continue;
        }
        let data = match site.expert {
            None => site_mut(sites, site.layer, SiteKind::DownIn)?,
            Some(_) => match sites.get_mut(&site) {
                Some(d) if d.tokens >= crate::search::MIN_EXPERT_TOKENS => d,
                _ => continue,
            },
        };
        let perm = sort_desc(&data.absmax);
        permute_down_input(model, site.layer, site.expert, &perm)?;
        data.permute(&perm);
        let n = int8_blocks_needed(&outlier_score(&data.absmax), block, ratio);
        blocks.insert(site, n);
    }

    for layer in 0..layers {
        let data = site_mut(sites, layer, SiteKind::OIn)?;
        let hp = head_permutation(model, &outlier_score(&data.absmax), ratio);
        hp.apply(model, layer)?;
        data.permute(&hp.o_input(model));
        let n = int8_blocks_needed(&outlier_score(&data.absmax), block, ratio);
        blocks.insert(Site::dense(layer, SiteKind::OIn), n);
    }
    Ok(blocks)
}

/// The head and within-head order of o_proj's input that ends its outliers earliest, from the
/// per-channel scores of o_proj's input (`q_dim`, in the layer's current order).
fn head_permutation(model: &DenseModel, score: &[f32], ratio: f32) -> HeadPermutation {
    let c = &model.config;
    let (hd, group) = (c.head_dim, c.num_heads / c.num_kv_heads);
    // Per KV head, dims by their largest score over the group's query heads.
    let within: Vec<Vec<usize>> = (0..c.num_kv_heads)
        .map(|kv| {
            let s: Vec<f32> = (0..hd)
                .map(|d| {
                    (0..group)
                        .map(|g| score[((kv * group + g) * hd) + d])
                        .fold(0f32, f32::max)
                })
                .collect();
            sort_desc(&s)
        })
        .collect();
    // How far into its (reordered) head each query head's outliers reach.
    let reach: Vec<usize> = (0..c.num_heads)
        .map(|q| {
            let order = &within[q / group];
            order
                .iter()
                .rposition(|&d| score[q * hd + d] > ratio)
                .map_or(0, |p| p + 1)
        })
        .collect();
    let mut heads_of: Vec<Vec<usize>> = (0..c.num_kv_heads)
        .map(|kv| {
            let mut qs: Vec<usize> = (kv * group..(kv + 1) * group).collect();
            qs.sort_by(|&a, &b| reach[b].cmp(&reach[a]).then(a.cmp(&b)));
            qs
        })
        .collect();
    let key = |kv: usize| {
        let qs = &heads_of[kv];
        (
            qs.iter().filter(|&&q| reach[q] > 0).count(),
            qs.iter().map(|&q| reach[q]).sum::<usize>(),
        )
    };
    let mut kv_heads: Vec<usize> = (0..c.num_kv_heads).collect();
    kv_heads.sort_by(|&a, &b| key(b).cmp(&key(a)).then(a.cmp(&b)));
    let q_heads = kv_heads
        .iter()
        .flat_map(|&kv| std::mem::take(&mut heads_of[kv]))
        .collect();
    let within = kv_heads.iter().map(|&kv| within[kv].clone()).collect();
    HeadPermutation {
        kv_heads,
        q_heads,
        within,
    }
}

pub fn quantize(
    model: DenseModel,
    spec: PrecisionSpec,
    calibration: &[Vec<u32>],
    opts: &QuantOptions,
    progress: &mut dyn FnMut(&str, usize, usize),
) -> Result<QuantizedModel> {
    quantize_with(model, spec, calibration, opts, OUTLIER_RATIO, progress)
}

/// FMPQ with outlier threshold `ratio` (see [`OUTLIER_RATIO`]).
pub fn quantize_with(
    mut model: DenseModel,
    spec: PrecisionSpec,
    calibration: &[Vec<u32>],
    opts: &QuantOptions,
    ratio: f32,
    progress: &mut dyn FnMut(&str, usize, usize),
) -> Result<QuantizedModel> {
    if !(ratio.is_finite() && ratio > 1.0) {
        return Err(Error::InvalidArgument(format!(
            "an outlier threshold of {ratio} times the median is not above 1"
        )));
    }
    let LinearScheme::W4A4A8 { group } = spec.linear else {
        return Err(Error::InvalidArgument(format!(
            "FMPQ quantizes to w4a4a8-gN, not {}",
            spec.linear
        )));
    };
    let (_, mut sites) = calibrate(&model, calibration, opts.threads, &mut |d, t| {
        progress("fmpq: calibrate", d, t)
    })?;
    let blocks = plan_and_permute(&mut model, &mut sites, group as usize, ratio)?;
    progress("fmpq: permute", 1, 1);
    let format_of = |id: LinearId| {
        let n = int8_blocks_of(&blocks, id);
        spec.linear
            .linear_format(n as u16)
            .expect("w4a4a8 is a quantized scheme")
    };
    let linears = clip_and_encode(&model, &sites, &format_of, &clip_grid(), &mut |d, t| {
        progress("fmpq: clip and encode", d, t)
    })?;
    Ok(QuantizedModel {
        spec,
        method: Method::Fmpq,
        dense: model,
        linears,
    })
}
