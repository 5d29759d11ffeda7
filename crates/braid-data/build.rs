//! Builds braid-data's JPEG shim (`csrc/jpeg_shim.c`) and links
//! libjpeg-turbo into it statically, so a braid binary decodes JPEGs the
//! same way on every machine it is copied to, whatever libjpeg (if any)
//! that machine has.
//!
//! libjpeg-turbo's `jpeglib.h` and `libjpeg.a` are looked for in
//! `$BRAID_LIBJPEG_DIR` (the folder holding `libjpeg.a`; its headers in
//! `../include` or `../../include` beside it, or the system's), then in
//! the usual system folders. Without them the crate still builds, with
//! the cfg `braid_no_libjpeg`: `braid_data::jpeg` then answers every call
//! with an error that says how to get JPEG support.

use std::env;
use std::path::{Path, PathBuf};

const INSTALL: &str = "install libjpeg-turbo's static library and headers (Debian: \
     `apt-get install libjpeg62-turbo-dev`; Ubuntu: `apt-get install libjpeg-turbo8-dev`) \
     or set BRAID_LIBJPEG_DIR to the folder holding libjpeg.a, then rebuild";

fn main() {
    println!("cargo::rustc-check-cfg=cfg(braid_no_libjpeg)");
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=csrc/jpeg_shim.c");
    println!("cargo:rerun-if-env-changed=BRAID_LIBJPEG_DIR");

    match find_libjpeg() {
        Ok((lib_dir, include_dir)) => {
            println!(
                "cargo:rerun-if-changed={}",
                lib_dir.join("libjpeg.a").display()
            );
            let mut build = cc::Build::new();
            build.file("csrc/jpeg_shim.c").warnings(true).opt_level(2);
            if let Some(dir) = include_dir {
                build.include(dir);
            }
            build.compile("braid_jpeg_shim");
            // After the shim, which needs its symbols.
            println!("cargo:rustc-link-search=native={}", lib_dir.display());
            println!("cargo:rustc-link-lib=static=jpeg");
        }
        Err(why) => {
            println!(
                "cargo:warning=braid-data: JPEG support is off: {why}; to turn it on, {INSTALL}"
            );
            println!("cargo:rustc-cfg=braid_no_libjpeg");
        }
    }
}

/// The folder holding `libjpeg.a`, and the folder holding `jpeglib.h`
/// where the C compiler would not find it by itself.
fn find_libjpeg() -> Result<(PathBuf, Option<PathBuf>), String> {
    let arch = env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_default();
    let (lib_dir, extra_includes): (PathBuf, Vec<PathBuf>) = match env::var_os("BRAID_LIBJPEG_DIR")
    {
        Some(dir) => {
            let dir = PathBuf::from(dir);
            if !dir.join("libjpeg.a").is_file() {
                return Err(format!(
                    "BRAID_LIBJPEG_DIR={} holds no libjpeg.a",
                    dir.display()
                ));
            }
            let includes = [dir.join("../include"), dir.join("../../include")]
                .into_iter()
                .filter(|d| d.join("jpeglib.h").is_file())
                .collect();
            (dir, includes)
        }
        None => {
            let candidates = [
                PathBuf::from(format!("/usr/lib/{arch}-linux-gnu")),
                PathBuf::from("/usr/lib64"),
                PathBuf::from("/usr/lib"),
                PathBuf::from("/usr/local/lib"),
            ];
            let dir = candidates
                .iter()
                .find(|d| d.join("libjpeg.a").is_file())
                .ok_or_else(|| {
                    format!(
                        "no libjpeg.a in {}",
                        candidates
                            .iter()
                            .map(|d| d.display().to_string())
                            .collect::<Vec<_>>()
                            .join(", ")
                    )
                })?
                .clone();
            let includes = if dir.starts_with("/usr/local") {
                vec![PathBuf::from("/usr/local/include")]
            } else {
                vec![]
            };
            (dir, includes)
        }
    };
    // The header: in an extra folder found above, else where the C
    // compiler looks by default (which includes /usr/include).
    let header = extra_includes
        .iter()
        .chain([&PathBuf::from("/usr/include")])
        .map(|d| d.join("jpeglib.h"))
        .find(|h| h.is_file())
        .ok_or_else(|| "no jpeglib.h beside libjpeg.a nor in /usr/include".to_string())?;
    check_turbo(&header)?;
    println!("cargo:rerun-if-changed={}", header.display());
    let include_dir = extra_includes
        .into_iter()
        .find(|d| d.join("jpeglib.h").is_file());
    Ok((lib_dir, include_dir))
}

/// The shim uses libjpeg-turbo's partial decoding (`jpeg_crop_scanline`,
/// `jpeg_skip_scanlines`, 1.5 and later), which IJG's libjpeg lacks.
fn check_turbo(header: &Path) -> Result<(), String> {
    let text = std::fs::read_to_string(header)
        .map_err(|e| format!("cannot read {}: {e}", header.display()))?;
    if text.contains("jpeg_crop_scanline") && text.contains("jpeg_skip_scanlines") {
        Ok(())
    } else {
        Err(format!(
            "{} is not libjpeg-turbo 1.5 or later (no jpeg_crop_scanline)",
            header.display()
        ))
    }
}
