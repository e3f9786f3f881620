//! The bytes of the manifests this registry serves, for GETs by tag or by digest: held
//! in memory, else the index's copy (`manifest_bytes`: a key in a compressed table, read
//! with the manifest's record), else the store's object (on local disk an open, two stats,
//! a read and a close of a file in a tree of millions; on S3 a GET), which then fills
//! both. Pushes fill both too ([`ManifestCache::pushed`]).
//!
//! At a million images the files of the manifests were 5 GiB of 4 KiB blocks (a
//! manifest is about a kilobyte) beside their inodes and directories, which the page
//! cache did not keep: opening one was 28% of the registry's CPU in GETs by tag, and a
//! read that waited for the disk stalled the requests queued behind it.
//!
//! Invariant: an entry, in memory or in the index, holds exactly the bytes of the
//! manifest its digest names (a copy read from the store is checked against its digest
//! before the index keeps it). Manifests are content-addressed and never rewritten or
//! removed (`ObjectStore::remove` is for layer blobs only), so an entry never goes stale
//! and nothing invalidates one. Memory stays within `manifest_cache_bytes`
//! (`crate::bytes_cache`).

use bytes::Bytes;

use crate::bytes_cache::BytesCache;
use crate::index::{Index, IndexError};
use crate::store::{ObjectKey, ObjectStore, StoreError};
use amber_oci::digest::Digest;

/// Manifest reads answered from memory, from the index's copy, and from the store
/// (metrics).
pub const HITS: &str = "amber_manifest_cache_hits_total";
pub const INDEX_HITS: &str = "amber_manifest_cache_index_hits_total";
pub const MISSES: &str = "amber_manifest_cache_misses_total";

#[derive(Debug, thiserror::Error)]
pub enum ManifestReadError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Index(#[from] IndexError),
}

pub struct ManifestCache {
    held: BytesCache<Digest>,
    /// Keeps no copies (a budget of 0).
    off: bool,
}

impl ManifestCache {
    /// A cache holding at most `budget` bytes of manifests in memory. 0 turns it off:
    /// no copies at all, in memory or in the index, so every GET reads the store (what a
    /// test that tampers with the store's objects needs to reach the client).
    pub fn new(budget: usize) -> ManifestCache {
        ManifestCache {
            held: BytesCache::new(budget, |d| std::mem::size_of::<Digest>() + d.hex().len()),
            off: budget == 0,
        }
    }

    /// The bytes of manifest `digest`: from memory, else from `index`'s copy, else from
    /// `store` (then kept in both).
    pub async fn read(
        &self,
        index: &Index,
        store: &dyn ObjectStore,
        digest: &Digest,
    ) -> Result<Bytes, ManifestReadError> {
        if self.off {
            metrics::counter!(MISSES).increment(1);
            return Ok(store.read_all(&ObjectKey::blob(digest)).await?);
        }
        let ticket = match self.held.get(digest) {
            Ok(bytes) => {
                metrics::counter!(HITS).increment(1);
                return Ok(bytes);
            }
            Err(ticket) => ticket,
        };
        if let Some(bytes) = index.manifest_bytes(digest)? {
            metrics::counter!(INDEX_HITS).increment(1);
            self.held.fill(ticket, digest.clone(), bytes.clone());
            return Ok(bytes);
        }
        metrics::counter!(MISSES).increment(1);
        let bytes = store.read_all(&ObjectKey::blob(digest)).await?;
        if Digest::of(digest.algorithm(), &bytes) == *digest {
            index.put_manifest_bytes(digest, &bytes)?;
            self.held.fill(ticket, digest.clone(), bytes.clone());
        } else {
            // Served as stored (the store's own checks are for its scrub to report), but
            // never kept as the manifest's bytes.
            tracing::warn!(%digest, "stored manifest does not match its digest; not cached");
        }
        Ok(bytes)
    }

    /// Keeps `bytes`, just pushed and checked to be manifest `digest`'s.
    pub fn pushed(&self, index: &Index, digest: &Digest, bytes: &Bytes) -> Result<(), IndexError> {
        if self.off {
            return Ok(());
        }
        index.put_manifest_bytes(digest, bytes)?;
        self.held.set(digest.clone(), bytes.clone());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::fs::FsStore;
    use amber_oci::digest::Algorithm;

    /// A store and an index in a fresh directory, with `bytes` stored as manifest `digest`.
    async fn stored(digest: &Digest, bytes: &Bytes) -> (tempfile::TempDir, FsStore, Index) {
        let dir = tempfile::tempdir().unwrap();
        let store = FsStore::open(dir.path().join("store")).unwrap();
        let index = Index::open(&dir.path().join("index")).unwrap();
        store
            .put(&ObjectKey::blob(digest), bytes.clone())
            .await
            .unwrap();
        (dir, store, index)
    }

    #[tokio::test]
    async fn a_manifest_read_once_is_served_from_memory_or_the_index_with_the_same_bytes() {
        let body = Bytes::from_static(br#"{"schemaVersion":2}"#);
        let digest = Digest::of(Algorithm::Sha256, &body);
        let (_dir, store, index) = stored(&digest, &body).await;
        let cache = ManifestCache::new(1 << 20);
        assert_eq!(cache.read(&index, &store, &digest).await.unwrap(), body);
        // Gone from the store (which never happens to a manifest): still served, from
        // memory, and from the index's copy by a cache with nothing in memory yet.
        store.remove(&ObjectKey::blob(&digest)).await.unwrap();
        assert_eq!(cache.read(&index, &store, &digest).await.unwrap(), body);
        let cold = ManifestCache::new(1 << 20);
        assert_eq!(cold.read(&index, &store, &digest).await.unwrap(), body);
        // A manifest the store lacks is the store's error, and nothing is held for it.
        let missing = Digest::of(Algorithm::Sha256, b"not pushed");
        let err = cache.read(&index, &store, &missing).await.unwrap_err();
        assert!(
            matches!(err, ManifestReadError::Store(StoreError::NotFound(_))),
            "{err}"
        );
        assert_eq!(cache.held.held().1, 1, "only the manifest read is held");
        assert_eq!(index.manifest_bytes(&missing).unwrap(), None);
        // A pushed manifest is served without the store.
        let pushed = Bytes::from_static(br#"{"schemaVersion":2,"pushed":1}"#);
        let pushed_digest = Digest::of(Algorithm::Sha256, &pushed);
        cache.pushed(&index, &pushed_digest, &pushed).unwrap();
        assert_eq!(
            cold.read(&index, &store, &pushed_digest).await.unwrap(),
            pushed
        );
        // Turned off (a budget of 0), it keeps nothing and reads the store every time.
        let off = ManifestCache::new(0);
        let err = off.read(&index, &store, &digest).await.unwrap_err();
        assert!(
            matches!(err, ManifestReadError::Store(StoreError::NotFound(_))),
            "{err}"
        );
        let unkept = Bytes::from_static(br#"{"schemaVersion":2,"off":1}"#);
        let unkept_digest = Digest::of(Algorithm::Sha256, &unkept);
        off.pushed(&index, &unkept_digest, &unkept).unwrap();
        assert_eq!(index.manifest_bytes(&unkept_digest).unwrap(), None);
    }

    /// Bytes in the store that are not the manifest its digest names are served as
    /// stored but never kept as the manifest's.
    #[tokio::test]
    async fn a_stored_object_that_does_not_match_its_digest_is_not_kept() {
        let digest = Digest::of(Algorithm::Sha256, b"the real manifest");
        let wrong = Bytes::from_static(b"something else");
        let (_dir, store, index) = stored(&digest, &wrong).await;
        let cache = ManifestCache::new(1 << 20);
        assert_eq!(cache.read(&index, &store, &digest).await.unwrap(), wrong);
        assert_eq!(cache.held.held().1, 0);
        assert_eq!(index.manifest_bytes(&digest).unwrap(), None);
    }
}
