//! The root-cause report printed when a job fails.

use crate::rendezvous::Failure;
use std::fmt::Write;

/// Formats the failure report for attempt `attempt` (0-based).
pub fn failure_report(f: &Failure, attempt: u32, max_restarts: u32, restarting: bool) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "braid launch: the job failed (attempt {} of {})",
        attempt + 1,
        max_restarts + 1
    );
    match f.rank {
        Some(rank) => {
            let _ = write!(s, "  root cause: rank {rank}");
            let mut details = Vec::new();
            if let Some(lr) = f.local_rank {
                details.push(format!("local rank {lr}"));
            }
            details.push(format!("node {}", f.node_rank));
            details.push(format!("host {}", f.host));
            if let Some(pid) = f.pid {
                details.push(format!("pid {pid}"));
            }
            let _ = writeln!(s, " ({}) ended with {}", details.join(", "), f.how);
        }
        None => {
            let _ = writeln!(s, "  root cause: {}", f.how);
        }
    }
    if let Some(rank) = f.rank {
        if f.stderr_tail.is_empty() {
            let _ = writeln!(s, "  rank {rank} wrote nothing to stderr");
        } else {
            let _ = writeln!(
                s,
                "  last {} line(s) of rank {rank}'s stderr:",
                f.stderr_tail.len()
            );
            for line in &f.stderr_tail {
                let _ = writeln!(s, "    | {line}");
            }
        }
    }
    let _ = writeln!(s, "  all other workers were stopped");
    if restarting {
        let _ = writeln!(
            s,
            "  restarting the worker group (restart {} of {max_restarts})",
            attempt + 1
        );
    } else if f.restartable && max_restarts > 0 {
        let _ = writeln!(s, "  no restarts left (--max-restarts {max_restarts})");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn report_names_rank_signal_and_stderr() {
        let f = Failure {
            node_rank: 0,
            host: "h".into(),
            rank: Some(2),
            local_rank: Some(2),
            pid: Some(42),
            how: "signal SIGKILL".into(),
            exit_code: 137,
            stderr_tail: vec!["oops".into()],
            restartable: true,
        };
        let r = failure_report(&f, 0, 0, false);
        assert!(r.contains("root cause: rank 2 (local rank 2, node 0, host h, pid 42) ended with signal SIGKILL"), "{r}");
        assert!(r.contains("| oops"), "{r}");
        let r = failure_report(&f, 0, 2, true);
        assert!(r.contains("restart 1 of 2"), "{r}");
    }
}
