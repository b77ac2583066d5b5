//! What a client's connections prove, and how that changes as it
//! registers: its key (`--key-file`) to register with the meta-server, then
//! the session secret the registration gave it ([`crate::session`]), to
//! the meta-server and every NIC; the members' secret to other clients'
//! mailboxes. After it was fenced it proves its key again to register
//! anew. Without a key (a cluster without keys) nothing is proved: every
//! connection is anonymous, except that once registered the client names
//! its session to the NICs ([`Credential::Claim`]), so that a fence of this
//! client refuses its verbs there as it would in a keyed cluster.

use citron_lock::rdma::tcp::RpcClient;
use citron_lock::rdma::NodeCredentials;
use citron_rpc::auth::{Authority, Credential, Credentials, Key, SessionId};
use parking_lot::Mutex;

use crate::error::FsError;
use crate::proto::{ClusterInfo, MetaRequest, MetaResponse};

pub(super) struct Identity {
    key: Option<Key>,
    /// Shared with the meta-server RPC client (and, keyed, the nodes).
    credentials: Credentials,
    /// What the nodes' queue pairs prove: `credentials` itself in a keyed
    /// cluster; without keys, the claimed session once registered.
    nic: Credentials,
    /// What the node proves to other mailboxes and lets into its own.
    members: Mutex<Option<(Credentials, Authority)>>,
}

impl Identity {
    pub fn new(key: Option<Key>) -> Self {
        let credentials = Credentials::of_key(key.as_ref());
        let nic = match &key {
            Some(_) => credentials.clone(),
            None => Credentials::anonymous(),
        };
        Self { key, credentials, nic, members: Mutex::new(None) }
    }

    pub fn credentials(&self) -> &Credentials {
        &self.credentials
    }

    /// Before registering: new connections prove the key.
    pub fn registering(&self, rpc: &RpcClient<MetaRequest, MetaResponse>) {
        match &self.key {
            Some(k) => self.credentials.set(Credential::Key(k.clone())),
            None => self.credentials.set(Credential::Anonymous),
        }
        rpc.reset();
    }

    /// After registering: new connections prove the session `info` gave.
    pub fn registered(
        &self,
        rpc: &RpcClient<MetaRequest, MetaResponse>,
        info: &ClusterInfo,
    ) -> Result<(), FsError> {
        let (Some(key), Some(keys)) = (&self.key, &info.session) else {
            return match self.key {
                Some(_) => Err(FsError::Io("the meta-server gave no session to a keyed client".into())),
                None => {
                    // Connections opened from now on name the new session;
                    // those of an old one are cut by its fence. The
                    // meta-server's too: a restarted meta-server (another
                    // incarnation) refuses them, so no call of the old
                    // registration is served by the new process.
                    let id = SessionId { incarnation: info.incarnation, client: info.client.0 };
                    self.nic.set(Credential::Claim(id));
                    self.credentials.set(Credential::Claim(id));
                    rpc.reset();
                    Ok(())
                }
            };
        };
        let (session, member) = keys.unwrap(key, info.client);
        let id = SessionId { incarnation: keys.incarnation, client: info.client.0 };
        self.credentials.set(Credential::Session { id, secret: session });
        rpc.reset();
        let peers =
            Credentials::new(Credential::Member { incarnation: keys.incarnation, secret: member.clone() });
        let mailbox = Authority::Members { incarnation: keys.incarnation, secret: member };
        *self.members.lock() = Some((peers, mailbox));
        Ok(())
    }

    /// The version of what the nodes' queue pairs prove: it changes when the
    /// client registers anew (see [`super::endpoints::Endpoints`]).
    pub fn nic_version(&self) -> u64 {
        self.nic.version()
    }

    /// What a node of this client proves and lets in.
    pub fn node_credentials(&self) -> NodeCredentials {
        let (peers, mailbox) = self.members.lock().clone().unwrap_or_default();
        NodeCredentials { host: self.nic.clone(), peers, mailbox }
    }
}
