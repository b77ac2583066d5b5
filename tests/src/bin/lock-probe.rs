//! A process that takes file locks on command, for the mounted-lock tests:
//! POSIX locks belong to a process, so every owner in those tests is one of
//! these. It reads one command per line on stdin and answers one line on
//! stdout (a blocking command answers when it returns).
//!
//! ```text
//! open PATH              -> fd N
//! dup FD                 -> fd N
//! close FD               -> ok
//! setlk FD r|w|u START LEN       (also setlkw, ofd-setlk, ofd-setlkw)
//!                        -> ok | err EAGAIN | err EDEADLK | err EINTR | ...
//! getlk FD r|w START LEN (also ofd-getlk)
//!                        -> unlocked | r|w START LEN PID
//! flock FD sh|ex|un [nb] -> ok | err EWOULDBLOCK ...
//! write FD OFFSET TEXT / read FD OFFSET LEN -> ok / data TEXT
//! incr FD OFFSET         -> ok N  (read a decimal counter, add 1, write back)
//! catch-usr1             -> ok    (a SIGUSR1 handler without SA_RESTART)
//! spare-thread           -> ok    (a second thread that sleeps with no signal
//!                                  blocked: it could take a process-directed one)
//! pid                    -> pid N
//! ```
//!
//! and the commands of [`citronfs_tests::probe_ops`] (credentials, modes,
//! shared mappings, leases).

use std::ffi::CString;
use std::io::{BufRead, Write};

use citronfs_tests::probe_ops::errno_name;

extern "C" fn on_usr1(_: libc::c_int) {}

fn last_err() -> String {
    format!("err {}", errno_name(std::io::Error::last_os_error().raw_os_error().unwrap_or(0)))
}

fn lock_type(s: &str) -> Option<i16> {
    match s {
        "r" => Some(libc::F_RDLCK as i16),
        "w" => Some(libc::F_WRLCK as i16),
        "u" => Some(libc::F_UNLCK as i16),
        _ => None,
    }
}

fn run(words: &[&str]) -> Result<String, String> {
    let num = |i: usize| -> Result<i64, String> {
        words.get(i).ok_or("missing argument")?.parse::<i64>().map_err(|e| format!("bad number: {e}"))
    };
    match words.first().copied().unwrap_or("") {
        "open" => {
            let path = CString::new(*words.get(1).ok_or("missing path")?).map_err(|e| e.to_string())?;
            // SAFETY: `path` is a valid NUL-terminated string.
            let fd = unsafe { libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CREAT, 0o644) };
            Ok(if fd < 0 { last_err() } else { format!("fd {fd}") })
        }
        "dup" => {
            // SAFETY: dup of a descriptor number; an invalid one fails with EBADF.
            let fd = unsafe { libc::dup(num(1)? as i32) };
            Ok(if fd < 0 { last_err() } else { format!("fd {fd}") })
        }
        "close" => {
            // SAFETY: closing a descriptor number; an invalid one fails with EBADF.
            let r = unsafe { libc::close(num(1)? as i32) };
            Ok(if r < 0 { last_err() } else { "ok".into() })
        }
        cmd @ ("setlk" | "setlkw" | "ofd-setlk" | "ofd-setlkw" | "getlk" | "ofd-getlk") => {
            let fd = num(1)? as i32;
            let typ = lock_type(words.get(2).ok_or("missing type")?).ok_or("type is r, w or u")?;
            // SAFETY: an all-zero `flock` is a valid value of the C struct.
            let mut fl: libc::flock = unsafe { std::mem::zeroed() };
            fl.l_type = typ;
            fl.l_whence = libc::SEEK_SET as i16;
            fl.l_start = num(3)?;
            fl.l_len = num(4)?;
            let op = match cmd {
                "setlk" => libc::F_SETLK,
                "setlkw" => libc::F_SETLKW,
                "ofd-setlk" => libc::F_OFD_SETLK,
                "ofd-setlkw" => libc::F_OFD_SETLKW,
                "getlk" => libc::F_GETLK,
                _ => libc::F_OFD_GETLK,
            };
            // SAFETY: `fl` is a valid `struct flock` that outlives the call.
            let r = unsafe { libc::fcntl(fd, op, &mut fl as *mut libc::flock) };
            if r < 0 {
                return Ok(last_err());
            }
            if cmd.ends_with("getlk") {
                return Ok(match i32::from(fl.l_type) {
                    libc::F_UNLCK => "unlocked".into(),
                    t => format!(
                        "{} {} {} {}",
                        if t == libc::F_WRLCK { "w" } else { "r" },
                        fl.l_start,
                        fl.l_len,
                        fl.l_pid
                    ),
                });
            }
            Ok("ok".into())
        }
        "flock" => {
            let mut op = match *words.get(2).ok_or("missing sh|ex|un")? {
                "sh" => libc::LOCK_SH,
                "ex" => libc::LOCK_EX,
                "un" => libc::LOCK_UN,
                other => return Err(format!("bad flock op {other}")),
            };
            if words.get(3) == Some(&"nb") {
                op |= libc::LOCK_NB;
            }
            // SAFETY: flock on a descriptor number; an invalid one fails.
            let r = unsafe { libc::flock(num(1)? as i32, op) };
            Ok(if r < 0 { last_err() } else { "ok".into() })
        }
        "write" => {
            let text = words.get(3).ok_or("missing text")?.as_bytes();
            // SAFETY: `text` is valid for `text.len()` bytes.
            let r = unsafe { libc::pwrite(num(1)? as i32, text.as_ptr().cast(), text.len(), num(2)?) };
            Ok(if r < 0 { last_err() } else { "ok".into() })
        }
        "read" => {
            let mut buf = vec![0u8; num(3)? as usize];
            // SAFETY: `buf` is valid for `buf.len()` bytes.
            let r = unsafe { libc::pread(num(1)? as i32, buf.as_mut_ptr().cast(), buf.len(), num(2)?) };
            if r < 0 {
                return Ok(last_err());
            }
            buf.truncate(r as usize);
            Ok(format!("data {}", String::from_utf8_lossy(&buf)))
        }
        "incr" => {
            let (fd, off) = (num(1)? as i32, num(2)?);
            let mut buf = [0u8; 20];
            // SAFETY: `buf` is valid for 20 bytes.
            let r = unsafe { libc::pread(fd, buf.as_mut_ptr().cast(), buf.len(), off) };
            if r < 0 {
                return Ok(last_err());
            }
            let text = String::from_utf8_lossy(&buf[..r as usize]);
            let n: u64 = text.trim_matches(|c: char| c == '\0' || c.is_whitespace()).parse().unwrap_or(0) + 1;
            let out = format!("{n:020}");
            // SAFETY: `out` is valid for its length.
            let w = unsafe { libc::pwrite(fd, out.as_ptr().cast(), out.len(), off) };
            Ok(if w < 0 { last_err() } else { format!("ok {n}") })
        }
        "catch-usr1" => {
            // SAFETY: installs a handler that does nothing, with an empty mask
            // and no SA_RESTART, so a blocked call returns EINTR.
            unsafe {
                let mut sa: libc::sigaction = std::mem::zeroed();
                sa.sa_sigaction = on_usr1 as extern "C" fn(libc::c_int) as usize;
                libc::sigemptyset(&mut sa.sa_mask);
                sa.sa_flags = 0;
                if libc::sigaction(libc::SIGUSR1, &sa, std::ptr::null_mut()) < 0 {
                    return Ok(last_err());
                }
            }
            Ok("ok".into())
        }
        "spare-thread" => {
            // Answered once the thread runs its own code: while a thread is
            // being created, it blocks every signal.
            let (running, started) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                let _ = running.send(());
                loop {
                    std::thread::park();
                }
            });
            started.recv().map_err(|e| e.to_string())?;
            Ok("ok".into())
        }
        "pid" => Ok(format!("pid {}", std::process::id())),
        other => {
            citronfs_tests::probe_ops::run(words).unwrap_or_else(|| Err(format!("unknown command {other:?}")))
        }
    }
}

fn main() {
    let stdin = std::io::stdin();
    let mut out = std::io::stdout();
    for line in stdin.lock().lines() {
        let Ok(line) = line else { break };
        let words: Vec<&str> = line.split_whitespace().collect();
        if words.is_empty() {
            continue;
        }
        if words[0] == "exit" {
            break;
        }
        let answer = run(&words).unwrap_or_else(|e| format!("bad {e}"));
        if writeln!(out, "{answer}").and_then(|_| out.flush()).is_err() {
            break;
        }
    }
}
