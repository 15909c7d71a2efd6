use half::f16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::*;

/// Values with a few large outliers, as real weights and activations have.
fn random_values(rng: &mut ChaCha8Rng, n: usize, outlier_scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let x: f32 = rng.random_range(-1.0..1.0);
            if rng.random_bool(0.02) {
                x * outlier_scale
            } else {
                x
            }
        })
        .collect()
}

fn quantize_weight(codec: WeightCodec, w: &[f32], n: usize, k: usize) -> Vec<u8> {
    let rb = codec.row_bytes(k).unwrap();
    let mut out = vec![0u8; n * rb];
    for (row, o) in w.chunks_exact(k).zip(out.chunks_exact_mut(rb)) {
        codec.quantize_row(row, 1.0, o).unwrap();
    }
    out
}

/// The weights the kernels multiply, in f64: decoded e4m3 codes times the f32 scale for FP8
/// (exactly, unlike the f32 `dequantize`), the f16-rounded values for 16-bit activations, and
/// the exact dequantized values otherwise.
fn weights_f64(format: LinearFormat, w: &[u8], n: usize, k: usize) -> Vec<f64> {
    let rb = format.row_bytes(k).unwrap();
    let mut vals = vec![0f32; k];
    let mut out = Vec::with_capacity(n * k);
    for row in w.chunks_exact(rb) {
        match (format.codec, format.act) {
            (_, ActQuant::F16) => {
                f16_weight_row(format.codec, row, k, &mut vals).unwrap();
                out.extend(vals.iter().map(|&v| v as f64));
            }
            (WeightCodec::Fp8PerChannel, _) => {
                let s = fp8_row(row, k, &mut vals) as f64;
                out.extend(vals.iter().map(|&v| v as f64 * s));
            }
            (codec, _) => {
                codec.dequantize(row, k, &mut vals).unwrap();
                out.extend(vals.iter().map(|&v| v as f64));
            }
        }
    }
    out
}

/// How many f32 roundings (each at most 2^-24 of the magnitude sum) the reference's arithmetic
/// may accumulate for one output.
fn roundings(format: LinearFormat, k: usize) -> f64 {
    match (format.codec, format.act) {
        (_, ActQuant::F16) | (_, ActQuant::Fp8PerToken) => k as f64 + 3.0,
        (WeightCodec::Int4Group { group }, _) if group > 0 => (k / group as usize) as f64 + 3.0,
        _ => 3.0,
    }
}

/// Each format against an f64 product of the dequantized weights and activations: only the
/// f32 arithmetic of the reference separates the two.
#[test]
fn every_format_matches_f64_on_the_dequantized_operands() {
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let mut cases = 0;
    for k in [64, 128, 576, 1536] {
        for format in kernel_formats(k) {
            for (m, n) in [(1, 1), (1, 17), (3, 3), (17, 1), (3, 17), (17, 17)] {
                let wf = random_values(&mut rng, n * k, 8.0);
                let x = random_values(&mut rng, m * k, 30.0);
                let w = quantize_weight(format.codec, &wf, n, k);
                let y = reference_matmul(format, &x, m, k, &w, n).unwrap();
                let w64 = weights_f64(format, &w, n, k);
                let tol_units = roundings(format, k) * 2f64.powi(-24);
                for i in 0..m {
                    let xq = format
                        .act
                        .quantize_row(&x[i * k..(i + 1) * k])
                        .unwrap()
                        .dequantize_f64();
                    for r in 0..n {
                        let wr = &w64[r * k..(r + 1) * k];
                        let want: f64 = wr.iter().zip(&xq).map(|(a, b)| a * b).sum();
                        let mag: f64 = wr.iter().zip(&xq).map(|(a, b)| (a * b).abs()).sum();
                        let got = y[i * n + r] as f64;
                        let tol = tol_units * mag + 1e-30;
                        assert!(
                            (got - want).abs() <= tol,
                            "{format} k={k} m={m} n={n} y[{i}][{r}] = {got}, f64 {want}, \
                             err {:e} > {tol:e}",
                            (got - want).abs()
                        );
                    }
                }
                cases += 1;
            }
        }
    }
    assert!(cases > 300, "{cases} cases");
}

/// End to end against the float product of the unquantized weights and activations: the error
/// stays within what each precision can do (relative Frobenius error), and the better formats
/// beat the cruder ones.
#[test]
fn quantization_error_is_appropriate_to_the_precision() {
    let (m, n, k) = (8, 64, 1536);
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    let wf: Vec<f32> = (0..n * k).map(|_| rng.random_range(-1f32..1.0)).collect();
    let x: Vec<f32> = (0..m * k).map(|_| rng.random_range(-1f32..1.0)).collect();
    let mut exact = vec![0f64; m * n];
    for i in 0..m {
        for r in 0..n {
            exact[i * n + r] = (0..k)
                .map(|j| x[i * k + j] as f64 * wf[r * k + j] as f64)
                .sum();
        }
    }
    let norm = exact.iter().map(|v| v * v).sum::<f64>().sqrt();
    let rel = |s: &str| {
        let format: LinearFormat = s.parse().unwrap();
        let w = quantize_weight(format.codec, &wf, n, k);
        let y = reference_matmul(format, &x, m, k, &w, n).unwrap();
        let e: f64 = y
            .iter()
            .zip(&exact)
            .map(|(&a, b)| (a as f64 - b).powi(2))
            .sum();
        e.sqrt() / norm
    };
    // Uniform data (measured: INT8 0.4-0.55%, FP8 2.6-3.6%, INT4 weights 6.4-6.9%, INT4
    // activations 9.9%); the bounds leave about 1.4x of room.
    for (s, bound) in [
        ("int8-pc/a16", 0.006),
        ("int8-pc/a8", 0.008),
        ("fp8-pc/a16", 0.036),
        ("fp8-pc/afp8", 0.05),
        ("int4-g32/a16", 0.09),
        ("int4-g128/a16", 0.09),
        ("int4-pc/a8", 0.09),
        ("int4-g64/a8", 0.09),
        ("qoq-g64/a8", 0.095),
        ("lqq-g64/a8", 0.095),
        ("int4-g128/a4a8-b128-n12", 0.09),
        ("int4-g128/a4a8-b128-n0", 0.14),
    ] {
        let e = rel(s);
        assert!(e <= bound, "{s}: relative error {e:.4} > {bound}");
        assert!(e > 1e-4, "{s}: relative error {e:e} is implausibly small");
    }
    assert!(rel("int8-pc/a8") < rel("int4-g64/a8"));
    assert!(rel("int4-g32/a16") < rel("int4-pc/a16"));
    assert!(rel("int4-g128/a4a8-b128-n12") < rel("int4-g128/a4a8-b128-n0"));
}

fn f16b(v: f32) -> [u8; 2] {
    f16::from_f32(v).to_le_bytes()
}

/// Nibble codes packed two per byte, element `2j` low.
fn nibbles(codes: &[u8]) -> Vec<u8> {
    codes.chunks(2).map(|p| p[0] | (p[1] << 4)).collect()
}

fn one_row(format: &str, x: &[f32], w: &[u8]) -> f32 {
    let format: LinearFormat = format.parse().unwrap();
    let y = reference_matmul(format, x, 1, x.len(), w, 1).unwrap();
    y[0]
}

/// `x = [127, 1, 1, ...]`: amax 127, so the INT8 codes equal the values and the scale is 1.
fn ones_after_127(k: usize) -> Vec<f32> {
    let mut x = vec![1f32; k];
    x[0] = 127.0;
    x
}

#[test]
fn hand_worked_int8_per_channel() {
    // Codes [0.5 -> 0 (tie to even), -1, 127, 0], scale 1; weights [1, -2, 3, 127] x 0.5.
    let mut w = vec![1u8, (-2i8) as u8, 3, 127];
    w.extend(f16b(0.5));
    let y = one_row("int8-pc/a8", &[0.5, -1.0, 127.0, 0.0], &w);
    // acc = 0 + 2 + 381 + 0 = 383; y = 383 * (1 * 0.5).
    assert_eq!(y, 191.5);
}

#[test]
fn hand_worked_int4_per_channel() {
    // q = [0, 15, 8, 7], z = 8 -> [-8, 7, 0, -1], scale 0.5; x codes [1, 2, 3, 127] (scale 1).
    let mut w = nibbles(&[0, 15, 8, 7]);
    w.extend(f16b(0.5));
    w.push(8);
    let y = one_row("int4-pc/a8", &[1.0, 2.0, 3.0, 127.0], &w);
    // acc = -8 + 14 + 0 - 127 = -121.
    assert_eq!(y, -60.5);
}

#[test]
fn hand_worked_int4_groups() {
    // Group 0: q 9, z 8 -> 1, scale 0.25. Group 1: q 0, z 3 -> -3, scale 2.
    let mut w = nibbles(&[[9u8; 32], [0u8; 32]].concat());
    w.extend(f16b(0.25));
    w.extend(f16b(2.0));
    w.extend([8, 3]);
    let y = one_row("int4-g32/a8", &ones_after_127(64), &w);
    // p0 = 127 + 31 = 158, p1 = -3 * 32 = -96; t = 158 * 0.25 = 39.5, t = -192 + 39.5.
    assert_eq!(y, -152.5);
}

#[test]
fn hand_worked_qoq() {
    // Group 0: (5 - 3) * 2 = 4. Group 1: (0 - 15) * 8 = -120. Channel scale 0.5.
    let mut w = nibbles(&[[5u8; 32], [0u8; 32]].concat());
    w.extend([2, 8, 3, 15]);
    w.extend(f16b(0.5));
    let y = one_row("qoq-g32/a8", &ones_after_127(64), &w);
    // acc = 4 * 127 + 4 * 31 - 120 * 32 = -3208.
    assert_eq!(y, -1604.0);
}

#[test]
fn hand_worked_lqq() {
    // Group 0: 3 * 5 + 100 - 128 = -13. Group 1: 15 * 17 + 0 - 128 = 127. Channel scale 0.25.
    let mut w = nibbles(&[[3u8; 32], [15u8; 32]].concat());
    w.extend([5, 17, 100, 0]);
    w.extend(f16b(0.25));
    let y = one_row("lqq-g32/a8", &ones_after_127(64), &w);
    // acc = -13 * 127 - 13 * 31 + 127 * 32 = 2010.
    assert_eq!(y, 502.5);
}

#[test]
fn hand_worked_comet_mixed_blocks() {
    // Weights as in `hand_worked_int4_groups`: [1 x 32] at 0.25, [-3 x 32] at 2.
    let mut w = nibbles(&[[9u8; 32], [0u8; 32]].concat());
    w.extend(f16b(0.25));
    w.extend(f16b(2.0));
    w.extend([8, 3]);
    // Block 0 (INT8): [127, 1, ...] -> scale 1, codes equal. Block 1 (INT4): [7, 3.5, ...] ->
    // scale 1, 3.5 ties to even 4.
    let mut x = ones_after_127(32);
    x.push(7.0);
    x.extend([3.5f32; 31]);
    let y = one_row("int4-g32/a4a8-b32-n1", &x, &w);
    // p0 = 158 -> 39.5; p1 = -3 * (7 + 31 * 4) = -393 -> -786 + 39.5.
    assert_eq!(y, -746.5);
    // All blocks INT4: block 0 scale 127 / 7, codes [7, 0 (1 / 18.14 rounds to 0), ...].
    let y = one_row("int4-g32/a4a8-b32-n0", &x, &w);
    let s0 = 127f32 / 7.0;
    assert_eq!(y, (-393f32).mul_add(2.0, 7f32 * (0.25 * s0)));
}

#[test]
fn hand_worked_sixteen_bit() {
    // Weight 3 * f16(0.1) = 4914 / 2^14 is a tie between f16 neighbours 4912 and 4916 (2^-12
    // apart): even 4912 / 2^14. x[0] = f16(1/3) = 5460 / 2^14. The second term is -1638 / 2^14.
    let mut w = vec![3u8, (-1i8) as u8];
    w.extend(f16b(0.1));
    let y = one_row("int8-pc/a16", &[1.0 / 3.0, 1.0], &w);
    // 4912 * 5460 / 2^28 - 1638 * 2^14 / 2^28, exact in f32.
    assert_eq!(y, (4912.0 * 5460.0 - 1638.0 * 16384.0) / 2f32.powi(28));
}

#[test]
fn hand_worked_fp8() {
    // Weight codes 1.5 and -2 (e4m3 0x3C, 0xC0), scale 0.5; x = [448, 0.75] -> scale 1, codes
    // 448 and 0.75.
    let mut w = vec![0x3C, 0xC0];
    w.extend(0.5f32.to_le_bytes());
    let y = one_row("fp8-pc/afp8", &[448.0, 0.75], &w);
    assert_eq!(y, (1.5 * 448.0 - 2.0 * 0.75) * 0.5);
}

#[test]
fn bad_arguments_are_refused() {
    let f: LinearFormat = "int8-pc/a8".parse().unwrap();
    let w = vec![0u8; 66];
    assert!(reference_matmul(f, &[0.0; 64], 1, 64, &w, 1).is_ok());
    assert!(reference_matmul(f, &[0.0; 63], 1, 64, &w, 1).is_err());
    assert!(reference_matmul(f, &[0.0; 64], 1, 64, &w[..65], 1).is_err());
    // A pair without a kernel, built around `LinearFormat::new`.
    let bad = LinearFormat {
        codec: WeightCodec::Qoq { group: 32 },
        act: ActQuant::F16,
    };
    let w = vec![0u8; bad.codec.row_bytes(64).unwrap()];
    let err = reference_matmul(bad, &[0.0; 64], 1, 64, &w, 1).unwrap_err();
    assert!(err.to_string().contains("qoq-g32/a16"), "{err}");
    let k = MAX_INT_K + 1;
    let w = vec![0u8; f.row_bytes(k).unwrap()];
    let err = reference_matmul(f, &vec![0.0; k], 1, k, &w, 1).unwrap_err();
    assert!(err.to_string().contains("overflow"), "{err}");
}
