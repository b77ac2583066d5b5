//! `citronfs bench …`: benchmarks that print tables and write CSV + PNG.

pub mod io;
pub mod verbs;

use clap::Subcommand;

#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Latency and throughput of every verb kind, beside the transport's limit.
    Verbs(verbs::VerbsArgs),
    /// Sequential I/O and metadata rates beside bindfs and tmpfs.
    Io(io::IoArgs),
}

pub fn run(cmd: BenchCommand) -> anyhow::Result<()> {
    match cmd {
        BenchCommand::Verbs(a) => verbs::run(a),
        BenchCommand::Io(a) => io::run(a),
    }
}
