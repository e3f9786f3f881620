//! Blob uploads: POST (session, monolithic `?digest=`, cross-repository `?mount=&from=`),
//! PATCH (streamed, with or without `Content-Range`), PUT `?digest=` (verify, publish),
//! GET (status) and DELETE (cancel).
//!
//! Invariant: a session's acknowledged offset (its store record, `crate::uploads`) only
//! moves forward after the staged bytes up to it are durable; a request that fails
//! mid-stream leaves the staged data cut back to the acknowledged offset. Any replica
//! can serve any request of a session.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum::extract::Request;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;

use super::{header_str, param, query, request_stream, AppState};
use crate::api::error::{ApiError, ApiResult};
use crate::clock::now_unix;
use crate::registry::HashState;
use crate::store::{ByteStream, ObjectKey, StoreError, Version};
use crate::uploads::{SessionId, UploadSession};
use amber_oci::digest::{Algorithm, Digest};
use amber_oci::names::{parse_content_range, RepoName};

fn location(name: &RepoName, id: &SessionId) -> String {
    format!("/v2/{name}/blobs/uploads/{id}")
}

fn range_value(offset: u64) -> String {
    format!("0-{}", offset.saturating_sub(1))
}

/// 202 with the session's location and acknowledged range.
fn accepted(name: &RepoName, id: &SessionId, offset: u64, status: StatusCode) -> Response {
    (
        status,
        [
            (header::LOCATION, location(name, id)),
            (header::RANGE, range_value(offset)),
            (header::CONTENT_LENGTH, "0".to_string()),
            (
                header::HeaderName::from_static("docker-upload-uuid"),
                id.to_string(),
            ),
        ],
    )
        .into_response()
}

fn created(name: &RepoName, digest: &Digest) -> Response {
    (
        StatusCode::CREATED,
        [
            (header::LOCATION, format!("/v2/{name}/blobs/{digest}")),
            (header::CONTENT_LENGTH, "0".to_string()),
            (
                header::HeaderName::from_static("docker-content-digest"),
                digest.to_string(),
            ),
        ],
    )
        .into_response()
}

fn digest_param(q: &[(String, String)]) -> ApiResult<Option<Digest>> {
    param(q, "digest")
        .map(|d| {
            d.parse().map_err(|e: amber_oci::digest::DigestError| {
                ApiError::digest_invalid(e.to_string())
            })
        })
        .transpose()
}

/// `req` without its `mount`/`from` parameters when the caller may not read `from`.
pub fn drop_unreadable_mount(mut req: Request, readable: impl Fn(&str) -> bool) -> Request {
    let q = query(&req);
    match param(&q, "from") {
        Some(from) if param(&q, "mount").is_some() && !readable(from) => {
            let kept: Vec<_> = q
                .iter()
                .filter(|(k, _)| k != "mount" && k != "from")
                .collect();
            let qs = serde_urlencoded::to_string(kept).unwrap_or_default();
            let path = req.uri().path().to_string();
            let uri = if qs.is_empty() {
                path
            } else {
                format!("{path}?{qs}")
            };
            if let Ok(u) = uri.parse() {
                *req.uri_mut() = u;
            }
            req
        }
        _ => req,
    }
}

pub async fn start(reg: &AppState, name: RepoName, req: Request) -> ApiResult<Response> {
    let q = query(&req);
    if let Some(m) = param(&q, "mount") {
        let digest: Digest = m
            .parse()
            .map_err(|e: amber_oci::digest::DigestError| ApiError::digest_invalid(e.to_string()))?;
        if let Some(from) = param(&q, "from") {
            let from = RepoName::parse(from)?;
            if let Some(size) = reg.repo_blob(&from, &digest).await? {
                reg.link_blob(&name, &digest, size).await?;
                return Ok(created(&name, &digest));
            }
        }
        // Not mountable: fall back to a new session (202), as the spec allows.
    }
    let digest = if param(&q, "mount").is_some() {
        None
    } else {
        digest_param(&q)?
    };
    if let Some(digest) = &digest {
        let declared: Option<u64> =
            header_str(req.headers(), header::CONTENT_LENGTH).and_then(|v| v.parse().ok());
        let small = declared.filter(|&n| n <= SMALL_BLOB.min(reg.config.max_blob_bytes));
        if let (Some(n), None) = (small, req.headers().get(header::CONTENT_RANGE)) {
            return small_blob(reg, &name, digest.clone(), n, req).await;
        }
    }
    let id = SessionId::new();
    let mut session = UploadSession::new(name.as_str(), now_unix());
    let mut version = reg.put_upload_session(&id, &session, None).await?;
    match digest {
        None => Ok(accepted(&name, &id, 0, StatusCode::ACCEPTED)),
        Some(digest) => {
            let lock = reg.session_lock(&id.to_string());
            let mut state = lock.lock().await;
            append(reg, &id, &mut session, &mut version, &mut state, req).await?;
            complete(reg, &name, &id, &session, &mut state, digest).await
        }
    }
}

/// Session `id` of repository `name` and its record's version.
async fn load(
    reg: &AppState,
    name: &RepoName,
    id: &str,
) -> ApiResult<(SessionId, UploadSession, Version)> {
    let Some(sid) = SessionId::parse(id) else {
        return Err(ApiError::upload_unknown(id));
    };
    match reg.upload_session(&sid).await? {
        // A session a registry before named segments started: its bytes cannot be read
        // by name, so the client starts the upload again (expiry removes it).
        Some((s, _)) if s.unnamed() => Err(ApiError::upload_unknown(id)),
        Some((s, v)) if s.repo == name.as_str() => Ok((sid, s, v)),
        _ => Err(ApiError::upload_unknown(id)),
    }
}

/// The in-process lock of session `id` (one request at a time per session and replica),
/// for an id the registry could have made.
fn session_lock(reg: &AppState, id: &str) -> ApiResult<crate::registry::SessionLock> {
    match SessionId::parse(id) {
        Some(_) => Ok(reg.session_lock(id)),
        None => Err(ApiError::upload_unknown(id)),
    }
}

/// [`load`] under the session's lock; an unknown session's lock is forgotten again, so
/// requests for made-up ids leave nothing behind.
async fn load_locked(
    reg: &AppState,
    name: &RepoName,
    id: &str,
) -> ApiResult<(SessionId, UploadSession, Version)> {
    let loaded = load(reg, name, id).await;
    if loaded.is_err() {
        reg.forget_session(id);
    }
    loaded
}

pub async fn status(reg: &AppState, name: RepoName, id: String) -> ApiResult<Response> {
    let (id, s, _) = load(reg, &name, &id).await?;
    Ok(accepted(&name, &id, s.offset, StatusCode::NO_CONTENT))
}

pub async fn patch(
    reg: &AppState,
    name: RepoName,
    id: String,
    req: Request,
) -> ApiResult<Response> {
    let lock = session_lock(reg, &id)?;
    let mut state = lock.lock().await;
    // Read under the lock: another request may have moved or finished the session.
    let (id, mut s, mut version) = load_locked(reg, &name, &id).await?;
    append(reg, &id, &mut s, &mut version, &mut state, req).await?;
    Ok(accepted(&name, &id, s.offset, StatusCode::ACCEPTED))
}

pub async fn finish(
    reg: &AppState,
    name: RepoName,
    id: String,
    req: Request,
) -> ApiResult<Response> {
    let digest = digest_param(&query(&req))?.ok_or_else(|| {
        ApiError::digest_invalid(
            "completing an upload needs the blob's digest: PUT …?digest=<algorithm>:<hex>",
        )
    })?;
    let lock = session_lock(reg, &id)?;
    let mut state = lock.lock().await;
    let (id, mut s, mut version) = load_locked(reg, &name, &id).await?;
    append(reg, &id, &mut s, &mut version, &mut state, req).await?;
    complete(reg, &name, &id, &s, &mut state, digest).await
}

pub async fn cancel(reg: &AppState, name: RepoName, id: String) -> ApiResult<Response> {
    let lock = session_lock(reg, &id)?;
    let _state = lock.lock().await;
    let (id, s, _) = load_locked(reg, &name, &id).await?;
    reg.drop_upload_session(&id, &s).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// At most this much of a refused request's body is read and discarded so that the
/// client, still sending, reads the error instead of a reset connection.
const DRAIN_LIMIT: u64 = 256 << 20;
/// And for at most this long.
const DRAIN_TIME: std::time::Duration = std::time::Duration::from_secs(30);

/// Appends the request body to session `id` and acknowledges it.
///
/// On an error the rest of the body is read and discarded (bounded by [`DRAIN_LIMIT`]
/// and [`DRAIN_TIME`]) before the error is answered: an HTTP/1.1 client that is still
/// writing a body the server stopped reading sees a broken pipe, not the 507 or 413
/// that says what to do.
async fn append(
    reg: &AppState,
    id: &SessionId,
    s: &mut UploadSession,
    version: &mut Version,
    state: &mut Option<HashState>,
    req: Request,
) -> ApiResult<()> {
    let headers = req.headers().clone();
    let body = Arc::new(std::sync::Mutex::new(request_stream(req)));
    let shared = body.clone();
    let stream: ByteStream = Box::pin(futures_util::stream::poll_fn(move |cx| {
        shared
            .lock()
            .expect("request body lock poisoned")
            .poll_next_unpin(cx)
    }));
    let res = append_stream(reg, id, s, version, state, &headers, stream).await;
    if res.is_err() {
        drain(&body).await;
    }
    res
}

/// Reads and discards what is left of `body`, within [`DRAIN_LIMIT`] and [`DRAIN_TIME`].
async fn drain(body: &std::sync::Mutex<ByteStream>) {
    let mut left = DRAIN_LIMIT;
    let read = async {
        loop {
            let next = futures_util::future::poll_fn(|cx| {
                body.lock()
                    .expect("request body lock poisoned")
                    .poll_next_unpin(cx)
            })
            .await;
            match next {
                Some(Ok(b)) if (b.len() as u64) < left => left -= b.len() as u64,
                _ => return,
            }
        }
    };
    let _ = tokio::time::timeout(DRAIN_TIME, read).await;
}

async fn append_stream(
    reg: &AppState,
    sid: &SessionId,
    s: &mut UploadSession,
    version: &mut Version,
    state: &mut Option<HashState>,
    headers: &HeaderMap,
    body: ByteStream,
) -> ApiResult<()> {
    let name = RepoName::parse(&s.repo)?;
    let staged_id = sid.to_string();
    let id = staged_id.as_str();
    let declared_len: Option<u64> =
        header_str(headers, header::CONTENT_LENGTH).and_then(|v| v.parse().ok());
    let mut expect_len = None;
    if let Some(cr) = header_str(headers, header::CONTENT_RANGE) {
        let (start, end) = parse_content_range(cr).ok_or_else(|| {
            ApiError::upload_invalid(format!(
                "Content-Range {cr:?} is malformed; expected <start>-<end>"
            ))
        })?;
        if start != s.offset {
            return Err(ApiError::new(
                StatusCode::RANGE_NOT_SATISFIABLE,
                "BLOB_UPLOAD_INVALID",
                format!(
                    "chunk starts at byte {start} but the upload has {} bytes; resume at {}",
                    s.offset, s.offset
                ),
            )
            .with_header(header::RANGE, &range_value(s.offset))
            .with_header(header::LOCATION, &location(&name, sid)));
        }
        let n = end - start + 1;
        if declared_len.is_some_and(|cl| cl != n) {
            return Err(ApiError::upload_invalid(format!(
                "Content-Range {cr:?} covers {n} bytes but Content-Length is {}",
                declared_len.unwrap_or(0)
            )));
        }
        expect_len = Some(n);
    }
    let max = reg.config.max_blob_bytes;
    let room = max.saturating_sub(s.offset);
    if let Some(n) = expect_len.or(declared_len).filter(|&n| n > room) {
        return Err(too_large(max, s.offset, n));
    }
    let _slot = upload_slot(reg)?;
    // Staged bytes past the acknowledged offset belong to a request that never finished:
    // the store appends after the acknowledged offset and drops them.
    let mut hs = if s.offset == 0 {
        Some(HashState::new())
    } else {
        state.take().filter(|h| h.hashed == s.offset)
    };
    let exceeded = Arc::new(AtomicBool::new(false));
    metrics::gauge!(crate::metrics::UPLOADS_IN_FLIGHT).increment(1.0);
    let res = reg
        .store
        .append_staged(
            id,
            s.offset,
            limited(body, room, &exceeded),
            expect_len.or(declared_len),
            &mut |chunk: &[u8]| {
                if let Some(h) = hs.as_mut() {
                    h.hasher.update(chunk);
                    h.hashed += chunk.len() as u64;
                }
                metrics::counter!(crate::metrics::BYTES_IN).increment(chunk.len() as u64);
            },
        )
        .await;
    metrics::gauge!(crate::metrics::UPLOADS_IN_FLIGHT).decrement(1.0);
    // On an error nothing of this append is visible (the store's promise), so the
    // session is as it was.
    let (written, segment) = match res {
        Ok(a) => (a.len - s.offset, a.segment),
        Err(e) => {
            *state = None;
            return Err(match e {
                StoreError::Body(_) if exceeded.load(Ordering::Relaxed) => {
                    too_large(max, s.offset, room + 1)
                }
                StoreError::Body(err) => ApiError::upload_invalid(format!(
                    "the request body ended early ({err}); the upload keeps its first {} bytes, resume from there",
                    s.offset
                )),
                StoreError::OffsetMismatch { .. } | StoreError::NotFound(_) => {
                    // The staged data is gone (published just before a crash, or removed).
                    reg.drop_upload_session(sid, s).await?;
                    ApiError::upload_unknown(id)
                }
                other => other.into(),
            });
        }
    };
    if let Some(n) = expect_len.filter(|&n| n != written) {
        *state = None;
        if let Some(seg) = &segment {
            reg.store.discard_segment(id, seg).await?;
        }
        return Err(ApiError::upload_invalid(format!(
            "Content-Range announced {n} bytes but the body had {written}"
        )));
    }
    if let Some(seg) = segment {
        let mut moved = s.clone();
        moved.offset += written;
        moved.updated_unix = now_unix();
        moved.segments.push(seg.clone());
        match reg.put_upload_session(sid, &moved, Some(version)).await {
            Ok(v) => {
                *version = v;
                *s = moved;
            }
            Err(e) => {
                // Another request moved (or finished) the session meanwhile: this one's
                // bytes are not the upload's, and its segment goes.
                *state = None;
                if let Err(d) = reg.store.discard_segment(id, &seg).await {
                    tracing::warn!(upload = id, error = %d, "dropping a segment that lost its compare-and-swap");
                }
                return Err(e.into());
            }
        }
    }
    *state = hs;
    Ok(())
}

/// 413 for an upload that would pass `max_blob_bytes`; the session keeps `offset`.
fn too_large(max: u64, offset: u64, more: u64) -> ApiError {
    ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "SIZE_INVALID",
        format!(
            "the blob would pass {max} bytes (max_blob_bytes): it has {offset} and {more} more were sent; the upload keeps its first {offset} bytes"
        ),
    )
}

/// `body` cut off with an error (and `exceeded` set) past `room` bytes.
fn limited(body: ByteStream, room: u64, exceeded: &Arc<AtomicBool>) -> ByteStream {
    let exceeded = exceeded.clone();
    let mut seen = 0u64;
    Box::pin(body.map(move |r| {
        let b = r?;
        seen += b.len() as u64;
        if seen > room {
            exceeded.store(true, Ordering::Relaxed);
            return Err(std::io::Error::other("the blob passes max_blob_bytes"));
        }
        Ok(b)
    }))
}

/// A monolithic upload (POST `?digest=`) of at most this many bytes, by its Content-Length,
/// is read into memory, verified and published under its digest in one write: no upload
/// session, no staged object. On S3 that is one PUT instead of a session record written
/// three times, a staged object, a listing and a link (config blobs and small task
/// layers are most blobs of a registry of task images). Memory: this times
/// `max_concurrent_uploads` at most.
const SMALL_BLOB: u64 = 1 << 20;

/// Reads a monolithic upload of `n` declared bytes, verifies it against `digest`, and
/// publishes it. A body that does not match its digest or its length stores nothing.
async fn small_blob(
    reg: &AppState,
    name: &RepoName,
    digest: Digest,
    n: u64,
    req: Request,
) -> ApiResult<Response> {
    let _slot = upload_slot(reg)?;
    let mut body = crate::store::exactly(request_stream(req), n);
    let mut bytes = bytes::BytesMut::with_capacity(n as usize);
    metrics::gauge!(crate::metrics::UPLOADS_IN_FLIGHT).increment(1.0);
    let read = async {
        while let Some(chunk) = body.next().await {
            let chunk = chunk?;
            metrics::counter!(crate::metrics::BYTES_IN).increment(chunk.len() as u64);
            bytes.extend_from_slice(&chunk);
        }
        Ok::<(), std::io::Error>(())
    }
    .await;
    metrics::gauge!(crate::metrics::UPLOADS_IN_FLIGHT).decrement(1.0);
    read.map_err(|e| {
        ApiError::upload_invalid(format!(
            "the request body did not match its Content-Length of {n} bytes ({e}); nothing was stored"
        ))
    })?;
    let bytes = bytes.freeze();
    let mut hasher = digest.algorithm().hasher();
    hasher.update(&bytes);
    let actual = hasher.finish();
    if actual != digest {
        return Err(ApiError::digest_invalid(format!(
            "the uploaded {n} bytes have digest {actual}, not {digest}; nothing was stored"
        )));
    }
    if !kept_as_recipe(reg, &digest).await? {
        reg.store.put(&ObjectKey::blob(&digest), bytes).await?;
    }
    reg.link_blob(name, &digest, n).await?;
    Ok(created(name, &digest))
}

/// Whether `digest` is a layer this registry keeps as a recipe (`crate::recipe`): its
/// bytes are not stored again.
async fn kept_as_recipe(reg: &AppState, digest: &Digest) -> ApiResult<bool> {
    Ok(reg.index.blob_size(digest)?.is_some()
        && reg.store.stat(&ObjectKey::recipe(digest)).await?.is_some())
}

/// One of the `max_concurrent_uploads` slots, or 429.
fn upload_slot(reg: &AppState) -> ApiResult<tokio::sync::OwnedSemaphorePermit> {
    reg.upload_slots.clone().try_acquire_owned().map_err(|_| {
        ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "TOOMANYREQUESTS",
            format!(
                "{} uploads are in progress (max_concurrent_uploads); retry",
                reg.config.max_concurrent_uploads
            ),
        )
        .with_header(header::RETRY_AFTER, "1")
    })
}

/// Verifies the staged bytes against `digest` and publishes them as the blob.
async fn complete(
    reg: &AppState,
    name: &RepoName,
    sid: &SessionId,
    s: &UploadSession,
    state: &mut Option<HashState>,
    digest: Digest,
) -> ApiResult<Response> {
    let staged_id = sid.to_string();
    let id = staged_id.as_str();
    let actual = match state.take() {
        Some(h) if h.hashed == s.offset && digest.algorithm() == Algorithm::Sha256 => {
            h.hasher.finish()
        }
        _ => {
            let mut hasher = digest.algorithm().hasher();
            let mut stream = reg.store.read_staged(id, &s.segments, s.offset).await?;
            while let Some(chunk) = stream.next().await {
                hasher.update(&chunk.map_err(|e| ApiError::internal("reading staged upload", e))?);
            }
            hasher.finish()
        }
    };
    if actual != digest {
        reg.drop_upload_session(sid, s).await?;
        return Err(ApiError::digest_invalid(format!(
            "the uploaded {} bytes have digest {actual}, not {digest}; the upload was discarded",
            s.offset
        )));
    }
    // A layer this registry keeps as a recipe (`crate::recipe`) is not stored again.
    if kept_as_recipe(reg, &digest).await? {
        reg.store.remove_staged(id, &s.segments).await?;
        reg.finish_upload_session(sid).await?;
    } else {
        // The session ends before its bytes are published: a store may publish them
        // where they are staged (s3 links them), and an expired or cancelled session
        // removes its staged data, so a session must never outlive their publishing.
        // A crash in between loses this upload (the client starts it again), not a blob.
        reg.finish_upload_session(sid).await?;
        reg.store
            .publish_staged(id, &s.segments, s.offset, &ObjectKey::blob(&digest))
            .await?;
    }
    reg.link_blob(name, &digest, s.offset).await?;
    Ok(created(name, &digest))
}
