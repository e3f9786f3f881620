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

macro_rules! blake3_id {
    ($t:ident) => {
        impl $t {
            pub fn of(data: &[u8]) -> $t {
                $t(*blake3::hash(data).as_bytes())
            }
            pub fn hex(&self) -> String {
                hex::encode(self.0)
            }
        }
        impl fmt::Display for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "blake3:{}", hex::encode(self.0))
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
