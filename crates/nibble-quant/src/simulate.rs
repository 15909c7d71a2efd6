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
use nibble_cpu::{CpuBackend, CpuTensor};
use nibble_formats::{HostTensor, TensorBytes, WeightFormat};
use nibble_model::source::TensorSource;
use nibble_model::{BatchLayout, LogitRows, Transformer};
use nibble_precision::KvSpec;

use crate::dense::{DenseModel, LinearId, Mat};
use crate::hooked::{Hooked, Hooks};
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
    pub kv: KvSpec,
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
            acts.insert(id, ActSim::of(format.act));
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
            kv: KvSpec::default(),
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
        let backend = Hooked {
            cpu: CpuBackend::new(threads)?,
            hooks: ActHooks { acts: &self.acts },
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

/// Replays each linear layer's run-time activation quantization on its input.
struct ActHooks<'a> {
    acts: &'a HashMap<LinearId, ActSim>,
}

impl Hooks for ActHooks<'_> {
    type Tag = ActSim;

    fn tag(&self, name: &str) -> ActSim {
        LinearId::parse(name)
            .and_then(|id| self.acts.get(&id).copied())
            .unwrap_or(ActSim::Float)
    }

    fn linear_input(&self, act: ActSim, x: &CpuTensor) -> Option<CpuTensor> {
        if act == ActSim::Float {
            return None;
        }
        let xq = act.apply(&Mat::new(x.rows, x.cols, x.data.clone()));
        Some(CpuTensor::new(xq.data, x.rows, x.cols))
    }
}
