//! The `citronfs` command.

mod bench;
mod daemon;
mod install_units;
mod keys;
mod locks_cmd;
mod logging;
mod mount_cmd;
mod mount_options;
mod plot;
mod region_host;
mod regions;
mod report;
mod servers;
mod size;
mod status_cmd;
mod unmount;

use std::ffi::OsString;

use clap::{CommandFactory, Parser, Subcommand};

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
    /// The shm regions servers on this host publish, and who owns them.
    Regions(regions::RegionsArgs),
    /// Install the systemd units and the mount(8) helper.
    InstallUnits(install_units::InstallArgs),
    /// Space, files, lock memory, clients and leases of a cluster.
    Status(status_cmd::StatusArgs),
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

/// The command line as clap should see it: the mount helper's arguments
/// (`mount.fuse.citronfs SPEC DIR -o ...`) as a `citronfs mount` command,
/// and `-o` lists of `citronfs mount` expanded into flags. `None`: nothing
/// to do (the helper's fake mode).
fn command_line() -> anyhow::Result<Option<Vec<OsString>>> {
    let mut argv: Vec<OsString> = std::env::args_os().collect();
    if argv.first().is_some_and(|a| mount_options::called_as_helper(a)) {
        match mount_options::helper_command_line(&argv[1..])? {
            Some(line) => argv = line,
            None => return Ok(None),
        }
    }
    if argv.get(1).is_some_and(|a| a == "mount") {
        let cli = Cli::command();
        let mount = cli.find_subcommand("mount").expect("the mount subcommand");
        let rest = mount_options::expand(argv.split_off(2), mount)?;
        argv.extend(rest);
    }
    Ok(Some(argv))
}

fn main() -> std::process::ExitCode {
    logging::init();
    let argv = match command_line() {
        Ok(Some(argv)) => argv,
        Ok(None) => return std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("citronfs: {e:#}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let cli = Cli::parse_from(argv);
    // Every server or mount start first removes the shm regions of this
    // host that no live process owns (a crashed server's or mount's).
    if matches!(
        cli.command,
        Command::Mount(_) | Command::MetaServer(_) | Command::DataServer(_) | Command::RegionHost(_)
    ) {
        if let Err(e) = citron_lock::rdma::shm_owner::remove_orphans() {
            log::warn!("cannot sweep orphaned shm regions: {e}");
        }
    }
    // A `--log-file` is opened before anything else, on the caller's
    // terminal: a path that cannot be written fails the command there.
    let log_file = match &cli.command {
        Command::Mount(a) => a.log.log_file.as_deref(),
        Command::MetaServer(a) => a.log.log_file.as_deref(),
        Command::DataServer(a) => a.log.log_file.as_deref(),
        _ => None,
    };
    let log_file = match log_file.map(|p| logging::open(p).map(|f| (p.to_path_buf(), f))).transpose() {
        Ok(f) => f,
        Err(e) => {
            eprintln!("citronfs: {e:#}");
            return std::process::ExitCode::FAILURE;
        }
    };
    // The detached mount's word to the waiting parent.
    let mut readiness = None;
    let detaching = matches!(&cli.command, Command::Mount(a) if !a.foreground);
    let log_file = match log_file {
        Some((path, file)) if !detaching => {
            logging::to_file(&path, file);
            None
        }
        f => f,
    };
    let result = match cli.command {
        Command::Mount(a) => {
            if detaching {
                let plan =
                    daemon::LogPlan { file: log_file, default_name: logging::file_name(&a.mountpoint()) };
                match daemon::detach(plan) {
                    Ok(r) => readiness = Some(r),
                    Err(e) => {
                        eprintln!("citronfs: {e:#}");
                        return std::process::ExitCode::FAILURE;
                    }
                }
            }
            mount_cmd::run(a, &mut readiness)
        }
        Command::MetaServer(a) => servers::run_meta(a),
        Command::DataServer(a) => servers::run_data(a),
        Command::RegionHost(a) => region_host::run(a),
        Command::Locks(a) => locks_cmd::run(a),
        Command::Regions(a) => regions::run(a),
        Command::InstallUnits(a) => install_units::run(a),
        Command::Status(a) => match status_cmd::run(a) {
            Ok(true) => Ok(()),
            Ok(false) => return std::process::ExitCode::from(status_cmd::UNHEALTHY),
            Err(e) => Err(e),
        },
        Command::Key(k) => keys::run(k),
        Command::Bench(b) => bench::run(b),
        Command::BenchLocksWorker => bench::locks::worker(),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            match readiness.take() {
                Some(r) => r.failed(&format!("{e:#}")),
                None if daemon::is_detached() => log::error!("{e:#}"),
                None => {
                    // A `--log-file` keeps the reason too.
                    if logging::destination().is_some() {
                        log::error!("{e:#}");
                    }
                    eprintln!("citronfs: {e:#}")
                }
            }
            std::process::ExitCode::FAILURE
        }
    }
}
