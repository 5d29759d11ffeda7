//! SLURM support: the variables braid reads and the compressed host lists
//! (`gpu[01-04,07],login1`) that SLURM writes.

use crate::WorldInfoError;

/// Global task id of this process.
pub const PROCID_VAR: &str = "SLURM_PROCID";
/// Task id among the tasks of this node.
pub const LOCALID_VAR: &str = "SLURM_LOCALID";
/// Total number of tasks.
pub const NTASKS_VAR: &str = "SLURM_NTASKS";
/// Tasks per node, as SLURM writes them (`4`, or `4(x2),3`: the first
/// node's count is read).
pub const NTASKS_PER_NODE_VAR: &str = "SLURM_NTASKS_PER_NODE";
/// Number of nodes in the allocation.
pub const NNODES_VAR: &str = "SLURM_NNODES";
/// Index of this node in the allocation.
pub const NODEID_VAR: &str = "SLURM_NODEID";
/// Compressed list of the allocation's hosts (newer spelling).
pub const JOB_NODELIST_VAR: &str = "SLURM_JOB_NODELIST";
/// Compressed list of the allocation's hosts (older spelling).
pub const NODELIST_VAR: &str = "SLURM_NODELIST";
/// Job id, the default run id under SLURM.
pub const JOB_ID_VAR: &str = "SLURM_JOB_ID";

/// Expands a SLURM host list such as `gpu[01-04,07],cpu-[1-2]-x[a,b]` into
/// host names, in order. Zero padding of ranges is kept (`[08-10]` gives
/// `08 09 10`), and several bracket groups in one name multiply out.
pub fn expand_nodelist(list: &str) -> Result<Vec<String>, String> {
    let mut hosts = Vec::new();
    for item in split_top_level(list)? {
        if item.is_empty() {
            continue;
        }
        hosts.extend(expand_host(&item)?);
    }
    if hosts.is_empty() {
        return Err(format!("host list {list:?} names no host"));
    }
    Ok(hosts)
}

/// Splits on commas that are not inside brackets.
fn split_top_level(list: &str) -> Result<Vec<String>, String> {
    let mut items = Vec::new();
    let mut depth = 0usize;
    let mut current = String::new();
    for c in list.trim().chars() {
        match c {
            '[' => {
                depth += 1;
                if depth > 1 {
                    return Err(format!("nested '[' in host list {list:?}"));
                }
                current.push(c);
            }
            ']' => {
                depth = depth
                    .checked_sub(1)
                    .ok_or_else(|| format!("unmatched ']' in host list {list:?}"))?;
                current.push(c);
            }
            ',' if depth == 0 => items.push(std::mem::take(&mut current)),
            _ => current.push(c),
        }
    }
    if depth != 0 {
        return Err(format!("unclosed '[' in host list {list:?}"));
    }
    items.push(current);
    Ok(items.into_iter().map(|s| s.trim().to_string()).collect())
}

/// Expands one host pattern that may hold several bracket groups.
fn expand_host(pattern: &str) -> Result<Vec<String>, String> {
    let Some(open) = pattern.find('[') else {
        return Ok(vec![pattern.to_string()]);
    };
    let close = open
        + pattern[open..]
            .find(']')
            .ok_or_else(|| format!("unclosed '[' in {pattern:?}"))?;
    let prefix = &pattern[..open];
    let rest = expand_host(&pattern[close + 1..])?;
    let mut out = Vec::new();
    for part in pattern[open + 1..close].split(',') {
        let part = part.trim();
        let values: Vec<String> = match part.split_once('-') {
            Some((lo, hi)) => {
                let (a, b) = (parse_index(lo, pattern)?, parse_index(hi, pattern)?);
                if a > b {
                    return Err(format!("descending range {part:?} in {pattern:?}"));
                }
                if b - a > 1_000_000 {
                    return Err(format!(
                        "range {part:?} in {pattern:?} is implausibly large"
                    ));
                }
                let width = lo.len();
                (a..=b).map(|i| format!("{i:0width$}")).collect()
            }
            None => {
                parse_index(part, pattern)?;
                vec![part.to_string()]
            }
        };
        for v in values {
            for r in &rest {
                out.push(format!("{prefix}{v}{r}"));
            }
        }
    }
    Ok(out)
}

fn parse_index(s: &str, pattern: &str) -> Result<u64, String> {
    s.trim()
        .parse::<u64>()
        .map_err(|_| format!("{s:?} in {pattern:?} is not a number"))
}

/// The first host of the job's node list: the conventional master address.
pub fn master_from_env(
    get: &dyn Fn(&'static str) -> Option<String>,
) -> Result<String, WorldInfoError> {
    let (name, list) = match get(JOB_NODELIST_VAR) {
        Some(l) => (JOB_NODELIST_VAR, l),
        None => (
            NODELIST_VAR,
            get(NODELIST_VAR).ok_or(WorldInfoError::Missing { name: NODELIST_VAR })?,
        ),
    };
    let hosts = expand_nodelist(&list).map_err(|why| WorldInfoError::Invalid {
        name,
        value: list.clone(),
        why,
    })?;
    Ok(hosts[0].clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expands_ranges_lists_and_padding() {
        assert_eq!(
            expand_nodelist("gpu[01-04,07]").unwrap(),
            ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07"]
        );
        assert_eq!(expand_nodelist("n[8-10]").unwrap(), ["n8", "n9", "n10"]);
        assert_eq!(expand_nodelist("n[08-10]").unwrap(), ["n08", "n09", "n10"]);
    }

    #[test]
    fn expands_several_items_and_groups() {
        assert_eq!(
            expand_nodelist("login1,gpu[1-2],r[1-2]-n[3,5]").unwrap(),
            ["login1", "gpu1", "gpu2", "r1-n3", "r1-n5", "r2-n3", "r2-n5"]
        );
        assert_eq!(expand_nodelist("single").unwrap(), ["single"]);
    }

    #[test]
    fn rejects_malformed_lists() {
        for bad in ["gpu[01-04", "gpu]1", "gpu[4-1]", "gpu[a-b]", "", "x[[1]]"] {
            assert!(expand_nodelist(bad).is_err(), "{bad:?} should be rejected");
        }
    }
}
