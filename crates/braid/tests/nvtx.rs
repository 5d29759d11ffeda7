//! NVTX ranges through the real binary and a real injection library: a
//! small NVTX tool written here in C (compiled with the system's `cc`,
//! which Rust's linker needs anyway) attaches the way Nsight's does —
//! `NVTX_INJECTION64_PATH` names it, braid calls its
//! `InitializeInjectionNvtx2` with its export table, the tool writes its
//! push and pop into braid's core function table — and logs every range
//! braid pushes and pops. Two data-parallel CPU ranks train 3 steps with
//! `BRAID_NVTX=1`: each process's ranges nest and balance, and name the
//! steps, their parts and the collectives. Without `BRAID_NVTX` and
//! `--trace` the tool is never loaded.

mod common;

use common::{braid, run, TempDir};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// The tool: logs `PID push NAME` and `PID pop` lines into the file
/// `NVTX_PROBE_OUT` names (one `write` each, appended, so that processes
/// do not interleave within a line), and `PID attached N` once.
const PROBE_C: &str = r#"
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef const void *(*get_export_table_fn)(unsigned int id);
typedef int (*get_module_table_fn)(int module, void ***table, unsigned int *size);
struct callbacks { size_t struct_size; get_module_table_fn get_module_table; };
struct version_info { size_t struct_size; unsigned int version; unsigned int reserved; void (*set)(unsigned int); };

static int out = -1;

static void line(const char *what, const char *name) {
    char buf[600];
    int n = snprintf(buf, sizeof buf, "%d %s%s%s\n", (int)getpid(), what, name ? " " : "", name ? name : "");
    if (out >= 0 && n > 0) write(out, buf, (size_t)n);
}

static int push_a(const char *name) { line("push", name); return 0; }
static int pop(void) { line("pop", 0); return 0; }

int InitializeInjectionNvtx2(get_export_table_fn get) {
    const char *path = getenv("NVTX_PROBE_OUT");
    if (!path) return 0;
    out = open(path, O_WRONLY | O_CREAT | O_APPEND, 0644);
    const struct callbacks *cb = get(1);
    const struct version_info *v = get(3);
    if (!cb || cb->struct_size < sizeof *cb || !v || v->version != 3) return 0;
    void **core = 0;
    unsigned int n = 0;
    if (!cb->get_module_table(1, &core, &n) || n < 12 || core[0] || core[n]) return 0;
    *(void **)core[9] = (void *)push_a;
    *(void **)core[11] = (void *)pop;
    char buf[32];
    snprintf(buf, sizeof buf, "%u", n);
    line("attached", buf);
    return 1;
}
"#;

/// Compiles the tool into `dir`; `None` (the test says skipped) without a
/// C compiler.
fn build_probe(dir: &Path) -> Option<PathBuf> {
    let src = dir.join("probe.c");
    std::fs::write(&src, PROBE_C).unwrap();
    let lib = dir.join("libprobe.so");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let out = Command::new(&cc)
        .args(["-shared", "-fPIC", "-O1", "-o"])
        .arg(&lib)
        .arg(&src)
        .output();
    match out {
        Ok(o) if o.status.success() => Some(lib),
        Ok(o) => panic!(
            "{cc} failed to build the NVTX probe: {}",
            String::from_utf8_lossy(&o.stderr)
        ),
        Err(e) => {
            eprintln!("skipped: no C compiler ({cc}: {e})");
            None
        }
    }
}

fn train_cmd(dir: &TempDir, lib: &Path, log: &Path) -> Command {
    let mut c = braid();
    c.current_dir(dir.path())
        .env("NVTX_INJECTION64_PATH", lib)
        .env("NVTX_PROBE_OUT", log)
        .args([
            "train",
            "--model",
            "L2-H2-C32-V259-T16",
            "--tokenizer",
            "bytes",
            "--batch",
            "2",
            "--steps",
            "3",
            "--eval-every",
            "0",
            "--nproc-per-node",
            "2",
        ]);
    c
}

#[test]
fn ranges_reach_an_attached_nvtx_tool_nested_and_named() {
    let dir = TempDir::new("nvtx");
    let Some(lib) = build_probe(dir.path()) else {
        return;
    };

    // Asked for: every rank's process attaches and names its work.
    let log = dir.path().join("ranges.txt");
    let mut cmd = train_cmd(&dir, &lib, &log);
    cmd.env("BRAID_NVTX", "1");
    let f = run(cmd, Duration::from_secs(60));
    assert_eq!(f.code, Some(0), "{f:?}");
    assert!(
        f.stdout
            .contains("NVTX: ranges go to the attached profiler"),
        "{}",
        f.stdout
    );
    let text = std::fs::read_to_string(&log).unwrap();
    let mut per_pid: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for l in text.lines() {
        let (pid, rest) = l.split_once(' ').unwrap();
        per_pid.entry(pid).or_default().push(rest);
    }
    assert_eq!(per_pid.len(), 2, "one tool per rank's process:\n{text}");
    for (pid, lines) in &per_pid {
        assert_eq!(lines[0], "attached 16", "process {pid}");
        // Ranges nest and every push is popped.
        let mut stack = Vec::new();
        let mut names = Vec::new();
        for l in &lines[1..] {
            match l.strip_prefix("push ") {
                Some(name) => {
                    stack.push(name);
                    names.push(name);
                }
                None => {
                    assert_eq!(*l, "pop", "process {pid}");
                    assert!(stack.pop().is_some(), "process {pid}: a pop without a push");
                }
            }
        }
        assert!(
            stack.is_empty(),
            "process {pid}: ranges left open: {stack:?}"
        );
        for want in [
            "step 1",
            "step 3",
            "data",
            "forward",
            "backward",
            "optimizer",
        ] {
            assert!(
                names.contains(&want),
                "process {pid}: no range {want:?} in {names:?}"
            );
        }
        // The gradients' reduction between the two ranks, by operation.
        assert!(
            names
                .iter()
                .any(|n| n.starts_with("all_reduce") || n.starts_with("reduce")),
            "process {pid}: no collective among {names:?}"
        );
        // A collective of a step lies inside that step's range.
        let step2 = lines.iter().position(|l| *l == "push step 2").unwrap();
        let comm = lines[step2..]
            .iter()
            .position(|l| l.starts_with("push all_reduce") || l.starts_with("push reduce"))
            .map(|i| i + step2);
        let next = lines.iter().position(|l| *l == "push step 3").unwrap();
        assert!(
            comm.is_some_and(|c| c < next),
            "process {pid}: step 2 has no collective"
        );
    }

    // Not asked for (no BRAID_NVTX, no --trace): the tool is not loaded.
    let quiet = dir.path().join("quiet.txt");
    let f = run(train_cmd(&dir, &lib, &quiet), Duration::from_secs(60));
    assert_eq!(f.code, Some(0), "{f:?}");
    assert!(!quiet.exists(), "the tool was loaded unasked");

    // Asked for without a tool: a note, and the run goes on.
    let mut cmd = train_cmd(&dir, &lib, &quiet);
    cmd.env("BRAID_NVTX", "1")
        .env_remove("NVTX_INJECTION64_PATH");
    let f = run(cmd, Duration::from_secs(60));
    assert_eq!(f.code, Some(0), "{f:?}");
    assert!(f.stdout.contains("no profiler is attached"), "{}", f.stdout);

    // A path that is no library: a warning naming it, and the run goes on.
    let mut cmd = train_cmd(&dir, &dir.path().join("missing.so"), &quiet);
    cmd.env("BRAID_NVTX", "1");
    let f = run(cmd, Duration::from_secs(60));
    assert_eq!(f.code, Some(0), "{f:?}");
    assert!(
        f.stderr
            .contains("cannot load the tool's injection library")
            && f.stderr.contains("missing.so"),
        "{}",
        f.stderr
    );

    // A bad value of the variable is one clear error.
    let mut cmd = train_cmd(&dir, &lib, &quiet);
    cmd.env("BRAID_NVTX", "yes");
    let f = run(cmd, Duration::from_secs(60));
    assert_ne!(f.code, Some(0));
    assert!(f.stderr.contains("BRAID_NVTX=yes"), "{}", f.stderr);
}
