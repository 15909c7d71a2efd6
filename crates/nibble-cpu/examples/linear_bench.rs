//! Times `CpuBackend::linear` against decode-to-f32 + the gemm crate (not run in CI).
use std::sync::Arc;
use std::time::Instant;

use nibble_cpu::{CpuBackend, CpuTensor};
use nibble_formats::gguf::GgmlType;
use nibble_formats::{HostTensor, TensorBytes, WeightFormat};
use nibble_model::Backend;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let threads: usize = args.get(1).map_or(1, |s| s.parse().unwrap());
    let ty = match args.get(2).map_or("q4_1", |s| s.as_str()) {
        "q4_0" => GgmlType::Q4_0,
        "q8_0" => GgmlType::Q8_0,
        "f32" => GgmlType::F32,
        "q6k" => GgmlType::Q6K,
        _ => GgmlType::Q4_1,
    };
    let backend = CpuBackend::new(threads).unwrap();
    for &(m, n, k) in &[
        (128, 1536, 576),
        (128, 576, 1536),
        (128, 576, 576),
        (4, 1536, 576),
        (1, 1536, 576),
    ] {
        let mut seed = 1u64;
        let mut rnd = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let nbytes = ty.bytes_for(n * k).unwrap();
        let mut bytes: Vec<u8> = (0..nbytes).map(|_| rnd() as u8).collect();
        if ty == GgmlType::F32 {
            for c in bytes.chunks_exact_mut(4) {
                c.copy_from_slice(&((rnd() % 1000) as f32 / 1000.0).to_le_bytes());
            }
        } else {
            let bb = ty.block_bytes();
            let d = if ty == GgmlType::Q6K { bb - 2 } else { 0 };
            for b in bytes.chunks_exact_mut(bb) {
                b[d..d + 2].copy_from_slice(&half::f16::from_f32(0.01).to_le_bytes());
                if ty == GgmlType::Q4_1 {
                    b[2..4].copy_from_slice(&half::f16::from_f32(0.01).to_le_bytes());
                }
            }
        }
        let w = backend
            .load_weight(&HostTensor {
                name: "w".into(),
                shape: vec![n, k],
                format: WeightFormat::Ggml(ty),
                bytes: TensorBytes::Owned(Arc::new(bytes)),
            })
            .unwrap();
        let x = CpuTensor::new(
            (0..m * k)
                .map(|_| (rnd() % 2000) as f32 / 1000.0 - 1.0)
                .collect(),
            m,
            k,
        );
        let reps = (200_000_000 / (m * n * k)).max(3);
        let mut ours = f64::MAX;
        for _ in 0..reps {
            let t = Instant::now();
            std::hint::black_box(backend.linear(&x, &w, None).unwrap());
            ours = ours.min(t.elapsed().as_secs_f64());
        }
        // decode + gemm (single-threaded decode, gemm with the pool's threads)
        let mut g = f64::MAX;
        for _ in 0..reps {
            let t = Instant::now();
            let mut wf = vec![0f32; n * k];
            w.dequantize_rows(0, n, &mut wf).unwrap();
            let mut y = vec![0f32; m * n];
            unsafe {
                gemm::gemm(
                    m,
                    n,
                    k,
                    y.as_mut_ptr(),
                    1,
                    n as isize,
                    false,
                    x.data.as_ptr(),
                    1,
                    k as isize,
                    wf.as_ptr(),
                    k as isize,
                    1,
                    0.0,
                    1.0,
                    false,
                    false,
                    false,
                    gemm::Parallelism::None,
                );
            }
            std::hint::black_box(y);
            g = g.min(t.elapsed().as_secs_f64());
        }
        let gmac = (m * n * k) as f64 / 1e9;
        println!(
            "{ty} m={m} n={n} k={k}: linear {:.3} ms ({:.1} GMAC/s), decode+gemm {:.3} ms ({:.1} GMAC/s)",
            ours * 1e3,
            gmac / ours,
            g * 1e3,
            gmac / g
        );
    }
}
