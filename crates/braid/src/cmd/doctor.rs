//! `braid doctor LOGDIR`: what the flight records in a log directory say
//! about a failed or hung run: which rank is behind and where, ranks that
//! called different operations, ranks never heard from. The same
//! diagnosis the launcher prints after a failed attempt
//! (`braid_core::flight::diagnose_world`), from the files alone.

use braid_core::flight::{self, Liveness, Snapshot, SnapshotKind, WorldRank};
use clap::Args;
use std::path::PathBuf;

/// Diagnose a run from its flight records.
#[derive(Args)]
#[command(
    about = "Diagnose a failed or hung run from the flight records in its log directory",
    after_help = "Examples:\n  braid doctor /tmp/braid-<run id>      (the directory the launcher printed)\n  braid doctor logs --json\n\nRecords are written by every rank on a collective timeout or abort, and on SIGUSR1\n(kill -USR1 <pid> asks a running rank for one); after a failure the launcher adds the\nlast heartbeat of each rank that could not write its own (stopped, killed)."
)]
pub struct DoctorArgs {
    /// The log directory (`braid launch --log-dir`, or the one the launcher printed).
    dir: PathBuf,
    /// The diagnosis as JSON.
    #[arg(long, value_name = "FILE", num_args = 0..=1, default_missing_value = "-",
          value_parser = super::json_out::parse, help = super::json_out::HELP)]
    json: Option<super::json_out::JsonOut>,
}

/// Runs `braid doctor`.
pub fn run(a: DoctorArgs) -> Result<i32, String> {
    let loaded = flight::load_dir(&a.dir)
        .map_err(|e| format!("cannot read the log directory {}: {e}", a.dir.display()))?;
    let Some(newest) = loaded
        .snapshots
        .iter()
        .map(|(_, s)| s)
        .max_by_key(|s| s.wall_us)
    else {
        let mut msg = format!(
            "no flight records (flight-rank*.json) in {}: ranks write them on a collective timeout, an abort or SIGUSR1, into BRAID_LOG_DIR (braid launch sets it and prints it)",
            a.dir.display()
        );
        for p in &loaded.problems {
            msg.push_str(&format!("\n  unreadable: {p}"));
        }
        return Err(msg);
    };
    // The newest run and attempt in the directory; older ones are ignored.
    let (run_id, attempt) = (newest.run_id.clone(), newest.attempt);
    let (chosen, ignored): (Vec<_>, Vec<_>) = loaded
        .snapshots
        .iter()
        .partition(|(_, s)| s.run_id == run_id && s.attempt == attempt);
    let world_size = chosen
        .iter()
        .map(|(_, s)| s.world_size.max(s.rank + 1))
        .max()
        .unwrap_or(0);
    let mut by_rank: Vec<Option<&Snapshot>> = vec![None; world_size];
    for (_, s) in &chosen {
        by_rank[s.rank] = Some(s);
    }
    let ranks: Vec<WorldRank> = by_rank
        .iter()
        .map(|s| WorldRank {
            snapshot: *s,
            liveness: s
                .and_then(|s| s.observed.clone())
                .unwrap_or(Liveness::Unknown),
        })
        .collect();
    let diagnoses = flight::diagnose_world(&ranks);

    if let Some(out) = &a.json {
        let records: Vec<serde_json::Value> = chosen
            .iter()
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
            .collect();
        let doc = serde_json::json!({
            "dir": a.dir.display().to_string(),
            "run_id": run_id,
            "attempt": attempt,
            "world_size": world_size,
            "records": records,
            "missing_ranks": (0..world_size).filter(|r| by_rank[*r].is_none()).collect::<Vec<_>>(),
            "ignored": ignored.iter().map(|(p, _)| p.display().to_string()).collect::<Vec<_>>(),
            "unreadable": loaded.problems,
            "diagnoses": diagnoses,
        });
        out.write(&serde_json::to_string_pretty(&doc).map_err(|e| e.to_string())?)?;
        if out.is_stdout() {
            return Ok(0);
        }
    }

    let attempt_text = attempt
        .map(|n| format!(", attempt {}", n + 1))
        .unwrap_or_default();
    println!(
        "braid doctor: {}: run {run_id}{attempt_text}: records of {} of {world_size} rank(s)",
        a.dir.display(),
        chosen.len()
    );
    for (_, s) in &chosen {
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
    if !ignored.is_empty() {
        println!(
            "  ({} record(s) of other runs or attempts ignored)",
            ignored.len()
        );
    }
    for p in &loaded.problems {
        println!("  unreadable: {p}");
    }
    println!("diagnosis:");
    let mut shown = 0;
    for d in diagnoses.iter().filter(|d| d.worth_showing()) {
        print!("{}", d.render("  ", 64));
        shown += 1;
    }
    if shown == 0 {
        println!("  no communicator shows a problem");
    }
    Ok(0)
}
