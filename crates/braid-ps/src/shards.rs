//! Which server owns which elements of the flat parameter buffer: `n`
//! disjoint ranges, balanced (their lengths differ by at most one), in
//! server order — ps-lite's key ranges over braid's one flat buffer.

use std::ops::Range;

/// The servers' ranges of a flat buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shards {
    ranges: Vec<Range<usize>>,
}

impl Shards {
    /// `len` elements over `servers` servers, balanced. Refused where a
    /// server would hold nothing.
    pub fn balanced(len: usize, servers: usize) -> Result<Shards, String> {
        if servers == 0 {
            return Err("a parameter-server run needs at least one server (--ps N, N >= 1)".into());
        }
        if len < servers {
            return Err(format!(
                "{servers} servers for {len} parameters: every server must own at least one \
                 (fewer --ps servers)"
            ));
        }
        let (base, extra) = (len / servers, len % servers);
        let mut at = 0;
        let ranges = (0..servers)
            .map(|s| {
                let n = base + usize::from(s < extra);
                at += n;
                at - n..at
            })
            .collect();
        Ok(Shards { ranges })
    }

    /// Number of servers.
    pub fn len(&self) -> usize {
        self.ranges.len()
    }

    /// Whether there are none (never, once built).
    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }

    /// Server `s`'s range.
    pub fn range(&self, s: usize) -> Range<usize> {
        self.ranges[s].clone()
    }

    /// Every server's range, in order.
    pub fn ranges(&self) -> &[Range<usize>] {
        &self.ranges
    }

    /// The parts of `r` each server owns: `(server, part)` in order, the
    /// parts covering `r` exactly.
    pub fn split(&self, r: Range<usize>) -> Vec<(usize, Range<usize>)> {
        self.ranges
            .iter()
            .enumerate()
            .filter_map(|(s, own)| {
                let cut = own.start.max(r.start)..own.end.min(r.end);
                (!cut.is_empty()).then_some((s, cut))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_are_balanced_and_cover_the_buffer() {
        let s = Shards::balanced(10, 3).unwrap();
        assert_eq!(s.ranges(), &[0..4, 4..7, 7..10]);
        assert_eq!(s.split(3..8), vec![(0, 3..4), (1, 4..7), (2, 7..8)]);
        assert_eq!(s.split(4..7), vec![(1, 4..7)]);
        assert!(s.split(5..5).is_empty());
        assert!(Shards::balanced(2, 3).unwrap_err().contains("at least one"));
        assert!(Shards::balanced(2, 0).is_err());
    }
}
