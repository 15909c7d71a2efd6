//! Next-token sampling as one exact function of (logits, parameters, seed, draw index), the
//! reference that every backend's sampler reproduces bit for bit.
//!
//! The semantics are llama.cpp's and Hugging Face's: an allowed-token mask (structured outputs)
//! first, then the repetition penalty, the additive adjustments (OpenAI's `logit_bias`,
//! `presence_penalty` and `frequency_penalty`, summed per token on the host by
//! [`additive_deltas`]), temperature, top-k, min-p, top-p (nucleus), then a draw. What makes the GPU able to give the very same token is
//! that nothing here depends on the order of a floating-point sum:
//!
//! * **Ranking** is by a 64-bit key, the scaled logit's order-preserving bits above the complement
//!   of the token id: every key is distinct, a larger key ranks first, and ties in value go to
//!   the lower id (as greedy argmax does). Top-k and top-p are thresholds on this key.
//! * **Probabilities** are `exp_det(s - max)`, an exponential built from IEEE-rounded adds and
//!   multiplies only (no fused multiply-add, no library call), then **mass** in fixed point
//!   (`p * 2^32`, truncated): sums of masses are integer sums, exact in any order.
//! * **The draw** is one uniform per (seed, draw index) from a counter-based hash, scaled to the
//!   kept mass in integer arithmetic, and walked over the kept tokens in id order.
//!
//! Log-probabilities (`top_logprobs`) are reported from the raw logits, before any penalty or
//! filter, as OpenAI's API does; those are ordinary floats, equal across backends to rounding.

use nibble_core::{Error, Result};

/// How to pick the next token. Every knob has an "off" value so one struct covers greedy decoding
/// and any mix of filters.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
// Request bodies usually set one or two knobs; the rest must fall back to "off", not be errors.
#[serde(default)]
pub struct SamplingParams {
    /// 0 means greedy (argmax); the filters below are then irrelevant.
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; 0 = off.
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability mass reaches `top_p`; 1 = off.
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely one; 0 = off.
    pub min_p: f32,
    /// CTRL-style penalty for tokens already in the history; 1 = off.
    pub repetition_penalty: f32,
    /// OpenAI's: subtracted once from the logit of every token already generated; 0 = off.
    pub presence_penalty: f32,
    /// OpenAI's: subtracted from a token's logit once per time it was generated; 0 = off.
    pub frequency_penalty: f32,
    /// OpenAI's `logit_bias`: added to the token's logit; empty = off.
    pub logit_bias: Vec<(u32, f32)>,
    /// Fixed seed for reproducible output; `None` seeds from OS entropy.
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: Vec::new(),
            seed: None,
        }
    }
}

impl SamplingParams {
    /// Rejects values that would silently produce garbage (NaN probabilities, empty candidate
    /// sets) so the mistake surfaces at request time rather than as odd output.
    pub fn validate(&self) -> Result<()> {
        let bad = |field: &str, value: f32, want: &str| {
            Err(Error::InvalidArgument(format!(
                "sampling parameter {field} is {value}, but must be {want}"
            )))
        };
        let t = self.temperature;
        if !t.is_finite() || t < 0.0 {
            return bad("temperature", t, "a finite number >= 0");
        }
        let p = self.top_p;
        // Written so NaN fails the check too.
        if !(p > 0.0 && p <= 1.0) {
            return bad("top_p", p, "in (0, 1]");
        }
        let m = self.min_p;
        if !(0.0..=1.0).contains(&m) {
            return bad("min_p", m, "in [0, 1]");
        }
        let r = self.repetition_penalty;
        // Infinity is rejected as well: it maps every repeated positive logit to 0 and every
        // negative one to -inf, which is never what a caller means.
        if !(r > 0.0 && r.is_finite()) {
            return bad("repetition_penalty", r, "a finite number > 0");
        }
        // OpenAI's ranges: past them a penalty or bias only ever means "always" or "never".
        for (field, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                return bad(field, v, "in [-2, 2]");
            }
        }
        for &(id, b) in &self.logit_bias {
            if !(-100.0..=100.0).contains(&b) {
                return bad(&format!("logit_bias[{id}]"), b, "in [-100, 100]");
            }
        }
        Ok(())
    }

    /// Whether sampling reads the generated tokens (presence and frequency penalties).
    pub fn uses_output(&self) -> bool {
        self.presence_penalty != 0.0 || self.frequency_penalty != 0.0
    }

    /// Whether sampling reads the sequence's tokens at all: then a step cannot be sampled
    /// before the previous step's token is on the host.
    pub fn uses_history(&self) -> bool {
        self.repetition_penalty != 1.0 || self.uses_output()
    }
}

/// The most top alternatives a request may ask for (OpenAI's limit, which the server enforces):
/// what a device sampler reports per token.
pub const MAX_TOP_LOGPROBS: usize = 20;

/// One row of a batch's logits to sample from.
#[derive(Debug, Clone)]
pub struct SampleSpec<'a> {
    /// Row of the logits tensor.
    pub row: usize,
    pub params: &'a SamplingParams,
    /// The sequence's seed (already resolved when the request gave none).
    pub seed: u64,
    /// How many tokens this sequence drew before: the random stream's position.
    pub draw: u64,
    /// Tokens the repetition penalty looks at (prompt and output so far).
    pub history: &'a [u32],
    /// The generated tokens, which the presence and frequency penalties count.
    pub output: &'a [u32],
    /// Structured outputs: bit `i % 32` of word `i / 32` says whether token `i` may be sampled
    /// (`vocab.div_ceil(32)` words); `None` allows every token.
    pub allowed: Option<&'a [u32]>,
    /// Report the chosen token's log-probability and this many top alternatives.
    pub logprobs: Option<usize>,
}

/// A sampled token and, when asked for, log-probabilities from the raw logits.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    pub token: u32,
    pub logprobs: Option<TokenLogprobs>,
}

/// A batch's sampling as [`crate::Backend::launch_sample`] left it: already on the host, or
/// queued on the device behind the forward pass, its tokens to be fetched by
/// [`crate::Backend::collect_sample`].
#[derive(Debug)]
pub enum PendingSample {
    Ready(Vec<Sampled>),
    /// `slot` names the backend's staging area for the results; `logprobs` is each spec's
    /// request, which says what to read back from it.
    Queued {
        slot: usize,
        logprobs: Vec<Option<usize>>,
    },
}

impl PendingSample {
    /// Whether the tokens are still on the device, where the next forward pass can read them
    /// ([`crate::Backend::feed_sampled`]).
    pub fn on_device(&self) -> bool {
        matches!(self, PendingSample::Queued { .. })
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    /// The chosen token's log-probability.
    pub logprob: f32,
    /// The most likely tokens, most likely first.
    pub top: Vec<(u32, f32)>,
}

/// Rank key of a scaled logit `s` (not NaN) of token `id`: larger ranks first; equal values go
/// to the lower id.
pub fn rank_key(s: f32, id: u32) -> u64 {
    let bits = s.to_bits();
    let ordered = if bits & 0x8000_0000 != 0 {
        !bits
    } else {
        bits | 0x8000_0000
    };
    (u64::from(ordered) << 32) | u64::from(!id)
}

/// Token id of a rank key.
pub fn key_id(key: u64) -> u32 {
    !(key as u32)
}

/// `e^x` for `x <= 0`, from IEEE-rounded multiplies and adds in a fixed order (so every backend
/// computes the same bits), within a few ulp of the true value; 0 below -87.
pub fn exp_det(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 split so that n * LN2_HI is exact for |n| < 2^11; kernels/sampling.cu spells the same
    // digits.
    #[allow(clippy::excessive_precision)]
    const LN2_HI: f32 = 0.693_145_751_953_125;
    #[allow(clippy::excessive_precision)]
    const LN2_LO: f32 = 1.428_606_765_330_187e-6;
    if x.is_nan() || x < -87.0 {
        return 0.0;
    }
    let n = (x * LOG2E + 0.5).floor();
    let r = (x - n * LN2_HI) - n * LN2_LO;
    // Taylor to r^6 on |r| <= ln2/2: error under 2^-26 relative before the scaling.
    let mut p = 1.0 / 720.0;
    p = p * r + 1.0 / 120.0;
    p = p * r + 1.0 / 24.0;
    p = p * r + 1.0 / 6.0;
    p = p * r + 0.5;
    p = p * r + 1.0;
    p = p * r + 1.0;
    // n is in [-126, 0] here: 2^n is a normal float.
    let scale = f32::from_bits(((n as i32 + 127) as u32) << 23);
    p * scale
}

/// Fixed-point mass of an unnormalized probability `p` in [0, 1]: `p * 2^32`, truncated.
pub fn mass(p: f32) -> u64 {
    (p * 4_294_967_296.0) as u64
}

/// A 53-bit uniform integer for draw `draw` of stream `seed` (splitmix64 of both).
pub fn uniform53(seed: u64, draw: u64) -> u64 {
    fn mix(mut z: u64) -> u64 {
        z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    mix(seed ^ mix(draw)) >> 11
}

/// `floor(u53 * total / 2^53)`: the draw's point in `[0, total)`.
pub fn scale_draw(u53: u64, total: u64) -> u64 {
    ((u128::from(u53) * u128::from(total)) >> 53) as u64
}

/// The top-p target: the mass the kept prefix must reach, at least one unit.
pub fn top_p_target(total: u64, top_p: f32) -> u64 {
    ((total as f64 * f64::from(top_p)) as u64).max(1)
}

/// Sets the logit of every token `allowed` leaves out (and of every token past its words) to
/// -inf, so that no filter can bring it back.
pub fn apply_mask(logits: &mut [f32], allowed: &[u32]) {
    for (i, l) in logits.iter_mut().enumerate() {
        if allowed.get(i / 32).is_none_or(|w| (w >> (i % 32)) & 1 == 0) {
            *l = f32::NEG_INFINITY;
        }
    }
}

/// The additive adjustment of each token that has one, sorted by id: `logit_bias` minus
/// `presence + frequency * count` over the generated tokens, each computed once here in f32, so
/// that every backend adds the very same number (the GPU's kernel looks them up). Ids at or past
/// `vocab` are left out.
pub fn additive_deltas(params: &SamplingParams, output: &[u32], vocab: usize) -> Vec<(u32, f32)> {
    let mut out: Vec<(u32, f32)> = Vec::new();
    if params.uses_output() && !output.is_empty() {
        let mut ids: Vec<u32> = output
            .iter()
            .copied()
            .filter(|&t| (t as usize) < vocab)
            .collect();
        ids.sort_unstable();
        for run in ids.chunk_by(|a, b| a == b) {
            let pen = params.presence_penalty + params.frequency_penalty * run.len() as f32;
            out.push((run[0], -pen));
        }
    }
    for &(id, b) in &params.logit_bias {
        if id as usize >= vocab {
            continue;
        }
        match out.binary_search_by_key(&id, |e| e.0) {
            Ok(i) => out[i].1 += b,
            Err(i) => out.insert(i, (id, b)),
        }
    }
    out
}

/// Adds [`additive_deltas`] to their tokens' logits.
pub fn apply_deltas(logits: &mut [f32], deltas: &[(u32, f32)]) {
    for &(id, d) in deltas {
        if let Some(l) = logits.get_mut(id as usize) {
            *l += d;
        }
    }
}

/// Applies the repetition penalty in place, once per distinct token of `history`. `seen` is
/// scratch space.
pub fn apply_repetition_penalty(
    logits: &mut [f32],
    history: &[u32],
    penalty: f32,
    seen: &mut Vec<u64>,
) {
    if penalty == 1.0 || history.is_empty() {
        return;
    }
    // A bitset dedups in O(history), where sorting a long history would cost more than the rest
    // of sampling.
    seen.clear();
    seen.resize(logits.len().div_ceil(64), 0);
    for &tok in history {
        let i = tok as usize;
        // Ids beyond the vocabulary (e.g. a history from another model) are not ours to judge.
        let Some(l) = logits.get_mut(i) else { continue };
        let (word, bit) = (i / 64, 1u64 << (i % 64));
        if seen[word] & bit != 0 {
            continue;
        }
        seen[word] |= bit;
        // Dividing a negative logit would make it *more* likely, hence the sign split.
        if *l > 0.0 {
            *l /= penalty;
        } else {
            *l *= penalty;
        }
    }
}

/// First index of the largest logit, skipping NaN; 0 when nothing is selectable, because a
/// generation loop can always handle a valid id but not a panic.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    let mut best_val = f32::NEG_INFINITY;
    for (i, &l) in logits.iter().enumerate() {
        // NaN compares false, so it can never become the best.
        if l > best_val {
            best = i;
            best_val = l;
        }
    }
    best as u32
}

/// Buckets of the top-p search: the top 16 bits of a rank key, so a bucket never straddles
/// keys out of order.
const TOP_P_BUCKET_SHIFT: u32 = 48;

/// Scratch buffers reused across calls so a 150k-entry vocabulary costs no allocation per token.
#[derive(Default)]
pub struct SampleScratch {
    /// (rank key, mass) of the candidates still in play.
    cands: Vec<(u64, u64)>,
    mass_by_id: Vec<u64>,
    buckets: Vec<u64>,
    pub seen: Vec<u64>,
}

impl SampleScratch {
    /// The tokens the last [`filter`] kept, in no particular order.
    pub fn kept_ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.cands.iter().map(|c| key_id(c.0))
    }
}

/// What the filters leave: the candidates (rank key, mass), or a token decided without a draw.
pub enum Filtered {
    Token(u32),
    Kept,
}

/// The tokens `params` keeps from `logits` (already penalized), into `scratch.cands`. Greedy
/// decoding keeps nothing and answers directly.
pub fn filter(logits: &[f32], params: &SamplingParams, scratch: &mut SampleScratch) -> Filtered {
    let t = params.temperature;
    if t == 0.0 {
        return Filtered::Token(argmax(logits));
    }
    let cands = &mut scratch.cands;
    cands.clear();
    // -inf and NaN have zero probability; dropping them keeps NaN out of every comparison.
    cands.extend(
        logits
            .iter()
            .enumerate()
            .filter(|&(_, &l)| l > f32::NEG_INFINITY)
            .map(|(i, &l)| (rank_key(l / t, i as u32), 0)),
    );
    if cands.is_empty() {
        return Filtered::Token(0);
    }
    if params.top_k > 0 && params.top_k < cands.len() {
        // Partition instead of sorting: O(n), and order within the top k does not matter.
        cands.select_nth_unstable_by(params.top_k - 1, |a, b| b.0.cmp(&a.0));
        cands.truncate(params.top_k);
    }
    let top = cands.iter().map(|c| c.0).max().expect("not empty");
    let top_s = logits[key_id(top) as usize] / t;
    if top_s == f32::INFINITY {
        // exp(inf - inf) is NaN; an infinite logit is a certainty (the lowest such id).
        return Filtered::Token(key_id(top));
    }
    if top_s == f32::NEG_INFINITY {
        // Every finite logit overflowed to -inf when divided by a tiny temperature; their order
        // is still meaningful, and a tiny temperature means greedy anyway.
        return Filtered::Token(argmax(logits));
    }
    let mut total = 0u64;
    for c in cands.iter_mut() {
        let p = exp_det(logits[key_id(c.0) as usize] / t - top_s);
        // Min-p is a threshold on p itself: marked by a mass of u64::MAX, dropped below.
        let q = mass(p);
        total += q;
        c.1 = if params.min_p > 0.0 && p < params.min_p {
            u64::MAX
        } else {
            q
        };
    }
    // Min-p before top-p: both keep a prefix of the ranking, and top-p measures its target
    // against the mass before min-p.
    if params.min_p > 0.0 {
        cands.retain(|c| c.1 != u64::MAX);
    }
    if params.top_p < 1.0 {
        top_p_cut(
            cands,
            top_p_target(total, params.top_p),
            &mut scratch.buckets,
        );
    }
    Filtered::Kept
}

/// Keeps the smallest most-likely prefix of `cands` whose mass reaches `target` (all of them if
/// it never does). A flat distribution puts tens of thousands of tokens in the nucleus, so a
/// histogram of mass per key bucket finds the one bucket the cut falls in, and only that bucket
/// is sorted.
fn top_p_cut(cands: &mut Vec<(u64, u64)>, target: u64, buckets: &mut Vec<u64>) {
    let bucket = |key: u64| (key >> TOP_P_BUCKET_SHIFT) as usize;
    buckets.clear();
    buckets.resize(1 << (64 - TOP_P_BUCKET_SHIFT), 0);
    for c in cands.iter() {
        buckets[bucket(c.0)] += c.1;
    }
    let mut above = 0u64;
    let mut boundary = None;
    for b in (0..buckets.len()).rev() {
        if above + buckets[b] >= target {
            boundary = Some(b);
            break;
        }
        above += buckets[b];
    }
    let Some(boundary) = boundary else { return };
    let mut kept = 0;
    for i in 0..cands.len() {
        if bucket(cands[i].0) > boundary {
            cands.swap(kept, i);
            kept += 1;
        }
    }
    let mut end = kept;
    for i in kept..cands.len() {
        if bucket(cands[i].0) == boundary {
            cands.swap(end, i);
            end += 1;
        }
    }
    cands[kept..end].sort_unstable_by_key(|c| std::cmp::Reverse(c.0));
    let mut cum = above;
    let mut keep = end;
    for (i, c) in cands[kept..end].iter().enumerate() {
        cum += c.1;
        if cum >= target {
            keep = kept + i + 1;
            break;
        }
    }
    cands.truncate(keep);
}

/// Draws from what [`filter`] kept: the first token, in id order, whose running mass passes
/// the scaled uniform.
pub fn draw(vocab: usize, seed: u64, draw: u64, scratch: &mut SampleScratch) -> u32 {
    let total: u64 = scratch.cands.iter().map(|c| c.1).sum();
    let r = scale_draw(uniform53(seed, draw), total);
    let by_id = &mut scratch.mass_by_id;
    by_id.clear();
    by_id.resize(vocab, 0);
    for c in &scratch.cands {
        by_id[key_id(c.0) as usize] = c.1;
    }
    let mut cum = 0u64;
    for (i, &q) in by_id.iter().enumerate() {
        cum += q;
        if r < cum {
            return i as u32;
        }
    }
    // Unreachable while the top token's mass (2^32) is kept; a valid id is the honest answer.
    scratch.cands.first().map_or(0, |c| key_id(c.0))
}

/// Samples one token from penalized `logits` (the reference of every backend's sampler).
pub fn sample_row(
    logits: &[f32],
    params: &SamplingParams,
    seed: u64,
    draw_index: u64,
    scratch: &mut SampleScratch,
) -> u32 {
    match filter(logits, params, scratch) {
        Filtered::Token(t) => t,
        Filtered::Kept => draw(logits.len(), seed, draw_index, scratch),
    }
}

/// Log-sum-exp of the raw row and its `n` most likely tokens (NaN skipped) with their
/// log-probabilities, most likely first.
pub fn top_logprobs(row: &[f32], n: usize) -> (f32, Vec<(u32, f32)>) {
    let max = row
        .iter()
        .copied()
        .filter(|x| !x.is_nan())
        .fold(f32::NEG_INFINITY, f32::max);
    let lse = max
        + row
            .iter()
            .filter(|x| !x.is_nan())
            .map(|&x| (x - max).exp())
            .sum::<f32>()
            .ln();
    let mut keys: Vec<u64> = row
        .iter()
        .enumerate()
        .filter(|(_, x)| !x.is_nan())
        .map(|(i, &x)| rank_key(x, i as u32))
        .collect();
    let n = n.min(keys.len());
    if n > 0 {
        keys.select_nth_unstable_by(n - 1, |a, b| b.cmp(a));
        keys.truncate(n);
        keys.sort_unstable_by(|a, b| b.cmp(a));
    } else {
        keys.clear();
    }
    let top = keys
        .into_iter()
        .map(|k| {
            let id = key_id(k);
            (id, row[id as usize] - lse)
        })
        .collect();
    (lse, top)
}

/// What comes before the filters, in their order: the mask, the repetition penalty, then the
/// additive deltas.
pub fn adjust_row(row: &mut [f32], spec: &SampleSpec, seen: &mut Vec<u64>) {
    if let Some(allowed) = spec.allowed {
        apply_mask(row, allowed);
    }
    apply_repetition_penalty(row, spec.history, spec.params.repetition_penalty, seen);
    apply_deltas(row, &additive_deltas(spec.params, spec.output, row.len()));
}

/// The reference for a whole batch: `logits` is `[rows, vocab]` on the host.
pub fn sample_rows(logits: &[f32], vocab: usize, specs: &[SampleSpec]) -> Result<Vec<Sampled>> {
    let mut scratch = SampleScratch::default();
    let mut row = Vec::with_capacity(vocab);
    specs
        .iter()
        .map(|s| {
            let raw = logits
                .get(s.row * vocab..(s.row + 1) * vocab)
                .ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "sampling row {} of a {}-row batch",
                        s.row,
                        logits.len() / vocab.max(1)
                    ))
                })?;
            row.clear();
            row.extend_from_slice(raw);
            adjust_row(&mut row, s, &mut scratch.seen);
            let token = sample_row(&row, s.params, s.seed, s.draw, &mut scratch);
            let logprobs = s.logprobs.map(|n| {
                let (lse, top) = top_logprobs(raw, n);
                TokenLogprobs {
                    logprob: raw[token as usize] - lse,
                    top,
                }
            });
            Ok(Sampled { token, logprobs })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_det_is_close_to_exp_and_exact_at_zero() {
        assert_eq!(exp_det(0.0), 1.0);
        assert_eq!(exp_det(-100.0), 0.0);
        assert_eq!(exp_det(f32::NAN), 0.0);
        let mut x = 0.0f32;
        while x > -87.0 {
            let want = f64::from(x).exp();
            let got = f64::from(exp_det(x));
            assert!(
                ((got - want) / want).abs() < 4e-7,
                "exp_det({x}) = {got}, exp = {want}"
            );
            x -= 0.013_7;
        }
    }

    #[test]
    fn rank_keys_order_values_then_lower_ids() {
        assert!(rank_key(2.0, 5) > rank_key(1.0, 0));
        assert!(rank_key(-1.0, 5) > rank_key(-2.0, 0));
        assert!(rank_key(1.0, 3) > rank_key(1.0, 4));
        assert!(rank_key(f32::INFINITY, 9) > rank_key(f32::MAX, 0));
        assert!(rank_key(f32::NEG_INFINITY, 0) < rank_key(f32::MIN, 9));
        assert_eq!(key_id(rank_key(-3.5, 12345)), 12345);
    }

    #[test]
    fn draws_are_uniform_and_reproducible() {
        assert_eq!(uniform53(7, 3), uniform53(7, 3));
        assert_ne!(uniform53(7, 3), uniform53(7, 4));
        assert_ne!(uniform53(7, 3), uniform53(8, 3));
        let n = 20_000;
        let mean = (0..n)
            .map(|i| uniform53(42, i) as f64 / (1u64 << 53) as f64)
            .sum::<f64>()
            / n as f64;
        assert!((mean - 0.5).abs() < 0.01, "mean {mean}");
        assert_eq!(scale_draw((1 << 53) - 1, 10), 9);
        assert_eq!(scale_draw(0, 10), 0);
    }

    fn spec<'a>(
        params: &'a SamplingParams,
        output: &'a [u32],
        allowed: Option<&'a [u32]>,
    ) -> SampleSpec<'a> {
        SampleSpec {
            row: 0,
            params,
            seed: 9,
            draw: 0,
            history: &[],
            output,
            allowed,
            logprobs: Some(2),
        }
    }

    #[test]
    fn a_mask_leaves_only_allowed_tokens_whatever_the_filters() {
        let vocab = 70;
        let logits: Vec<f32> = (0..vocab).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        // Tokens 3, 40 and 69 only: the first and the last word, and past a word boundary.
        let allowed = [1u32 << 3, 1 << 8, 1 << 5];
        for temperature in [0.0, 0.7, 1.5] {
            for top_k in [0, 1, 5] {
                let params = SamplingParams {
                    temperature,
                    top_k,
                    top_p: 0.9,
                    ..SamplingParams::default()
                };
                for draw in 0..40 {
                    let mut s = spec(&params, &[], Some(&allowed));
                    s.draw = draw;
                    let out = sample_rows(&logits, vocab, &[s]).unwrap();
                    assert!(
                        [3, 40, 69].contains(&out[0].token),
                        "{} at t {temperature} top_k {top_k}",
                        out[0].token
                    );
                    // Log-probabilities stay those of the raw logits.
                    let (lse, _) = top_logprobs(&logits, 0);
                    let lp = out[0].logprobs.as_ref().unwrap().logprob;
                    assert_eq!(lp, logits[out[0].token as usize] - lse);
                }
            }
        }
        // Greedy under a mask is the argmax of the allowed tokens.
        let params = SamplingParams::default();
        let best = [3usize, 40, 69]
            .into_iter()
            .max_by(|&a, &b| logits[a].total_cmp(&logits[b]))
            .unwrap();
        let out = sample_rows(&logits, vocab, &[spec(&params, &[], Some(&allowed))]).unwrap();
        assert_eq!(out[0].token as usize, best);
    }

    #[test]
    fn penalties_and_bias_follow_openai() {
        let params = SamplingParams {
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            logit_bias: vec![(2, 10.0), (7, -100.0), (99, 5.0)],
            ..SamplingParams::default()
        };
        // Token 1 three times, token 2 once, token 500 is past the vocabulary.
        let d = additive_deltas(&params, &[1, 2, 1, 1, 500], 10);
        assert_eq!(d, vec![(1, -(0.5 + 0.75)), (2, 10.0 - 0.75), (7, -100.0)]);
        let mut row = vec![1.0f32; 10];
        apply_deltas(&mut row, &d);
        assert_eq!(row[1], 1.0 - 1.25);
        assert_eq!(row[2], 1.0 + 9.25);
        assert_eq!(row[7], -99.0);
        assert_eq!(row[0], 1.0);
        // Greedy follows the bias: token 2 wins though 0 has the larger raw logit.
        let logits = [3.0f32, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0];
        let p = SamplingParams {
            logit_bias: vec![(2, 4.0)],
            ..SamplingParams::default()
        };
        assert_eq!(
            sample_rows(&logits, 10, &[spec(&p, &[], None)]).unwrap()[0].token,
            2
        );
        // A frequency penalty pushes a repeated token below the next one.
        let p = SamplingParams {
            frequency_penalty: 1.0,
            ..SamplingParams::default()
        };
        let logits = [3.0f32, 1.5, 0.0];
        assert_eq!(
            sample_rows(&logits, 3, &[spec(&p, &[0], None)]).unwrap()[0].token,
            0
        );
        assert_eq!(
            sample_rows(&logits, 3, &[spec(&p, &[0, 0], None)]).unwrap()[0].token,
            1
        );
        // Out-of-range values are refused.
        for bad in [
            SamplingParams {
                presence_penalty: 2.5,
                ..SamplingParams::default()
            },
            SamplingParams {
                frequency_penalty: f32::NAN,
                ..SamplingParams::default()
            },
            SamplingParams {
                logit_bias: vec![(1, 101.0)],
                ..SamplingParams::default()
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
    }
}
