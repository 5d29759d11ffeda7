//! One image's trip from a `.beton` payload to a training tensor: the
//! crop (torchvision's and FFCV's random-resized-crop, or a centre crop),
//! decoding only that window of a JPEG at the smallest scale that still
//! has the output's resolution (1/2, 1/4 or 1/8 when the crop allows:
//! the DCT does that shrinking for free), resizing to the output size as
//! OpenCV's `INTER_AREA`, a random horizontal flip, and the output's
//! element type and layout (u8, or bf16 normalised; NHWC or NCHW).
//!
//! Every random choice comes from a generator seeded by (seed, epoch,
//! sample), so a sample's pixels do not depend on which thread made them.

use braid_core::rng::Rng;

use crate::beton::{Image, ImageMode};
use crate::jpeg;
use crate::resize::resize_area_crop;

/// How the image is cut before resizing.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Crop {
    /// torchvision's `RandomResizedCrop` (FFCV's decoder of the same
    /// name): an area fraction in `scale` and an aspect ratio in `ratio`
    /// (log-uniform), ten tries, then a centre crop clamped to `ratio`.
    RandomResized {
        /// Fractions of the image's area (torchvision: 0.08 to 1).
        scale: (f64, f64),
        /// Width / height (torchvision: 3/4 to 4/3).
        ratio: (f64, f64),
    },
    /// FFCV's `CenterCropRGBImageDecoder`: the centred square of side
    /// `ratio × the shorter side` (224/256 for ImageNet evaluation).
    Center {
        /// Side of the square over the image's shorter side.
        ratio: f64,
    },
}

impl Crop {
    /// torchvision's defaults.
    pub const RANDOM_RESIZED: Crop = Crop::RandomResized {
        scale: (0.08, 1.0),
        ratio: (3.0 / 4.0, 4.0 / 3.0),
    };

    /// The window (x, y, width, height) of a `width × height` image.
    pub fn window(&self, width: usize, height: usize, rng: &mut Rng) -> Window {
        match *self {
            Crop::RandomResized { scale, ratio } => {
                random_resized(width, height, scale, ratio, rng)
            }
            Crop::Center { ratio } => {
                let side = ((width.min(height) as f64 * ratio).round() as usize)
                    .clamp(1, width.min(height));
                Window {
                    x: (width - side) / 2,
                    y: (height - side) / 2,
                    w: side,
                    h: side,
                }
            }
        }
    }
}

/// A crop window in source pixels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    /// Left column.
    pub x: usize,
    /// Top row.
    pub y: usize,
    /// Columns.
    pub w: usize,
    /// Rows.
    pub h: usize,
}

fn random_resized(
    width: usize,
    height: usize,
    scale: (f64, f64),
    ratio: (f64, f64),
    rng: &mut Rng,
) -> Window {
    let area = (width * height) as f64;
    let (lo, hi) = (ratio.0.ln(), ratio.1.ln());
    for _ in 0..10 {
        let target = area * (scale.0 + (scale.1 - scale.0) * rng.uniform());
        let aspect = (lo + (hi - lo) * rng.uniform()).exp();
        let w = (target * aspect).sqrt().round() as usize;
        let h = (target / aspect).sqrt().round() as usize;
        if w > 0 && w <= width && h > 0 && h <= height {
            let y = rng.below(height - h + 1);
            let x = rng.below(width - w + 1);
            return Window { x, y, w, h };
        }
    }
    let in_ratio = width as f64 / height as f64;
    let (w, h) = if in_ratio < ratio.0.min(ratio.1) {
        (
            width,
            ((width as f64 / ratio.0.min(ratio.1)).round() as usize).clamp(1, height),
        )
    } else if in_ratio > ratio.0.max(ratio.1) {
        (
            ((height as f64 * ratio.0.max(ratio.1)).round() as usize).clamp(1, width),
            height,
        )
    } else {
        (width, height)
    };
    Window {
        x: (width - w) / 2,
        y: (height - h) / 2,
        w,
        h,
    }
}

/// The largest JPEG scale denominator (8, 4, 2 or 1) at which `win` of a
/// `width × height` image still has at least `out_w × out_h` pixels, and
/// the window in that scaled image's pixels (rounded outwards).
pub fn decode_scale(
    width: usize,
    height: usize,
    win: Window,
    out_w: usize,
    out_h: usize,
) -> (u32, Window) {
    for d in [8usize, 4, 2] {
        let (sw, sh) = (width.div_ceil(d), height.div_ceil(d));
        let x0 = win.x / d;
        let y0 = win.y / d;
        let x1 = (win.x + win.w).div_ceil(d).min(sw);
        let y1 = (win.y + win.h).div_ceil(d).min(sh);
        // The scaled window must keep the output's resolution (rounding
        // outwards adds at most a pixel, so ask for the crop's own size
        // divided by d).
        if win.w / d >= out_w && win.h / d >= out_h {
            return (
                d as u32,
                Window {
                    x: x0,
                    y: y0,
                    w: x1 - x0,
                    h: y1 - y0,
                },
            );
        }
    }
    (1, win)
}

/// What the output tensor holds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Pixels {
    /// Bytes as decoded.
    U8,
    /// `(x / 255 - mean) / std` per channel, as bf16 bits.
    Bf16 {
        /// Per-channel means (of values scaled to [0, 1]).
        mean: [f32; 3],
        /// Per-channel standard deviations.
        std: [f32; 3],
    },
}

impl Pixels {
    /// ImageNet's normalisation.
    pub const IMAGENET_BF16: Pixels = Pixels::Bf16 {
        mean: [0.485, 0.456, 0.406],
        std: [0.229, 0.224, 0.225],
    };

    /// Bytes per element.
    pub fn size(&self) -> usize {
        match self {
            Pixels::U8 => 1,
            Pixels::Bf16 { .. } => 2,
        }
    }
}

/// Memory order of a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// Sample, row, column, channel (FFCV's memory order; PyTorch's
    /// channels-last).
    Nhwc,
    /// Sample, channel, row, column (PyTorch's default).
    Nchw,
}

/// One sample's output: its cropping, its size and its element form.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Augment {
    /// The crop.
    pub crop: Crop,
    /// Output width.
    pub width: usize,
    /// Output height.
    pub height: usize,
    /// Flip half the images left to right.
    pub flip: bool,
    /// Element form.
    pub pixels: Pixels,
    /// Memory order.
    pub layout: Layout,
}

/// Per-thread buffers, reused from sample to sample.
#[derive(Default)]
pub struct Scratch {
    decoded: Vec<u8>,
    resized: Vec<u8>,
    bf16: Option<([f32; 3], [f32; 3], Vec<u16>)>,
}

impl Augment {
    /// Bytes one sample takes in a batch.
    pub fn sample_bytes(&self) -> usize {
        self.width * self.height * 3 * self.pixels.size()
    }

    /// Makes `img` (sample `sample`) into `out` (`sample_bytes()` long),
    /// drawing its crop and flip from `rng`.
    pub fn apply(
        &self,
        img: &Image<'_>,
        rng: &mut Rng,
        scratch: &mut Scratch,
        out: &mut [u8],
    ) -> Result<(), String> {
        let (iw, ih) = (img.width as usize, img.height as usize);
        if iw == 0 || ih == 0 {
            return Err(format!("an image of {iw}x{ih} pixels"));
        }
        let win = self.crop.window(iw, ih, rng);
        let flip = self.flip && rng.uniform() < 0.5;
        let (ow, oh) = (self.width, self.height);
        let direct = self.pixels == Pixels::U8 && self.layout == Layout::Nhwc;
        let mut resized = std::mem::take(&mut scratch.resized);
        let dst: &mut [u8] = if direct {
            &mut out[..ow * oh * 3]
        } else {
            resized.resize(ow * oh * 3, 0);
            &mut resized
        };
        match img.mode {
            ImageMode::Raw => {
                if img.data.len() != iw * ih * 3 {
                    return Err(format!(
                        "a raw {iw}x{ih} image has {} bytes, not {}",
                        img.data.len(),
                        iw * ih * 3
                    ));
                }
                resize_area_crop(img.data, iw, ih, win.x, win.y, win.w, win.h, dst, ow, oh);
            }
            ImageMode::Jpeg => {
                let (d, sw) = decode_scale(iw, ih, win, ow, oh);
                // Rows as libjpeg leaves them (up to the scaled image's
                // width), so no row is copied before the resize reads it.
                let scaled_w = iw.div_ceil(d as usize);
                let len = sw.h * scaled_w * 3;
                let decoded = jpeg::sized(&mut scratch.decoded, len, || {
                    format!("a {}x{} window", sw.w, sw.h)
                })?;
                let (row_x, row_w) = jpeg::decode_crop_wide(
                    img.data,
                    d,
                    sw.x as u32,
                    sw.y as u32,
                    sw.w as u32,
                    sw.h as u32,
                    decoded,
                )
                .map_err(|e| format!("{e} (the file says {iw}x{ih})"))?;
                let (row_x, row_w) = (row_x as usize, row_w as usize);
                resize_area_crop(
                    decoded,
                    row_w,
                    sw.h,
                    sw.x - row_x,
                    0,
                    sw.w,
                    sw.h,
                    dst,
                    ow,
                    oh,
                );
            }
        }
        if flip {
            for row in dst.chunks_exact_mut(ow * 3) {
                flip_row(row);
            }
        }
        if !direct {
            self.convert(&resized, scratch, out);
        }
        scratch.resized = resized;
        Ok(())
    }

    /// HWC bytes into the output's form.
    fn convert(&self, hwc: &[u8], scratch: &mut Scratch, out: &mut [u8]) {
        let plane = self.width * self.height;
        match self.pixels {
            Pixels::U8 => {
                // NCHW (NHWC was written in place).
                for c in 0..3 {
                    for (o, px) in out[c * plane..(c + 1) * plane]
                        .iter_mut()
                        .zip(hwc.chunks_exact(3))
                    {
                        *o = px[c];
                    }
                }
            }
            Pixels::Bf16 { mean, std } => {
                let lut = match &scratch.bf16 {
                    Some((m, s, lut)) if *m == mean && *s == std => lut,
                    _ => {
                        let lut = (0..3)
                            .flat_map(|c| {
                                (0..256).map(move |v| {
                                    half::bf16::from_f32((v as f32 / 255.0 - mean[c]) / std[c])
                                        .to_bits()
                                })
                            })
                            .collect();
                        scratch.bf16 = Some((mean, std, lut));
                        &scratch.bf16.as_ref().expect("set").2
                    }
                };
                let out = &mut out[..plane * 6];
                match self.layout {
                    Layout::Nhwc => {
                        for (i, (o, &v)) in out.chunks_exact_mut(2).zip(hwc).enumerate() {
                            o.copy_from_slice(&lut[(i % 3) * 256 + v as usize].to_le_bytes());
                        }
                    }
                    Layout::Nchw => {
                        for c in 0..3 {
                            let o = &mut out[c * plane * 2..(c + 1) * plane * 2];
                            for (o, px) in o.chunks_exact_mut(2).zip(hwc.chunks_exact(3)) {
                                o.copy_from_slice(&lut[c * 256 + px[c] as usize].to_le_bytes());
                            }
                        }
                    }
                }
            }
        }
    }
}

fn flip_row(row: &mut [u8]) {
    let n = row.len() / 3;
    for i in 0..n / 2 {
        let j = n - 1 - i;
        for c in 0..3 {
            row.swap(i * 3 + c, j * 3 + c);
        }
    }
}

/// The generator for `sample` in `epoch`.
pub fn sample_rng(seed: u64, epoch: u64, sample: usize) -> Rng {
    Rng::new(
        seed ^ epoch.wrapping_mul(0x9e37_79b9_7f4a_7c15)
            ^ (sample as u64).wrapping_mul(0xd1b5_4a32_d192_ed03),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_resized_crops_lie_inside_and_keep_the_ratio_bounds() {
        let mut rng = Rng::new(7);
        for (w, h) in [(500, 375), (100, 1000), (64, 64), (1, 300)] {
            for _ in 0..2000 {
                let c = Crop::RANDOM_RESIZED.window(w, h, &mut rng);
                assert!(
                    c.w >= 1 && c.h >= 1 && c.x + c.w <= w && c.y + c.h <= h,
                    "{c:?} in {w}x{h}"
                );
            }
        }
        // Areas spread over the scale range on an ordinary photo.
        let areas: Vec<f64> = (0..4000)
            .map(|_| {
                let c = Crop::RANDOM_RESIZED.window(500, 375, &mut rng);
                (c.w * c.h) as f64 / (500.0 * 375.0)
            })
            .collect();
        let mean = areas.iter().sum::<f64>() / areas.len() as f64;
        // (Large draws that do not fit are redrawn, so below the 0.54 of
        // the raw draws.)
        assert!((0.38..0.5).contains(&mean), "mean area fraction {mean}");
    }

    #[test]
    fn the_decode_scale_keeps_the_output_resolution() {
        let win = Window {
            x: 13,
            y: 7,
            w: 400,
            h: 300,
        };
        let (d, s) = decode_scale(500, 375, win, 160, 160);
        assert_eq!(d, 1, "300 / 2 < 160");
        assert_eq!(s, win);
        let (d, s) = decode_scale(500, 375, win, 96, 96);
        assert_eq!(d, 2);
        assert_eq!((s.x, s.y), (6, 3));
        assert!(s.w >= 200 && s.h >= 150 && s.x + s.w <= 250 && s.y + s.h <= 188);
        let (d, _) = decode_scale(
            4000,
            3000,
            Window {
                x: 0,
                y: 0,
                w: 4000,
                h: 3000,
            },
            160,
            160,
        );
        assert_eq!(d, 8);
    }

    #[test]
    fn flips_and_layouts_move_pixels_where_they_belong() {
        // A raw 4x2 image, cropped whole (centre crop of ratio 1 on a
        // square would cut; use a 2x2 image) and kept at its size.
        let data: Vec<u8> = (0..12).collect();
        let img = Image {
            mode: ImageMode::Raw,
            width: 2,
            height: 2,
            data: &data,
        };
        let base = Augment {
            crop: Crop::Center { ratio: 1.0 },
            width: 2,
            height: 2,
            flip: false,
            pixels: Pixels::U8,
            layout: Layout::Nhwc,
        };
        let mut s = Scratch::default();
        let mut out = vec![0u8; 12];
        base.apply(&img, &mut Rng::new(1), &mut s, &mut out)
            .unwrap();
        assert_eq!(out, data);
        let nchw = Augment {
            layout: Layout::Nchw,
            ..base
        };
        nchw.apply(&img, &mut Rng::new(1), &mut s, &mut out)
            .unwrap();
        assert_eq!(out, [0, 3, 6, 9, 1, 4, 7, 10, 2, 5, 8, 11]);
        // Flipping: find a seed that flips, the row's pixels swap.
        let flip = Augment { flip: true, ..base };
        let seed = (0..64)
            .find(|&k| {
                let mut r = Rng::new(k);
                r.uniform() < 0.5
            })
            .unwrap();
        flip.apply(&img, &mut Rng::new(seed), &mut s, &mut out)
            .unwrap();
        assert_eq!(out, [3, 4, 5, 0, 1, 2, 9, 10, 11, 6, 7, 8]);
        let bf = Augment {
            pixels: Pixels::Bf16 {
                mean: [0.0; 3],
                std: [1.0 / 255.0; 3],
            },
            ..base
        };
        let mut wide = vec![0u8; 24];
        bf.apply(&img, &mut Rng::new(1), &mut s, &mut wide).unwrap();
        let vals: Vec<f32> = wide
            .chunks_exact(2)
            .map(|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect();
        assert_eq!(vals, data.iter().map(|&v| v as f32).collect::<Vec<_>>());
    }
}
