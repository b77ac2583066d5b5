//! `citronfs regions`: the shm fabrics of this host (the memory servers
//! publish for same-host clients under `/dev/shm/citronfs-NAME/`), who owns
//! each, and how much memory they hold; `--remove-orphans` deletes the ones
//! no live process owns (every citronfs start does that anyway).
//!
//! [`host_regions`] and [`print_regions`] are meant to be shared with
//! `citronfs status`.

use std::io::Write;

use anyhow::{Context, Result};
use citron_lock::rdma::shm_owner::{self, FabricInfo, Owner};
use clap::Args;
use serde::Serialize;

#[derive(Args, Debug)]
pub struct RegionsArgs {
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Remove the fabrics no live process owns before listing.
    #[arg(long)]
    remove_orphans: bool,
}

/// One shm fabric of this host, as `citronfs regions` reports it.
#[derive(Clone, Debug, Serialize)]
pub struct HostRegion {
    /// The fabric's name (`shm:NAME`).
    pub fabric: String,
    pub dir: String,
    /// `live`, `orphaned`, or `unknown` (no owner lock: made by an older
    /// citronfs, never removed automatically).
    pub state: &'static str,
    /// The owning process, when live and visible.
    pub pid: Option<u32>,
    /// Its command name (`/proc/PID/comm`).
    pub command: Option<String>,
    /// Registered regions: (id, bytes).
    pub regions: Vec<(u32, u64)>,
    /// Bytes of every file of the fabric.
    pub bytes: u64,
    /// Memory those files really hold.
    pub resident: u64,
}

impl From<&FabricInfo> for HostRegion {
    fn from(f: &FabricInfo) -> Self {
        let (state, pid) = match f.owner {
            Owner::Live { pid } => ("live", pid),
            Owner::Orphaned => ("orphaned", None),
            Owner::Unknown => ("unknown", None),
        };
        let command = pid.and_then(|p| std::fs::read_to_string(format!("/proc/{p}/comm")).ok());
        Self {
            fabric: f.name.clone(),
            dir: f.dir.display().to_string(),
            state,
            pid,
            command: command.map(|c| c.trim().to_string()),
            regions: f
                .regions()
                .filter_map(|r| Some((r.name.strip_prefix("region-")?.parse().ok()?, r.bytes)))
                .collect(),
            bytes: f.bytes(),
            resident: f.resident(),
        }
    }
}

/// `bytes` in binary units with one decimal (`1.5GiB`).
fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes}B")
    } else {
        format!("{value:.1}{}", UNITS[unit])
    }
}

/// The shm fabrics of this host and who owns them.
pub fn host_regions() -> Result<Vec<HostRegion>> {
    let fabrics = shm_owner::list_fabrics().context("cannot list /dev/shm")?;
    Ok(fabrics.iter().map(HostRegion::from).collect())
}

/// Prints `regions` as a table, or as JSON.
pub fn print_regions(out: &mut dyn Write, regions: &[HostRegion], json: bool) -> Result<()> {
    if json {
        serde_json::to_writer_pretty(&mut *out, regions)?;
        writeln!(out)?;
        return Ok(());
    }
    writeln!(
        out,
        "{:<28} {:<9} {:>8} {:<16} {:>8} {:>10} {:>10}",
        "FABRIC", "STATE", "PID", "COMMAND", "REGIONS", "SIZE", "RESIDENT"
    )?;
    for r in regions {
        writeln!(
            out,
            "{:<28} {:<9} {:>8} {:<16} {:>8} {:>10} {:>10}",
            r.fabric,
            r.state,
            r.pid.map_or_else(|| "-".to_string(), |p| p.to_string()),
            r.command.as_deref().unwrap_or("-"),
            r.regions.len(),
            human(r.bytes),
            human(r.resident),
        )?;
    }
    let resident: u64 = regions.iter().map(|r| r.resident).sum();
    let orphans = regions.iter().filter(|r| r.state == "orphaned").count();
    writeln!(out, "{} fabrics, {} resident, {orphans} orphaned", regions.len(), human(resident))?;
    Ok(())
}

pub fn run(args: RegionsArgs) -> Result<()> {
    if args.remove_orphans {
        let removed = shm_owner::remove_orphans().context("cannot sweep /dev/shm")?;
        for f in &removed {
            eprintln!("removed orphaned fabric {} ({})", f.name, human(f.resident()));
        }
    }
    let regions = host_regions()?;
    print_regions(&mut std::io::stdout().lock(), &regions, args.json)
}
