//! POSIX lock calls below FUSE, as the lock tests make them: one owner's
//! call over a byte range, and an `F_SETLKW` whose answer arrives on a
//! channel (so a test can wait for it with a bound, or see that it has not
//! come).

use std::sync::mpsc::{channel, Receiver};

use citronfs_core::client::{FsClient, LockCall};
use citronfs_core::locks::{ByteRange, LockFlavor, LockMode, LockOwner};
use citronfs_core::types::Ino;
use citronfs_core::FsError;

/// A POSIX (`fcntl`) call of `owner` on `range` of `ino`: `mode` `None`
/// unlocks. The owner's number doubles as its pid (what `F_GETLK` reports).
pub fn posix_call(ino: Ino, owner: u64, mode: Option<LockMode>, range: ByteRange) -> LockCall {
    LockCall {
        ino,
        owner: LockOwner(owner),
        flavor: LockFlavor::Posix,
        mode,
        range,
        pid: owner as u32,
        fh: 1,
    }
}

/// `F_SETLKW` of `call` on `client`, never interrupted; its answer comes on
/// the returned channel.
pub fn setlkw(client: &FsClient, call: LockCall) -> Receiver<Result<(), FsError>> {
    let (tx, rx) = channel();
    client.setlkw(
        &call,
        Box::new(|| false),
        Box::new(move |r| {
            let _ = tx.send(r);
        }),
    );
    rx
}
