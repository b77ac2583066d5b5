//! Keys and key files.
//!
//! A key is a name, 32 random bytes and the options the meta-server applies
//! to whoever proves it holds the key. A key file holds one key per line:
//!
//! ```text
//! # NAME  SECRET (64 hex digits)                                        OPTIONS
//! cluster 8f1c...e0 role=server
//! lab     41d7...9a role=client squash=root anonuid=65534 anongid=65534
//! ```
//!
//! * `role=server` (the default) marks the **cluster key**: servers (meta,
//!   data) prove it to each other, and a mount that holds it is trusted like
//!   a server's own user. A cluster has exactly one; every other secret is
//!   derived from it ([`Keyring::session_secret`], [`Keyring::member_secret`]).
//! * `role=client` keys only let a mount register with the meta-server;
//!   `squash=root` maps uid/gid 0 of that mount's callers to
//!   `anonuid`/`anongid` (default 65534), `squash=all` maps every caller, as
//!   NFS exports' `root_squash` / `all_squash` do.
//!
//! The meta-server reads all keys of its file; a data server needs the
//! cluster key; a mount uses the first key of its file. A key file must not
//! be readable by group or others ([`Keyring::load`] refuses it), as ssh
//! refuses a private key.

use std::fmt;
use std::io::Write;
use std::path::Path;

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Bytes of a key's secret.
pub const SECRET_LEN: usize = 32;
/// Longest key name.
pub const MAX_NAME_LEN: usize = 64;

/// A key's secret bytes. Never printed by `Debug`.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(pub(crate) [u8; SECRET_LEN]);

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(..)")
    }
}

impl Secret {
    /// 32 bytes from the operating system's random source.
    pub fn generate() -> Self {
        use rand::RngCore;
        let mut b = [0u8; SECRET_LEN];
        rand::rngs::OsRng.fill_bytes(&mut b);
        Secret(b)
    }

    pub fn from_bytes(bytes: [u8; SECRET_LEN]) -> Self {
        Secret(bytes)
    }

    /// HMAC-SHA256 under this secret of the concatenation of `parts`.
    pub(crate) fn mac(&self, parts: &[&[u8]]) -> [u8; 32] {
        let mut m = <Hmac<Sha256> as Mac>::new_from_slice(&self.0).expect("HMAC takes any key length");
        for p in parts {
            m.update(p);
        }
        m.finalize().into_bytes().into()
    }

    /// Whether `tag` is the HMAC of `parts`, compared in constant time.
    pub(crate) fn verify(&self, parts: &[&[u8]], tag: &[u8]) -> bool {
        let mut m = <Hmac<Sha256> as Mac>::new_from_slice(&self.0).expect("HMAC takes any key length");
        for p in parts {
            m.update(p);
        }
        m.verify_slice(tag).is_ok()
    }

    /// A secret derived from this one for `label` and `context` (HMAC as
    /// the key-derivation function: the derived secret says nothing of this
    /// one).
    pub(crate) fn derive(&self, label: &[u8], context: &[u8]) -> Secret {
        Secret(self.mac(&[label, context]))
    }

    /// `secret` wrapped under this one for `context` (XOR with the HMAC of
    /// the context: a one-time pad, as long as a context is used once).
    pub fn wrap(&self, secret: &Secret, context: &[u8]) -> [u8; SECRET_LEN] {
        let pad = self.mac(&[WRAP_LABEL, context]);
        std::array::from_fn(|i| secret.0[i] ^ pad[i])
    }

    /// The inverse of [`Secret::wrap`] with the same context.
    pub fn unwrap(&self, wrapped: &[u8; SECRET_LEN], context: &[u8]) -> Secret {
        let pad = self.mac(&[WRAP_LABEL, context]);
        Secret(std::array::from_fn(|i| wrapped[i] ^ pad[i]))
    }

    fn hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }
}

/// What a key's holder may do.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Role {
    /// The cluster key: servers, and mounts trusted as much as servers.
    #[default]
    Server,
    /// A mount: may register as a client, nothing else.
    Client,
}

/// Which callers' ids a mount's key maps to the anonymous ids.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Squash {
    #[default]
    None,
    /// uid 0 and gid 0 (NFS `root_squash`).
    Root,
    /// Every uid and gid (NFS `all_squash`).
    All,
}

/// The options of a key (what the meta-server applies to its holder).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeyOptions {
    pub role: Role,
    pub squash: Squash,
    pub anon_uid: u32,
    pub anon_gid: u32,
}

impl Default for KeyOptions {
    fn default() -> Self {
        Self { role: Role::Server, squash: Squash::None, anon_uid: 65534, anon_gid: 65534 }
    }
}

impl KeyOptions {
    /// `(uid, gid)` as the holder's caller is to be treated.
    pub fn squash_ids(&self, uid: u32, gid: u32) -> (u32, u32) {
        match self.squash {
            Squash::None => (uid, gid),
            Squash::Root => {
                (if uid == 0 { self.anon_uid } else { uid }, if gid == 0 { self.anon_gid } else { gid })
            }
            Squash::All => (self.anon_uid, self.anon_gid),
        }
    }
}

/// One key: a name, a secret, options.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Key {
    pub name: String,
    pub secret: Secret,
    pub options: KeyOptions,
}

impl Key {
    /// A new random key.
    pub fn generate(name: &str, options: KeyOptions) -> Result<Self, KeyError> {
        check_name(name)?;
        Ok(Self { name: name.to_string(), secret: Secret::generate(), options })
    }

    /// The key as one line of a key file.
    pub fn to_line(&self) -> String {
        let o = &self.options;
        let mut line = format!("{} {}", self.name, self.secret.hex());
        line.push_str(match o.role {
            Role::Server => " role=server",
            Role::Client => " role=client",
        });
        match o.squash {
            Squash::None => {}
            Squash::Root => line.push_str(" squash=root"),
            Squash::All => line.push_str(" squash=all"),
        }
        let d = KeyOptions::default();
        if o.squash != Squash::None && (o.anon_uid, o.anon_gid) != (d.anon_uid, d.anon_gid) {
            line.push_str(&format!(" anonuid={} anongid={}", o.anon_uid, o.anon_gid));
        }
        line
    }

    fn parse_line(line: &str) -> Result<Self, String> {
        let mut fields = line.split_whitespace();
        let name = fields.next().ok_or("empty line")?;
        check_name(name).map_err(|e| e.to_string())?;
        let hex = fields.next().ok_or("no secret after the name")?;
        if hex.len() != 2 * SECRET_LEN {
            return Err(format!("the secret must be {} hex digits, not {}", 2 * SECRET_LEN, hex.len()));
        }
        let mut secret = [0u8; SECRET_LEN];
        for (i, b) in secret.iter_mut().enumerate() {
            *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).map_err(|_| "the secret is not hex")?;
        }
        let mut options = KeyOptions::default();
        for f in fields {
            let (k, v) = f.split_once('=').ok_or_else(|| format!("option {f:?} is not NAME=VALUE"))?;
            match (k, v) {
                ("role", "server") => options.role = Role::Server,
                ("role", "client") => options.role = Role::Client,
                ("squash", "none") => options.squash = Squash::None,
                ("squash", "root") => options.squash = Squash::Root,
                ("squash", "all") => options.squash = Squash::All,
                ("anonuid", n) => options.anon_uid = n.parse().map_err(|_| format!("bad anonuid {n:?}"))?,
                ("anongid", n) => options.anon_gid = n.parse().map_err(|_| format!("bad anongid {n:?}"))?,
                _ => return Err(format!("unknown option {f:?}")),
            }
        }
        if options.role == Role::Server && options.squash != Squash::None {
            return Err("the cluster key (role=server) cannot squash".into());
        }
        Ok(Key { name: name.to_string(), secret: Secret(secret), options })
    }
}

fn check_name(name: &str) -> Result<(), KeyError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME_LEN
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(KeyError::BadName(name.to_string()))
    }
}

/// Why a key file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("cannot read key file {path}: {error}")]
    Io { path: String, error: std::io::Error },
    #[error("key file {path} is readable by group or others (mode {mode:o}); chmod 600 it")]
    Exposed { path: String, mode: u32 },
    #[error("key file {path}, line {line}: {why}")]
    Syntax { path: String, line: usize, why: String },
    #[error("key file {0} holds no key")]
    Empty(String),
    #[error("key file {0} holds two keys of one name")]
    Duplicate(String),
    #[error("key file {0} holds more than one role=server key (a cluster has one cluster key)")]
    TwoClusterKeys(String),
    #[error("bad key name {0:?}: 1 to 64 letters, digits, '.', '_' or '-'")]
    BadName(String),
}

/// The keys of a key file, in file order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Keyring {
    keys: Vec<Key>,
}

/// Labels of the derived secrets (domain separation).
const SESSION_LABEL: &[u8] = b"citronfs session secret v1";
const WRAP_LABEL: &[u8] = b"citronfs wrapped secret v1";
const MEMBER_LABEL: &[u8] = b"citronfs member secret v1";

impl Keyring {
    pub fn new(keys: Vec<Key>) -> Result<Self, KeyError> {
        let ring = Self { keys };
        ring.validate("(in memory)")?;
        Ok(ring)
    }

    /// A keyring of one new cluster key named `name`.
    pub fn generate(name: &str) -> Result<Self, KeyError> {
        Self::new(vec![Key::generate(name, KeyOptions::default())?])
    }

    fn validate(&self, path: &str) -> Result<(), KeyError> {
        if self.keys.is_empty() {
            return Err(KeyError::Empty(path.to_string()));
        }
        for (i, k) in self.keys.iter().enumerate() {
            if self.keys[..i].iter().any(|o| o.name == k.name) {
                return Err(KeyError::Duplicate(path.to_string()));
            }
        }
        if self.keys.iter().filter(|k| k.options.role == Role::Server).count() > 1 {
            return Err(KeyError::TwoClusterKeys(path.to_string()));
        }
        Ok(())
    }

    /// Parses key-file text (`path` only names it in errors).
    pub fn parse(text: &str, path: &str) -> Result<Self, KeyError> {
        let mut keys = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let key = Key::parse_line(line).map_err(|why| KeyError::Syntax {
                path: path.to_string(),
                line: i + 1,
                why,
            })?;
            keys.push(key);
        }
        let ring = Self { keys };
        ring.validate(path)?;
        Ok(ring)
    }

    /// Reads a key file; refuses one that group or others may read.
    pub fn load(path: &Path) -> Result<Self, KeyError> {
        use std::os::unix::fs::PermissionsExt;
        let shown = path.display().to_string();
        let io = |error| KeyError::Io { path: shown.clone(), error };
        let meta = std::fs::metadata(path).map_err(io)?;
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            return Err(KeyError::Exposed { path: shown, mode });
        }
        let text = std::fs::read_to_string(path).map_err(io)?;
        Self::parse(&text, &shown)
    }

    /// Writes the keyring to a new file `path`, readable by its owner only;
    /// refuses to overwrite one.
    pub fn save_new(&self, path: &Path) -> std::io::Result<()> {
        use std::os::unix::fs::OpenOptionsExt;
        let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(path)?;
        writeln!(f, "# citronfs key file: NAME SECRET OPTIONS (keep it secret: mode 600)")?;
        for k in &self.keys {
            writeln!(f, "{}", k.to_line())?;
        }
        f.sync_all()
    }

    pub fn keys(&self) -> &[Key] {
        &self.keys
    }

    /// The key a client proves: the first of the file.
    pub fn first(&self) -> &Key {
        &self.keys[0]
    }

    pub fn get(&self, name: &str) -> Option<&Key> {
        self.keys.iter().find(|k| k.name == name)
    }

    /// The cluster key (`role=server`), if this keyring has it.
    pub fn cluster_key(&self) -> Option<&Key> {
        self.keys.iter().find(|k| k.options.role == Role::Server)
    }

    /// The secret of client `client` of the meta-server incarnation
    /// `incarnation`: what the client proves to servers after it registered.
    /// Only holders of the cluster key can derive it.
    pub fn session_secret(&self, incarnation: u64, client: u64) -> Option<Secret> {
        let mut context = [0u8; 16];
        context[..8].copy_from_slice(&incarnation.to_le_bytes());
        context[8..].copy_from_slice(&client.to_le_bytes());
        Some(self.cluster_key()?.secret.derive(SESSION_LABEL, &context))
    }

    /// The secret the registered clients of meta-server incarnation
    /// `incarnation` share, to reach each other's mailboxes.
    pub fn member_secret(&self, incarnation: u64) -> Option<Secret> {
        Some(self.cluster_key()?.secret.derive(MEMBER_LABEL, &incarnation.to_le_bytes()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_round_trip() {
        let mut options = KeyOptions { role: Role::Client, squash: Squash::Root, ..KeyOptions::default() };
        let k = Key::generate("lab-1", options).unwrap();
        let ring = Keyring::parse(&format!("# comment\n\n{}  # trailing\n", k.to_line()), "t").unwrap();
        assert_eq!(ring.keys(), &[k]);
        options.anon_uid = 99;
        options.anon_gid = 98;
        let k = Key::generate("x", options).unwrap();
        assert_eq!(Keyring::parse(&k.to_line(), "t").unwrap().first(), &k);
        let c = Key::generate("c", KeyOptions::default()).unwrap();
        assert_eq!(Keyring::parse(&c.to_line(), "t").unwrap().cluster_key(), Some(&c));
    }

    #[test]
    fn bad_files_are_refused_with_the_line() {
        let c = Key::generate("c", KeyOptions::default()).unwrap().to_line();
        for (text, want) in [
            ("", "holds no key"),
            ("c 00", "64 hex digits"),
            (&format!("{c}\n{c}"), "two keys of one name"),
            (&format!("{c} bogus=1"), "line 1: unknown option"),
            (&format!("{c} squash=root"), "cannot squash"),
            (&c.replace("c ", "d/e "), "bad key name"),
        ] {
            let e = Keyring::parse(text, "f").unwrap_err().to_string();
            assert!(e.contains(want), "{text:?}: {e}");
        }
        let d = Key::generate("d", KeyOptions::default()).unwrap().to_line();
        assert!(matches!(Keyring::parse(&format!("{c}\n{d}"), "f"), Err(KeyError::TwoClusterKeys(_))));
    }

    #[test]
    fn exposed_files_are_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("k");
        Keyring::generate("c").unwrap().save_new(&path).unwrap();
        assert!(Keyring::load(&path).is_ok());
        assert!(Keyring::generate("c").unwrap().save_new(&path).is_err(), "never overwrites");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o640)).unwrap();
        assert!(matches!(Keyring::load(&path), Err(KeyError::Exposed { mode: 0o640, .. })));
    }

    #[test]
    fn squash_maps_as_nfs_does() {
        let root = KeyOptions { squash: Squash::Root, ..KeyOptions::default() };
        assert_eq!(root.squash_ids(0, 0), (65534, 65534));
        assert_eq!(root.squash_ids(1000, 0), (1000, 65534));
        assert_eq!(root.squash_ids(1000, 100), (1000, 100));
        let all = KeyOptions { squash: Squash::All, anon_uid: 7, anon_gid: 8, ..KeyOptions::default() };
        assert_eq!(all.squash_ids(1000, 100), (7, 8));
        assert_eq!(KeyOptions::default().squash_ids(0, 0), (0, 0));
    }

    #[test]
    fn derived_secrets_depend_on_everything_and_need_the_cluster_key() {
        let ring = Keyring::generate("c").unwrap();
        let s = ring.session_secret(1, 2).unwrap();
        assert_ne!(s, ring.session_secret(1, 3).unwrap());
        assert_ne!(s, ring.session_secret(2, 2).unwrap());
        assert_ne!(ring.member_secret(1).unwrap(), ring.member_secret(2).unwrap());
        assert_ne!(Keyring::generate("c").unwrap().session_secret(1, 2).unwrap(), s);
        let client_only = Keyring::new(vec![Key::generate(
            "m",
            KeyOptions { role: Role::Client, ..KeyOptions::default() },
        )
        .unwrap()])
        .unwrap();
        assert!(client_only.session_secret(1, 2).is_none());
    }
}
