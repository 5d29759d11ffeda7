//! Words as braid prints them: counts (`1 step`, `2 steps`), sizes
//! (`1 KiB`, `2.5 MiB`) and long descriptions one clause a line.

/// `n` and `noun`, the noun in the plural unless `n` is 1 (`noun` + `s`,
/// or [`count_irregular`] for other plurals).
pub fn count(n: usize, noun: &str) -> String {
    match n {
        1 => format!("1 {noun}"),
        _ => format!("{n} {noun}s"),
    }
}

/// `n` and `one` or `many` (`1 process`, `2 processes`).
pub fn count_irregular(n: usize, one: &str, many: &str) -> String {
    match n {
        1 => format!("1 {one}"),
        _ => format!("{n} {many}"),
    }
}

/// `bytes` in the largest binary unit it fills at least once (B, KiB,
/// MiB, GiB, TiB), with one decimal where it is not whole: `512 B`,
/// `1 KiB`, `2.5 MiB`.
pub fn bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut unit = 0;
    while unit + 1 < UNITS.len() && bytes >= 1u64 << (10 * (unit + 1)) {
        unit += 1;
    }
    let whole = 1u64 << (10 * unit);
    match bytes % whole {
        0 => format!("{} {}", bytes / whole, UNITS[unit]),
        _ => format!("{:.1} {}", bytes as f64 / whole as f64, UNITS[unit]),
    }
}

/// `line` broken after each `; ` into lines of their own, the lines after
/// the first indented by `indent`: a long description as one clause a
/// line, each clause kept whole (so that a search for a phrase finds it).
pub fn clauses(line: &str, indent: &str) -> String {
    line.split("; ")
        .enumerate()
        .map(|(i, c)| match i {
            0 => c.to_string(),
            _ => format!("{indent}{c}"),
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_take_the_largest_unit_they_fill() {
        assert_eq!(bytes(0), "0 B");
        assert_eq!(bytes(512), "512 B");
        assert_eq!(bytes(1024), "1 KiB");
        assert_eq!(bytes(1536), "1.5 KiB");
        assert_eq!(bytes(64 << 20), "64 MiB");
        assert_eq!(bytes((5 << 30) / 2), "2.5 GiB");
    }

    #[test]
    fn one_is_singular_every_other_count_plural() {
        assert_eq!(count(1, "step"), "1 step");
        assert_eq!(count(0, "step"), "0 steps");
        assert_eq!(count(5, "thread"), "5 threads");
        assert_eq!(count_irregular(2, "process", "processes"), "2 processes");
    }

    #[test]
    fn clauses_go_one_to_a_line() {
        assert_eq!(
            clauses("strategy: one; two, three; four", "  "),
            "strategy: one\n  two, three\n  four"
        );
        assert_eq!(clauses("short", "  "), "short");
    }
}
