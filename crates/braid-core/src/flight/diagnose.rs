//! The diagnosis: several ranks' records of one communicator (and of a
//! world of them) turned into who is behind and where, which operations
//! disagree, and which ranks never arrived.

use super::*;
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

/// One rank of a communicator, as the diagnosis sees it.
#[derive(Debug, Clone)]
pub struct RankInput {
    /// Rank in the communicator.
    pub rank: usize,
    /// Its world rank, when known.
    pub world_rank: Option<usize>,
    /// Whether its position is known (it published a heartbeat or left a
    /// dump), even if `records` is empty (no operation yet).
    pub known: bool,
    /// Its records of this communicator (any order, duplicates allowed).
    pub records: Vec<OpRecord>,
    /// How alive it was.
    pub liveness: Liveness,
}

/// Where a rank is in a communicator.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Position {
    /// The last operation it completed.
    pub last_completed: Option<OpRecord>,
    /// The operation it is in (or failed in, or queued last on a GPU).
    pub current: Option<OpRecord>,
    /// An operation it must have joined, known from the others (someone
    /// completed it, and it needs every rank), when that is further than
    /// what its own records say (they may be as old as its last
    /// heartbeat).
    pub joined: Option<OpRecord>,
    /// The highest sequence number it has issued and not seen complete
    /// (a GPU rank queues several), when past `current`.
    pub queued_through: Option<u64>,
}

impl Position {
    /// From a rank's records: the highest completed sequence number, and
    /// the numbered operation past it that has not completed (a failed one
    /// first).
    pub fn of(records: &[OpRecord]) -> Position {
        let last_completed = records
            .iter()
            .filter(|r| r.state == OpState::Completed && r.seq.is_some())
            .max_by_key(|r| r.seq)
            .cloned();
        let done = last_completed.as_ref().and_then(|r| r.seq).unwrap_or(0);
        let open = records
            .iter()
            .filter(|r| r.state != OpState::Completed && r.seq.is_some_and(|s| s > done));
        let newest = open.clone().filter_map(|r| r.seq).max();
        let current = open
            .clone()
            .filter(|r| r.state == OpState::Failed)
            .max_by_key(|r| r.seq)
            .or_else(|| open.max_by_key(|r| r.seq))
            .cloned();
        let at = current.as_ref().and_then(|c| c.seq);
        Position {
            last_completed,
            current,
            joined: None,
            queued_through: newest.filter(|n| Some(*n) > at),
        }
    }

    /// The furthest sequence number reached (entered or completed).
    pub fn reach(&self) -> u64 {
        let c = self.current.as_ref().and_then(|r| r.seq).unwrap_or(0);
        let d = self
            .last_completed
            .as_ref()
            .and_then(|r| r.seq)
            .unwrap_or(0);
        let j = self.joined.as_ref().and_then(|r| r.seq).unwrap_or(0);
        c.max(d).max(j).max(self.queued_through.unwrap_or(0))
    }

    /// `in all_reduce #5`, `after all_reduce #4`, `after joining
    /// all_reduce #4`, `before its first operation`.
    pub fn describe(&self) -> String {
        if let Some(j) = &self.joined {
            return format!("after joining {}", j.label());
        }
        match (&self.current, &self.last_completed) {
            (Some(c), _) => match c.state {
                OpState::Failed => format!("in {} (failed)", c.label()),
                OpState::Enqueued => match &self.last_completed {
                    Some(d) => format!("after {} with {} queued on the GPU", d.label(), c.label()),
                    None => format!("with {} queued on the GPU", c.label()),
                },
                _ => format!("in {}", c.label()),
            },
            (None, Some(d)) => format!("after {}", d.label()),
            (None, None) => "before its first operation".into(),
        }
    }
}

/// What kind of problem a finding is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FindingKind {
    /// Stopped or silent (no heartbeat).
    Stopped,
    /// Its process ended.
    Exited,
    /// Dropped its communicator.
    Left,
    /// Alive (or unknown) but behind the others.
    Behind,
    /// No heartbeat and no record at all.
    NeverArrived,
    /// Ranks called different operations at one sequence number.
    Mismatch,
}

/// One thing the diagnosis found.
#[derive(Debug, Clone, Serialize)]
pub struct Finding {
    /// What kind.
    pub kind: FindingKind,
    /// The ranks (in the communicator) it is about.
    pub ranks: Vec<usize>,
    /// In words.
    pub text: String,
}

/// One rank's line of the diagnosis.
#[derive(Debug, Clone, Serialize)]
pub struct RankReport {
    /// Rank in the communicator.
    pub rank: usize,
    /// World rank, when known.
    pub world_rank: Option<usize>,
    /// `waiting`, `behind`, `stopped`, `exited`, `left`, `finished`,
    /// `never arrived`, `unknown`.
    pub status: String,
    /// Where it is, in words.
    pub position: String,
    /// Where it is.
    pub at: Position,
    /// How alive it was.
    pub liveness: Liveness,
}

/// The diagnosis of one communicator.
#[derive(Debug, Clone, Serialize)]
pub struct Diagnosis {
    /// Communicator id.
    pub comm: String,
    /// Its size.
    pub size: usize,
    /// The furthest operation any rank reached.
    pub front: Option<OpRecord>,
    /// Suspects and mismatches, most telling first.
    pub findings: Vec<Finding>,
    /// Ranks inside the front operation, waiting for the others.
    pub waiting: Vec<usize>,
    /// Every rank.
    pub ranks: Vec<RankReport>,
    /// One line: the suspects, then who waits where.
    pub summary: String,
}

impl Diagnosis {
    /// Whether anything is wrong (a suspect or a mismatch).
    pub fn has_problem(&self) -> bool {
        !self.findings.is_empty()
    }

    /// Whether to print it: the world's always; another communicator's
    /// when it found something and had operations (a split nobody used
    /// only repeats what the world's says about a stopped or dead rank).
    pub fn worth_showing(&self) -> bool {
        self.comm == "world" || (self.has_problem() && self.front.is_some())
    }

    /// The ranks the findings name, in order.
    pub fn suspects(&self) -> Vec<usize> {
        let mut seen = BTreeSet::new();
        self.findings
            .iter()
            .flat_map(|f| f.ranks.iter().copied())
            .filter(|r| seen.insert(*r))
            .collect()
    }

    /// Several lines: the summary, then one line per rank (at most
    /// `max_ranks`, suspects and waiting ranks first), each indented by
    /// `indent`.
    pub fn render(&self, indent: &str, max_ranks: usize) -> String {
        let mut s = format!(
            "{indent}{} ({} rank{}): {}\n",
            self.comm,
            self.size,
            if self.size == 1 { "" } else { "s" },
            self.summary
        );
        let suspects = self.suspects();
        let mut order: Vec<&RankReport> = self.ranks.iter().collect();
        order.sort_by_key(|r| (!suspects.contains(&r.rank), r.rank));
        for r in order.iter().take(max_ranks) {
            let world = match r.world_rank {
                Some(w) if w != r.rank => format!(" (world rank {w})"),
                _ => String::new(),
            };
            let note = r.liveness.note();
            let _ = writeln!(
                s,
                "{indent}  rank {}{world}: {}, {}{}",
                r.rank,
                r.status,
                r.position,
                if note.is_empty() {
                    String::new()
                } else {
                    format!(" ({note})")
                }
            );
        }
        if order.len() > max_ranks {
            let _ = writeln!(
                s,
                "{indent}  ... and {} more rank(s)",
                order.len() - max_ranks
            );
        }
        s
    }
}

/// `0`, `0, 2-5, 9`.
pub fn rank_list(ranks: &[usize]) -> String {
    let mut sorted = ranks.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut parts = Vec::new();
    let mut i = 0;
    while i < sorted.len() {
        let mut j = i;
        while j + 1 < sorted.len() && sorted[j + 1] == sorted[j] + 1 {
            j += 1;
        }
        parts.push(if j > i + 1 {
            format!("{}-{}", sorted[i], sorted[j])
        } else if j == i + 1 {
            format!("{}, {}", sorted[i], sorted[j])
        } else {
            sorted[i].to_string()
        });
        i = j + 1;
    }
    parts.join(", ")
}

fn ranks_word(ranks: &[usize]) -> String {
    if ranks.len() == 1 {
        format!("rank {}", ranks[0])
    } else {
        format!("ranks {}", rank_list(ranks))
    }
}

/// Whether every rank must have joined operation `op` for any rank to
/// complete it (not so for rooted operations, whose root or leaves may
/// finish first, nor for point-to-point ones).
pub fn needs_every_rank(op: &str) -> bool {
    matches!(
        op,
        "all_reduce"
            | "all_gather"
            | "all_gather_v"
            | "reduce_scatter"
            | "all_to_all"
            | "all_to_all_v"
            | "barrier"
    )
}

/// The first sequence number at which two ranks' records disagree.
fn first_mismatch(inputs: &[RankInput]) -> Option<(u64, Vec<(usize, OpRecord)>)> {
    let mut by_seq: BTreeMap<u64, Vec<(usize, OpRecord)>> = BTreeMap::new();
    for input in inputs {
        let mut seen = BTreeSet::new();
        for r in &input.records {
            if let Some(seq) = r.seq {
                if seen.insert(seq) {
                    by_seq.entry(seq).or_default().push((input.rank, r.clone()));
                }
            }
        }
    }
    by_seq.into_iter().find_map(|(seq, calls)| {
        let first = &calls[0].1;
        (calls.len() > 1 && calls.iter().any(|(_, r)| !r.matches(first))).then_some((seq, calls))
    })
}

/// Diagnoses communicator `comm` of `size` ranks from what is known of
/// each (`ranks` need not cover every rank: one missing never arrived).
///
/// The *front* is the furthest operation any rank reached. A rank short
/// of it is behind; a rank that is stopped, silent, gone or left without
/// having failed an operation itself is a suspect wherever it is; ranks
/// in the front operation are waiting. Ranks that recorded different
/// operations under one sequence number are a mismatch.
pub fn diagnose(comm: &str, size: usize, ranks: &[RankInput]) -> Diagnosis {
    let mut inputs: Vec<RankInput> = (0..size)
        .map(|r| RankInput {
            rank: r,
            world_rank: None,
            known: false,
            records: Vec::new(),
            liveness: Liveness::Unknown,
        })
        .collect();
    for input in ranks.iter().filter(|i| i.rank < size) {
        inputs[input.rank] = input.clone();
    }
    let mut positions: Vec<Position> = inputs.iter().map(|i| Position::of(&i.records)).collect();
    // A rank's records may be older than where it is (a heartbeat lags by
    // up to its interval): an operation that needs every rank and that
    // some rank completed was joined by all.
    let joined_by_all = inputs
        .iter()
        .flat_map(|i| &i.records)
        .filter(|r| r.state == OpState::Completed && needs_every_rank(&r.op))
        .max_by_key(|r| r.seq)
        .cloned();
    if let Some(j) = &joined_by_all {
        let seq = j.seq.unwrap_or(0);
        for p in positions.iter_mut().filter(|p| p.reach() < seq) {
            p.joined = Some(j.clone());
        }
    }
    let mut by_seq: BTreeMap<u64, &OpRecord> = BTreeMap::new();
    for r in inputs.iter().flat_map(|i| &i.records) {
        if let Some(seq) = r.seq {
            by_seq.entry(seq).or_insert(r);
        }
    }
    let front_seq = positions.iter().map(Position::reach).max().unwrap_or(0);
    let front = (front_seq > 0).then(|| {
        let at_front = |r: &Option<OpRecord>| r.clone().filter(|r| r.seq == Some(front_seq));
        positions
            .iter()
            .find_map(|p| at_front(&p.current))
            .or_else(|| positions.iter().find_map(|p| at_front(&p.last_completed)))
            .or_else(|| by_seq.get(&front_seq).map(|r| (*r).clone()))
            .or_else(|| positions.iter().find_map(|p| at_front(&p.joined)))
    });
    let front = front.flatten();
    let front_label = front
        .as_ref()
        .map(OpRecord::label)
        .unwrap_or_else(|| "its first operation".into());

    let mut findings: Vec<Finding> = Vec::new();
    let mut waiting = Vec::new();
    let mut reports = Vec::new();
    let mut never = Vec::new();
    for (input, pos) in inputs.iter().zip(&positions) {
        let has_info = input.known || !input.records.is_empty() || pos.joined.is_some();
        let failed_here = pos
            .current
            .as_ref()
            .is_some_and(|c| c.state == OpState::Failed);
        let behind = has_info && pos.reach() < front_seq;
        let where_ = if has_info {
            pos.describe()
        } else {
            "at an unknown point (no heartbeat, no flight record)".into()
        };
        // The first operation it is missing (GPU ranks may have queued
        // several past it), else the front.
        let missing = by_seq
            .get(&(pos.reach() + 1))
            .map(|r| r.label())
            .unwrap_or_else(|| front_label.clone());
        let short_of = if behind {
            format!(" and did not reach {missing}")
        } else {
            String::new()
        };
        let own_info = input.known || !input.records.is_empty();
        let note = input.liveness.note();
        let paren = if !note.is_empty() {
            format!(" ({note})")
        } else if !own_info {
            " (it left no heartbeat or flight record)".into()
        } else {
            String::new()
        };
        let suspect_by_liveness = input.liveness.is_problem() && !failed_here;
        let r = input.rank;
        let (status, finding) = if !has_info && input.liveness == Liveness::Unknown {
            never.push(r);
            ("never arrived", None)
        } else if behind || suspect_by_liveness {
            match &input.liveness {
                Liveness::Stopped { .. } | Liveness::Silent { .. } => (
                    "stopped",
                    Some((
                        FindingKind::Stopped,
                        format!("rank {r} stopped {where_}{short_of}{paren}"),
                    )),
                ),
                Liveness::Exited { how } => (
                    "exited",
                    Some((
                        FindingKind::Exited,
                        format!("rank {r} exited {where_}{short_of} ({how})"),
                    )),
                ),
                Liveness::Left => (
                    "left",
                    Some((
                        FindingKind::Left,
                        format!("rank {r} left {where_}{short_of} (dropped its communicator)"),
                    )),
                ),
                _ => (
                    "behind",
                    Some((
                        FindingKind::Behind,
                        format!(
                            "rank {r} is behind, {where_}, and has not reached {missing}{paren}"
                        ),
                    )),
                ),
            }
        } else if !has_info {
            ("unknown", None)
        } else if pos.current.is_some() {
            waiting.push(r);
            ("waiting", None)
        } else {
            ("finished", None)
        };
        if let Some((kind, text)) = finding {
            findings.push(Finding {
                kind,
                ranks: vec![r],
                text,
            });
        }
        reports.push(RankReport {
            rank: r,
            world_rank: input.world_rank,
            status: status.into(),
            position: where_,
            at: pos.clone(),
            liveness: input.liveness.clone(),
        });
    }
    if !never.is_empty() {
        findings.push(Finding {
            kind: FindingKind::NeverArrived,
            text: format!(
                "{} never arrived (no heartbeat, no flight record{})",
                ranks_word(&never),
                if front_seq > 0 {
                    format!("; the others reached {front_label}")
                } else {
                    String::new()
                }
            ),
            ranks: never,
        });
    }
    if let Some((seq, calls)) = first_mismatch(&inputs) {
        let mut groups: Vec<(OpRecord, Vec<usize>)> = Vec::new();
        for (r, rec) in calls {
            match groups.iter_mut().find(|(g, _)| g.matches(&rec)) {
                Some((_, ranks)) => ranks.push(r),
                None => groups.push((rec, vec![r])),
            }
        }
        let parts: Vec<String> = groups
            .iter()
            .map(|(rec, ranks)| {
                let shape = rec.shape().map(|s| format!(" ({s})")).unwrap_or_default();
                format!("{}{shape} on {}", rec.op, ranks_word(ranks))
            })
            .collect();
        findings.push(Finding {
            kind: FindingKind::Mismatch,
            ranks: groups.iter().skip(1).flat_map(|(_, r)| r.clone()).collect(),
            text: format!(
                "ranks called different operations at #{seq}: {}",
                parts.join("; ")
            ),
        });
    }

    const MAX_LISTED: usize = 8;
    let mut parts: Vec<String> = findings
        .iter()
        .take(MAX_LISTED)
        .map(|f| f.text.clone())
        .collect();
    if findings.len() > MAX_LISTED {
        parts.push(format!(
            "and {} more finding(s)",
            findings.len() - MAX_LISTED
        ));
    }
    // Who waits in what (a GPU rank waits in its oldest unfinished
    // operation, maybe short of what it queued).
    let mut waits: Vec<(String, Vec<usize>)> = Vec::new();
    for &r in &waiting {
        let label = positions[r]
            .current
            .as_ref()
            .map(OpRecord::label)
            .unwrap_or_else(|| front_label.clone());
        match waits.iter_mut().find(|(l, _)| *l == label) {
            Some((_, ranks)) => ranks.push(r),
            None => waits.push((label, vec![r])),
        }
    }
    for (label, ranks) in waits.iter().take(4) {
        parts.push(format!("{} waiting in {label}", ranks_word(ranks)));
    }
    if waits.len() > 4 {
        parts.push(format!(
            "{} more rank(s) waiting elsewhere",
            waits[4..].iter().map(|(_, r)| r.len()).sum::<usize>()
        ));
    }
    if findings.is_empty() {
        if !waiting.is_empty() && waiting.len() == size {
            parts.insert(
                0,
                "no rank is behind and none stopped: every rank is inside the same operation (a transfer stuck in the backend or the network)".into(),
            );
        } else if waiting.is_empty() && front_seq > 0 {
            parts.push(format!(
                "every rank finished {front_label} and none is inside an operation"
            ));
        } else if front_seq == 0 && waiting.is_empty() {
            parts.push("no operation has started".into());
        }
    }
    Diagnosis {
        comm: comm.to_string(),
        size,
        front,
        findings,
        waiting,
        ranks: reports,
        summary: parts.join("; "),
    }
}

/// One world rank, as the launcher or `braid doctor` knows it.
#[derive(Debug, Clone)]
pub struct WorldRank<'a> {
    /// Its dump or last heartbeat, if any.
    pub snapshot: Option<&'a Snapshot>,
    /// How alive it was.
    pub liveness: Liveness,
}

/// Diagnoses every communicator the snapshots mention (`world` first),
/// from `ranks`, indexed by world rank.
pub fn diagnose_world(ranks: &[WorldRank]) -> Vec<Diagnosis> {
    let mut comms: BTreeMap<String, usize> = BTreeMap::new();
    for s in ranks.iter().filter_map(|r| r.snapshot) {
        for c in &s.comms {
            comms.entry(c.id.clone()).or_insert(c.size);
        }
    }
    let mut ids: Vec<String> = comms.keys().cloned().collect();
    ids.sort_by_key(|id| (id != "world", id.clone()));
    let mut out = Vec::new();
    for id in ids {
        let size = comms[&id];
        // Comm rank -> world rank: a dump's list, else each snapshot's own
        // entry; the world communicator's ranks are the world's.
        let mut map: BTreeMap<usize, usize> = BTreeMap::new();
        for (w, s) in ranks
            .iter()
            .enumerate()
            .filter_map(|(w, r)| r.snapshot.map(|s| (w, s)))
        {
            for c in s.comms.iter().filter(|c| c.id == id) {
                for (cr, wr) in c.world_ranks.iter().enumerate() {
                    map.insert(cr, *wr);
                }
                map.insert(c.rank, w);
            }
        }
        if id == "world" || id.starts_with("world/gpu") {
            for r in 0..size.min(ranks.len()) {
                map.entry(r).or_insert(r);
            }
        }
        let inputs: Vec<RankInput> = map
            .iter()
            .filter(|(_, w)| **w < ranks.len())
            .map(|(&cr, &w)| {
                let rank = &ranks[w];
                let known = rank
                    .snapshot
                    .is_some_and(|s| s.comms.iter().any(|c| c.id == id));
                RankInput {
                    rank: cr,
                    world_rank: Some(w),
                    known,
                    records: rank.snapshot.map(|s| s.records_of(&id)).unwrap_or_default(),
                    liveness: rank.liveness.clone(),
                }
            })
            .collect();
        out.push(diagnose(&id, size, &inputs));
    }
    out
}
