//! The GPU decoder's switches read from the environment, one spelling for
//! all: a default-on path turns off with `0` or `off`, a default-off one
//! turns on with `1` or `on` (case aside); anything else leaves the
//! default.

/// False where `name` is `0` or `off`, else true.
pub(super) fn on_unless_off(name: &str) -> bool {
    !std::env::var(name).is_ok_and(|v| v == "0" || v.eq_ignore_ascii_case("off"))
}

/// True where `name` is `1` or `on`, else false.
pub(super) fn switched_on(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| v == "1" || v.eq_ignore_ascii_case("on"))
}

#[cfg(test)]
mod tests {
    use super::{on_unless_off, switched_on};

    /// Both spellings, in a variable no other test reads.
    #[test]
    fn switches_read_zero_off_one_and_on() {
        let name = "BRAID_TEST_DECODE_SWITCH";
        std::env::remove_var(name);
        assert!(on_unless_off(name) && !switched_on(name));
        // (value, a default-on switch, a default-off one)
        for (v, default_on, default_off) in [
            ("0", false, false),
            ("OFF", false, false),
            ("1", true, true),
            ("yes", true, false),
        ] {
            std::env::set_var(name, v);
            assert_eq!(on_unless_off(name), default_on, "{v}");
            assert_eq!(switched_on(name), default_off, "{v}");
        }
        std::env::set_var(name, "On");
        assert!(on_unless_off(name) && switched_on(name));
        std::env::remove_var(name);
    }
}
