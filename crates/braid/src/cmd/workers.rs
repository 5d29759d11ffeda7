//! Shared by the subcommands that run as distributed workers (`bench`,
//! `verify`): joining the world from the launcher's environment, or
//! starting N local workers of the same command through the launcher.

use braid_comm::{CommOptions, Communicator};

/// Whether this process was started as a worker of a distributed run
/// (`braid launch`, torchrun, or SLURM's task variables).
pub fn launched() -> bool {
    std::env::var_os(braid_core::env::WORLD_SIZE).is_some()
        || std::env::var_os(braid_core::slurm::PROCID_VAR).is_some()
}

/// Joins the world described by the environment with `options`.
pub fn init(options: CommOptions) -> Result<Communicator, String> {
    braid_core::WorldInfo::from_env()
        .map_err(|e| format!("{e}\n(run under `braid launch`, or pass --nproc-per-node N)"))?;
    Communicator::init_from_env_with(options).map_err(|e| e.to_string())
}

/// Every spelling of the worker count a command accepts: the one name
/// (torchrun's) and the aliases kept for old command lines.
pub const NPROC_FLAGS: [&str; 5] = [
    "--nproc-per-node",
    "--nproc_per_node",
    "--nproc",
    "--np",
    "--workers",
];

/// Re-runs the current command line, minus its worker count (any of
/// [`NPROC_FLAGS`]), as `np` local workers under the launcher; their
/// stdout lines carry `[rank N] ` only if `prefix_stdout`. Returns the
/// launcher's exit code.
pub fn relaunch_locally(np: usize, prefix_stdout: bool) -> Result<i32, String> {
    let exe =
        std::env::current_exe().map_err(|e| format!("cannot find the braid executable: {e}"))?;
    let mut command: Vec<std::ffi::OsString> = vec![exe.into()];
    let mut args = std::env::args_os().skip(1);
    while let Some(a) = args.next() {
        let s = a.to_string_lossy();
        if NPROC_FLAGS.contains(&&*s) {
            args.next();
        } else if !NPROC_FLAGS.iter().any(|f| s.starts_with(&format!("{f}="))) {
            command.push(a);
        }
    }
    let cores = braid_launch::config::host_cores();
    let limit = braid_launch::config::nproc_limit(cores);
    if np > limit {
        return Err(format!(
            "--nproc-per-node {np}: this host has {cores} CPU core(s), and more than {limit} local \
             workers is most likely a mistake; lower it, or start them under the launcher \
             anyway: `braid launch --force-nproc --nproc-per-node {np} -- braid ...` with this \
             command's other flags"
        ));
    }
    let options = braid_launch::LaunchOptions {
        nproc_per_node: np,
        standalone: true,
        command,
        prefix_stdout,
        ..Default::default()
    };
    let plan = options.resolve().map_err(|e| e.to_string())?;
    let signals = braid_launch::Signals::install().map_err(|e| e.to_string())?;
    braid_launch::launch(&plan, &signals).map_err(|e| e.to_string())
}

/// Makes SIGTERM (how a launcher stops the other workers when one fails)
/// end this worker with an error that names the cause instead of a silent
/// death: the communicator is aborted — after a moment, so that the
/// health monitor can first name a dead peer, whose reason then stands —
/// and the worker's own error path reports it. If the worker is still
/// there two seconds later, it exits with 128 + SIGTERM.
pub fn stop_on_sigterm(comm: &Communicator) {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let flag = Arc::new(AtomicBool::new(false));
    if signal_hook::flag::register(signal_hook::consts::SIGTERM, flag.clone()).is_err() {
        return; // SIGTERM keeps its default action.
    }
    // A weak handle: the watcher must not keep the communicator alive, or
    // it never ends and never tells the other ranks that this one left
    // cleanly (they would take its exit for a death).
    let (weak, rank) = (comm.downgrade(), comm.rank());
    let _ = std::thread::Builder::new()
        .name("braid-sigterm".into())
        .spawn(move || {
            while !flag.load(Ordering::SeqCst) {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            std::thread::sleep(std::time::Duration::from_millis(500));
            let comm = weak.upgrade();
            if let Some(comm) = &comm {
                comm.abort(
                    "stopped by signal SIGTERM (the launcher stops every worker when one fails)",
                );
            }
            std::thread::sleep(std::time::Duration::from_secs(2));
            // Still here: the worker is stuck in device work that waits for
            // a peer. Say why, as its error would have.
            let why = comm
                .and_then(|c| c.aborted())
                .unwrap_or_else(|| "no cause known".into());
            eprintln!(
                "braid: error: rank {rank}: communicator aborted: {why} (the worker was stopped by signal SIGTERM while still busy: computing, or waiting on a peer or the GPU)"
            );
            std::process::exit(128 + 15);
        });
}
