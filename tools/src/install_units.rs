//! `citronfs install-units`: installs what running CitronFS as a service
//! needs, from the files in `dist/systemd/` (built into the binary):
//!
//! * `citronfs-meta-server.service`, `citronfs-data-server.service`
//!   (`Type=notify`) into the unit directory, running this binary;
//! * `/etc/default/citronfs`, their settings (kept if it exists);
//! * the mount(8) helper `mount.fuse.citronfs`, a symlink to this binary in
//!   `/sbin`, so `mount -t fuse.citronfs` and fstab lines work;
//! * the example mount unit, as `mnt-citron.mount.example` beside the units
//!   (copy it to a unit named after your mount point to use it).
//!
//! Every destination can be moved (`--root` prefixes them all), so packaging
//! and tests install into a staging directory.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::Args;

use crate::mount_options::HELPER_NAME;

const META_UNIT: &str = include_str!("../../dist/systemd/citronfs-meta-server.service");
const DATA_UNIT: &str = include_str!("../../dist/systemd/citronfs-data-server.service");
const MOUNT_UNIT: &str = include_str!("../../dist/systemd/mnt-citron.mount");
const DEFAULTS: &str = include_str!("../../dist/systemd/citronfs.default");

#[derive(Args, Debug)]
pub struct InstallArgs {
    /// Prefix of every destination (a staging directory; default /).
    #[arg(long, default_value = "/")]
    root: PathBuf,
    /// Where systemd units go.
    #[arg(long, default_value = "etc/systemd/system")]
    unit_dir: PathBuf,
    /// Where mount(8) looks for helpers.
    #[arg(long, default_value = "sbin")]
    sbin_dir: PathBuf,
    /// The settings file the units read.
    #[arg(long, default_value = "etc/default/citronfs")]
    env_file: PathBuf,
    /// The citronfs binary the units and the helper run (default: this one).
    #[arg(long)]
    bin: Option<PathBuf>,
}

fn under(root: &Path, path: &Path) -> PathBuf {
    root.join(path.strip_prefix("/").unwrap_or(path))
}

fn write(path: &Path, text: &str) -> Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))?;
    println!("installed {}", path.display());
    Ok(())
}

pub fn run(args: InstallArgs) -> Result<()> {
    let bin = match args.bin {
        Some(b) => b,
        None => std::env::current_exe().context("cannot find this binary")?,
    };
    let bin = std::fs::canonicalize(&bin).with_context(|| format!("{} does not exist", bin.display()))?;
    let bin_text = bin.to_str().context("the binary's path is not UTF-8")?;
    let units = under(&args.root, &args.unit_dir);
    write(&units.join("citronfs-meta-server.service"), &META_UNIT.replace("@BIN@", bin_text))?;
    write(&units.join("citronfs-data-server.service"), &DATA_UNIT.replace("@BIN@", bin_text))?;
    write(&units.join("mnt-citron.mount.example"), MOUNT_UNIT)?;
    let env_file = under(&args.root, &args.env_file);
    if env_file.exists() {
        println!("kept {}", env_file.display());
    } else {
        write(&env_file, DEFAULTS)?;
    }
    let sbin = under(&args.root, &args.sbin_dir);
    std::fs::create_dir_all(&sbin).with_context(|| format!("cannot create {}", sbin.display()))?;
    let helper = sbin.join(HELPER_NAME);
    if helper.symlink_metadata().is_ok() {
        std::fs::remove_file(&helper).with_context(|| format!("cannot replace {}", helper.display()))?;
    }
    std::os::unix::fs::symlink(&bin, &helper)
        .with_context(|| format!("cannot link {} to {}", helper.display(), bin.display()))?;
    println!("installed {} -> {}", helper.display(), bin.display());
    println!(
        "next: systemctl daemon-reload && systemctl enable --now citronfs-meta-server citronfs-data-server"
    );
    Ok(())
}
