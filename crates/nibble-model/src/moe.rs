//! Mixture-of-experts routing: which experts each token of a batch runs, and the weight of each
//! one's output. It runs on the host, from the router logits, so that every backend routes the
//! same way: routing decides which weights a token reads, and a different choice on near-ties
//! would change a token's output far more than any rounding.

use nibble_core::{Error, Result};

/// The tokens one expert runs on, in batch order, with the weight of its output for each.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ExpertRows {
    pub rows: Vec<usize>,
    pub weights: Vec<f32>,
}

/// Routes each row of `logits` (`[tokens, num_experts]`, row-major): softmax in f32 over all
/// experts (max subtracted, sum in expert order), the `top_k` largest probabilities (the lower
/// expert index first on ties), divided by their sum (taken in rank order) when `renormalize`.
/// Returns, per expert, the rows that chose it. A row's routing depends on its logits only, so a
/// token's experts and weights do not depend on its batch.
pub fn route(
    logits: &[f32],
    num_experts: usize,
    top_k: usize,
    renormalize: bool,
) -> Result<Vec<ExpertRows>> {
    if num_experts == 0 || top_k == 0 || top_k > num_experts {
        return Err(Error::InvalidArgument(format!(
            "routing top {top_k} of {num_experts} experts"
        )));
    }
    if !logits.len().is_multiple_of(num_experts) {
        return Err(Error::InvalidArgument(format!(
            "{} router logits are not rows of {num_experts} experts",
            logits.len()
        )));
    }
    let mut out = vec![ExpertRows::default(); num_experts];
    let mut probs = vec![0f32; num_experts];
    let mut order: Vec<usize> = Vec::with_capacity(num_experts);
    for (row, l) in logits.chunks_exact(num_experts).enumerate() {
        let max = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0f32;
        for (p, &x) in probs.iter_mut().zip(l) {
            *p = (x - max).exp();
            sum += *p;
        }
        for p in &mut probs {
            *p /= sum;
        }
        order.clear();
        order.extend(0..num_experts);
        // A total order, so that even a NaN routes deterministically (and shows in the output).
        order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]).then(a.cmp(&b)));
        let chosen = &order[..top_k];
        let scale = if renormalize {
            1.0 / chosen.iter().map(|&e| probs[e]).sum::<f32>()
        } else {
            1.0
        };
        for &e in chosen {
            let w = if renormalize {
                probs[e] * scale
            } else {
                probs[e]
            };
            out[e].rows.push(row);
            out[e].weights.push(w);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn softmax_top_k_and_renormalization() {
        // One token over 4 experts: probabilities ∝ e^[0, 2, 1, 2].
        let logits = [0.0, 2.0, 1.0, 2.0];
        let e: Vec<f32> = logits.iter().map(|x: &f32| x.exp()).collect();
        let total: f32 = e.iter().sum();
        let raw = route(&logits, 4, 2, false).unwrap();
        // The tie between experts 1 and 3 is no tie at top 2; both are chosen.
        assert_eq!(raw[1].rows, vec![0]);
        assert_eq!(raw[3].rows, vec![0]);
        assert!(raw[0].rows.is_empty() && raw[2].rows.is_empty());
        assert!((raw[1].weights[0] - e[1] / total).abs() < 1e-6);
        let norm = route(&logits, 4, 2, true).unwrap();
        assert!((norm[1].weights[0] - 0.5).abs() < 1e-6);
        assert!((norm[3].weights[0] - 0.5).abs() < 1e-6);
        // On an exact tie for the last place, the lower index wins.
        let tied = route(&[1.0, 3.0, 1.0], 3, 2, true).unwrap();
        assert_eq!(tied[0].rows, vec![0]);
        assert!(tied[2].rows.is_empty());
    }

    #[test]
    fn a_row_routes_the_same_in_any_batch() {
        let a = [0.3, -1.0, 2.5, 0.7, 1.1, -0.2];
        let b = [5.0, 1.0, -3.0, 0.0, 0.5, 0.25];
        let alone = route(&a, 6, 2, false).unwrap();
        let batch: Vec<f32> = b.iter().chain(&a).copied().collect();
        let both = route(&batch, 6, 2, false).unwrap();
        for (x, y) in alone.iter().zip(&both) {
            let from_a: Vec<f32> = y
                .rows
                .iter()
                .zip(&y.weights)
                .filter(|(r, _)| **r == 1)
                .map(|(_, w)| *w)
                .collect();
            assert_eq!(x.weights, from_a);
        }
    }

    #[test]
    fn bad_shapes_are_errors() {
        assert!(route(&[0.0; 4], 4, 5, true).is_err());
        assert!(route(&[0.0; 4], 4, 0, true).is_err());
        assert!(route(&[0.0; 5], 4, 2, true).is_err());
    }
}
