//! The peer protocol after the handshake, as the daemons speak it: records sealed by one side's
//! record layer (the real one, keyed by a fixed test secret and fixed hellos) and opened by the
//! other's, then parsed by the real message decoders. The input is a script: each step sends a
//! message of some kind with fuzzed contents, honestly sealed, or tampers with one (a bit
//! flipped, bytes replaced, a record replayed or dropped, a tag forged).
//!
//! Oracles: an honest record always opens and a tampered one never does (a forgery would be a
//! critical finding); every decoder returns a value or an error, never a panic or an
//! allocation sized by a forged length; what decodes re-encodes to the same bytes.

#![no_main]

use feedstore_proto::peer::{PeerHello, ReadReply, ReadRequest, TAG_BYTES};
use feedstore_proto::peer_stream::{SessionReply, SessionRequest, frame_len};
use feedstore_store::cluster::auth::{Secret, Side};
use feedstore_store::cluster::record::Records;
use libfuzzer_sys::fuzz_target;

fn hello(nonce: u8) -> PeerHello {
    PeerHello {
        version: feedstore_proto::peer::PEER_VERSION,
        oldest: feedstore_proto::peer::PEER_OLDEST_VERSION,
        reserved: 0,
        flags: feedstore_proto::peer::HELLO_SECRET,
        node_id: u32::from(nonce),
        epoch: 7,
        instance: u64::from(nonce) << 8,
        nonce: [nonce; 32],
    }
}

/// Parses `body` as the message `kind` names, checking canonical re-encoding.
fn parse(kind: u8, body: &[u8]) {
    match kind % 4 {
        0 => {
            if let Ok(b) = <&[u8; ReadRequest::BYTES]>::try_from(body)
                && let Ok(r) = ReadRequest::from_bytes(b)
            {
                assert_eq!(&r.to_bytes(), b);
            }
        }
        1 => {
            if let Ok(b) = <&[u8; ReadReply::BYTES]>::try_from(body)
                && let Ok(r) = ReadReply::from_bytes(b)
            {
                assert_eq!(&r.to_bytes(), b);
            }
        }
        k => {
            // A session frame: length word first, as the session's reader takes it.
            let Some((word, frame)) = body.split_first_chunk::<4>() else {
                return;
            };
            if frame_len(*word) != Ok(frame.len()) {
                return;
            }
            if k == 2 {
                if let Ok((id, r)) = SessionRequest::decode(frame) {
                    assert_eq!(r.encode(id), body);
                }
            } else if let Ok((id, r)) = SessionReply::decode(frame) {
                assert_eq!(r.encode(id), body);
            }
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let secret = Secret::from_bytes(b"the fixed secret of the fuzz target".to_vec()).unwrap();
    let (c, a) = (hello(1), hello(2));
    let mut connector = Records::new(Some(&secret), Side::Connector, &c, &a);
    let mut acceptor = Records::new(Some(&secret), Side::Acceptor, &c, &a);
    let mut sent: Vec<(Vec<u8>, [u8; TAG_BYTES])> = Vec::new();
    let mut rest = data;
    while let [op, kind, len, tail @ ..] = rest {
        let n = usize::from(*len).min(tail.len());
        let (body, next) = tail.split_at(n);
        rest = next;
        // Messages of each kind go the way the daemons send them; any bytes may be a body.
        let (sender, receiver) = if kind % 4 == 1 || kind % 4 == 3 {
            (&mut acceptor, &mut connector)
        } else {
            (&mut connector, &mut acceptor)
        };
        let tag = sender.sealer.seal(body);
        // A replay needs an earlier record; without one the step is honest.
        let op = if op % 6 == 3 && sent.is_empty() { 0 } else { op % 6 };
        match op {
            // Honest: opens, then parses.
            0 | 1 => {
                assert!(receiver.opener.open(body, &tag).is_ok(), "an honest record failed");
                parse(*kind, body);
                sent.push((body.to_vec(), tag));
            }
            // A bit of the record or its tag flipped on the way.
            2 => {
                let mut bad = body.to_vec();
                let mut bad_tag = tag;
                let at = usize::from(*len);
                if bad.is_empty() || at % 2 == 1 {
                    bad_tag[at % TAG_BYTES] ^= 1 << (at % 8);
                } else {
                    let i = at % bad.len();
                    bad[i] ^= 1 << (at % 8);
                }
                assert!(receiver.opener.open(&bad, &bad_tag).is_err(), "a flipped record opened");
                return; // the connection ends here
            }
            // An earlier record sent again in place of this one.
            3 => {
                let (old, old_tag) = &sent[usize::from(*len) % sent.len()];
                assert!(
                    receiver.opener.open(old, old_tag).is_err(),
                    "a replayed record opened"
                );
                return;
            }
            // This record dropped: the next honest one arrives out of its place.
            4 => {
                let next = sender.sealer.seal(body);
                assert!(receiver.opener.open(body, &next).is_err(), "a record opened out of order");
                return;
            }
            // A tag made up by someone without the key.
            _ => {
                let mut forged = [0u8; TAG_BYTES];
                for (i, b) in forged.iter_mut().enumerate() {
                    *b = body.get(i).copied().unwrap_or(*kind);
                }
                if forged != tag {
                    assert!(receiver.opener.open(body, &forged).is_err(), "a forged tag opened");
                }
                return;
            }
        }
    }
});
