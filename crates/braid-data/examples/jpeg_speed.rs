//! How fast braid decodes JPEGs on one thread: a 400×300 picture encoded
//! at quality 90, decoded whole 2000 times, then as a 1/2-scale window
//! (the centre 160×120 of the 200×150 scaled image) 2000 times.
//!
//!     cargo run --release -p braid-data --example jpeg_speed

use std::time::Instant;

use braid_data::jpeg::{decode, decode_crop, encode, scaled_size};

const N: u32 = 2000;

fn main() -> Result<(), String> {
    let (w, h) = (400u32, 300u32);
    let mut rgb = Vec::with_capacity((w * h * 3) as usize);
    for y in 0..h {
        for x in 0..w {
            let (fx, fy) = (x as f64, y as f64);
            rgb.push((128.0 + 100.0 * (fx / 23.0).sin() * (fy / 31.0).cos()) as u8);
            rgb.push((128.0 + 90.0 * ((fx + fy) / 40.0).cos()) as u8);
            rgb.push(((fx * 0.7 + fy * 0.4 + (fx * fy).sqrt() * 3.0) % 256.0) as u8);
        }
    }
    let jpeg = encode(&rgb, w, h, 90)?;
    println!("{w}x{h} RGB at quality 90: {} bytes of JPEG", jpeg.len());

    let mut checksum = 0u64;
    let t = Instant::now();
    for _ in 0..N {
        let (_, out) = decode(&jpeg)?;
        checksum += out[out.len() / 2] as u64;
    }
    let s = t.elapsed().as_secs_f64();
    println!(
        "full decode:           {:8.0} images/s ({:.3} ms each)",
        N as f64 / s,
        s * 1e3 / N as f64
    );

    let (sw, sh) = scaled_size(w, h, 2);
    let (cw, ch) = (sw * 4 / 5, sh * 4 / 5);
    let (cx, cy) = ((sw - cw) / 2, (sh - ch) / 2);
    let mut out = vec![0u8; (cw * ch * 3) as usize];
    let t = Instant::now();
    for _ in 0..N {
        decode_crop(&jpeg, 2, cx, cy, cw, ch, &mut out)?;
        checksum += out[out.len() / 2] as u64;
    }
    let s = t.elapsed().as_secs_f64();
    println!(
        "1/2 scale {cw}x{ch} crop: {:8.0} images/s ({:.3} ms each)",
        N as f64 / s,
        s * 1e3 / N as f64
    );
    println!("(checksum {checksum})");
    Ok(())
}
