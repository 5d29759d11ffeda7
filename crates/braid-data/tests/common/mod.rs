//! The ffcv fixtures of `crates/braid-data/tests/fixtures/ffcv/`, for the
//! tests of braid-data and of the `braid` binary (which includes this
//! file by path). The `.beton` files are kept gzipped (`NAME.beton.gz`:
//! their 38 MB of mostly repeated bytes take 1 MB, which keeps the tree
//! small enough to send to the device machines whole); a test reads each
//! unpacked into the target directory's scratch, once per version.
#![allow(dead_code)]

use std::io::Read;
use std::path::{Path, PathBuf};

/// The fixture `name` (`images.beton`, `images.expected.json`, …): a
/// `.beton` unpacked from its `.gz`, anything else where it lies.
pub fn ffcv_fixture(name: &str) -> PathBuf {
    // (From either crate's manifest directory.)
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../braid-data/tests/fixtures/ffcv");
    if !name.ends_with(".beton") {
        return dir.join(name);
    }
    let gz = dir.join(format!("{name}.gz"));
    let packed = std::fs::read(&gz).unwrap_or_else(|e| panic!("{}: {e}", gz.display()));
    // gzip's trailer (the CRC-32 and length of the unpacked bytes) names
    // this version of the file.
    let trailer: [u8; 8] = packed[packed.len().saturating_sub(8)..]
        .try_into()
        .unwrap_or_else(|_| panic!("{}: shorter than a gzip trailer", gz.display()));
    let version = u64::from_le_bytes(trailer);
    let out_dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("ffcv-fixtures");
    let stem = name.trim_end_matches(".beton");
    let out = out_dir.join(format!("{stem}-{version:016x}.beton"));
    if out.exists() {
        return out;
    }
    std::fs::create_dir_all(&out_dir).unwrap();
    let mut raw = Vec::new();
    flate2::read::GzDecoder::new(&packed[..])
        .read_to_end(&mut raw)
        .unwrap_or_else(|e| panic!("{}: {e}", gz.display()));
    // Written aside, then renamed: tests running at once each see a whole
    // file.
    let tmp = out_dir.join(format!(
        "{stem}-{version:016x}.{}-{:?}.part",
        std::process::id(),
        std::thread::current().id()
    ));
    std::fs::write(&tmp, &raw).unwrap();
    std::fs::rename(&tmp, &out).unwrap();
    out
}
