//! Shared by the subcommands that run as distributed workers (`bench`,
//! `verify`): joining the world from the launcher's environment, or
//! starting N local workers of the same command through the launcher.

use braid_comm::{CommOptions, Communicator};

/// Joins the world described by the environment with `options`.
pub fn init(options: CommOptions) -> Result<Communicator, String> {
    let world = braid_core::WorldInfo::from_env()
        .map_err(|e| format!("{e}\n(run under `braid launch`, or pass --np N)"))?;
    let store = braid_store::WorkerStore::from_env(&world).map_err(|e| e.to_string())?;
    let client = store.client.reconnect().map_err(|e| e.to_string())?;
    let comm = Communicator::init(world.rank, world.world_size, client, options)
        .map_err(|e| e.to_string())?;
    // Rank 0 may host the store (no launcher): keep it up until `finish`.
    *HOSTED.lock().unwrap_or_else(|p| p.into_inner()) = Some(store);
    Ok(comm)
}

/// The worker's store connection (and rank 0's server, without a launcher).
static HOSTED: std::sync::Mutex<Option<braid_store::WorkerStore>> = std::sync::Mutex::new(None);

/// Releases the worker's store. A rank 0 that hosts the store waits here
/// (bounded) until the other ranks have disconnected, so that they can
/// still read an abort reason or finish their last exchange.
pub fn finish() {
    let store = HOSTED.lock().unwrap_or_else(|p| p.into_inner()).take();
    drop(store);
}

/// Re-runs the current command line, minus `--np N`, as `np` local
/// workers under the launcher; returns the launcher's exit code.
pub fn relaunch_locally(np: usize) -> Result<i32, String> {
    let exe =
        std::env::current_exe().map_err(|e| format!("cannot find the braid executable: {e}"))?;
    let mut command: Vec<std::ffi::OsString> = vec![exe.into()];
    let mut args = std::env::args_os().skip(1);
    while let Some(a) = args.next() {
        let s = a.to_string_lossy();
        if s == "--np" {
            args.next();
        } else if !s.starts_with("--np=") {
            command.push(a);
        }
    }
    let options = braid_launch::LaunchOptions {
        nproc_per_node: np,
        standalone: true,
        command,
        ..Default::default()
    };
    let plan = options.resolve().map_err(|e| e.to_string())?;
    let signals = braid_launch::Signals::install().map_err(|e| e.to_string())?;
    braid_launch::launch(&plan, &signals).map_err(|e| e.to_string())
}
