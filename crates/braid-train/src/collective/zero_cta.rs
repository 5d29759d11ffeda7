//! Where ZeRO-3's bf16 gathers run on GPUs, read in one place:
//! `BRAID_ZERO3_GATHER_VIA` is `auto` (the default: NCCL's copy engines
//! where every rank can have them, NCCL's kernels otherwise), `ce` (the
//! copy engines, or a refusal naming why not) or `nccl` (the kernels).
//! The copy engines need NCCL 2.28's symmetric windows, one host, and
//! NCCL's zero-CTA policy, which braid asks for on the gathers' own
//! communicator; `NCCL_CTA_POLICY`, where set, overrides what a program
//! asks for (NCCL's rule), so a value other than 2 is in the way.
//! Measured on 4 H200s with every freed window kept, the copy engines
//! are 2-6 % faster from 124M to 12.85B (BENCHMARKS.md).

/// The variable naming where ZeRO-3's gathers run.
pub const GATHER_VIA_VAR: &str = braid_core::env::BRAID_ZERO3_GATHER_VIA;

/// NCCL's variable for its CTA policy, and the zero-CTA policy's value.
pub const CTA_POLICY: (&str, &str) = (braid_core::env::NCCL_CTA_POLICY, "2");

/// `BRAID_ZERO3_GATHER_VIA`'s values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GatherVia {
    /// The copy engines where all ranks can have them, else the kernels.
    Auto,
    /// NCCL's kernels.
    Kernels,
    /// The copy engines, or a refusal.
    CopyEngines,
}

impl GatherVia {
    /// The choice `value` names (`None`: unset, which is `auto`), or what
    /// is expected.
    pub fn parse(value: Option<&str>) -> Result<GatherVia, String> {
        match value.map(str::trim) {
            None | Some("" | "auto") => Ok(GatherVia::Auto),
            Some("nccl") => Ok(GatherVia::Kernels),
            Some("ce") => Ok(GatherVia::CopyEngines),
            Some(other) => Err(format!(
                "{GATHER_VIA_VAR}={other:?}: expected auto, ce or nccl"
            )),
        }
    }

    /// The choice in this process's environment.
    pub fn from_env() -> Result<GatherVia, String> {
        GatherVia::parse(std::env::var(GATHER_VIA_VAR).ok().as_deref())
    }
}

/// Why `NCCL_CTA_POLICY`'s value (`None`: unset) keeps NCCL from the copy
/// engines, if it does: set to anything but the zero-CTA policy.
pub fn policy_in_the_way(policy: Option<&str>) -> Option<String> {
    match policy.map(str::trim) {
        None | Some("") => None,
        Some(p) if p == CTA_POLICY.1 => None,
        Some(p) => Some(format!(
            "{}={p:?} overrides the zero-CTA policy ({}={}) the gathers' communicator asks for",
            CTA_POLICY.0, CTA_POLICY.0, CTA_POLICY.1
        )),
    }
}

/// The refusal of `BRAID_ZERO3_GATHER_VIA=ce` under `NCCL_CTA_POLICY`'s
/// value (`None`: unset), if another policy is in its way.
pub fn copy_engines_refused(policy: Option<&str>) -> Option<String> {
    policy_in_the_way(policy).map(|why| {
        format!(
            "{GATHER_VIA_VAR}=ce: {why}; unset {} or use {GATHER_VIA_VAR}=nccl",
            CTA_POLICY.0
        )
    })
}

/// This process's `NCCL_CTA_POLICY`, where set.
pub fn policy_from_env() -> Option<String> {
    std::env::var(CTA_POLICY.0).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gather_choice_and_the_policy_in_the_way() {
        assert_eq!(GatherVia::parse(None), Ok(GatherVia::Auto));
        assert_eq!(GatherVia::parse(Some("auto")), Ok(GatherVia::Auto));
        assert_eq!(GatherVia::parse(Some(" nccl")), Ok(GatherVia::Kernels));
        assert_eq!(GatherVia::parse(Some("ce")), Ok(GatherVia::CopyEngines));
        let e = GatherVia::parse(Some("kernels")).unwrap_err();
        assert!(e.contains("expected auto, ce or nccl"), "{e}");
        assert_eq!(policy_in_the_way(None), None);
        assert_eq!(policy_in_the_way(Some("2")), None);
        let e = policy_in_the_way(Some("1")).unwrap();
        assert!(
            e.contains("NCCL_CTA_POLICY=\"1\"") && e.contains("=2"),
            "{e}"
        );
        assert_eq!(copy_engines_refused(Some("2")), None);
        let e = copy_engines_refused(Some("1")).unwrap();
        assert!(e.contains("unset NCCL_CTA_POLICY or use"), "{e}");
    }
}
