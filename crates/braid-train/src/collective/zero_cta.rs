//! The two settings behind copy-engine all-gathers, read in one place:
//! `BRAID_ZERO3_GATHER_VIA` (ZeRO-3's bf16 gathers through NCCL's kernels,
//! `nccl`, or its copy engines, `ce`) and NCCL's zero-CTA policy
//! (`NCCL_CTA_POLICY=2`), which NCCL reads when a communicator is made,
//! so the command that starts the workers gives it to them.

/// The variable and value of NCCL's zero-CTA policy.
pub const ZERO_CTA_POLICY: (&str, &str) = ("NCCL_CTA_POLICY", "2");

/// Whether `BRAID_ZERO3_GATHER_VIA`'s value (`None`: unset) asks for the
/// copy engines: `ce` yes; unset, empty or `nccl` no; anything else
/// refused with what is expected.
pub fn gathers_via_copy_engines(value: Option<&str>) -> Result<bool, String> {
    match value.map(str::trim) {
        None | Some("" | "nccl") => Ok(false),
        Some("ce") => Ok(true),
        Some(other) => Err(format!(
            "BRAID_ZERO3_GATHER_VIA={other:?}: expected nccl or ce"
        )),
    }
}

/// What workers need in their environment for the zero-CTA policy, given
/// `NCCL_CTA_POLICY`'s value here (`None`: unset): the policy where it is
/// unset, nothing where it is set (whether it is 2 is the caller's to
/// check).
pub fn zero_cta_policy_for_workers(policy: Option<&str>) -> Vec<(String, String)> {
    match policy {
        None => vec![(ZERO_CTA_POLICY.0.into(), ZERO_CTA_POLICY.1.into())],
        Some(_) => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gather_choice_and_the_policy_for_workers() {
        assert_eq!(gathers_via_copy_engines(None), Ok(false));
        assert_eq!(gathers_via_copy_engines(Some(" nccl")), Ok(false));
        assert_eq!(gathers_via_copy_engines(Some("ce")), Ok(true));
        let e = gathers_via_copy_engines(Some("kernels")).unwrap_err();
        assert!(e.contains("expected nccl or ce"), "{e}");
        assert_eq!(
            zero_cta_policy_for_workers(None),
            vec![("NCCL_CTA_POLICY".to_string(), "2".to_string())]
        );
        assert!(zero_cta_policy_for_workers(Some("1")).is_empty());
    }
}
