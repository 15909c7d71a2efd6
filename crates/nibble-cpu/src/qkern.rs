//! Tile kernels of the nibble quantized linear formats (see [`crate::quant`]), each computing
//! exactly the arithmetic of `nibble_precision::reference`, so their results are that reference's
//! bits.
//!
//! - **Integer tiles** (`a8`, COMET `a4a8`): `MR` activation rows (i16 codes) by `NR` weight rows
//!   (INT8), `MR * NR = 8` outputs, lane `t` being activation row `t / NR` and weight row
//!   `t % NR`. The integer dot of each lane is summed in i32 in any order (it is exact), reduced
//!   to one i32 per lane at each group end, and the group's f32 epilogue runs on all eight lanes
//!   at once: the same IEEE operations, in the same order, as the scalar reference.
//! - **Float tiles** (`a16`, FP8 x FP8): `MR` activation rows by `P` panels of 8 weight rows
//!   (f16 bits, channel-major in the panel). Every output is one sequential f32 chain
//!   `acc = fma(x_j, w_j, acc)` over the channels; with both operands f16 values the product is
//!   exact, so this is the reference's `acc + w_j * x_j`. The `MR * P` independent chains hide the
//!   FMA latency.
//!
//! AVX2 versions are compiled in when the build targets AVX2 + FMA + F16C (the release config);
//! the portable versions compute the same bits with scalar code and are tested against them.

/// How a tile's per-group i32 sums become outputs: the three integer epilogues of the
/// reference (`sx` the activation scale, `sw` the weight scale).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Epilogue {
    /// One group spanning the row: `y = f32(p) * (sx * sw)`.
    PerChannel,
    /// A weight scale per group and one activation scale per row:
    /// `t = fma(f32(p_g), sw_g, t)` over the groups, then `y = t * sx`.
    Groups,
    /// A weight scale per group and an activation scale per block (= group):
    /// `y = fma(f32(p_g), sw_g * sx_g, y)` over the groups.
    Mixed,
}

/// The weight side of an integer tile: `NR` consecutive weight rows.
#[derive(Clone, Copy)]
pub struct IntTile<'a> {
    /// The rows' integers, row `j` at `w[j * kp..][..kp]` (zero padded past K).
    pub w: &'a [i8],
    pub kp: usize,
    /// Channels per scale group and the number of groups (`gl * groups <= kp`).
    pub gl: usize,
    pub groups: usize,
    /// The weight scales of the 8-row panel holding the tile, `[group][8]`, and the panel
    /// lane of the tile's first row.
    pub wscales: &'a [f32],
    pub wlane: usize,
    pub epi: Epilogue,
}

impl IntTile<'_> {
    #[inline(always)]
    fn check<const MR: usize, const NR: usize>(&self, x: &[&[i16]; MR], xs: &[&[f32]; MR]) {
        assert!(MR * NR <= 8 && self.wlane + NR <= 8);
        assert!(self.w.len() >= NR * self.kp && self.gl * self.groups <= self.kp);
        assert!(self.wscales.len() >= 8 * self.groups);
        assert!(self.epi != Epilogue::PerChannel || self.groups == 1);
        let scales = if self.epi == Epilogue::Mixed {
            self.groups
        } else {
            1
        };
        for r in 0..MR {
            assert!(x[r].len() >= self.kp && xs[r].len() >= scales);
        }
    }
}

/// Portable tile kernels: the reference's loops, one lane at a time.
#[allow(dead_code)] // with AVX2 only the tests and odd group sizes call these
pub mod portable {
    use super::{Epilogue, IntTile};
    use half::f16;

    pub fn int_tile<const MR: usize, const NR: usize>(
        t: &IntTile,
        x: [&[i16]; MR],
        xs: [&[f32]; MR],
    ) -> [f32; 8] {
        t.check::<MR, NR>(&x, &xs);
        let mut out = [0f32; 8];
        for (lane, o) in out.iter_mut().enumerate().take(MR * NR) {
            let (r, j) = (lane / NR, lane % NR);
            let w = &t.w[j * t.kp..];
            let mut y = 0f32;
            for g in 0..t.groups {
                let c = g * t.gl..(g + 1) * t.gl;
                let p: i32 = w[c.clone()]
                    .iter()
                    .zip(&x[r][c])
                    .map(|(&a, &b)| a as i32 * b as i32)
                    .sum();
                let sw = t.wscales[g * 8 + t.wlane + j];
                y = match t.epi {
                    Epilogue::PerChannel => p as f32 * (xs[r][0] * sw),
                    Epilogue::Groups => (p as f32).mul_add(sw, y),
                    Epilogue::Mixed => (p as f32).mul_add(sw * xs[r][g], y),
                };
            }
            if t.epi == Epilogue::Groups {
                y *= xs[r][0];
            }
            *o = y;
        }
        out
    }

    /// `MR` rows by `P` panels (`panels[p * k * 8..][c * 8 + l]` is channel `c` of the panel's
    /// row `l`): `out[r][p][l]`, each a sequential chain over the `k` channels.
    pub fn float_tile<const MR: usize, const P: usize>(
        panels: &[u16],
        k: usize,
        x: [&[f32]; MR],
    ) -> [[[f32; 8]; P]; MR] {
        assert!(panels.len() >= P * k * 8 && x.iter().all(|x| x.len() >= k));
        let mut acc = [[[0f32; 8]; P]; MR];
        for c in 0..k {
            for p in 0..P {
                let w = &panels[p * k * 8 + c * 8..][..8];
                for r in 0..MR {
                    for l in 0..8 {
                        let wv = f16::from_bits(w[l]).to_f32();
                        acc[r][p][l] = x[r][c].mul_add(wv, acc[r][p][l]);
                    }
                }
            }
        }
        acc
    }
}

#[cfg(not(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma",
    target_feature = "f16c"
)))]
pub use portable as imp;

#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma",
    target_feature = "f16c"
))]
pub use avx2 as imp;

/// Whether [`imp::int_tile`] takes groups of `gl` channels (it steps 16 at a time).
pub fn simd_group_ok(gl: usize) -> bool {
    gl.is_multiple_of(16)
}

/// AVX2 tile kernels. Integer tiles widen 16 weights to i16 (`vpmovsxbw`) and multiply them with
/// 16 activation codes by `vpmaddwd` (pairs summed into i32, exact: |w| <= 128, |x| <= 127);
/// a widened weight vector serves all `MR` activation rows.
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma",
    target_feature = "f16c"
))]
pub mod avx2 {
    use std::arch::x86_64::*;

    use super::{Epilogue, IntTile};

    /// Eight i32 vectors to one: lane `t` is the sum of `a[t]`'s lanes.
    #[inline(always)]
    fn reduce8(a: [__m256i; 8]) -> __m256i {
        // SAFETY: register-only AVX2.
        unsafe {
            let h01 = _mm256_hadd_epi32(a[0], a[1]);
            let h23 = _mm256_hadd_epi32(a[2], a[3]);
            let h45 = _mm256_hadd_epi32(a[4], a[5]);
            let h67 = _mm256_hadd_epi32(a[6], a[7]);
            // [a0..a3 low-half sums | a0..a3 high-half sums], and the same for a4..a7.
            let h0123 = _mm256_hadd_epi32(h01, h23);
            let h4567 = _mm256_hadd_epi32(h45, h67);
            _mm256_add_epi32(
                _mm256_permute2x128_si256(h0123, h4567, 0x20),
                _mm256_permute2x128_si256(h0123, h4567, 0x31),
            )
        }
    }

    /// The weight scales of group `g` in lane order (lane `t`: the tile's row `t % NR`).
    #[inline(always)]
    fn wlanes<const NR: usize>(t: &IntTile, g: usize) -> __m256 {
        let s = &t.wscales[g * 8 + t.wlane..][..NR];
        // SAFETY: `s` holds NR floats, the width each load reads.
        unsafe {
            match NR {
                8 => _mm256_loadu_ps(s.as_ptr()),
                4 => _mm256_broadcast_ps(&*(s.as_ptr() as *const __m128)),
                2 => _mm256_castpd_ps(_mm256_broadcast_sd(&*(s.as_ptr() as *const f64))),
                _ => {
                    let l: [f32; 8] = std::array::from_fn(|i| s[i % NR]);
                    _mm256_loadu_ps(l.as_ptr())
                }
            }
        }
    }

    /// Activation scales in lane order (lane `t`: activation row `t / NR`, scale `g`).
    #[inline(always)]
    fn xlanes<const MR: usize, const NR: usize>(xs: &[&[f32]; MR], g: usize) -> __m256 {
        // SAFETY: register-only AVX, and an 8-float load from an 8-float array.
        unsafe {
            if MR == 1 {
                _mm256_set1_ps(xs[0][g])
            } else {
                let l: [f32; 8] = std::array::from_fn(|t| xs[(t / NR).min(MR - 1)][g]);
                _mm256_loadu_ps(l.as_ptr())
            }
        }
    }

    pub fn int_tile<const MR: usize, const NR: usize>(
        t: &IntTile,
        x: [&[i16]; MR],
        xs: [&[f32]; MR],
    ) -> [f32; 8] {
        t.check::<MR, NR>(&x, &xs);
        assert!(MR * NR == 8 && super::simd_group_ok(t.gl));
        let (w, kp) = (t.w.as_ptr(), t.kp);
        let mut out = [0f32; 8];
        // SAFETY: `check` bounds every load: weight row j < NR reads w[j * kp + c..][..16] and
        // activation row r reads x[r][c..][..16] with c + 16 <= gl * groups <= kp.
        unsafe {
            let mut y = _mm256_setzero_ps();
            for g in 0..t.groups {
                let mut acc = [_mm256_setzero_si256(); 8];
                for c in (g * t.gl..(g + 1) * t.gl).step_by(16) {
                    let xv: [__m256i; MR] = std::array::from_fn(|r| {
                        _mm256_loadu_si256(x[r].as_ptr().add(c) as *const __m256i)
                    });
                    for j in 0..NR {
                        let wv = _mm256_cvtepi8_epi16(_mm_loadu_si128(
                            w.add(j * kp + c) as *const __m128i
                        ));
                        for r in 0..MR {
                            let a = &mut acc[r * NR + j];
                            *a = _mm256_add_epi32(*a, _mm256_madd_epi16(wv, xv[r]));
                        }
                    }
                }
                let p = _mm256_cvtepi32_ps(reduce8(acc));
                y = match t.epi {
                    Epilogue::PerChannel => _mm256_mul_ps(
                        p,
                        _mm256_mul_ps(xlanes::<MR, NR>(&xs, 0), wlanes::<NR>(t, g)),
                    ),
                    Epilogue::Groups => _mm256_fmadd_ps(p, wlanes::<NR>(t, g), y),
                    Epilogue::Mixed => {
                        let c = _mm256_mul_ps(wlanes::<NR>(t, g), xlanes::<MR, NR>(&xs, g));
                        _mm256_fmadd_ps(p, c, y)
                    }
                };
            }
            if t.epi == Epilogue::Groups {
                y = _mm256_mul_ps(y, xlanes::<MR, NR>(&xs, 0));
            }
            _mm256_storeu_ps(out.as_mut_ptr(), y);
        }
        out
    }

    pub fn float_tile<const MR: usize, const P: usize>(
        panels: &[u16],
        k: usize,
        x: [&[f32]; MR],
    ) -> [[[f32; 8]; P]; MR] {
        assert!(panels.len() >= P * k * 8 && x.iter().all(|x| x.len() >= k));
        let mut out = [[[0f32; 8]; P]; MR];
        // SAFETY: panel p reads panels[p * k * 8 + c * 8..][..8] and row r reads x[r][c] with
        // c < k, inside the lengths asserted above.
        unsafe {
            let mut acc = [[_mm256_setzero_ps(); P]; MR];
            let base = panels.as_ptr();
            for c in 0..k {
                let wv: [__m256; P] = std::array::from_fn(|p| {
                    _mm256_cvtph_ps(_mm_loadu_si128(
                        base.add(p * k * 8 + c * 8) as *const __m128i
                    ))
                });
                for r in 0..MR {
                    let xb = _mm256_set1_ps(*x[r].get_unchecked(c));
                    for p in 0..P {
                        acc[r][p] = _mm256_fmadd_ps(xb, wv[p], acc[r][p]);
                    }
                }
            }
            for r in 0..MR {
                for p in 0..P {
                    _mm256_storeu_ps(out[r][p].as_mut_ptr(), acc[r][p]);
                }
            }
        }
        out
    }
}
