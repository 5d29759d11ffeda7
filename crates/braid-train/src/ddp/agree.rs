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

/// A checksum of `x`'s bits: FNV-1a over 32-bit words, per 1 Mi-element
/// chunk in parallel, chunks combined in order.
pub fn checksum(x: &[f32]) -> u64 {
    const PRIME: u64 = 0x0000_0100_0000_01B3;
    let chunks: Vec<u64> = x
        .par_chunks(1 << 20)
        .map(|c| {
            c.iter().fold(0xCBF2_9CE4_8422_2325u64, |h, v| {
                (h ^ v.to_bits() as u64).wrapping_mul(PRIME)
            })
        })
        .collect();
    chunks
        .iter()
        .fold(x.len() as u64, |h, c| (h ^ c).wrapping_mul(PRIME))
}

/// Checks that every rank's parameters `params` have rank 0's checksum;
/// the error names each rank that disagrees.
pub fn same_checksum(comm: &Communicator, params: &[f32], when: &str) -> Result<()> {
    let mine = [checksum(params) as i64];
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
    use super::checksum;

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
}
