//! Who a meta-server request comes from, and what follows from it.
//!
//! A connection's handshake proved a [`Principal`]:
//!
//! | principal | may | client ids in requests | callers |
//! |---|---|---|---|
//! | anyone, on a meta-server without keys | everything | trusted | as sent |
//! | the cluster key (`role=server`) | everything | trusted | as sent |
//! | a client key (`role=client`) | `RegisterClient` only | - | - |
//! | a session (a registered client) | everything a mount does | must be its own | squashed as its key says |
//! | a member (mailbox secret) | nothing | - | - |
//!
//! A mount proves its key to register and gets its session secret and the
//! members' secret back, each wrapped under its own key (only the holder
//! of that key can unwrap them; see [`SessionKeys`]); from then on its
//! connections (here and at every NIC) prove the session, so the
//! meta-server knows which client sends each request, and a request that
//! names another client's id is refused. Root squash is per key: a
//! session's callers are mapped with the options of the key its client
//! registered with ([`KeyOptions::squash_ids`]).

use citron_rpc::auth::{Key, KeyOptions, Principal, Role};
use citronfs_core::proto::MetaRequest;
#[cfg(doc)]
use citronfs_core::session::SessionKeys;
use citronfs_core::types::{Caller, ClientId};
use citronfs_core::FsError;

/// What a request's sender may be trusted with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Asker {
    /// A server, or anyone on a meta-server without keys.
    Trusted,
    /// The holder of a key, registering as a client.
    Registering(Key),
    /// A registered client, under the options of its key.
    Client(ClientId, KeyOptions),
}

/// Decides who sent `request` and adjusts it: refuses what the sender may
/// not ask, checks the client ids it names, squashes its callers.
/// `key_of` finds a key of the keyring by name; `client_options` the key
/// options a live client registered with (`None`: not registered, or
/// fenced).
pub fn vet(
    principal: &Principal,
    request: &mut MetaRequest,
    key_of: impl Fn(&str) -> Option<Key>,
    client_options: impl Fn(ClientId) -> Option<KeyOptions>,
) -> Result<Asker, FsError> {
    let asker = match principal {
        // A server without keys checks no identity: a claimed session
        // (which only such a server accepts) is trusted as anyone is.
        Principal::Anonymous | Principal::Claimed(_) => Asker::Trusted,
        Principal::Key { name, options } => {
            if let MetaRequest::RegisterClient { .. } | MetaRequest::ReclaimClient { .. } = request {
                return key_of(name).map(Asker::Registering).ok_or(FsError::Perm);
            }
            if options.role != Role::Server {
                return Err(FsError::Perm);
            }
            Asker::Trusted
        }
        Principal::Session(s) => {
            let client = ClientId(s.client);
            let options = client_options(client)
                .ok_or_else(|| FsError::Io("lease expired: client was fenced".into()))?;
            Asker::Client(client, options)
        }
        Principal::Member { .. } => return Err(FsError::Perm),
    };
    let Asker::Client(me, options) = &asker else { return Ok(asker) };
    match request {
        MetaRequest::RegisterClient { .. }
        | MetaRequest::ReclaimClient { .. }
        | MetaRequest::RegisterDataServer { .. }
        | MetaRequest::DataServerLeaves { .. } => return Err(FsError::Perm),
        MetaRequest::Heartbeat { client }
        | MetaRequest::ClientLeaves { client }
        | MetaRequest::ReportLockTiming { client, .. }
        | MetaRequest::CreateOpen { client, .. }
        | MetaRequest::LateChanges { client, .. }
        | MetaRequest::LendInodes { client, .. }
        | MetaRequest::Open { client, .. }
        | MetaRequest::Release { client, .. }
        | MetaRequest::ReleaseMany { client, .. }
        | MetaRequest::Caching { client, .. }
        | MetaRequest::Once { client, .. }
        | MetaRequest::AwaitInvalidations { client, .. }
            if client != me =>
        {
            log::warn!("client {} sent a request as client {}; refused", me.0, client.0);
            return Err(FsError::Perm);
        }
        _ => {}
    }
    let squash = |caller: &mut Caller| {
        let (uid, gid) = options.squash_ids(caller.uid, caller.gid);
        *caller = Caller { uid, gid, pid: caller.pid };
    };
    if let MetaRequest::LateChanges { changes, .. } = request {
        changes.iter_mut().for_each(|c| squash(c.caller_mut()));
    }
    if let Some(caller) = caller_mut(request) {
        squash(caller);
    }
    Ok(asker)
}

/// The caller a request carries, if any.
fn caller_mut(request: &mut MetaRequest) -> Option<&mut Caller> {
    use MetaRequest as R;
    match request {
        R::Lookup { caller, .. }
        | R::SetAttr { caller, .. }
        | R::Create { caller, .. }
        | R::CreateOpen { caller, .. }
        | R::Symlink { caller, .. }
        | R::Link { caller, .. }
        | R::Unlink { caller, .. }
        | R::Rmdir { caller, .. }
        | R::Rename { caller, .. }
        | R::ReadDir { caller, .. }
        | R::ReadDirPlus { caller, .. }
        | R::Access { caller, .. }
        | R::Open { caller, .. }
        | R::SetXattr { caller, .. }
        | R::GetXattr { caller, .. }
        | R::ListXattr { caller, .. }
        | R::RemoveXattr { caller, .. } => Some(caller),
        R::RegisterClient { .. }
        | R::ReclaimClient { .. }
        | R::DataServers
        | R::Heartbeat { .. }
        | R::RegisterDataServer { .. }
        | R::GetAttr { .. }
        | R::ReadLink { .. }
        | R::Layout { .. }
        | R::Release { .. }
        | R::ReleaseMany { .. }
        | R::GrowLockTable { .. }
        | R::GrowWaitsFor { .. }
        | R::Clients
        | R::AllocChunks { .. }
        | R::GrowExtents { .. }
        | R::Fallocate { .. }
        | R::KillSuidGid { .. }
        | R::ClientLeaves { .. }
        | R::ReportLockTiming { .. }
        | R::DataServerLeaves { .. }
        | R::Status
        // Each of its changes carries its caller (squashed by `vet`).
        | R::LateChanges { .. }
        | R::LendInodes { .. }
        | R::Caching { .. }
        | R::Once { .. }
        | R::AwaitInvalidations { .. }
        | R::StatFs => None,
    }
}

#[cfg(test)]
mod tests {
    use citron_rpc::auth::{SessionId, Squash};
    use citronfs_core::types::Ino;

    use super::*;

    fn client_key(squash: Squash) -> Key {
        Key::generate("lab", KeyOptions { role: Role::Client, squash, ..KeyOptions::default() }).unwrap()
    }

    #[test]
    fn sessions_may_act_only_as_themselves_and_are_squashed() {
        let session = Principal::Session(SessionId { incarnation: 1, client: 7 });
        let root_squash = KeyOptions { squash: Squash::Root, ..KeyOptions::default() };
        let live = |c: ClientId| (c == ClientId(7)).then_some(root_squash);
        let mut open = MetaRequest::Open { caller: Caller::ROOT, client: ClientId(7), ino: Ino(2), flags: 0 };
        assert!(matches!(vet(&session, &mut open, |_| None, live), Ok(Asker::Client(ClientId(7), _))));
        let MetaRequest::Open { caller, .. } = open else { unreachable!() };
        assert_eq!((caller.uid, caller.gid), (65534, 65534));
        let mut other = MetaRequest::Release { client: ClientId(8), ino: Ino(2), opens: 1 };
        assert_eq!(vet(&session, &mut other, |_| None, live), Err(FsError::Perm));
        let mut register = MetaRequest::RegisterClient { hostname: "h".into(), pid: 1 };
        assert_eq!(vet(&session, &mut register, |_| None, live), Err(FsError::Perm));
        // Fenced: nothing.
        let fenced = Principal::Session(SessionId { incarnation: 1, client: 9 });
        assert!(vet(&fenced, &mut MetaRequest::StatFs, |_| None, live).is_err());
    }

    #[test]
    fn client_keys_only_register_and_servers_are_trusted() {
        let key = client_key(Squash::None);
        let p = Principal::Key { name: key.name.clone(), options: key.options };
        let find = |n: &str| (n == "lab").then(|| key.clone());
        let mut stat = MetaRequest::StatFs;
        assert_eq!(vet(&p, &mut stat, find, |_| None), Err(FsError::Perm));
        let mut register = MetaRequest::RegisterClient { hostname: "h".into(), pid: 1 };
        assert!(matches!(vet(&p, &mut register, find, |_| None), Ok(Asker::Registering(_))));
        let server = Principal::Key { name: "c".into(), options: KeyOptions::default() };
        let mut register = MetaRequest::RegisterClient { hostname: "h".into(), pid: 1 };
        let cluster = Key::generate("c", KeyOptions::default()).unwrap();
        let find = |n: &str| (n == "c").then(|| cluster.clone());
        assert!(matches!(vet(&server, &mut register, find, |_| None), Ok(Asker::Registering(_))));
        let mut open = MetaRequest::Open { caller: Caller::ROOT, client: ClientId(3), ino: Ino(2), flags: 0 };
        assert_eq!(vet(&server, &mut open, |_| None, |_| None), Ok(Asker::Trusted));
        assert_eq!(
            vet(&Principal::Member { incarnation: 1 }, &mut open, |_| None, |_| None),
            Err(FsError::Perm)
        );
    }
}
