//! The `kvx` binary: one entry point for serving, generation, model management and benchmarks.

mod cmd;

use clap::Parser;

fn main() -> std::process::ExitCode {
    let cli = cmd::Cli::parse();
    cmd::init_tracing(cli.log.as_deref());
    match cmd::run(cli) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
