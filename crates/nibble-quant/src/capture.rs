//! Calibration: the ordinary `Transformer` runs over calibration text on the CPU backend with
//! hooks ([`crate::hooked`]) that record what every linear layer reads, so the statistics come from exactly
//! the forward pass nibble serves with (same rotary, attention, norms).
//!
//! Per input site (see [`SiteKind`]) of every block it keeps the channel-wise max and mean of
//! |x|, optionally the Gram matrix `X^T X` (GPTQ's Hessian), and an evenly strided sample of
//! input rows (for searches that replay a layer: AWQ scales, clipping). Per layer it keeps the
//! channel-wise max |K| of the rotary-embedded keys (SmoothAttention), and optionally whole
//! sequences' attention inputs (SmoothAttention's strength search).

use std::collections::HashMap;
use std::sync::Mutex;

use nibble_core::Result;
use nibble_cpu::{CpuBackend, CpuTensor};
use nibble_model::{BatchLayout, LogitRows, Transformer};

use crate::dense::{DenseModel, Expert, LinearId, LinearKind, Mat, Site, SiteKind};
use crate::hooked::{Hooked, Hooks};

#[derive(Debug, Clone, Copy)]
pub struct CaptureOptions {
    /// Accumulate `X^T X` per site (k x k f64 each; needed by GPTQ only).
    pub hessian: bool,
    /// Keep at most this many input rows per site.
    pub max_samples: usize,
    /// Keep every `sample_stride`-th token's input row.
    pub sample_stride: usize,
    /// Also keep every sequence's first token's row (the attention sink), whatever the stride.
    pub sample_first: bool,
    /// Keep every layer's whole attention inputs (rotary-embedded queries and keys, values) of
    /// this many of the first sequences ([`Calibration::attention`]).
    pub attention_sequences: usize,
    /// With `hessian`: only the sites of layers `start..end` get one (GPTQ over a big model
    /// captures its Hessians a window of layers at a time; `None`: every layer).
    pub hessian_layers: Option<(usize, usize)>,
}

impl Default for CaptureOptions {
    fn default() -> Self {
        CaptureOptions {
            hessian: false,
            max_samples: 1024,
            sample_stride: 4,
            sample_first: false,
            attention_sequences: 0,
            hessian_layers: None,
        }
    }
}

/// What one linear-layer input looked like over the calibration set.
#[derive(Debug, Clone)]
pub struct SiteStats {
    pub tokens: usize,
    pub absmax: Vec<f32>,
    abssum: Vec<f64>,
    /// `X^T X`, row-major `k x k`, when asked for.
    pub hessian: Option<Vec<f64>>,
    /// Sampled input rows, `[n, k]`.
    pub samples: Mat,
}

impl SiteStats {
    fn new(k: usize, hessian: bool) -> Self {
        SiteStats {
            tokens: 0,
            absmax: vec![0.0; k],
            abssum: vec![0.0; k],
            hessian: hessian.then(|| vec![0.0; k * k]),
            samples: Mat::new(0, k, Vec::new()),
        }
    }

    /// Channel-wise mean of |x|.
    pub fn absmean(&self) -> Vec<f32> {
        let n = self.tokens.max(1) as f64;
        self.abssum.iter().map(|s| (s / n) as f32).collect()
    }

    /// The statistics of the same input divided channel-wise by `s` (what folding `s` into the
    /// site does to it): exact for max, mean and samples, `D⁻¹ H D⁻¹` for the Gram matrix.
    pub fn divide_channels(&mut self, s: &[f32]) {
        assert_eq!(s.len(), self.absmax.len(), "one factor per channel");
        for ((m, a), &d) in self.absmax.iter_mut().zip(&mut self.abssum).zip(s) {
            *m /= d;
            *a /= d as f64;
        }
        let inv: Vec<f32> = s.iter().map(|d| 1.0 / d).collect();
        self.samples.scale_cols(&inv);
        if let Some(h) = &mut self.hessian {
            let k = s.len();
            for (i, row) in h.chunks_exact_mut(k).enumerate() {
                for (j, v) in row.iter_mut().enumerate() {
                    *v /= s[i] as f64 * s[j] as f64;
                }
            }
        }
    }
}

/// Statistics of a whole calibration run.
#[derive(Debug, Clone)]
pub struct Calibration {
    /// Every input of every block over all calibration tokens (a sparse block's MLP input as
    /// its router reads it).
    pub sites: HashMap<(usize, SiteKind), SiteStats>,
    /// The inputs of a sparse block's experts, each over the tokens it ran on: the ones the
    /// router sent it (every token for a shared expert). An expert the router never chose has
    /// no entry.
    pub experts: HashMap<(usize, SiteKind, Expert), SiteStats>,
    /// Per layer, channel-wise max |K| after rotary embedding (`kv_dim` values).
    pub key_absmax: Vec<Vec<f32>>,
    /// Per layer, the attention inputs of the first [`CaptureOptions::attention_sequences`]
    /// sequences, in order.
    pub attention: Vec<Vec<AttentionInputs>>,
    pub tokens: usize,
    pub sequences: usize,
}

/// One sequence's attention inputs in one layer: `[tokens, q_dim]` rotary-embedded queries,
/// `[tokens, kv_dim]` rotary-embedded keys and values, as the KV cache is handed them.
#[derive(Debug, Clone)]
pub struct AttentionInputs {
    pub q: Mat,
    pub k: Mat,
    pub v: Mat,
}

impl Calibration {
    pub fn site(&self, layer: usize, site: SiteKind) -> &SiteStats {
        &self.sites[&(layer, site)]
    }

    /// The statistics of a site, when the capture saw it.
    pub fn stats(&self, site: Site) -> Option<&SiteStats> {
        match site.expert {
            None => self.sites.get(&(site.layer, site.kind)),
            Some(e) => self.experts.get(&(site.layer, site.kind, e)),
        }
    }

    /// The statistics of the input a linear layer reads: for an expert, of the tokens it ran
    /// on only (`None` when it ran on none).
    pub fn input_of(&self, id: LinearId) -> Option<&SiteStats> {
        self.stats(id.input())
    }

    /// Every recorded share of site `site` (a sparse block's MLP input as each expert saw it,
    /// besides the whole), mutably: a fold at the site divides them all.
    pub fn shares_mut(&mut self, site: Site) -> Vec<&mut SiteStats> {
        let mut out: Vec<&mut SiteStats> = Vec::new();
        if site.expert.is_none() {
            out.extend(self.sites.get_mut(&(site.layer, site.kind)));
        }
        for (&(layer, kind, e), s) in &mut self.experts {
            let shared_input = site.expert.is_none() && kind == SiteKind::MlpIn;
            if layer == site.layer && kind == site.kind && (shared_input || site.expert == Some(e))
            {
                out.push(s);
            }
        }
        out
    }
}

#[derive(Default)]
struct Recorder {
    sites: HashMap<Site, SiteStats>,
    key_absmax: HashMap<usize, Vec<f32>>,
    attention: HashMap<usize, Vec<AttentionInputs>>,
}

/// Records the inputs of linear layers and the keys as the forward pass runs.
struct Capture {
    opts: CaptureOptions,
    /// The sample stride of a routed expert's inputs: it sees about `top_k / num_experts` of the
    /// tokens, so the stride shrinks by that share to keep about as many rows per expert as per
    /// dense site.
    expert_stride: usize,
    rec: Mutex<Recorder>,
}

impl Capture {
    fn record(&self, key: Site, x: &CpuTensor) {
        let mut opts = self.opts;
        if matches!(key.expert, Some(Expert::Routed(_))) {
            opts.sample_stride = self.expert_stride;
        }
        let mut rec = self.rec.lock().expect("recorder lock");
        let s = rec.sites.entry(key).or_insert_with(|| {
            let in_window = opts
                .hessian_layers
                .is_none_or(|(a, b)| (a..b).contains(&key.layer));
            SiteStats::new(x.cols, opts.hessian && in_window)
        });
        let k = x.cols;
        for r in 0..x.rows {
            let row = x.row(r);
            for ((m, a), &v) in s.absmax.iter_mut().zip(&mut s.abssum).zip(row) {
                *m = m.max(v.abs());
                *a += v.abs() as f64;
            }
            // `capture` prefills each sequence whole, so row 0 is its first token (for a routed
            // expert, the first token of the sequence routed to it: QoQ's `sample_first` keeps
            // one such row per sequence, the sink itself only where it routes there).
            let strided = (s.tokens + r).is_multiple_of(opts.sample_stride.max(1));
            if (strided || (opts.sample_first && r == 0)) && s.samples.rows < opts.max_samples {
                s.samples.data.extend_from_slice(row);
                s.samples.rows += 1;
            }
        }
        s.tokens += x.rows;
        if let Some(h) = &mut s.hessian {
            let g = gram(&x.data, x.rows, k);
            for (h, g) in h.iter_mut().zip(g) {
                *h += g as f64;
            }
        }
    }
}

/// `X^T X` for row-major `X` (`m x k`), in f32. Split by output rows over the rayon pool: it
/// runs between the backend's layer calls, while the backend's own threads wait.
pub fn gram(x: &[f32], m: usize, k: usize) -> Vec<f32> {
    use rayon::prelude::*;
    assert_eq!(x.len(), m * k, "gram input length");
    let mut out = vec![0f32; k * k];
    let chunk = k.div_ceil(rayon::current_num_threads().max(1)).max(32);
    out.par_chunks_mut(chunk * k)
        .enumerate()
        .for_each(|(c, o)| {
            let (i0, rows) = (c * chunk, o.len() / k);
            // SAFETY: `o` is output rows `i0..i0 + rows`, row-major `rows x k`. The left operand
            // is columns `i0..i0 + rows` of `x` read transposed (`rows x m`: element (i, t) at
            // `t * k + i0 + i`), the right one `x` itself (`m x k`); all inside `x`.
            unsafe {
                gemm::gemm(
                    rows,
                    k,
                    m,
                    o.as_mut_ptr(),
                    1,
                    k as isize,
                    false,
                    x.as_ptr().add(i0),
                    k as isize,
                    1,
                    x.as_ptr(),
                    1,
                    k as isize,
                    0.0,
                    1.0,
                    false,
                    false,
                    false,
                    gemm::Parallelism::None,
                );
            }
        });
    out
}

impl Hooks for Capture {
    /// The site a weight records, set on the first reader of each site (q, o, gate or a
    /// sparse block's router, down; each expert's gate and down), which records the input once.
    type Tag = Option<Site>;

    fn tag(&self, name: &str) -> Self::Tag {
        if let Some(id) = LinearId::parse(name) {
            return matches!(
                id.kind,
                LinearKind::Q | LinearKind::O | LinearKind::Gate | LinearKind::Down
            )
            .then(|| id.input());
        }
        // A router: its input is the whole MLP input of a sparse block.
        let rest = name.strip_prefix("model.layers.")?;
        let (layer, suffix) = rest.split_once('.')?;
        matches!(suffix, "mlp.gate.weight" | "block_sparse_moe.gate.weight")
            .then(|| Some(Site::dense(layer.parse().ok()?, SiteKind::MlpIn)))
            .flatten()
    }

    fn linear_input(&self, tag: Self::Tag, x: &CpuTensor) -> Option<CpuTensor> {
        if let Some(key) = tag {
            self.record(key, x);
        }
        None
    }

    fn attention_inputs(&self, layer: usize, q: &CpuTensor, k: &CpuTensor, v: &CpuTensor) {
        let mut rec = self.rec.lock().expect("recorder lock");
        // `capture` prefills each sequence whole: one call per layer and sequence.
        let kept = rec.attention.entry(layer).or_default();
        if kept.len() < self.opts.attention_sequences {
            let mat = |t: &CpuTensor| Mat::new(t.rows, t.cols, t.data.clone());
            kept.push(AttentionInputs {
                q: mat(q),
                k: mat(k),
                v: mat(v),
            });
        }
        let m = rec
            .key_absmax
            .entry(layer)
            .or_insert_with(|| vec![0.0; k.cols]);
        for row in k.data.chunks_exact(k.cols) {
            for (m, &v) in m.iter_mut().zip(row) {
                *m = m.max(v.abs());
            }
        }
    }
}

/// Runs `model` over `sequences` (each one prefill) and returns the statistics of every linear
/// layer's input; `progress(done, total)` per sequence.
pub fn capture(
    model: &DenseModel,
    sequences: &[Vec<u32>],
    opts: CaptureOptions,
    threads: usize,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Calibration> {
    let backend = Hooked {
        cpu: CpuBackend::new(threads)?,
        hooks: Capture {
            opts,
            expert_stride: model.config.moe.as_ref().map_or(1, |m| {
                (opts.sample_stride * m.top_k / m.num_experts.max(1)).max(1)
            }),
            rec: Mutex::new(Recorder::default()),
        },
    };
    let transformer = Transformer::load(&backend, model.config.clone(), model, &mut |_, _| {})?;
    let mut tokens = 0;
    for (i, seq) in sequences.iter().enumerate() {
        let (mut kv, table) = transformer.single_sequence_kv(&backend, seq.len())?;
        transformer.forward(
            &backend,
            seq,
            &BatchLayout::single(table, 0, seq.len()),
            &mut kv,
            LogitRows::LastPerSeq,
        )?;
        tokens += seq.len();
        progress(i + 1, sequences.len());
    }
    let rec = backend.hooks.rec.into_inner().expect("recorder lock");
    let mut key_absmax: Vec<(usize, Vec<f32>)> = rec.key_absmax.into_iter().collect();
    key_absmax.sort_by_key(|(l, _)| *l);
    let mut attention: Vec<(usize, Vec<AttentionInputs>)> = rec.attention.into_iter().collect();
    attention.sort_by_key(|(l, _)| *l);
    let (mut sites, mut experts) = (HashMap::new(), HashMap::new());
    for (site, stats) in rec.sites {
        match site.expert {
            None => sites.insert((site.layer, site.kind), stats),
            Some(e) => experts.insert((site.layer, site.kind, e), stats),
        };
    }
    Ok(Calibration {
        sites,
        experts,
        key_absmax: key_absmax.into_iter().map(|(_, v)| v).collect(),
        attention: attention.into_iter().map(|(_, v)| v).collect(),
        tokens,
        sequences: sequences.len(),
    })
}

#[cfg(test)]
mod tests {
    use super::gram;

    #[test]
    fn gram_matches_a_plain_loop() {
        for (m, k) in [(1, 1), (5, 3), (40, 97), (9, 300)] {
            let x: Vec<f32> = (0..m * k)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
                .collect();
            let g = gram(&x, m, k);
            for i in 0..k {
                for j in 0..k {
                    let want: f64 = (0..m)
                        .map(|t| x[t * k + i] as f64 * x[t * k + j] as f64)
                        .sum();
                    assert!((g[i * k + j] as f64 - want).abs() < 1e-3, "({i},{j})");
                }
            }
        }
    }
}
