//! The checker's looking threads: a random look (stat, lstat, access,
//! open and read, readlink, readdir) at a zone through a mount, holding no
//! mutex, logged with its start, end and what it saw.

use std::fs;
use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::sync::atomic::Ordering;
use std::time::Instant;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::changes::{dir_path, file_path};
use super::{
    c_path, errno, zone_dir, Look, Observation, Progress, Seen, SeenAttr, LOOKS, READ_BUFFER, ZONES,
};
use crate::TestMount;

fn seen_attr(meta: std::io::Result<fs::Metadata>) -> Seen {
    match meta {
        Err(e) => Seen::Err(errno(&e)),
        Ok(meta) => {
            let ft = meta.file_type();
            let kind = if ft.is_dir() {
                'd'
            } else if ft.is_symlink() {
                'l'
            } else {
                'f'
            };
            Seen::Attr(SeenAttr {
                kind,
                ino: meta.ino(),
                perm: meta.mode() & 0o7777,
                size: meta.size(),
                nlink: meta.nlink(),
                mtime: (meta.mtime(), meta.mtime_nsec() as u32),
            })
        }
    }
}

/// Does `look` of `path` on mount `m` (whose zone directory is `zone`).
fn observe(m: &TestMount, zone: &str, look: Look, path: &str) -> Seen {
    let p = m.path(&format!("{zone}/{path}"));
    let access = |mode| {
        // SAFETY: a NUL-terminated path.
        match unsafe { libc::access(c_path(&p).as_ptr(), mode) } {
            0 => Seen::Done,
            _ => Seen::Err(errno(&std::io::Error::last_os_error())),
        }
    };
    match look {
        Look::Stat => seen_attr(fs::metadata(&p)),
        Look::Lstat => seen_attr(fs::symlink_metadata(&p)),
        Look::Exists => access(libc::F_OK),
        Look::Exec => access(libc::X_OK),
        Look::Read => {
            // One read(2) of more than the checker ever writes: one FUSE
            // read, made under the file's locks, sees one state. (Reading
            // on until EOF would be several, each free to see a later one.)
            let mut bytes = vec![0; READ_BUFFER];
            match fs::File::open(&p) {
                Err(e) => Seen::Err(errno(&e)),
                Ok(mut f) => match f.read(&mut bytes) {
                    Ok(n) => {
                        bytes.truncate(n);
                        Seen::Bytes(bytes)
                    }
                    Err(e) => Seen::Err(errno(&e)),
                },
            }
        }
        Look::Readlink => match fs::read_link(&p) {
            Ok(t) => Seen::Target(t.to_string_lossy().into_owned()),
            Err(e) => Seen::Err(errno(&e)),
        },
        Look::Readdir => {
            let names: std::io::Result<Vec<String>> = fs::read_dir(&p).and_then(|entries| {
                entries.map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned())).collect()
            });
            match names {
                Ok(mut names) => {
                    names.sort();
                    Seen::Names(names)
                }
                Err(e) => Seen::Err(errno(&e)),
            }
        }
    }
}

/// A looking thread on mount `m` while the run goes on: its observations.
pub(super) fn look_until(m: &TestMount, mount: usize, progress: &Progress, seed: u64) -> Vec<Observation> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut out = Vec::new();
    while progress.going() {
        let zone = rng.gen_range(0..ZONES);
        let look = LOOKS[rng.gen_range(0..LOOKS.len())];
        // Mostly names that are there now (a peek only chooses; the check
        // is against the log).
        let path = if rng.gen_bool(0.6) {
            let tree = progress.newest[zone].lock().unwrap().clone();
            let paths = tree.paths();
            paths[rng.gen_range(0..paths.len())].clone()
        } else if look == Look::Readdir {
            dir_path(&mut rng)
        } else {
            file_path(&mut rng)
        };
        let start = Instant::now();
        let seen = observe(m, &zone_dir(zone), look, &path);
        let end = Instant::now();
        out.push(Observation { zone, mount, look, path, start, end, seen });
        progress.looks[mount].fetch_add(1, Ordering::Relaxed);
    }
    out
}
