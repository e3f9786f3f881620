//! The bytes of the manifests this registry serves, held in memory: a manifest GET by tag
//! or by digest answers from here instead of reading the manifest's object from the store
//! every time (on local disk an open, two stats, a read and a close; on S3 a GET).
//!
//! Invariant: an entry holds exactly the bytes of the manifest its digest names.
//! Manifests are content-addressed and never rewritten or removed (`ObjectStore::remove`
//! is for layer blobs only), so an entry never goes stale and nothing invalidates one.
//! Memory stays within `manifest_cache_bytes` (`crate::bytes_cache`).

use bytes::Bytes;

use crate::bytes_cache::BytesCache;
use crate::store::{ObjectKey, ObjectStore, StoreError};
use amber_oci::digest::Digest;

/// Manifest reads answered from memory, and from the store (metrics).
pub const HITS: &str = "amber_manifest_cache_hits_total";
pub const MISSES: &str = "amber_manifest_cache_misses_total";

pub struct ManifestCache {
    held: BytesCache<Digest>,
}

impl ManifestCache {
    /// A cache holding at most `budget` bytes of manifests (0: holds nothing).
    pub fn new(budget: usize) -> ManifestCache {
        ManifestCache {
            held: BytesCache::new(budget, |d| std::mem::size_of::<Digest>() + d.hex().len()),
        }
    }

    /// The bytes of manifest `digest`: from memory, else from `store` (then held).
    pub async fn read(
        &self,
        store: &dyn ObjectStore,
        digest: &Digest,
    ) -> Result<Bytes, StoreError> {
        let ticket = match self.held.get(digest) {
            Ok(bytes) => {
                metrics::counter!(HITS).increment(1);
                return Ok(bytes);
            }
            Err(ticket) => ticket,
        };
        metrics::counter!(MISSES).increment(1);
        let bytes = store.read_all(&ObjectKey::blob(digest)).await?;
        self.held.fill(ticket, digest.clone(), bytes.clone());
        Ok(bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::fs::FsStore;
    use amber_oci::digest::Algorithm;

    #[tokio::test]
    async fn a_manifest_read_once_is_served_from_memory_with_the_same_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let store = FsStore::open(dir.path()).unwrap();
        let body = Bytes::from_static(br#"{"schemaVersion":2}"#);
        let digest = Digest::of(Algorithm::Sha256, &body);
        store
            .put(&ObjectKey::blob(&digest), body.clone())
            .await
            .unwrap();
        let cache = ManifestCache::new(1 << 20);
        assert_eq!(cache.read(&store, &digest).await.unwrap(), body);
        // Gone from the store (which never happens to a manifest): still served, so from memory.
        store.remove(&ObjectKey::blob(&digest)).await.unwrap();
        assert_eq!(cache.read(&store, &digest).await.unwrap(), body);
        // A manifest the store lacks is the store's error, and nothing is held for it.
        let missing = Digest::of(Algorithm::Sha256, b"not pushed");
        let err = cache.read(&store, &missing).await.unwrap_err();
        assert!(matches!(err, StoreError::NotFound(_)), "{err}");
        assert_eq!(cache.held.held().1, 1, "only the manifest read is held");
    }
}
