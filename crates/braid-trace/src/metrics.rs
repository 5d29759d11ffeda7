//! Live metrics: a small HTTP endpoint serving this process's gauges and
//! counters in Prometheus' text exposition format (version 0.0.4) while a
//! training run goes on.
//!
//! [`MetricsServer::start`] binds a TCP listener and serves `GET /metrics`
//! (and `GET /`) from a background thread; the run sets values with
//! [`MetricsServer::set_gauge`] and [`MetricsServer::set_counter`], and
//! every scrape also carries the per-operation collective statistics of
//! [`crate::stats`] (which starting the server switches on). Requests are
//! read with a bound on size (8 KiB) and time (5 s), each on its own
//! short-lived thread, so a slow or silent client cannot hold up a scrape.
//! Dropping the server stops it.

use std::collections::BTreeMap;
use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The most bytes of a request head read.
const MAX_HEAD: usize = 8 * 1024;
/// How long a client has to send its request head (and to take the
/// answer).
const IO_TIMEOUT: Duration = Duration::from_secs(5);
/// Connections served at once; past it, new ones are closed unanswered.
const MAX_IN_FLIGHT: usize = 32;
/// The exposition format's content type.
const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// A metric family's type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Gauge,
    Counter,
}

impl Kind {
    fn as_str(self) -> &'static str {
        match self {
            Kind::Gauge => "gauge",
            Kind::Counter => "counter",
        }
    }
}

/// One metric family: its help, its type and one value per label set
/// (label names sorted, so a set is one key whatever order it came in).
#[derive(Debug, Clone)]
struct Family {
    help: String,
    kind: Kind,
    samples: BTreeMap<Vec<(String, String)>, f64>,
}

type Registry = BTreeMap<String, Family>;

/// Serves live metrics over HTTP until dropped.
pub struct MetricsServer {
    addr: SocketAddr,
    registry: Arc<Mutex<Registry>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl MetricsServer {
    /// Binds `addr` (`host:port`, e.g. `127.0.0.1:9400`, or `0.0.0.0:0`
    /// for any free port), switches on the collective statistics and
    /// serves `GET /metrics` from a background thread.
    pub fn start(addr: &str) -> Result<MetricsServer, String> {
        let server = MetricsServer::bind(addr)?;
        crate::stats::enable();
        Ok(server)
    }

    /// [`MetricsServer::start`] without switching on the statistics.
    fn bind(addr: &str) -> Result<MetricsServer, String> {
        let listener = TcpListener::bind(addr).map_err(|e| bind_error(addr, &e))?;
        let local = listener
            .local_addr()
            .map_err(|e| format!("--metrics-addr {addr}: {e}"))?;
        let registry = Arc::new(Mutex::new(Registry::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (registry, stop) = (registry.clone(), stop.clone());
            std::thread::Builder::new()
                .name("braid-metrics".into())
                .spawn(move || serve(listener, registry, stop))
                .map_err(|e| format!("--metrics-addr {addr}: cannot start its thread: {e}"))?
        };
        Ok(MetricsServer {
            addr: local,
            registry,
            stop,
            thread: Some(thread),
        })
    }

    /// The address it listens on (with the port chosen, if `:0` was
    /// asked for).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Sets gauge `name{labels}` to `value`. `help` describes the family;
    /// the latest given is shown.
    pub fn set_gauge(&self, name: &str, help: &str, labels: &[(&str, &str)], value: f64) {
        self.set(Kind::Gauge, name, help, labels, value);
    }

    /// Sets counter `name{labels}` to `value`, its total so far (the
    /// caller keeps the totals; by convention counter names end in
    /// `_total`). `help` describes the family; the latest given is shown.
    pub fn set_counter(&self, name: &str, help: &str, labels: &[(&str, &str)], value: f64) {
        self.set(Kind::Counter, name, help, labels, value);
    }

    fn set(&self, kind: Kind, name: &str, help: &str, labels: &[(&str, &str)], value: f64) {
        let name = sanitize(name, true);
        let key = label_key(labels);
        let mut reg = lock(&self.registry);
        let family = reg.entry(name).or_insert_with(|| Family {
            help: String::new(),
            kind,
            samples: BTreeMap::new(),
        });
        if family.kind != kind {
            // A family has one type: the latest use wins, and the old
            // samples, of the other type, go.
            family.kind = kind;
            family.samples.clear();
        }
        if family.help != help {
            family.help = help.to_string();
        }
        family.samples.insert(key, value);
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the blocking accept with a connection of our own.
        let mut wake = self.addr;
        if wake.ip().is_unspecified() {
            wake.set_ip(match wake.ip() {
                IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::LOCALHOST),
                IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::LOCALHOST),
            });
        }
        let woke = TcpStream::connect_timeout(&wake, Duration::from_secs(1)).is_ok();
        if let Some(t) = self.thread.take() {
            // Without the wake-up the thread would wait for the next
            // client: leave it rather than hang here.
            if woke {
                let _ = t.join();
            }
        }
    }
}

/// Explains a failed bind and what to do about it.
fn bind_error(addr: &str, e: &io::Error) -> String {
    let what = match e.kind() {
        io::ErrorKind::AddrInUse => "address in use (pick another port, or :0 for any)".to_string(),
        io::ErrorKind::AddrNotAvailable => {
            "address not available on this host (use 127.0.0.1, 0.0.0.0 or one of its addresses)"
                .to_string()
        }
        io::ErrorKind::PermissionDenied => {
            "permission denied (ports below 1024 need privileges: pick a higher one)".to_string()
        }
        _ => format!("{e} (expected host:port, e.g. 127.0.0.1:9400, or 0.0.0.0:0 for any port)"),
    };
    format!("--metrics-addr {addr}: {what}")
}

fn lock(registry: &Mutex<Registry>) -> MutexGuard<'_, Registry> {
    registry.lock().unwrap_or_else(|p| p.into_inner())
}

/// The server thread: accepts connections until told to stop, handing
/// each to a short-lived thread.
fn serve(listener: TcpListener, registry: Arc<Mutex<Registry>>, stop: Arc<AtomicBool>) {
    let in_flight = Arc::new(AtomicUsize::new(0));
    for conn in listener.incoming() {
        if stop.load(Ordering::SeqCst) {
            break;
        }
        let Ok(stream) = conn else {
            // A connection that failed before it was accepted (e.g.
            // reset); on running out of descriptors, do not spin.
            std::thread::sleep(Duration::from_millis(10));
            continue;
        };
        if in_flight.fetch_add(1, Ordering::SeqCst) >= MAX_IN_FLIGHT {
            in_flight.fetch_sub(1, Ordering::SeqCst);
            continue; // dropped: closed unanswered
        }
        let (registry, count) = (registry.clone(), in_flight.clone());
        let spawned = std::thread::Builder::new()
            .name("braid-metrics-conn".into())
            .spawn(move || {
                let _ = handle(stream, &registry);
                count.fetch_sub(1, Ordering::SeqCst);
            });
        if spawned.is_err() {
            in_flight.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// Answers one connection.
fn handle(mut stream: TcpStream, registry: &Mutex<Registry>) -> io::Result<()> {
    stream.set_write_timeout(Some(IO_TIMEOUT))?;
    let head = match read_head(&mut stream)? {
        Some(head) => head,
        None => return respond(&mut stream, "431 Request Header Fields Too Large", "", ""),
    };
    let line = head.lines().next().unwrap_or("");
    let mut parts = line.split(' ');
    let (method, target, version) = (parts.next(), parts.next(), parts.next());
    let (Some(method), Some(target), Some(version)) = (method, target, version) else {
        return respond(&mut stream, "400 Bad Request", "", "bad request line\n");
    };
    if parts.next().is_some() || !version.starts_with("HTTP/") {
        return respond(&mut stream, "400 Bad Request", "", "bad request line\n");
    }
    let path = target.split(['?', '#']).next().unwrap_or("");
    if path != "/metrics" && path != "/" {
        return respond(
            &mut stream,
            "404 Not Found",
            "",
            "not found: try /metrics\n",
        );
    }
    if method != "GET" {
        return respond(
            &mut stream,
            "405 Method Not Allowed",
            "Allow: GET\r\n",
            "only GET\n",
        );
    }
    let body = render(&lock(registry));
    respond(&mut stream, "200 OK", "", &body)
}

/// Reads the request head (through the blank line), within
/// [`IO_TIMEOUT`] in all; `None` if it is longer than [`MAX_HEAD`].
fn read_head(stream: &mut TcpStream) -> io::Result<Option<String>> {
    let deadline = Instant::now() + IO_TIMEOUT;
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        stream.set_read_timeout(Some(left))?;
        let n = stream.read(&mut chunk)?;
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        buf.extend_from_slice(&chunk[..n]);
        let end = find(&buf, b"\r\n\r\n")
            .map(|i| i + 4)
            .or_else(|| find(&buf, b"\n\n").map(|i| i + 2));
        if let Some(end) = end {
            if end > MAX_HEAD {
                return Ok(None);
            }
            return Ok(Some(String::from_utf8_lossy(&buf[..end]).into_owned()));
        }
        if buf.len() >= MAX_HEAD {
            return Ok(None);
        }
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// Writes a whole response and closes the connection.
fn respond(stream: &mut TcpStream, status: &str, extra: &str, body: &str) -> io::Result<()> {
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {CONTENT_TYPE}\r\nContent-Length: {}\r\n\
         Connection: close\r\n{extra}\r\n",
        body.len()
    );
    let mut out = head.into_bytes();
    out.extend_from_slice(body.as_bytes());
    stream.write_all(&out)?;
    stream.flush()?;
    stream.shutdown(Shutdown::Write)?;
    // Closing with unread input would reset the connection, and the
    // client could lose the answer: read what is left until it closes
    // (briefly, and a bounded amount).
    stream.set_read_timeout(Some(Duration::from_secs(1)))?;
    let _ = io::copy(&mut stream.take(64 * 1024), &mut io::sink());
    Ok(())
}

/// The exposition body: the registry's families and the collective
/// statistics, families sorted by name.
fn render(registry: &Registry) -> String {
    let mut families: BTreeMap<&str, &Family> =
        registry.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let collectives = collective_families();
    for (name, family) in &collectives {
        families.insert(name, family); // ours win over a clash
    }
    let mut out = String::new();
    for (name, family) in families {
        out.push_str(&format!(
            "# HELP {name} {}\n# TYPE {name} {}\n",
            escape_help(&family.help),
            family.kind.as_str()
        ));
        for (labels, value) in &family.samples {
            out.push_str(name);
            if !labels.is_empty() {
                out.push('{');
                for (i, (k, v)) in labels.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    out.push_str(&format!("{k}=\"{}\"", escape_label(v)));
                }
                out.push('}');
            }
            out.push(' ');
            out.push_str(&float(*value));
            out.push('\n');
        }
    }
    out
}

/// `braid_collective_{ops,bytes,seconds}_total{op=...}` from
/// [`crate::stats::snapshot`].
fn collective_families() -> Vec<(String, Family)> {
    let snap = crate::stats::snapshot();
    let family = |help: &str, value: &dyn Fn(&crate::stats::OpTotals) -> f64| Family {
        help: help.to_string(),
        kind: Kind::Counter,
        samples: snap
            .iter()
            .map(|(op, t)| (vec![("op".to_string(), op.clone())], value(t)))
            .collect(),
    };
    vec![
        (
            "braid_collective_ops_total".to_string(),
            family("Collective operations run, by operation.", &|t| {
                t.count as f64
            }),
        ),
        (
            "braid_collective_bytes_total".to_string(),
            family(
                "Bytes of the collectives' buffers (this rank's input), by operation.",
                &|t| t.bytes as f64,
            ),
        ),
        (
            "braid_collective_seconds_total".to_string(),
            family("Seconds collectives ran, by operation.", &|t| t.seconds),
        ),
    ]
}

/// A label set as a key: names sanitized, sorted by name (a repeated
/// name keeps its last value).
fn label_key(labels: &[(&str, &str)]) -> Vec<(String, String)> {
    let map: BTreeMap<String, String> = labels
        .iter()
        .map(|(k, v)| (sanitize(k, false), v.to_string()))
        .collect();
    map.into_iter().collect()
}

/// `name` made a valid metric name (`[a-zA-Z_:][a-zA-Z0-9_:]*`) or label
/// name (the same without colons): other characters become `_`, and a
/// leading digit gets a `_` before it.
fn sanitize(name: &str, colons: bool) -> String {
    let ok = |c: char| c.is_ascii_alphanumeric() || c == '_' || (colons && c == ':');
    let mut out: String = name.chars().map(|c| if ok(c) { c } else { '_' }).collect();
    if !out.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_' || (colons && c == ':')) {
        out.insert(0, '_');
    }
    out
}

/// A label value escaped: backslash, double quote and newline.
fn escape_label(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

/// Help text escaped: backslash and newline.
fn escape_help(h: &str) -> String {
    h.replace('\\', "\\\\").replace('\n', "\\n")
}

/// A value as Prometheus parses it.
fn float(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v == f64::INFINITY {
        "+Inf".into()
    } else if v == f64::NEG_INFINITY {
        "-Inf".into()
    } else {
        format!("{v}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `GET path` (or any raw request) against `addr`: the whole answer.
    fn fetch_raw(addr: SocketAddr, request: &str) -> String {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(request.as_bytes()).unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    }

    fn get(addr: SocketAddr, path: &str) -> String {
        fetch_raw(addr, &format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n"))
    }

    /// Splits an answer into its status line, its headers and its body.
    fn parts(answer: &str) -> (&str, Vec<&str>, &str) {
        let (head, body) = answer.split_once("\r\n\r\n").unwrap();
        let mut lines = head.split("\r\n");
        let status = lines.next().unwrap();
        (status, lines.collect(), body)
    }

    // The tests but the last serve with `bind`, not `start`: switching the
    // statistics on is process-wide and would upset `stats`' own test.

    #[test]
    fn a_scrape_gets_the_values_set_in_the_exposition_format() {
        let m = MetricsServer::bind("127.0.0.1:0").unwrap();
        m.set_gauge(
            "braid_loss",
            "Training loss.",
            &[("rank", "0"), ("job", "a \"b\"\\c\nd")],
            2.5,
        );
        m.set_gauge("braid_loss", "Training loss.", &[("rank", "1")], 3.0);
        m.set_counter("braid_steps_total", "Steps run.", &[], 7.0);
        m.set_counter("braid_steps_total", "Steps run.", &[], 8.0);
        m.set_gauge("braid_lr", "Learning rate.", &[], f64::INFINITY);
        m.set_gauge("bad name-1", "x", &[("9l", "v")], f64::NAN);

        let answer = get(m.local_addr(), "/metrics");
        let (status, headers, body) = parts(&answer);
        assert_eq!(status, "HTTP/1.1 200 OK");
        assert!(headers.contains(&"Content-Type: text/plain; version=0.0.4; charset=utf-8"));
        assert!(headers.contains(&"Connection: close"));
        assert!(headers.contains(&format!("Content-Length: {}", body.len()).as_str()));
        let lines: Vec<&str> = body.lines().collect();
        let at = |l: &str| {
            lines
                .iter()
                .position(|x| *x == l)
                .unwrap_or_else(|| panic!("{l:?} not in\n{body}"))
        };
        let help = at("# HELP braid_loss Training loss.");
        assert_eq!(at("# TYPE braid_loss gauge"), help + 1);
        assert_eq!(
            at(r#"braid_loss{job="a \"b\"\\c\nd",rank="0"} 2.5"#),
            help + 2
        );
        assert_eq!(at(r#"braid_loss{rank="1"} 3"#), help + 3);
        assert_eq!(
            at("# TYPE braid_steps_total counter"),
            at("# HELP braid_steps_total Steps run.") + 1
        );
        at("braid_steps_total 8");
        at("braid_lr +Inf");
        at(r#"bad_name_1{_9l="v"} NaN"#);
        at("# TYPE braid_collective_ops_total counter");
        at("# HELP braid_collective_bytes_total Bytes of the collectives' buffers (this rank's input), by operation.");
        at("# TYPE braid_collective_seconds_total counter");
        // Families sorted by name.
        assert!(at("# TYPE bad_name_1 gauge") < at("# TYPE braid_collective_bytes_total counter"));
        assert!(at("# TYPE braid_loss gauge") < at("# TYPE braid_lr gauge"));
        assert!(at("# TYPE braid_lr gauge") < at("# TYPE braid_steps_total counter"));
        assert_eq!(get(m.local_addr(), "/"), answer);
    }

    #[test]
    fn other_paths_and_methods_are_refused() {
        let m = MetricsServer::bind("127.0.0.1:0").unwrap();
        let answer = get(m.local_addr(), "/nope");
        assert!(answer.starts_with("HTTP/1.1 404 Not Found\r\n"), "{answer}");
        let answer = fetch_raw(m.local_addr(), "POST /metrics HTTP/1.1\r\n\r\n");
        assert!(
            answer.starts_with("HTTP/1.1 405 Method Not Allowed\r\n"),
            "{answer}"
        );
        let answer = fetch_raw(m.local_addr(), "nonsense\r\n\r\n");
        assert!(
            answer.starts_with("HTTP/1.1 400 Bad Request\r\n"),
            "{answer}"
        );
        let big = format!("GET /metrics HTTP/1.1\r\nX: {}\r\n\r\n", "y".repeat(9000));
        let answer = fetch_raw(m.local_addr(), &big);
        assert!(answer.starts_with("HTTP/1.1 431 "), "{answer}");
    }

    #[test]
    fn an_address_in_use_is_named_in_the_error() {
        let m = MetricsServer::bind("127.0.0.1:0").unwrap();
        let addr = m.local_addr().to_string();
        let err = MetricsServer::bind(&addr).err().unwrap();
        assert!(err.contains(&addr), "{err}");
        assert!(err.contains("in use"), "{err}");
        let err = MetricsServer::bind("not an address").err().unwrap();
        assert!(err.contains("not an address"), "{err}");
    }

    #[test]
    fn a_silent_client_does_not_hold_up_a_scrape() {
        let m = MetricsServer::bind("127.0.0.1:0").unwrap();
        let _silent = TcpStream::connect(m.local_addr()).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        let t = Instant::now();
        let answer = get(m.local_addr(), "/metrics");
        assert!(answer.starts_with("HTTP/1.1 200 OK\r\n"), "{answer}");
        assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    }

    #[test]
    fn dropping_the_server_stops_it() {
        let m = MetricsServer::bind("127.0.0.1:0").unwrap();
        let addr = m.local_addr();
        let _silent = TcpStream::connect(addr).unwrap();
        let t = Instant::now();
        drop(m);
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
        assert!(TcpStream::connect(addr).is_err());
    }

    #[test]
    fn values_print_as_prometheus_parses_them() {
        assert_eq!(float(1.0), "1");
        assert_eq!(float(-0.25), "-0.25");
        assert_eq!(float(f64::NEG_INFINITY), "-Inf");
        assert_eq!(sanitize("a:b.c", true), "a:b_c");
        assert_eq!(sanitize("a:b", false), "a_b");
        assert_eq!(sanitize("", true), "_");
        assert_eq!(escape_help("a\\b\nc\"d"), "a\\\\b\\nc\"d");
    }

    /// Runs in a child process of its own (the test binary again, with
    /// this one test), since it switches the statistics on for good.
    #[test]
    fn collective_spans_show_up_in_the_scrape() {
        const CHILD: &str = "BRAID_METRICS_TEST_CHILD";
        const NAME: &str = "metrics::tests::collective_spans_show_up_in_the_scrape";
        if std::env::var_os(CHILD).is_none() {
            let out = std::process::Command::new(std::env::current_exe().unwrap())
                .args([NAME, "--exact", "--test-threads=1", "--nocapture"])
                .env(CHILD, "1")
                .output()
                .unwrap();
            let stdout = String::from_utf8_lossy(&out.stdout);
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(out.status.success(), "{stdout}\n{stderr}");
            assert!(stdout.contains("1 passed"), "{stdout}\n{stderr}");
            return;
        }
        use crate::recorder::{record, track, Cat, Span};
        let m = MetricsServer::start("127.0.0.1:0").unwrap();
        record(Span {
            name: "metrics_test_op".into(),
            cat: Cat::Comm,
            tid: track::COLLECTIVES,
            ts_us: 0.0,
            dur_us: 500.0,
            args: vec![("bytes", 1024.into())],
        });
        let answer = get(m.local_addr(), "/metrics");
        let (_, _, body) = parts(&answer);
        let lines: Vec<&str> = body.lines().collect();
        for l in [
            r#"braid_collective_ops_total{op="metrics_test_op"} 1"#,
            r#"braid_collective_bytes_total{op="metrics_test_op"} 1024"#,
            r#"braid_collective_seconds_total{op="metrics_test_op"} 0.0005"#,
            "# HELP braid_collective_ops_total Collective operations run, by operation.",
        ] {
            assert!(lines.contains(&l), "{l:?} not in\n{body}");
        }
    }
}
