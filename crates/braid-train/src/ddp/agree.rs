//! Start-of-run agreement between data-parallel ranks: the same engine
//! description everywhere, and after rank 0's parameters are broadcast,
//! the same parameters everywhere (a cheap checksum). Every check is one
//! small all-gather on the host communicator, so a disagreeing rank is
//! named instead of hanging the first collective of a wrong size.

use crate::Result;
use braid_comm::Communicator;
use rayon::prelude::*;

/// Longest description compared (longer ones are cut).
const DESCRIPTION_BYTES: usize = 512;

/// Checks that every rank's `description` equals rank 0's; the error
/// names each rank that differs and both descriptions.
pub fn same_description(comm: &Communicator, description: &str) -> Result<()> {
    let mut mine = [0u8; DESCRIPTION_BYTES];
    let bytes = description.as_bytes();
    let n = bytes.len().min(DESCRIPTION_BYTES);
    mine[..n].copy_from_slice(&bytes[..n]);
    let mut all = vec![0u8; DESCRIPTION_BYTES * comm.size()];
    comm.all_gather(&mine, &mut all)
        .map_err(|e| format!("comparing configurations across ranks: {e}"))?;
    let text = |r: usize| {
        let b = &all[r * DESCRIPTION_BYTES..(r + 1) * DESCRIPTION_BYTES];
        let end = b.iter().position(|&x| x == 0).unwrap_or(b.len());
        String::from_utf8_lossy(&b[..end]).into_owned()
    };
    let first = text(0);
    let differ: Vec<String> = (1..comm.size())
        .filter(|&r| text(r) != first)
        .map(|r| format!("rank {r} has {:?}", text(r)))
        .collect();
    if differ.is_empty() {
        return Ok(());
    }
    Err(format!(
        "rank {}: the ranks' model configurations differ: rank 0 has {first:?}; {} \
         (start every rank with the same model and batch options)",
        comm.rank(),
        differ.join("; ")
    ))
}

/// FNV-1a's prime.
const PRIME: u64 = 0x0000_0100_0000_01B3;

/// Elements per hashed chunk of [`checksum`].
const CHUNK: usize = 1 << 20;

/// Chunks of [`CHUNK`] elements read at once by [`checksum_in_pieces`]:
/// 256 MiB of host memory, however large the model.
const PIECE_CHUNKS: usize = 64;

/// FNV-1a over the 32-bit words of one chunk.
fn chunk_hash(c: &[f32]) -> u64 {
    c.iter().fold(0xCBF2_9CE4_8422_2325u64, |h, v| {
        (h ^ v.to_bits() as u64).wrapping_mul(PRIME)
    })
}

/// A checksum of `x`'s bits: FNV-1a over 32-bit words, per 1 Mi-element
/// chunk in parallel, chunks combined in order (after the length).
pub fn checksum(x: &[f32]) -> u64 {
    let chunks: Vec<u64> = x.par_chunks(CHUNK).map(chunk_hash).collect();
    chunks
        .iter()
        .fold(x.len() as u64, |h, c| (h ^ c).wrapping_mul(PRIME))
}

/// Copies elements `range` of a buffer into `out` (host memory).
pub type ReadPiece<'a> = dyn FnMut(std::ops::Range<usize>, &mut [f32]) -> Result<()> + 'a;

/// [`checksum`] of `len` elements that `read(range, out)` copies into host
/// memory a piece at a time (a device buffer of billions of parameters
/// needs no whole host copy to be compared).
pub fn checksum_in_pieces(len: usize, read: &mut ReadPiece<'_>) -> Result<u64> {
    let piece = CHUNK * PIECE_CHUNKS;
    let mut buf = vec![0f32; piece.min(len)];
    let mut h = len as u64;
    let mut at = 0;
    while at < len {
        let end = (at + piece).min(len);
        let out = &mut buf[..end - at];
        read(at..end, out)?;
        let chunks: Vec<u64> = out.par_chunks(CHUNK).map(chunk_hash).collect();
        h = chunks.iter().fold(h, |h, c| (h ^ c).wrapping_mul(PRIME));
        at = end;
    }
    Ok(h)
}

/// Checks that every rank's parameters, whose checksum here is `sum`
/// ([`checksum`]), have rank 0's; the error names each rank that
/// disagrees.
pub fn same_checksum(comm: &Communicator, sum: u64, when: &str) -> Result<()> {
    let mine = [sum as i64];
    let mut all = vec![0i64; comm.size()];
    comm.all_gather(&mine, &mut all)
        .map_err(|e| format!("comparing parameter checksums across ranks: {e}"))?;
    let bad: Vec<String> = (1..all.len())
        .filter(|&r| all[r] != all[0])
        .map(|r| r.to_string())
        .collect();
    if bad.is_empty() {
        return Ok(());
    }
    Err(format!(
        "rank {}: {when}, the parameters of rank(s) {} differ from rank 0's \
         (checksum {:#018x} on rank 0, {} elsewhere)",
        comm.rank(),
        bad.join(", "),
        all[0],
        bad.iter()
            .map(|r| format!(
                "{:#018x} on rank {r}",
                all[r.parse::<usize>().expect("ours")]
            ))
            .collect::<Vec<_>>()
            .join(", ")
    ))
}

#[cfg(test)]
mod tests {
    use super::{checksum, checksum_in_pieces, CHUNK, PIECE_CHUNKS};

    #[test]
    fn checksums_see_every_bit_and_the_length() {
        let a: Vec<f32> = (0..3_000_000).map(|i| i as f32 * 0.5).collect();
        let mut b = a.clone();
        assert_eq!(checksum(&a), checksum(&b));
        b[2_500_000] = f32::from_bits(b[2_500_000].to_bits() ^ 1);
        assert_ne!(checksum(&a), checksum(&b));
        assert_ne!(checksum(&a[..10]), checksum(&a[..11]));
        assert_ne!(checksum(&[0.0]), checksum(&[-0.0]));
    }

    #[test]
    fn a_checksum_read_in_pieces_is_the_whole_buffers() {
        // Two whole pieces and a ragged third (chunks cut at its end).
        let len = 2 * CHUNK * PIECE_CHUNKS + 3 * CHUNK + 17;
        let x: Vec<f32> = (0..len).map(|i| (i % 1009) as f32 - 0.25).collect();
        let mut reads = 0;
        let sum = checksum_in_pieces(len, &mut |r, out| {
            reads += 1;
            out.copy_from_slice(&x[r]);
            Ok(())
        })
        .unwrap();
        assert_eq!(sum, checksum(&x));
        assert_eq!(reads, 3);
        assert_eq!(
            checksum_in_pieces(0, &mut |_, _| Ok(())).unwrap(),
            checksum(&[])
        );
        let failed = checksum_in_pieces(5, &mut |_, _| Err("device gone".into()));
        assert_eq!(failed.unwrap_err(), "device gone");
    }
}
