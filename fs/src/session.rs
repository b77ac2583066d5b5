//! The secrets a mount gets when it registers with a keyed cluster, and how
//! they travel: wrapped under the key the mount proved, so only its holder
//! can use them (the connection itself is not encrypted).
//!
//! * the **session secret**: what the mount's connections prove from then
//!   on (to the meta-server and every NIC), so each server knows which
//!   client each connection is;
//! * the **member secret**: what the mounts of one meta-server incarnation
//!   prove to each other's mailboxes.
//!
//! Wrapping XORs a secret with an HMAC-SHA256 pad keyed by the mount's key
//! over a context (incarnation, client id, which secret) that is never used
//! twice, i.e. a one-time pad from a PRF.

use citron_rpc::auth::{Key, Secret};
use serde::{Deserialize, Serialize};

use crate::types::ClientId;

/// The wrapped secrets in a registration's answer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionKeys {
    /// The meta-server's incarnation (part of the session's id).
    pub incarnation: u64,
    pub session: [u8; 32],
    pub member: [u8; 32],
}

const SESSION: u8 = 1;
const MEMBER: u8 = 2;

fn context(incarnation: u64, client: ClientId, purpose: u8) -> [u8; 17] {
    let mut c = [0u8; 17];
    c[..8].copy_from_slice(&incarnation.to_le_bytes());
    c[8..16].copy_from_slice(&client.0.to_le_bytes());
    c[16] = purpose;
    c
}

impl SessionKeys {
    /// The meta-server's side: `session` and `member` wrapped under `key`.
    pub fn wrap(key: &Key, incarnation: u64, client: ClientId, session: &Secret, member: &Secret) -> Self {
        Self {
            incarnation,
            session: key.secret.wrap(session, &context(incarnation, client, SESSION)),
            member: key.secret.wrap(member, &context(incarnation, client, MEMBER)),
        }
    }

    /// The mount's side: (session secret, member secret).
    pub fn unwrap(&self, key: &Key, client: ClientId) -> (Secret, Secret) {
        (
            key.secret.unwrap(&self.session, &context(self.incarnation, client, SESSION)),
            key.secret.unwrap(&self.member, &context(self.incarnation, client, MEMBER)),
        )
    }
}

#[cfg(test)]
mod tests {
    use citron_rpc::auth::{KeyOptions, Keyring};

    use super::*;

    #[test]
    fn wrapped_secrets_open_only_with_the_key_and_context() {
        let ring = Keyring::generate("c").unwrap();
        let key = Key::generate("lab", KeyOptions::default()).unwrap();
        let (session, member) = (ring.session_secret(3, 4).unwrap(), ring.member_secret(3).unwrap());
        let keys = SessionKeys::wrap(&key, 3, ClientId(4), &session, &member);
        assert_ne!(keys.session, keys.member);
        assert_eq!(keys.unwrap(&key, ClientId(4)), (session.clone(), member.clone()));
        let other = Key::generate("lab", KeyOptions::default()).unwrap();
        assert_ne!(keys.unwrap(&other, ClientId(4)).0, session);
        assert_ne!(keys.unwrap(&key, ClientId(5)).0, session);
    }
}
