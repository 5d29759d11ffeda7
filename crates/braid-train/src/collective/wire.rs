//! The bytes `n` ranks put on the wire for a ring collective: an
//! all-reduce ([`ring_wire_bytes`]), a reduce-scatter or an all-gather
//! ([`ring_half_wire_bytes`]).

/// What `n` ranks send for a reduce-scatter or an all-gather of `bytes`
/// by ring (`(n-1)/n`).
pub(crate) fn ring_half_wire_bytes(bytes: u64, n: usize) -> u64 {
    if n <= 1 {
        return 0;
    }
    bytes * (n as u64 - 1) / n as u64
}

/// What `n` ranks send for an all-reduce of `bytes` by ring (`2(n-1)/n`).
pub(crate) fn ring_wire_bytes(bytes: u64, n: usize) -> u64 {
    if n <= 1 {
        return 0;
    }
    bytes * 2 * (n as u64 - 1) / n as u64
}
