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
use crate::store::{self, RecordKey};
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

/// Records read at once: a reindex from a bucket is bound by request latency, not by
/// the index.
const PARALLEL_READS: usize = 64;

/// Levels of the store's tree listed at once (one listing per repository and kind of
/// record, per chunk fan-out directory): a flat listing of millions of keys would be
/// thousands of requests one after another.
const PARALLEL_LISTINGS: usize = 32;

/// Listed levels waiting to be read: bounds the memory of a reindex, however many records
/// the bucket holds.
const LISTED_AHEAD: usize = 64;

/// What one record added to the index.
enum Filled {
    Blob,
    Manifest,
    Tag(RepoName, Tag),
    Nothing,
}

async fn fill_one(reg: &Registry, key: RecordKey) -> anyhow::Result<Filled> {
    let Some(entry) = parse(&key) else {
        tracing::warn!(key = key.as_str(), "skipping a record that names nothing");
        return Ok(Filled::Nothing);
    };
    Ok(match entry {
        Entry::Blob(repo, digest) => {
            // A blob's size is its content's: once one repository's record gave it, the
            // others' (a shared base layer's, in thousands of repositories) need no read.
            if let Some(size) = reg.index.blob_size(&digest)? {
                reg.index.put_blob(&repo, &digest, size)?;
                return Ok(Filled::Blob);
            }
            match reg.repo_blob(&repo, &digest).await? {
                Some(_) => Filled::Blob,
                None => Filled::Nothing,
            }
        }
        Entry::Manifest(repo, digest) => {
            let (v, _) = reg
                .store
                .get_record(&key)
                .await?
                .with_context(|| format!("record {} vanished", key.as_str()))?;
            let link: ManifestLink =
                serde_json::from_slice(&v).with_context(|| format!("record {}", key.as_str()))?;
            reg.cache_manifest(&repo, &digest, &link)?;
            Filled::Manifest
        }
        Entry::Tag(repo, tag) => Filled::Tag(repo, tag),
        Entry::Referrer => Filled::Nothing,
    })
}

/// Walks `root` in the store ([`store::walk`], skipping prefixes `descend` refuses) while
/// `read` reads what it found, `PARALLEL_READS` at a time, folding the results into
/// `init` with `fold`; the walk runs ahead of the reads by at most `LISTED_AHEAD` levels.
async fn walk_and_read<T, A, F, Fut>(
    reg: &Registry,
    root: &str,
    descend: impl Fn(&str) -> bool,
    read: F,
    init: A,
    mut fold: impl FnMut(A, T) -> A,
) -> anyhow::Result<A>
where
    F: Fn((String, u64)) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<T>>,
{
    use futures_util::{StreamExt, TryStreamExt};
    let (tx, rx) = tokio::sync::mpsc::channel(LISTED_AHEAD);
    let walk = store::walk(&*reg.store, root, descend, PARALLEL_LISTINGS, tx);
    let levels = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|level| (level, rx))
    });
    let reads = async {
        let mut read = std::pin::pin!(levels
            .flat_map(futures_util::stream::iter)
            .map(read)
            .buffer_unordered(PARALLEL_READS));
        let mut acc = init;
        while let Some(t) = read.try_next().await? {
            acc = fold(acc, t);
        }
        Ok::<_, anyhow::Error>(acc)
    };
    let (walked, read) = futures_util::join!(walk, reads);
    // A failed read drops the receiver, which ends the walk: report the read's error.
    let read = read?;
    walked.with_context(|| format!("listing {root} in the store"))?;
    Ok(read)
}

async fn fill(reg: &Registry) -> anyhow::Result<Summary> {
    use futures_util::{StreamExt, TryStreamExt};
    // Referrer records say what the manifest records say already.
    let (mut s, tags) = walk_and_read(
        reg,
        "_records/repos/",
        |p| !p.ends_with("/_referrers/"),
        |(key, _)| async move {
            match RecordKey::parse(&key) {
                Some(key) => fill_one(reg, key).await,
                None => Ok(Filled::Nothing),
            }
        },
        (Summary::default(), Vec::new()),
        |(mut s, mut tags), f| {
            match f {
                Filled::Blob => s.blobs += 1,
                Filled::Manifest => s.manifests += 1,
                Filled::Tag(repo, tag) => tags.push((repo, tag)),
                Filled::Nothing => {}
            }
            (s, tags)
        },
    )
    .await?;
    // Tags last: their manifests are in the index by now.
    let mut pointed = futures_util::stream::iter(tags)
        .map(|(repo, tag)| async move {
            let digest = reg.tag(&repo, &tag).await?;
            Ok::<_, anyhow::Error>(digest.map(|d| (repo, tag, d)))
        })
        .buffer_unordered(PARALLEL_READS);
    while let Some(found) = pointed.try_next().await? {
        let Some((repo, tag, digest)) = found else {
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
    let count = |n: usize, found: bool| n + usize::from(found);
    walk_and_read(
        reg,
        RecordKey::CATALOG,
        |_| true,
        |(key, _)| async move {
            if let Some(repo) = RecordKey::parse(&key).and_then(|k| k.catalog_repo()) {
                reg.index.put_repo(&repo)?;
            }
            Ok(())
        },
        (),
        |(), ()| (),
    )
    .await?;
    s.conversions = walk_and_read(
        reg,
        "_records/conversions/",
        |_| true,
        |(key, _)| async move {
            let image = key
                .strip_prefix("_records/conversions/")
                .and_then(|d| d.parse::<Digest>().ok());
            Ok(match image {
                Some(image) => reg.conversion(&image).await?.is_some(),
                None => false,
            })
        },
        0,
        count,
    )
    .await?;
    // Sizes from the listing itself: no request per chunk.
    s.chunks = walk_and_read(
        reg,
        "chunks/",
        |_| true,
        |(key, size)| async move {
            let id = key.rsplit('/').next().unwrap_or("");
            reg.index.put_chunk(&format!("blake3:{id}"), size, false)?;
            Ok(true)
        },
        0,
        count,
    )
    .await?;
    Ok(s)
}
