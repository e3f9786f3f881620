//! The block manifest, its canonical encoding and the env digest; chunk ids.
//!
//! Invariant: the env digest is blake3 of `BlockManifest::canonical_bytes()`, which
//! covers exactly the fields that determine the device's bytes (format version, device
//! size, block size, file system, and the sorted extents with their chunk ids). Ranges
//! not covered by an extent read as zeros. Provenance lives beside the manifest in
//! `ManifestEnvelope`, never inside what the digest covers.

use serde::{Deserialize, Serialize};

pub use amber_oci::env::{BadBlake3, ChunkId, EnvDigest};

/// One stored range of the device.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Extent {
    pub offset: u64,
    pub length: u64,
    pub chunk: ChunkId,
}

pub const FORMAT_VERSION: u32 = 1;

/// What determines a block device's bytes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockManifest {
    pub version: u32,
    pub device_size: u64,
    pub block_size: u32,
    pub filesystem: String,
    /// Sorted by offset, non-overlapping; gaps are zeros.
    pub extents: Vec<Extent>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ManifestError {
    #[error("unsupported block manifest version {0}")]
    Version(u32),
    #[error("extent at {offset} overlaps or precedes the one before it")]
    Unsorted { offset: u64 },
    #[error("extent at {offset} (+{length}) lies outside the {device_size}-byte device")]
    OutOfRange {
        offset: u64,
        length: u64,
        device_size: u64,
    },
    #[error("extent at {0} is empty")]
    Empty(u64),
}

impl BlockManifest {
    /// The canonical encoding: JSON with fields in a fixed order and no whitespace.
    pub fn canonical_bytes(&self) -> Vec<u8> {
        // serde_json writes struct fields in declaration order and Extent/ChunkId have
        // one textual form, so this is canonical by construction.
        serde_json::to_vec(self).expect("manifest serializes")
    }

    pub fn env_digest(&self) -> EnvDigest {
        EnvDigest::of(&self.canonical_bytes())
    }

    /// Checks the invariants a reader relies on.
    pub fn validate(&self) -> Result<(), ManifestError> {
        if self.version != FORMAT_VERSION {
            return Err(ManifestError::Version(self.version));
        }
        let mut end = 0;
        for e in &self.extents {
            if e.length == 0 {
                return Err(ManifestError::Empty(e.offset));
            }
            if e.offset < end {
                return Err(ManifestError::Unsorted { offset: e.offset });
            }
            end = e.offset.saturating_add(e.length);
            if end > self.device_size {
                return Err(ManifestError::OutOfRange {
                    offset: e.offset,
                    length: e.length,
                    device_size: self.device_size,
                });
            }
        }
        Ok(())
    }

    /// Bytes covered by extents (the rest is holes).
    pub fn stored_bytes(&self) -> u64 {
        self.extents.iter().map(|e| e.length).sum()
    }
}

/// Provenance that does not determine the bytes: stored beside the manifest.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Provenance {
    /// The OCI image manifest digest the device was made from, when known.
    pub image: Option<String>,
    /// Uncompressed layer digests (diff_ids), in order.
    pub diff_ids: Vec<String>,
    pub converter: String,
}

/// The stored form: the manifest, its digest, and provenance.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ManifestEnvelope {
    pub env_digest: EnvDigest,
    pub manifest: BlockManifest,
    pub provenance: Provenance,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m() -> BlockManifest {
        BlockManifest {
            version: FORMAT_VERSION,
            device_size: 8192,
            block_size: 4096,
            filesystem: "erofs".into(),
            extents: vec![Extent {
                offset: 0,
                length: 4096,
                chunk: ChunkId::of(b"x"),
            }],
        }
    }

    #[test]
    fn digest_is_stable_and_round_trips() {
        let a = m();
        let text = String::from_utf8(a.canonical_bytes()).unwrap();
        assert!(text.starts_with(r#"{"version":1,"device_size":8192,"block_size":4096,"filesystem":"erofs","extents":[{"offset":0"#));
        let b: BlockManifest = serde_json::from_str(&text).unwrap();
        assert_eq!(a.env_digest(), b.env_digest());
        let d = a.env_digest().to_string();
        assert_eq!(d.parse::<EnvDigest>().unwrap(), a.env_digest());
    }

    #[test]
    fn invalid_manifests_are_refused() {
        let mut a = m();
        a.extents.push(Extent {
            offset: 100,
            length: 10,
            chunk: ChunkId::of(b"y"),
        });
        assert_eq!(a.validate(), Err(ManifestError::Unsorted { offset: 100 }));
        let mut b = m();
        b.extents[0].length = 9000;
        assert!(matches!(
            b.validate(),
            Err(ManifestError::OutOfRange { .. })
        ));
        assert!("blake3:xyz".parse::<ChunkId>().is_err());
        assert!("sha256:00".parse::<ChunkId>().is_err());
    }
}
