//! `citronfs locks PATH`: the cluster-wide holders and waiters of one file's
//! byte-range locks (fcntl, OFD, flock), like `lslocks` for the whole cluster.
//! The mount that serves PATH reads the file's lock-record table and answers
//! through a virtual extended attribute (`citronfs_mount::LOCKS_XATTR`).

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;

#[derive(Args, Debug)]
pub struct LocksArgs {
    /// A file on a citronfs mount.
    path: PathBuf,
}

/// The value of the extended attribute `name` of `path`.
pub(crate) fn getxattr(path: &std::path::Path, name: &str) -> Result<Vec<u8>> {
    let p = CString::new(path.as_os_str().as_bytes()).context("the path has a NUL byte")?;
    let n = CString::new(name).expect("a constant name");
    let mut buf = vec![0u8; 64 * 1024];
    // SAFETY: `p` and `n` are NUL-terminated; `buf` is valid for its length.
    let len = unsafe { libc::getxattr(p.as_ptr(), n.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    if len < 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::ENODATA) || e.raw_os_error() == Some(libc::ENOTSUP) {
            bail!("{} is not on a citronfs mount", path.display());
        }
        return Err(e).with_context(|| format!("cannot read the locks of {}", path.display()));
    }
    buf.truncate(len as usize);
    Ok(buf)
}

pub fn run(args: LocksArgs) -> Result<()> {
    if !args.path.exists() {
        bail!("{} does not exist", args.path.display());
    }
    let listing = getxattr(&args.path, citronfs_mount::LOCKS_XATTR)?;
    let text = String::from_utf8(listing).context("the mount answered garbage")?;
    let rows: Vec<Vec<&str>> =
        text.lines().map(|l| l.split(' ').collect()).filter(|f: &Vec<&str>| f.len() == 8).collect();
    if rows.is_empty() {
        println!("no locks on {}", args.path.display());
        return Ok(());
    }
    let header = ["NODE (mount)", "CLIENT", "PID", "TYPE", "MODE", "START", "END", "STATE"];
    let table: Vec<[&str; 8]> =
        rows.iter().map(|f| [f[7], f[6], f[5], f[1], f[2], f[3], f[4], f[0]]).collect();
    let widths: Vec<usize> = (0..8)
        .map(|i| table.iter().map(|r| r[i].len()).chain([header[i].len()]).max().unwrap_or(0))
        .collect();
    let line = |cells: [&str; 8]| {
        cells.iter().zip(&widths).map(|(c, w)| format!("{c:<w$}")).collect::<Vec<_>>().join("  ")
    };
    println!("{}", line(header).trim_end());
    for r in table {
        println!("{}", line(r).trim_end());
    }
    Ok(())
}
