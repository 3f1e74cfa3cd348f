//! `parsectl`: parses arguments and hands them to the library.

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env(parse_core::env::LOG)
                .unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = parsectl::Cli::parse();
    match parsectl::run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("parsectl: error: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}
