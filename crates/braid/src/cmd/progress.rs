//! Progress of long work, one implementation for every command: a bar
//! redrawn in place (indicatif) when stderr is a terminal, and plain lines
//! — at most one every few seconds, and one at the end — when it is a pipe
//! or a log file, so logs never fill with carriage returns. Also the one
//! way durations are written (`1:02:03` past an hour).

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal as _;
use std::time::{Duration, Instant};

/// Seconds between two plain progress lines.
const PLAIN_EVERY: Duration = Duration::from_secs(5);

/// A duration as `m:ss`, or `h:mm:ss` from an hour up.
pub fn fmt_duration(secs: f64) -> String {
    let s = secs.max(0.0).round() as u64;
    match s {
        s if s >= 3600 => format!("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60),
        s => format!("{}:{:02}", s / 60, s % 60),
    }
}

/// Whether progress bars may be drawn: stderr is a terminal.
pub fn on_terminal() -> bool {
    std::io::stderr().is_terminal()
}

/// Progress through `len` items (samples, batches) of some work.
pub struct Progress {
    what: String,
    unit: &'static str,
    bar: Option<ProgressBar>,
    start: Instant,
    last_line: Option<Instant>,
    done: u64,
    len: u64,
}

impl Progress {
    /// Progress of `what` (e.g. "writing"), counted in `unit`s; drawn as
    /// a bar on a terminal, else as plain lines.
    pub fn new(what: impl Into<String>, unit: &'static str) -> Progress {
        Progress::with_target(what, unit, on_terminal())
    }

    /// As [`new`](Self::new), the bar drawn only where `bar` says.
    pub fn with_target(what: impl Into<String>, unit: &'static str, bar: bool) -> Progress {
        let what = what.into();
        let bar = bar.then(|| {
            let b = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr_with_hz(10));
            let style =
                ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} {per_sec} eta {eta}")
                    .expect("a fixed, valid template")
                    .progress_chars("#> ");
            b.set_style(style);
            b.set_message(what.clone());
            b
        });
        Progress {
            what,
            unit,
            bar,
            start: Instant::now(),
            last_line: None,
            done: 0,
            len: 0,
        }
    }

    /// `done` of `len` items are finished.
    pub fn show(&mut self, done: u64, len: u64) {
        self.done = done;
        self.len = len;
        if let Some(b) = &self.bar {
            b.set_length(len);
            b.set_position(done);
            return;
        }
        let now = Instant::now();
        let due = match self.last_line {
            None => now - self.start >= PLAIN_EVERY,
            Some(l) => now - l >= PLAIN_EVERY,
        };
        if due && done < len {
            self.last_line = Some(now);
            eprintln!("{}", self.line());
        }
    }

    /// The work is over: the bar is cleared (the caller prints what was
    /// done), or, without one, a last line is printed if lines were.
    pub fn finish(self) {
        match &self.bar {
            Some(b) => b.finish_and_clear(),
            None if self.last_line.is_some() => eprintln!("{}", self.line()),
            None => {}
        }
    }

    fn line(&self) -> String {
        let secs = self.start.elapsed().as_secs_f64().max(1e-9);
        let rate = self.done as f64 / secs;
        let left = self.len.saturating_sub(self.done) as f64 / rate.max(1e-9);
        format!(
            "{}: {}/{} {} ({:.0}%), {:.0} {}/s, {} elapsed, eta {}",
            self.what,
            self.done,
            self.len,
            self.unit,
            100.0 * self.done as f64 / self.len.max(1) as f64,
            rate,
            self.unit,
            fmt_duration(secs),
            fmt_duration(left)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::fmt_duration;

    #[test]
    fn durations_past_an_hour_show_hours() {
        assert_eq!(fmt_duration(0.0), "0:00");
        assert_eq!(fmt_duration(62.4), "1:02");
        assert_eq!(fmt_duration(3599.0), "59:59");
        assert_eq!(fmt_duration(7642.0), "2:07:22");
        assert_eq!(fmt_duration(-3.0), "0:00");
    }
}
