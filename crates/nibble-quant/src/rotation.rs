//! Orthogonal rotations of the residual stream (QuaRot/QoQ block-input rotation), built so that
//! every hidden size a Llama-family model uses gets a matrix with entries of equal magnitude.
//!
//! `R = D H / sqrt(n)` with `D` diagonal random signs (seeded) and `H` a Hadamard matrix
//! (`H H^T = n I`, entries ±1). A flat `H` spreads any one outlier channel evenly over all `n`
//! channels, which is the point of rotating. `H` is a Kronecker product `H_{2^a} ⊗ H_b`:
//!
//! * `H_{2^a}`: Sylvester's construction, applied by the fast Walsh-Hadamard transform.
//! * `H_b` for the odd part `m` of `n = 2^p m`: a Paley type-I matrix of order `b = m 2^t`
//!   (`t <= p` smallest) where `b - 1` is a prime `≡ 3 (mod 4)`: 12 for `m = 3`, 20 for 5,
//!   72 for 9 (576 = 8 x 72, SmolLM2's width), 224 for 7 (896 = 4 x 224, Qwen2-0.5B).
//! * When no such prime exists below `n` (no Llama-family width known to us), `H_b` is replaced
//!   by a random orthogonal `m x m` matrix (seeded Gram-Schmidt, scaled by `sqrt(m)`): still
//!   orthogonal, so the function is kept, but an outlier is spread less evenly.
//!
//! Applying `R` to a row vector costs `n (b + log2 n)` flops instead of `n^2`, which is what
//! makes rotating a 49k-row embedding table cheap.

use nibble_core::{Error, Result};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

use crate::dense::{DenseModel, Mat};

/// A seeded orthogonal `n x n` matrix `D (H_{2^a} ⊗ B) / sqrt(n)`.
#[derive(Debug, Clone)]
pub struct Rotation {
    n: usize,
    signs: Vec<f64>,
    /// Order of the Sylvester factor.
    pow2: usize,
    /// The small factor `B` (`b x b`, row-major) with `B B^T = b I`.
    small: Vec<f64>,
    b: usize,
    /// Whether `B` is a Hadamard matrix (entries ±1) rather than the random fallback.
    pub flat: bool,
}

impl Rotation {
    pub fn new(n: usize, seed: u64) -> Result<Rotation> {
        if n == 0 {
            return Err(Error::InvalidArgument(
                "cannot rotate a zero-width stream".into(),
            ));
        }
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let signs: Vec<f64> = (0..n)
            .map(|_| if rng.random_bool(0.5) { 1.0 } else { -1.0 })
            .collect();
        let p = n.trailing_zeros() as usize;
        let m = n >> p;
        let (small, b, flat) = if m == 1 {
            (vec![1.0], 1, true)
        } else if let Some(t) = (0..=p).find(|&t| paley_prime(m << t)) {
            let b = m << t;
            (paley(b), b, true)
        } else {
            let scale = (m as f64).sqrt();
            let q = random_orthogonal(m, &mut rng);
            (q.into_iter().map(|v| v * scale).collect(), m, false)
        };
        Ok(Rotation {
            n,
            signs,
            pow2: n / b,
            small,
            b,
            flat,
        })
    }

    pub fn size(&self) -> usize {
        self.n
    }

    /// `x <- x R` for a row vector `x` of length `n`, in f64.
    pub fn apply(&self, x: &mut [f32]) {
        assert_eq!(x.len(), self.n, "rotation width");
        let (a, b) = (self.pow2, self.b);
        // Index i * b + j of x is element (i, j) of an a x b matrix X, and
        // x (H_a ⊗ B) = vec(H_a^T X B); H_a (Sylvester) is symmetric.
        let mut v: Vec<f64> = x
            .iter()
            .zip(&self.signs)
            .map(|(&x, s)| x as f64 * s)
            .collect();
        if b > 1 {
            let mut tmp = vec![0f64; b];
            for row in v.chunks_exact_mut(b) {
                tmp.fill(0.0);
                for (i, &xi) in row.iter().enumerate() {
                    if xi != 0.0 {
                        for (t, &h) in tmp.iter_mut().zip(&self.small[i * b..(i + 1) * b]) {
                            *t += xi * h;
                        }
                    }
                }
                row.copy_from_slice(&tmp);
            }
        }
        let mut h = 1;
        while h < a {
            for start in (0..a).step_by(2 * h) {
                for i in start..start + h {
                    for j in 0..b {
                        let (p, q) = (i * b + j, (i + h) * b + j);
                        let (u, w) = (v[p], v[q]);
                        v[p] = u + w;
                        v[q] = u - w;
                    }
                }
            }
            h *= 2;
        }
        let norm = 1.0 / (self.n as f64).sqrt();
        for (o, v) in x.iter_mut().zip(v) {
            *o = (v * norm) as f32;
        }
    }

    /// The matrix itself (row `i` is `e_i R`), for checks and small models.
    pub fn matrix(&self) -> Mat {
        let mut data = vec![0f32; self.n * self.n];
        for (i, row) in data.chunks_exact_mut(self.n).enumerate() {
            row[i] = 1.0;
            self.apply(row);
        }
        Mat::new(self.n, self.n, data)
    }

    /// Applies `x <- x R` to every row of `m` (a reader of the stream: `W' = W R`).
    pub fn apply_rows(&self, m: &mut Mat) {
        let cols = m.cols;
        m.data.par_chunks_mut(cols).for_each(|r| self.apply(r));
    }

    /// `W' = R^T W` for a writer into the stream (`W` is `[n, in]`): every column is a row
    /// vector of the stream, rotated like a hidden state.
    pub fn apply_cols(&self, m: &mut Mat) {
        let mut t = m.transpose();
        self.apply_rows(&mut t);
        *m = t.transpose();
    }
}

/// Rotates the residual stream of `model` by `rot` (what [`DenseModel::rotate_residual`] does
/// with a dense matrix, in `O(n log n)` per vector). Needs unit norm weights
/// ([`DenseModel::fold_norms`]); `progress(done, total)` per layer.
pub fn rotate_residual(
    model: &mut DenseModel,
    rot: &Rotation,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<()> {
    let h = model.config.hidden_size;
    if rot.size() != h {
        return Err(Error::InvalidArgument(format!(
            "a residual rotation must be {h} wide, got {}",
            rot.size()
        )));
    }
    let unit = |w: &[f32]| w.iter().all(|&x| x == 1.0);
    if !(unit(&model.final_norm)
        && model
            .layers
            .iter()
            .all(|l| unit(&l.attn_norm) && unit(&l.mlp_norm)))
    {
        return Err(Error::InvalidArgument(
            "rotating the residual stream needs the norm weights folded first (fold_norms)".into(),
        ));
    }
    model.untie_head();
    let total = model.layers.len() + 1;
    rot.apply_rows(&mut model.embed);
    rot.apply_rows(model.lm_head.as_mut().expect("untied above"));
    progress(1, total);
    for i in 0..model.layers.len() {
        let l = &mut model.layers[i];
        for m in l.residual_readers_mut() {
            rot.apply_rows(m);
        }
        for m in l.residual_writers_mut() {
            rot.apply_cols(m);
        }
        progress(i + 2, total);
    }
    Ok(())
}

/// Rotates every value head of `model` by `rot` (`head_dim` wide): each head's values `v`
/// become `v R`, so v_proj's rows of a KV head (and its bias) become `Rᵀ W_v`, and every query
/// head's slice of o_proj's input columns becomes `W_o R`. Attention mixes a head's values over
/// tokens linearly and per head, so its output is the old output times `R`, which o_proj undoes:
/// the function is kept. What changes is what gets quantized: a value cache quantized per token
/// and head (KV4/KV8) and o_proj's per-token INT8 input see each value dim's outliers spread over
/// the whole head. Query heads of a KV group read the same rotated values, so they all take `R`.
pub fn rotate_values(model: &mut DenseModel, rot: &Rotation) -> Result<()> {
    let c = model.config.clone();
    let hd = c.head_dim;
    if rot.size() != hd {
        return Err(Error::InvalidArgument(format!(
            "a value rotation must be head_dim = {hd} wide, got {}",
            rot.size()
        )));
    }
    for l in &mut model.layers {
        // v_proj: rows h * hd .. (h + 1) * hd are KV head h's writer, `W' = Rᵀ W`.
        let cols = l.v.cols;
        for h in 0..c.num_kv_heads {
            let rows = &mut l.v.data[h * hd * cols..(h + 1) * hd * cols];
            let mut block = Mat::new(hd, cols, rows.to_vec());
            rot.apply_cols(&mut block);
            rows.copy_from_slice(&block.data);
        }
        if let Some(b) = &mut l.v_bias {
            b.chunks_exact_mut(hd).for_each(|head| rot.apply(head));
        }
        // o_proj: every row's slice of each query head is a reader of that head, `W' = W R`.
        l.o.data
            .par_chunks_mut(l.o.cols)
            .for_each(|row| row.chunks_exact_mut(hd).for_each(|head| rot.apply(head)));
    }
    Ok(())
}

/// Whether `b - 1` is a prime `≡ 3 (mod 4)`, so Paley's type-I construction gives `H_b`.
fn paley_prime(b: usize) -> bool {
    b >= 4 && (b - 1) % 4 == 3 && is_prime(b - 1)
}

fn is_prime(q: usize) -> bool {
    q >= 2
        && (2..)
            .take_while(|d| d * d <= q)
            .all(|d| !q.is_multiple_of(d))
}

/// Paley type I: for a prime `q ≡ 3 (mod 4)`, `H = I + S` of order `q + 1` with
/// `S = [[0, 1^T], [-1, Q]]` and `Q[i][j] = χ(j - i)` (the Legendre symbol). `Q` is
/// antisymmetric because `χ(-1) = -1`, which makes `H H^T = (q + 1) I`.
fn paley(b: usize) -> Vec<f64> {
    let q = b - 1;
    let mut square = vec![false; q];
    for x in 1..q {
        square[x * x % q] = true;
    }
    let chi = |v: usize| -> f64 {
        if v == 0 {
            0.0
        } else if square[v] {
            1.0
        } else {
            -1.0
        }
    };
    let mut h = vec![0f64; b * b];
    for i in 0..b {
        for j in 0..b {
            let s = match (i, j) {
                (0, 0) => 0.0,
                (0, _) => 1.0,
                (_, 0) => -1.0,
                _ => chi((j + q - i) % q),
            };
            h[i * b + j] = s + if i == j { 1.0 } else { 0.0 };
        }
    }
    h
}

/// A random orthogonal `m x m` matrix (row-major) by Gram-Schmidt on uniform rows, in f64.
fn random_orthogonal(m: usize, rng: &mut ChaCha8Rng) -> Vec<f64> {
    let mut q: Vec<Vec<f64>> = Vec::with_capacity(m);
    while q.len() < m {
        let mut v: Vec<f64> = (0..m).map(|_| rng.random_range(-1.0..1.0)).collect();
        // Twice, so rounding left by the first pass is removed too.
        for _ in 0..2 {
            for u in &q {
                let d: f64 = v.iter().zip(u).map(|(a, b)| a * b).sum();
                v.iter_mut().zip(u).for_each(|(a, b)| *a -= d * b);
            }
        }
        let norm = v.iter().map(|a| a * a).sum::<f64>().sqrt();
        if norm > 1e-3 {
            q.push(v.into_iter().map(|a| a / norm).collect());
        }
    }
    q.into_iter().flatten().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paley_matrices_are_hadamard() {
        for b in [4, 8, 12, 20, 24, 72, 224] {
            assert!(paley_prime(b), "{b}");
            let h = paley(b);
            assert!(h.iter().all(|&v| v == 1.0 || v == -1.0), "{b}: entries ±1");
            for i in 0..b {
                for j in 0..b {
                    let d: f64 = (0..b).map(|k| h[i * b + k] * h[j * b + k]).sum();
                    assert_eq!(d, if i == j { b as f64 } else { 0.0 }, "H_{b} ({i},{j})");
                }
            }
        }
        // 27 and 35 are not prime, 17 is 1 mod 4.
        assert!(!paley_prime(28) && !paley_prime(36) && !paley_prime(18));
    }

    fn max_orthogonality_error(r: &Mat) -> f64 {
        let n = r.rows;
        let mut worst = 0f64;
        for i in 0..n {
            for j in 0..n {
                let d: f64 = r
                    .row(i)
                    .iter()
                    .zip(r.row(j))
                    .map(|(a, b)| *a as f64 * *b as f64)
                    .sum();
                worst = worst.max((d - if i == j { 1.0 } else { 0.0 }).abs());
            }
        }
        worst
    }

    /// Orthogonal for every construction path, and flat (all entries ±1/sqrt(n)) whenever a
    /// Hadamard factor exists: powers of two, 3·2^k, 9·2^k (576), 7·2^k (896), 5·2^k.
    #[test]
    fn rotations_are_orthogonal_and_flat_where_possible() {
        for (n, flat) in [
            (1, true),
            (2, true),
            (64, true),
            (96, true),
            (576, true),
            (896, true),
            (160, true),
            (18, false),
            (9, false),
            (100, false),
        ] {
            let rot = Rotation::new(n, 5).unwrap();
            assert_eq!(rot.flat, flat, "n = {n}");
            let r = rot.matrix();
            let err = max_orthogonality_error(&r);
            assert!(err < 1e-5, "n = {n}: R R^T off by {err}");
            if flat {
                let want = 1.0 / (n as f32).sqrt();
                assert!(
                    r.data.iter().all(|v| (v.abs() - want).abs() < 1e-6),
                    "n = {n}: not flat"
                );
            }
        }
        assert!(Rotation::new(0, 1).is_err());
    }

    /// The fast application equals multiplying by the matrix, and the seed picks the signs.
    #[test]
    fn fast_apply_is_the_matrix_product() {
        let rot = Rotation::new(24, 9).unwrap();
        let r = rot.matrix();
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let x: Vec<f32> = (0..24).map(|_| rng.random_range(-1.0..1.0)).collect();
        let mut fast = x.clone();
        rot.apply(&mut fast);
        for (j, f) in fast.iter().enumerate() {
            let want: f64 = (0..24).map(|i| x[i] as f64 * r.row(i)[j] as f64).sum();
            assert!((*f as f64 - want).abs() < 1e-6);
        }
        assert_ne!(
            Rotation::new(24, 9).unwrap().matrix(),
            Rotation::new(24, 10).unwrap().matrix()
        );
        // An outlier channel is spread evenly: its energy lands on every output channel.
        let mut spike = vec![0f32; 576];
        spike[100] = 24.0;
        Rotation::new(576, 3).unwrap().apply(&mut spike);
        assert!(spike.iter().all(|v| (v.abs() - 1.0).abs() < 1e-5));
    }
}
