//! Peer authentication: each agent's secret key, the handshake's nonces and its HMAC-SHA256
//! proofs.
//!
//! Every agent draws a random 32-byte key when it starts and publishes it in its
//! [`AgentMetadata`](crate::AgentMetadata). Holding an agent's metadata — received over an
//! authenticated channel, or from [`Agent::metadata`](crate::Agent::metadata) in-process —
//! is what lets a peer connect to it; nobody else can. Both channels (TCP and the same-host
//! Unix socket) open with a mutual challenge-response keyed by the *target's* key:
//!
//! ```text
//! initiator → target  Hello     cn                       (fresh 32-byte client nonce)
//! target → initiator  HelloAck  sn, HMAC(key, "kvx-xfer target"    ‖ cn ‖ sn)
//! initiator → target  Auth          HMAC(key, "kvx-xfer initiator" ‖ cn ‖ sn)
//! ```
//!
//! The initiator checks the target's proof before it sends anything else (so a target that
//! does not hold the key learns nothing it could replay), and the target serves no frame but
//! Hello, Auth and a keyless GetMeta until the initiator's proof checked out; anything else,
//! a wrong proof, or Auth before Hello closes the connection before a byte of a region is
//! touched. Proofs are compared in constant time. The handshake authenticates the ends of a
//! connection; it does not encrypt or integrity-protect the frames that follow.

use std::fmt;

use hmac::{Hmac, Mac};
use rand::TryRngCore;
use sha2::Sha256;

use crate::error::{Result, XferError};

/// Length of an agent's secret key.
pub const KEY_LEN: usize = 32;
/// Length of a handshake nonce.
pub const NONCE_LEN: usize = 32;
/// Length of an HMAC-SHA256 proof.
pub const PROOF_LEN: usize = 32;

type HmacSha256 = Hmac<Sha256>;

/// Which end of a connection a proof speaks for (its HMAC label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// The agent that accepted the connection and owns the key (label `kvx-xfer target`).
    Target,
    /// The agent that dialled (label `kvx-xfer initiator`).
    Initiator,
}

impl Side {
    fn label(self) -> &'static [u8] {
        match self {
            Side::Target => b"kvx-xfer target",
            Side::Initiator => b"kvx-xfer initiator",
        }
    }
}

fn mac(key: &[u8; KEY_LEN], side: Side, cn: &[u8], sn: &[u8]) -> Option<HmacSha256> {
    // HMAC takes keys of any length; `None` cannot happen but is not worth a panic path.
    let mut m = HmacSha256::new_from_slice(key).ok()?;
    m.update(side.label());
    m.update(cn);
    m.update(sn);
    Some(m)
}

/// The proof `side` gives for the nonces `cn` (initiator's) and `sn` (target's):
/// `HMAC-SHA256(key, label ‖ cn ‖ sn)`.
pub fn proof(
    key: &[u8; KEY_LEN],
    side: Side,
    cn: &[u8; NONCE_LEN],
    sn: &[u8; NONCE_LEN],
) -> [u8; PROOF_LEN] {
    let mut out = [0u8; PROOF_LEN];
    if let Some(m) = mac(key, side, cn, sn) {
        out.copy_from_slice(&m.finalize().into_bytes());
    }
    out
}

/// Whether `proof` is the proof `side` gives for `cn` and `sn` (constant-time comparison).
pub fn verify(
    key: &[u8; KEY_LEN],
    side: Side,
    cn: &[u8; NONCE_LEN],
    sn: &[u8; NONCE_LEN],
    proof: &[u8],
) -> bool {
    mac(key, side, cn, sn).is_some_and(|m| m.verify_slice(proof).is_ok())
}

/// `N` bytes from the operating system's random source.
pub(crate) fn random<const N: usize>() -> Result<[u8; N]> {
    let mut b = [0u8; N];
    rand::rngs::OsRng.try_fill_bytes(&mut b).map_err(|_| XferError::Io {
        op: "getrandom",
        msg: "no randomness".into(),
        errno: 0,
    })?;
    Ok(b)
}

/// An agent's secret key; its `Debug` does not print it.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct Key(pub(crate) [u8; KEY_LEN]);

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Key(..)")
    }
}

/// Copy `b` into a fixed-size array (`b` must be exactly `N` bytes).
fn array<const N: usize>(b: &[u8]) -> Option<[u8; N]> {
    <[u8; N]>::try_from(b).ok()
}

/// Progress of the handshake on a connection this agent accepted (the target side).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Handshake {
    /// Nothing received yet.
    Fresh,
    /// Hello answered; the initiator's proof for these nonces is due.
    Challenged { cn: [u8; NONCE_LEN], sn: [u8; NONCE_LEN] },
    /// The initiator proved it holds this agent's key.
    Open,
}

impl Handshake {
    /// Whether the initiator has authenticated.
    pub(crate) fn is_open(&self) -> bool {
        matches!(self, Handshake::Open)
    }

    /// Answer a Hello whose notification area is `notif` (`cn ‖ name`): write the HelloAck's
    /// notification area (`sn ‖ proof_t ‖ own_name`, the name cut to fit) into `ack` and
    /// return the initiator's name. An error (a second Hello, a short one) drops the
    /// connection.
    pub(crate) fn hello<'a>(
        &mut self,
        key: &Key,
        notif: &'a [u8],
        own_name: &str,
        ack: &mut Vec<u8>,
    ) -> Result<&'a [u8]> {
        if *self != Handshake::Fresh {
            return Err(XferError::Protocol("Hello twice on one connection"));
        }
        let cn = notif
            .get(..NONCE_LEN)
            .and_then(array::<NONCE_LEN>)
            .ok_or(XferError::Protocol("Hello without a nonce"))?;
        let sn = random::<NONCE_LEN>()?;
        ack.clear();
        ack.extend_from_slice(&sn);
        ack.extend_from_slice(&proof(&key.0, Side::Target, &cn, &sn));
        let room = crate::wire::MAX_NOTIF - ack.len();
        ack.extend_from_slice(&own_name.as_bytes()[..own_name.len().min(room)]);
        *self = Handshake::Challenged { cn, sn };
        Ok(&notif[NONCE_LEN..])
    }

    /// Check an Auth frame's notification area (`proof_i`). An error (Auth before Hello, a
    /// wrong proof) drops the connection.
    pub(crate) fn auth(&mut self, key: &Key, notif: &[u8]) -> Result<()> {
        let Handshake::Challenged { cn, sn } = *self else {
            return Err(XferError::Protocol("Auth before Hello"));
        };
        if notif.len() != PROOF_LEN || !verify(&key.0, Side::Initiator, &cn, &sn, notif) {
            return Err(XferError::Protocol("wrong initiator proof"));
        }
        *self = Handshake::Open;
        Ok(())
    }
}

/// The initiator's side of one handshake.
#[derive(Debug)]
pub(crate) struct Dial {
    cn: [u8; NONCE_LEN],
}

impl Dial {
    /// A handshake with a fresh client nonce.
    pub(crate) fn new() -> Result<Dial> {
        Ok(Dial { cn: random()? })
    }

    /// The Hello's notification area: `cn ‖ name` (the name cut to fit).
    pub(crate) fn hello(&self, name: &str) -> Vec<u8> {
        let room = crate::wire::MAX_NOTIF - NONCE_LEN;
        let mut v = Vec::with_capacity(NONCE_LEN + name.len().min(room));
        v.extend_from_slice(&self.cn);
        v.extend_from_slice(&name.as_bytes()[..name.len().min(room)]);
        v
    }

    /// Check the HelloAck's notification area (`sn ‖ proof_t ‖ name`) against the target's
    /// `key`; on success return the Auth frame's notification area (`proof_i`).
    pub(crate) fn check_ack(
        &self,
        key: &[u8; KEY_LEN],
        ack: &[u8],
        peer: &str,
    ) -> Result<[u8; PROOF_LEN]> {
        let fail = |reason| XferError::Auth { peer: peer.to_owned(), reason };
        let sn = ack
            .get(..NONCE_LEN)
            .and_then(array::<NONCE_LEN>)
            .ok_or(fail("its HelloAck carries no proof"))?;
        let proof_t = ack
            .get(NONCE_LEN..NONCE_LEN + PROOF_LEN)
            .ok_or(fail("its HelloAck carries no proof"))?;
        if !verify(key, Side::Target, &self.cn, &sn, proof_t) {
            return Err(fail("it does not hold the key in its metadata"));
        }
        Ok(proof(key, Side::Initiator, &self.cn, &sn))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs_depend_on_key_side_and_both_nonces() {
        let key = [7u8; KEY_LEN];
        let (cn, sn) = ([1u8; NONCE_LEN], [2u8; NONCE_LEN]);
        let p = proof(&key, Side::Target, &cn, &sn);
        assert!(verify(&key, Side::Target, &cn, &sn, &p));
        assert!(!verify(&key, Side::Initiator, &cn, &sn, &p), "sides differ");
        assert!(!verify(&key, Side::Target, &sn, &cn, &p), "nonces are ordered");
        let mut other = key;
        other[0] ^= 1;
        assert!(!verify(&other, Side::Target, &cn, &sn, &p));
        assert!(!verify(&key, Side::Target, &cn, &sn, &p[..31]));
        // A vector computed independently (Python: hmac.new(bytes(32), b"kvx-xfer target"
        // + bytes(64), hashlib.sha256)).
        let z = proof(&[0u8; KEY_LEN], Side::Target, &[0u8; NONCE_LEN], &[0u8; NONCE_LEN]);
        let hex: String = z.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, "a5724e51448ad9fec8adddc0dca64d658b508913dbf05984d9899671fe1d0c9a");
    }

    #[test]
    fn handshake_runs_in_order_only() {
        let key = Key(random().unwrap());
        let dial = Dial::new().unwrap();
        let mut hs = Handshake::Fresh;
        assert!(hs.auth(&key, &[0u8; PROOF_LEN]).is_err(), "Auth before Hello");
        assert_eq!(hs, Handshake::Fresh);
        let mut ack = Vec::new();
        let hello = dial.hello("init");
        let name = hs.hello(&key, &hello, "target", &mut ack).unwrap();
        assert_eq!(name, b"init");
        assert_eq!(&ack[NONCE_LEN + PROOF_LEN..], b"target");
        assert!(hs.hello(&key, &dial.hello("init"), "target", &mut Vec::new()).is_err());
        let proof_i = dial.check_ack(&key.0, &ack, "target").unwrap();
        let mut wrong = proof_i;
        wrong[5] ^= 0x40;
        let mut bad = hs;
        assert!(bad.auth(&key, &wrong).is_err());
        assert!(!bad.is_open());
        hs.auth(&key, &proof_i).unwrap();
        assert!(hs.is_open());
        // An initiator holding a different key refuses the target's proof.
        let mut other = key.0;
        other[31] ^= 1;
        assert!(matches!(dial.check_ack(&other, &ack, "target"), Err(XferError::Auth { .. })));
        assert!(dial.check_ack(&key.0, &ack[..40], "target").is_err());
        assert!(Handshake::Fresh.hello(&key, &[0u8; 10], "t", &mut Vec::new()).is_err());
        assert_eq!(format!("{key:?}"), "Key(..)");
    }
}
