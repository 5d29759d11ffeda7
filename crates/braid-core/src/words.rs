//! Words as braid prints them: counts (`1 step`, `2 steps`) and long
//! lines wrapped for a terminal.

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

/// The columns braid's long descriptive lines are wrapped to.
pub const WIDTH: usize = 100;

/// `line` wrapped at spaces to lines of at most `width` characters (a
/// word longer than that stands alone), the lines after the first
/// indented by `indent`.
pub fn wrap(line: &str, width: usize, indent: &str) -> String {
    let mut out = String::new();
    let mut current = String::new();
    for word in line.split(' ').filter(|w| !w.is_empty()) {
        let len = current.chars().count();
        if len > 0 && len + 1 + word.chars().count() > width {
            out.push_str(&current);
            out.push('\n');
            current = indent.to_string();
        } else if len > 0 && current != indent {
            current.push(' ');
        }
        current.push_str(word);
    }
    out.push_str(&current);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_is_singular_every_other_count_plural() {
        assert_eq!(count(1, "step"), "1 step");
        assert_eq!(count(0, "step"), "0 steps");
        assert_eq!(count(5, "thread"), "5 threads");
        assert_eq!(count_irregular(2, "process", "processes"), "2 processes");
    }

    #[test]
    fn long_lines_wrap_at_spaces_with_an_indent() {
        let w = wrap("strategy: one two three four five", 14, "  ");
        assert_eq!(w, "strategy: one\n  two three\n  four five");
        assert!(w.lines().all(|l| l.chars().count() <= 14), "{w}");
        assert_eq!(wrap("short", 100, "  "), "short");
        assert_eq!(
            wrap("a verylongwordhere b", 6, " "),
            "a\n verylongwordhere\n b"
        );
    }
}
