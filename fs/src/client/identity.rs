//! What a client's connections prove, and how that changes as it
//! registers: its key (`--key-file`) to register with the meta-server, then
//! the session secret the registration gave it ([`crate::session`]), to
//! the meta-server and every NIC; the members' secret to other clients'
//! mailboxes. After it was fenced it proves its key again to register
//! anew. Without a key everything is anonymous (a cluster without keys).

use citron_lock::rdma::tcp::RpcClient;
use citron_lock::rdma::NodeCredentials;
use citron_rpc::auth::{Authority, Credential, Credentials, Key, SessionId};
use parking_lot::Mutex;

use crate::error::FsError;
use crate::proto::{ClusterInfo, MetaRequest, MetaResponse};

pub(super) struct Identity {
    key: Option<Key>,
    /// Shared with the meta-server RPC client and the nodes' queue pairs.
    credentials: Credentials,
    /// What the node proves to other mailboxes and lets into its own.
    members: Mutex<Option<(Credentials, Authority)>>,
}

impl Identity {
    pub fn new(key: Option<Key>) -> Self {
        let credentials = match &key {
            Some(k) => Credentials::new(Credential::Key(k.clone())),
            None => Credentials::anonymous(),
        };
        Self { key, credentials, members: Mutex::new(None) }
    }

    pub fn credentials(&self) -> &Credentials {
        &self.credentials
    }

    /// Before registering: new connections prove the key.
    pub fn registering(&self, rpc: &RpcClient<MetaRequest, MetaResponse>) {
        if let Some(k) = &self.key {
            self.credentials.set(Credential::Key(k.clone()));
            rpc.reset();
        }
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
                None => Ok(()),
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

    /// What a node of this client proves and lets in.
    pub fn node_credentials(&self) -> NodeCredentials {
        let (peers, mailbox) = self.members.lock().clone().unwrap_or_default();
        NodeCredentials { host: self.credentials.clone(), peers, mailbox }
    }
}
