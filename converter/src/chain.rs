//! Conversion work kept for reuse: the merged tree after the first `k` layers of an
//! image (a *layer chain*), with every file's bytes located in the chunk store.
//!
//! Task images share their lower layers, so most of what a conversion reads was read
//! before. A `ChainState` is what `convert` knew after applying a chain of layers: the
//! tree (metadata only), the diff ids, and for each file where its bytes are among the
//! chunks (`DataLocation`). A later image whose first `k` layers are the same blobs
//! starts from that state and reads only its own layers; files from the chain are laid
//! out from their locations, and a pack or large file whose chunks the store already has
//! is not read at all.
//!
//! Invariants:
//! - a state depends only on its chain (the layer blobs, in order) and the converter's
//!   `CHAIN_FORMAT`; `ChainKey` names exactly that, so a state is valid for any image
//!   with that chain, and the env digest from it is the one a full conversion gives (the
//!   converter's tests compare both paths);
//! - every chunk a state names is in the store before the state is published (the
//!   caller stores a state only after its conversion's chunks are stored), and every
//!   chunk read back through a `ChunkSource` is checked against its id;
//! - the encoding carries a blake3 checksum, so a damaged state is refused, never used.

use std::io::Read;

use serde::{Deserialize, Serialize};

use crate::chunk::DataLocation;
use crate::tree::Inode;

/// Changes whenever a state's meaning changes (tree rules, layout or chunking rules).
pub const CHAIN_FORMAT: u32 = 2;
const MAGIC: &[u8; 8] = b"amberch1";
/// Largest decoded state accepted (a tree of ten million entries is about 1 GiB).
const MAX_STATE: u64 = 2 << 30;

/// Names a chain of layers: blake3 over `CHAIN_FORMAT` and the layer blob digests in
/// order. Keys are per blob, not per diff id, because they are looked up before any
/// layer is read; the same content compressed differently is simply another chain.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ChainKey(pub [u8; 32]);

impl ChainKey {
    pub fn hex(&self) -> String {
        hex::encode(self.0)
    }
}

/// The key of every prefix of `layers`: element `k - 1` names the first `k` layers.
pub fn chain_keys<S: AsRef<str>>(layers: &[S]) -> Vec<ChainKey> {
    let mut h = blake3::Hasher::new();
    h.update(format!("amber layer chain v{CHAIN_FORMAT}\n").as_bytes());
    layers
        .iter()
        .map(|l| {
            h.update(&(l.as_ref().len() as u64).to_le_bytes());
            h.update(l.as_ref().as_bytes());
            ChainKey(*h.clone().finalize().as_bytes())
        })
        .collect()
}

/// What a conversion knew after applying the first `layers` layers of a chain.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ChainState {
    pub format: u32,
    /// How many layers the chain has.
    pub layers: u32,
    /// Their diff ids (the env's file system UUID is derived from all of an image's).
    pub diff_ids: Vec<String>,
    /// Uncompressed bytes of those layers.
    pub layer_bytes: u64,
    /// The tree; every regular file's data is `DataSource::Stored(i)`, an index into
    /// `data` (unreachable files, hidden by a later layer of the chain, point past it:
    /// nothing lays them out).
    pub inodes: Vec<Inode>,
    pub data: Vec<DataLocation>,
}

#[derive(Debug, thiserror::Error)]
pub enum ChainError {
    #[error("not a layer chain state (bad magic)")]
    Magic,
    #[error("layer chain state is damaged (checksum mismatch)")]
    Checksum,
    #[error("layer chain state has format {0}; this converter reads {CHAIN_FORMAT}")]
    Format(u32),
    #[error("layer chain state does not decode: {0}")]
    Decode(String),
}

impl ChainState {
    /// magic, blake3 of the rest, then the zstd-compressed postcard encoding.
    pub fn encode(&self) -> Vec<u8> {
        let plain = postcard::to_allocvec(self).expect("a state serializes");
        let packed = zstd::bulk::compress(&plain, 3).expect("zstd compresses in memory");
        let mut out = Vec::with_capacity(packed.len() + 40);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(blake3::hash(&packed).as_bytes());
        out.extend_from_slice(&packed);
        out
    }

    pub fn decode(bytes: &[u8]) -> Result<ChainState, ChainError> {
        let rest = bytes.strip_prefix(MAGIC).ok_or(ChainError::Magic)?;
        if rest.len() < 32 {
            return Err(ChainError::Magic);
        }
        let (sum, packed) = rest.split_at(32);
        if blake3::hash(packed).as_bytes() != sum {
            return Err(ChainError::Checksum);
        }
        let mut plain = Vec::new();
        zstd::stream::read::Decoder::new(packed)
            .map_err(|e| ChainError::Decode(e.to_string()))?
            .take(MAX_STATE + 1)
            .read_to_end(&mut plain)
            .map_err(|e| ChainError::Decode(e.to_string()))?;
        if plain.len() as u64 > MAX_STATE {
            return Err(ChainError::Decode("larger than 2 GiB".into()));
        }
        let state: ChainState =
            postcard::from_bytes(&plain).map_err(|e| ChainError::Decode(e.to_string()))?;
        if state.format != CHAIN_FORMAT {
            return Err(ChainError::Format(state.format));
        }
        if state.diff_ids.len() != state.layers as usize || state.inodes.is_empty() {
            return Err(ChainError::Decode(
                "layer count, diff ids and tree disagree".into(),
            ));
        }
        Ok(state)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_key_depends_on_every_layer_below_it_and_nothing_above() {
        let a = chain_keys(&["sha256:aa", "sha256:bb", "sha256:cc"]);
        let b = chain_keys(&["sha256:aa", "sha256:bb", "sha256:dd"]);
        let c = chain_keys(&["sha256:bb"]);
        assert_eq!(a[..2], b[..2]);
        assert_ne!(a[2], b[2]);
        assert_ne!(a[0], c[0]);
        assert_ne!(
            chain_keys(&["sha256:a", "sha256:b"])[1],
            chain_keys(&["sha256:a\nsha256:b"])[0]
        );
    }

    #[test]
    fn a_damaged_state_is_refused() {
        let s = ChainState {
            format: CHAIN_FORMAT,
            layers: 0,
            diff_ids: vec![],
            layer_bytes: 0,
            inodes: crate::tree::Tree::new().inodes,
            data: vec![],
        };
        let mut bytes = s.encode();
        assert!(ChainState::decode(&bytes).is_ok());
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        assert!(matches!(
            ChainState::decode(&bytes),
            Err(ChainError::Checksum)
        ));
        assert!(matches!(
            ChainState::decode(b"nonsense"),
            Err(ChainError::Magic)
        ));
    }
}
