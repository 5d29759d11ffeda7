//! The GPU decoder's switches read from the environment, one spelling for
//! all: a default-on path turns off with `0` or `off`, a default-off one
//! turns on with `1` or `on` (case aside); anything else leaves the
//! default. Counts are read here too, a bad one refused by name.

/// False where `name` is `0` or `off`, else true.
pub(super) fn on_unless_off(name: &str) -> bool {
    !std::env::var(name).is_ok_and(|v| v == "0" || v.eq_ignore_ascii_case("off"))
}

/// True where `name` is `1` or `on`, else false.
pub(super) fn switched_on(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| v == "1" || v.eq_ignore_ascii_case("on"))
}

/// `BRAID_DECODE_NT_BLOCKS`: blocks a multiprocessor for the NT products
/// (0 or unset: a block per group of outputs); anything but a small count
/// is refused, naming the variable.
pub(super) fn nt_blocks_from_env() -> braid_cuda::Result<usize> {
    let name = braid_core::env::BRAID_DECODE_NT_BLOCKS;
    match std::env::var(name) {
        Err(_) => Ok(0),
        Ok(v) => match v.trim().parse::<usize>() {
            Ok(n) if n <= 32 => Ok(n),
            _ => Err(braid_cuda::CudaError::Invalid(format!(
                "{name}={v}: give blocks a multiprocessor for the NT products, 0 to 32 \
                 (0: a block per group of outputs)"
            ))),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::{nt_blocks_from_env, on_unless_off, switched_on};

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

    /// `BRAID_DECODE_NT_BLOCKS`: a small count or unset; anything else
    /// refused with the variable named (the one test that sets it).
    #[test]
    fn the_nt_grid_cap_is_read_or_refused_by_name() {
        let name = braid_core::env::BRAID_DECODE_NT_BLOCKS;
        std::env::remove_var(name);
        assert_eq!(nt_blocks_from_env().unwrap(), 0);
        std::env::set_var(name, "2");
        assert_eq!(nt_blocks_from_env().unwrap(), 2);
        for bad in ["x", "64", "-1"] {
            std::env::set_var(name, bad);
            let e = nt_blocks_from_env().unwrap_err().to_string();
            assert!(e.contains(name) && e.contains(bad), "{e}");
        }
        std::env::remove_var(name);
    }
}
