//! The `lock-probe` commands beyond locks: credentials, modes and owners,
//! shared mappings and leases, so one probe process can be the
//! unprivileged user, the process that maps a file, or the lease holder of
//! a test. One command per line, one answer per line, as for the locks:
//!
//! ```text
//! become UID GID          -> ok        (drop to UID/GID, no supplementary groups)
//! open-ro PATH            -> fd N      (O_RDONLY)
//! open-nb PATH            -> fd N      (O_RDWR | O_NONBLOCK: a lease break does not wait)
//! stat PATH               -> mode OOOO UID GID SIZE   (permission bits in octal)
//! truncate FD LEN         -> ok
//! chown PATH UID GID      -> ok        (-1 leaves one unchanged)
//! mmap FD LEN             -> map N     (MAP_SHARED, read and write)
//! mwrite N OFFSET TEXT    -> ok        (store through the mapping)
//! mread N OFFSET LEN      -> data TEXT (load through the mapping)
//! mincr N OFFSET          -> ok K      (a decimal counter in the mapping, plus one)
//! msync N                 -> ok        (MS_SYNC)
//! munmap N                -> ok
//! lease FD r|w|u          -> ok        (F_SETLEASE; its break signal, SIGIO, is counted)
//! getlease FD             -> lease r|w|u
//! breaks                  -> breaks N  (lease-break signals received)
//! ```
//!
//! Errors answer `err NAME` ([`errno_name`]).

use std::ffi::CString;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;

/// Live mappings by number: (address, length).
static MAPS: Mutex<Vec<Option<(usize, usize)>>> = Mutex::new(Vec::new());
static LEASE_BREAKS: AtomicU32 = AtomicU32::new(0);

extern "C" fn on_lease_break(_: libc::c_int) {
    LEASE_BREAKS.fetch_add(1, Ordering::Relaxed);
}

/// The answer for an errno: its name for the ones tests look for.
pub fn errno_name(e: i32) -> String {
    match e {
        libc::EAGAIN => "EAGAIN".into(),
        libc::EDEADLK => "EDEADLK".into(),
        libc::EINTR => "EINTR".into(),
        libc::EBADF => "EBADF".into(),
        libc::EINVAL => "EINVAL".into(),
        libc::ENOLCK => "ENOLCK".into(),
        libc::EIO => "EIO".into(),
        libc::EPERM => "EPERM".into(),
        libc::EACCES => "EACCES".into(),
        libc::EEXIST => "EEXIST".into(),
        libc::ENODEV => "ENODEV".into(),
        other => format!("errno{other}"),
    }
}

fn last_err() -> String {
    format!("err {}", errno_name(std::io::Error::last_os_error().raw_os_error().unwrap_or(0)))
}

fn ok_or_err(r: i64) -> String {
    if r < 0 {
        last_err()
    } else {
        "ok".into()
    }
}

fn open(words: &[&str], flags: i32) -> Result<String, String> {
    let path = CString::new(*words.get(1).ok_or("missing path")?).map_err(|e| e.to_string())?;
    // SAFETY: a valid NUL-terminated path.
    let fd = unsafe { libc::open(path.as_ptr(), flags) };
    Ok(if fd < 0 { last_err() } else { format!("fd {fd}") })
}

fn mapping(n: i64) -> Result<(usize, usize), String> {
    MAPS.lock().unwrap().get(n as usize).copied().flatten().ok_or_else(|| format!("no mapping {n}"))
}

/// Runs one of these commands; `None` if `words` is not one of them.
pub fn run(words: &[&str]) -> Option<Result<String, String>> {
    let num = |i: usize| -> Result<i64, String> {
        words.get(i).ok_or("missing argument")?.parse::<i64>().map_err(|e| format!("bad number: {e}"))
    };
    let text = |i: usize| -> Result<&str, String> { words.get(i).copied().ok_or("missing argument".into()) };
    let answer = (|| -> Result<String, String> {
        Ok(match words.first().copied().unwrap_or("") {
            "become" => {
                let (uid, gid) = (num(1)? as libc::uid_t, num(2)? as libc::gid_t);
                // SAFETY: credential calls with no memory arguments but
                // setgroups' empty list.
                let r = unsafe {
                    if libc::setgroups(0, std::ptr::null()) < 0 || libc::setgid(gid) < 0 {
                        -1
                    } else {
                        libc::setuid(uid)
                    }
                };
                ok_or_err(r.into())
            }
            "open-ro" => return open(words, libc::O_RDONLY),
            "open-nb" => return open(words, libc::O_RDWR | libc::O_NONBLOCK),
            "stat" => {
                let path = CString::new(text(1)?).map_err(|e| e.to_string())?;
                // SAFETY: an all-zero stat is valid; stat fills it.
                let mut st: libc::stat = unsafe { std::mem::zeroed() };
                // SAFETY: a valid path and a valid stat buffer.
                if unsafe { libc::stat(path.as_ptr(), &mut st) } < 0 {
                    return Ok(last_err());
                }
                format!("mode {:04o} {} {} {}", st.st_mode & 0o7777, st.st_uid, st.st_gid, st.st_size)
            }
            "truncate" => {
                // SAFETY: ftruncate of a descriptor number; a bad one fails.
                ok_or_err(unsafe { libc::ftruncate(num(1)? as i32, num(2)?) }.into())
            }
            "chown" => {
                let path = CString::new(text(1)?).map_err(|e| e.to_string())?;
                // SAFETY: a valid path; -1 (as the unsigned id) leaves an id unchanged.
                let r = unsafe { libc::chown(path.as_ptr(), num(2)? as libc::uid_t, num(3)? as libc::gid_t) };
                ok_or_err(r.into())
            }
            "mmap" => {
                let (fd, len) = (num(1)? as i32, num(2)? as usize);
                // SAFETY: a fresh shared mapping of a descriptor; the kernel
                // picks the address; failure is MAP_FAILED.
                let p = unsafe {
                    libc::mmap(
                        std::ptr::null_mut(),
                        len,
                        libc::PROT_READ | libc::PROT_WRITE,
                        libc::MAP_SHARED,
                        fd,
                        0,
                    )
                };
                if p == libc::MAP_FAILED {
                    return Ok(last_err());
                }
                let mut maps = MAPS.lock().unwrap();
                maps.push(Some((p as usize, len)));
                format!("map {}", maps.len() - 1)
            }
            "mwrite" => {
                let (addr, len) = mapping(num(1)?)?;
                let (off, bytes) = (num(2)? as usize, text(3)?.as_bytes());
                if off + bytes.len() > len {
                    return Err("past the mapping".into());
                }
                // SAFETY: the range lies inside a live shared mapping of
                // `len` bytes (checked above); nothing else in this process
                // refers to it.
                unsafe {
                    std::ptr::copy_nonoverlapping(bytes.as_ptr(), (addr + off) as *mut u8, bytes.len())
                };
                "ok".into()
            }
            "mread" => {
                let (addr, len) = mapping(num(1)?)?;
                let (off, n) = (num(2)? as usize, num(3)? as usize);
                if off + n > len {
                    return Err("past the mapping".into());
                }
                let mut buf = vec![0u8; n];
                // SAFETY: as for mwrite, a range inside a live mapping.
                unsafe { std::ptr::copy_nonoverlapping((addr + off) as *const u8, buf.as_mut_ptr(), n) };
                format!("data {}", String::from_utf8_lossy(&buf))
            }
            "mincr" => {
                let (addr, len) = mapping(num(1)?)?;
                let off = num(2)? as usize;
                if off + 20 > len {
                    return Err("past the mapping".into());
                }
                // SAFETY: 20 bytes inside a live mapping (checked above).
                let counter = unsafe { std::slice::from_raw_parts_mut((addr + off) as *mut u8, 20) };
                let text = String::from_utf8_lossy(counter);
                let n: u64 =
                    text.trim_matches(|c: char| c == '\0' || c.is_whitespace()).parse().unwrap_or(0) + 1;
                counter.copy_from_slice(format!("{n:020}").as_bytes());
                format!("ok {n}")
            }
            "msync" => {
                let (addr, len) = mapping(num(1)?)?;
                // SAFETY: a live mapping's own address and length.
                ok_or_err(unsafe { libc::msync(addr as *mut libc::c_void, len, libc::MS_SYNC) }.into())
            }
            "munmap" => {
                let n = num(1)?;
                let (addr, len) = mapping(n)?;
                MAPS.lock().unwrap()[n as usize] = None;
                // SAFETY: a live mapping, forgotten above so it is never used again.
                ok_or_err(unsafe { libc::munmap(addr as *mut libc::c_void, len) }.into())
            }
            "lease" => {
                let typ = match text(2)? {
                    "r" => libc::F_RDLCK,
                    "w" => libc::F_WRLCK,
                    "u" => libc::F_UNLCK,
                    other => return Err(format!("bad lease type {other}")),
                };
                // SAFETY: a handler that only counts, installed with an
                // empty mask; F_SETLEASE on a descriptor number.
                let r = unsafe {
                    let mut sa: libc::sigaction = std::mem::zeroed();
                    sa.sa_sigaction = on_lease_break as extern "C" fn(libc::c_int) as usize;
                    libc::sigemptyset(&mut sa.sa_mask);
                    sa.sa_flags = libc::SA_RESTART;
                    libc::sigaction(libc::SIGIO, &sa, std::ptr::null_mut());
                    libc::fcntl(num(1)? as i32, libc::F_SETLEASE, typ)
                };
                ok_or_err(r.into())
            }
            "getlease" => {
                // SAFETY: F_GETLEASE on a descriptor number.
                let r = unsafe { libc::fcntl(num(1)? as i32, libc::F_GETLEASE) };
                match r {
                    libc::F_RDLCK => "lease r".into(),
                    libc::F_WRLCK => "lease w".into(),
                    libc::F_UNLCK => "lease u".into(),
                    _ => last_err(),
                }
            }
            "breaks" => format!("breaks {}", LEASE_BREAKS.load(Ordering::Relaxed)),
            _ => return Err(String::new()),
        })
    })();
    match answer {
        Err(e) if e.is_empty() => None,
        other => Some(other),
    }
}
