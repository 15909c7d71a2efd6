//! Runs a quantized model the way its kernels compute it, in f32 on the CPU: every linear
//! weight decoded from its codec, every linear input quantized by its run-time activation rule
//! ([`ActSim`]), everything else (embeddings, norms, attention, the head) as in the float
//! model, and the KV cache in the spec's format (the CPU backend's own KV quantizers). This
//! measures a method end to end (logits, negative
//! log-likelihood) with plain f32 matmuls; [`QuantSource`] serves the same model to the real
//! quantized kernels, which must agree with it to float rounding.

use std::collections::HashMap;

use std::sync::Arc;

use nibble_core::Result;
use nibble_cpu::{CpuBackend, CpuKvCache, CpuTensor, CpuWeight};
use nibble_formats::{HostTensor, TensorBytes, WeightFormat};
use nibble_model::source::TensorSource;
use nibble_model::{
    AttentionShape, Backend, BatchLayout, KvShape, LogitRows, RopeLayout, Transformer,
};
use nibble_precision::KvFormat;

use crate::dense::{DenseModel, LinearId, Mat};
use crate::pipeline::QuantizedModel;
use crate::sim::ActSim;

/// A quantized model ready to run in simulation.
#[derive(Debug, Clone)]
pub struct Simulated {
    /// The float model with each linear weight replaced by its decoded encoding.
    pub dense: DenseModel,
    /// Each linear layer's activation rule.
    pub acts: HashMap<LinearId, ActSim>,
    /// The KV cache format.
    pub kv: KvFormat,
}

impl Simulated {
    pub fn new(q: &QuantizedModel) -> Result<Simulated> {
        let mut dense = q.dense.clone();
        let mut acts = HashMap::new();
        for (&id, (format, bytes)) in &q.linears {
            let w = dense.linear_mut(id);
            let mut out = vec![0f32; w.rows * w.cols];
            format.codec.dequantize(bytes, w.cols, &mut out)?;
            *w = Mat::new(w.rows, w.cols, out);
            acts.insert(id, ActSim::of(format.act)?);
        }
        Ok(Simulated {
            dense,
            acts,
            kv: q.spec.kv,
        })
    }

    /// The float model, unquantized (the reference a simulation is compared with).
    pub fn float(dense: &DenseModel) -> Simulated {
        Simulated {
            dense: dense.clone(),
            acts: HashMap::new(),
            kv: KvFormat::F16,
        }
    }

    /// Logits of every position of `tokens` (one prefill), `[tokens, vocab]` row-major.
    pub fn logits(&self, tokens: &[u32], threads: usize) -> Result<Vec<f32>> {
        let mut out = Vec::new();
        self.run(&[tokens.to_vec()], threads, &mut |_, logits| {
            out = logits;
        })?;
        Ok(out)
    }

    /// Mean negative log-likelihood of each token given the ones before it, over `sequences`
    /// (each one window); returns `(mean nll, predicted tokens)`. Perplexity is `exp(nll)`.
    pub fn mean_nll(
        &self,
        sequences: &[Vec<u32>],
        threads: usize,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<(f64, usize)> {
        let vocab = self.dense.config.vocab_size;
        let (mut nll, mut count) = (0f64, 0usize);
        self.run(sequences, threads, &mut |i, logits| {
            let seq = &sequences[i];
            for t in 0..seq.len().saturating_sub(1) {
                let row = &logits[t * vocab..(t + 1) * vocab];
                let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
                let lse = max
                    + row
                        .iter()
                        .map(|&x| (x as f64 - max).exp())
                        .sum::<f64>()
                        .ln();
                nll += lse - row[seq[t + 1] as usize] as f64;
                count += 1;
            }
            progress(i + 1, sequences.len());
        })?;
        Ok((nll / count.max(1) as f64, count))
    }

    /// Loads the model once and prefills each sequence, handing over all its logits.
    fn run(
        &self,
        sequences: &[Vec<u32>],
        threads: usize,
        each: &mut dyn FnMut(usize, Vec<f32>),
    ) -> Result<()> {
        let backend = SimBackend {
            cpu: CpuBackend::new(threads)?,
            acts: &self.acts,
        };
        let mut t = Transformer::load(
            &backend,
            self.dense.config.clone(),
            &self.dense,
            &mut |_, _| {},
        )?;
        t.kv_format = self.kv;
        for (i, seq) in sequences.iter().enumerate() {
            let (mut kv, table) = t.single_sequence_kv(&backend, seq.len())?;
            let out = t.forward(
                &backend,
                seq,
                &BatchLayout::single(table, 0, seq.len()),
                &mut kv,
                LogitRows::All,
            )?;
            each(i, out.data);
        }
        Ok(())
    }
}

/// A quantized model as a tensor source: its linear layers as [`WeightFormat::Quant`] tensors
/// (what a checkpoint holds), everything else as the dense model's f32 tensors. Loading it runs
/// the backend's quantized kernels without writing a checkpoint.
pub struct QuantSource<'a>(pub &'a QuantizedModel);

impl TensorSource for QuantSource<'_> {
    fn get(&self, name: &str) -> Option<HostTensor> {
        let q = self.0;
        match LinearId::parse(name).and_then(|id| q.linears.get(&id).map(|l| (id, l))) {
            Some((id, (format, bytes))) => {
                let w = q.dense.linear(id);
                Some(HostTensor {
                    name: name.to_string(),
                    shape: vec![w.rows, w.cols],
                    format: WeightFormat::Quant(*format),
                    bytes: TensorBytes::Owned(Arc::new(bytes.clone())),
                })
            }
            None => q.dense.get(name),
        }
    }

    fn origin(&self) -> String {
        format!("the {} {} model in memory", self.0.method, self.0.spec)
    }
}

struct SimBackend<'a> {
    cpu: CpuBackend,
    acts: &'a HashMap<LinearId, ActSim>,
}

struct SimWeight {
    inner: CpuWeight,
    act: ActSim,
}

impl Backend for SimBackend<'_> {
    type Tensor = CpuTensor;
    type Weight = SimWeight;
    type Kv = CpuKvCache;

    fn name(&self) -> String {
        format!("quantization simulation on {}", self.cpu.name())
    }

    fn load_weight(&self, t: &HostTensor) -> Result<SimWeight> {
        let act = LinearId::parse(&t.name)
            .and_then(|id| self.acts.get(&id).copied())
            .unwrap_or(ActSim::Float);
        Ok(SimWeight {
            inner: self.cpu.load_weight(t)?,
            act,
        })
    }

    fn load_vector(&self, values: &[f32]) -> Result<CpuTensor> {
        self.cpu.load_vector(values)
    }

    fn new_kv_pool(&self, shape: KvShape, blocks: usize, block_size: usize) -> Result<CpuKvCache> {
        self.cpu.new_kv_pool(shape, blocks, block_size)
    }

    fn release_kv_blocks(&self, kv: &mut CpuKvCache, blocks: &[u32]) {
        self.cpu.release_kv_blocks(kv, blocks)
    }

    fn embed(&self, table: &SimWeight, ids: &[u32]) -> Result<CpuTensor> {
        self.cpu.embed(&table.inner, ids)
    }

    fn rms_norm(&self, x: &CpuTensor, w: &CpuTensor, eps: f32) -> CpuTensor {
        self.cpu.rms_norm(x, w, eps)
    }

    fn add_rms_norm(&self, x: &mut CpuTensor, d: &CpuTensor, w: &CpuTensor, eps: f32) -> CpuTensor {
        self.cpu.add_rms_norm(x, d, w, eps)
    }

    fn head_rms_norm(&self, x: &mut CpuTensor, w: &CpuTensor, head_dim: usize, eps: f32) {
        self.cpu.head_rms_norm(x, w, head_dim, eps)
    }

    fn linear(&self, x: &CpuTensor, w: &SimWeight, bias: Option<&CpuTensor>) -> Result<CpuTensor> {
        if w.act == ActSim::Float {
            return self.cpu.linear(x, &w.inner, bias);
        }
        let xq = w.act.apply(&Mat::new(x.rows, x.cols, x.data.clone()));
        self.cpu
            .linear(&CpuTensor::new(xq.data, x.rows, x.cols), &w.inner, bias)
    }

    fn rope(
        &self,
        x: &mut CpuTensor,
        head_dim: usize,
        batch: &BatchLayout,
        inv_freq: &CpuTensor,
        layout: RopeLayout,
    ) {
        self.cpu.rope(x, head_dim, batch, inv_freq, layout)
    }

    fn attention(
        &self,
        q: &CpuTensor,
        k: &CpuTensor,
        v: &CpuTensor,
        kv: &mut CpuKvCache,
        layer: usize,
        batch: &BatchLayout,
        shape: AttentionShape,
    ) -> Result<CpuTensor> {
        self.cpu.attention(q, k, v, kv, layer, batch, shape)
    }

    fn silu_mul(&self, gate: &CpuTensor, up: &CpuTensor) -> CpuTensor {
        self.cpu.silu_mul(gate, up)
    }

    fn add(&self, x: &mut CpuTensor, d: &CpuTensor) {
        self.cpu.add(x, d)
    }

    fn gather_rows(&self, x: &CpuTensor, rows: &[usize]) -> CpuTensor {
        self.cpu.gather_rows(x, rows)
    }

    fn to_host(&self, x: &CpuTensor) -> Result<Vec<f32>> {
        self.cpu.to_host(x)
    }
}
