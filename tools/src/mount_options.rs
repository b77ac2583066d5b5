//! Mount options in mount(8)'s form, and the mount helper.
//!
//! `citronfs mount DIR -o attr-ttl=1,nosuid,_netdev` takes a comma list as
//! fstab writes it. Each entry is one of:
//! * a long flag of `citronfs mount`, without its dashes: `attr-ttl=1` is
//!   `--attr-ttl 1`, `foreground` is `--foreground` (`_` may stand for `-`).
//!   The mapping is generic: every flag the command has is an option, and
//!   one it does not have is an error that names it (e.g. `key-file` in a
//!   build without `--key-file`);
//! * a per-mount VFS flag: `ro`, `rw`, `nosuid`, `suid`, `nodev`, `dev`,
//!   `noexec`, `exec`, `noatime`, `atime`, `sync`, `async`, `dirsync`, applied
//!   to the FUSE mount itself;
//! * an option meant for mount(8) or systemd, accepted and ignored: `defaults`,
//!   `_netdev`, `nofail`, `auto`, `noauto`, `user`, `nouser`, `users`,
//!   `owner`, `group`, `x-*`, `comment=*`.
//!
//! The helper: mount(8) runs `/sbin/mount.fuse.citronfs SPEC DIR [-sfnv]
//! [-o OPTIONS] [-t TYPE]` for a file system of type `fuse.citronfs`
//! (`mount -t fuse.citronfs META_ADDR DIR -o ...`, or an fstab line). The
//! `citronfs` binary is that helper when it is called by that name (a
//! symlink, see `citronfs install-units`): it becomes
//! `citronfs mount DIR --meta SPEC --source SPEC -o OPTIONS`, which detaches
//! once the file system is mounted, so mount(8)'s exit status says whether
//! it is.

use std::ffi::{OsStr, OsString};
use std::net::ToSocketAddrs;

use anyhow::{anyhow, bail, Context, Result};

/// The name mount(8) looks for (`/sbin/mount.fuse.citronfs`).
pub const HELPER_NAME: &str = "mount.fuse.citronfs";

/// Options mount(8), systemd or fstab readers use, which mean nothing to
/// the file system.
const FOR_MOUNT8: &[&str] =
    &["defaults", "_netdev", "nofail", "auto", "noauto", "user", "nouser", "users", "owner", "group"];

/// A per-mount VFS flag, given to the kernel with the FUSE mount.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum VfsFlag {
    Ro,
    Rw,
    Nosuid,
    Suid,
    Nodev,
    Dev,
    Noexec,
    Exec,
    Noatime,
    Atime,
    Sync,
    Async,
    Dirsync,
}

impl VfsFlag {
    pub fn mount_option(self) -> fuser::MountOption {
        use fuser::MountOption as O;
        match self {
            VfsFlag::Ro => O::RO,
            VfsFlag::Rw => O::RW,
            VfsFlag::Nosuid => O::NoSuid,
            VfsFlag::Suid => O::Suid,
            VfsFlag::Nodev => O::NoDev,
            VfsFlag::Dev => O::Dev,
            VfsFlag::Noexec => O::NoExec,
            VfsFlag::Exec => O::Exec,
            VfsFlag::Noatime => O::NoAtime,
            VfsFlag::Atime => O::Atime,
            VfsFlag::Sync => O::Sync,
            VfsFlag::Async => O::Async,
            VfsFlag::Dirsync => O::DirSync,
        }
    }
}

/// The mount options of a set of VFS flags: the last of two contradicting
/// flags wins, as with mount(8).
pub fn vfs_mount_options(flags: &[VfsFlag]) -> Vec<fuser::MountOption> {
    use VfsFlag::*;
    let opposite = |f: VfsFlag| match f {
        Ro => Some(Rw),
        Rw => Some(Ro),
        Nosuid => Some(Suid),
        Suid => Some(Nosuid),
        Nodev => Some(Dev),
        Dev => Some(Nodev),
        Noexec => Some(Exec),
        Exec => Some(Noexec),
        Noatime => Some(Atime),
        Atime => Some(Noatime),
        Sync => Some(Async),
        Async => Some(Sync),
        Dirsync => None,
    };
    let mut kept: Vec<VfsFlag> = Vec::new();
    for &f in flags {
        kept.retain(|k| *k != f && Some(*k) != opposite(f));
        kept.push(f);
    }
    kept.into_iter().map(VfsFlag::mount_option).collect()
}

/// What one entry of an `-o` list becomes on the command line.
fn expand_one(entry: &str, mount: &clap::Command) -> Result<Vec<OsString>> {
    let (name, value) = match entry.split_once('=') {
        Some((n, v)) => (n, Some(v)),
        None => (entry, None),
    };
    if FOR_MOUNT8.contains(&name) || name.starts_with("x-") || name.starts_with("X-") || name == "comment" {
        return Ok(Vec::new());
    }
    if value.is_none() && <VfsFlag as clap::ValueEnum>::from_str(name, false).is_ok() {
        return Ok(vec!["--vfs-flag".into(), name.into()]);
    }
    let long = name.replace('_', "-");
    let arg = mount
        .get_arguments()
        .filter(|a| !a.is_hide_set())
        .find(|a| a.get_long() == Some(long.as_str()))
        .ok_or_else(|| anyhow!("unknown mount option {name:?}: `citronfs mount` has no --{long}"))?;
    let takes_value = arg.get_action().takes_values();
    match (takes_value, value) {
        (true, Some(v)) => Ok(vec![format!("--{long}").into(), v.into()]),
        (true, None) => bail!("mount option {name:?} needs a value ({name}=...)"),
        (false, None) => Ok(vec![format!("--{long}").into()]),
        (false, Some(_)) => bail!("mount option {name:?} takes no value"),
    }
}

/// Replaces every `-o LIST` (also `-oLIST`, `--options LIST`) of a
/// `citronfs mount` command line (`args` after the subcommand) by the flags
/// it stands for.
pub fn expand(args: Vec<OsString>, mount: &clap::Command) -> Result<Vec<OsString>> {
    let mut out = Vec::with_capacity(args.len());
    let mut it = args.into_iter();
    while let Some(a) = it.next() {
        let list = match a.to_str() {
            Some("-o" | "--options") => Some(
                it.next()
                    .ok_or_else(|| anyhow!("-o needs a list of options"))?
                    .into_string()
                    .map_err(|l| anyhow!("mount options {l:?} are not UTF-8"))?,
            ),
            Some(s) if s.starts_with("-o") => Some(s[2..].to_string()),
            Some(s) if s.starts_with("--options=") => Some(s["--options=".len()..].to_string()),
            _ => None,
        };
        match list {
            Some(list) => {
                for entry in list.split(',').filter(|e| !e.is_empty()) {
                    out.extend(expand_one(entry, mount)?);
                }
            }
            None => out.push(a),
        }
    }
    Ok(out)
}

/// Whether the process was started as the mount helper.
pub fn called_as_helper(argv0: &OsStr) -> bool {
    std::path::Path::new(argv0).file_name().is_some_and(|n| n == HELPER_NAME)
}

/// The `citronfs mount` command line for the helper's arguments
/// (`SPEC DIR [-sfnv] [-N NS] [-o OPTIONS] [-t TYPE]`); `None` for `-f`
/// (mount(8)'s fake mode: check, do nothing).
pub fn helper_command_line(args: &[OsString]) -> Result<Option<Vec<OsString>>> {
    let mut positional = Vec::new();
    let mut options: Vec<OsString> = Vec::new();
    let mut fake = false;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.to_str() {
            Some("-o") => {
                options.push("-o".into());
                options.push(it.next().ok_or_else(|| anyhow!("-o needs a list of options"))?.clone());
            }
            Some("-t") => {
                let t = it.next().ok_or_else(|| anyhow!("-t needs a type"))?;
                if t != "fuse.citronfs" && t != "citronfs" {
                    bail!("{HELPER_NAME} mounts type fuse.citronfs, not {}", t.to_string_lossy());
                }
            }
            Some("-N") => bail!("{HELPER_NAME}: -N (mount in another namespace) is not supported"),
            Some(flags) if flags.starts_with('-') && flags.len() > 1 && !flags.starts_with("--") => {
                for f in flags[1..].chars() {
                    match f {
                        'f' => fake = true,
                        // -s (sloppy), -n (no mtab), -v (verbose): nothing to do.
                        's' | 'n' | 'v' => {}
                        other => bail!("{HELPER_NAME}: unknown flag -{other}"),
                    }
                }
            }
            _ => positional.push(a.clone()),
        }
    }
    let [spec, dir] = positional.as_slice() else {
        bail!("usage: {HELPER_NAME} META_ADDR DIR [-o OPTIONS]");
    };
    let spec_text = spec.to_str().ok_or_else(|| anyhow!("meta-server address is not UTF-8"))?;
    let meta = spec_text
        .to_socket_addrs()
        .with_context(|| format!("cannot resolve the meta-server address {spec_text:?} (HOST:PORT)"))?
        .next()
        .ok_or_else(|| anyhow!("{spec_text:?} resolves to no address"))?;
    if fake {
        return Ok(None);
    }
    let mut line: Vec<OsString> = vec!["citronfs".into(), "mount".into(), dir.clone()];
    line.extend(["--meta".into(), meta.to_string().into(), "--source".into(), spec.clone()]);
    line.extend(options);
    Ok(Some(line))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{Args, Command};

    #[derive(Args, Debug)]
    struct Fake {
        #[arg(long, default_value_t = 0.0)]
        attr_ttl: f64,
        #[arg(long)]
        foreground: bool,
        #[arg(long, hide = true)]
        internal: Option<String>,
    }

    fn cmd() -> Command {
        Fake::augment_args(Command::new("mount"))
    }

    fn expanded(list: &str) -> Result<Vec<String>> {
        Ok(expand(vec!["-o".into(), list.into()], &cmd())?
            .into_iter()
            .map(|s| s.into_string().unwrap())
            .collect())
    }

    #[test]
    fn options_map_onto_flags() {
        assert_eq!(
            expanded("attr_ttl=1.5,foreground,_netdev,nofail,x-systemd.automount,nosuid,ro").unwrap(),
            ["--attr-ttl", "1.5", "--foreground", "--vfs-flag", "nosuid", "--vfs-flag", "ro"]
        );
        assert_eq!(expanded("defaults").unwrap(), Vec::<String>::new());
    }

    #[test]
    fn bad_options_are_named() {
        let e = expanded("attr-ttl=1,key-file=/etc/k").unwrap_err().to_string();
        assert!(e.contains("key-file") && e.contains("no --key-file"), "{e}");
        assert!(expanded("attr-ttl").unwrap_err().to_string().contains("needs a value"));
        assert!(expanded("foreground=1").unwrap_err().to_string().contains("takes no value"));
        // Hidden plumbing is not an option.
        assert!(expanded("internal=x").is_err());
    }

    #[test]
    fn last_of_contradicting_vfs_flags_wins() {
        use fuser::MountOption as O;
        assert_eq!(vfs_mount_options(&[VfsFlag::Ro, VfsFlag::Nosuid, VfsFlag::Rw]), [O::NoSuid, O::RW]);
    }

    #[test]
    fn helper_arguments_become_a_mount_command() {
        let args: Vec<OsString> =
            ["127.0.0.1:7070", "/mnt/x", "-n", "-o", "attr-ttl=1,_netdev", "-t", "fuse.citronfs"]
                .map(OsString::from)
                .to_vec();
        let line = helper_command_line(&args).unwrap().unwrap();
        let line: Vec<String> = line.into_iter().map(|s| s.into_string().unwrap()).collect();
        assert_eq!(
            line,
            [
                "citronfs",
                "mount",
                "/mnt/x",
                "--meta",
                "127.0.0.1:7070",
                "--source",
                "127.0.0.1:7070",
                "-o",
                "attr-ttl=1,_netdev"
            ]
        );
        let fake: Vec<OsString> = ["127.0.0.1:7070", "/mnt/x", "-f"].map(OsString::from).to_vec();
        assert!(helper_command_line(&fake).unwrap().is_none());
        let bad: Vec<OsString> = ["nowhere", "/mnt/x"].map(OsString::from).to_vec();
        assert!(helper_command_line(&bad).unwrap_err().to_string().contains("cannot resolve"));
    }
}
