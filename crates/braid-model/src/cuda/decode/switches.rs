//! The GPU decoder's switches read from the environment, one spelling for
//! all: a default-on path turns off with `0` or `off`, a default-off one
//! turns on with `1` or `on` (case aside); anything else leaves the
//! default. Counts are read here too, a bad one refused by name.

use crate::cuda::mixed::{NtPrefetch, NtStart};

/// False where `name` is `0` or `off`, else true.
pub(super) fn on_unless_off(name: &str) -> bool {
    !std::env::var(name).is_ok_and(|v| v == "0" || v.eq_ignore_ascii_case("off"))
}

/// True where `name` is `1` or `on`, else false.
pub(super) fn switched_on(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| v == "1" || v.eq_ignore_ascii_case("on"))
}

/// A path on by default where it was measured faster: true where `name` is
/// `1` or `on`, false where it is `0` or `off`, else `measured_faster`.
pub(super) fn on_where_faster(name: &str, measured_faster: bool) -> bool {
    match std::env::var(name) {
        Ok(v) if v == "1" || v.eq_ignore_ascii_case("on") => true,
        Ok(v) if v == "0" || v.eq_ignore_ascii_case("off") => false,
        _ => measured_faster,
    }
}

/// Whether `device` is a Hopper or later (compute capability 9 and up):
/// where the NT products and the overlapped launches were measured faster
/// than cuBLASLt and plain launches (H100, 2026-12-07, BENCHMARKS.md), so
/// `BRAID_DECODE_NT` and `BRAID_DECODE_OVERLAP` are on by default.
pub(super) fn hopper_or_later(device: &braid_cuda::Device) -> bool {
    device
        .compute_capability()
        .is_ok_and(|(major, _)| major >= 9)
}

/// `BRAID_DECODE_NT_BLOCKS`: blocks a multiprocessor for the NT products
/// (0 or unset: a block per group of outputs); anything but a small count
/// is refused, naming the variable.
pub(super) fn nt_blocks_from_env() -> braid_cuda::Result<usize> {
    blocks_from_env(braid_core::env::BRAID_DECODE_NT_BLOCKS, 0)
}

/// `BRAID_DECODE_NT_LN_BLOCKS`: blocks a multiprocessor for the NT
/// products that normalise their rows themselves (unset: 2; 0: a block
/// per group of outputs), checked as [`nt_blocks_from_env`].
pub(super) fn nt_ln_blocks_from_env() -> braid_cuda::Result<usize> {
    blocks_from_env(braid_core::env::BRAID_DECODE_NT_LN_BLOCKS, 2)
}

/// Blocks a multiprocessor from `name` (`unset` where it is not set), 0
/// to 32; anything else refused, naming the variable.
fn blocks_from_env(name: &str, unset: usize) -> braid_cuda::Result<usize> {
    match std::env::var(name) {
        Err(_) => Ok(unset),
        Ok(v) => match v.trim().parse::<usize>() {
            Ok(n) if n <= 32 => Ok(n),
            _ => Err(braid_cuda::CudaError::Invalid(format!(
                "{name}={v}: give blocks a multiprocessor for the NT products, 0 to 32 \
                 (0: a block per group of outputs)"
            ))),
        },
    }
}

/// `BRAID_DECODE_NT_START`: how the NT products start, words separated by
/// commas or `+` — `first` or `after` (the kernel behind released before or
/// after the wait for the one ahead), `lines`, `bulk` or `none` (how the
/// weights are asked for into L2 meanwhile), from `after,lines`; unset
/// (`None`), each product's by its weights' size
/// ([`NtStart::for_weights`]). An unknown word is refused, naming the
/// variable.
pub(super) fn nt_start_from_env() -> braid_cuda::Result<Option<NtStart>> {
    let name = braid_core::env::BRAID_DECODE_NT_START;
    let Ok(v) = std::env::var(name) else {
        return Ok(None);
    };
    let mut start = NtStart::default();
    for word in v.split([',', '+']).map(str::trim).filter(|w| !w.is_empty()) {
        match word.to_ascii_lowercase().as_str() {
            "first" => start.release_first = true,
            "after" => start.release_first = false,
            "lines" => start.prefetch = NtPrefetch::Lines,
            "bulk" => start.prefetch = NtPrefetch::Bulk,
            "none" => start.prefetch = NtPrefetch::None,
            _ => {
                return Err(braid_cuda::CudaError::Invalid(format!(
                    "{name}={v}: `{word}` is not a way to start; give words from \
                     first|after and lines|bulk|none, separated by commas or +"
                )))
            }
        }
    }
    Ok(Some(start))
}

#[cfg(test)]
mod tests {
    use super::{
        nt_blocks_from_env, nt_start_from_env, on_unless_off, on_where_faster, switched_on,
    };
    use crate::cuda::mixed::{NtPrefetch, NtStart};

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

    /// A switch on where measured faster: its default unset or unreadable,
    /// else as spelled (a variable no other test reads).
    #[test]
    fn a_switch_on_where_faster_keeps_its_default_unless_spelled() {
        let name = "BRAID_TEST_DECODE_SWITCH_WHERE_FASTER";
        std::env::remove_var(name);
        assert!(on_where_faster(name, true) && !on_where_faster(name, false));
        for (v, on) in [("0", false), ("Off", false), ("1", true), ("ON", true)] {
            std::env::set_var(name, v);
            assert_eq!(on_where_faster(name, true), on, "{v}");
            assert_eq!(on_where_faster(name, false), on, "{v}");
        }
        std::env::set_var(name, "maybe");
        assert!(on_where_faster(name, true) && !on_where_faster(name, false));
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

    /// `BRAID_DECODE_NT_START`: the default unset, words read in any
    /// order, an unknown one refused by name (the one test that sets it).
    #[test]
    fn the_nt_start_is_read_or_refused_by_name() {
        let name = braid_core::env::BRAID_DECODE_NT_START;
        std::env::remove_var(name);
        assert_eq!(nt_start_from_env().unwrap(), None);
        std::env::set_var(name, "bulk+ First");
        let want = NtStart {
            release_first: true,
            prefetch: NtPrefetch::Bulk,
        };
        assert_eq!(nt_start_from_env().unwrap(), Some(want));
        std::env::set_var(name, "none");
        let after_none = NtStart {
            release_first: false,
            prefetch: NtPrefetch::None,
        };
        assert_eq!(nt_start_from_env().unwrap(), Some(after_none));
        std::env::set_var(name, "first,sideways");
        let e = nt_start_from_env().unwrap_err().to_string();
        assert!(e.contains(name) && e.contains("sideways"), "{e}");
        std::env::remove_var(name);
    }
}
