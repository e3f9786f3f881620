//! amber's own content ids: `EnvDigest` (blake3 of a block manifest's canonical bytes,
//! the id an environment is pinned by) and `ChunkId` (blake3 of a chunk's uncompressed
//! bytes), both spelled `blake3:<64 lowercase hex>`.
//!
//! Invariant kept here: a parsed id is always 32 bytes from exactly 64 lowercase hex
//! characters, so its `hex()` is safe as a storage key.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// `blake3:<hex>` of a chunk's uncompressed bytes.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChunkId(pub [u8; 32]);

/// `blake3:<hex>` of a block manifest's canonical encoding.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EnvDigest(pub [u8; 32]);

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{0:?} is not a blake3 digest (blake3:<64 lowercase hex>)")]
pub struct BadBlake3(pub String);

fn parse_blake3(s: &str) -> Result<[u8; 32], BadBlake3> {
    let hex = s
        .strip_prefix("blake3:")
        .ok_or_else(|| BadBlake3(s.into()))?;
    if hex.len() != 64
        || !hex
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    {
        return Err(BadBlake3(s.into()));
    }
    let mut out = [0u8; 32];
    hex::decode_to_slice(hex, &mut out).map_err(|_| BadBlake3(s.into()))?;
    Ok(out)
}

/// Lowercase hex of a 32-byte id, without allocating (ids are formatted for every key
/// and path that names a chunk: `hex::encode` built a String a char at a time).
fn hex32(bytes: &[u8; 32]) -> [u8; 64] {
    let mut out = [0u8; 64];
    hex::encode_to_slice(bytes, &mut out).expect("64 bytes hold 32 in hex");
    out
}

macro_rules! blake3_id {
    ($t:ident) => {
        impl $t {
            pub fn of(data: &[u8]) -> $t {
                $t(*blake3::hash(data).as_bytes())
            }
            pub fn hex(&self) -> String {
                String::from_utf8(hex32(&self.0).to_vec()).expect("hex is ASCII")
            }
        }
        impl fmt::Display for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                let hex = hex32(&self.0);
                f.write_str("blake3:")?;
                f.write_str(std::str::from_utf8(&hex).expect("hex is ASCII"))
            }
        }
        impl fmt::Debug for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(self, f)
            }
        }
        impl FromStr for $t {
            type Err = BadBlake3;
            fn from_str(s: &str) -> Result<$t, BadBlake3> {
                parse_blake3(s).map($t)
            }
        }
        impl Serialize for $t {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.collect_str(self)
            }
        }
        impl<'de> Deserialize<'de> for $t {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<$t, D::Error> {
                String::deserialize(d)?
                    .parse()
                    .map_err(serde::de::Error::custom)
            }
        }
    };
}

blake3_id!(ChunkId);
blake3_id!(EnvDigest);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_print_as_blake3_hex_and_parse_back() {
        let id = ChunkId::of(b"a chunk");
        let shown = id.to_string();
        assert_eq!(
            shown,
            format!("blake3:{}", blake3::hash(b"a chunk").to_hex())
        );
        assert_eq!(id.hex(), shown["blake3:".len()..]);
        assert_eq!(shown.parse::<ChunkId>().unwrap(), id);
    }
}
