//! A parameter-server run's staleness, from its workers' traces: every
//! `ps update` span carries the staleness of the push it committed (how
//! many other updates reached the servers between the worker's read of the
//! parameters and its push being applied). Shown by `braid report`.

use crate::format::RankTrace;
use serde_json::{json, Value};

/// The span a parameter-server worker records around each commit.
pub const SPAN: &str = "ps update";

/// Per worker: pushes, mean and largest staleness, and the count by
/// staleness (0 to 15, then 16 or more); `Value::Null` when no trace
/// holds a parameter-server update.
pub fn of(traces: &[RankTrace]) -> Value {
    let ranks: Vec<Value> = traces
        .iter()
        .filter_map(|t| {
            let seen: Vec<u64> = t
                .events
                .iter()
                .filter(|e| e.name == SPAN)
                .filter_map(|e| e.args.get("staleness").and_then(Value::as_u64))
                .collect();
            if seen.is_empty() {
                return None;
            }
            let mut histogram = [0u64; 17];
            for s in &seen {
                histogram[(*s as usize).min(16)] += 1;
            }
            Some(json!({
                "rank": t.rank,
                "pushes": seen.len(),
                "mean": seen.iter().sum::<u64>() as f64 / seen.len() as f64,
                "max": seen.iter().max(),
                "histogram": histogram,
            }))
        })
        .collect();
    match ranks.is_empty() {
        true => Value::Null,
        false => json!({ "ranks": ranks }),
    }
}

/// The section's lines for the text report.
pub fn render(v: &Value) -> Vec<String> {
    let Some(ranks) = v["ranks"].as_array() else {
        return Vec::new();
    };
    let mut out = vec![
        "\n-- parameter server: staleness of each worker's pushes (updates by others between its read and its push) --".to_string(),
    ];
    for r in ranks {
        let hist: Vec<String> = r["histogram"]
            .as_array()
            .into_iter()
            .flatten()
            .enumerate()
            .filter(|(_, n)| n.as_u64().unwrap_or(0) > 0)
            .map(|(s, n)| match s {
                16 => format!("16+: {n}"),
                _ => format!("{s}: {n}"),
            })
            .collect();
        out.push(format!(
            "worker {}: {} pushes, mean {:.2}, max {} | by staleness {}",
            r["rank"],
            r["pushes"],
            r["mean"].as_f64().unwrap_or(0.0),
            r["max"],
            hist.join(", ")
        ));
    }
    out
}
