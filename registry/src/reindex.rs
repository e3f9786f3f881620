//! `amber-registry reindex`: rebuilds the RocksDB index from the object store alone (its
//! records and chunk objects), for a new replica or after losing an index. The new index
//! is built beside the old one and swapped in only when complete; the old one is kept as
//! `index.before-reindex-<unix time>`.

use std::sync::Arc;

use anyhow::Context;

use crate::clock::now_unix;
use crate::config::Config;
use crate::index::Index;
use crate::records::ManifestLink;
use crate::registry::Registry;
use crate::store::RecordKey;
use amber_oci::digest::Digest;
use amber_oci::names::{RepoName, Tag};

/// What a reindex found.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Summary {
    pub manifests: usize,
    pub blobs: usize,
    pub tags: usize,
    pub conversions: usize,
    pub chunks: usize,
}

/// One repository record, parsed from its key.
enum Entry {
    Manifest(RepoName, Digest),
    Blob(RepoName, Digest),
    Tag(RepoName, Tag),
    /// Referrer records; the manifest records carry the same.
    Referrer,
}

fn parse(key: &RecordKey) -> Option<Entry> {
    let rest = key.as_str().strip_prefix("_records/repos/")?;
    if rest.contains("/_referrers/") {
        return Some(Entry::Referrer);
    }
    for (kind, sep) in [(0, "/_manifests/"), (1, "/_blobs/"), (2, "/_tags/")] {
        if let Some((repo, last)) = rest.split_once(sep) {
            let repo = RepoName::parse(repo).ok()?;
            return match kind {
                0 => Some(Entry::Manifest(repo, last.parse().ok()?)),
                1 => Some(Entry::Blob(repo, last.parse().ok()?)),
                _ => Some(Entry::Tag(repo, Tag::parse(last).ok()?)),
            };
        }
    }
    None
}

/// Rebuilds `config.data/index` from the store.
pub async fn reindex(config: Config) -> anyhow::Result<Summary> {
    std::fs::create_dir_all(&config.data)
        .with_context(|| format!("creating data directory {}", config.data.display()))?;
    let index_dir = config.data.join("index");
    let stamp = now_unix();
    let fresh = config.data.join(format!("index.reindex-{stamp}"));
    let store = crate::registry::open_store(&config).await?;
    let index =
        Index::open(&fresh).with_context(|| format!("creating index at {}", fresh.display()))?;
    let reg = Arc::new(Registry::new(config.clone(), index, store));
    let summary = fill(&reg).await;
    drop(reg);
    let summary = match summary {
        Ok(s) => s,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&fresh);
            return Err(e);
        }
    };
    if index_dir.exists() {
        let old = config.data.join(format!("index.before-reindex-{stamp}"));
        std::fs::rename(&index_dir, &old)
            .with_context(|| format!("moving the old index to {}", old.display()))?;
    }
    std::fs::rename(&fresh, &index_dir)
        .with_context(|| format!("moving the new index to {}", index_dir.display()))?;
    Ok(summary)
}

async fn fill(reg: &Registry) -> anyhow::Result<Summary> {
    let mut s = Summary::default();
    let mut tags = Vec::new();
    for key in reg.store.list_records("_records/repos/").await? {
        let Some(entry) = parse(&key) else {
            tracing::warn!(key = key.as_str(), "skipping a record that names nothing");
            continue;
        };
        match entry {
            Entry::Blob(repo, digest) => {
                if reg.repo_blob(&repo, &digest).await?.is_some() {
                    s.blobs += 1;
                }
            }
            Entry::Manifest(repo, digest) => {
                let (v, _) = reg
                    .store
                    .get_record(&key)
                    .await?
                    .with_context(|| format!("record {} vanished", key.as_str()))?;
                let link: ManifestLink = serde_json::from_slice(&v)
                    .with_context(|| format!("record {}", key.as_str()))?;
                reg.cache_manifest(&repo, &digest, &link)?;
                s.manifests += 1;
            }
            Entry::Tag(repo, tag) => tags.push((repo, tag)),
            Entry::Referrer => {}
        }
    }
    // Tags last: their manifests are in the index by now.
    for (repo, tag) in tags {
        let Some(digest) = reg.tag(&repo, &tag).await? else {
            continue;
        };
        let record = reg
            .index
            .manifest(&repo, &digest)?
            .with_context(|| format!("tag {repo}:{} points at unknown {digest}", tag.as_str()))?;
        reg.index.put_manifest(crate::index::ManifestWrite {
            repo: &repo,
            digest: &digest,
            record,
            tag: Some(&tag),
            tag_immutable: false,
            referrer: None,
        })?;
        s.tags += 1;
    }
    for key in reg.store.list_records(RecordKey::CATALOG).await? {
        if let Some(repo) = key.catalog_repo() {
            reg.index.put_repo(&repo)?;
        }
    }
    for key in reg.store.list_records("_records/conversions/").await? {
        let Some(image) = key
            .as_str()
            .strip_prefix("_records/conversions/")
            .and_then(|d| d.parse::<Digest>().ok())
        else {
            continue;
        };
        if reg.conversion(&image).await?.is_some() {
            s.conversions += 1;
        }
    }
    for key in reg.store.list("chunks/").await? {
        let id = key.as_str().rsplit('/').next().unwrap_or("");
        if let Some(size) = reg.store.stat(&key).await? {
            reg.index.put_chunk(&format!("blake3:{id}"), size)?;
            s.chunks += 1;
        }
    }
    Ok(s)
}
