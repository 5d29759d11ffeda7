//! `braid report --html`: the report as one self-contained HTML page.

use braid_trace::format::RankTrace;

/// The page for report `r` of the run traced in `traces`.
pub fn page(r: &serde_json::Value, _traces: &[RankTrace]) -> String {
    format!(
        "<!doctype html><meta charset=utf-8><title>braid report</title><pre>{}</pre>",
        braid_trace::report::render_text(r)
            .replace('&', "&amp;")
            .replace('<', "&lt;")
    )
}
