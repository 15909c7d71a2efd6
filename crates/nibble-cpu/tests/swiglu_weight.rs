//! The model's use of `Backend::load_swiglu_weight`, on the CPU: a backend that offers a SwiGLU
//! weight (gate and up kept apart, `silu_mul` of their products when multiplied) must load a
//! dense model into exactly the forward pass the plain `CpuBackend` runs. Only the CUDA backend
//! offers the weight in earnest, so without this the loader's and forward pass's handling of it
//! would run on GPUs only.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};

use common::argmax;
use nibble_core::{Error, Result};
use nibble_cpu::{CpuBackend, CpuKvCache, CpuTensor, CpuWeight};
use nibble_formats::HostTensor;
use nibble_model::dummy::open_dummy;
use nibble_model::{AttentionShape, Backend, BatchLayout, LogitRows, ModelFiles, Transformer};

enum SwiGluTestWeight {
    Plain(CpuWeight),
    SwiGlu { gate: CpuWeight, up: CpuWeight },
}

/// `CpuBackend` offering SwiGLU weights, counting how the model uses them.
struct SwiGluCpu {
    cpu: CpuBackend,
    swiglu_weights_loaded: AtomicUsize,
    swiglu_norm_linears: AtomicUsize,
}

impl SwiGluCpu {
    fn plain(w: &SwiGluTestWeight) -> Result<&CpuWeight> {
        match w {
            SwiGluTestWeight::Plain(w) => Ok(w),
            SwiGluTestWeight::SwiGlu { .. } => Err(Error::InvalidArgument(
                "a SwiGLU weight where a plain one belongs".into(),
            )),
        }
    }
}

impl Backend for SwiGluCpu {
    type Tensor = CpuTensor;
    type Weight = SwiGluTestWeight;
    type Kv = CpuKvCache;

    nibble_cpu::delegate_to_cpu!(cpu);

    fn name(&self) -> String {
        format!("{} with SwiGLU weights", self.cpu.name())
    }

    fn load_weight(&self, t: &HostTensor) -> Result<SwiGluTestWeight> {
        self.cpu.load_weight(t).map(SwiGluTestWeight::Plain)
    }

    // Passed on so that q/k/v (and, for the plain backend, gate/up) fuse on both backends alike.
    fn load_fused_weight(&self, parts: &[HostTensor]) -> Result<Option<SwiGluTestWeight>> {
        Ok(self
            .cpu
            .load_fused_weight(parts)?
            .map(SwiGluTestWeight::Plain))
    }

    fn load_swiglu_weight(
        &self,
        gate: &HostTensor,
        up: &HostTensor,
    ) -> Result<Option<SwiGluTestWeight>> {
        self.swiglu_weights_loaded.fetch_add(1, Ordering::Relaxed);
        Ok(Some(SwiGluTestWeight::SwiGlu {
            gate: self.cpu.load_weight(gate)?,
            up: self.cpu.load_weight(up)?,
        }))
    }

    fn split_cols(&self, x: &CpuTensor, widths: &[usize]) -> Result<Vec<CpuTensor>> {
        self.cpu.split_cols(x, widths)
    }

    fn embed(&self, table: &SwiGluTestWeight, ids: &[u32]) -> Result<CpuTensor> {
        self.cpu.embed(Self::plain(table)?, ids)
    }

    fn linear(
        &self,
        x: &CpuTensor,
        w: &SwiGluTestWeight,
        bias: Option<&CpuTensor>,
    ) -> Result<CpuTensor> {
        match w {
            SwiGluTestWeight::Plain(w) => self.cpu.linear(x, w, bias),
            SwiGluTestWeight::SwiGlu { gate, up } => {
                if bias.is_some() {
                    return Err(Error::InvalidArgument(
                        "the model loads SwiGLU weights only for unbiased gate/up".into(),
                    ));
                }
                let g = self.cpu.linear(x, gate, None)?;
                let u = self.cpu.linear(x, up, None)?;
                Ok(self.cpu.silu_mul(&g, &u))
            }
        }
    }

    // The trait's own norm_linear, counted: the dense MLP's only way to its SwiGLU weight.
    fn norm_linear(
        &self,
        x: &mut CpuTensor,
        delta: Option<&CpuTensor>,
        norm: &CpuTensor,
        eps: f32,
        weight: &SwiGluTestWeight,
        bias: Option<&CpuTensor>,
    ) -> Result<CpuTensor> {
        if let SwiGluTestWeight::SwiGlu { .. } = weight {
            self.swiglu_norm_linears.fetch_add(1, Ordering::Relaxed);
        }
        let h = self.pre_norm(x, delta, norm, eps);
        self.linear(&h, weight, bias)
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
}

const THREADS: usize = 2;
const PROMPT: &str = "The quick brown fox";
const STEPS: usize = 16;

struct Run {
    load_ticks: usize,
    tokens: Vec<u32>,
    /// Per forward pass (the prefill, then each decode step), the last token's logits.
    logits: Vec<Vec<f32>>,
}

/// Loads `files` on `backend`, prefills the prompt and decodes `STEPS` greedy tokens.
fn generate<B: Backend>(backend: &B, files: &ModelFiles) -> Run {
    let mut load_ticks = 0;
    let model = Transformer::load(
        backend,
        files.config.clone(),
        &*files.source,
        &mut |_, _| load_ticks += 1,
    )
    .unwrap();
    let prompt = files.tokenizer.encode(PROMPT, true).unwrap();
    // Several rows in the prefill, one in each decode step: both shapes of the CPU matmul.
    assert!(prompt.len() > 1);
    let (mut kv, blocks) = model
        .single_sequence_kv(backend, prompt.len() + STEPS)
        .unwrap();
    let mut logits = vec![];
    let mut tokens = vec![];
    let mut fed = prompt;
    let mut pos = 0;
    for _ in 0..=STEPS {
        let batch = BatchLayout::single(blocks.clone(), pos, fed.len());
        let l = model
            .forward(backend, &fed, &batch, &mut kv, LogitRows::LastPerSeq)
            .unwrap();
        let host = backend.to_host(&l).unwrap();
        let next = argmax(&host);
        logits.push(host);
        tokens.push(next);
        pos += fed.len();
        fed = vec![next];
    }
    Run {
        load_ticks,
        tokens,
        logits,
    }
}

fn check_swiglu_weight_matches_plain(spec: &str) {
    let files = open_dummy(spec, 11).unwrap();
    let layers = files.config.num_layers;
    let plain = generate(&CpuBackend::new(THREADS).unwrap(), &files);
    let swiglu_cpu = SwiGluCpu {
        cpu: CpuBackend::new(THREADS).unwrap(),
        swiglu_weights_loaded: AtomicUsize::new(0),
        swiglu_norm_linears: AtomicUsize::new(0),
    };
    let swiglu = generate(&swiglu_cpu, &files);

    assert_eq!(
        swiglu_cpu.swiglu_weights_loaded.load(Ordering::Relaxed),
        layers,
        "{spec}: one SwiGLU weight per dense layer"
    );
    let forwards = STEPS + 1;
    assert_eq!(
        swiglu_cpu.swiglu_norm_linears.load(Ordering::Relaxed),
        layers * forwards,
        "{spec}: every layer of every forward pass through norm_linear"
    );
    // The loader ticks the two tensors a SwiGLU weight takes, so progress still reaches the end.
    assert_eq!(swiglu.load_ticks, plain.load_ticks, "{spec}: load progress");
    assert_eq!(swiglu.tokens, plain.tokens, "{spec}: greedy tokens");
    // Bit for bit: every output of a CPU linear layer is its row's dot product whichever other
    // rows share the matmul (the plain backend fuses gate and up into one), and the rest of the
    // two forward passes is the same ops on the same values.
    for (step, (s, p)) in swiglu.logits.iter().zip(&plain.logits).enumerate() {
        assert_eq!(s.len(), p.len());
        let differing = s
            .iter()
            .zip(p)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert_eq!(differing, 0, "{spec}: logits of forward pass {step} differ");
    }
}

#[test]
fn swiglu_weight_matches_plain_bf16() {
    check_swiglu_weight_matches_plain("tiny-dummy");
}

// Quantized gate/up are not fused by the plain backend: the SwiGLU weight is compared with
// separate projections and a separate pre-norm there.
#[test]
fn swiglu_weight_matches_plain_w4a16() {
    check_swiglu_weight_matches_plain("tiny-dummy:w4a16-g32");
}
