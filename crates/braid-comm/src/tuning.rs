//! Which algorithm runs a collective, chosen from a table by message size
//! and world size, overridable with `BRAID_ALGO`.

/// All-reduce algorithms of the point-to-point (tcp) backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Algo {
    /// Recursive doubling (log2 n rounds of whole-buffer exchanges): the
    /// latency-optimal choice for small messages. `BRAID_ALGO=tree` or `rd`.
    Tree,
    /// Pipelined ring reduce-scatter + all-gather: the bandwidth-optimal
    /// choice for large messages. `BRAID_ALGO=ring`.
    Ring,
}

impl Algo {
    /// Parses `ring`, `tree` or `rd`.
    pub fn parse(s: &str) -> Result<Algo, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "ring" => Ok(Algo::Ring),
            "tree" | "rd" | "recursive-doubling" => Ok(Algo::Tree),
            other => Err(format!(
                "unknown algorithm {other:?}: expected ring or tree"
            )),
        }
    }

    /// Name for reports.
    pub fn name(self) -> &'static str {
        match self {
            Algo::Tree => "tree",
            Algo::Ring => "ring",
        }
    }
}

/// One row of the table: up to `max_bytes` (inclusive) use `algo`.
struct Row {
    max_bytes: usize,
    algo: Algo,
}

/// The all-reduce table. A ring moves 2(n-1)/n of the data in 2(n-1)
/// steps; recursive doubling moves all of it log2(n) times in log2(n)
/// steps, so it wins while per-step latency dominates.
const ALL_REDUCE: &[Row] = &[
    Row {
        max_bytes: 64 << 10,
        algo: Algo::Tree,
    },
    Row {
        max_bytes: usize::MAX,
        algo: Algo::Ring,
    },
];

/// Picks the all-reduce algorithm for `bytes` bytes on `n` ranks, honouring
/// an override.
pub fn all_reduce_algo(bytes: usize, n: usize, forced: Option<Algo>) -> Algo {
    if let Some(a) = forced {
        return a;
    }
    if n <= 2 {
        // With two ranks both algorithms are one exchange each way; the
        // ring halves the bytes each rank reduces once messages are large.
        return if bytes <= 64 << 10 {
            Algo::Tree
        } else {
            Algo::Ring
        };
    }
    ALL_REDUCE
        .iter()
        .find(|r| bytes <= r.max_bytes)
        .map(|r| r.algo)
        .unwrap_or(Algo::Ring)
}

/// Reads `BRAID_ALGO`.
pub fn forced_from_env() -> Result<Option<Algo>, String> {
    match std::env::var(braid_core::env::BRAID_ALGO) {
        Ok(v) if !v.trim().is_empty() => Algo::parse(&v).map(Some),
        _ => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_goes_tree_large_goes_ring() {
        assert_eq!(all_reduce_algo(8, 4, None), Algo::Tree);
        assert_eq!(all_reduce_algo(64 << 20, 4, None), Algo::Ring);
        assert_eq!(all_reduce_algo(8, 4, Some(Algo::Ring)), Algo::Ring);
        assert!(Algo::parse("bogus").is_err());
    }
}
