//! Repository records: which manifests and blobs each repository holds, where its tags
//! point and how its images converted. Their durable truth is the object store's records
//! (store/mod.rs); the RocksDB index caches them.
//!
//! Invariants kept here:
//! - every write goes to the store first, then to the index: a crash in between leaves
//!   the index behind the store, never ahead of it;
//! - reads try the index and fall back to the store, filling the index: a push through
//!   one replica is visible through every other replica over the same bucket at once;
//! - tags are always read from the store (the index copy only serves listings) and moved
//!   with compare-and-swap, so tag moves are linearizable across replicas;
//! - `reindex` rebuilds an index from the store's records alone.

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::index::{Conversion, ConversionState, IndexError, ManifestRecord, ManifestWrite};
use crate::manifest_cache::{Held, HITS, INDEX_HITS, MISSES};
use crate::registry::Registry;
use crate::store::{ObjectKey, RecordKey, StoreError};
use amber_oci::digest::Digest;
use amber_oci::names::{RepoName, Tag};

/// Attempts at moving a tag before a push is refused as contended (each attempt loses
/// only to a push that moved the tag meanwhile).
const TAG_ATTEMPTS: usize = 64;

#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Index(#[from] IndexError),
    #[error("tag {repo}:{tag} is moved by other pushes so often that this one gave up after {TAG_ATTEMPTS} attempts; retry")]
    Contended { repo: String, tag: String },
    #[error("record {key} is not valid: {why}")]
    Corrupt { key: String, why: String },
}

/// The record of a manifest in a repository.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ManifestLink {
    pub media_type: String,
    pub size: u64,
    /// (subject digest, this manifest's descriptor) when the manifest has a subject.
    #[serde(default)]
    pub referrer: Option<(String, Value)>,
    /// Where it came from, when it was imported from another registry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<amber_api::registry::ImageSource>,
}

/// The keys of a listing refresh; none when the store did not answer (the listing is
/// then served from the index as it is).
fn served_from_index(prefix: &str, listed: Result<Vec<RecordKey>, StoreError>) -> Vec<RecordKey> {
    listed.unwrap_or_else(|e| {
        tracing::warn!(error = %e, prefix, "listing served from the index cache");
        Vec::new()
    })
}

fn corrupt(key: &RecordKey, why: impl std::fmt::Display) -> RecordError {
    RecordError::Corrupt {
        key: key.as_str().to_string(),
        why: why.to_string(),
    }
}

impl Registry {
    /// Records that `repo` holds blob `digest` of `size` bytes (already in the store).
    pub async fn link_blob(
        &self,
        repo: &RepoName,
        digest: &Digest,
        size: u64,
    ) -> Result<(), RecordError> {
        if self.index.repo_blob(repo, digest)? != Some(size) {
            self.link_repo(repo).await?;
            let key = RecordKey::blob(repo, digest);
            // Create-once: when it exists already it says the same.
            self.store
                .put_record(&key, Bytes::from(size.to_string()), None)
                .await?;
        }
        self.index.put_blob(repo, digest, size)?;
        Ok(())
    }

    /// The size of blob `digest` if `repo` holds it.
    pub async fn repo_blob(
        &self,
        repo: &RepoName,
        digest: &Digest,
    ) -> Result<Option<u64>, RecordError> {
        if let Some(size) = self.index.repo_blob(repo, digest)? {
            return Ok(Some(size));
        }
        let key = RecordKey::blob(repo, digest);
        let Some((v, _)) = self.store.get_record(&key).await? else {
            return Ok(None);
        };
        let size: u64 = std::str::from_utf8(&v)
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| corrupt(&key, "not a size"))?;
        self.index.put_blob(repo, digest, size)?;
        Ok(Some(size))
    }

    /// Records a pushed manifest (already in the store) and moves its tag, if any.
    pub async fn link_manifest(&self, w: ManifestWrite<'_>) -> Result<(), RecordError> {
        let link = ManifestLink {
            media_type: w.record.media_type.clone(),
            size: w.record.size,
            referrer: w.referrer.as_ref().map(|(s, d)| (s.to_string(), d.clone())),
            source: w.record.source.clone(),
        };
        let key = RecordKey::manifest(w.repo, w.digest);
        if self.index.manifest(w.repo, w.digest)?.is_none() {
            self.link_repo(w.repo).await?;
            if let Some((subject, _)) = &w.referrer {
                self.store
                    .put_record(
                        &RecordKey::referrer(w.repo, subject, w.digest),
                        Bytes::new(),
                        None,
                    )
                    .await?;
            }
            self.store
                .put_record(
                    &key,
                    Bytes::from(serde_json::to_vec(&link).expect("json")),
                    None,
                )
                .await?;
        }
        if let Some(tag) = w.tag {
            self.move_tag(w.repo, tag, w.digest, w.tag_immutable)
                .await?;
        }
        // The store decided the tag; the index only caches it.
        self.index.put_manifest(ManifestWrite {
            tag_immutable: false,
            ..w
        })?;
        Ok(())
    }

    /// Records that `repo` exists, once.
    async fn link_repo(&self, repo: &RepoName) -> Result<(), RecordError> {
        if !self.index.repo_exists(repo)? {
            self.store
                .put_record(&RecordKey::repo(repo), Bytes::new(), None)
                .await?;
        }
        Ok(())
    }

    /// Whether other replicas may have written to the store behind this index's back
    /// (a shared bucket). Listings then read the store's records first.
    fn shared(&self) -> bool {
        self.config.storage == crate::config::StorageKind::S3
    }

    /// Records under `prefix` for a listing refresh; none when the store does not answer
    /// (the listing is then served from the index as it is).
    async fn listed(&self, prefix: &str) -> Vec<RecordKey> {
        served_from_index(prefix, self.store.list_records(prefix).await)
    }

    /// Brings the index's repositories up to date with the store for a catalog page: the
    /// first `n` after `after`, in name order (one listing request, however many
    /// repositories the store holds).
    pub async fn refresh_catalog(&self, after: Option<&str>, n: usize) -> Result<(), RecordError> {
        if !self.shared() {
            return Ok(());
        }
        let prefix = RecordKey::CATALOG;
        let page = self.store.list_records_page(prefix, after, n).await;
        for key in served_from_index(prefix, page) {
            if let Some(repo) = key.catalog_repo() {
                if !self.index.repo_exists(&repo)? {
                    self.index.put_repo(&repo)?;
                }
            }
        }
        Ok(())
    }

    /// Brings the index's tags of `repo` up to date with the store for a tag-list page:
    /// the first `n` names after `after` (one listing request). A listing needs only the
    /// names, so only tags the index does not know are read (tags are resolved from the
    /// store's records whatever the index holds).
    pub async fn refresh_tags(
        &self,
        repo: &RepoName,
        after: Option<&str>,
        n: usize,
    ) -> Result<(), RecordError> {
        if !self.shared() {
            return Ok(());
        }
        let prefix = format!("_records/repos/{repo}/_tags/");
        let page = self.store.list_records_page(&prefix, after, n).await;
        for key in served_from_index(&prefix, page) {
            let Some(tag) = key
                .as_str()
                .strip_prefix(&prefix)
                .and_then(|t| Tag::parse(t).ok())
            else {
                continue;
            };
            if self.index.tag(repo, &tag)?.is_some() {
                continue;
            }
            if let Some(digest) = self.tag(repo, &tag).await? {
                if self.manifest(repo, &digest).await?.is_some() {
                    self.index.put_repo(repo)?;
                    self.index.put_tag(repo, &tag, &digest)?;
                }
            }
        }
        Ok(())
    }

    /// Brings the index's referrers of `subject` in `repo` up to date with the store.
    pub async fn refresh_referrers(
        &self,
        repo: &RepoName,
        subject: &Digest,
    ) -> Result<(), RecordError> {
        if !self.shared() {
            return Ok(());
        }
        let prefix = format!("_records/repos/{repo}/_referrers/{subject}/");
        for key in self.listed(&prefix).await {
            if let Some(d) = key
                .as_str()
                .strip_prefix(&prefix)
                .and_then(|d| d.parse::<Digest>().ok())
            {
                self.manifest(repo, &d).await?;
            }
        }
        Ok(())
    }

    /// Points `tag` at `digest` with compare-and-swap; an immutable tag only ever gets its
    /// first digest.
    async fn move_tag(
        &self,
        repo: &RepoName,
        tag: &Tag,
        digest: &Digest,
        immutable: bool,
    ) -> Result<(), RecordError> {
        let key = RecordKey::tag(repo, tag);
        let value = Bytes::from(digest.to_string());
        for _ in 0..TAG_ATTEMPTS {
            let current = self.store.get_record(&key).await?;
            let expected = match &current {
                Some((v, _)) if *v == value => return Ok(()),
                Some((v, _)) if immutable => {
                    return Err(IndexError::TagImmutable {
                        repo: repo.to_string(),
                        tag: tag.as_str().to_string(),
                        current: String::from_utf8_lossy(v).into_owned(),
                    }
                    .into())
                }
                Some((_, version)) => Some(version),
                None => None,
            };
            if self
                .store
                .put_record(&key, value.clone(), expected)
                .await?
                .is_some()
            {
                return Ok(());
            }
        }
        Err(RecordError::Contended {
            repo: repo.to_string(),
            tag: tag.as_str().to_string(),
        })
    }

    /// Where `tag` points now (read from the store: linearizable across replicas).
    pub async fn tag(&self, repo: &RepoName, tag: &Tag) -> Result<Option<Digest>, RecordError> {
        let key = RecordKey::tag(repo, tag);
        let record = match self.store.get_record(&key).await {
            Ok(r) => r,
            // The store is unreachable: answer from the cache (possibly stale) rather
            // than not at all.
            Err(e @ StoreError::Io { .. }) => {
                tracing::warn!(error = %e, %repo, tag = tag.as_str(), "tag read from the index cache");
                return Ok(self.index.tag(repo, tag)?);
            }
            Err(e) => return Err(e.into()),
        };
        match record {
            Some((v, _)) => Ok(Some(
                std::str::from_utf8(&v)
                    .ok()
                    .and_then(|s| s.parse().ok())
                    .ok_or_else(|| corrupt(&key, "not a digest"))?,
            )),
            // Data written before records existed has its tags in the index only.
            None => Ok(self.index.tag(repo, tag)?),
        }
    }

    /// What `repo` holds of manifest `digest`.
    pub async fn manifest(
        &self,
        repo: &RepoName,
        digest: &Digest,
    ) -> Result<Option<ManifestRecord>, RecordError> {
        if let Some(r) = self.index.manifest(repo, digest)? {
            return Ok(Some(r));
        }
        let key = RecordKey::manifest(repo, digest);
        let Some((v, _)) = self.store.get_record(&key).await? else {
            return Ok(None);
        };
        let link: ManifestLink = serde_json::from_slice(&v).map_err(|e| corrupt(&key, e))?;
        self.cache_manifest(repo, digest, &link)?;
        Ok(Some(ManifestRecord {
            media_type: link.media_type,
            size: link.size,
            source: link.source,
        }))
    }

    /// Puts a manifest record into the index (no tag).
    pub fn cache_manifest(
        &self,
        repo: &RepoName,
        digest: &Digest,
        link: &ManifestLink,
    ) -> Result<(), RecordError> {
        let subject = match &link.referrer {
            Some((s, d)) => Some((
                s.parse::<Digest>()
                    .map_err(|e| corrupt(&RecordKey::manifest(repo, digest), e))?,
                d.clone(),
            )),
            None => None,
        };
        self.index.put_manifest(ManifestWrite {
            repo,
            digest,
            record: ManifestRecord {
                media_type: link.media_type.clone(),
                size: link.size,
                source: link.source.clone(),
            },
            tag: None,
            tag_immutable: false,
            referrer: subject.as_ref().map(|(s, d)| (s, d.clone())),
        })?;
        Ok(())
    }

    /// The bytes of manifest `digest`: from memory, else from the index's copy, else from
    /// the store (then kept in both, once checked against the digest).
    pub async fn manifest_bytes(&self, digest: &Digest) -> Result<Bytes, RecordError> {
        let ticket = match self.held_manifest_bytes(digest)? {
            Held::Bytes(bytes) => return Ok(bytes),
            Held::Missing(ticket) => Some(ticket),
            Held::Off => None,
        };
        metrics::counter!(MISSES).increment(1);
        let bytes = self.store.read_all(&ObjectKey::blob(digest)).await?;
        let Some(ticket) = ticket else {
            // The cache is off: no copies anywhere.
            return Ok(bytes);
        };
        if Digest::of(digest.algorithm(), &bytes) == *digest {
            self.index.put_manifest_bytes(digest, &bytes)?;
            self.manifests.fill(ticket, digest, bytes.clone());
        } else {
            // Served as stored (the store's own checks are for its scrub to report), but
            // never kept as the manifest's bytes.
            tracing::warn!(%digest, "stored manifest does not match its digest; not cached");
        }
        Ok(bytes)
    }

    /// Manifest `digest`'s bytes and the media type they declare, when memory or the
    /// index's copy holds them and they declare one (`declared_media_type`); `None`
    /// sends the caller to the manifest's record and [`Self::manifest_bytes`].
    ///
    /// What a GET by tag answers with, one lookup fewer than through the repository's
    /// manifest record: a tag names only a manifest its repository holds (the record is
    /// written before any tag moves to it, `link_manifest`, and neither is ever removed),
    /// and a stored manifest's record has the media type its bytes declare
    /// (`parse_manifest` refuses a Content-Type that differs).
    pub fn held_manifest(&self, digest: &Digest) -> Result<Option<(String, Bytes)>, RecordError> {
        Ok(match self.held_manifest_bytes(digest)? {
            Held::Bytes(bytes) => {
                amber_oci::manifest::declared_media_type(&bytes).map(|t| (t, bytes))
            }
            _ => None,
        })
    }

    /// What memory holds of manifest `digest`, with the index's copy standing in for
    /// memory on a miss (and filling it); hits of either are counted.
    fn held_manifest_bytes(&self, digest: &Digest) -> Result<Held, RecordError> {
        let ticket = match self.manifests.get(digest) {
            Held::Missing(ticket) => ticket,
            Held::Bytes(bytes) => {
                metrics::counter!(HITS).increment(1);
                return Ok(Held::Bytes(bytes));
            }
            Held::Off => return Ok(Held::Off),
        };
        Ok(match self.index.manifest_bytes(digest)? {
            Some(bytes) => {
                metrics::counter!(INDEX_HITS).increment(1);
                self.manifests.fill(ticket, digest, bytes.clone());
                Held::Bytes(bytes)
            }
            None => Held::Missing(ticket),
        })
    }

    /// Keeps `bytes`, just pushed and checked to be manifest `digest`'s, in memory and in
    /// the index (unsynced: a copy lost in a crash is read from the store again).
    pub fn manifest_pushed(&self, digest: &Digest, bytes: &Bytes) -> Result<(), RecordError> {
        if self.manifests.on() {
            self.index.put_manifest_bytes(digest, bytes)?;
            self.manifests.set(digest, bytes.clone());
        }
        Ok(())
    }

    /// Records how an image's conversion ended (done or failed), for every replica and
    /// for `reindex`, and returns the outcome the store keeps: the first one recorded,
    /// except that a success replaces a failure (a later attempt that succeeded).
    pub async fn record_conversion(
        &self,
        image: &Digest,
        c: &Conversion,
    ) -> Result<Conversion, RecordError> {
        let key = RecordKey::conversion(image);
        let value = Bytes::from(serde_json::to_vec(c).expect("json"));
        let mut expected = None;
        for _ in 0..TAG_ATTEMPTS {
            if self
                .store
                .put_record(&key, value.clone(), expected.as_ref())
                .await?
                .is_some()
            {
                return Ok(c.clone());
            }
            let Some((v, version)) = self.store.get_record(&key).await? else {
                expected = None;
                continue;
            };
            let kept: Conversion = serde_json::from_slice(&v).map_err(|e| corrupt(&key, e))?;
            if kept.state == ConversionState::Done || c.state != ConversionState::Done {
                return Ok(kept);
            }
            expected = Some(version);
        }
        Err(RecordError::Corrupt {
            key: key.as_str().to_string(),
            why: "rewritten by other replicas on every attempt".into(),
        })
    }

    /// How an image's conversion stands: its success from the index, or its outcome
    /// from the store (filling the index), else its work item in the shared queue (queued, or running
    /// on some replica).
    pub async fn conversion(&self, image: &Digest) -> Result<Option<Conversion>, RecordError> {
        let cached = self.index.conversion(image)?;
        // A failure is looked up again: another replica may have converted the image
        // since (a later push retries a failed conversion).
        if cached
            .as_ref()
            .is_some_and(|c| c.state == ConversionState::Done)
        {
            return Ok(cached);
        }
        let key = RecordKey::conversion(image);
        if let Some((v, _)) = self.store.get_record(&key).await? {
            let c: Conversion = serde_json::from_slice(&v).map_err(|e| corrupt(&key, e))?;
            self.cache_conversion(image, &c)?;
            return Ok(Some(c));
        }
        match self.pending_conversion(image).await? {
            Some(pending) => Ok(Some(pending)),
            None => Ok(cached),
        }
    }

    fn cache_conversion(&self, image: &Digest, c: &Conversion) -> Result<(), RecordError> {
        match &c.env_digest {
            Some(env) if c.state == ConversionState::Done => {
                self.index.finish_conversion(image, env, c)?;
            }
            _ => self.index.put_conversion(image, c)?,
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::manifest_cache::ManifestCache;
    use amber_oci::digest::Algorithm;

    /// A registry in a fresh directory keeping `budget` bytes of manifests in memory, with
    /// `bytes` stored as manifest `digest`.
    async fn stored(
        budget: usize,
        digest: &Digest,
        bytes: &Bytes,
    ) -> (tempfile::TempDir, Registry) {
        let dir = tempfile::tempdir().unwrap();
        let config = Config {
            data: dir.path().to_path_buf(),
            manifest_cache_bytes: budget,
            ..Config::default()
        };
        let reg = Registry::in_data_dir(config);
        reg.store
            .put(&ObjectKey::blob(digest), bytes.clone())
            .await
            .unwrap();
        (dir, reg)
    }

    #[tokio::test]
    async fn a_manifest_read_once_is_served_from_memory_or_the_index_with_the_same_bytes() {
        let body = Bytes::from_static(br#"{"schemaVersion":2}"#);
        let digest = Digest::of(Algorithm::Sha256, &body);
        let (_dir, mut reg) = stored(1 << 20, &digest, &body).await;
        assert_eq!(reg.manifest_bytes(&digest).await.unwrap(), body);
        // Gone from the store (which never happens to a manifest): still served, from
        // memory, and from the index's copy once memory holds nothing.
        reg.store.remove(&ObjectKey::blob(&digest)).await.unwrap();
        assert_eq!(reg.manifest_bytes(&digest).await.unwrap(), body);
        reg.manifests = ManifestCache::new(1 << 20);
        assert_eq!(reg.manifest_bytes(&digest).await.unwrap(), body);
        assert_eq!(reg.manifests.held_count(), 1, "the index's copy is held");
        // A manifest the store lacks is the store's error, and nothing is kept for it.
        let missing = Digest::of(Algorithm::Sha256, b"not pushed");
        let err = reg.manifest_bytes(&missing).await.unwrap_err();
        assert!(
            matches!(err, RecordError::Store(StoreError::NotFound(_))),
            "{err}"
        );
        assert_eq!(
            reg.manifests.held_count(),
            1,
            "only the manifest read is held"
        );
        assert_eq!(reg.index.manifest_bytes(&missing).unwrap(), None);
        // A pushed manifest is served without the store, from memory or the index.
        let pushed = Bytes::from_static(br#"{"schemaVersion":2,"pushed":1}"#);
        let pushed_digest = Digest::of(Algorithm::Sha256, &pushed);
        reg.manifest_pushed(&pushed_digest, &pushed).unwrap();
        assert_eq!(reg.manifest_bytes(&pushed_digest).await.unwrap(), pushed);
        reg.manifests = ManifestCache::new(1 << 20);
        assert_eq!(reg.manifest_bytes(&pushed_digest).await.unwrap(), pushed);
    }

    /// A budget of 0 keeps no copies, in memory or in the index: every read is the
    /// store's (a test that tampers with a stored manifest sees its tampering).
    #[tokio::test]
    async fn a_cache_of_zero_bytes_keeps_no_copies_and_reads_the_store() {
        let body = Bytes::from_static(br#"{"schemaVersion":2,"off":1}"#);
        let digest = Digest::of(Algorithm::Sha256, &body);
        let (_dir, reg) = stored(0, &digest, &body).await;
        reg.manifest_pushed(&digest, &body).unwrap();
        assert_eq!(reg.manifest_bytes(&digest).await.unwrap(), body);
        assert_eq!(reg.index.manifest_bytes(&digest).unwrap(), None);
        assert_eq!(reg.manifests.held_count(), 0);
        reg.store.remove(&ObjectKey::blob(&digest)).await.unwrap();
        let err = reg.manifest_bytes(&digest).await.unwrap_err();
        assert!(
            matches!(err, RecordError::Store(StoreError::NotFound(_))),
            "{err}"
        );
    }

    /// Bytes in the store that are not the manifest its digest names are served as
    /// stored but never kept as the manifest's.
    #[tokio::test]
    async fn a_stored_object_that_does_not_match_its_digest_is_not_kept() {
        let digest = Digest::of(Algorithm::Sha256, b"the real manifest");
        let wrong = Bytes::from_static(b"something else");
        let (_dir, reg) = stored(1 << 20, &digest, &wrong).await;
        assert_eq!(reg.manifest_bytes(&digest).await.unwrap(), wrong);
        assert_eq!(reg.manifests.held_count(), 0);
        assert_eq!(reg.index.manifest_bytes(&digest).unwrap(), None);
    }
}
