//! Worker output: every line a worker prints is forwarded with a
//! `[rank N] ` prefix, optionally appended to that rank's log file, and the
//! last lines of its stderr are kept for the failure summary. Which of a
//! worker's streams reach the console and which its log file is torchrun's
//! choice, made per local rank by `--tee`, `--redirects` and
//! `--local-ranks-filter` ([`Streams`], [`Routes`]).

use std::collections::VecDeque;
use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

/// Lines longer than this are forwarded in pieces.
const MAX_LINE: usize = 64 << 10;
/// Lines of stderr kept per worker for the failure summary.
pub const TAIL_LINES: usize = 20;

/// Which of the launcher's streams a worker stream is forwarded to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    /// The launcher's stdout, each line prefixed `[rank N] ` or not.
    Stdout {
        /// Whether lines get the prefix.
        prefix: bool,
    },
    /// The launcher's stderr.
    Stderr,
    /// Nowhere on the console (the line still reaches the log and the
    /// tail): a redirected stream, or a local rank the console filter
    /// leaves out.
    Hidden,
}

/// A set of a worker's standard streams, as torchrun's `Std` numbers them:
/// 0 none, 1 stdout, 2 stderr, 3 both.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Streams {
    /// stdout is in the set.
    pub stdout: bool,
    /// stderr is in the set.
    pub stderr: bool,
}

impl Streams {
    /// torchrun's number for a set of streams: 0, 1, 2 or 3.
    pub fn from_number(n: u8) -> Option<Streams> {
        (n <= 3).then_some(Streams {
            stdout: n & 1 != 0,
            stderr: n & 2 != 0,
        })
    }

    /// Whether the set is empty.
    pub fn is_empty(self) -> bool {
        !self.stdout && !self.stderr
    }
}

/// torchrun's `--tee`/`--redirects` value: one set of streams for every
/// local rank (`3`), or a set per local rank (`0:1,1:2`; ranks not named
/// get none).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum StreamSpec {
    /// No stream of any rank (`0`, torchrun's default).
    #[default]
    None,
    /// The same streams for every local rank.
    All(Streams),
    /// Streams per local rank.
    PerRank(Vec<(usize, Streams)>),
}

impl StreamSpec {
    /// Parses `3` or `0:1,1:2` (`flag` names the option in errors).
    pub fn parse(flag: &str, s: &str) -> Result<StreamSpec, String> {
        let bad = || {
            format!(
                "{flag} {s:?}: expected 0 (none), 1 (stdout), 2 (stderr) or 3 (both), for every \
                 local rank, or LOCAL_RANK:N pairs such as 0:3,1:2"
            )
        };
        let number = |v: &str| {
            v.trim()
                .parse::<u8>()
                .ok()
                .and_then(Streams::from_number)
                .ok_or_else(bad)
        };
        let s_trim = s.trim();
        if !s_trim.contains(':') {
            let streams = number(s_trim)?;
            return Ok(match streams.is_empty() {
                true => StreamSpec::None,
                false => StreamSpec::All(streams),
            });
        }
        let mut per = Vec::new();
        for pair in s_trim.split(',').filter(|p| !p.trim().is_empty()) {
            let (rank, n) = pair.split_once(':').ok_or_else(bad)?;
            let rank = rank.trim().parse::<usize>().map_err(|_| bad())?;
            per.push((rank, number(n)?));
        }
        Ok(StreamSpec::PerRank(per))
    }

    /// The streams of local rank `local_rank`.
    pub fn of(&self, local_rank: usize) -> Streams {
        match self {
            StreamSpec::None => Streams::default(),
            StreamSpec::All(s) => *s,
            StreamSpec::PerRank(per) => per
                .iter()
                .find(|(r, _)| *r == local_rank)
                .map_or(Streams::default(), |(_, s)| *s),
        }
    }

    /// Whether any rank's stream is in the spec.
    pub fn any(&self) -> bool {
        match self {
            StreamSpec::None => false,
            StreamSpec::All(s) => !s.is_empty(),
            StreamSpec::PerRank(per) => per.iter().any(|(_, s)| !s.is_empty()),
        }
    }
}

/// Where a worker's output goes, as torchrun's options decide it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct OutputOptions {
    /// Every stream of every rank also to its log file (braid's
    /// `--log-dir`).
    pub log_all: bool,
    /// Streams copied to the log file as well as the console (`--tee`).
    pub tee: StreamSpec,
    /// Streams sent to the log file instead of the console
    /// (`--redirects`).
    pub redirects: StreamSpec,
    /// The local ranks whose output reaches the console; `None`: all
    /// (`--local-ranks-filter`).
    pub console_ranks: Option<Vec<usize>>,
}

/// Where one stream of one worker goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Route {
    /// To the launcher's console.
    pub console: bool,
    /// To the rank's log file.
    pub file: bool,
}

/// Where both streams of one worker go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Routes {
    /// The worker's stdout.
    pub stdout: Route,
    /// The worker's stderr.
    pub stderr: Route,
}

impl Default for Routes {
    /// Both streams to the console, neither to a file.
    fn default() -> Self {
        let console = Route {
            console: true,
            file: false,
        };
        Routes {
            stdout: console,
            stderr: console,
        }
    }
}

impl Routes {
    /// Whether either stream goes to the log file.
    pub fn any_file(&self) -> bool {
        self.stdout.file || self.stderr.file
    }
}

impl OutputOptions {
    /// The routes of local rank `local_rank`'s streams.
    pub fn routes(&self, local_rank: usize) -> Routes {
        let shown = self
            .console_ranks
            .as_ref()
            .is_none_or(|r| r.contains(&local_rank));
        let (tee, redirect) = (self.tee.of(local_rank), self.redirects.of(local_rank));
        let route = |teed: bool, redirected: bool| Route {
            console: shown && !redirected,
            file: self.log_all || teed || redirected,
        };
        Routes {
            stdout: route(tee.stdout, redirect.stdout),
            stderr: route(tee.stderr, redirect.stderr),
        }
    }

    /// Whether some stream of some rank goes to a log file.
    pub fn any_file(&self) -> bool {
        self.log_all || self.tee.any() || self.redirects.any()
    }
}

/// Parses `--local-ranks-filter`: local ranks, comma-separated (`0,1,2`).
pub fn parse_ranks_filter(s: &str) -> Result<Vec<usize>, String> {
    let ranks: Result<Vec<usize>, _> = s
        .split(',')
        .filter(|p| !p.trim().is_empty())
        .map(|p| p.trim().parse::<usize>())
        .collect();
    match ranks {
        Ok(r) if !r.is_empty() => Ok(r),
        _ => Err(format!(
            "--local-ranks-filter {s:?}: expected local ranks separated by commas, e.g. 0 or 0,1,2"
        )),
    }
}

/// The last lines a worker wrote to stderr.
#[derive(Debug, Default, Clone)]
pub struct Tail(Arc<Mutex<VecDeque<String>>>);

impl Tail {
    fn push(&self, line: &str) {
        let mut t = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if t.len() == TAIL_LINES {
            t.pop_front();
        }
        t.push_back(line.to_string());
    }

    /// The kept lines, oldest first.
    pub fn lines(&self) -> Vec<String> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .cloned()
            .collect()
    }
}

/// Opens (appending) the log file of `rank` in `dir` and marks the attempt.
pub fn open_log(dir: &Path, rank: usize, attempt: u32) -> std::io::Result<Arc<Mutex<File>>> {
    std::fs::create_dir_all(dir)?;
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log_path(dir, rank))?;
    writeln!(f, "=== braid launch: attempt {attempt}, rank {rank} ===")?;
    Ok(Arc::new(Mutex::new(f)))
}

/// Where rank `rank`'s log lives in `dir`.
pub fn log_path(dir: &Path, rank: usize) -> std::path::PathBuf {
    dir.join(format!("rank{rank}.log"))
}

/// Starts a thread that forwards `source` line by line until it closes.
pub fn pump(
    source: impl Read + Send + 'static,
    rank: usize,
    stream: Stream,
    log: Option<Arc<Mutex<File>>>,
    tail: Option<Tail>,
) -> JoinHandle<()> {
    std::thread::Builder::new()
        .name(format!("braid-out-{rank}"))
        .spawn(move || {
            let prefix = match stream {
                Stream::Stdout { prefix: false } | Stream::Hidden => String::new(),
                _ => format!("[rank {rank}] "),
            };
            for_each_line(source, |line| {
                let text = String::from_utf8_lossy(line);
                let mut out = Vec::with_capacity(prefix.len() + line.len() + 1);
                out.extend_from_slice(prefix.as_bytes());
                out.extend_from_slice(line);
                out.push(b'\n');
                // A closed stdout (e.g. `| head`) must not stop the job.
                let _ = match stream {
                    Stream::Stdout { .. } => std::io::stdout().lock().write_all(&out),
                    Stream::Stderr => std::io::stderr().lock().write_all(&out),
                    Stream::Hidden => Ok(()),
                };
                if let Some(log) = &log {
                    let mut f = log.lock().unwrap_or_else(|p| p.into_inner());
                    let _ = f.write_all(line).and_then(|_| f.write_all(b"\n"));
                }
                if let Some(tail) = &tail {
                    tail.push(&text);
                }
            });
        })
        .expect("spawning an output thread")
}

/// Calls `f` with each line of `source` (without its newline); a final
/// line without newline is delivered too, and over-long lines in pieces.
pub fn for_each_line(source: impl Read, mut f: impl FnMut(&[u8])) {
    let mut reader = BufReader::with_capacity(MAX_LINE, source);
    let mut line = Vec::new();
    loop {
        let buf = match reader.fill_buf() {
            Ok([]) => break,
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => break,
        };
        let (used, complete) = match buf.iter().position(|b| *b == b'\n') {
            Some(i) => {
                line.extend_from_slice(&buf[..i]);
                (i + 1, true)
            }
            None => {
                line.extend_from_slice(buf);
                (buf.len(), line.len() >= MAX_LINE)
            }
        };
        reader.consume(used);
        if complete {
            let trimmed = line.strip_suffix(b"\r").unwrap_or(&line);
            f(trimmed);
            line.clear();
        }
    }
    if !line.is_empty() {
        f(&line);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(input: &[u8]) -> Vec<String> {
        let mut out = Vec::new();
        for_each_line(input, |l| out.push(String::from_utf8_lossy(l).into_owned()));
        out
    }

    #[test]
    fn splits_lines_and_keeps_the_unterminated_last_one() {
        assert_eq!(lines(b"a\nb\r\n\nc"), ["a", "b", "", "c"]);
        assert!(lines(b"").is_empty());
    }

    #[test]
    fn splits_over_long_lines() {
        let long = vec![b'x'; MAX_LINE * 2 + 5];
        let got = lines(&long);
        assert_eq!(got.iter().map(|l| l.len()).sum::<usize>(), long.len());
        assert!(got.len() >= 2);
    }

    #[test]
    fn stream_specs_read_as_torchrun_writes_them() {
        let both = Streams {
            stdout: true,
            stderr: true,
        };
        assert_eq!(StreamSpec::parse("--tee", "3"), Ok(StreamSpec::All(both)));
        assert_eq!(StreamSpec::parse("--tee", "0"), Ok(StreamSpec::None));
        let per = StreamSpec::parse("--redirects", "0:1,1:2").unwrap();
        assert!(per.of(0).stdout && !per.of(0).stderr);
        assert!(!per.of(1).stdout && per.of(1).stderr);
        assert!(per.of(2).is_empty());
        for bad in ["4", "x", "0:5", "a:1", "0-1"] {
            let e = StreamSpec::parse("--tee", bad).unwrap_err();
            assert!(e.contains("--tee") && e.contains("LOCAL_RANK:N"), "{e}");
        }
        assert_eq!(parse_ranks_filter("0, 2"), Ok(vec![0, 2]));
        assert!(parse_ranks_filter("one").is_err());
        assert!(parse_ranks_filter("").is_err());
    }

    #[test]
    fn routes_follow_tee_redirects_and_the_console_filter() {
        let o = OutputOptions {
            tee: StreamSpec::parse("--tee", "1").unwrap(),
            redirects: StreamSpec::parse("--redirects", "1:2").unwrap(),
            console_ranks: Some(vec![0, 1]),
            ..Default::default()
        };
        let r0 = o.routes(0);
        assert_eq!(
            r0.stdout,
            Route {
                console: true,
                file: true
            }
        );
        assert_eq!(
            r0.stderr,
            Route {
                console: true,
                file: false
            }
        );
        let r1 = o.routes(1);
        assert_eq!(
            r1.stderr,
            Route {
                console: false,
                file: true
            }
        );
        let r2 = o.routes(2);
        assert!(!r2.stdout.console && !r2.stderr.console && r2.stdout.file);
        assert!(!OutputOptions::default().routes(0).any_file());
        let all = OutputOptions {
            log_all: true,
            ..Default::default()
        };
        assert!(all.routes(5).stderr.file && all.routes(5).stderr.console);
    }

    #[test]
    fn tail_keeps_the_last_lines() {
        let t = Tail::default();
        for i in 0..30 {
            t.push(&i.to_string());
        }
        let l = t.lines();
        assert_eq!(l.len(), TAIL_LINES);
        assert_eq!(l[0], "10");
    }
}
