//! The frames every tcp connection of the project speaks, split from the
//! code that drives them.
//!
//! Every frame is `[u32 len][u64 seq][body]`, little-endian, where `len`
//! counts the `seq` and the body. The body is bincode (see [`crate::codec`]).
//! The sequence number sits outside the body so that a server which cannot
//! decode a body can still say which request it refuses.

use std::io::{self, Read, Write};

use crate::codec::MAX_FRAME;

/// Bytes before the body.
pub const HEADER_LEN: usize = 12;

/// What went wrong reading a frame.
#[derive(Debug)]
pub enum FrameError {
    /// The peer closed the connection cleanly between frames.
    Closed,
    /// The stream failed or ended inside a frame.
    Io(io::Error),
    /// The length prefix is impossible; the stream cannot be resynchronised.
    BadLength(u32),
}

/// Reads one frame into `body` and returns its sequence number.
pub fn read_frame(r: &mut impl Read, body: &mut Vec<u8>) -> Result<u64, FrameError> {
    let mut header = [0u8; HEADER_LEN];
    // Distinguish a clean close (no byte of a new frame) from a truncated one.
    let mut got = 0;
    while got < HEADER_LEN {
        match r.read(&mut header[got..]) {
            Ok(0) if got == 0 => return Err(FrameError::Closed),
            Ok(0) => return Err(FrameError::Io(io::ErrorKind::UnexpectedEof.into())),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(FrameError::Io(e)),
        }
    }
    let len = u32::from_le_bytes(header[0..4].try_into().expect("4 bytes"));
    let seq = u64::from_le_bytes(header[4..12].try_into().expect("8 bytes"));
    if (len as usize) < 8 || u64::from(len) > MAX_FRAME + 8 {
        return Err(FrameError::BadLength(len));
    }
    body.clear();
    body.resize(len as usize - 8, 0);
    r.read_exact(body).map_err(FrameError::Io)?;
    Ok(seq)
}

/// Busy-polls `stream` for up to `budget` until a byte can be read, without
/// consuming it. Returns whether one can.
///
/// A thread that blocks in `read` right after sending a request pays the
/// scheduler's wake-up on the reply (tens of microseconds on a virtual
/// machine), which is most of a loopback round trip. Polling for a short
/// while first keeps the thread running, as an RDMA client polls its
/// completion queue; past the budget the caller blocks as usual.
/// Whether an idle connection (no answer due) is still open: the peer has
/// neither closed it nor sent anything unasked.
pub fn idle_and_open(stream: &std::net::TcpStream) -> bool {
    use std::os::fd::AsRawFd;
    let mut byte = 0u8;
    // SAFETY: `byte` is a valid 1-byte buffer; MSG_PEEK leaves any data in
    // the socket and MSG_DONTWAIT makes the call return at once.
    let n = unsafe {
        libc::recv(stream.as_raw_fd(), (&mut byte as *mut u8).cast(), 1, libc::MSG_PEEK | libc::MSG_DONTWAIT)
    };
    n < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::WouldBlock
}

pub fn poll_readable(stream: &std::net::TcpStream, budget: std::time::Duration) -> bool {
    use std::os::fd::AsRawFd;
    if budget.is_zero() {
        return false;
    }
    let start = std::time::Instant::now();
    let mut byte = 0u8;
    loop {
        // SAFETY: `byte` is a valid 1-byte buffer; MSG_PEEK leaves the data in
        // the socket and MSG_DONTWAIT makes the call return at once.
        let n = unsafe {
            libc::recv(
                stream.as_raw_fd(),
                (&mut byte as *mut u8).cast(),
                1,
                libc::MSG_PEEK | libc::MSG_DONTWAIT,
            )
        };
        // n > 0: data; n == 0: orderly shutdown (reading will say so);
        // n < 0 with EAGAIN: nothing yet; any other error: reading will say.
        if n >= 0 || std::io::Error::last_os_error().kind() != std::io::ErrorKind::WouldBlock {
            return true;
        }
        if start.elapsed() >= budget {
            return false;
        }
        // Give the core to any runnable thread (with more threads than
        // cores, pure spinning would starve the very thread we wait for).
        std::thread::yield_now();
    }
}

/// Waits up to `timeout` until `stream` has something to read (or is
/// closed, or failed: reading will say); `false` if the time ran out.
pub fn wait_readable(stream: &std::net::TcpStream, timeout: std::time::Duration) -> io::Result<bool> {
    use std::os::fd::AsRawFd;
    let deadline = std::time::Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let mut fd = libc::pollfd { fd: stream.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        let ms = libc::c_int::try_from(left.as_millis() + 1).unwrap_or(libc::c_int::MAX);
        // SAFETY: one valid pollfd, for the duration of the call.
        match unsafe { libc::poll(&mut fd, 1, ms) } {
            n if n > 0 => return Ok(true),
            0 if std::time::Instant::now() >= deadline => return Ok(false),
            0 => {}
            _ => {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
}

/// Appends one frame to `out` (a buffered writer or a byte vector).
pub fn write_frame(out: &mut impl Write, seq: u64, body: &[u8]) -> io::Result<()> {
    let len = u32::try_from(body.len() + 8).map_err(|_| io::Error::other("frame too large"))?;
    let mut header = [0u8; HEADER_LEN];
    header[0..4].copy_from_slice(&len.to_le_bytes());
    header[4..12].copy_from_slice(&seq.to_le_bytes());
    out.write_all(&header)?;
    out.write_all(body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frame_round_trip() {
        let mut buf = Vec::new();
        write_frame(&mut buf, 42, b"hello").unwrap();
        let mut body = Vec::new();
        assert_eq!(read_frame(&mut buf.as_slice(), &mut body).unwrap(), 42);
        assert_eq!(body, b"hello");
    }

    #[test]
    fn truncated_and_closed_are_distinguished() {
        let mut body = Vec::new();
        assert!(matches!(read_frame(&mut &[][..], &mut body), Err(FrameError::Closed)));
        let mut buf = Vec::new();
        write_frame(&mut buf, 1, b"abcdef").unwrap();
        buf.truncate(buf.len() - 2);
        assert!(matches!(read_frame(&mut buf.as_slice(), &mut body), Err(FrameError::Io(_))));
        assert!(matches!(read_frame(&mut &buf[..5], &mut body), Err(FrameError::Io(_))));
    }

    #[test]
    fn impossible_lengths_are_refused() {
        let mut body = Vec::new();
        let huge = [0xFF, 0xFF, 0xFF, 0xFF, 0, 0, 0, 0, 0, 0, 0, 0];
        assert!(matches!(read_frame(&mut &huge[..], &mut body), Err(FrameError::BadLength(_))));
        let tiny = [3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        assert!(matches!(read_frame(&mut &tiny[..], &mut body), Err(FrameError::BadLength(3))));
    }
}
