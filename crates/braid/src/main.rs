//! `braid`: one binary for distributed training.
//!
//! Each subcommand lives in its own module under [`cmd`]; this file only
//! parses the command line and maps results to exit codes.

mod cmd;

use clap::{CommandFactory, Parser, Subcommand};
use std::process::ExitCode;

/// braid: distributed deep-learning training, one binary.
#[derive(Parser)]
#[command(
    name = "braid",
    version,
    max_term_width = 100,
    about = "braid: distributed deep-learning training in one binary",
    after_help = "Examples:\n  braid launch --standalone --nproc-per-node 4 -- ./target/release/examples/hello\n  braid bench all_reduce --np 4 -b 8 -e 64M --check\n  braid verify --np 4\n  braid bench all_reduce --device cuda --np 4 --check\n  braid train --model tiny\n  braid train --nproc 2\n  braid scale -- --steps 60\n  braid generate --load model.safetensors --prompt \"the \"\n  braid doctor /tmp/braid-<run id>"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    Launch(cmd::launch::LaunchArgs),
    Bench(cmd::bench::BenchArgs),
    Store(cmd::store::StoreArgs),
    Topo(cmd::topo::TopoArgs),
    Verify(cmd::verify::VerifyArgs),
    Train(Box<cmd::train::TrainArgs>),
    Scale(cmd::scale::ScaleArgs),
    Generate(cmd::generate::GenerateArgs),
    Serve(cmd::serve::ServeArgs),
    Kernels(cmd::kernels::KernelsArgs),
    Ckpt(cmd::ckpt::CkptArgs),
    Doctor(cmd::doctor::DoctorArgs),
    Report(cmd::report::ReportArgs),
    Data(cmd::data::DataArgs),
    Plot(cmd::plot::PlotArgs),
    Plan(cmd::plan::PlanArgs),
}

/// `braid ... | head`: a stdout closed by its reader ends the command
/// quietly with 141 (128 + SIGPIPE), as a Unix tool killed by SIGPIPE
/// would, rather than with a panic and its backtrace. (Rust ignores
/// SIGPIPE, so printing to a closed pipe panics; the signal itself stays
/// ignored, for the sockets and pipes braid's own workers use.)
fn quiet_on_closed_stdout() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let payload = info.payload();
        let message = payload
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| payload.downcast_ref::<&str>().copied())
            .unwrap_or_default();
        if message.starts_with("failed printing to stdout") && message.contains("Broken pipe") {
            std::process::exit(141);
        }
        default(info);
    }));
}

fn main() -> ExitCode {
    quiet_on_closed_stdout();
    let argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    // `braid bench serve` loads an HTTP endpoint: flags of its own, not
    // the collectives' (`braid bench OP`).
    if argv.get(1).is_some_and(|a| a == "bench") && argv.get(2).is_some_and(|a| a == "serve") {
        let args = cmd::bench_serve::BenchServeArgs::parse_from(&argv[2..]);
        return match cmd::bench_serve::run_bench_serve(args) {
            Ok(code) => ExitCode::from(code.clamp(0, 255) as u8),
            Err(message) => {
                eprintln!("braid: error: {message}");
                ExitCode::from(2)
            }
        };
    }
    let cli = match Cli::try_parse_from(&argv) {
        Ok(cli) => cli,
        Err(e) => match cmd::unknown_flag::explain(&e, &Cli::command(), &argv) {
            Some(message) => {
                eprintln!("{message}");
                return ExitCode::from(2);
            }
            None => e.exit(),
        },
    };
    let result = match cli.command {
        Command::Launch(args) => cmd::launch::run(args),
        Command::Bench(args) => cmd::bench::run(args),
        Command::Store(args) => cmd::store::run(args),
        Command::Topo(args) => cmd::topo::run(args),
        Command::Verify(args) => cmd::verify::run(args),
        Command::Train(args) => cmd::train::run_train(*args),
        Command::Scale(args) => cmd::scale::run(args),
        Command::Generate(args) => cmd::generate::run_generate(args),
        Command::Serve(args) => cmd::serve::run_serve(args),
        Command::Kernels(args) => cmd::kernels::run(args),
        Command::Ckpt(args) => cmd::ckpt::run(args),
        Command::Doctor(args) => cmd::doctor::run(args),
        Command::Report(args) => cmd::report::run(args),
        Command::Data(args) => cmd::data::run(args),
        Command::Plot(args) => cmd::plot::run(args),
        Command::Plan(args) => cmd::plan::run(args),
    };
    match result {
        Ok(code) => ExitCode::from(code.clamp(0, 255) as u8),
        Err(message) => {
            eprintln!("braid: error: {message}");
            ExitCode::from(2)
        }
    }
}
