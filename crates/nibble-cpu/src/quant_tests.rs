//! The quantized matmul against `nibble_precision::reference_matmul`, bit for bit: every format,
//! odd shapes, every batch size from 1 to 40, both kernel sets, outputs poisoned beforehand.

use std::sync::Arc;

use nibble_formats::{HostTensor, TensorBytes, WeightFormat};
use nibble_model::Backend;
use nibble_precision::reference::{kernel_formats, reference_matmul};
use nibble_precision::{ActQuant, LinearFormat, WeightCodec};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::{CpuBackend, CpuTensor, CpuWeight};

/// A NaN no kernel produces: an output still holding it was never written.
const POISON: u32 = 0x7fc0_dead;

/// `n` rows quantized from random floats with outliers; every 13th row is all zero (zero scales),
/// every 5th all positive (with positive activation rows, integer sums large enough that their
/// f32 products round, so the order and fusing of the epilogue shows), and the clip ratio varies.
fn quantized_weight(codec: WeightCodec, n: usize, k: usize, rng: &mut ChaCha8Rng) -> Vec<u8> {
    let rb = codec.row_bytes(k).unwrap();
    let mut out = vec![0u8; n * rb];
    for (r, o) in out.chunks_exact_mut(rb).enumerate() {
        let row: Vec<f32> = (0..k)
            .map(|_| {
                let v: f32 = rng.random_range(-1.0..1.0);
                match r % 13 {
                    12 => 0.0,
                    _ if r % 5 == 1 => v.abs(),
                    _ if rng.random_bool(0.02) => v * 10.0,
                    _ => v,
                }
            })
            .collect();
        codec
            .quantize_row(&row, rng.random_range(0.8..=1.0), o)
            .unwrap();
    }
    out
}

/// Activations with a few outlier channels; every 11th row is all zero, every 3rd all positive
/// and near its maximum (codes near 127).
fn activations(m: usize, k: usize, rng: &mut ChaCha8Rng) -> Vec<f32> {
    let mut x = Vec::with_capacity(m * k);
    for i in 0..m {
        let scale = if i % 11 == 10 {
            0.0
        } else {
            rng.random_range(0.01..4.0)
        };
        let positive = i % 3 == 1;
        x.extend((0..k).map(|j| {
            if positive {
                return rng.random_range(0.7f32..1.0) * scale;
            }
            let v = rng.random_range(-1f32..1.0) * scale;
            if j % 37 == 5 { v * 25.0 } else { v }
        }));
    }
    x
}

fn load(backend: &CpuBackend, format: LinearFormat, n: usize, k: usize, bytes: &[u8]) -> CpuWeight {
    backend
        .load_weight(&HostTensor {
            name: format!("w.{format}"),
            shape: vec![n, k],
            format: WeightFormat::Quant(format),
            bytes: TensorBytes::Owned(Arc::new(bytes.to_vec())),
        })
        .unwrap()
}

/// The kernels' output for `x` (`m x k`), written over a poisoned buffer.
fn run(backend: &CpuBackend, w: &CpuWeight, x: &[f32], m: usize, portable: bool) -> Vec<f32> {
    let x = CpuTensor::new(x.to_vec(), m, w.cols);
    let mut y = vec![f32::from_bits(POISON); m * w.rows];
    crate::quant::matmul(&backend.pool, &x, w.quant().unwrap(), &mut y, portable).unwrap();
    y
}

fn assert_bits(what: &str, got: &[f32], want: &[f32], n: usize) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (idx, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            g.to_bits() == w.to_bits(),
            "{what}: y[{}][{}] = {g} ({:#x}), reference {w} ({:#x})",
            idx / n,
            idx % n,
            g.to_bits(),
            w.to_bits()
        );
    }
}

fn check(backend: &CpuBackend, format: LinearFormat, m: usize, n: usize, k: usize, seed: u64) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let bytes = quantized_weight(format.codec, n, k, &mut rng);
    let x = activations(m, k, &mut rng);
    let want = reference_matmul(format, &x, m, k, &bytes, n).unwrap();
    let w = load(backend, format, n, k, &bytes);
    for portable in [false, true] {
        let got = run(backend, &w, &x, m, portable);
        let what = format!("{format} m={m} n={n} k={k} portable={portable}");
        assert_bits(&what, &got, &want, n);
    }
    // The public path too (a fresh output buffer, and the expansion already cached).
    let y = backend.linear(&CpuTensor::new(x, m, k), &w, None).unwrap();
    assert_bits(&format!("{format} linear"), &y.data, &want, n);
}

#[test]
fn every_format_is_bit_identical_to_the_reference() {
    let backend = CpuBackend::new(2).unwrap();
    let mut seed = 0;
    for k in [64, 128, 576, 1536] {
        for format in kernel_formats(k) {
            // 300 columns with m >= 4 run as parallel tiles, the rest on the calling thread.
            for (m, n) in [(1, 1), (1, 300), (3, 17), (17, 3), (5, 300), (17, 17)] {
                seed += 1;
                check(&backend, format, m, n, k, seed);
            }
        }
    }
}

/// Every batch size from 1 to 40 (every mix of 4-, 2- and 1-row integer tiles and 8-, 4-, 2-
/// and 1-row float tiles).
#[test]
fn every_batch_size_from_1_to_40_is_bit_identical() {
    let backend = CpuBackend::new(2).unwrap();
    let mut seed = 10_000;
    for format in kernel_formats(128) {
        for m in 1..=40 {
            seed += 1;
            check(&backend, format, m, 37, 128, seed);
        }
    }
}

/// Input sizes that are not a multiple of the kernels' 16 channels (per-channel formats pad with
/// zeros), and group sizes the SIMD kernels do not step through (the portable kernels run).
#[test]
fn odd_input_sizes_and_group_sizes() {
    let backend = CpuBackend::new(2).unwrap();
    let mut seed = 20_000;
    for k in [1, 2, 70, 130, 1000] {
        for format in kernel_formats(k) {
            if format.row_bytes(k).is_err() {
                continue;
            }
            for (m, n) in [(1, 9), (6, 21), (9, 300)] {
                seed += 1;
                check(&backend, format, m, n, k, seed);
            }
        }
    }
    for (group, k) in [(8, 96), (48, 96), (96, 96), (16, 80)] {
        let codec = WeightCodec::Int4Group { group };
        let blocks = (k / group as usize) as u16;
        let mut formats = vec![
            LinearFormat::new(codec, ActQuant::Int8PerToken).unwrap(),
            LinearFormat::new(codec, ActQuant::F16).unwrap(),
        ];
        for int8_blocks in [0, 1, blocks] {
            let act = ActQuant::Mixed4x8 {
                block: group as u16,
                int8_blocks,
            };
            formats.push(LinearFormat::new(codec, act).unwrap());
        }
        for format in formats {
            for (m, n) in [(1, 9), (7, 40)] {
                seed += 1;
                check(&backend, format, m, n, k, seed);
            }
        }
    }
}

/// Batch invariance through the public path: a row alone, in a batch, or at another position
/// gives the same bits, across the serial/parallel switch.
#[test]
fn every_row_is_independent_of_the_batch() {
    let backend = CpuBackend::new(2).unwrap();
    let k = 576;
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    for s in [
        "int8-pc/a8",
        "int4-g64/a8",
        "qoq-g64/a8",
        "int4-g64/a4a8-b64-n2",
        "int8-pc/a16",
        "fp8-pc/afp8",
    ] {
        let format: LinearFormat = s.parse().unwrap();
        let n = 300;
        let w = load(
            &backend,
            format,
            n,
            k,
            &quantized_weight(format.codec, n, k, &mut rng),
        );
        for m in [1, 2, 3, 5, 8, 9, 16, 33] {
            let x = CpuTensor::new(activations(m, k, &mut rng), m, k);
            let y = backend.linear(&x, &w, None).unwrap();
            for i in 0..m {
                let yi = backend
                    .linear(&CpuTensor::new(x.row(i).to_vec(), 1, k), &w, None)
                    .unwrap();
                assert_bits(&format!("{s} m={m} row {i}"), y.row(i), &yi.data, n);
            }
            let perm: Vec<usize> = (0..m).map(|i| (i * 7 + 3) % m).rev().collect();
            let px = CpuTensor::new(perm.iter().flat_map(|&i| x.row(i).to_vec()).collect(), m, k);
            let py = backend.linear(&px, &w, None).unwrap();
            for (pi, &i) in perm.iter().enumerate() {
                assert_bits(&format!("{s} m={m} permuted"), py.row(pi), y.row(i), n);
            }
        }
    }
}

/// A NaN or infinite activation makes its own row's outputs NaN and leaves the other rows' bits
/// alone.
#[test]
fn non_finite_activations_poison_only_their_row() {
    let backend = CpuBackend::new(2).unwrap();
    let (m, n, k) = (5, 24, 128);
    let mut rng = ChaCha8Rng::seed_from_u64(6);
    for format in kernel_formats(k) {
        let bytes = quantized_weight(format.codec, n, k, &mut rng);
        let w = load(&backend, format, n, k, &bytes);
        let clean = activations(m, k, &mut rng);
        let want = run(&backend, &w, &clean, m, false);
        for bad in [f32::NAN, f32::INFINITY] {
            let mut x = clean.clone();
            x[2 * k + 77] = bad;
            let got = run(&backend, &w, &x, m, false);
            let refy = reference_matmul(format, &x, m, k, &bytes, n).unwrap();
            for i in 0..m {
                for c in 0..n {
                    let (g, r) = (got[i * n + c], refy[i * n + c]);
                    if i == 2 {
                        // Every format's output is NaN except that an infinite 16-bit
                        // activation times a zero weight column sums to +-inf or NaN alike.
                        let f16_inf = format.act == ActQuant::F16 && bad.is_infinite();
                        assert!(g.is_nan() || (f16_inf && g.is_infinite()), "{format}: {g}");
                        assert_eq!(g.is_nan(), r.is_nan(), "{format}");
                    } else {
                        assert_eq!(g.to_bits(), want[i * n + c].to_bits(), "{format} row {i}");
                    }
                }
            }
        }
    }
}

#[test]
fn quantized_embedding_rows_are_the_dequantized_rows() {
    let backend = CpuBackend::new(2).unwrap();
    let (rows, k) = (50, 128);
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    for s in [
        "int8-pc/a8",
        "int4-g32/a16",
        "qoq-g128/a8",
        "lqq-g64/a8",
        "fp8-pc/afp8",
    ] {
        let format: LinearFormat = s.parse().unwrap();
        let bytes = quantized_weight(format.codec, rows, k, &mut rng);
        let table = load(&backend, format, rows, k, &bytes);
        let ids = [3u32, 0, 49, 3, 17];
        let e = backend.embed(&table, &ids).unwrap();
        let mut all = vec![0f32; rows * k];
        format.codec.dequantize(&bytes, k, &mut all).unwrap();
        for (t, &id) in ids.iter().enumerate() {
            let want = &all[id as usize * k..][..k];
            assert_bits(&format!("{s} id {id}"), e.row(t), want, k);
            assert!(want.iter().any(|&v| v != 0.0) || id % 13 == 12, "{s}");
        }
        assert!(backend.embed(&table, &[50]).is_err());
    }
}

#[test]
fn bad_quantized_weights_are_refused_at_load() {
    let backend = CpuBackend::new(1).unwrap();
    let t = |format: LinearFormat, k: usize, len: usize| HostTensor {
        name: "model.layers.0.mlp.up_proj.weight".into(),
        shape: vec![2, k],
        format: WeightFormat::Quant(format),
        bytes: TensorBytes::Owned(Arc::new(vec![0u8; len])),
    };
    let f: LinearFormat = "int4-g64/a8".parse().unwrap();
    let rb = f.row_bytes(128).unwrap();
    assert!(backend.load_weight(&t(f, 128, 2 * rb)).is_ok());
    let err = backend.load_weight(&t(f, 128, 2 * rb - 1)).err().unwrap();
    assert!(err.to_string().contains("up_proj"), "{err}");
    // The group does not divide K.
    assert!(backend.load_weight(&t(f, 96, 2 * rb)).is_err());
    // A pair with no kernel.
    let bad = LinearFormat {
        codec: WeightCodec::Qoq { group: 64 },
        act: ActQuant::F16,
    };
    let err = backend.load_weight(&t(bad, 128, 2 * rb)).err().unwrap();
    assert!(err.to_string().contains("qoq-g64/a16"), "{err}");
    // More input channels than an i32 accumulator can take exactly.
    let f8: LinearFormat = "int8-pc/a8".parse().unwrap();
    let k = nibble_precision::reference::MAX_INT_K + 1;
    let err = backend
        .load_weight(&t(f8, k, 2 * f8.row_bytes(k).unwrap()))
        .err()
        .unwrap();
    assert!(err.to_string().contains("overflow"), "{err}");
    // The same K with 16-bit activations has no integer accumulator to overflow.
    let f16: LinearFormat = "int8-pc/a16".parse().unwrap();
    assert!(
        backend
            .load_weight(&t(f16, k, 2 * f16.row_bytes(k).unwrap()))
            .is_ok()
    );
}
