//! Times `CpuBackend::linear` on nibble's quantized formats with SmolLM2-135M's shapes (not run
//! in CI): every linear of one decoder layer (q, k, v, o, gate, up, down) and the tied output
//! head, at a prefill chunk of `m` tokens and at decode (`m = 1`), reported as the tokens per
//! second that 30 layers plus the head would allow (the linears only).
//!
//! With one thread the time is the calling thread's CPU time (`/proc/thread-self/schedstat`),
//! which other processes on a busy machine do not inflate; with more it is wall time.
//!
//! `cargo run --release -p nibble-cpu --example quant_bench -- [threads] [m] [formats...]`
use std::sync::Arc;
use std::time::Instant;

use nibble_cpu::{CpuBackend, CpuTensor, CpuWeight};
use nibble_formats::{HostTensor, TensorBytes, WeightFormat};
use nibble_model::Backend;
use nibble_precision::LinearFormat;

const LAYERS: usize = 30;
/// (out, in) of each linear in a layer.
const LAYER: [(usize, usize); 7] = [
    (576, 576),
    (192, 576),
    (192, 576),
    (576, 576),
    (1536, 576),
    (1536, 576),
    (576, 1536),
];
const HEAD: (usize, usize) = (49152, 576);

fn weight(backend: &CpuBackend, format: LinearFormat, n: usize, k: usize, seed: u64) -> CpuWeight {
    let mut s = seed;
    let mut rnd = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s % 2001) as f32 / 1000.0 - 1.0
    };
    let rb = format.row_bytes(k).unwrap();
    let mut bytes = vec![0u8; n * rb];
    let mut row = vec![0f32; k];
    for o in bytes.chunks_exact_mut(rb) {
        row.iter_mut().for_each(|v| *v = rnd() * 0.05);
        format.codec.quantize_row(&row, 1.0, o).unwrap();
    }
    backend
        .load_weight(&HostTensor {
            name: "w".into(),
            shape: vec![n, k],
            format: WeightFormat::Quant(format),
            bytes: TensorBytes::Owned(Arc::new(bytes)),
        })
        .unwrap()
}

/// This thread's CPU time in seconds.
fn thread_cpu() -> f64 {
    let s = std::fs::read_to_string("/proc/thread-self/schedstat").unwrap();
    s.split_whitespace().next().unwrap().parse::<f64>().unwrap() / 1e9
}

/// Best of `reps` runs of every weight against `m` rows, in seconds (CPU time of this thread
/// when the backend has one thread, else wall time).
fn time(backend: &CpuBackend, ws: &[CpuWeight], m: usize, reps: usize) -> f64 {
    let xs: Vec<CpuTensor> = ws
        .iter()
        .map(|w| {
            let data = (0..m * w.cols)
                .map(|i| ((i * 7919) % 2000) as f32 / 1000.0 - 1.0)
                .collect();
            CpuTensor::new(data, m, w.cols)
        })
        .collect();
    // The first call expands the weights; its time sets how many passes make one sample long
    // enough for the scheduler's CPU-time accounting (updated at ticks of a few ms).
    let t = Instant::now();
    for (w, x) in ws.iter().zip(&xs) {
        backend.linear(x, w, None).unwrap();
    }
    let passes = (0.2 / t.elapsed().as_secs_f64())
        .ceil()
        .clamp(1.0, 10_000.0) as usize;
    let cpu = backend.threads() == 1;
    let mut best = f64::MAX;
    for _ in 0..reps {
        let (t, c) = (Instant::now(), thread_cpu());
        for _ in 0..passes {
            for (w, x) in ws.iter().zip(&xs) {
                std::hint::black_box(backend.linear(x, w, None).unwrap());
            }
        }
        let took = if cpu {
            thread_cpu() - c
        } else {
            t.elapsed().as_secs_f64()
        };
        best = best.min(took / passes as f64);
    }
    best
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let threads: usize = args.get(1).map_or(2, |s| s.parse().unwrap());
    let m: usize = args.get(2).map_or(128, |s| s.parse().unwrap());
    let formats: Vec<String> = if args.len() > 3 {
        args[3..].to_vec()
    } else {
        [
            "int8-pc/a8",
            "int4-pc/a8",
            "int4-g64/a8",
            "qoq-g64/a8",
            "lqq-g64/a8",
            "int4-g64/a4a8-b64-n1",
            "int8-pc/a16",
            "int4-g64/a16",
            "fp8-pc/afp8",
        ]
        .map(String::from)
        .to_vec()
    };
    let backend = CpuBackend::new(threads).unwrap();
    let macs_layer: usize = LAYER.iter().map(|(n, k)| n * k).sum();
    let macs_head = HEAD.0 * HEAD.1;
    println!(
        "{threads} threads, prefill chunk m={m}; tokens/s = linears of {LAYERS} layers + head"
    );
    for f in formats {
        let format: LinearFormat = f.parse().unwrap();
        let layer: Vec<CpuWeight> = LAYER
            .iter()
            .enumerate()
            .map(|(i, &(n, k))| weight(&backend, format, n, k, i as u64 + 1))
            .collect();
        let head = [weight(&backend, format, HEAD.0, HEAD.1, 99)];
        let mlp = &layer[4..];
        let reps = 5;
        let (t_layer, t_head, t_mlp) = (
            time(&backend, &layer, m, reps),
            time(&backend, &head, m, 3),
            time(&backend, mlp, m, reps),
        );
        let prefill = m as f64 / (LAYERS as f64 * t_layer + t_head);
        let (d_layer, d_head) = (time(&backend, &layer, 1, 5), time(&backend, &head, 1, 3));
        let decode = 1.0 / (LAYERS as f64 * d_layer + d_head);
        println!(
            "{f:>22}: prefill {prefill:7.0} tok/s ({:5.1} GMAC/s; MLP 1536x576+576x1536 {:6.0} \
             tok/s), decode {decode:5.1} tok/s ({:4.1} GMAC/s)",
            m as f64 * (LAYERS * macs_layer + macs_head) as f64
                / (LAYERS as f64 * t_layer + t_head)
                / 1e9,
            m as f64 / (LAYERS as f64 * t_mlp),
            (LAYERS * macs_layer + macs_head) as f64 * decode / 1e9,
        );
    }
}
