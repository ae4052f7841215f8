//! Rotary position embedding with ggml's arithmetic: the `[cos, sin]` table of one position
//! ([`rope_cache`]) and the scalar rotations of both modes ([`rope_norm`], [`rope_neox`]),
//! whose bodies the SIMD levels' table entries inline. Re-exported from [`crate::ops`].

/// Rotary embedding tables for one position: `cos`/`sin` per dimension pair, computed as
/// ggml does (theta multiplied by `base^(-2/n_dims)` pair after pair, in f32).
pub fn rope_cache(
    pos: u32,
    n_dims: usize,
    freq_base: f32,
    freq_factors: Option<&[f32]>,
    cache: &mut [f32],
) {
    let theta_scale = freq_base.powf(-2.0 / n_dims as f32);
    let mut theta = pos as f32;
    for i in 0..n_dims / 2 {
        let ff = freq_factors.map_or(1.0, |f| f.get(i).copied().unwrap_or(1.0));
        let t = theta / ff;
        cache[2 * i] = t.cos();
        cache[2 * i + 1] = t.sin();
        theta *= theta_scale;
    }
}

/// One rotated pair, associated as ggml's compiled C does (GCC contracts
/// `x0*c - x1*s` to `fma(x0, c, -(x1*s))` and `x0*s + x1*c` to `fma(x0, s, x1*c)`).
#[inline(always)]
fn rotate(x0: f32, x1: f32, c: f32, s: f32) -> (f32, f32) {
    (x0.mul_add(c, -(x1 * s)), x0.mul_add(s, x1 * c))
}

/// Applies rope in "normal" mode (adjacent pairs) to the first `n_dims` of `x` (the scalar
/// twin of the table's `rope_norm`).
pub fn rope_norm(x: &mut [f32], cache: &[f32], n_dims: usize) {
    rope_norm_inline(x, cache, n_dims);
}

/// [`rope_norm`]'s body, inlined into the SIMD levels' copies (compiled with FMA there).
#[inline(always)]
pub(crate) fn rope_norm_inline(x: &mut [f32], cache: &[f32], n_dims: usize) {
    for i in 0..n_dims / 2 {
        let (a, b) = rotate(x[2 * i], x[2 * i + 1], cache[2 * i], cache[2 * i + 1]);
        x[2 * i] = a;
        x[2 * i + 1] = b;
    }
}

/// Applies rope in "NeoX" mode (pairs `i`, `i + n_dims/2`) to the first `n_dims` of `x` (the
/// scalar twin of the table's `rope_neox`).
pub fn rope_neox(x: &mut [f32], cache: &[f32], n_dims: usize) {
    rope_neox_inline(x, cache, n_dims);
}

/// [`rope_neox`]'s body, inlined into the SIMD levels' copies (compiled with FMA there).
#[inline(always)]
pub(crate) fn rope_neox_inline(x: &mut [f32], cache: &[f32], n_dims: usize) {
    let h = n_dims / 2;
    for i in 0..h {
        let (a, b) = rotate(x[i], x[i + h], cache[2 * i], cache[2 * i + 1]);
        x[i] = a;
        x[i + h] = b;
    }
}
