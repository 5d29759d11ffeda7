//! Resizing RGB images as OpenCV's `cv2.resize(..., interpolation=
//! cv2.INTER_AREA)` does, which FFCV uses both to shrink images when
//! writing a dataset (`max_resolution`) and in its random-resized-crop:
//!
//! - shrinking (or keeping) both sides: each output pixel is the
//!   area-weighted mean of the source pixels its cell covers, source
//!   pixels cut by the cell's edges counting by the fraction covered
//!   (OpenCV's `computeResizeAreaTab`);
//! - enlarging either side: OpenCV's INTER_AREA falls back to bilinear
//!   interpolation with its "area mode" coefficients (source pixels
//!   replicated, blended only where an output pixel straddles two), on
//!   both axes.
//!
//! The work is separable: per-axis taps (source index, weight) computed
//! once, a horizontal pass into an `f32` buffer, then a vertical pass,
//! rounded to nearest. Pixels agree with OpenCV's within ±1 (OpenCV
//! rounds some paths in fixed point and breaks ties to even).

/// Resizes `src` (`sw` × `sh` RGB bytes, row-major) into `dst` (`dw` ×
/// `dh` RGB bytes).
///
/// # Panics
/// If a buffer is shorter than its sizes say, or a size is zero.
pub fn resize_area(src: &[u8], sw: usize, sh: usize, dst: &mut [u8], dw: usize, dh: usize) {
    resize_area_crop(src, sw, sh, 0, 0, sw, sh, dst, dw, dh)
}

/// Resizes the window `[x, x + cw) × [y, y + ch)` of `src` (`sw` × `sh`
/// RGB bytes, row-major) into `dst` (`dw` × `dh` RGB bytes), as
/// `cv2.resize(src[y:y+ch, x:x+cw], (dw, dh), interpolation=INTER_AREA)`:
/// the window is the whole image, pixels outside it are never read.
///
/// # Panics
/// If the window does not lie inside the image, a buffer is shorter than
/// its sizes say, or a size is zero.
#[allow(clippy::too_many_arguments)]
pub fn resize_area_crop(
    src: &[u8],
    sw: usize,
    sh: usize,
    x: usize,
    y: usize,
    cw: usize,
    ch: usize,
    dst: &mut [u8],
    dw: usize,
    dh: usize,
) {
    assert!(
        cw > 0 && ch > 0 && dw > 0 && dh > 0,
        "resize: empty size ({cw}x{ch} -> {dw}x{dh})"
    );
    assert!(
        x + cw <= sw && y + ch <= sh,
        "resize: window {cw}x{ch}+{x}+{y} outside a {sw}x{sh} image"
    );
    assert!(src.len() >= sw * sh * 3, "resize: source buffer too short");
    assert!(dst.len() >= dw * dh * 3, "resize: output buffer too short");
    let area = dw <= cw && dh <= ch;
    let (tx, ty) = if area {
        (Taps::area(cw, dw), Taps::area(ch, dh))
    } else {
        (Taps::linear(cw, dw), Taps::linear(ch, dh))
    };
    // Horizontal pass over the window's rows that the vertical taps read.
    let (r0, r1) = ty.range();
    let mut rows = vec![0f32; (r1 - r0) * dw * 3];
    for (r, row) in rows.chunks_exact_mut(dw * 3).enumerate() {
        let line = &src[((y + r0 + r) * sw + x) * 3..((y + r0 + r) * sw + x + cw) * 3];
        for (dx, out) in row.chunks_exact_mut(3).enumerate() {
            let (mut a, mut b, mut c) = (0f32, 0f32, 0f32);
            for &(s, w) in tx.of(dx) {
                let p = &line[s as usize * 3..s as usize * 3 + 3];
                a += w * p[0] as f32;
                b += w * p[1] as f32;
                c += w * p[2] as f32;
            }
            out[0] = a;
            out[1] = b;
            out[2] = c;
        }
    }
    // Vertical pass.
    let mut acc = vec![0f32; dw * 3];
    for (dy, out) in dst[..dw * dh * 3].chunks_exact_mut(dw * 3).enumerate() {
        acc.iter_mut().for_each(|v| *v = 0.0);
        for &(s, w) in ty.of(dy) {
            let row = &rows[(s as usize - r0) * dw * 3..(s as usize - r0 + 1) * dw * 3];
            for (a, &v) in acc.iter_mut().zip(row) {
                *a += w * v;
            }
        }
        for (o, &a) in out.iter_mut().zip(&acc) {
            *o = (a + 0.5).clamp(0.0, 255.0) as u8;
        }
    }
}

/// One axis's taps: for each output index, the (source index, weight)
/// pairs it sums.
struct Taps {
    taps: Vec<(u32, f32)>,
    /// `taps[start[d]..start[d + 1]]` are output `d`'s.
    start: Vec<usize>,
}

impl Taps {
    fn of(&self, d: usize) -> &[(u32, f32)] {
        &self.taps[self.start[d]..self.start[d + 1]]
    }

    /// The source indices read: `[first, last + 1)`.
    fn range(&self) -> (usize, usize) {
        let lo = self.taps.iter().map(|t| t.0).min().unwrap_or(0) as usize;
        let hi = self.taps.iter().map(|t| t.0).max().unwrap_or(0) as usize;
        (lo, hi + 1)
    }

    fn build(n: usize, mut each: impl FnMut(usize, &mut Vec<(u32, f32)>)) -> Taps {
        let mut t = Taps {
            taps: Vec::with_capacity(n * 2),
            start: Vec::with_capacity(n + 1),
        };
        t.start.push(0);
        for d in 0..n {
            each(d, &mut t.taps);
            t.start.push(t.taps.len());
        }
        t
    }

    /// Area averaging from `ss` source pixels to `ds <= ss` (OpenCV's
    /// `computeResizeAreaTab`): output `d` covers `[d·s, (d+1)·s)`,
    /// `s = ss / ds`.
    fn area(ss: usize, ds: usize) -> Taps {
        let scale = ss as f64 / ds as f64;
        Taps::build(ds, |d, taps| {
            let f1 = d as f64 * scale;
            let f2 = f1 + scale;
            let cell = scale.min(ss as f64 - f1);
            let s2 = (f2.floor() as usize).min(ss - 1);
            let s1 = (f1.ceil() as usize).min(s2);
            if s1 as f64 - f1 > 1e-3 {
                taps.push(((s1 - 1) as u32, ((s1 as f64 - f1) / cell) as f32));
            }
            for s in s1..s2 {
                taps.push((s as u32, (1.0 / cell) as f32));
            }
            if f2 - s2 as f64 > 1e-3 {
                taps.push((
                    s2 as u32,
                    ((f2 - s2 as f64).min(1.0).min(cell) / cell) as f32,
                ));
            }
        })
    }

    /// Bilinear with OpenCV's INTER_AREA coefficients: output `d` reads
    /// source `floor(d·s)` and the next, the latter weighted by how far
    /// output `d`'s cell reaches past the former's end.
    fn linear(ss: usize, ds: usize) -> Taps {
        let inv = ds as f64 / ss as f64;
        let scale = 1.0 / inv;
        Taps::build(ds, |d, taps| {
            let mut s = (d as f64 * scale).floor() as i64;
            let f = (d + 1) as f64 - (s + 1) as f64 * inv;
            let mut f = if f <= 0.0 { 0.0 } else { f - f.floor() };
            if s >= ss as i64 - 1 {
                s = ss as i64 - 1;
                f = 0.0;
            }
            let s = s.max(0) as u32;
            taps.push((s, (1.0 - f) as f32));
            if f > 0.0 {
                taps.push((s + 1, f as f32));
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image(w: usize, h: usize, seed: u64) -> Vec<u8> {
        let mut r = braid_core::rng::Rng::new(seed);
        (0..w * h * 3).map(|_| r.below(256) as u8).collect()
    }

    fn resized(src: &[u8], sw: usize, sh: usize, dw: usize, dh: usize) -> Vec<u8> {
        let mut out = vec![0u8; dw * dh * 3];
        resize_area(src, sw, sh, &mut out, dw, dh);
        out
    }

    /// Area averaging the slow way: each output pixel's cell, intersected
    /// with every source pixel.
    fn reference(src: &[u8], sw: usize, sh: usize, dw: usize, dh: usize) -> Vec<u8> {
        let (sx, sy) = (sw as f64 / dw as f64, sh as f64 / dh as f64);
        let overlap =
            |a0: f64, a1: f64, i: usize| (a1.min(i as f64 + 1.0) - a0.max(i as f64)).max(0.0);
        let mut out = vec![0u8; dw * dh * 3];
        for dy in 0..dh {
            for dx in 0..dw {
                let (x0, x1, y0, y1) = (
                    dx as f64 * sx,
                    (dx + 1) as f64 * sx,
                    dy as f64 * sy,
                    (dy + 1) as f64 * sy,
                );
                for c in 0..3 {
                    let mut sum = 0.0;
                    for j in 0..sh {
                        for i in 0..sw {
                            sum += overlap(x0, x1, i)
                                * overlap(y0, y1, j)
                                * src[(j * sw + i) * 3 + c] as f64;
                        }
                    }
                    out[(dy * dw + dx) * 3 + c] = (sum / (sx * sy)).round() as u8;
                }
            }
        }
        out
    }

    #[test]
    fn equal_sizes_are_the_identity() {
        let src = image(13, 7, 1);
        assert_eq!(resized(&src, 13, 7, 13, 7), src);
    }

    #[test]
    fn halving_is_the_rounded_two_by_two_mean() {
        let (w, h) = (10, 6);
        let src = image(w, h, 2);
        let out = resized(&src, w, h, w / 2, h / 2);
        for y in 0..h / 2 {
            for x in 0..w / 2 {
                for c in 0..3 {
                    let p = |i: usize, j: usize| src[(j * w + i) * 3 + c] as u32;
                    let sum = p(2 * x, 2 * y)
                        + p(2 * x + 1, 2 * y)
                        + p(2 * x, 2 * y + 1)
                        + p(2 * x + 1, 2 * y + 1);
                    assert_eq!(
                        out[(y * w / 2 + x) * 3 + c] as u32,
                        (sum + 2) / 4,
                        "({x}, {y}, {c})"
                    );
                }
            }
        }
    }

    #[test]
    fn a_constant_image_stays_constant() {
        let src: Vec<u8> = [17u8, 200, 93].repeat(37 * 23);
        for (dw, dh) in [(5, 3), (36, 22), (11, 23), (37, 1)] {
            assert_eq!(
                resized(&src, 37, 23, dw, dh),
                [17u8, 200, 93].repeat(dw * dh)
            );
        }
        // Enlarging too.
        assert_eq!(
            resized(&src, 37, 23, 50, 40),
            [17u8, 200, 93].repeat(50 * 40)
        );
    }

    #[test]
    fn non_integer_ratios_match_slow_area_averaging() {
        for (sw, sh, dw, dh, seed) in [
            (7, 7, 3, 3, 3),
            (7, 5, 3, 2, 4),
            (31, 17, 10, 9, 5),
            (100, 75, 64, 48, 6),
        ] {
            let src = image(sw, sh, seed);
            let fast = resized(&src, sw, sh, dw, dh);
            let slow = reference(&src, sw, sh, dw, dh);
            for (i, (&a, &b)) in fast.iter().zip(&slow).enumerate() {
                assert!(
                    (a as i32 - b as i32).abs() <= 1,
                    "{sw}x{sh} -> {dw}x{dh}, byte {i}: {a} vs {b}"
                );
            }
        }
    }

    #[test]
    fn a_crop_resizes_as_the_cut_out_window() {
        let (sw, sh) = (40, 30);
        let src = image(sw, sh, 7);
        let (x, y, cw, ch) = (5, 3, 21, 17);
        let mut window = Vec::new();
        for j in y..y + ch {
            window.extend_from_slice(&src[(j * sw + x) * 3..(j * sw + x + cw) * 3]);
        }
        for (dw, dh) in [(8, 6), (30, 25)] {
            let mut out = vec![0u8; dw * dh * 3];
            resize_area_crop(&src, sw, sh, x, y, cw, ch, &mut out, dw, dh);
            assert_eq!(out, resized(&window, cw, ch, dw, dh));
        }
    }

    #[test]
    fn doubling_replicates_pixels() {
        // OpenCV's INTER_AREA enlarging by an integer factor copies each
        // pixel into a block.
        let src = image(3, 2, 8);
        let out = resized(&src, 3, 2, 6, 4);
        for y in 0..4 {
            for x in 0..6 {
                assert_eq!(
                    out[(y * 6 + x) * 3..(y * 6 + x) * 3 + 3],
                    src[((y / 2) * 3 + x / 2) * 3..((y / 2) * 3 + x / 2) * 3 + 3]
                );
            }
        }
    }
}
