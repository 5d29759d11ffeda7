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
    let (tx, ty) = (Dense::new(&tx, cw), Dense::new(&ty, ch));
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2.
        return unsafe { passes_avx2(src, sw, x, y, cw, &tx, &ty, dst, dw, dh) };
    }
    passes(src, sw, x, y, cw, &tx, &ty, dst, dw, dh)
}

/// [`passes`] compiled for AVX2 (the same arithmetic, wider vectors).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[allow(clippy::too_many_arguments)]
unsafe fn passes_avx2(
    src: &[u8],
    sw: usize,
    x: usize,
    y: usize,
    cw: usize,
    tx: &Dense,
    ty: &Dense,
    dst: &mut [u8],
    dw: usize,
    dh: usize,
) {
    passes(src, sw, x, y, cw, tx, ty, dst, dw, dh)
}

/// The two passes of [`resize_area_crop`] over its window.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn passes(
    src: &[u8],
    sw: usize,
    x: usize,
    y: usize,
    cw: usize,
    tx: &Dense,
    ty: &Dense,
    dst: &mut [u8],
    dw: usize,
    dh: usize,
) {
    // Horizontal passes into a ring of `ty.k` rows of `dw × 3` floats
    // (and one more, which pixel-wide stores spill into): source row `r`
    // in slot `r % ty.k`. Output rows read ascending windows of `ty.k`
    // source rows, so each source row is filtered once.
    let k = ty.k;
    let stride = dw * 3 + 1;
    let mut ring = vec![0f32; k * stride];
    let mut held = vec![usize::MAX; k];
    // The source row as floats, and one more: pixel-wide loads spill
    // into it.
    let mut line = vec![0f32; cw * 3 + 1];
    let mut acc = vec![0f32; dw * 3];
    for dy in 0..dh {
        let first = ty.first[dy] as usize;
        for r in first..first + k {
            let slot = r % k;
            if held[slot] == r {
                continue;
            }
            held[slot] = r;
            let src_row = &src[((y + r) * sw + x) * 3..((y + r) * sw + x + cw) * 3];
            for (f, &b) in line.iter_mut().zip(src_row) {
                *f = b as f32;
            }
            horizontal(&line, tx, &mut ring[slot * stride..(slot + 1) * stride]);
        }
        // Vertical pass: the taps in order, summed from zero.
        let w = &ty.weights[dy * k..(dy + 1) * k];
        let row = |j: usize| {
            let slot = (first + j) % k;
            &ring[slot * stride..slot * stride + dw * 3]
        };
        match k {
            1 => vertical::<1>(std::array::from_fn(row), w, &mut acc),
            2 => vertical::<2>(std::array::from_fn(row), w, &mut acc),
            3 => vertical::<3>(std::array::from_fn(row), w, &mut acc),
            4 => vertical::<4>(std::array::from_fn(row), w, &mut acc),
            _ => {
                acc.iter_mut().for_each(|v| *v = 0.0);
                for (j, &w) in w.iter().enumerate() {
                    for (a, &v) in acc.iter_mut().zip(row(j)) {
                        *a += w * v;
                    }
                }
            }
        }
        for (o, &a) in dst[dy * dw * 3..(dy + 1) * dw * 3].iter_mut().zip(&acc) {
            // `max` and `min` leave no NaN, so the value is in 0..=255;
            // unchecked, the conversion vectorises.
            #[allow(clippy::manual_clamp)] // clamp would keep a NaN
            let v = (a + 0.5).max(0.0).min(255.0);
            // SAFETY: `v` is finite and in 0..=255 (see above).
            *o = unsafe { v.to_int_unchecked::<i32>() } as u8;
        }
    }
}

/// One row filtered horizontally: output pixel `d`'s channels are the
/// sums, from zero, of `line`'s pixels `first[d] + j` × weight `j` for
/// `j` in `0..k`. `line` and `out` hold one float more than their
/// pixels: four-float loads and stores spill into it.
#[inline(always)]
fn horizontal(line: &[f32], t: &Dense, out: &mut [f32]) {
    #[inline(always)]
    fn fixed<const K: usize>(line: &[f32], t: &Dense, out: &mut [f32]) {
        // Two output pixels at a time (eight lanes), then the odd one.
        let pairs = t.first.len() / 2;
        for (i, (f, w)) in t
            .first
            .chunks_exact(2)
            .zip(t.splat.chunks_exact(2 * K))
            .enumerate()
        {
            let p0 = &line[f[0] as usize * 3..f[0] as usize * 3 + 3 * K + 1];
            let p1 = &line[f[1] as usize * 3..f[1] as usize * 3 + 3 * K + 1];
            let mut a = [0f32; 8];
            for j in 0..K {
                let mut p = [0f32; 8];
                p[..4].copy_from_slice(&p0[3 * j..3 * j + 4]);
                p[4..].copy_from_slice(&p1[3 * j..3 * j + 4]);
                for c in 0..4 {
                    a[c] += w[j][c] * p[c];
                    a[4 + c] += w[K + j][c] * p[4 + c];
                }
            }
            let d = 2 * i;
            out[d * 3..d * 3 + 4].copy_from_slice(&a[..4]);
            out[d * 3 + 3..d * 3 + 7].copy_from_slice(&a[4..]);
        }
        for d in 2 * pairs..t.first.len() {
            let f = t.first[d] as usize;
            let w = &t.splat[d * K..(d + 1) * K];
            let px = &line[f * 3..f * 3 + 3 * K + 1];
            let mut a = [0f32; 4];
            for j in 0..K {
                let p: [f32; 4] = px[3 * j..3 * j + 4].try_into().unwrap();
                for c in 0..4 {
                    a[c] += w[j][c] * p[c];
                }
            }
            out[d * 3..d * 3 + 4].copy_from_slice(&a);
        }
    }
    match t.k {
        1 => fixed::<1>(line, t, out),
        2 => fixed::<2>(line, t, out),
        3 => fixed::<3>(line, t, out),
        4 => fixed::<4>(line, t, out),
        5 => fixed::<5>(line, t, out),
        k => {
            for (d, (&f, w)) in t.first.iter().zip(t.weights.chunks_exact(k)).enumerate() {
                let mut a = [0f32; 4];
                for (j, &w) in w.iter().enumerate() {
                    let i = (f as usize + j) * 3;
                    let p: [f32; 4] = line[i..i + 4].try_into().unwrap();
                    for c in 0..4 {
                        a[c] += w * p[c];
                    }
                }
                out[d * 3..d * 3 + 4].copy_from_slice(&a);
            }
        }
    }
}

/// `acc[i]`: the sum, from zero, of `rows[j][i] × w[j]` in order.
#[inline(always)]
fn vertical<const K: usize>(rows: [&[f32]; K], w: &[f32], acc: &mut [f32]) {
    let w: &[f32; K] = w.try_into().unwrap();
    let n = acc.len();
    let rows: [&[f32]; K] = std::array::from_fn(|j| &rows[j][..n]);
    for (i, a) in acc.iter_mut().enumerate() {
        let mut s = 0f32;
        for j in 0..K {
            s += w[j] * rows[j][i];
        }
        *a = s;
    }
}

/// [`Taps`] with the same number `k` of taps for every output: output
/// `d` reads sources `first[d]..first[d] + k` with
/// `weights[d·k..(d+1)·k]`. An output's taps are consecutive sources in
/// ascending order, so its own taps keep their order, padded with zero
/// weights (after them, or before them at the image's end); sums of
/// non-negative terms gain nothing exactly from a zero term, so the
/// results equal summing the taps alone.
struct Dense {
    k: usize,
    first: Vec<u32>,
    weights: Vec<f32>,
    /// `weights`, each four times (one per lane of a pixel).
    splat: Vec<[f32; 4]>,
}

impl Dense {
    fn new(t: &Taps, n: usize) -> Dense {
        let outs = t.start.len() - 1;
        let k = (0..outs).map(|d| t.of(d).len()).max().unwrap_or(1).max(1);
        let mut dense = Dense {
            k,
            first: Vec::with_capacity(outs),
            weights: vec![0.0; outs * k],
            splat: Vec::new(),
        };
        for d in 0..outs {
            let taps = t.of(d);
            let lo = taps.first().map_or(0, |t| t.0 as usize);
            debug_assert!(taps.iter().enumerate().all(|(j, t)| t.0 as usize == lo + j));
            let first = lo.min(n - k);
            dense.first.push(first as u32);
            for &(s, w) in taps {
                dense.weights[d * k + s as usize - first] = w;
            }
        }
        dense.splat = dense.weights.iter().map(|&w| [w; 4]).collect();
        dense
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
