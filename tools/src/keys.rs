//! Cluster keys at the command line: `--key-file` for every server and
//! mount, `citronfs key new`, the key an embedded `citronfs mount` makes,
//! and the rule for servers without a key.
//!
//! **A server that listens on an address other than loopback refuses to
//! start without `--key-file`.** Making a key on the fly instead would
//! leave a secret on one machine that every other node needs before it can
//! join, so the admin has to fetch and distribute it anyway, and until then
//! the cluster half-works (data servers and mounts refused with a key
//! error from a server that seemed to start fine). Refusing says at once
//! what to do, with the command that makes a key. `citronfs mount`
//! without `--meta` is the exception: it is a cluster of its own, so it
//! always makes a key (wherever it listens) and prints how others join.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use citron_rpc::auth::{Key, KeyOptions, Keyring, Role, Squash};
use clap::Args;

/// `--key-file`, shared by every command that joins a cluster.
#[derive(Args, Debug, Clone, Default)]
pub struct KeyArgs {
    /// The cluster's key file (mode 600): servers need the cluster key
    /// (role=server); a mount uses the first key of the file. Make one with
    /// `citronfs key new FILE`.
    #[arg(long, value_name = "FILE")]
    pub key_file: Option<PathBuf>,
}

impl KeyArgs {
    pub fn load(&self) -> Result<Option<Arc<Keyring>>> {
        self.key_file.as_deref().map(load).transpose()
    }

    /// The keyring of a server listening on `listen`: refuses a server
    /// reachable from other hosts without one (see the module comment).
    pub fn for_server(&self, listen: SocketAddr, what: &str) -> Result<Option<Arc<Keyring>>> {
        let keyring = self.load()?;
        if keyring.is_none() && !listen.ip().is_loopback() {
            bail!(
                "{what} listens on {listen}, which other hosts can reach, but has no key: anyone could \
                 read and overwrite the file system. Make a key with `citronfs key new FILE`, copy the file \
                 (mode 600) to every node, and start every server and mount with --key-file FILE"
            );
        }
        Ok(keyring)
    }
}

pub fn load(path: &Path) -> Result<Arc<Keyring>> {
    Ok(Arc::new(Keyring::load(path)?))
}

#[derive(clap::Subcommand, Debug)]
pub enum KeyCommand {
    /// Write a new random key to FILE (created mode 600; never overwritten).
    New(NewKeyArgs),
}

#[derive(Args, Debug)]
pub struct NewKeyArgs {
    file: PathBuf,
    /// The key's name (what a connection names in its handshake).
    #[arg(long, default_value = "cluster")]
    name: String,
    /// server: the cluster key (servers, and trusted mounts); client: a
    /// mount's key, which only registers clients.
    #[arg(long, value_enum, default_value = "server")]
    role: RoleArg,
    /// For a client key: which callers of its mounts lose their ids
    /// (none, root = NFS root_squash, all = all_squash).
    #[arg(long, value_enum, default_value = "none")]
    squash: SquashArg,
    /// The uid and gid squashed callers get.
    #[arg(long, default_value_t = 65534)]
    anon_uid: u32,
    #[arg(long, default_value_t = 65534)]
    anon_gid: u32,
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum RoleArg {
    Server,
    Client,
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum SquashArg {
    None,
    Root,
    All,
}

pub fn run(command: KeyCommand) -> Result<()> {
    match command {
        KeyCommand::New(a) => {
            let options = KeyOptions {
                role: match a.role {
                    RoleArg::Server => Role::Server,
                    RoleArg::Client => Role::Client,
                },
                squash: match a.squash {
                    SquashArg::None => Squash::None,
                    SquashArg::Root => Squash::Root,
                    SquashArg::All => Squash::All,
                },
                anon_uid: a.anon_uid,
                anon_gid: a.anon_gid,
            };
            if options.role == Role::Server && options.squash != Squash::None {
                bail!("--squash applies to client keys (--role client)");
            }
            let ring = Keyring::new(vec![Key::generate(&a.name, options)?])?;
            ring.save_new(&a.file).with_context(|| format!("cannot create {}", a.file.display()))?;
            println!("wrote key {:?} to {} (mode 600)", a.name, a.file.display());
            if options.role == Role::Client {
                println!(
                    "append its line to the meta-server's key file; give the file to the mounts that use it"
                );
            }
            Ok(())
        }
    }
}

/// The key of an embedded cluster: the file given (made if missing), or a
/// new one in the runtime directory, removed when the mount ends.
pub struct EmbeddedKey {
    pub keyring: Arc<Keyring>,
    pub path: PathBuf,
    /// Made here and ours to remove.
    remove: bool,
}

impl EmbeddedKey {
    pub fn obtain(given: Option<&Path>) -> Result<Self> {
        if let Some(path) = given {
            if path.exists() {
                return Ok(Self { keyring: load(path)?, path: path.to_path_buf(), remove: false });
            }
            Keyring::generate("cluster")?
                .save_new(path)
                .with_context(|| format!("cannot create {}", path.display()))?;
            return Ok(Self { keyring: load(path)?, path: path.to_path_buf(), remove: false });
        }
        let dir = runtime_dir();
        std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))
                .with_context(|| format!("cannot restrict {}", dir.display()))?;
        }
        sweep_dead_keys(&dir);
        let path = dir.join(key_file_name(std::process::id()));
        let _ = std::fs::remove_file(&path); // a dead process's file under a reused pid
        let keyring = Arc::new(Keyring::generate("cluster")?);
        keyring.save_new(&path).with_context(|| format!("cannot create {}", path.display()))?;
        Ok(Self { keyring, path, remove: true })
    }

    /// Whether the file goes away with this mount.
    pub fn is_temporary(&self) -> bool {
        self.remove
    }
}

impl Drop for EmbeddedKey {
    fn drop(&mut self) {
        if self.remove {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Where an embedded cluster's key lives: `$XDG_RUNTIME_DIR/citronfs`,
/// `/run/citronfs` for root, else the temporary directory.
/// The name of the key file of the embedded cluster of process `pid`.
fn key_file_name(pid: u32) -> String {
    format!("cluster-{pid}.key")
}

/// Removes the key files that embedded clusters of processes no longer
/// running left in `dir` (a mount killed or crashed never removes its
/// own): the next mount on this host cleans up. A file whose pid was
/// reused by another process stays until that one is gone too.
fn sweep_dead_keys(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.strip_prefix("cluster-")?.strip_suffix(".key")) else {
            continue;
        };
        let Ok(pid) = pid.parse::<u64>() else { continue };
        if !citron_lock::rdma::atomicity::process_exists(pid) {
            match std::fs::remove_file(entry.path()) {
                Ok(()) => {
                    log::info!("removed {}, left by process {pid}, which is gone", entry.path().display())
                }
                Err(e) => log::warn!("cannot remove {}: {e}", entry.path().display()),
            }
        }
    }
}

fn runtime_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("XDG_RUNTIME_DIR") {
        return PathBuf::from(d).join("citronfs");
    }
    // SAFETY: getuid has no preconditions.
    if unsafe { libc::getuid() } == 0 {
        return PathBuf::from("/run/citronfs");
    }
    // SAFETY: as above.
    std::env::temp_dir().join(format!("citronfs-{}", unsafe { libc::getuid() }))
}
