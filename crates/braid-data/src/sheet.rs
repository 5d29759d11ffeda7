//! Contact sheets: the first images of a `.beton` file's RGB image field
//! as one picture, for a look at what a dataset holds (`braid data
//! inspect FILE --sheet OUT.png`).
//!
//! Each image is fitted into a [`THUMB`] × [`THUMB`] box keeping its
//! aspect ratio (OpenCV's `INTER_AREA`, [`crate::resize::resize_area`]),
//! centred in it, and the boxes are laid out in a grid on a dark grey
//! background, each with its sample index (and, where the file has an int
//! field named `label`, the label) written under it in a built-in 5×7
//! pixel font. Raw images are used as stored, JPEG ones decoded
//! ([`crate::jpeg::decode`]); an image that does not decode is an error
//! naming its sample. The result is RGB pixels and their size: encoding
//! them (PNG, say) is the caller's.

use rayon::prelude::*;

use crate::beton::{Beton, FieldType, ImageMode, Value};
use crate::jpeg;
use crate::resize::resize_area;

/// The side of the box each thumbnail is fitted into, in pixels.
pub const THUMB: usize = 128;
/// Pixels between boxes and around the sheet.
pub const GAP: usize = 6;
/// The band under each box its caption is written in, in pixels.
pub const CAPTION: usize = 18;
/// The most images one sheet takes.
pub const MAX_IMAGES: usize = 1024;

/// An RGB image: width, height and height × width × 3 bytes, row-major.
pub type Rgb = (usize, usize, Vec<u8>);

/// The background's grey level.
const BACKGROUND: [u8; 3] = [32, 32, 32];
/// The sample index's colour.
const INDEX_INK: [u8; 3] = [220, 220, 220];
/// The label's colour.
const LABEL_INK: [u8; 3] = [255, 190, 60];
/// Each font pixel drawn as this many pixels square.
const FONT_SCALE: usize = 2;

/// What to put on a sheet.
#[derive(Debug, Clone)]
pub struct SheetOptions<'a> {
    /// The image field (default: the file's first RGB image field).
    pub field: Option<&'a str>,
    /// How many images, from sample 0 (fewer if the file has fewer), 1 to
    /// [`MAX_IMAGES`].
    pub count: usize,
    /// Boxes per row (fewer if there are fewer images); at least 1.
    pub columns: usize,
}

/// A contact sheet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sheet {
    /// Pixels across.
    pub width: usize,
    /// Pixels down.
    pub height: usize,
    /// Boxes per row.
    pub columns: usize,
    /// Rows of boxes.
    pub rows: usize,
    /// Images on the sheet.
    pub images: usize,
    /// The field they came from.
    pub field: String,
    /// height × width × 3 RGB bytes, row-major.
    pub rgb: Vec<u8>,
}

/// The size of a sheet of `columns` × `rows` boxes: (width, height).
pub fn sheet_size(columns: usize, rows: usize) -> (usize, usize) {
    (
        GAP + columns * (THUMB + GAP),
        GAP + rows * (THUMB + CAPTION + GAP),
    )
}

/// The size a `w` × `h` image is drawn at to fit a `max` × `max` box
/// keeping its aspect ratio (enlarged if smaller); at least 1 × 1.
pub fn fit(w: usize, h: usize, max: usize) -> (usize, usize) {
    let scale = max as f64 / w.max(h).max(1) as f64;
    let side = |x: usize| ((x as f64 * scale).round() as usize).clamp(1, max);
    (side(w), side(h))
}

/// The field a sheet is made of: `name` if given (it must be an RGB
/// image field), else the first RGB image field. An error naming the
/// file and listing its fields if there is none.
pub fn image_field(b: &Beton, name: Option<&str>) -> Result<usize, String> {
    let idx = b.index();
    let fields = || {
        idx.fields
            .iter()
            .map(|f| format!("{} ({})", f.name, f.ty.name()))
            .collect::<Vec<_>>()
            .join(", ")
    };
    match name {
        Some(name) => {
            let f = idx.field(name)?;
            if idx.fields[f].ty != FieldType::RgbImage {
                return Err(format!(
                    "{}: field '{name}' holds {}, not RGB images; its fields: {}",
                    idx.path,
                    idx.fields[f].ty.name(),
                    fields()
                ));
            }
            Ok(f)
        }
        None => idx
            .fields
            .iter()
            .position(|f| f.ty == FieldType::RgbImage)
            .ok_or_else(|| {
                format!(
                    "{} has no image field to make a contact sheet of; its fields: {}",
                    idx.path,
                    fields()
                )
            }),
    }
}

/// Sample `s`'s image of field `f` as RGB pixels: (width, height, pixels).
/// An error naming the sample if it does not decode.
pub fn image_rgb(b: &Beton, s: usize, f: usize) -> Result<Rgb, String> {
    let idx = b.index();
    let here = |what: String| {
        format!(
            "{}: sample {s}, field '{}': {what}",
            idx.path, idx.fields[f].name
        )
    };
    let Value::Image(img) = b.value(s, f)? else {
        return Err(here("not an image".into()));
    };
    let (w, h) = (img.width as usize, img.height as usize);
    match img.mode {
        ImageMode::Raw => Ok((w, h, img.data.to_vec())),
        ImageMode::Jpeg => {
            let (info, rgb) = jpeg::decode(img.data).map_err(here)?;
            if (info.width as usize, info.height as usize) != (w, h) {
                return Err(here(format!(
                    "the JPEG is {}x{} pixels, the metadata says {w}x{h}",
                    info.width, info.height
                )));
            }
            Ok((w, h, rgb))
        }
    }
}

/// The contact sheet of `b`'s first `opts.count` images.
pub fn build(b: &Beton, opts: &SheetOptions) -> Result<Sheet, String> {
    let idx = b.index();
    let f = image_field(b, opts.field)?;
    if opts.count == 0 || opts.count > MAX_IMAGES {
        return Err(format!(
            "a contact sheet of {} images asked for; it takes 1 to {MAX_IMAGES}",
            opts.count
        ));
    }
    if opts.columns == 0 {
        return Err("a contact sheet of 0 columns asked for; it needs at least 1".into());
    }
    if b.is_empty() {
        return Err(format!(
            "{} has no samples to make a contact sheet of",
            idx.path
        ));
    }
    let n = opts.count.min(b.len());
    let label = idx
        .fields
        .iter()
        .position(|x| x.name == "label" && x.ty == FieldType::Int);
    // Every thumbnail, in parallel; the first failure (by sample) is the
    // error.
    let thumbs: Vec<Result<Rgb, String>> = (0..n)
        .into_par_iter()
        .map(|s| {
            let (w, h, rgb) = image_rgb(b, s, f)?;
            let (tw, th) = fit(w, h, THUMB);
            let mut out = vec![0u8; tw * th * 3];
            resize_area(&rgb, w, h, &mut out, tw, th);
            Ok((tw, th, out))
        })
        .collect();
    let columns = opts.columns.min(n);
    let rows = n.div_ceil(columns);
    let (width, height) = sheet_size(columns, rows);
    let mut sheet = Sheet {
        width,
        height,
        columns,
        rows,
        images: n,
        field: idx.fields[f].name.clone(),
        rgb: BACKGROUND.repeat(width * height),
    };
    for (s, thumb) in thumbs.into_iter().enumerate() {
        let (tw, th, pixels) = thumb?;
        let (bx, by) = (
            GAP + (s % columns) * (THUMB + GAP),
            GAP + (s / columns) * (THUMB + CAPTION + GAP),
        );
        let (x0, y0) = (bx + (THUMB - tw) / 2, by + (THUMB - th) / 2);
        for row in 0..th {
            let at = ((y0 + row) * width + x0) * 3;
            sheet.rgb[at..at + tw * 3].copy_from_slice(&pixels[row * tw * 3..(row + 1) * tw * 3]);
        }
        let text_y = by + THUMB + (CAPTION - 7 * FONT_SCALE) / 2;
        let right = bx + THUMB;
        let mut x = sheet.text(&s.to_string(), bx, text_y, right, INDEX_INK);
        if let Some(l) = label {
            if let Value::Int(v) = b.value(s, l)? {
                x += 2 * glyph_advance();
                sheet.text(&v.to_string(), x, text_y, right, LABEL_INK);
            }
        }
    }
    Ok(sheet)
}

/// A glyph's width plus the space after it, in sheet pixels.
fn glyph_advance() -> usize {
    6 * FONT_SCALE
}

impl Sheet {
    /// Writes `text` from (`x`, `y`), clipped at column `right`; the
    /// column after it.
    fn text(&mut self, text: &str, mut x: usize, y: usize, right: usize, ink: [u8; 3]) -> usize {
        for c in text.chars() {
            let rows = glyph(c);
            for (gy, bits) in rows.iter().enumerate() {
                for gx in 0..5 {
                    if bits >> (4 - gx) & 1 == 0 {
                        continue;
                    }
                    for dy in 0..FONT_SCALE {
                        for dx in 0..FONT_SCALE {
                            let (px, py) = (x + gx * FONT_SCALE + dx, y + gy * FONT_SCALE + dy);
                            if px < right.min(self.width) && py < self.height {
                                let at = (py * self.width + px) * 3;
                                self.rgb[at..at + 3].copy_from_slice(&ink);
                            }
                        }
                    }
                }
            }
            x += glyph_advance();
        }
        x
    }
}

/// The 5×7 glyph of `c` (digits and `-`; anything else is blank), one
/// row a byte, the leftmost pixel in bit 4.
fn glyph(c: char) -> [u8; 7] {
    match c {
        '0' => [0x0e, 0x11, 0x13, 0x15, 0x19, 0x11, 0x0e],
        '1' => [0x04, 0x0c, 0x04, 0x04, 0x04, 0x04, 0x0e],
        '2' => [0x0e, 0x11, 0x01, 0x02, 0x04, 0x08, 0x1f],
        '3' => [0x1f, 0x02, 0x04, 0x02, 0x01, 0x11, 0x0e],
        '4' => [0x02, 0x06, 0x0a, 0x12, 0x1f, 0x02, 0x02],
        '5' => [0x1f, 0x10, 0x1e, 0x01, 0x01, 0x11, 0x0e],
        '6' => [0x06, 0x08, 0x10, 0x1e, 0x11, 0x11, 0x0e],
        '7' => [0x1f, 0x01, 0x02, 0x04, 0x08, 0x08, 0x08],
        '8' => [0x0e, 0x11, 0x11, 0x0e, 0x11, 0x11, 0x0e],
        '9' => [0x0e, 0x11, 0x11, 0x0f, 0x01, 0x02, 0x0c],
        '-' => [0x00, 0x00, 0x00, 0x1f, 0x00, 0x00, 0x00],
        _ => [0; 7],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn images_fit_their_box_keeping_aspect() {
        assert_eq!(fit(256, 128, 128), (128, 64));
        assert_eq!(fit(24, 20, 128), (128, 107));
        assert_eq!(fit(1, 1000, 128), (1, 128));
        assert_eq!(fit(128, 128, 128), (128, 128));
    }

    #[test]
    fn sheets_are_sized_by_their_grid() {
        assert_eq!(
            sheet_size(1, 1),
            (2 * GAP + THUMB, 2 * GAP + THUMB + CAPTION)
        );
        assert_eq!(sheet_size(8, 2), (1078, 310));
    }

    #[test]
    fn text_is_clipped_to_its_column() {
        let mut s = Sheet {
            width: 40,
            height: 20,
            columns: 1,
            rows: 1,
            images: 0,
            field: String::new(),
            rgb: vec![0; 40 * 20 * 3],
        };
        let x = s.text("18", 0, 0, 20, [255; 3]);
        assert_eq!(x, 2 * glyph_advance());
        let lit = |s: &Sheet, x0: usize, x1: usize| {
            (0..s.height).any(|y| (x0..x1).any(|x| s.rgb[(y * s.width + x) * 3] == 255))
        };
        assert!(lit(&s, 0, 10) && lit(&s, 12, 20));
        assert!(!lit(&s, 20, 40), "drawn past its column");
    }
}
