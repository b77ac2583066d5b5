//! The `citronfs` command.

mod bench;
mod keys;
mod locks_cmd;
mod mount_cmd;
mod plot;
mod region_host;
mod report;
mod servers;
mod size;

use clap::{Parser, Subcommand};

/// CitronFS: a distributed in-DRAM file system with decentralised byte-range locks.
#[derive(Parser, Debug)]
#[command(name = "citronfs", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Mount the file system (starts an embedded cluster without --meta).
    Mount(mount_cmd::MountArgs),
    /// Run the meta-server (namespace, allocation, leases).
    MetaServer(servers::MetaServerArgs),
    /// Run a data server exporting DRAM for file chunks.
    DataServer(servers::DataServerArgs),
    /// Serve regions of memory over the tcp software NIC and/or as a shm fabric.
    RegionHost(region_host::RegionHostArgs),
    /// The cluster-wide lock holders and waiters of one file (like lslocks).
    Locks(locks_cmd::LocksArgs),
    /// Make cluster keys (for --key-file).
    #[command(subcommand)]
    Key(keys::KeyCommand),
    /// Run a benchmark.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
    /// One client process of `bench locks` (started by it; plan on stdin).
    #[command(hide = true)]
    BenchLocksWorker,
}

fn main() -> std::process::ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn,fuser=error")).init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Mount(a) => mount_cmd::run(a),
        Command::MetaServer(a) => servers::run_meta(a),
        Command::DataServer(a) => servers::run_data(a),
        Command::RegionHost(a) => region_host::run(a),
        Command::Locks(a) => locks_cmd::run(a),
        Command::Key(k) => keys::run(k),
        Command::Bench(b) => bench::run(b),
        Command::BenchLocksWorker => bench::locks::worker(),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("citronfs: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
