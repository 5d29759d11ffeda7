//! Worker processes: starting one in its own process group, and the
//! operating-system plumbing that guarantees none outlives the launcher.
//!
//! Each worker leads a process group, so a signal to the group reaches the
//! worker and everything it started (`sh -c` children, data loaders). The
//! launcher also makes itself a *child subreaper*: grandchildren that escape
//! their group and are orphaned are re-parented to the launcher instead of
//! init, and [`sweep_orphans`] kills them at the end. Children that exit
//! are collected as they go ([`exited_child`], [`reap`]), so that none is
//! left a zombie while the launcher starts or watches the others.

use crate::error::LaunchError;
use crate::output::{self, Routes, Stream, Tail};
use nix::sys::signal::{killpg, Signal};
use nix::sys::wait::{waitid, waitpid, Id, WaitPidFlag};
use nix::unistd::Pid;
use std::ffi::OsString;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread::JoinHandle;
use std::time::Instant;

/// Everything needed to start one worker.
#[derive(Debug, Clone)]
pub struct WorkerSpec {
    /// Global rank.
    pub rank: usize,
    /// Rank on this node.
    pub local_rank: usize,
    /// Program and arguments.
    pub command: Vec<OsString>,
    /// Variables added to the launcher's environment.
    pub env: Vec<(String, String)>,
    /// Whether the worker's stdout lines get the `[rank N] ` prefix (its
    /// stderr lines always do).
    pub prefix_stdout: bool,
    /// Which of its streams reach the console and which its log file.
    pub routes: Routes,
}

/// A running (or finished) worker.
pub struct Worker {
    /// Global rank.
    pub rank: usize,
    /// Rank on this node.
    pub local_rank: usize,
    child: Child,
    /// Exit status once reaped.
    pub status: Option<ExitStatus>,
    /// When the exit was noticed.
    pub exited_at: Option<Instant>,
    /// Last lines of stderr.
    pub tail: Tail,
    pumps: Vec<JoinHandle<()>>,
}

impl Worker {
    /// Starts a worker as `spec` says, forwarding its output.
    pub fn spawn(
        spec: &WorkerSpec,
        log_dir: Option<&Path>,
        attempt: u32,
    ) -> Result<Worker, LaunchError> {
        let program = spec.command[0].clone();
        let mut cmd = Command::new(&program);
        cmd.args(&spec.command[1..])
            .envs(spec.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0);
        let launcher = std::process::id() as libc::pid_t;
        // SAFETY: the closure runs in the forked child before exec and calls
        // only async-signal-safe functions (prctl, getppid); it allocates
        // nothing and touches no locks.
        unsafe {
            cmd.pre_exec(move || {
                // Die with the launcher, even if it is killed with SIGKILL.
                if libc::prctl(
                    libc::PR_SET_PDEATHSIG,
                    libc::SIGKILL as libc::c_ulong,
                    0,
                    0,
                    0,
                ) != 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                // The launcher may have died before prctl took effect.
                if libc::getppid() != launcher {
                    return Err(std::io::Error::other(
                        "the launcher exited while starting the worker",
                    ));
                }
                Ok(())
            });
        }
        let spawn_error = |source| LaunchError::Spawn {
            rank: spec.rank,
            program: program.to_string_lossy().into_owned(),
            source,
        };
        let log = match log_dir.filter(|_| spec.routes.any_file()) {
            Some(dir) => Some(output::open_log(dir, spec.rank, attempt).map_err(|source| {
                LaunchError::Io {
                    what: format!(
                        "cannot open the log file of rank {} in {}",
                        spec.rank,
                        dir.display()
                    ),
                    source,
                }
            })?),
            None => None,
        };
        let mut child = cmd.spawn().map_err(spawn_error)?;
        let tail = Tail::default();
        let mut pumps = Vec::new();
        let routes = spec.routes;
        let console = |shown: bool, stream: Stream| if shown { stream } else { Stream::Hidden };
        if let Some(out) = child.stdout.take() {
            pumps.push(output::pump(
                out,
                spec.rank,
                console(
                    routes.stdout.console,
                    Stream::Stdout {
                        prefix: spec.prefix_stdout,
                    },
                ),
                log.clone().filter(|_| routes.stdout.file),
                None,
            ));
        }
        if let Some(err) = child.stderr.take() {
            pumps.push(output::pump(
                err,
                spec.rank,
                console(routes.stderr.console, Stream::Stderr),
                log.filter(|_| routes.stderr.file),
                Some(tail.clone()),
            ));
        }
        Ok(Worker {
            rank: spec.rank,
            local_rank: spec.local_rank,
            child,
            status: None,
            exited_at: None,
            tail,
            pumps,
        })
    }

    /// The worker's process id (also its process group id).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Checks, without blocking, whether the worker has exited.
    pub fn poll(&mut self) -> Option<ExitStatus> {
        if self.status.is_none() {
            if let Ok(Some(status)) = self.child.try_wait() {
                self.status = Some(status);
                self.exited_at = Some(Instant::now());
            }
        }
        self.status
    }

    /// Sends `signal` to the worker's whole process group. Safe to call after
    /// the worker exited: what remains of its group still gets the signal.
    pub fn signal_group(&self, signal: Signal) {
        let _ = killpg(Pid::from_raw(self.child.id() as i32), signal);
    }

    /// Waits (bounded) for the output threads to drain the worker's pipes.
    pub fn finish_output(&mut self, deadline: Instant) {
        for pump in std::mem::take(&mut self.pumps) {
            while !pump.is_finished() && Instant::now() < deadline {
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            if pump.is_finished() {
                let _ = pump.join();
            }
        }
    }
}

/// How a process ended, in words: `exit code 3`, `signal SIGKILL`.
pub fn describe_status(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit code {code}"),
        (None, Some(sig)) => format!("signal {}", signal_name(sig)),
        _ => format!("{status}"),
    }
}

/// The launcher's exit code for a worker's status: its exit code, or
/// 128 + signal number as a shell reports it.
pub fn exit_code_of(status: ExitStatus) -> i32 {
    match (status.code(), status.signal()) {
        (Some(code), _) => code,
        (None, Some(sig)) => 128 + sig,
        _ => 1,
    }
}

/// `SIGKILL` for 9, and so on; `signal 99` for unknown numbers.
pub fn signal_name(sig: i32) -> String {
    Signal::try_from(sig)
        .map(|s| s.as_str().to_string())
        .unwrap_or_else(|_| format!("signal {sig}"))
}

/// Makes the launcher adopt orphaned descendants (Linux).
pub fn become_subreaper() {
    // SAFETY: prctl with PR_SET_CHILD_SUBREAPER only changes a flag of this
    // process; it takes no pointers.
    unsafe {
        libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1 as libc::c_ulong, 0, 0, 0);
    }
}

/// The pid of a child of the launcher (a worker or an adopted orphan) that
/// has exited and awaits collection, if any. The child is left as it is
/// (`WNOWAIT`): a worker's status is collected by its [`Worker::poll`], an
/// orphan's by [`reap`]; until then the same pid may be reported again.
pub fn exited_child() -> Option<u32> {
    let flags = WaitPidFlag::WEXITED | WaitPidFlag::WNOHANG | WaitPidFlag::WNOWAIT;
    match waitid(Id::All, flags) {
        Ok(status) => status.pid().map(|pid| pid.as_raw() as u32),
        // ECHILD: no children at all.
        Err(_) => None,
    }
}

/// Collects the exit status of child `pid` (an adopted orphan, not a
/// [`Worker`], whose status its `Child` collects), without waiting.
pub fn reap(pid: u32) {
    let _ = waitpid(Pid::from_raw(pid as i32), Some(WaitPidFlag::WNOHANG));
}

/// Kills and reaps every remaining child of the launcher that is not one of
/// `keep` (orphaned grandchildren adopted as subreaper). Returns how many.
pub fn sweep_orphans(keep: &[u32]) -> usize {
    let me = std::process::id();
    let mut killed = 0;
    for _ in 0..20 {
        let orphans: Vec<u32> = children_of(me)
            .into_iter()
            .filter(|p| !keep.contains(p))
            .collect();
        if orphans.is_empty() {
            break;
        }
        for pid in orphans {
            let pid = Pid::from_raw(pid as i32);
            let _ = nix::sys::signal::kill(pid, Signal::SIGKILL);
            let _ = waitpid(pid, None);
            killed += 1;
        }
    }
    killed
}

/// Process ids whose parent is `parent`, read from /proc.
fn children_of(parent: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| parent_of(*pid) == Some(parent))
        .collect()
}

fn parent_of(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces and parentheses: skip past the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(1)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_signals() {
        assert_eq!(signal_name(9), "SIGKILL");
        assert_eq!(signal_name(15), "SIGTERM");
        assert_eq!(signal_name(999), "signal 999");
    }

    #[test]
    fn reads_parent_pid_from_proc() {
        assert_eq!(
            parent_of(std::process::id()),
            Some(std::os::unix::process::parent_id())
        );
    }

    /// Waits until `exited_child` reports `pid` (it may report others of
    /// this test process first, which it leaves alone).
    fn until_reported(pid: u32) -> bool {
        let deadline = Instant::now() + std::time::Duration::from_secs(10);
        while Instant::now() < deadline {
            if exited_child() == Some(pid) {
                return true;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        false
    }

    #[test]
    fn exited_children_are_reported_then_collected() {
        // A worker: reported without being reaped, then collected by poll.
        let spec = WorkerSpec {
            rank: 0,
            local_rank: 0,
            command: vec!["sh".into(), "-c".into(), "exit 3".into()],
            env: vec![],
            prefix_stdout: true,
            routes: Routes::default(),
        };
        let mut w = Worker::spawn(&spec, None, 0).unwrap();
        assert!(until_reported(w.pid()));
        assert!(until_reported(w.pid()), "WNOWAIT leaves it for its owner");
        assert_eq!(w.poll().and_then(|s| s.code()), Some(3));
        assert_ne!(exited_child(), Some(w.pid()));
        w.finish_output(Instant::now() + std::time::Duration::from_secs(2));

        // Any other child: reaped by pid.
        let pid = Command::new("true").spawn().unwrap().id();
        assert!(until_reported(pid));
        reap(pid);
        assert_ne!(exited_child(), Some(pid));
        assert!(
            parent_of(pid) != Some(std::process::id()),
            "{pid} was reaped"
        );
    }
}
