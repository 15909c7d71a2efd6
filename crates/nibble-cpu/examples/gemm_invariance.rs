//! Evidence for linear.rs's design: the gemm crate gives an output row different bits once the
//! batch has more than 4 rows, so a request's logits would depend on its batch-mates. Run:
//! `cargo run --release -p nibble-cpu --example gemm_invariance`.
use rand::{Rng, SeedableRng};

/// `x[m, k] @ w[n, k]^T` through the gemm crate, single-threaded.
fn gemm_rows(x: &[f32], w: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
    let mut out = vec![0f32; m * n];
    // SAFETY: out is m x n (row stride n), x is m x k (row stride k), w^T is k x n viewed with
    // column stride k; all slices are at least that long.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            out.as_mut_ptr(),
            1,
            n as isize,
            false,
            x.as_ptr(),
            1,
            k as isize,
            w.as_ptr(),
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
    out
}

fn main() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
    let (k, n, rows) = (576usize, 64usize, 64usize);
    let w: Vec<f32> = (0..n * k).map(|_| rng.random_range(-1.0..1.0)).collect();
    let x: Vec<f32> = (0..rows * k).map(|_| rng.random_range(-1.0..1.0)).collect();
    let alone: Vec<Vec<f32>> = (0..rows)
        .map(|i| gemm_rows(&x[i * k..(i + 1) * k], &w, 1, n, k))
        .collect();
    for m in [1, 2, 3, 4, 5, 8, 16, 17, 33, 64] {
        let batched = gemm_rows(&x[..m * k], &w, m, n, k);
        let same = (0..m).all(|i| {
            batched[i * n..(i + 1) * n]
                .iter()
                .zip(&alone[i])
                .all(|(a, b)| a.to_bits() == b.to_bits())
        });
        println!("m={m}: every row identical to its m=1 result: {same}");
    }
}
