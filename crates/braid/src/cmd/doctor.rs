//! `braid doctor LOGDIR`: what the flight records in a log directory say
//! about a failed or hung run: which rank is behind and where, ranks that
//! called different operations, ranks never heard from. The same
//! diagnosis the launcher prints after a failed attempt
//! (`braid_core::flight::diagnose_world`), from the files alone, for every
//! attempt of the directory's newest run (a restarted run keeps one record
//! per rank and attempt), oldest first.

use braid_core::flight::{self, Diagnosis, Liveness, Snapshot, SnapshotKind, WorldRank};
use clap::Args;
use std::path::{Path, PathBuf};

/// Diagnose a run from its flight records.
#[derive(Args)]
#[command(
    about = "Diagnose a failed or hung run from the flight records in its log directory",
    after_help = "Examples:\n  braid doctor /tmp/braid-<run id>      (the directory the launcher printed)\n  braid doctor logs --json\n\nRecords are written by every rank on a collective timeout or abort, and on SIGUSR1\n(kill -USR1 <pid> asks a running rank for one); after a failure the launcher adds the\nlast heartbeat of each rank that could not write its own (stopped, killed). Each rank\nand attempt has its own file, flight-rankNNNNN-attemptA.json (flight-rankNNNNN.json\nwithout braid launch, or from older braids); every attempt of the newest run in the\ndirectory is diagnosed, oldest first."
)]
pub struct DoctorArgs {
    /// The log directory (`braid launch --log-dir`, or the one the launcher printed).
    dir: PathBuf,
    /// The diagnosis as JSON.
    #[arg(long, value_name = "FILE", num_args = 0..=1, default_missing_value = "-",
          value_parser = super::json_out::parse, help = super::json_out::HELP)]
    json: Option<super::json_out::JsonOut>,
}

/// One attempt's records, one per rank, and their diagnosis.
struct AttemptRecords<'a> {
    /// The launcher's attempt (`BRAID_RESTART_COUNT`), if launched.
    attempt: Option<u32>,
    world_size: usize,
    /// Each rank's record (file and snapshot), if any.
    by_rank: Vec<Option<&'a (PathBuf, Snapshot)>>,
    diagnoses: Vec<Diagnosis>,
}

impl AttemptRecords<'_> {
    /// `attempt 2`.
    fn label(&self) -> String {
        match self.attempt {
            Some(n) => format!("attempt {}", u64::from(n) + 1),
            None => "records without an attempt (not started by braid launch)".into(),
        }
    }

    fn records(&self) -> impl Iterator<Item = &(PathBuf, Snapshot)> {
        self.by_rank.iter().flatten().copied()
    }
}

/// Groups the newest run's records by attempt, oldest first; a rank with
/// two records of one attempt (one named with the attempt, one without)
/// keeps the newer. Returns the attempts and the files left aside (other
/// runs', older duplicates).
fn by_attempt<'a>(
    snapshots: &'a [(PathBuf, Snapshot)],
    run_id: &str,
) -> (Vec<AttemptRecords<'a>>, Vec<&'a Path>) {
    let mut ignored: Vec<&Path> = Vec::new();
    let mut attempts: Vec<Option<u32>> = Vec::new();
    for (path, s) in snapshots {
        if s.run_id != run_id {
            ignored.push(path);
        } else if !attempts.contains(&s.attempt) {
            attempts.push(s.attempt);
        }
    }
    attempts.sort();
    let groups = attempts
        .into_iter()
        .map(|attempt| {
            let of_it: Vec<&(PathBuf, Snapshot)> = snapshots
                .iter()
                .filter(|(_, s)| s.run_id == run_id && s.attempt == attempt)
                .collect();
            let world_size = of_it
                .iter()
                .map(|(_, s)| s.world_size.max(s.rank + 1))
                .max()
                .unwrap_or(0);
            let mut by_rank: Vec<Option<&(PathBuf, Snapshot)>> = vec![None; world_size];
            for r in of_it {
                let slot = &mut by_rank[r.1.rank];
                match slot {
                    Some(kept) if kept.1.wall_us >= r.1.wall_us => ignored.push(&r.0),
                    Some(kept) => {
                        ignored.push(&kept.0);
                        *slot = Some(r);
                    }
                    None => *slot = Some(r),
                }
            }
            let ranks: Vec<WorldRank> = by_rank
                .iter()
                .map(|r| WorldRank {
                    snapshot: r.map(|(_, s)| s),
                    liveness: r
                        .and_then(|(_, s)| s.observed.clone())
                        .unwrap_or(Liveness::Unknown),
                })
                .collect();
            let diagnoses = flight::diagnose_world(&ranks);
            AttemptRecords {
                attempt,
                world_size,
                by_rank,
                diagnoses,
            }
        })
        .collect();
    (groups, ignored)
}

/// Runs `braid doctor`.
pub fn run(a: DoctorArgs) -> Result<i32, String> {
    if a.dir.is_file() {
        let parent = match a.dir.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        let name = a.dir.file_name().unwrap_or_default().to_string_lossy();
        return Err(format!(
            "{}: a file; braid doctor reads a log directory (the one `braid launch` printed, or \
             its --log-dir) and diagnoses every record in it{}",
            a.dir.display(),
            match name.starts_with("flight-") {
                true => format!(": try `braid doctor {}`", parent.display()),
                false => String::new(),
            }
        ));
    }
    if let Some(j) = &a.json {
        j.check()?;
    }
    let loaded = flight::load_dir(&a.dir)
        .map_err(|e| format!("cannot read the log directory {}: {e}", a.dir.display()))?;
    let Some(newest) = loaded
        .snapshots
        .iter()
        .map(|(_, s)| s)
        .max_by_key(|s| s.wall_us)
    else {
        let mut msg = format!(
            "no flight records (flight-rankNNNNN-attemptA.json, or flight-rankNNNNN.json) in {}: ranks that use braid's communicators write them on a collective timeout, an abort or SIGUSR1, into BRAID_LOG_DIR (braid launch sets it and prints it); other programs' ranks (a Python script's, say) keep none, and the launcher's failure report is what there is",
            a.dir.display()
        );
        for p in &loaded.problems {
            msg.push_str(&format!("\n  unreadable: {p}"));
        }
        return Err(msg);
    };
    // Every attempt of the newest run in the directory; other runs' records
    // are ignored.
    let run_id = newest.run_id.clone();
    let (attempts, ignored) = by_attempt(&loaded.snapshots, &run_id);
    let last = attempts.last().expect("the newest record's attempt");

    if let Some(out) = &a.json {
        let records = |g: &AttemptRecords| -> Vec<serde_json::Value> {
            g.records()
                .map(|(path, s)| {
                    serde_json::json!({
                        "rank": s.rank,
                        "file": path.display().to_string(),
                        "kind": s.kind,
                        "pid": s.pid,
                        "host": s.host,
                        "reason": s.reason,
                        "records": s.records.len(),
                    })
                })
                .collect()
        };
        let missing = |g: &AttemptRecords| -> Vec<usize> {
            (0..g.world_size)
                .filter(|r| g.by_rank[*r].is_none())
                .collect()
        };
        let per_attempt: Vec<serde_json::Value> = attempts
            .iter()
            .map(|g| {
                serde_json::json!({
                    "attempt": g.attempt,
                    "world_size": g.world_size,
                    "records": records(g),
                    "missing_ranks": missing(g),
                    "diagnoses": g.diagnoses,
                })
            })
            .collect();
        // The top level describes the newest attempt, as before there
        // were several; `attempts` has each, oldest first.
        let doc = serde_json::json!({
            "dir": a.dir.display().to_string(),
            "run_id": run_id,
            "attempt": last.attempt,
            "world_size": last.world_size,
            "records": records(last),
            "missing_ranks": missing(last),
            "ignored": ignored.iter().map(|p| p.display().to_string()).collect::<Vec<_>>(),
            "unreadable": loaded.problems,
            "diagnoses": last.diagnoses,
            "attempts": per_attempt,
        });
        out.write(&serde_json::to_string_pretty(&doc).map_err(|e| e.to_string())?)?;
        if out.is_stdout() {
            return Ok(0);
        }
    }

    println!(
        "braid doctor: {}: run {run_id}: {} attempt(s), oldest first",
        a.dir.display(),
        attempts.len()
    );
    for (i, g) in attempts.iter().enumerate() {
        let newest = if attempts.len() > 1 && i + 1 == attempts.len() {
            " (the newest)"
        } else {
            ""
        };
        println!(
            "{}{newest}: records of {} of {} rank(s)",
            g.label(),
            g.records().count(),
            g.world_size
        );
        for (_, s) in g.records() {
            let what = match s.kind {
                SnapshotKind::Dump => format!("{} operation(s) recorded", s.records.len()),
                SnapshotKind::Heartbeat => "its last heartbeat".to_string(),
            };
            let reason = s.reason.as_deref().unwrap_or("");
            let reason = if reason.chars().count() > 240 {
                format!("{}...", reason.chars().take(240).collect::<String>())
            } else {
                reason.to_string()
            };
            println!(
                "  rank {} (pid {} on {}): {what}; {reason}",
                s.rank, s.pid, s.host
            );
        }
        println!("diagnosis of {}:", g.label());
        let mut shown = 0;
        for d in g.diagnoses.iter().filter(|d| d.worth_showing()) {
            print!("{}", d.render("  ", 64));
            shown += 1;
        }
        if shown == 0 {
            println!("  no communicator shows a problem");
        }
    }
    if !ignored.is_empty() {
        println!(
            "({} record(s) of other runs, or older copies, ignored)",
            ignored.len()
        );
    }
    for p in &loaded.problems {
        println!("unreadable: {p}");
    }
    Ok(0)
}
