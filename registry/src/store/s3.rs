//! The `s3` backend (AWS S3 or any S3-compatible store), with `aws-sdk-s3`.
//!
//! Layout in the bucket, under an optional prefix: published objects at their
//! [`ObjectKey`]; a staged object `id` as segments, one per append, each made visible
//! whole (a single PUT, or a multipart upload completed at the end), so a crash never
//! leaves a partial segment. Every append writes an object of its own, named by a random
//! token: the first segment is `data/<id>.<token>`, every later one
//! `_staging/<id>/<offset:020>.<token>`. Which of them hold the upload is what the
//! session's record says ([`Segment`]s, moved by compare-and-swap); two replicas appending
//! at one offset at once write two objects, and the one whose compare-and-swap lost drops
//! its own. Nothing is listed per request: reads and publishes take the record's
//! segments. (A record without segments, and `data/<id>` or `_staging/<id>/<offset:020>`
//! without a token, are of a registry before per-append names.)
//!
//! S3 has no rename, so publishing a staged object would cost a server-side copy of all
//! its bytes. Most blobs are pushed in one PATCH (docker, skopeo, containerd), so their
//! staged object is `data/<id>` alone: that one is published as a *link*, an empty
//! object at the blob's key whose metadata names `data/<id>` and its size, and its bytes
//! are never copied. A blob staged in several segments is copied as before.
//!
//! Invariants kept here:
//! - published objects are created once: every write to a published key carries
//!   `If-None-Match: *`; a 412 means the content-addressed object is already there;
//! - publishing links the one `data/<id>` segment, or copies the segments server-side to
//!   the final key (one `CopyObject` for a single segment, else `UploadPartCopy` parts of
//!   a multipart upload), with `If-None-Match: *`: the final key is either absent, or
//!   complete, or a link to a complete data object;
//! - a staged object's segments below its acknowledged length never change: each is an
//!   object written once under a name no other request uses, so a hash of them computed
//!   while they were written stays the hash of what is published, and a request that
//!   lands late cannot change a published (linked) blob;
//! - a linked `data/<id>.<token>` is removed only with its link (`remove`), never as
//!   staged data: the session it was staged for ends before the link is written
//!   (`crate::uploads`), publishing never removes the data a link at its key names, and
//!   removing staged data whose session is gone leaves `data/` alone (a crash between an
//!   append's write and its compare-and-swap can leave an unnamed `data/<id>.<token>`;
//!   nothing links it, and fsck does not see it yet);
//! - only blob keys (`blobs/…`) can be links; what a blob key holds is cached (links and
//!   published objects never change; a removed one reads as missing, and its size is
//!   its recipe's), so a link costs one HEAD per process, not per read, and a whole
//!   read (`read_all`, a manifest) takes one GET as before;
//! - data (a part, or an object of one PUT) goes with an unsigned payload: the request is
//!   still signed and carries a CRC32 of its body that the server checks, but the body is
//!   not hashed with SHA-256 twice more (by the SDK to sign it, by the server to check
//!   the signature). Every byte is checked end to end anyway: a blob against its
//!   digest, a chunk against its blake3 id;
//! - memory per upload is bounded by a few part buffers (`PARALLEL_PARTS` + 1 of
//!   `PART_BYTES`), whatever the blob size;
//! - every call has timeouts and retries with backoff and jitter (the SDK's standard
//!   retry mode), so a silent endpoint fails cleanly instead of hanging.
//!
//! Multipart uploads abandoned by a crash stay invisible; they are aborted when their
//! session is cut back or removed (and a bucket lifecycle rule
//! `AbortIncompleteMultipartUpload` should clean any the registry never sees again).

use std::io;
use std::ops::Range;
use std::time::Duration;

use async_trait::async_trait;
use aws_sdk_s3::error::{DisplayErrorContext, SdkError};
use aws_sdk_s3::primitives::ByteStream as SdkStream;
use aws_sdk_s3::types::{CompletedMultipartUpload, CompletedPart};
use bytes::{Bytes, BytesMut};
use futures_util::StreamExt;

use super::{
    Appended, ByteStream, Level, ObjectKey, ObjectStore, Observer, RecordKey, Segment, StoreError,
    UnlinkedUpload, Version,
};

/// Bytes per multipart part (S3's minimum is 5 MiB, except for the last part).
const PART_BYTES: usize = 8 << 20;
/// Parts of one upload in flight at once: memory per upload is at most
/// (PARALLEL_PARTS + 1) * PART_BYTES.
const PARALLEL_PARTS: usize = 3;
/// S3's minimum size of a part that is not the last.
const MIN_PART: u64 = 5 << 20;
/// The largest source range one `UploadPartCopy` may copy.
const MAX_COPY_PART: u64 = 5 << 30;
/// The largest object S3 takes in one PUT.
const MAX_PUT: u64 = 5 << 30;
/// Chunks of a streamed PUT queued between the client's body and the SDK.
const PUT_QUEUE: usize = 4;
/// The published objects that may be links: blobs, the only ones pushed through upload
/// sessions.
const LINKABLE: &str = "blobs/";
/// Where a session's first segment is staged, and stays when it is linked.
const DATA: &str = "data/";
/// User metadata of a link: the key (below the bucket prefix) of the data it names...
const LINK_META: &str = "amber-link";
/// ...and the size of that data.
const SIZE_META: &str = "amber-size";
/// Blob keys whose resolution is cached.
const RESOLVED_CACHE: usize = 65_536;
/// Blob links read at once when looking for upload data no link names (fsck).
const LINK_READS: usize = 32;

/// Where the bucket is and how to reach it.
#[derive(Clone, Debug, Default)]
pub struct S3Settings {
    /// Custom endpoint (S3-compatible servers); `None` is AWS.
    pub endpoint: Option<String>,
    pub bucket: String,
    pub region: String,
    /// Path-style addressing (`endpoint/bucket/key`), which most S3-compatible servers need.
    pub path_style: bool,
    /// Prefix of every key, so several registries can share a bucket.
    pub prefix: String,
    /// Static credentials; `None` uses the standard provider chain.
    pub credentials: Option<(String, String)>,
}

pub struct S3Store {
    client: aws_sdk_s3::Client,
    bucket: String,
    prefix: String,
    /// What blob keys hold (see [`Resolved`]), by full key.
    resolved: std::sync::Mutex<lru::LruCache<String, Resolved>>,
}

/// Where the bytes of a published object are: the object itself, or the data object a
/// link names.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Resolved {
    /// The full key holding the bytes.
    data: String,
    size: u64,
    link: bool,
}

fn status<E, R: HttpStatus>(e: &SdkError<E, R>) -> Option<u16> {
    e.raw_response().map(|r| r.status_code())
}

/// The HTTP status of a raw response (kept generic over the SDK's response type).
trait HttpStatus {
    fn status_code(&self) -> u16;
}

impl HttpStatus for aws_sdk_s3::config::http::HttpResponse {
    fn status_code(&self) -> u16 {
        self.status().as_u16()
    }
}

fn io_err<E>(what: String, e: SdkError<E, aws_sdk_s3::config::http::HttpResponse>) -> StoreError
where
    E: std::error::Error + Send + Sync + 'static,
{
    StoreError::io(what, io::Error::other(DisplayErrorContext(e).to_string()))
}

fn body_err(what: &str, e: impl std::fmt::Display) -> io::Error {
    io::Error::other(format!("{what}: {e}"))
}

/// Counts every S3 operation (once: requests are serialised once, whatever the retries)
/// by name, for /metrics.
#[derive(Debug)]
struct CountRequests;

impl aws_sdk_s3::config::Intercept for CountRequests {
    fn name(&self) -> &'static str {
        "amber-count-requests"
    }

    fn read_before_serialization(
        &self,
        _context: &aws_sdk_s3::config::interceptors::BeforeSerializationInterceptorContextRef<'_>,
        _components: &aws_sdk_s3::config::RuntimeComponents,
        cfg: &mut aws_sdk_s3::config::ConfigBag,
    ) -> Result<(), aws_smithy_runtime_api::box_error::BoxError> {
        let op = cfg
            .load::<aws_smithy_runtime_api::client::orchestrator::Metadata>()
            .map(|m| m.name().to_string())
            .unwrap_or_else(|| "unknown".into());
        metrics::counter!(crate::metrics::S3_REQUESTS, "op" => op).increment(1);
        Ok(())
    }
}

/// The body of a streamed PUT: chunks fed through a channel, with its declared length as
/// the exact size hint the SDK sends as Content-Length (S3 refuses a PUT without one).
struct Declared {
    rx: tokio::sync::mpsc::Receiver<Bytes>,
    left: u64,
}

impl http_body::Body for Declared {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, io::Error>>> {
        // The feeder ends the channel early only when its body failed; the PUT then sends
        // fewer bytes than declared, which the HTTP client refuses to complete.
        self.rx.poll_recv(cx).map(|chunk| {
            chunk.map(|b| {
                self.left = self.left.saturating_sub(b.len() as u64);
                Ok(http_body::Frame::data(b))
            })
        })
    }

    fn size_hint(&self) -> http_body::SizeHint {
        http_body::SizeHint::with_exact(self.left)
    }
}

/// An object found under a staged object's names (listed: for recovery and fsck only):
/// where its bytes would start, its key and size.
#[derive(Clone, Debug)]
struct StagedObject {
    start: u64,
    key: String,
    size: u64,
}

/// Whether `name` is a segment name this backend makes (or the empty one of before).
fn segment_name_ok(name: &str) -> bool {
    name.is_empty()
        || (name.len() == 32 && name.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')))
}

impl S3Store {
    /// Connects and checks that the bucket answers.
    pub async fn connect(s: &S3Settings) -> Result<S3Store, StoreError> {
        use aws_config::retry::RetryConfig;
        use aws_config::timeout::TimeoutConfig;
        use aws_config::{BehaviorVersion, Region};
        let mut loader = aws_config::defaults(BehaviorVersion::latest())
            .region(Region::new(s.region.clone()))
            .retry_config(
                RetryConfig::standard()
                    .with_max_attempts(5)
                    .with_initial_backoff(Duration::from_millis(100))
                    .with_max_backoff(Duration::from_secs(5)),
            )
            .timeout_config(
                TimeoutConfig::builder()
                    .connect_timeout(Duration::from_secs(5))
                    .read_timeout(Duration::from_secs(60))
                    .operation_attempt_timeout(Duration::from_secs(120))
                    .build(),
            );
        if let Some((id, secret)) = &s.credentials {
            loader = loader.credentials_provider(aws_sdk_s3::config::Credentials::new(
                id, secret, None, None, "amber",
            ));
        } else {
            // The standard chain (environment, profile, web identity, container, instance
            // metadata), with an instance-metadata client that gives up within about a
            // second where there is no metadata service, instead of stalling start-up.
            let imds = aws_config::imds::Client::builder()
                .connect_timeout(Duration::from_millis(500))
                .read_timeout(Duration::from_millis(500))
                .max_attempts(1)
                .build();
            let chain =
                aws_config::default_provider::credentials::DefaultCredentialsChain::builder()
                    .region(Region::new(s.region.clone()))
                    .imds_client(imds)
                    .build()
                    .await;
            loader = loader.credentials_provider(chain);
        }
        if let Some(e) = &s.endpoint {
            loader = loader.endpoint_url(e);
        }
        let shared = loader.load().await;
        // Responses are checked where it matters, end to end: blobs against their sha256,
        // chunks against their blake3. The SDK's own response checksums are only checked
        // when asked for, because S3-compatible servers get them wrong for objects made by
        // UploadPartCopy (s3s-fs 0.14 sends the checksum of the copy's source).
        // Requests carry a checksum only where S3 requires one, for the same reason: the
        // SDK's default computes a CRC32 of every PutObject and UploadPart body and sends
        // it as an aws-chunked trailer, which costs the push a pass over every byte on
        // both sides (a fifth of an S3 push in BENCHMARKS.md) and which several
        // S3-compatible services do not accept. What S3 stores is checked on every read
        // against the digest that names it, and TLS covers the wire.
        let conf = aws_sdk_s3::config::Builder::from(&shared)
            .force_path_style(s.path_style)
            .response_checksum_validation(
                aws_sdk_s3::config::ResponseChecksumValidation::WhenRequired,
            )
            .request_checksum_calculation(
                aws_sdk_s3::config::RequestChecksumCalculation::WhenRequired,
            )
            .interceptor(CountRequests)
            .build();
        let store = S3Store {
            client: aws_sdk_s3::Client::from_conf(conf),
            bucket: s.bucket.clone(),
            prefix: s.prefix.clone(),
            resolved: std::sync::Mutex::new(lru::LruCache::new(
                std::num::NonZeroUsize::new(RESOLVED_CACHE).expect("cache size"),
            )),
        };
        store
            .client
            .head_bucket()
            .bucket(&store.bucket)
            .send()
            .await
            .map_err(|e| {
                let where_ = s.endpoint.as_deref().unwrap_or("AWS");
                io_err(format!("bucket {} at {where_}", s.bucket), e)
            })?;
        Ok(store)
    }

    fn key(&self, key: &ObjectKey) -> String {
        format!("{}{}", self.prefix, key.as_str())
    }

    fn staged_prefix(&self, id: &str) -> Result<String, StoreError> {
        if !amber_oci::names::upload_id_ok(id) {
            return Err(StoreError::NotFound(format!("staged upload {id:?}")));
        }
        Ok(format!("{}_staging/{id}/", self.prefix))
    }

    /// The full key that every first segment of staged object `id` starts with
    /// (`data/<id>`, which is itself the one of a registry before per-append names).
    fn data_key(&self, id: &str) -> Result<String, StoreError> {
        self.staged_prefix(id)?;
        Ok(format!("{}{DATA}{id}", self.prefix))
    }

    /// The full key of `segment` of staged object `id`.
    fn segment_key(&self, id: &str, segment: &Segment) -> Result<String, StoreError> {
        if !segment_name_ok(&segment.name) {
            return Err(StoreError::NotFound(format!(
                "segment {:?} of staged upload {id}",
                segment.name
            )));
        }
        let base = if segment.start == 0 {
            self.data_key(id)?
        } else {
            format!("{}{:020}", self.staged_prefix(id)?, segment.start)
        };
        Ok(match segment.name.as_str() {
            "" => base,
            name => format!("{base}.{name}"),
        })
    }

    /// The objects holding the first `len` bytes of staged object `id`, as `segments`
    /// name them, with the size of each; an error if the segments do not tile `len`.
    fn segment_objects(
        &self,
        id: &str,
        segments: &[Segment],
        len: u64,
    ) -> Result<Vec<(String, u64)>, StoreError> {
        let mut out = Vec::with_capacity(segments.len());
        let mut at = 0;
        for (i, seg) in segments.iter().enumerate() {
            let end = segments.get(i + 1).map_or(len, |next| next.start);
            if seg.start != at || end <= seg.start {
                break;
            }
            out.push((self.segment_key(id, seg)?, end - seg.start));
            at = end;
        }
        if at != len {
            return Err(StoreError::OffsetMismatch {
                id: id.to_string(),
                expected: len,
                actual: at,
            });
        }
        Ok(out)
    }

    /// HEAD of a full key: where its bytes are, following a link; `None` if it does not
    /// exist.
    async fn head(&self, key: &str) -> Result<Option<Resolved>, StoreError> {
        let r = match self
            .client
            .head_object()
            .bucket(&self.bucket)
            .key(key)
            .send()
            .await
        {
            Ok(r) => r,
            Err(e) if status(&e) == Some(404) => return Ok(None),
            Err(e) => return Err(io_err(format!("stat of {key}"), e)),
        };
        let meta = r.metadata();
        let link = meta.and_then(|m| m.get(LINK_META));
        let size = meta.and_then(|m| m.get(SIZE_META));
        Ok(Some(match (link, size) {
            (Some(link), Some(size)) => Resolved {
                data: self.link_target(key, link)?,
                size: size.parse().map_err(|_| {
                    StoreError::io(
                        format!("link {key}"),
                        io::Error::other(format!("{SIZE_META} {size:?} is not a size")),
                    )
                })?,
                link: true,
            },
            _ => Resolved {
                data: key.to_string(),
                size: r.content_length().unwrap_or(0) as u64,
                link: false,
            },
        }))
    }

    /// The full key a link at `key` names with `link`: only ever an upload's first
    /// segment (`data/<id>.<token>`, or `data/<id>` from before per-append names).
    fn link_target(&self, key: &str, link: &str) -> Result<String, StoreError> {
        let named = |rest: &str| {
            let (id, token) = rest.split_once('.').unwrap_or((rest, ""));
            amber_oci::names::upload_id_ok(id) && segment_name_ok(token)
        };
        match link.strip_prefix(DATA) {
            Some(rest) if named(rest) => Ok(format!("{}{link}", self.prefix)),
            _ => Err(StoreError::io(
                format!("link {key}"),
                io::Error::other(format!("{LINK_META} {link:?} names no upload's data")),
            )),
        }
    }

    /// Where the bytes of the blob key `key` are (from the cache, or one HEAD); `None`
    /// when it does not exist.
    async fn resolve(&self, key: &ObjectKey) -> Result<Option<Resolved>, StoreError> {
        let k = self.key(key);
        if let Some(r) = self.cached(&k) {
            return Ok(Some(r));
        }
        let r = self.head(&k).await?;
        if let Some(r) = &r {
            self.resolved_lock().put(k, r.clone());
        }
        Ok(r)
    }

    fn cached(&self, key: &str) -> Option<Resolved> {
        self.resolved_lock().get(key).cloned()
    }

    fn resolved_lock(&self) -> std::sync::MutexGuard<'_, lru::LruCache<String, Resolved>> {
        // The cache holds no invariant a panicking holder could break.
        self.resolved.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Publishes `key` (full) as a link to `data` (full) of `size` bytes, create-once.
    /// Returns false when the key existed already (the write was refused).
    async fn write_link(&self, key: &str, data: &str, size: u64) -> Result<bool, StoreError> {
        let rel = &data[self.prefix.len()..];
        match self
            .client
            .put_object()
            .bucket(&self.bucket)
            .key(key)
            .metadata(LINK_META, rel)
            .metadata(SIZE_META, size.to_string())
            .body(SdkStream::from(Bytes::new()))
            .if_none_match("*")
            .send()
            .await
        {
            Ok(_) => Ok(true),
            Err(e) if matches!(status(&e), Some(412) | Some(409)) => Ok(false),
            Err(e) => Err(io_err(format!("linking {key} to {rel}"), e)),
        }
    }

    /// Every object under `prefix` as (key, size), in key order.
    async fn list_keys(&self, prefix: &str) -> Result<Vec<(String, u64)>, StoreError> {
        Ok(self.list_pages(prefix, false).await?.keys)
    }

    /// Every page of a listing of full prefix `prefix`: with `delimited`, one level (the
    /// objects directly under it and the prefixes one level down), otherwise every object
    /// under it. Full keys, each list in byte order.
    async fn list_pages(&self, prefix: &str, delimited: bool) -> Result<Level, StoreError> {
        let mut pages = self
            .client
            .list_objects_v2()
            .bucket(&self.bucket)
            .prefix(prefix)
            .set_delimiter(delimited.then(|| "/".to_string()))
            .into_paginator()
            .send();
        let mut level = Level::default();
        while let Some(page) = pages.next().await {
            let page = page.map_err(|e| io_err(format!("listing {prefix}"), e))?;
            for o in page.contents() {
                if let Some(k) = o.key() {
                    level
                        .keys
                        .push((k.to_string(), o.size().unwrap_or(0) as u64));
                }
            }
            let prefixes = page.common_prefixes().iter().filter_map(|p| p.prefix());
            level.prefixes.extend(prefixes.map(str::to_string));
        }
        level.keys.sort();
        level.prefixes.sort();
        Ok(level)
    }

    /// Every object staged under `id`'s names, acknowledged or not, by where it starts
    /// (listed: for recovery and fsck, never per request).
    async fn staged_objects(&self, id: &str) -> Result<Vec<StagedObject>, StoreError> {
        let prefix = self.staged_prefix(id)?;
        let data = self.data_key(id)?;
        let mut found = Vec::new();
        for (key, size) in self.list_keys(&data).await? {
            let rest = &key[data.len()..];
            if rest.is_empty() || rest.starts_with('.') {
                found.push(StagedObject {
                    start: 0,
                    key,
                    size,
                });
            }
        }
        for (key, size) in self.list_keys(&prefix).await? {
            let name = &key[prefix.len()..];
            let start = name.split_once('.').map_or(name, |(start, _)| start);
            if let Ok(start) = start.parse::<u64>() {
                found.push(StagedObject { start, key, size });
            }
        }
        found.sort_by_key(|o| o.start);
        Ok(found)
    }

    async fn delete(&self, key: &str) -> Result<(), StoreError> {
        self.client
            .delete_object()
            .bucket(&self.bucket)
            .key(key)
            .send()
            .await
            .map_err(|e| io_err(format!("deleting {key}"), e))?;
        Ok(())
    }

    /// Aborts multipart uploads left under `prefix` by a crash. Best effort: some
    /// S3-compatible servers do not list multipart uploads.
    async fn abort_dangling(&self, prefix: &str) {
        let Ok(list) = self
            .client
            .list_multipart_uploads()
            .bucket(&self.bucket)
            .prefix(prefix)
            .send()
            .await
        else {
            return;
        };
        for u in list.uploads() {
            if let (Some(k), Some(id)) = (u.key(), u.upload_id()) {
                self.abort(k, id).await;
            }
        }
    }

    /// Writes `key` from `first` (already read) and the rest of `body`: one PUT when it
    /// all fits in a part, else a multipart upload. Returns the bytes written. Nothing is
    /// visible under `key` unless this returns Ok.
    async fn write_streamed(
        &self,
        key: &str,
        mut body: ByteStream,
        observe: Observer<'_>,
        create_once: bool,
    ) -> Result<u64, StoreError> {
        let mut buf = BytesMut::with_capacity(PART_BYTES);
        let mut upload: Option<(String, Vec<CompletedPart>)> = None;
        let mut inflight = futures_util::stream::FuturesUnordered::new();
        let mut next_part = 0i32;
        let mut total = 0u64;
        loop {
            let next = body.next().await;
            let done = next.is_none();
            if let Some(chunk) = next {
                let chunk = match chunk {
                    Ok(c) => c,
                    Err(e) => {
                        if let Some((id, _)) = &upload {
                            self.abort(key, id).await;
                        }
                        return Err(StoreError::Body(e));
                    }
                };
                observe(&chunk);
                total += chunk.len() as u64;
                buf.extend_from_slice(&chunk);
            }
            if upload.is_none() && done {
                // Small: one PUT.
                let mut req = self
                    .client
                    .put_object()
                    .bucket(&self.bucket)
                    .key(key)
                    .body(SdkStream::from(buf.freeze()));
                if create_once {
                    req = req.if_none_match("*");
                }
                return match req.customize().disable_payload_signing().send().await {
                    Ok(_) => Ok(total),
                    Err(e) if create_once && status(&e) == Some(412) => Ok(total),
                    Err(e) => Err(io_err(format!("writing {key}"), e)),
                };
            }
            while buf.len() >= PART_BYTES || (done && !buf.is_empty()) {
                if upload.is_none() {
                    upload = Some((self.start_upload(key).await?, Vec::new()));
                }
                let (id, parts) = upload.as_mut().expect("started");
                if inflight.len() >= PARALLEL_PARTS {
                    let finished: Result<CompletedPart, StoreError> =
                        inflight.next().await.expect("parts in flight");
                    if let Err(e) = finished.map(|p| parts.push(p)) {
                        let id = id.clone();
                        self.abort(key, &id).await;
                        return Err(e);
                    }
                }
                let n = buf.len().min(PART_BYTES);
                let part = buf.split_to(n).freeze();
                next_part += 1;
                inflight.push(self.upload_part(key, id.clone(), next_part, part));
            }
            if done {
                let (id, mut parts) = upload.take().expect("started");
                while let Some(finished) = inflight.next().await {
                    if let Err(e) = finished.map(|p| parts.push(p)) {
                        self.abort(key, &id).await;
                        return Err(e);
                    }
                }
                parts.sort_by_key(|p| p.part_number());
                self.complete(key, &id, parts, create_once).await?;
                return Ok(total);
            }
        }
    }

    /// Writes `key` from `body`, declared to be `len` bytes, in one streamed PUT: the body
    /// goes to the SDK through a small bounded channel, fed here, where `observe` sees
    /// each chunk. The PUT is not retried by the SDK (its body cannot be replayed): a
    /// failure is the request's, and the client resumes from its acknowledged offset.
    async fn put_streamed(
        &self,
        key: &str,
        mut body: ByteStream,
        len: u64,
        observe: Observer<'_>,
    ) -> Result<u64, StoreError> {
        let (tx, rx) = tokio::sync::mpsc::channel(PUT_QUEUE);
        let put = self
            .client
            .put_object()
            .bucket(&self.bucket)
            .key(key)
            .content_length(len as i64)
            .body(SdkStream::from_body_1_x(Declared { rx, left: len }))
            .customize()
            .disable_payload_signing()
            .send();
        let feed = async {
            let mut total = 0u64;
            while let Some(chunk) = body.next().await {
                let chunk = chunk?;
                observe(&chunk);
                total += chunk.len() as u64;
                if tx.send(chunk).await.is_err() {
                    break; // the PUT ended early; its error is reported below
                }
            }
            drop(tx);
            Ok::<u64, io::Error>(total)
        };
        let (put, fed) = tokio::join!(put, feed);
        // A body that failed is the client's error, whatever the PUT made of it.
        let total = fed.map_err(StoreError::Body)?;
        put.map_err(|e| io_err(format!("writing {key}"), e))?;
        Ok(total)
    }

    /// Uploads one part; the future owns what it sends, so several run at once.
    fn upload_part(
        &self,
        key: &str,
        upload_id: String,
        number: i32,
        part: Bytes,
    ) -> impl std::future::Future<Output = Result<CompletedPart, StoreError>> {
        let req = self
            .client
            .upload_part()
            .bucket(&self.bucket)
            .key(key)
            .upload_id(upload_id)
            .part_number(number)
            .body(SdkStream::from(part));
        let key = key.to_string();
        async move {
            let r = req
                .customize()
                .disable_payload_signing()
                .send()
                .await
                .map_err(|e| io_err(format!("uploading part {number} of {key}"), e))?;
            Ok(CompletedPart::builder()
                .part_number(number)
                .set_e_tag(r.e_tag().map(str::to_string))
                .build())
        }
    }

    /// Starts a multipart upload of `key`; returns its id.
    async fn start_upload(&self, key: &str) -> Result<String, StoreError> {
        let r = self
            .client
            .create_multipart_upload()
            .bucket(&self.bucket)
            .key(key)
            .send()
            .await
            .map_err(|e| io_err(format!("starting a multipart upload of {key}"), e))?;
        Ok(r.upload_id().unwrap_or_default().to_string())
    }

    async fn abort(&self, key: &str, upload_id: &str) {
        let _ = self
            .client
            .abort_multipart_upload()
            .bucket(&self.bucket)
            .key(key)
            .upload_id(upload_id)
            .send()
            .await;
    }

    async fn complete(
        &self,
        key: &str,
        upload_id: &str,
        parts: Vec<CompletedPart>,
        create_once: bool,
    ) -> Result<(), StoreError> {
        let mut req = self
            .client
            .complete_multipart_upload()
            .bucket(&self.bucket)
            .key(key)
            .upload_id(upload_id)
            .multipart_upload(
                CompletedMultipartUpload::builder()
                    .set_parts(Some(parts))
                    .build(),
            );
        if create_once {
            req = req.if_none_match("*");
        }
        match req.send().await {
            Ok(_) => Ok(()),
            Err(e) if create_once && status(&e) == Some(412) => {
                self.abort(key, upload_id).await;
                Ok(())
            }
            Err(e) => {
                self.abort(key, upload_id).await;
                Err(io_err(format!("completing the upload of {key}"), e))
            }
        }
    }

    /// Streams `range` of `key` (one GET with a Range header).
    async fn get_range(&self, key: &str, range: Range<u64>) -> Result<ByteStream, StoreError> {
        let r = self
            .client
            .get_object()
            .bucket(&self.bucket)
            .key(key)
            .range(format!("bytes={}-{}", range.start, range.end - 1))
            .send()
            .await
            .map_err(|e| match status(&e) {
                Some(404) => StoreError::NotFound(key.to_string()),
                Some(416) => StoreError::BadRange {
                    key: key.to_string(),
                    start: range.start,
                    end: range.end,
                    size: 0,
                },
                _ => io_err(format!("reading {key}"), e),
            })?;
        // A range past the end comes back short: the Content-Range total says so.
        let total = r
            .content_range()
            .and_then(|c| c.rsplit('/').next())
            .and_then(|t| t.parse::<u64>().ok());
        if let Some(size) = total {
            if range.end > size {
                return Err(StoreError::BadRange {
                    key: key.to_string(),
                    start: range.start,
                    end: range.end,
                    size,
                });
            }
        }
        Ok(sdk_stream(r.body, key.to_string()))
    }
}

/// An SDK body as a store stream.
fn sdk_stream(body: SdkStream, what: String) -> ByteStream {
    Box::pin(futures_util::stream::unfold(Some(body), move |state| {
        let what = what.clone();
        async move {
            let mut b = state?;
            match b.next().await {
                Some(Ok(bytes)) => Some((Ok(bytes), Some(b))),
                Some(Err(e)) => Some((Err(body_err(&what, e)), None)),
                None => None,
            }
        }
    }))
}

#[async_trait]
impl ObjectStore for S3Store {
    async fn stat(&self, key: &ObjectKey) -> Result<Option<u64>, StoreError> {
        let r = if key.as_str().starts_with(LINKABLE) {
            self.resolve(key).await?
        } else {
            self.head(&self.key(key)).await?
        };
        Ok(r.map(|r| r.size))
    }

    async fn read(&self, key: &ObjectKey, range: Range<u64>) -> Result<ByteStream, StoreError> {
        if key.as_str().starts_with(LINKABLE) {
            let Some(r) = self.resolve(key).await? else {
                return Err(StoreError::NotFound(key.as_str().into()));
            };
            if range.start > range.end || range.end > r.size {
                return Err(StoreError::BadRange {
                    key: key.as_str().into(),
                    start: range.start,
                    end: range.end,
                    size: r.size,
                });
            }
            if range.start == range.end {
                return Ok(Box::pin(futures_util::stream::empty()));
            }
            return self.get_range(&r.data, range).await;
        }
        if range.start == range.end {
            return match self.stat(key).await? {
                Some(size) if range.end <= size => Ok(Box::pin(futures_util::stream::empty())),
                Some(size) => Err(StoreError::BadRange {
                    key: key.as_str().into(),
                    start: range.start,
                    end: range.end,
                    size,
                }),
                None => Err(StoreError::NotFound(key.as_str().into())),
            };
        }
        self.get_range(&self.key(key), range).await
    }

    async fn read_all(&self, key: &ObjectKey) -> Result<Bytes, StoreError> {
        // One GET, whatever the key holds (a manifest read costs what it did before
        // links); a link answers with no bytes and its metadata names the data.
        let mut k = self.key(key);
        if let Some(r) = self.cached(&k) {
            k = r.data;
        }
        loop {
            let r = self
                .client
                .get_object()
                .bucket(&self.bucket)
                .key(&k)
                .send()
                .await
                .map_err(|e| match status(&e) {
                    Some(404) => StoreError::NotFound(k.clone()),
                    _ => io_err(format!("reading {k}"), e),
                })?;
            if let Some(link) = r.metadata().and_then(|m| m.get(LINK_META)) {
                if key.as_str().starts_with(LINKABLE) && k == self.key(key) {
                    k = self.link_target(&k, link)?;
                    continue;
                }
            }
            let data = r
                .body
                .collect()
                .await
                .map_err(|e| StoreError::io(format!("reading {k}"), body_err(&k, e)))?;
            return Ok(data.into_bytes());
        }
    }

    async fn put(&self, key: &ObjectKey, data: Bytes) -> Result<(), StoreError> {
        let k = self.key(key);
        let body: ByteStream = Box::pin(futures_util::stream::once(async move { Ok(data) }));
        self.write_streamed(&k, body, &mut |_| {}, true).await?;
        Ok(())
    }

    async fn put_replacing(&self, key: &ObjectKey, data: Bytes) -> Result<(), StoreError> {
        // An unconditional PUT: S3 replaces an object atomically.
        let k = self.key(key);
        let body: ByteStream = Box::pin(futures_util::stream::once(async move { Ok(data) }));
        self.write_streamed(&k, body, &mut |_| {}, false).await?;
        Ok(())
    }

    async fn append_staged(
        &self,
        id: &str,
        offset: u64,
        body: ByteStream,
        len: Option<u64>,
        observe: Observer<'_>,
    ) -> Result<Appended, StoreError> {
        let mut body = match len {
            Some(n) => super::exactly(body, n),
            None => body,
        };
        // An empty append (the closing PUT of a chunked upload) writes nothing.
        let first = loop {
            match body.next().await {
                Some(Ok(c)) if c.is_empty() => continue,
                Some(Ok(c)) => break Some(c),
                Some(Err(e)) => return Err(StoreError::Body(e)),
                None => break None,
            }
        };
        let Some(first) = first else {
            return Ok(Appended {
                len: offset,
                segment: None,
            });
        };
        let body: ByteStream =
            Box::pin(futures_util::stream::once(async { Ok(first) }).chain(body));
        // No listing and no overwrite: the append gets an object of its own, and the
        // caller's compare-and-swap of its segments decides whether it is the upload's.
        let segment = Segment {
            start: offset,
            name: uuid::Uuid::new_v4().simple().to_string(),
        };
        let key = self.segment_key(id, &segment)?;
        let written = match len {
            // Declared and bigger than a part: one streamed PUT, so the server writes the
            // bytes once (a multipart upload's parts are joined on completion, which an
            // S3-compatible server on a disk does by copying them).
            Some(n) if n > PART_BYTES as u64 && n <= MAX_PUT => {
                self.put_streamed(&key, body, n, observe).await?
            }
            _ => self.write_streamed(&key, body, observe, false).await?,
        };
        Ok(Appended {
            len: offset + written,
            segment: Some(segment),
        })
    }

    async fn discard_segment(&self, id: &str, segment: &Segment) -> Result<(), StoreError> {
        self.delete(&self.segment_key(id, segment)?).await
    }

    async fn staged_len(&self, id: &str) -> Result<Option<u64>, StoreError> {
        let found = self.staged_objects(id).await?;
        Ok((!found.is_empty()).then(|| found.iter().map(|o| o.size).sum()))
    }

    async fn truncate_staged(&self, id: &str, len: u64) -> Result<(), StoreError> {
        self.abort_dangling(&self.staged_prefix(id)?).await;
        self.abort_dangling(&self.data_key(id)?).await;
        for o in self.staged_objects(id).await? {
            if o.start >= len {
                self.delete(&o.key).await?;
            } else if o.start + o.size > len {
                // Cut inside this object (only one staged before per-append names can
                // pass the acknowledged length): rewrite it as its first `keep` bytes,
                // copied server-side, replacing it atomically.
                let keep = len - o.start;
                let upload = self.start_upload(&o.key).await?;
                let part = self.copy_part(&o.key, &upload, 1, &o.key, 0..keep).await;
                match part {
                    Ok(p) => self.complete(&o.key, &upload, vec![p], false).await?,
                    Err(e) => {
                        self.abort(&o.key, &upload).await;
                        return Err(e);
                    }
                }
            }
        }
        Ok(())
    }

    async fn read_staged(
        &self,
        id: &str,
        segments: &[Segment],
        len: u64,
    ) -> Result<ByteStream, StoreError> {
        let mut streams = Vec::new();
        for (key, size) in self.segment_objects(id, segments, len)? {
            streams.push(self.get_range(&key, 0..size).await?);
        }
        Ok(Box::pin(futures_util::stream::iter(streams).flatten()))
    }

    async fn publish_staged(
        &self,
        id: &str,
        segments: &[Segment],
        len: u64,
        key: &ObjectKey,
    ) -> Result<(), StoreError> {
        let objects = self.segment_objects(id, segments, len)?;
        let k = self.key(key);
        if key.as_str().starts_with(LINKABLE) {
            if let [(data, _)] = objects.as_slice() {
                // One segment, from byte 0: the upload's first, under `data/`.
                return self.publish_link(&k, data, len).await;
            }
        }
        if self.head(&k).await?.is_none() {
            let copyable = objects
                .iter()
                .rev()
                .skip(1)
                .all(|(_, size)| *size >= MIN_PART && *size <= MAX_COPY_PART)
                && objects
                    .last()
                    .is_none_or(|(_, size)| *size <= MAX_COPY_PART);
            if objects.is_empty() || !copyable {
                // Empty, or segments S3 cannot copy as parts: stream them through.
                let body = self.read_staged(id, segments, len).await?;
                self.write_streamed(&k, body, &mut |_| {}, true).await?;
            } else if let [(only, _)] = objects.as_slice() {
                // One segment (a blob pushed in one PATCH, as docker and skopeo do): one
                // server-side copy, not a multipart upload of one copied part.
                self.copy_whole(&k, only).await?;
            } else {
                let upload = self.start_upload(&k).await?;
                let mut parts = Vec::new();
                for (i, (src, size)) in objects.iter().enumerate() {
                    match self
                        .copy_part(&k, &upload, i as i32 + 1, src, 0..*size)
                        .await
                    {
                        Ok(p) => parts.push(p),
                        Err(e) => {
                            self.abort(&k, &upload).await;
                            return Err(e);
                        }
                    }
                }
                self.complete(&k, &upload, parts, true).await?;
            }
        }
        // What unacknowledged requests left under the session (a crash between a write
        // and its compare-and-swap) is not listed here: `remove_staged` of the orphan
        // takes it (recovery at start, fsck --repair).
        for (seg, _) in &objects {
            self.delete(seg).await?;
        }
        Ok(())
    }

    async fn remove(&self, key: &ObjectKey) -> Result<(), StoreError> {
        let k = self.key(key);
        let held = if key.as_str().starts_with(LINKABLE) {
            self.head(&k).await?
        } else {
            None
        };
        // The link first: a link is never left naming data that is gone.
        self.delete(&k).await?;
        self.resolved_lock().pop(&k);
        if let Some(Resolved {
            data, link: true, ..
        }) = held
        {
            self.delete(&data).await?;
        }
        Ok(())
    }

    async fn remove_staged(&self, id: &str, segments: &[Segment]) -> Result<(), StoreError> {
        let prefix = self.staged_prefix(id)?;
        // Multipart uploads never completed are never linked, under `data/` or not.
        self.abort_dangling(&prefix).await;
        self.abort_dangling(&self.data_key(id)?).await;
        for (key, _) in self.list_keys(&prefix).await? {
            self.delete(&key).await?;
        }
        // First segments only by name: with its session gone, a `data/` object of `id` may
        // be a published blob's bytes.
        for seg in segments.iter().filter(|s| s.start == 0) {
            self.delete(&self.segment_key(id, seg)?).await?;
        }
        Ok(())
    }

    async fn list_staged(&self) -> Result<Vec<String>, StoreError> {
        let prefix = format!("{}_staging/", self.prefix);
        let mut ids: Vec<String> = self
            .list_keys(&prefix)
            .await?
            .into_iter()
            .filter_map(|(k, _)| Some(k[prefix.len()..].split_once('/')?.0.to_string()))
            .collect();
        ids.dedup();
        Ok(ids)
    }

    async fn unlinked_uploads(&self) -> Result<Vec<UnlinkedUpload>, StoreError> {
        // Data first, links after: a first segment linked in between is seen linked.
        let data = self.list_keys(&format!("{}{DATA}", self.prefix)).await?;
        let mut linked = std::collections::HashSet::new();
        let blobs = self
            .list_keys(&format!("{}{LINKABLE}", self.prefix))
            .await?;
        // A link is an empty object: only those (and empty blobs) need a HEAD.
        let mut heads = futures_util::stream::iter(
            blobs
                .into_iter()
                .filter(|(_, size)| *size == 0)
                .map(|(k, _)| async move { self.head(&k).await }),
        )
        .buffer_unordered(LINK_READS);
        while let Some(r) = heads.next().await {
            if let Some(Resolved {
                data, link: true, ..
            }) = r?
            {
                linked.insert(data);
            }
        }
        let at = self.prefix.len() + DATA.len();
        Ok(data
            .into_iter()
            .filter(|(k, _)| !linked.contains(k))
            .map(|(key, bytes)| UnlinkedUpload {
                id: key[at..].split('.').next().unwrap_or_default().to_string(),
                key: key[self.prefix.len()..].to_string(),
                bytes,
            })
            .collect())
    }

    async fn list(&self, prefix: &str) -> Result<Vec<ObjectKey>, StoreError> {
        Ok(self
            .list_sizes(prefix)
            .await?
            .into_iter()
            .map(|(k, _)| k)
            .collect())
    }

    async fn list_sizes(&self, prefix: &str) -> Result<Vec<(ObjectKey, u64)>, StoreError> {
        // Staged objects and records are not published objects.
        if prefix.is_empty() || prefix.starts_with('_') {
            return Ok(Vec::new());
        }
        let full = format!("{}{prefix}", self.prefix);
        Ok(self
            .list_keys(&full)
            .await?
            .into_iter()
            .map(|(k, n)| (ObjectKey(k[self.prefix.len()..].to_string()), n))
            .collect())
    }

    async fn list_level(&self, prefix: &str) -> Result<Level, StoreError> {
        // `data/` holds staged first segments (and the bytes of blobs linked to them).
        if !super::level_prefix_ok(prefix) || prefix.starts_with(DATA) {
            return Ok(Level::default());
        }
        let full = self
            .list_pages(&format!("{}{prefix}", self.prefix), true)
            .await?;
        let n = self.prefix.len();
        Ok(Level {
            keys: full
                .keys
                .into_iter()
                .map(|(k, size)| (k[n..].to_string(), size))
                .collect(),
            prefixes: full
                .prefixes
                .into_iter()
                .map(|p| p[n..].to_string())
                .collect(),
        })
    }

    async fn presign_get(
        &self,
        key: &ObjectKey,
        ttl: Duration,
    ) -> Result<Option<String>, StoreError> {
        let k = match key.as_str().starts_with(LINKABLE) {
            true => match self.resolve(key).await? {
                Some(r) => r.data,
                None => self.key(key),
            },
            false => self.key(key),
        };
        let cfg = aws_sdk_s3::presigning::PresigningConfig::expires_in(ttl)
            .map_err(|e| StoreError::io(format!("presigning {k}"), io::Error::other(e)))?;
        let req = self
            .client
            .get_object()
            .bucket(&self.bucket)
            .key(&k)
            .presigned(cfg)
            .await
            .map_err(|e| io_err(format!("presigning {k}"), e))?;
        Ok(Some(req.uri().to_string()))
    }

    async fn get_record(&self, key: &RecordKey) -> Result<Option<(Bytes, Version)>, StoreError> {
        let k = format!("{}{}", self.prefix, key.as_str());
        let r = match self
            .client
            .get_object()
            .bucket(&self.bucket)
            .key(&k)
            .send()
            .await
        {
            Ok(r) => r,
            Err(e) if status(&e) == Some(404) => return Ok(None),
            Err(e) => return Err(io_err(format!("reading record {k}"), e)),
        };
        let version = Version(r.e_tag().unwrap_or_default().to_string());
        let data = r
            .body
            .collect()
            .await
            .map_err(|e| StoreError::io(format!("reading {k}"), body_err(&k, e)))?;
        Ok(Some((data.into_bytes(), version)))
    }

    async fn put_record(
        &self,
        key: &RecordKey,
        value: Bytes,
        expected: Option<&Version>,
    ) -> Result<Option<Version>, StoreError> {
        let k = format!("{}{}", self.prefix, key.as_str());
        let mut req = self
            .client
            .put_object()
            .bucket(&self.bucket)
            .key(&k)
            .body(SdkStream::from(value));
        req = match expected {
            None => req.if_none_match("*"),
            Some(v) => req.if_match(&v.0),
        };
        match req.send().await {
            Ok(r) => Ok(Some(Version(r.e_tag().unwrap_or_default().to_string()))),
            // 412: the condition failed; 409: a concurrent conditional write won the race;
            // 404 to an If-Match: the record is gone (AWS answers so), which fails it too.
            Err(e) if matches!(status(&e), Some(412) | Some(409)) => Ok(None),
            Err(e) if expected.is_some() && status(&e) == Some(404) => Ok(None),
            Err(e) => Err(io_err(format!("writing record {k}"), e)),
        }
    }

    async fn delete_record(&self, key: &RecordKey) -> Result<(), StoreError> {
        self.delete(&format!("{}{}", self.prefix, key.as_str()))
            .await
    }

    async fn list_records(&self, prefix: &str) -> Result<Vec<RecordKey>, StoreError> {
        if !prefix.starts_with(RecordKey::ALL) {
            return Ok(Vec::new());
        }
        let full = format!("{}{prefix}", self.prefix);
        Ok(self
            .list_keys(&full)
            .await?
            .into_iter()
            .filter_map(|(k, _)| RecordKey::parse(&k[self.prefix.len()..]))
            .collect())
    }

    async fn list_records_page(
        &self,
        prefix: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<RecordKey>, StoreError> {
        if !prefix.starts_with(RecordKey::ALL) || limit == 0 {
            return Ok(Vec::new());
        }
        let full = format!("{}{prefix}", self.prefix);
        let mut req = self
            .client
            .list_objects_v2()
            .bucket(&self.bucket)
            .prefix(&full)
            // S3 lists in UTF-8 byte order, the order of the index's keys.
            .max_keys(limit.min(1000) as i32);
        if let Some(a) = after {
            req = req.start_after(format!("{full}{a}{}", super::after_mark(prefix)));
        }
        let mut pages = req.into_paginator().send();
        let mut out = Vec::new();
        while let Some(page) = pages.next().await {
            let page = page.map_err(|e| io_err(format!("listing {full}"), e))?;
            for k in page.contents().iter().filter_map(|o| o.key()) {
                if let Some(key) = RecordKey::parse(&k[self.prefix.len()..]) {
                    out.push(key);
                }
                if out.len() == limit {
                    return Ok(out);
                }
            }
        }
        Ok(out)
    }
}

impl S3Store {
    /// Publishes a staged object held whole by its first segment `data` as a link at
    /// `key`.
    async fn publish_link(&self, key: &str, data: &str, len: u64) -> Result<(), StoreError> {
        if self.write_link(key, data, len).await? {
            return Ok(());
        }
        match self.head(key).await? {
            // A retried publish of this session: the link is there already.
            Some(r) if r.data == data => Ok(()),
            // Another upload of the same blob published first: this one's data goes.
            Some(_) => self.delete(data).await,
            None => Err(StoreError::io(
                format!("linking {key}"),
                io::Error::other("the store refused the link as existing, yet it is not there"),
            )),
        }
    }

    /// Copies the whole object `src` server-side to the published key `key`, create-once
    /// (a 412 means the content-addressed object is there already).
    async fn copy_whole(&self, key: &str, src: &str) -> Result<(), StoreError> {
        match self
            .client
            .copy_object()
            .bucket(&self.bucket)
            .key(key)
            .copy_source(format!("{}/{src}", self.bucket))
            .if_none_match("*")
            .send()
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if status(&e) == Some(412) => Ok(()),
            Err(e) => Err(io_err(format!("copying {src} to {key}"), e)),
        }
    }

    /// Copies `range` of `src` server-side as part `number` of an upload to `key`.
    async fn copy_part(
        &self,
        key: &str,
        upload_id: &str,
        number: i32,
        src: &str,
        range: Range<u64>,
    ) -> Result<CompletedPart, StoreError> {
        let r = self
            .client
            .upload_part_copy()
            .bucket(&self.bucket)
            .key(key)
            .upload_id(upload_id)
            .part_number(number)
            .copy_source(format!("{}/{src}", self.bucket))
            .copy_source_range(format!("bytes={}-{}", range.start, range.end - 1))
            .send()
            .await
            .map_err(|e| io_err(format!("copying {src} into {key}"), e))?;
        Ok(CompletedPart::builder()
            .part_number(number)
            .set_e_tag(
                r.copy_part_result()
                    .and_then(|c| c.e_tag())
                    .map(str::to_string),
            )
            .build())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shared suite against a real S3-compatible server: AMBER_TEST_S3_ENDPOINTS
    /// lists `name=url` pairs (scripts/test starts moto and s3s-fs and sets it).
    #[tokio::test]
    async fn passes_the_store_suite_on_every_s3_server() {
        let endpoints = std::env::var("AMBER_TEST_S3_ENDPOINTS")
            .expect("AMBER_TEST_S3_ENDPOINTS is not set: scripts/test starts S3 servers");
        let mut ran = 0;
        for pair in endpoints.split(',') {
            let (name, url) = pair.split_once('=').expect("name=url");
            let prefix = format!("suite-{}/", uuid::Uuid::new_v4());
            let store = S3Store::connect(&S3Settings {
                endpoint: Some(url.to_string()),
                bucket: std::env::var("AMBER_TEST_S3_BUCKET").unwrap_or("amber-test".into()),
                region: "us-east-1".into(),
                path_style: true,
                prefix,
                credentials: Some(("amber".into(), "amber-secret".into())),
            })
            .await
            .unwrap_or_else(|e| panic!("{name} at {url}: {e}"));
            super::super::suite::run(&store).await;
            big_publish_copies_parts(&store).await;
            racing_appends_at_one_offset_never_mix(&store).await;
            unlinked_uploads_are_found(&store).await;
            ran += 1;
        }
        assert!(ran >= 1);
    }

    /// Appends `v` at `offset` in chunks of 1 MiB; the segment written.
    async fn append(store: &S3Store, id: &str, offset: u64, v: &[u8]) -> Segment {
        let body: ByteStream = Box::pin(futures_util::stream::iter(
            v.chunks(1 << 20)
                .map(|c| Ok(Bytes::copy_from_slice(c)))
                .collect::<Vec<_>>(),
        ));
        let a = store
            .append_staged(id, offset, body, None, &mut |_| {})
            .await
            .unwrap();
        assert_eq!(a.len, offset + v.len() as u64);
        a.segment.unwrap()
    }

    async fn collect(s: ByteStream) -> Vec<u8> {
        s.map(|b| b.unwrap().to_vec())
            .collect::<Vec<_>>()
            .await
            .concat()
    }

    async fn read_all_of(store: &S3Store, key: &ObjectKey) -> Vec<u8> {
        store.read_all(key).await.unwrap().to_vec()
    }

    /// Appends of more than a part become a multipart segment; publishing copies them.
    async fn big_publish_copies_parts(store: &S3Store) {
        let id = "0000eeee-0000-0000-0000-000000000001";
        let a: Vec<u8> = (0..(PART_BYTES + 12345)).map(|i| (i % 253) as u8).collect();
        let b: Vec<u8> = vec![7u8; 1000];
        let sa = append(store, id, 0, &a).await;
        let sb = append(store, id, a.len() as u64, &b).await;
        let mut all = a.clone();
        all.extend_from_slice(&b);
        let key = ObjectKey::blob(&amber_oci::digest::Digest::of(
            amber_oci::digest::Algorithm::Sha256,
            &all,
        ));
        store
            .publish_staged(id, &[sa, sb], all.len() as u64, &key)
            .await
            .unwrap();
        assert_eq!(store.read_all(&key).await.unwrap().len(), all.len());
        let mid = store
            .read(&key, PART_BYTES as u64 - 10..PART_BYTES as u64 + 10)
            .await
            .unwrap();
        assert_eq!(collect(mid).await, all[PART_BYTES - 10..PART_BYTES + 10]);
        assert_eq!(store.staged_len(id).await.unwrap(), None);

        // One segment of more than a part (one streamed PATCH): linked, not copied.
        let single = "00000000-0000-0000-0000-00000000b1c2";
        let mut whole = all.clone();
        whole.reverse();
        let seg = append(store, single, 0, &whole).await;
        let key = ObjectKey::blob(&amber_oci::digest::Digest::of(
            amber_oci::digest::Algorithm::Sha256,
            &whole,
        ));
        store
            .publish_staged(single, std::slice::from_ref(&seg), whole.len() as u64, &key)
            .await
            .unwrap();
        let data = store.segment_key(single, &seg).unwrap();
        assert!(data.contains(&format!("{DATA}{single}.")), "{data}");
        let held = Resolved {
            data: data.clone(),
            size: whole.len() as u64,
            link: true,
        };
        assert_eq!(
            store.head(&store.key(&key)).await.unwrap(),
            Some(held.clone())
        );
        // Read through a cold cache (another process) and a warm one.
        store.resolved_lock().clear();
        assert!(store.read_all(&key).await.unwrap() == whole);
        assert_eq!(store.stat(&key).await.unwrap(), Some(whole.len() as u64));
        let tail = collect(
            store
                .read(&key, whole.len() as u64 - 5..whole.len() as u64)
                .await
                .unwrap(),
        )
        .await;
        assert_eq!(tail, whole[whole.len() - 5..]);
        assert!(matches!(
            store
                .read(&key, 0..whole.len() as u64 + 1)
                .await
                .map(|_| ()),
            Err(StoreError::BadRange { .. })
        ));
        let url = store
            .presign_get(&key, Duration::from_secs(60))
            .await
            .unwrap()
            .unwrap();
        assert!(url.contains(&format!("{DATA}{single}")), "{url}");
        assert!(!store
            .list_staged()
            .await
            .unwrap()
            .contains(&single.to_string()));
        // The same content from another session keeps the first link and drops the
        // second session's data.
        let again = "00000000-0000-0000-0000-00000000b1c3";
        let seg2 = append(store, again, 0, &whole).await;
        store
            .publish_staged(again, &[seg2], whole.len() as u64, &key)
            .await
            .unwrap();
        assert_eq!(store.head(&store.key(&key)).await.unwrap(), Some(held));
        assert_eq!(store.staged_len(again).await.unwrap(), None);
        // A retried publish of the first session (a crash after it linked) keeps it.
        store
            .publish_staged(single, &[seg], whole.len() as u64, &key)
            .await
            .unwrap();
        assert!(store.read_all(&key).await.unwrap() == whole);
        // Removing the blob (its recipe took over) removes the link and its data.
        store.remove(&key).await.unwrap();
        assert_eq!(store.stat(&key).await.unwrap(), None);
        assert_eq!(store.head(&data).await.unwrap(), None);
        assert!(matches!(
            store.read_all(&key).await,
            Err(StoreError::NotFound(_))
        ));
    }

    /// Two requests appending different bytes at one offset of one session (through two
    /// replicas) write two objects: what the session acknowledged is what is read and
    /// published, whichever lands last, and a request that lands after the blob is
    /// published (linked) does not change it.
    async fn racing_appends_at_one_offset_never_mix(store: &S3Store) {
        let id = "0000dddd-0000-0000-0000-000000000001";
        let ours = vec![1u8; 3000];
        let theirs = vec![2u8; 3000];
        let acked = append(store, id, 0, &ours).await;
        let lost = append(store, id, 0, &theirs).await;
        assert_ne!(acked, lost);
        let acked = [acked];
        let read = collect(store.read_staged(id, &acked, 3000).await.unwrap()).await;
        assert_eq!(read, ours);
        let key = ObjectKey::blob(&amber_oci::digest::Digest::of(
            amber_oci::digest::Algorithm::Sha256,
            &ours,
        ));
        store.publish_staged(id, &acked, 3000, &key).await.unwrap();
        let late = append(store, id, 0, &theirs).await;
        store.resolved_lock().clear();
        assert_eq!(read_all_of(store, &key).await, ours);
        // The losers drop their own objects; the blob stays.
        store.discard_segment(id, &lost).await.unwrap();
        store.discard_segment(id, &late).await.unwrap();
        assert_eq!(read_all_of(store, &key).await, ours);
        // A record naming anything but a segment this backend made is refused.
        let forged = Segment {
            start: 0,
            name: "../../blobs/x".into(),
        };
        assert!(store.read_staged(id, &[forged], 1).await.is_err());
    }

    /// A first segment that no link names (its session died before publishing) is
    /// reported; one a blob links, or one a publish copied and dropped, is not.
    async fn unlinked_uploads_are_found(store: &S3Store) {
        let blob = |v: &[u8]| {
            ObjectKey::blob(&amber_oci::digest::Digest::of(
                amber_oci::digest::Algorithm::Sha256,
                v,
            ))
        };
        let linked = "0000cccc-0000-0000-0000-000000000001";
        let v = vec![5u8; 2000];
        let seg = append(store, linked, 0, &v).await;
        store
            .publish_staged(linked, &[seg], 2000, &blob(&v))
            .await
            .unwrap();
        let copied = "0000cccc-0000-0000-0000-000000000002";
        let w = vec![6u8; 4000];
        let s1 = append(store, copied, 0, &w[..1000]).await;
        let s2 = append(store, copied, 1000, &w[1000..]).await;
        store
            .publish_staged(copied, &[s1, s2], 4000, &blob(&w))
            .await
            .unwrap();
        let died = "0000cccc-0000-0000-0000-000000000003";
        let seg = append(store, died, 0, &[7u8; 1500]).await;
        let found = store.unlinked_uploads().await.unwrap();
        let ours: Vec<_> = found
            .iter()
            .filter(|u| u.id.starts_with("0000cccc"))
            .collect();
        assert_eq!(
            ours,
            [&UnlinkedUpload {
                id: died.into(),
                key: format!("{DATA}{died}.{}", seg.name),
                bytes: 1500,
            }],
            "{found:?}"
        );
    }
}
