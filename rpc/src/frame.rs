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

/// Whether busy-polling has been paying off on one connection: decides
/// each wait's budget for [`poll_readable`].
///
/// Polling wins when the peer answers within the budget — a loopback
/// round trip on an idle machine, a pipelining client's next request —
/// and loses when it does not: every miss burns the whole budget of CPU.
/// On a machine whose cores are all busy (a benchmark's processes, the
/// mounts' workers, the meta-server's threads on two cores) the peer is
/// slow to run *because* of such spinning, and nearly every poll misses:
/// measured with `bench meta`, four processes on two mounts, a
/// meta-server that never polled for the next request created 14–36% and
/// unlinked 27–68% more files per second in a shared directory (three
/// runs each), while one process alone stat'ed 20–35% fewer. So each
/// connection keeps a score: a catch raises it, a miss lowers it twice
/// as much, and below [`PollGauge::FLOOR`] the connection stops polling,
/// except one wait in [`PollGauge::PROBE_EVERY`], which polls to notice
/// that the peer has become quick again. Against polling always (medians
/// of five runs each, same sitting): one process 0.97–1.38× on every
/// phase of `bench meta`, four processes 0.89–1.19× (shared-directory
/// unlinks 1.19×) — on this machine's noise, a gain alone and no loss
/// beyond it under load.
#[derive(Debug)]
pub struct PollGauge {
    score: u8,
    /// Waits since the last probe, while not polling.
    idle_waits: u32,
}

impl Default for PollGauge {
    fn default() -> Self {
        Self { score: Self::MAX, idle_waits: 0 }
    }
}

impl PollGauge {
    const MAX: u8 = 16;
    /// Polling goes on while the score is at least this: at most a third
    /// of recent polls missed.
    const FLOOR: u8 = 8;
    const PROBE_EVERY: u32 = 16;

    /// Polls `stream` for up to `budget` if polling pays on this
    /// connection (see the type), then records whether it caught a byte.
    pub fn poll(&mut self, stream: &std::net::TcpStream, budget: std::time::Duration) {
        if self.score < Self::FLOOR {
            self.idle_waits += 1;
            if self.idle_waits < Self::PROBE_EVERY {
                return;
            }
            self.idle_waits = 0;
        }
        if poll_readable(stream, budget) {
            self.score = (self.score + 1).min(Self::MAX);
        } else {
            self.score = self.score.saturating_sub(2);
        }
    }

    /// Whether the next wait polls, unless it probes (tests, diagnostics).
    pub fn polling(&self) -> bool {
        self.score >= Self::FLOOR
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
    fn a_connection_stops_polling_after_misses_and_probes_its_way_back() {
        use std::net::{TcpListener, TcpStream};
        use std::time::Duration;
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (mut server, _) = listener.accept().unwrap();
        let mut gauge = PollGauge::default();
        let budget = Duration::from_micros(10);
        // Nothing ever comes: five misses take it from MAX under FLOOR.
        for _ in 0..5 {
            assert!(gauge.polling());
            gauge.poll(&client, budget);
        }
        assert!(!gauge.polling(), "still polling after five misses");
        // Bytes are there at every wait from now on: only probes poll, and
        // each catch raises the score until polling resumes.
        server.write_all(b"x").unwrap();
        let mut waits = 0;
        while !gauge.polling() {
            gauge.poll(&client, budget);
            waits += 1;
            assert!(waits <= 4 * PollGauge::PROBE_EVERY, "never polled again");
        }
        assert_eq!(waits % PollGauge::PROBE_EVERY, 0, "polled outside a probe");
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
