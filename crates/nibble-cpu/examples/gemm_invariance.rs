//! Evidence for linear.rs's design: the gemm crate gives an output row different bits once the
//! batch has more than 4 rows, so a request's logits would depend on its batch-mates. Run:
//! `cargo run --release -p nibble-cpu --example gemm_invariance`.
fn main() {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
    let (k, n) = (576usize, 64usize);
    let w: Vec<f32> = (0..n * k).map(|_| rng.random_range(-1.0..1.0)).collect();
    let x: Vec<f32> = (0..64 * k).map(|_| rng.random_range(-1.0..1.0)).collect();
    let run = |m: usize| {
        let mut out = vec![0f32; m * n];
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
    };
    let base: Vec<Vec<f32>> = (0..64)
        .map(|i| {
            let mut out = vec![0f32; n];
            unsafe {
                gemm::gemm(
                    1,
                    n,
                    k,
                    out.as_mut_ptr(),
                    1,
                    n as isize,
                    false,
                    x[i * k..].as_ptr(),
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
        })
        .collect();
    for m in [1, 2, 3, 4, 5, 8, 16, 17, 33, 64] {
        let o = run(m);
        let same = (0..m).all(|i| {
            o[i * n..(i + 1) * n]
                .iter()
                .zip(&base[i])
                .all(|(a, b)| a.to_bits() == b.to_bits())
        });
        println!("m={m}: rows identical to m=1: {same}");
    }
}
