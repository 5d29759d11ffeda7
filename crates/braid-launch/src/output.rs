//! Worker output: every line a worker prints is forwarded with a
//! `[rank N] ` prefix, optionally appended to that rank's log file, and the
//! last lines of its stderr are kept for the failure summary.

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
                Stream::Stdout { prefix: false } => String::new(),
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
