//! JPEG images: decoded whole, or only a window of them at 1/1, 1/2, 1/4
//! or 1/8 scale (the DCT does the downscaling, so a small window of a
//! large image costs little), and encoded — all through libjpeg-turbo,
//! linked in statically (`build.rs`, `csrc/jpeg_shim.c`).
//!
//! Decoding is FFCV's: RGB out, libjpeg's fast integer IDCT (`JDCT_IFAST`,
//! TurboJPEG's `TJFLAG_FASTDCT`) and fancy chroma upsampling, so pixels
//! equal those FFCV's loader decodes from the same bytes. Encoding is
//! OpenCV's `cv2.imencode('.jpg', …, [IMWRITE_JPEG_QUALITY, q])`, which
//! FFCV writes its JPEG images with: 4:2:0, standard Huffman tables,
//! baseline.
//!
//! Corrupt or truncated data is an error, never grey pixels, a panic or a
//! process exit (libjpeg's warnings count as errors). Every call has its
//! own libjpeg state: call from as many threads as you like.

use std::mem::MaybeUninit;

/// What a JPEG's header says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JpegInfo {
    /// Pixels across.
    pub width: u32,
    /// Pixels down.
    pub height: u32,
    /// Colour components in the file: 1 (grayscale), 3 (YCbCr or RGB) or
    /// 4 (CMYK, which braid does not decode). Decoded pixels are always
    /// RGB.
    pub components: u32,
}

/// Whether this build reads and writes JPEG images (libjpeg-turbo was
/// found and linked when braid was built).
pub const SUPPORTED: bool = cfg!(not(braid_no_libjpeg));

/// One line on this build's JPEG support, for `--help` texts.
pub fn support_note() -> &'static str {
    match SUPPORTED {
        true => "JPEG support: on (libjpeg-turbo, linked statically)",
        false => {
            "JPEG support: OFF in this build (libjpeg-turbo was not found when braid was \
                  built): --images and image .beton files fail; install libjpeg-turbo's static \
                  library and headers (Debian: libjpeg62-turbo-dev) or set BRAID_LIBJPEG_DIR, \
                  then rebuild"
        }
    }
}

/// Reads `jpeg`'s header only.
pub fn info(jpeg: &[u8]) -> Result<JpegInfo, String> {
    ffi::info(jpeg)
}

/// Decodes all of `jpeg` into height × width × 3 RGB bytes, row-major.
pub fn decode(jpeg: &[u8]) -> Result<(JpegInfo, Vec<u8>), String> {
    let info = info(jpeg)?;
    let len = info.width as usize * info.height as usize * 3;
    // Reserved, not filled: a damaged header may claim up to 65535 ×
    // 65535 pixels, and the error is better than an abort.
    let mut rgb = Vec::new();
    rgb.try_reserve_exact(len).map_err(|_| {
        format!(
            "a {}x{} JPEG needs {len} bytes of RGB, more than can be allocated",
            info.width, info.height
        )
    })?;
    ffi::decode(
        jpeg,
        1,
        0,
        0,
        info.width,
        info.height,
        &mut rgb.spare_capacity_mut()[..len],
        false,
    )?;
    // SAFETY: the capacity is at least `len`, and on success the shim
    // wrote all `len` bytes (every row of the whole image).
    unsafe { rgb.set_len(len) };
    Ok((info, rgb))
}

/// Decodes the `w` × `h` window at (`x`, `y`) of `jpeg` scaled by
/// 1/`scale_denom` (1, 2, 4 or 8; the window in the scaled image's
/// pixels, which [`scaled_size`] gives) into the first `h × w × 3` bytes
/// of `out`, RGB, row-major.
///
/// Only the rows down to the window's last are decoded, and of them only
/// the iMCU columns (8 or 16 pixels wide, before scaling) that the window
/// (and a pixel either side of it) touches; data below the window is not
/// read, so a file truncated there decodes without error. The pixels
/// equal the same window of the whole image decoded at that scale (of
/// [`decode`]'s at scale 1).
///
/// An error if the data is not a JPEG braid can decode, if the window is
/// empty or not inside the scaled image, or if `out` is too small.
pub fn decode_crop(
    jpeg: &[u8],
    scale_denom: u32,
    x: u32,
    y: u32,
    w: u32,
    h: u32,
    out: &mut [u8],
) -> Result<(), String> {
    decode_into(jpeg, scale_denom, x, y, w, h, out, false).map(|_| ())
}

/// [`decode_crop`] without its last copy: each row of the window is left
/// where libjpeg decodes it, `row_w` pixels wide from column `row_x` of
/// the scaled image (the window widened to whole iMCU columns and a pixel
/// either side, `row_x <= x`), so the asked window starts at column
/// `x - row_x` of each of the `h` rows, `row_w × 3` bytes apart. `out`
/// must hold `h × (scaled width) × 3` bytes, the most a row can take.
/// Returns `(row_x, row_w)`; the window's pixels equal
/// [`decode_crop`]'s.
pub fn decode_crop_wide(
    jpeg: &[u8],
    scale_denom: u32,
    x: u32,
    y: u32,
    w: u32,
    h: u32,
    out: &mut [u8],
) -> Result<(u32, u32), String> {
    decode_into(jpeg, scale_denom, x, y, w, h, out, true)
}

/// [`decode_crop`] (`wide` false) or [`decode_crop_wide`] (true).
#[allow(clippy::too_many_arguments)]
fn decode_into(
    jpeg: &[u8],
    scale_denom: u32,
    x: u32,
    y: u32,
    w: u32,
    h: u32,
    out: &mut [u8],
    wide: bool,
) -> Result<(u32, u32), String> {
    if !matches!(scale_denom, 1 | 2 | 4 | 8) {
        return Err(format!(
            "JPEG scale 1/{scale_denom} asked for; it must be 1/1, 1/2, 1/4 or 1/8"
        ));
    }
    // SAFETY: `MaybeUninit<u8>` has `u8`'s layout, and the shim only
    // ever writes initialised bytes into the slice, so `out` holds
    // initialised bytes whenever it is used again.
    let out = unsafe { &mut *(out as *mut [u8] as *mut [MaybeUninit<u8>]) };
    ffi::decode(jpeg, scale_denom, x, y, w, h, out, wide)
}

/// The first `len` bytes of a reused buffer (contents unspecified) to
/// decode into, or an error where that much cannot be allocated (a
/// damaged header may claim up to 65535 × 65535 pixels): `what()` names
/// it. The buffer only grows, so buffers reused for images of varying
/// sizes are not zeroed again and again.
pub(crate) fn sized(
    buf: &mut Vec<u8>,
    len: usize,
    what: impl Fn() -> String,
) -> Result<&mut [u8], String> {
    if len > buf.len() {
        if len > buf.capacity() {
            buf.try_reserve_exact(len - buf.len())
                .map_err(|_| format!("{} needs {len} bytes, more than can be allocated", what()))?;
        }
        buf.resize(len, 0);
    }
    Ok(&mut buf[..len])
}

/// The size of a `width` × `height` image decoded at 1/`denom` scale:
/// libjpeg's rule, each side divided and rounded up.
///
/// # Panics
///
/// If `denom` is 0.
pub fn scaled_size(width: u32, height: u32, denom: u32) -> (u32, u32) {
    (width.div_ceil(denom), height.div_ceil(denom))
}

/// Encodes height × width × 3 RGB bytes (row-major) as a baseline 4:2:0
/// JPEG of `quality` 1–100, as OpenCV does.
pub fn encode(rgb: &[u8], width: u32, height: u32, quality: u8) -> Result<Vec<u8>, String> {
    if !(1..=100).contains(&quality) {
        return Err(format!(
            "JPEG quality {quality} asked for; it must be 1 to 100"
        ));
    }
    // JPEG_MAX_DIMENSION in libjpeg.
    const MAX_SIDE: u32 = 65500;
    if width == 0 || height == 0 || width > MAX_SIDE || height > MAX_SIDE {
        return Err(format!(
            "cannot encode a {width}x{height} JPEG: each side must be 1 to {MAX_SIDE} pixels"
        ));
    }
    let want = width as usize * height as usize * 3;
    if rgb.len() != want {
        return Err(format!(
            "a {width}x{height} RGB image is {want} bytes; {} given",
            rgb.len()
        ));
    }
    ffi::encode(rgb, width, height, quality)
}

#[cfg(not(braid_no_libjpeg))]
mod ffi {
    use std::ffi::{c_char, c_int, c_uint, CStr};
    use std::mem::MaybeUninit;

    use super::JpegInfo;

    extern "C" {
        fn braid_jpeg_info(
            buf: *const u8,
            len: usize,
            width: *mut c_uint,
            height: *mut c_uint,
            components: *mut c_uint,
            err: *mut c_char,
            errlen: usize,
        ) -> c_int;
        fn braid_jpeg_decode(
            buf: *const u8,
            len: usize,
            scale_denom: c_uint,
            crop_x: c_uint,
            crop_y: c_uint,
            crop_w: c_uint,
            crop_h: c_uint,
            out: *mut u8,
            out_capacity: usize,
            wide: c_int,
            row_x: *mut c_uint,
            row_w: *mut c_uint,
            err: *mut c_char,
            errlen: usize,
        ) -> c_int;
        fn braid_jpeg_encode(
            rgb: *const u8,
            width: c_uint,
            height: c_uint,
            quality: c_int,
            out: *mut *mut u8,
            outlen: *mut usize,
            err: *mut c_char,
            errlen: usize,
        ) -> c_int;
        fn braid_jpeg_free(ptr: *mut u8);
    }

    /// Room for libjpeg's messages (JMSG_LENGTH_MAX is 200) and the shim's.
    const ERR_LEN: usize = 256;

    fn message(err: &[c_char; ERR_LEN]) -> String {
        // SAFETY: the shim always leaves a NUL-terminated string in the
        // buffer (it writes "" first, and truncates to ERR_LEN - 1).
        let text = unsafe { CStr::from_ptr(err.as_ptr()) };
        text.to_string_lossy().into_owned()
    }

    pub fn info(jpeg: &[u8]) -> Result<JpegInfo, String> {
        let (mut width, mut height, mut components) = (0, 0, 0);
        let mut err = [0 as c_char; ERR_LEN];
        // SAFETY: `jpeg` is valid for `jpeg.len()` bytes and only read;
        // the three outputs and `err` (ERR_LEN bytes) are live locals the
        // shim writes within bounds. The shim catches every libjpeg error
        // in C (setjmp/longjmp never cross this frame).
        let rc = unsafe {
            braid_jpeg_info(
                jpeg.as_ptr(),
                jpeg.len(),
                &mut width,
                &mut height,
                &mut components,
                err.as_mut_ptr(),
                ERR_LEN,
            )
        };
        if rc != 0 {
            return Err(format!("not a readable JPEG: {}", message(&err)));
        }
        Ok(JpegInfo {
            width,
            height,
            components,
        })
    }

    /// The window's rows exactly `w` wide, or (`wide`) as libjpeg
    /// decodes them: `(row_x, row_w)` says where they lie.
    #[allow(clippy::too_many_arguments)]
    pub fn decode(
        jpeg: &[u8],
        scale_denom: u32,
        x: u32,
        y: u32,
        w: u32,
        h: u32,
        out: &mut [MaybeUninit<u8>],
        wide: bool,
    ) -> Result<(u32, u32), String> {
        let mut err = [0 as c_char; ERR_LEN];
        let (mut row_x, mut row_w) = (0, 0);
        // SAFETY: `jpeg` is valid for `jpeg.len()` bytes and only read;
        // `out` is valid for writes of `out.len()` bytes, which the shim
        // checks the rows' size (`h × w × 3`, or `h × scaled width × 3`
        // when wide) against before writing any, and it only writes
        // (never reads) them; `row_x`, `row_w` and `err` (ERR_LEN bytes)
        // are live locals written in bounds. libjpeg's errors are caught
        // in C.
        let rc = unsafe {
            braid_jpeg_decode(
                jpeg.as_ptr(),
                jpeg.len(),
                scale_denom,
                x,
                y,
                w,
                h,
                out.as_mut_ptr().cast::<u8>(),
                out.len(),
                wide as c_int,
                &mut row_x,
                &mut row_w,
                err.as_mut_ptr(),
                ERR_LEN,
            )
        };
        if rc != 0 {
            return Err(format!("cannot decode JPEG: {}", message(&err)));
        }
        Ok((row_x, row_w))
    }

    pub fn encode(rgb: &[u8], width: u32, height: u32, quality: u8) -> Result<Vec<u8>, String> {
        let mut ptr: *mut u8 = std::ptr::null_mut();
        let mut len = 0usize;
        let mut err = [0 as c_char; ERR_LEN];
        // SAFETY: the caller checked `rgb` holds height × width × 3 bytes,
        // all the shim reads; `ptr`, `len` and `err` are live locals. On
        // success the shim hands over a malloc'd buffer of `len` bytes.
        let rc = unsafe {
            braid_jpeg_encode(
                rgb.as_ptr(),
                width,
                height,
                c_int::from(quality),
                &mut ptr,
                &mut len,
                err.as_mut_ptr(),
                ERR_LEN,
            )
        };
        if rc != 0 {
            return Err(format!("cannot encode JPEG: {}", message(&err)));
        }
        // SAFETY: on success `ptr` is the shim's malloc'd buffer holding
        // `len` initialised bytes; it is copied, then freed once, by the
        // shim's free, and not used again.
        let bytes = unsafe {
            let v = std::slice::from_raw_parts(ptr, len).to_vec();
            braid_jpeg_free(ptr);
            v
        };
        Ok(bytes)
    }
}

#[cfg(braid_no_libjpeg)]
mod ffi {
    use std::mem::MaybeUninit;

    use super::JpegInfo;

    const OFF: &str = "braid was built without libjpeg-turbo, so it cannot read or write \
         JPEG images: install libjpeg-turbo's static library and headers (Debian: \
         `apt-get install libjpeg62-turbo-dev`; Ubuntu: `apt-get install libjpeg-turbo8-dev`) \
         or set BRAID_LIBJPEG_DIR to the folder holding libjpeg.a, then rebuild braid";

    pub fn info(_jpeg: &[u8]) -> Result<JpegInfo, String> {
        Err(OFF.to_string())
    }

    #[allow(clippy::too_many_arguments)]
    pub fn decode(
        _jpeg: &[u8],
        _scale_denom: u32,
        _x: u32,
        _y: u32,
        _w: u32,
        _h: u32,
        _out: &mut [MaybeUninit<u8>],
        _wide: bool,
    ) -> Result<(u32, u32), String> {
        Err(OFF.to_string())
    }

    pub fn encode(_rgb: &[u8], _width: u32, _height: u32, _quality: u8) -> Result<Vec<u8>, String> {
        Err(OFF.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scaled_sizes_round_up() {
        assert_eq!(scaled_size(400, 300, 1), (400, 300));
        assert_eq!(scaled_size(401, 299, 2), (201, 150));
        assert_eq!(scaled_size(17, 9, 8), (3, 2));
        assert_eq!(scaled_size(1, 1, 4), (1, 1));
    }

    #[test]
    fn bad_arguments_are_refused_before_libjpeg() {
        let e = decode_crop(&[], 3, 0, 0, 1, 1, &mut [0; 3]).unwrap_err();
        assert!(e.contains("1/3"), "{e}");
        let e = encode(&[0; 3], 1, 1, 0).unwrap_err();
        assert!(e.contains("quality 0"), "{e}");
        let e = encode(&[0; 2], 1, 1, 90).unwrap_err();
        assert!(e.contains("3 bytes; 2 given"), "{e}");
        let e = encode(&[], 0, 1, 90).unwrap_err();
        assert!(e.contains("0x1"), "{e}");
    }
}
