//! `braid train --ps`: each rank's process keeps its role (server or
//! worker) in a child process and starts it again when it dies of a
//! signal (`kill -9`, a crash), up to `--ps-restarts` times, where the
//! role can come back: a server of a synchronous run whose servers update
//! and which writes checkpoints (it restores its shard from the last one
//! and the workers bring it level), and a worker of a run whose servers
//! hold the parameters (it rejoins at the servers' step). The launcher
//! sees the rank's process live on meanwhile, so the other ranks keep
//! running. A child that exits with an error is not restarted: its error
//! is the run's.

use super::train::TrainArgs;
use super::train_ps::Ps;
use braid_core::env;
use braid_ps::{Mode, UpdateAt};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::Command;

/// The attempt this process is, when it is a role's child.
pub fn attempt() -> Option<u32> {
    std::env::var(env::BRAID_PS_CHILD).ok()?.parse().ok()
}

/// Why the role of `ps` cannot come back after its child died, if it
/// cannot.
fn cannot_come_back(ps: &Ps, a: &TrainArgs) -> Option<String> {
    match ps.server {
        Some(i) => {
            (ps.mode != Mode::Sync || ps.update_at != UpdateAt::Server || a.ckpt_dir.is_none())
                .then(|| {
                    format!(
                "parameter server {i} comes back only in a synchronous run whose servers update \
                 and which writes checkpoints (--ps-mode sync --ps-update server --ckpt-dir DIR): \
                 it restores its shard from the last one"
            )
                })
        }
        None => (ps.update_at != UpdateAt::Server).then(|| {
            "a worker of a run whose servers only sum comes back with nothing to start from (the \
             servers hold no parameters): use --ps-update server"
                .to_string()
        }),
    }
}

/// Runs this rank's role in a child process, starting it again after a
/// death by signal while restarts are left; the child's exit code.
pub fn supervise(a: &TrainArgs, ps: &Ps) -> Result<i32, String> {
    let exe =
        std::env::current_exe().map_err(|e| format!("cannot find braid's executable: {e}"))?;
    let role = match ps.server {
        Some(i) => format!("parameter server {i}"),
        None => format!("worker {}", ps.world.rank),
    };
    let mut attempt = 0u32;
    loop {
        let mut cmd = Command::new(&exe);
        cmd.args(std::env::args_os().skip(1))
            .env(env::BRAID_PS_CHILD, attempt.to_string());
        // SAFETY: the closure runs in the forked child before exec and
        // calls only prctl, which is async-signal-safe; it allocates
        // nothing and touches no lock.
        unsafe {
            cmd.pre_exec(|| {
                // The child dies with this process (the launcher stopping
                // the rank).
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let status = cmd
            .status()
            .map_err(|e| format!("{role}: cannot start its process: {e}"))?;
        if let Some(code) = status.code() {
            return Ok(code);
        }
        let signal = status.signal().unwrap_or(0);
        if let Some(why) = cannot_come_back(ps, a) {
            return Err(format!("{role} was killed by signal {signal}; {why}"));
        }
        if attempt >= a.ps_restarts {
            return Err(format!(
                "{role} was killed by signal {signal}, and its --ps-restarts {} are used up",
                a.ps_restarts
            ));
        }
        attempt += 1;
        eprintln!(
            "{role} was killed by signal {signal}: starting it again ({attempt} of --ps-restarts \
             {})",
            a.ps_restarts
        );
    }
}
