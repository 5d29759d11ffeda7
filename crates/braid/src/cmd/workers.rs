//! Shared by the subcommands that run as distributed workers (`bench`,
//! `verify`): joining the world from the launcher's environment, or
//! starting N local workers of the same command through the launcher.

use braid_comm::{CommOptions, Communicator};

/// Joins the world described by the environment with `options`.
pub fn init(options: CommOptions) -> Result<Communicator, String> {
    braid_core::WorldInfo::from_env()
        .map_err(|e| format!("{e}\n(run under `braid launch`, or pass --np N)"))?;
    Communicator::init_from_env_with(options).map_err(|e| e.to_string())
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
