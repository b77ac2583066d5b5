//! `citronfs bench …`: benchmarks that print tables and write CSV + PNG.

pub mod alock;
pub mod auth;
pub mod citron_scale;
pub mod fcntl;
pub mod io;
pub mod locks;
pub mod meta;
pub mod ranges;
pub mod restart;
mod restart_pause;
pub mod space;
pub mod verbs;
pub mod workers;

use clap::Subcommand;

#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Latency and throughput of every verb kind, beside the transport's limit.
    Verbs(verbs::VerbsArgs),
    /// What cluster keys and grants cost: per connection, per verb, per
    /// file-system operation, beside the same without keys.
    Auth(auth::AuthArgs),
    /// Sequential I/O and metadata rates beside bindfs and tmpfs.
    Io(io::IoArgs),
    /// Range locks side by side (Citron paper §4.2, §4.6, §4.7): Citron,
    /// static segmentation and the RPC range lock server.
    Ranges(ranges::RangesArgs),
    /// One worker process of `bench ranges` (started by it).
    #[command(hide = true)]
    RangesWorker(ranges::RangesWorkerArgs),
    /// Lock goodput, latency and verbs per cycle, every algorithm side by
    /// side (the ShiftLock paper's microbenchmark, §4.2).
    Locks(locks::LocksArgs),
    /// ALock beside a naive mixed local/remote CAS lock: verbs per remote
    /// acquire, local acquire cost, mixed-contention throughput.
    Alock(alock::AlockArgs),
    /// What a Citron tree scale-up costs: verbs, round trips, RPCs, time.
    CitronScale(citron_scale::CitronScaleArgs),
    /// fcntl lock + unlock pairs per second through real FUSE mounts
    /// (citron vs rpc range locks, shm and tcp, beside a no-op FUSE daemon),
    /// verbs per lock and per unlock, and SQLite transactions per second.
    Fcntl(fcntl::FcntlArgs),
    /// One lock-taking process of `bench fcntl` (started by it).
    #[command(hide = true)]
    FcntlWorker(fcntl::FcntlWorkerArgs),
    /// Metadata rates as mdtest measures them (create, stat, read, unlink;
    /// N processes on M mounts, one shared directory or one per process),
    /// RPCs and FUSE requests per operation, beside bindfs over tmpfs and
    /// any --peer, all in one run.
    Meta(meta::MetaArgs),
    /// One process of `bench meta` (started by it).
    #[command(hide = true)]
    MetaWorker(meta::worker::MetaWorkerArgs),
    /// What a meta-server restart costs with a large namespace: journal
    /// replay, snapshot, start until serving.
    Restart(restart::RestartArgs),
    /// Files per GiB by file size, small-file create rate, and a million
    /// files opened and closed one after another (lock memory peak and end).
    Space(space::SpaceArgs),
}

pub fn run(cmd: BenchCommand) -> anyhow::Result<()> {
    match cmd {
        BenchCommand::Verbs(a) => verbs::run(a),
        BenchCommand::Auth(a) => auth::run(a),
        BenchCommand::Io(a) => io::run(a),
        BenchCommand::Ranges(a) => ranges::run(a),
        BenchCommand::RangesWorker(a) => ranges::worker(a),
        BenchCommand::Locks(a) => locks::run(a),
        BenchCommand::Alock(a) => alock::run(a),
        BenchCommand::CitronScale(a) => citron_scale::run(a),
        BenchCommand::Fcntl(a) => fcntl::run(a),
        BenchCommand::FcntlWorker(a) => fcntl::worker::worker(a),
        BenchCommand::Meta(a) => meta::run(a),
        BenchCommand::MetaWorker(a) => meta::worker::worker(a),
        BenchCommand::Space(a) => space::run(a),
        BenchCommand::Restart(a) => restart::run(a),
    }
}
