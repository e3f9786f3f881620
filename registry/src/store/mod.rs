//! The object store: where blob and manifest bytes live. One small trait, several
//! backends behind it (`fs`: local disk; `s3`: AWS S3 or an S3-compatible server), and
//! one shared test suite (`suite`) that every backend must pass.
//!
//! Two namespaces:
//! - published objects, named by an [`ObjectKey`] derived from a content digest. They are
//!   create-once and immutable: there is no overwrite, and the one removal is of a layer
//!   blob whose verified recipe (`crate::recipe`) is published first, so the blob's
//!   bytes stay readable throughout. A published object is always complete, because it
//!   is only ever made visible by an atomic publish of a fully written, durable staged
//!   object.
//! - staged objects (upload sessions), named by a session id. They are appended to,
//!   one [`Segment`] per append, and either published under a key or removed. The caller
//!   keeps the list of acknowledged segments (in the session's record) and names them to
//!   every read and publish: what a backend holds past them is from requests that were
//!   never acknowledged, and is never read.
//! - records: small named values describing repositories (which manifests and blobs
//!   each holds, where each tag points, how each image converted). They are the durable
//!   truth that the RocksDB index caches, so every replica over one bucket sees the same
//!   repositories and `reindex` can rebuild an index from the store alone. A record is
//!   written with compare-and-swap on its [`Version`]: create-only, or replace-if-unchanged.
//!   Records of work in progress (upload sessions, conversion work items) are removed
//!   when the work ends; every other record is never removed.

pub mod fs;
pub mod fs_records;
pub mod s3;
#[cfg(test)]
pub(crate) mod suite;

use std::io;
use std::ops::Range;
use std::pin::Pin;

use async_trait::async_trait;
use bytes::Bytes;
use futures_util::Stream;

use amber_oci::digest::Digest;

/// A stream of bytes read from, or written to, a store.
pub type ByteStream = Pin<Box<dyn Stream<Item = io::Result<Bytes>> + Send>>;

/// The name of a published object. Only built from validated parts, so a key never holds
/// `..`, a leading `/`, or anything else that could escape a backend's namespace.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ObjectKey(String);

impl ObjectKey {
    /// The key of the content-addressed blob (layer, config or manifest) with `digest`.
    pub fn blob(digest: &Digest) -> ObjectKey {
        ObjectKey::by_digest("blobs", digest)
    }

    /// `top/<algorithm>/<2 hex>/<hex>`.
    fn by_digest(top: &str, digest: &Digest) -> ObjectKey {
        let hex = digest.hex();
        ObjectKey(format!(
            "{top}/{}/{}/{hex}",
            digest.algorithm().name(),
            &hex[..2]
        ))
    }

    /// The key of a chunk (zstd bytes) named by the blake3 of its uncompressed bytes.
    pub fn chunk(id: &amber_converter::manifest::ChunkId) -> ObjectKey {
        let hex = id.hex();
        ObjectKey(format!("chunks/blake3/{}/{hex}", &hex[..2]))
    }

    /// The key of a block manifest envelope, named by its env digest.
    pub fn env(env: &amber_converter::manifest::EnvDigest) -> ObjectKey {
        let hex = env.hex();
        ObjectKey(format!("envs/blake3/{}/{hex}", &hex[..2]))
    }

    /// The key of a layer blob's recipe (`crate::recipe`): how to rebuild the blob
    /// with `digest` from chunks, kept instead of the blob itself.
    pub fn recipe(digest: &Digest) -> ObjectKey {
        ObjectKey::by_digest("recipes", digest)
    }

    /// The key of a kept layer-chain state (`amber_converter::chain`), named by its
    /// chain key. Derived data: a missing or damaged one only costs a full conversion.
    pub fn chain(key: &amber_converter::chain::ChainKey) -> ObjectKey {
        let hex = key.hex();
        ObjectKey(format!("chains/blake3/{}/{hex}", &hex[..2]))
    }

    /// The env digest a conversion of exactly this chain of layers gave (so the same
    /// layers under another config or tag are not converted again).
    pub fn chain_env(key: &amber_converter::chain::ChainKey) -> ObjectKey {
        let hex = key.hex();
        ObjectKey(format!("chains/blake3/{}/{hex}.env", &hex[..2]))
    }

    /// Marks a chain of layers that a conversion has seen: a state is kept only for a
    /// chain seen before, so images with layers of their own cost no state.
    pub fn chain_seen(key: &amber_converter::chain::ChainKey) -> ObjectKey {
        let hex = key.hex();
        ObjectKey(format!("chains/blake3/{}/{hex}.seen", &hex[..2]))
    }

    /// The digest of the blob this key names, `None` for any other object.
    pub fn blob_digest(&self) -> Option<Digest> {
        self.digest_under("blobs", ObjectKey::blob)
    }

    /// The digest of the blob whose recipe this key names, `None` for any other object.
    pub fn recipe_digest(&self) -> Option<Digest> {
        self.digest_under("recipes", ObjectKey::recipe)
    }

    /// `top/<algorithm>/<xx>/<hex>` as a digest, if `make` gives this key back from it.
    fn digest_under(&self, top: &str, make: fn(&Digest) -> ObjectKey) -> Option<Digest> {
        match self.0.split('/').collect::<Vec<_>>().as_slice() {
            [t, alg, _, hex] if *t == top => format!("{alg}:{hex}")
                .parse()
                .ok()
                .filter(|d| &make(d) == self),
            _ => None,
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// The name of a record. Only built from validated repository names, digests and tags.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RecordKey(String);

impl RecordKey {
    /// Repository `repo` holds manifest `digest`.
    pub fn manifest(repo: &amber_oci::names::RepoName, digest: &Digest) -> RecordKey {
        RecordKey(format!("_records/repos/{repo}/_manifests/{digest}"))
    }

    /// Repository `repo` holds blob `digest`.
    pub fn blob(repo: &amber_oci::names::RepoName, digest: &Digest) -> RecordKey {
        RecordKey(format!("_records/repos/{repo}/_blobs/{digest}"))
    }

    /// Tag `tag` of `repo` (a mutable pointer to a manifest digest).
    pub fn tag(repo: &amber_oci::names::RepoName, tag: &amber_oci::names::Tag) -> RecordKey {
        RecordKey(format!("_records/repos/{repo}/_tags/{}", tag.as_str()))
    }

    /// Repository `repo` exists (for the catalog).
    /// The catalog record of `repo`: its name and [`CATALOG_MARK`](Self::CATALOG_MARK).
    pub fn repo(repo: &amber_oci::names::RepoName) -> RecordKey {
        RecordKey(format!("{}{repo}{}", Self::CATALOG, Self::CATALOG_MARK))
    }

    /// The prefix of catalog records.
    pub const CATALOG: &'static str = "_records/catalog/";

    /// Ends a catalog record's key. One repository's name can be a directory of another's
    /// (`a/b` and `a/b/c`): on a file-backed store (fs, s3s-fs, MinIO) the record of
    /// `a/b` would be a file where `a/b/c` needs a directory. `!` is in no name and sorts
    /// before every character a name has, so records list in the order of the names.
    pub const CATALOG_MARK: &'static str = "!";

    /// The repository of a catalog record (written with or, before the mark, without
    /// [`CATALOG_MARK`]).
    pub fn catalog_repo(&self) -> Option<amber_oci::names::RepoName> {
        let name = self.0.strip_prefix(Self::CATALOG)?;
        amber_oci::names::RepoName::parse(name.strip_suffix(Self::CATALOG_MARK).unwrap_or(name))
            .ok()
    }

    /// Manifest `digest` of `repo` has subject `subject`.
    pub fn referrer(
        repo: &amber_oci::names::RepoName,
        subject: &Digest,
        digest: &Digest,
    ) -> RecordKey {
        RecordKey(format!(
            "_records/repos/{repo}/_referrers/{subject}/{digest}"
        ))
    }

    /// How image `image` converted (its outcome: done or failed).
    pub fn conversion(image: &Digest) -> RecordKey {
        RecordKey(format!("_records/conversions/{image}"))
    }

    /// The conversion of `image` waiting for or held by a replica (a work item with a
    /// lease; removed once the outcome is recorded).
    pub fn conversion_work(image: &Digest) -> RecordKey {
        RecordKey(format!("{}{image}", Self::CONVERSION_WORK))
    }

    /// The prefix of every conversion work item.
    pub const CONVERSION_WORK: &'static str = "_records/work/conversions/";

    /// Upload session `id` (`id` is a UUID the registry made).
    pub fn upload(id: &uuid::Uuid) -> RecordKey {
        RecordKey(format!("{}{id}", Self::UPLOADS))
    }

    /// The prefix of every upload session.
    pub const UPLOADS: &'static str = "_records/uploads/";

    /// The prefix of every record.
    pub const ALL: &'static str = "_records/";

    /// A key listed by [`ObjectStore::list_records`]; `None` if it is not a record name.
    pub fn parse(s: &str) -> Option<RecordKey> {
        let rest = s.strip_prefix(Self::ALL)?;
        (!rest
            .split('/')
            .any(|p| p.is_empty() || p == "." || p == ".."))
        .then(|| RecordKey(s.to_string()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// What follows a name given as `after` in a record listing of `prefix`: the catalog's
/// mark, so that "after `a/b`" starts after the record of `a/b` itself.
pub fn after_mark(prefix: &str) -> &'static str {
    if prefix == RecordKey::CATALOG {
        RecordKey::CATALOG_MARK
    } else {
        ""
    }
}

/// One level of the key tree ([`ObjectStore::list_level`]).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Level {
    /// Keys directly under the prefix, with their sizes.
    pub keys: Vec<(String, u64)>,
    /// Prefixes one level down, each ending in `/`.
    pub prefixes: Vec<String>,
}

/// Whether `prefix` names a part of the tree [`ObjectStore::list_level`] lists: ending in
/// `/`, no empty, `.` or `..` part, and records or published objects (not a first part
/// starting with `_` other than `_records`).
pub fn level_prefix_ok(prefix: &str) -> bool {
    let Some(body) = prefix.strip_suffix('/') else {
        return false;
    };
    let mut parts = body.split('/').peekable();
    let first = parts.peek().copied().unwrap_or("");
    (first == "_records" || !first.starts_with('_'))
        && parts.all(|p| !p.is_empty() && p != "." && p != "..")
}

/// Lists every key under `root` by walking its levels ([`ObjectStore::list_level`]),
/// `parallel` listings at a time, and sends each level's keys, as one batch, into `found`
/// (a bounded channel: memory stays bounded however many keys the tree holds). Prefixes
/// for which `descend` is false are not listed. Returns when the tree is walked, at the
/// first failed listing, or when `found`'s receiver is dropped (its reader failed).
pub async fn walk(
    store: &dyn ObjectStore,
    root: &str,
    descend: impl Fn(&str) -> bool,
    parallel: usize,
    found: tokio::sync::mpsc::Sender<Vec<(String, u64)>>,
) -> Result<(), StoreError> {
    use futures_util::stream::{FuturesUnordered, StreamExt};
    let mut pending = vec![root.to_string()];
    let mut listing = FuturesUnordered::new();
    loop {
        while listing.len() < parallel.max(1) {
            let Some(prefix) = pending.pop() else { break };
            listing.push(async move { store.list_level(&prefix).await });
        }
        let Some(level) = listing.next().await else {
            return Ok(());
        };
        let level = level?;
        pending.extend(level.prefixes.into_iter().filter(|p| descend(p)));
        if !level.keys.is_empty() && found.send(level.keys).await.is_err() {
            return Ok(());
        }
    }
}

/// One acknowledged append to a staged object: where its bytes start, and the backend's
/// name for them. A backend whose staged objects are shared (s3, several replicas) writes
/// every append under a name of its own, so two requests appending at one offset at once
/// never write the same object, and the caller's compare-and-swap of its list of segments
/// decides which of them is the upload's. A backend that appends to one file only this
/// process writes (fs) leaves the name empty. A segment ends where the next one starts,
/// the last one at the staged object's acknowledged length.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Segment {
    pub start: u64,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub name: String,
}

/// What [`ObjectStore::append_staged`] did: the staged object's new length, and the
/// segment it wrote (`None` for an empty append, which writes nothing).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Appended {
    pub len: u64,
    pub segment: Option<Segment>,
}

/// Upload data that no published blob names ([`ObjectStore::unlinked_uploads`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnlinkedUpload {
    /// The upload session id it was staged under.
    pub id: String,
    /// Where it is, as the backend names it (for a person to look at).
    pub key: String,
    pub bytes: u64,
}

/// The version of a record as its store sees it (an ETag, or a content hash); compared
/// only for equality.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Version(pub String);

/// Errors of a store backend, with the object they concern.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("object {0} not found")]
    NotFound(String),
    #[error("staged upload {id} has {actual} bytes, expected {expected}")]
    OffsetMismatch {
        id: String,
        expected: u64,
        actual: u64,
    },
    #[error("range {start}..{end} is outside object {key} of {size} bytes")]
    BadRange {
        key: String,
        start: u64,
        end: u64,
        size: u64,
    },
    /// The stream being written failed (for an upload: the client went away).
    #[error("the data being written ended early: {0}")]
    Body(#[source] io::Error),
    #[error("storage I/O on {what}: {source}")]
    Io {
        what: String,
        #[source]
        source: io::Error,
    },
}

impl StoreError {
    pub fn io(what: impl Into<String>, source: io::Error) -> StoreError {
        StoreError::Io {
            what: what.into(),
            source,
        }
    }
}

/// Observes every chunk of a staged write as it is stored (hashing, byte counters).
pub type Observer<'a> = &'a mut (dyn FnMut(&[u8]) + Send);

/// `body`, held to the `len` bytes its sender declared: a byte more, or an end before
/// `len`, is an error of the stream (and so `StoreError::Body` where it is written).
pub fn exactly(body: ByteStream, len: u64) -> ByteStream {
    Box::pin(Exactly {
        body,
        len,
        left: len,
        failed: false,
    })
}

struct Exactly {
    body: ByteStream,
    len: u64,
    left: u64,
    failed: bool,
}

impl Stream for Exactly {
    type Item = io::Result<Bytes>;

    fn poll_next(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        use std::task::Poll;
        if self.failed {
            return Poll::Ready(None);
        }
        let next = std::task::ready!(self.body.as_mut().poll_next(cx));
        let short = |s: &Self, kind, what: String| {
            Some(Err(io::Error::new(
                kind,
                format!("{what} than the {} bytes its sender declared", s.len),
            )))
        };
        Poll::Ready(match next {
            Some(Ok(b)) if b.len() as u64 > self.left => {
                self.failed = true;
                short(
                    &self,
                    io::ErrorKind::InvalidData,
                    "the body is longer".into(),
                )
            }
            Some(Ok(b)) => {
                self.left -= b.len() as u64;
                Some(Ok(b))
            }
            None if self.left > 0 => {
                self.failed = true;
                let got = self.len - self.left;
                short(
                    &self,
                    io::ErrorKind::UnexpectedEof,
                    format!("the body ended after {got} bytes, fewer"),
                )
            }
            other => other,
        })
    }
}

#[async_trait]
pub trait ObjectStore: Send + Sync + 'static {
    /// The size of a published object, or `None` when it does not exist.
    async fn stat(&self, key: &ObjectKey) -> Result<Option<u64>, StoreError>;

    /// Streams `range` of a published object. The range must lie inside the object.
    async fn read(&self, key: &ObjectKey, range: Range<u64>) -> Result<ByteStream, StoreError>;

    /// Reads a whole small published object (a manifest) into memory.
    async fn read_all(&self, key: &ObjectKey) -> Result<Bytes, StoreError>;

    /// Publishes `data` under `key` durably and atomically. If the key exists already the
    /// store is left unchanged: keys are content addresses, so the bytes are the same.
    async fn put(&self, key: &ObjectKey, data: Bytes) -> Result<(), StoreError>;

    /// Publishes `data` under `key` durably and atomically, replacing the bytes there if
    /// any: for another encoding of the same content (a chunk recompressed). A reader
    /// sees the old bytes or the new, whole, never a mix.
    async fn put_replacing(&self, key: &ObjectKey, data: Bytes) -> Result<(), StoreError>;

    /// `stat` for a caller on a thread that may block (a conversion): a backend whose
    /// work is blocking system calls (fs) does it on the calling thread instead of
    /// handing it to the runtime's blocking pool and waiting.
    fn stat_blocking(
        &self,
        handle: &tokio::runtime::Handle,
        key: &ObjectKey,
    ) -> Result<Option<u64>, StoreError> {
        handle.block_on(self.stat(key))
    }

    /// `put` for a caller on a thread that may block, as `stat_blocking`. A conversion
    /// stores tens of thousands of chunks: through the pool, each fs put was six hand-offs
    /// between threads (a third of the conversion's context switches).
    fn put_blocking(
        &self,
        handle: &tokio::runtime::Handle,
        key: &ObjectKey,
        data: Bytes,
    ) -> Result<(), StoreError> {
        handle.block_on(self.put(key, data))
    }

    /// `put_blocking` of one object of a batch (a conversion's chunks): readable at once,
    /// but durable only once a later `sync_batch` returns, which covers every batched
    /// put that returned before it. Until then a crash may leave the object short or
    /// empty under its name (`batched_may_be_short`), so a caller records it anywhere
    /// durable only after the sync, and checks the bytes of such an object it finds
    /// without a record. A backend whose puts are durable when they return keeps these
    /// defaults. On fs, one sync instead of two fsyncs an object: about a sixth of the
    /// registry's CPU while the corpus converted.
    fn put_batched(
        &self,
        handle: &tokio::runtime::Handle,
        key: &ObjectKey,
        data: Bytes,
    ) -> Result<(), StoreError> {
        self.put_blocking(handle, key, data)
    }

    /// Makes every `put_batched` that returned before this call durable. Blocking.
    fn sync_batch(&self, _handle: &tokio::runtime::Handle) -> Result<(), StoreError> {
        Ok(())
    }

    /// Whether an object that exists may be a `put_batched` that a crash cut short.
    fn batched_may_be_short(&self) -> bool {
        false
    }

    /// Appends `body` to staged object `id` after its first `offset` bytes, the ones the
    /// caller acknowledged (created when `offset` is 0), as a new segment; what a request
    /// that never finished staged past `offset` is never read again. Fewer than `offset`
    /// bytes staged is an error here or, for a backend that does not look (s3: no request
    /// beyond the write), when the object is read or published. `len` is the body's length
    /// when its sender declared it (a Content-Length, a descriptor's size): a body of another
    /// length is then `StoreError::Body`, as a body that fails, and a backend may write the
    /// segment in one request (s3: one PUT instead of a multipart upload). Each chunk is
    /// passed to `observe` as it is written. Returns the new length and the segment once the
    /// data is durable; on an error nothing of this append is left visible.
    async fn append_staged(
        &self,
        id: &str,
        offset: u64,
        body: ByteStream,
        len: Option<u64>,
        observe: Observer<'_>,
    ) -> Result<Appended, StoreError>;

    /// Drops `segment` of staged object `id`, written by [`append_staged`](Self::append_staged)
    /// but never acknowledged (another request's append won, or the body did not match
    /// what its sender announced). Dropping one that is gone is not an error.
    async fn discard_segment(&self, id: &str, segment: &Segment) -> Result<(), StoreError>;

    /// Bytes staged object `id` holds, acknowledged or not; `None` if it holds none (for
    /// recovery and fsck). On s3 a first segment that a link now names counts too (it
    /// cannot be told apart without the blob's key).
    async fn staged_len(&self, id: &str) -> Result<Option<u64>, StoreError>;

    /// Cuts staged object `id` back to `len` bytes (recovery after a crash mid-append, for a
    /// store this process owns alone).
    async fn truncate_staged(&self, id: &str, len: u64) -> Result<(), StoreError>;

    /// Streams the first `len` bytes of staged object `id`, held by `segments` (its
    /// acknowledged bytes); an error if they are not all there.
    async fn read_staged(
        &self,
        id: &str,
        segments: &[Segment],
        len: u64,
    ) -> Result<ByteStream, StoreError>;

    /// Removes a published object; removing a missing one is not an error. Only for a
    /// layer blob whose recipe is published and verified (`crate::recipe`): every other
    /// published object is kept forever.
    async fn remove(&self, key: &ObjectKey) -> Result<(), StoreError>;

    /// Makes the first `len` bytes of staged object `id`, held by `segments`, visible as
    /// `key`, atomically, and ends `id` (its segments are dropped; what unacknowledged
    /// requests left may stay until [`remove_staged`](Self::remove_staged)). If `key` exists
    /// already it is kept. An error if the bytes are not all there. A backend may publish
    /// the bytes where they are staged (s3 links a single-segment upload), so an ended id
    /// is never staged to again: ids are never reused, and the caller ends its session
    /// before publishing.
    async fn publish_staged(
        &self,
        id: &str,
        segments: &[Segment],
        len: u64,
        key: &ObjectKey,
    ) -> Result<(), StoreError>;

    /// Removes staged object `id`: `segments` (what its session acknowledged; empty for
    /// staged data whose session is gone) and whatever unacknowledged requests left under
    /// it. A first segment not named is kept where the backend may have published it (s3:
    /// a link may name it). Removing a missing one is not an error.
    async fn remove_staged(&self, id: &str, segments: &[Segment]) -> Result<(), StoreError>;

    /// Ids of every staged object (for recovery and expiry).
    async fn list_staged(&self) -> Result<Vec<String>, StoreError>;

    /// Upload data kept where a blob may be published from it but that no published
    /// blob names (for fsck): a backend that publishes a single-segment upload where it
    /// was staged (s3: `data/<id>.<token>`, linked from the blob's key) keeps first
    /// segments out of [`remove_staged`](Self::remove_staged)'s reach, so one left by a
    /// crash between an append and its acknowledgement, or between a session's end and
    /// its publish, is found only here. Data of sessions still in progress is listed too:
    /// the caller tells them apart. Backends that publish by moving or copying (fs) have
    /// none.
    async fn unlinked_uploads(&self) -> Result<Vec<UnlinkedUpload>, StoreError> {
        Ok(Vec::new())
    }

    /// Keys of every published object starting with `prefix` (for fsck and reindex).
    async fn list(&self, prefix: &str) -> Result<Vec<ObjectKey>, StoreError>;

    /// Published objects whose keys start with `prefix`, with their sizes as the listing
    /// gives them (no request per object). Only for objects stored as themselves
    /// (`chunks/`, `envs/`, `chains/`): a blob the s3 backend published as a link to its
    /// upload lists with the link's size, 0; `stat` gives a blob's.
    async fn list_sizes(&self, prefix: &str) -> Result<Vec<(ObjectKey, u64)>, StoreError>;

    /// One level of the key tree under `prefix` (ending in `/`): the keys directly
    /// under it with their sizes as the listing gives them, and the prefixes one level down,
    /// each in byte order. On S3 one delimited listing (a request per 1,000 entries). For
    /// walking a large tree many levels at a time ([`walk`]), where a flat listing of a
    /// million keys is a thousand requests one after another. Records and published objects
    /// alike (sizes as in [`list_sizes`](Self::list_sizes)); staged objects never: a prefix
    /// that fails [`level_prefix_ok`] lists nothing.
    async fn list_level(&self, prefix: &str) -> Result<Level, StoreError>;

    /// A record's value and version, or `None` when it does not exist.
    async fn get_record(&self, key: &RecordKey) -> Result<Option<(Bytes, Version)>, StoreError>;

    /// Writes a record if it is unchanged: `expected` `None` creates it only if it does not
    /// exist; `Some(v)` replaces it only if its version is still `v`. Returns the new
    /// version, or `None` when the condition failed (someone else wrote first). Durable
    /// and atomic: readers see the old value or the new one.
    async fn put_record(
        &self,
        key: &RecordKey,
        value: Bytes,
        expected: Option<&Version>,
    ) -> Result<Option<Version>, StoreError>;

    /// Removes a record; removing a missing one is not an error. Only for records that
    /// stand for work in progress (upload sessions, conversion work items), whose end
    /// is recorded elsewhere first.
    async fn delete_record(&self, key: &RecordKey) -> Result<(), StoreError>;

    /// Every record whose key starts with `prefix` (itself starting with `_records/`).
    async fn list_records(&self, prefix: &str) -> Result<Vec<RecordKey>, StoreError>;

    /// A page of [`list_records`](Self::list_records): at most `limit` records whose key
    /// starts with `prefix`, in byte order, after `prefix` + `after` when given. On S3 one
    /// listing request for a page up to 1,000, so a listing page costs the same however
    /// many records the prefix holds. The default lists them all and cuts the page out.
    async fn list_records_page(
        &self,
        prefix: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<RecordKey>, StoreError> {
        let from = after.map(|a| format!("{prefix}{a}{}", after_mark(prefix)));
        let mut keys = self.list_records(prefix).await?;
        keys.sort_by(|a, b| a.as_str().as_bytes().cmp(b.as_str().as_bytes()));
        Ok(keys
            .into_iter()
            .filter(|k| from.as_deref().is_none_or(|f| k.as_str() > f))
            .take(limit)
            .collect())
    }

    /// A URL from which a client may GET the published object directly for `ttl`, when
    /// the backend has such URLs (S3 presigned URLs); `None` otherwise.
    async fn presign_get(
        &self,
        _key: &ObjectKey,
        _ttl: std::time::Duration,
    ) -> Result<Option<String>, StoreError> {
        Ok(None)
    }
}
