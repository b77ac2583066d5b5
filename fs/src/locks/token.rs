//! Lock tokens: a mount that is the only one locking a file takes and
//! releases its fcntl, OFD and flock locks locally, with no verb, under a
//! token it holds in the file's lock memory (the byte-range analogue of a
//! CephFS capability or an NFSv4 delegation, kept in lock memory instead of
//! by the meta-server, so no server CPU joins the lock path).
//!
//! # The token word
//!
//! A file's token is two words of its table's first block
//! ([`TOKEN_HOLDER_OFFSET`], [`TOKEN_MAILBOX_OFFSET`]):
//! the holding client, 0 for none, and the mailbox where it hears
//! revocations. Only a holder of the range lock over the whole file
//! changes it (taking it, [`FileLocks::take_token`]; giving it up with its
//! records published, [`FileLocks::publish_token`]), except two changes
//! that need no range lock because nothing is published with them: a
//! holder with no record left clears its own word
//! ([`FileLocks::clear_token`]), and the meta-server clears a fenced
//! client's ([`clear_token_of`]).
//!
//! # Taking it
//!
//! Under the range lock over the whole file, a client takes the token if
//! the word is free and every record of the table is a held lock of its
//! own (no other client's, no waiter): it frees those slots and keeps the
//! records itself ([`LocalRecords`]), in the batch that releases the range
//! lock. From then on its lock calls on the file are decided locally by
//! the same rules as the table's ([`super::plan`]), with no verb.
//!
//! # Revoking it
//!
//! Every other request reads the word in the batch of its range lock that
//! reads the table (the word is in the table's first block). If another
//! client holds the token, it changes nothing, lets the range lock go,
//! sets the token's *asked* word ([`TOKEN_ASKED_OFFSET`]), sends the
//! holder [`LockMessage::Revoke`] and waits until the holder word changes
//! ([`FileLocks::await_revocation`]), then starts again. The message is
//! the fast way; the asked word, which every holder polls for the tokens
//! it holds (one batch of reads), reaches a holder the message cannot — a
//! shm mount asked by a tcp mount: messages do not cross fabrics. The
//! holder, on the message, writes its records into the table and frees the
//! word in one range-lock hold over the whole file ([`publish_token`]),
//! after which the requester sees everything the holder held — `F_GETLK`
//! and the deadlock check included. A request that waits under a token
//! (`F_SETLKW` that conflicts with another owner of the same mount) has
//! its holder publish first and then waits as any request does, so
//! blocking waits and `EDEADLK` use the table's machinery unchanged.
//!
//! # A holder that stops answering
//!
//! A holder decides locally only while its lease is known to be alive
//! (the client's own fence, 3/4 of a lease without a renewal): once the
//! meta-server fences it — a whole lease and a fence delay later — it
//! decides nothing more. The fence clears the holder's word, as it
//! removes its records; the records it kept locally go with it, as its
//! records in the table do. A requester waits for the word to change for
//! at most [`REVOCATION_PATIENCE`] past the cluster's lease and fence
//! delay.
//!
//! [`publish_token`]: FileLocks::publish_token

use std::time::{Duration, Instant};

use citron_lock::rdma::{ClientAddr, MailboxId, NodeId, RemoteAddr, Verb};

use super::plan::{first_conflict, plan, Changes, Located, Plan, Request, SlotIndex};
use super::protocol::{FileLocks, LockMessage};
use super::record::{
    Generation, LockRecord, RecordState, TOKEN_ASKED_OFFSET, TOKEN_HOLDER_OFFSET, TOKEN_MAILBOX_OFFSET,
};
use super::table;
use super::types::{ByteRange, LockFlavor, LockMode, OwnerKey};
use crate::error::FsError;
use crate::types::ClientId;

/// How long past the cluster's lease and fence delay a requester waits for
/// a token's holder to give it up before it fails: by then the holder is
/// fenced and the meta-server has cleared its word.
pub const REVOCATION_PATIENCE: Duration = Duration::from_secs(10);
/// How often a requester sets the asked word again while it waits (the
/// holder may have published and taken the token again meanwhile, which
/// clears it).
const ASK_AGAIN: Duration = Duration::from_millis(50);
/// How long a requester naps between reads of the token word.
const POLL_NAP: Duration = Duration::from_micros(200);

/// Who holds a file's token, as its word says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TokenWord {
    pub holder: ClientId,
    pub mailbox: ClientAddr,
}

impl TokenWord {
    /// The holder as a table's first block (read whole) names it.
    pub fn of_block(first_block: &[u8]) -> Option<TokenWord> {
        let word = |at: u64| {
            let at = at as usize;
            first_block.get(at..at + 8).map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
        };
        let holder = word(TOKEN_HOLDER_OFFSET).filter(|&h| h != 0)?;
        let mailbox = word(TOKEN_MAILBOX_OFFSET)?;
        Some(TokenWord { holder: ClientId(holder), mailbox: unpack_mailbox(mailbox) })
    }
}

fn pack_mailbox(m: ClientAddr) -> u64 {
    u64::from(m.node.0) | (u64::from(m.mailbox.0) << 32)
}

fn unpack_mailbox(w: u64) -> ClientAddr {
    ClientAddr { node: NodeId(w as u32), mailbox: MailboxId((w >> 32) as u32) }
}

/// The read of the asked word of the token of the table at `first`, for
/// a holder's poll (a batch of them, one per token it holds).
pub fn asked_read(first: RemoteAddr) -> Verb {
    Verb::Read { addr: first + TOKEN_ASKED_OFFSET, len: 8 }
}

/// Clears the token word of the table at `first` if `dead` holds it (the
/// meta-server's fence of `dead`). Returns whether it did.
pub fn clear_token_of(
    ep: &citron_lock::rdma::Endpoint,
    first: RemoteAddr,
    dead: ClientId,
) -> Result<bool, FsError> {
    let old = ep.cas(first + TOKEN_HOLDER_OFFSET, dead.0, 0)?;
    Ok(old == dead.0 && dead.0 != 0)
}

/// What a local decision came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LocalOutcome {
    Granted,
    /// Blocked by another owner of this client, and not asked to wait.
    Refused,
    /// Blocked, and asked to wait: the records must be published, and the
    /// request made against the table.
    MustPublish,
}

/// The records a client keeps for one file under its token: the table's
/// rules ([`plan`]) applied to a table only this client can see.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LocalRecords {
    records: Vec<LockRecord>,
}

impl LocalRecords {
    pub fn new(records: Vec<LockRecord>) -> Self {
        Self { records }
    }

    pub fn records(&self) -> &[LockRecord] {
        &self.records
    }

    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// The records as the plan reads a table: every record in a slot of
    /// its own.
    fn located(&self) -> Vec<Located> {
        self.records
            .iter()
            .enumerate()
            .map(|(i, r)| Located { slot: SlotIndex(i as u32), gen: Generation(0), record: *r })
            .collect()
    }

    /// Takes, converts or releases a lock, as [`FileLocks::set`] would on
    /// a table holding these records. No waiter exists under a token, so
    /// what gets weaker wakes no one.
    pub fn set(&mut self, req: &Request, wait: bool) -> LocalOutcome {
        match plan(req, &self.located(), ByteRange::whole_file()) {
            Plan::Apply(changes) => {
                self.apply(&changes);
                LocalOutcome::Granted
            }
            Plan::Conflict { .. } if wait => LocalOutcome::MustPublish,
            Plan::Conflict { drop_own, .. } => {
                // A refused flock conversion has dropped the old lock.
                self.apply(&drop_own);
                LocalOutcome::Refused
            }
            // The guard is the whole file: nothing is wider.
            Plan::Widen(_) => LocalOutcome::MustPublish,
        }
    }

    /// `F_GETLK` ([`FileLocks::get`]) over these records.
    pub fn get(
        &self,
        owner: OwnerKey,
        flavor: LockFlavor,
        mode: LockMode,
        range: ByteRange,
    ) -> Option<LockRecord> {
        first_conflict(&self.located(), owner, flavor, mode, range)
    }

    /// Drops every record that `matches`; answers how many went.
    pub fn release_matching(&mut self, matches: impl Fn(&LockRecord) -> bool) -> usize {
        let before = self.records.len();
        self.records.retain(|r| !matches(r));
        before - self.records.len()
    }

    fn apply(&mut self, changes: &Changes) {
        let mut next: Vec<LockRecord> = Vec::with_capacity(self.records.len() + changes.add.len());
        for (i, r) in self.records.iter().enumerate() {
            let slot = SlotIndex(i as u32);
            if changes.free.iter().any(|l| l.slot == slot) {
                continue;
            }
            match changes.rewrite.iter().find(|(l, _)| l.slot == slot) {
                Some((_, new)) => next.push(*new),
                None => next.push(*r),
            }
        }
        next.extend(changes.add.iter().copied());
        self.records = next;
    }
}

impl FileLocks<'_> {
    /// Takes the file's token for this client if no one else has a record
    /// in its table (see the module header), with `mailbox` as where it
    /// hears revocations. Answers the records of its own that it took out
    /// of the table, or `None` if the token cannot be taken now.
    pub fn take_token(&self, mailbox: ClientAddr) -> Result<Option<LocalRecords>, FsError> {
        let (hold, first_block) = self.acquire_raw(ByteRange::whole_file())?;
        let decided = (|| {
            if TokenWord::of_block(&first_block).is_some_and(|t| t.holder != self.client) {
                return Ok(None);
            }
            let snapshot = table::read_from(self.ep, self.table, Some(first_block))?;
            if snapshot.has_busy() {
                return Ok(None);
            }
            let records = snapshot.records();
            let all_mine_held = records
                .iter()
                .all(|l| l.record.state == RecordState::Held && l.record.owner.client == self.client);
            if !all_mine_held {
                return Ok(None);
            }
            let mut verbs = vec![
                Verb::Write {
                    addr: self.table + TOKEN_MAILBOX_OFFSET,
                    data: pack_mailbox(mailbox).to_le_bytes().to_vec(),
                },
                Verb::Write { addr: self.table + TOKEN_ASKED_OFFSET, data: 0u64.to_le_bytes().to_vec() },
                Verb::Write {
                    addr: self.table + TOKEN_HOLDER_OFFSET,
                    data: self.client.0.to_le_bytes().to_vec(),
                },
            ];
            for l in &records {
                verbs.push(table::free_verb(&snapshot, l.slot, l.gen)?);
            }
            Ok(Some((verbs, LocalRecords::new(records.iter().map(|l| l.record).collect()))))
        })();
        match decided {
            Ok(Some((verbs, local))) => {
                hold.release_after(self.ep, &verbs)?;
                Ok(Some(local))
            }
            Ok(None) => {
                hold.release(self.ep)?;
                Ok(None)
            }
            Err(e) => {
                let _ = hold.release(self.ep);
                Err(e)
            }
        }
    }

    /// Gives the token up: writes `local`'s records into the table and
    /// frees the word, in one hold of the range lock over the whole file
    /// (the writes in the batch that releases it). Fails, writing nothing,
    /// if this client no longer holds the token (a fence took it).
    pub fn publish_token(&self, local: &LocalRecords) -> Result<(), FsError> {
        if local.is_empty() {
            return self.clear_token();
        }
        let (hold, first_block) = self.acquire_raw(ByteRange::whole_file())?;
        let decided = (|| {
            if TokenWord::of_block(&first_block).map(|t| t.holder) != Some(self.client) {
                return Err(FsError::Io(format!(
                    "the lock token of inode {} was taken from this client (fenced?)",
                    self.ino.0
                )));
            }
            let mut snapshot = table::read_from(self.ep, self.table, Some(first_block))?;
            let changes = Changes { add: local.records().to_vec(), ..Changes::default() };
            let mut verbs = Vec::new();
            self.change_verbs(&mut snapshot, &changes, &mut verbs)?;
            verbs.push(Verb::Write {
                addr: self.table + TOKEN_HOLDER_OFFSET,
                data: 0u64.to_le_bytes().to_vec(),
            });
            Ok(verbs)
        })();
        match decided {
            Ok(verbs) => hold.release_after(self.ep, &verbs),
            Err(e) => {
                let _ = hold.release(self.ep);
                Err(e)
            }
        }
    }

    /// Frees this client's token word, holding no record under it: one
    /// CAS, no range lock (nothing is published with it).
    pub fn clear_token(&self) -> Result<(), FsError> {
        let old = self.ep.cas(self.table + TOKEN_HOLDER_OFFSET, self.client.0, 0)?;
        if old != self.client.0 {
            log::debug!("inode {}: the lock token was no longer this client's ({old})", self.ino.0);
        }
        Ok(())
    }

    /// Asks `token`'s holder to give it up and waits until the word no
    /// longer names it (published, or cleared by the holder's fence).
    /// Holds no range lock: the holder needs the whole file's.
    pub fn await_revocation(&self, token: TokenWord) -> Result<(), FsError> {
        let cluster = self.timing.cluster;
        let patience =
            Duration::from_millis(cluster.lease_ms + cluster.fence_delay_ms) * 2 + REVOCATION_PATIENCE;
        let start = Instant::now();
        let message = LockMessage::Revoke { ino: self.ino }.encode();
        let mut asked: Option<Instant> = None;
        loop {
            if asked.is_none_or(|s| s.elapsed() >= ASK_AGAIN) {
                // Asked in the word too: a holder on another fabric (shm
                // and tcp mounts of one cluster) cannot be messaged, and
                // polls it. The message goes once: a stopped holder reads
                // none, and its queue is bounded.
                self.ep.write_u64(self.table + TOKEN_ASKED_OFFSET, self.client.0.max(1))?;
                if asked.is_none() {
                    if let Err(e) = self.ep.send(token.mailbox, &message) {
                        // The asked word reaches it; its fence ends the
                        // wait anyway.
                        log::debug!("revoking the lock token of inode {}: {e}", self.ino.0);
                    }
                }
                asked = Some(Instant::now());
            }
            if self.ep.read_u64(self.table + TOKEN_HOLDER_OFFSET)? != token.holder.0 {
                return Ok(());
            }
            if start.elapsed() > patience {
                return Err(FsError::Io(format!(
                    "client {} did not give up the lock token of inode {} in {patience:?}",
                    token.holder.0, self.ino.0
                )));
            }
            std::thread::sleep(POLL_NAP);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::locks::record::ListSeq;
    use crate::locks::types::LockOwner;

    fn req(owner: u64, mode: Option<LockMode>, s: u64, l: u64) -> Request {
        Request {
            owner: OwnerKey { client: ClientId(1), owner: LockOwner(owner) },
            flavor: LockFlavor::Posix,
            mode,
            range: ByteRange::new(s, l).unwrap(),
            pid: 1,
            fh: 1,
        }
    }

    #[test]
    fn local_records_follow_the_table_rules() {
        let mut local = LocalRecords::default();
        assert_eq!(local.set(&req(1, Some(LockMode::Write), 0, 9), false), LocalOutcome::Granted);
        assert_eq!(local.set(&req(2, Some(LockMode::Read), 5, 5), false), LocalOutcome::Refused);
        assert_eq!(local.set(&req(2, Some(LockMode::Read), 5, 5), true), LocalOutcome::MustPublish);
        // Split by an unlock in the middle, merged back by a lock.
        assert_eq!(local.set(&req(1, None, 3, 4), false), LocalOutcome::Granted);
        assert_eq!(local.records().len(), 2);
        assert_eq!(local.set(&req(1, Some(LockMode::Write), 3, 4), false), LocalOutcome::Granted);
        assert_eq!(local.records().len(), 1);
        assert_eq!(local.records()[0].range, ByteRange::new(0, 9).unwrap());
        assert_eq!(local.records()[0].listed, ListSeq(1));
        let other = OwnerKey { client: ClientId(1), owner: LockOwner(2) };
        assert!(local.get(other, LockFlavor::Posix, LockMode::Read, ByteRange::new(9, 9).unwrap()).is_some());
        assert_eq!(local.release_matching(|r| r.owner.owner == LockOwner(1)), 1);
        assert!(local.is_empty());
    }

    #[test]
    fn the_token_word_round_trips() {
        let mut block = vec![0u8; 64];
        assert_eq!(TokenWord::of_block(&block), None);
        let m = ClientAddr { node: NodeId(3), mailbox: MailboxId(9) };
        block[16..24].copy_from_slice(&7u64.to_le_bytes());
        block[24..32].copy_from_slice(&pack_mailbox(m).to_le_bytes());
        assert_eq!(TokenWord::of_block(&block), Some(TokenWord { holder: ClientId(7), mailbox: m }));
    }
}
