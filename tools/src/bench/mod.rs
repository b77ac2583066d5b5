//! `citronfs bench …`: benchmarks that print tables and write CSV + PNG.

pub mod verbs;

use clap::Subcommand;

#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Latency and throughput of every verb kind, beside the transport's limit.
    Verbs(verbs::VerbsArgs),
}

pub fn run(cmd: BenchCommand) -> anyhow::Result<()> {
    match cmd {
        BenchCommand::Verbs(a) => verbs::run(a),
    }
}
