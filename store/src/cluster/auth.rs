//! The cluster secret and the handshake's proofs.
//!
//! Every daemon of a cluster holds the same secret (`--cluster-secret-file`). At handshake each
//! side sends HMAC-SHA256(secret, label ‖ side ‖ connector's hello ‖ acceptor's hello): both
//! hellos carry a fresh random nonce, so a proof is good for one connection only and a recorded
//! one cannot be replayed; the side byte stops a peer from reflecting the other's proof back.
//! The tag is compared in constant time (`hmac`'s `verify_slice`).
//!
//! The same secret and hellos key the records that follow ([`super::record`]): each direction's
//! key is HMAC-SHA256(secret, key label ‖ sending side ‖ both hellos), fresh per connection.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use feedstore_proto::peer::{PROOF_BYTES, PeerHello};
use hmac::{Hmac, Mac};
use sha2::Sha256;

/// The fewest bytes a secret may have.
pub const MIN_SECRET_BYTES: usize = 16;
/// The most bytes a secret file may hold.
pub const MAX_SECRET_BYTES: usize = 4096;

const LABEL: &[u8] = b"feedstore peer proof v1";
const KEY_LABEL: &[u8] = b"feedstore peer record key v1";

/// Which end of a connection: part of every proof.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// The daemon that connected.
    Connector = 0,
    /// The daemon that accepted.
    Acceptor = 1,
}

impl Side {
    /// The other end.
    pub fn other(self) -> Side {
        match self {
            Side::Connector => Side::Acceptor,
            Side::Acceptor => Side::Connector,
        }
    }
}

/// The cluster secret. Its bytes are never printed.
#[derive(Clone)]
pub struct Secret(Vec<u8>);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Secret({} bytes)", self.0.len())
    }
}

/// Why a secret file was refused.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    /// It could not be read.
    #[error("cannot read cluster secret {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// Its owner, mode, type or size is wrong.
    #[error("refusing cluster secret {path}: {reason}")]
    Unsafe {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
}

impl Secret {
    /// Reads a secret file: a regular file of this user or root, readable by nobody else (mode
    /// 0600 or 0400), of 16 to 4096 bytes (a trailing newline is not part of the secret).
    pub fn load(path: &Path) -> Result<Secret, SecretError> {
        let unsafe_file = |reason: String| SecretError::Unsafe {
            path: path.to_owned(),
            reason,
        };
        let read_err = |source| SecretError::Read {
            path: path.to_owned(),
            source,
        };
        let meta = std::fs::metadata(path).map_err(read_err)?;
        if !meta.is_file() {
            return Err(unsafe_file("not a regular file".into()));
        }
        let me = nix::unistd::geteuid().as_raw();
        if meta.uid() != me && meta.uid() != 0 {
            return Err(unsafe_file(format!("it belongs to uid {}", meta.uid())));
        }
        if meta.mode() & 0o077 != 0 {
            return Err(unsafe_file(format!(
                "other users can read or write it (mode {:o}); chmod 600 it",
                meta.mode() & 0o7777
            )));
        }
        if meta.len() > MAX_SECRET_BYTES as u64 {
            return Err(unsafe_file(format!(
                "{} bytes, over {MAX_SECRET_BYTES}",
                meta.len()
            )));
        }
        let mut bytes = std::fs::read(path).map_err(read_err)?;
        while bytes.last().is_some_and(|b| *b == b'\n' || *b == b'\r') {
            bytes.pop();
        }
        Secret::from_bytes(bytes).map_err(unsafe_file)
    }

    /// A secret from bytes, at least [`MIN_SECRET_BYTES`] long.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Secret, String> {
        if bytes.len() < MIN_SECRET_BYTES || bytes.len() > MAX_SECRET_BYTES {
            return Err(format!(
                "a cluster secret has {MIN_SECRET_BYTES} to {MAX_SECRET_BYTES} bytes, this one {} \
                 (make one with `head -c 32 /dev/urandom | base64 > FILE`)",
                bytes.len()
            ));
        }
        Ok(Secret(bytes))
    }

    fn mac(&self, side: Side, connector: &PeerHello, acceptor: &PeerHello) -> Hmac<Sha256> {
        labelled(&self.0, LABEL, side, connector, acceptor)
    }

    /// The key of the records `sender` sends on the connection of these hellos.
    pub fn record_key(
        &self,
        sender: Side,
        connector: &PeerHello,
        acceptor: &PeerHello,
    ) -> [u8; 32] {
        labelled(&self.0, KEY_LABEL, sender, connector, acceptor)
            .finalize()
            .into_bytes()
            .into()
    }

    /// [`Secret::record_key`] for a cluster without a secret (tests only): anyone can compute
    /// it, so its tags catch accidents, not attackers.
    pub fn unkeyed_record_key(
        sender: Side,
        connector: &PeerHello,
        acceptor: &PeerHello,
    ) -> [u8; 32] {
        labelled(&[], KEY_LABEL, sender, connector, acceptor)
            .finalize()
            .into_bytes()
            .into()
    }

    /// The proof `side` sends for this pair of hellos.
    pub fn prove(
        &self,
        side: Side,
        connector: &PeerHello,
        acceptor: &PeerHello,
    ) -> [u8; PROOF_BYTES] {
        self.mac(side, connector, acceptor)
            .finalize()
            .into_bytes()
            .into()
    }

    /// Whether `proof` is the one `side` should have sent, compared in constant time.
    pub fn verify(
        &self,
        side: Side,
        connector: &PeerHello,
        acceptor: &PeerHello,
        proof: &[u8; PROOF_BYTES],
    ) -> bool {
        self.mac(side, connector, acceptor)
            .verify_slice(proof)
            .is_ok()
    }
}

/// HMAC-SHA256 under `key` of a label, a side and both hellos.
fn labelled(
    key: &[u8],
    label: &[u8],
    side: Side,
    connector: &PeerHello,
    acceptor: &PeerHello,
) -> Hmac<Sha256> {
    let mut mac =
        <Hmac<Sha256> as Mac>::new_from_slice(key).expect("HMAC takes keys of any length");
    mac.update(label);
    mac.update(&[side as u8]);
    mac.update(&connector.to_bytes());
    mac.update(&acceptor.to_bytes());
    mac
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hello(nonce: u8) -> PeerHello {
        PeerHello {
            version: 1,
            oldest: 1,
            reserved: 0,
            flags: 1,
            node_id: 1,
            epoch: 2,
            instance: 3,
            nonce: [nonce; 32],
        }
    }

    #[test]
    fn a_proof_holds_for_its_side_secret_and_hellos_only() {
        let secret = Secret::from_bytes(b"0123456789abcdef".to_vec()).unwrap();
        let other = Secret::from_bytes(b"0123456789abcdeX".to_vec()).unwrap();
        let (c, a) = (hello(1), hello(2));
        let proof = secret.prove(Side::Connector, &c, &a);
        assert!(secret.verify(Side::Connector, &c, &a, &proof));
        assert!(!secret.verify(Side::Acceptor, &c, &a, &proof), "reflected");
        assert!(
            !other.verify(Side::Connector, &c, &a, &proof),
            "another secret"
        );
        assert!(
            !secret.verify(Side::Connector, &c, &hello(3), &proof),
            "replayed on a new connection"
        );
    }

    #[test]
    fn secret_files_must_be_private_and_long_enough() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("fs-secret-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("secret");
        std::fs::write(&path, "a-long-enough-cluster-secret\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let err = Secret::load(&path).unwrap_err().to_string();
        assert!(err.contains("mode 644"), "{err}");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(
            format!("{:?}", Secret::load(&path).unwrap()),
            "Secret(28 bytes)"
        );
        std::fs::write(&path, "short\n").unwrap();
        assert!(Secret::load(&path).is_err());
        assert!(Secret::load(&dir).is_err(), "a directory");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
