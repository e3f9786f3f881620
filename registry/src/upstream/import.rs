//! One import run (`POST /amber/v1/imports`) and pull-through of one reference: read an
//! image's manifests from its upstream, fetch the blobs the store lacks, then make the
//! image visible through the repository layer (`repository::store_manifest`), which
//! checks, links, tags and queues conversion exactly as for a push.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use amber_api::registry::{ImageSource, ImportEvent, ImportRequest};
use amber_oci::digest::Digest;
use amber_oci::manifest::{parse_manifest, ManifestKind, ParsedManifest};
use amber_oci::media::{non_distributable, OCI_INDEX, OCI_MANIFEST};
use amber_oci::names::{Reference, RepoName, Tag};
use amber_oci::reference::ImageRef;
use bytes::Bytes;
use futures_util::{StreamExt, TryStreamExt};
use tokio::sync::mpsc::UnboundedSender;

use super::{CredentialsError, UpstreamClient, UpstreamError, UpstreamSpec};
use crate::clock::now_unix;
use crate::records::RecordError;
use crate::registry::Registry;
use crate::repository::{store_manifest, PushError};
use crate::store::{ObjectKey, StoreError};

/// Blobs of one image fetched at once.
const BLOBS_AT_ONCE: usize = 4;
/// Progress is reported after at least this many more bytes.
const PROGRESS_STEP: u64 = 1 << 20;

#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    #[error("{source_ref:?} is not an image reference amber can import: {why}")]
    BadSource { source_ref: String, why: String },
    #[error(transparent)]
    Upstream(#[from] UpstreamError),
    #[error("{what} is {size} bytes, more than this registry takes ({limit}: {setting})")]
    TooLarge {
        what: String,
        size: u64,
        limit: u64,
        setting: &'static str,
    },
    #[error("manifest {digest} from {host}: {why}")]
    Manifest {
        host: String,
        digest: Digest,
        why: String,
    },
    #[error("the upstream's manifest was refused: {0}")]
    Push(#[from] PushError),
    #[error(transparent)]
    Record(#[from] RecordError),
    #[error("storing a fetched blob: {0}")]
    Store(#[from] StoreError),
    #[error(transparent)]
    Credentials(#[from] CredentialsError),
}

/// How an import run behaves.
#[derive(Clone, Copy, Debug)]
pub struct ImportOptions {
    /// Every platform of an index, or only linux/amd64 (stored under the tag).
    pub all_platforms: bool,
    /// Images at once.
    pub jobs: usize,
}

/// One image to import: where from, and where it goes.
struct Item {
    spec: UpstreamSpec,
    /// The repository on the upstream (`library/python`).
    upstream_repo: String,
    reference: Reference,
    /// The full reference as the source record keeps it.
    display: String,
    target: RepoName,
}

/// What importing one image did.
#[derive(Default)]
struct Stats {
    blobs_fetched: usize,
    blobs_present: usize,
    bytes_fetched: u64,
}

/// Sends progress events (an import's answer; nothing when nobody listens).
#[derive(Clone)]
struct Progress {
    events: Option<UnboundedSender<ImportEvent>>,
    unreported: Arc<AtomicU64>,
}

impl Progress {
    fn send(&self, e: ImportEvent) {
        if let Some(tx) = &self.events {
            let _ = tx.send(e);
        }
    }

    fn fetched(&self, n: u64) {
        let before = self.unreported.fetch_add(n, Ordering::Relaxed);
        if before + n >= PROGRESS_STEP {
            let bytes = self.unreported.swap(0, Ordering::Relaxed);
            if bytes > 0 {
                self.send(ImportEvent::Fetched { bytes });
            }
        }
    }
}

/// Runs `request`, sending its events to `events`; the last is a summary.
pub async fn import(
    reg: &Arc<Registry>,
    request: ImportRequest,
    events: UnboundedSender<ImportEvent>,
) {
    let progress = Progress {
        events: Some(events),
        unreported: Arc::new(AtomicU64::new(0)),
    };
    let opts = ImportOptions {
        all_platforms: request.all_platforms,
        jobs: request.jobs.unwrap_or(4).clamp(1, 64),
    };
    let mut credentials = match reg.upstreams.credentials() {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(error = %e, "upstream credentials file not used");
            BTreeMap::new()
        }
    };
    credentials.extend(request.credentials);
    let mut clients: HashMap<String, Arc<UpstreamClient>> = HashMap::new();
    let mut client_of = |host: &str| {
        clients
            .entry(host.to_string())
            .or_insert_with(|| {
                Arc::new(UpstreamClient::new(
                    reg.upstreams.spec(host),
                    credentials.get(host),
                ))
            })
            .clone()
    };
    let (mut items, mut failed) = (Vec::new(), 0usize);
    for source in &request.sources {
        match expand(reg, source, &mut client_of).await {
            Ok(mut found) => items.append(&mut found),
            Err(e) => {
                failed += 1;
                progress.send(ImportEvent::Finished {
                    source: source.clone(),
                    target: String::new(),
                    manifest_digest: None,
                    blobs_fetched: 0,
                    blobs_present: 0,
                    bytes_fetched: 0,
                    error: Some(e.to_string()),
                });
            }
        }
    }
    progress.send(ImportEvent::Planned {
        images: items.len(),
    });
    let mut total = Stats::default();
    let mut imported = 0usize;
    let mut runs = futures_util::stream::iter(items.into_iter().map(|item| {
        let client = client_of(&item.spec.host);
        let progress = progress.clone();
        async move {
            let mut stats = Stats::default();
            let r = import_image(reg, &client, &item, opts, &progress, &mut stats).await;
            (item, r, stats)
        }
    }))
    .buffer_unordered(opts.jobs);
    while let Some((item, r, stats)) = runs.next().await {
        match &r {
            Ok(d) => {
                imported += 1;
                tracing::info!(source = %item.display, target = %item.target, digest = %d, "image imported");
            }
            Err(e) => {
                failed += 1;
                tracing::warn!(source = %item.display, error = %e, "import failed");
            }
        }
        total.blobs_fetched += stats.blobs_fetched;
        total.blobs_present += stats.blobs_present;
        total.bytes_fetched += stats.bytes_fetched;
        progress.send(ImportEvent::Finished {
            source: item.display.clone(),
            target: item.target.to_string(),
            manifest_digest: r.as_ref().ok().cloned(),
            blobs_fetched: stats.blobs_fetched,
            blobs_present: stats.blobs_present,
            bytes_fetched: stats.bytes_fetched,
            error: r.err().map(|e| e.to_string()),
        });
    }
    let rest = progress.unreported.swap(0, Ordering::Relaxed);
    if rest > 0 {
        progress.send(ImportEvent::Fetched { bytes: rest });
    }
    progress.send(ImportEvent::Summary {
        images_imported: imported,
        images_failed: failed,
        blobs_fetched: total.blobs_fetched,
        blobs_present: total.blobs_present,
        bytes_fetched: total.bytes_fetched,
    });
}

/// The images `source` names: one, or every tag of a repository named without a tag.
async fn expand(
    reg: &Registry,
    source: &str,
    client_of: &mut impl FnMut(&str) -> Arc<UpstreamClient>,
) -> Result<Vec<Item>, ImportError> {
    let bad = |why: String| ImportError::BadSource {
        source_ref: source.to_string(),
        why,
    };
    let name = match ImageRef::parse(source.trim()).map_err(|e| bad(e.to_string()))? {
        ImageRef::Env(_) => return Err(bad("an env digest names no upstream image".into())),
        ImageRef::Image(n) => n,
    };
    let whole_repo = name.tag.is_none() && name.digest.is_none();
    let ImageRef::Image(name) = ImageRef::Image(name).docker_normalized() else {
        unreachable!("an image stays an image")
    };
    let host = name
        .registry
        .clone()
        .expect("normalized names have a registry");
    let target = name
        .mirror_repository()
        .ok_or_else(|| bad("its repository name is too long for amber".into()))?;
    let spec = reg.upstreams.spec(&host);
    let item = |reference: Reference| Item {
        spec: spec.clone(),
        upstream_repo: name.repository.to_string(),
        display: full_reference(&host, name.repository.as_str(), &reference),
        reference,
        target: target.clone(),
    };
    if !whole_repo {
        return Ok(vec![item(name.reference())]);
    }
    let client = client_of(&host);
    let tags = client.tags(name.repository.as_str()).await?;
    tags.iter()
        .map(|t| {
            Tag::parse(t)
                .map(|t| item(Reference::Tag(t)))
                .map_err(|e| bad(format!("the upstream lists tag {t:?}: {e}")))
        })
        .collect()
}

/// Pulls `reference` of `repo` through from its upstream if `repo` is a mirror of one;
/// `Ok(false)` when it is not. Concurrent requests for the same image import it once.
pub async fn pull_through(
    reg: &Arc<Registry>,
    repo: &RepoName,
    reference: &Reference,
) -> Result<bool, ImportError> {
    let Some((spec, upstream_repo)) = reg.upstreams.for_repo(repo) else {
        return Ok(false);
    };
    let key = format!("{repo}:{reference}");
    let lock = reg.upstreams.lock(&key);
    let guard = lock.lock().await;
    let present = match reference {
        Reference::Tag(t) => reg.tag(repo, t).await?.is_some(),
        Reference::Digest(d) => reg.manifest(repo, d).await?.is_some(),
    };
    let result = if present {
        Ok(())
    } else {
        let credentials = reg.upstreams.credentials()?;
        let client = UpstreamClient::new(spec.clone(), credentials.get(&spec.host));
        let item = Item {
            display: full_reference(&spec.host, &upstream_repo, reference),
            spec: spec.clone(),
            upstream_repo,
            reference: reference.clone(),
            target: repo.clone(),
        };
        // A digest may name an index: keep all of it. A tag names what linux/amd64 runs.
        let opts = ImportOptions {
            all_platforms: matches!(reference, Reference::Digest(_)),
            jobs: 1,
        };
        let progress = Progress {
            events: None,
            unreported: Arc::new(AtomicU64::new(0)),
        };
        let mut stats = Stats::default();
        import_image(reg, &client, &item, opts, &progress, &mut stats)
            .await
            .map(|d| {
                tracing::info!(source = %item.display, %repo, digest = %d, bytes = stats.bytes_fetched, "pulled through");
            })
    };
    drop(guard);
    drop(lock);
    reg.upstreams.release(&key);
    result.map(|()| true)
}

/// A manifest read from the upstream, checked and parsed.
struct Fetched {
    digest: Digest,
    bytes: Bytes,
    media_type: String,
    parsed: ParsedManifest,
}

/// The media type of manifest `bytes`: its `mediaType` field, else the descriptor's
/// (`hint`), else what its shape says (OCI lets both omit it).
fn media_type_of(bytes: &[u8], hint: Option<&str>) -> String {
    let v: serde_json::Value = serde_json::from_slice(bytes).unwrap_or_default();
    if let Some(m) = v.get("mediaType").and_then(|m| m.as_str()) {
        return m.to_string();
    }
    if let Some(h) = hint {
        return h.to_string();
    }
    if v.get("manifests").is_some() {
        OCI_INDEX.into()
    } else {
        OCI_MANIFEST.into()
    }
}

async fn fetch_manifest(
    reg: &Registry,
    client: &UpstreamClient,
    repo: &str,
    reference: &Reference,
    hint: Option<&str>,
) -> Result<Fetched, ImportError> {
    let (bytes, digest) = client.manifest(repo, reference).await?;
    let limit = reg.config.max_manifest_bytes;
    if bytes.len() > limit {
        return Err(ImportError::TooLarge {
            what: format!("manifest {repo}:{reference}"),
            size: bytes.len() as u64,
            limit: limit as u64,
            setting: "max_manifest_bytes",
        });
    }
    let media_type = media_type_of(&bytes, hint);
    let parsed = parse_manifest(&bytes, Some(&media_type)).map_err(|e| ImportError::Manifest {
        host: client.host().to_string(),
        digest: digest.clone(),
        why: e.to_string(),
    })?;
    Ok(Fetched {
        digest,
        bytes,
        media_type,
        parsed,
    })
}

/// The manifest an index lists as `child`.
async fn fetch_child(
    reg: &Registry,
    client: &UpstreamClient,
    repo: &str,
    child: &amber_oci::manifest::Descriptor,
) -> Result<Fetched, ImportError> {
    let r = Reference::Digest(child.digest.clone());
    fetch_manifest(reg, client, repo, &r, Some(&child.media_type)).await
}

/// `host/repo:tag` or `host/repo@digest`: how a source record names an upstream image.
fn full_reference(host: &str, repo: &str, reference: &Reference) -> String {
    match reference {
        Reference::Tag(t) => format!("{host}/{repo}:{t}"),
        Reference::Digest(d) => format!("{host}/{repo}@{d}"),
    }
}

/// Imports one image; returns the digest of the manifest its reference now names here.
async fn import_image(
    reg: &Arc<Registry>,
    client: &UpstreamClient,
    item: &Item,
    opts: ImportOptions,
    progress: &Progress,
    stats: &mut Stats,
) -> Result<Digest, ImportError> {
    let repo = item.upstream_repo.as_str();
    let top = fetch_manifest(reg, client, repo, &item.reference, None).await?;
    // Children first, then the manifest the reference names.
    let mut manifests = Vec::new();
    match top.parsed.kind {
        ManifestKind::Index if opts.all_platforms => {
            for child in &top.parsed.children {
                let m = fetch_child(reg, client, repo, child).await?;
                if m.parsed.kind == ManifestKind::Index {
                    return Err(ImportError::Manifest {
                        host: client.host().into(),
                        digest: top.digest.clone(),
                        why: format!(
                            "it lists index {}: nested indexes are not imported",
                            m.digest
                        ),
                    });
                }
                manifests.push(m);
            }
            manifests.push(top);
        }
        ManifestKind::Index => {
            let child = top.parsed.linux_amd64().ok_or_else(|| ImportError::Manifest {
                host: client.host().into(),
                digest: top.digest.clone(),
                why: "the index has no linux/amd64 image (import every platform with --all-platforms)".into(),
            })?;
            manifests.push(fetch_child(reg, client, repo, child).await?);
        }
        ManifestKind::Image => manifests.push(top),
    }
    let mut blobs: BTreeMap<Digest, u64> = BTreeMap::new();
    for m in &manifests {
        for b in &m.parsed.blobs {
            if !b.has_urls && !non_distributable(&b.media_type) {
                blobs.insert(b.digest.clone(), b.size);
            }
        }
    }
    let mut missing = Vec::new();
    let mut need_bytes = 0;
    for (d, &size) in &blobs {
        if size > reg.config.max_blob_bytes {
            return Err(ImportError::TooLarge {
                what: format!("blob {d}"),
                size,
                limit: reg.config.max_blob_bytes,
                setting: "max_blob_bytes",
            });
        }
        let held = match reg.repo_blob(&item.target, d).await? {
            Some(s) => Some(s),
            None => crate::recipe::stored_size(reg.store.as_ref(), &ObjectKey::blob(d)).await?,
        };
        if held.is_none() {
            missing.push((d.clone(), size));
            need_bytes += size;
        }
    }
    stats.blobs_present = blobs.len() - missing.len();
    progress.send(ImportEvent::Started {
        source: item.display.clone(),
        target: item.target.to_string(),
        blobs: missing.len(),
        bytes: need_bytes,
    });
    // Collected first: a lazy map of borrowed futures trips the compiler's lifetime
    // inference once the whole import is spawned.
    let fetches: Vec<_> = missing
        .iter()
        .map(|(d, size)| fetch_blob(reg, client, repo, d, *size, progress))
        .collect();
    let fetched: Vec<bool> = futures_util::stream::iter(fetches)
        .buffered(BLOBS_AT_ONCE)
        .try_collect()
        .await?;
    for (was_fetched, (_, size)) in fetched.iter().zip(&missing) {
        if *was_fetched {
            stats.blobs_fetched += 1;
            stats.bytes_fetched += size;
        } else {
            stats.blobs_present += 1;
        }
    }
    // Everything is here: make the image visible.
    for (d, size) in &blobs {
        reg.link_blob(&item.target, d, *size).await?;
    }
    let now = now_unix();
    let last = manifests.len() - 1;
    let mut named = None;
    for (i, m) in manifests.into_iter().enumerate() {
        let reference = if i == last {
            match &item.reference {
                Reference::Tag(t) => Reference::Tag(t.clone()),
                Reference::Digest(_) => Reference::Digest(m.digest.clone()),
            }
        } else {
            Reference::Digest(m.digest.clone())
        };
        let source = ImageSource {
            reference: item.display.clone(),
            digest: m.digest.clone(),
            imported_unix: now,
        };
        let pushed = store_manifest(
            reg,
            &item.target,
            &reference,
            m.bytes,
            Some(&m.media_type),
            Some(source),
        )
        .await?;
        named = Some(pushed.digest);
    }
    Ok(named.expect("at least one manifest"))
}

/// Fetches blob `digest` into the store unless it is there by now; `Ok(false)` when it
/// was. Published only after its bytes hash to `digest` and number `size`.
async fn fetch_blob(
    reg: &Registry,
    client: &UpstreamClient,
    repo: &str,
    digest: &Digest,
    size: u64,
    progress: &Progress,
) -> Result<bool, ImportError> {
    let key = ObjectKey::blob(digest);
    let lock_key = format!("blob {digest}");
    let lock = reg.upstreams.lock(&lock_key);
    let result = async {
        let _guard = lock.lock().await;
        if crate::recipe::stored_size(reg.store.as_ref(), &key)
            .await?
            .is_some()
        {
            return Ok(false);
        }
        let stream = client.blob(repo, digest).await?;
        let mut seen = 0u64;
        let limited: crate::store::ByteStream = Box::pin(stream.map(move |r| {
            let b = r?;
            seen += b.len() as u64;
            if seen > size {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("the upstream sent more than the {size} bytes the manifest gives"),
                ));
            }
            Ok(b)
        }));
        let id = uuid::Uuid::new_v4().to_string();
        let mut hasher = digest.algorithm().hasher();
        let written = reg
            .store
            .append_staged(&id, 0, limited, Some(size), &mut |chunk: &[u8]| {
                hasher.update(chunk);
                progress.fetched(chunk.len() as u64);
            })
            .await;
        let integrity = |actual: String| {
            ImportError::Upstream(UpstreamError::Integrity {
                host: client.host().into(),
                what: format!("blob {digest} of {repo}"),
                expected: digest.to_string(),
                actual,
            })
        };
        let (len, segments) = match written {
            Ok(a) => (a.len, Vec::from_iter(a.segment)),
            Err(e) => {
                let _ = reg.store.remove_staged(&id, &[]).await;
                return Err(match e {
                    StoreError::Body(io) if io.kind() == std::io::ErrorKind::InvalidData => {
                        ImportError::Upstream(UpstreamError::Corrupt {
                            host: client.host().into(),
                            what: format!("blob {digest} of {repo}"),
                            why: io.to_string(),
                        })
                    }
                    StoreError::Body(io) => ImportError::Upstream(UpstreamError::Failed {
                        host: client.host().into(),
                        what: format!("blob {digest} of {repo}"),
                        why: io.to_string(),
                    }),
                    other => other.into(),
                });
            }
        };
        let actual = hasher.finish();
        if &actual != digest || len != size {
            let _ = reg.store.remove_staged(&id, &segments).await;
            return Err(integrity(format!(
                "{actual} ({len} bytes, {size} expected)"
            )));
        }
        reg.store.publish_staged(&id, &segments, len, &key).await?;
        Ok(true)
    }
    .await;
    drop(lock);
    reg.upstreams.release(&lock_key);
    result
}
