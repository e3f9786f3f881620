//! Manifests over HTTP: GET/HEAD by tag or digest (the exact bytes pushed, with their
//! stored media type) and PUT, which reads a bounded body and hands it to the repository
//! layer (`crate::repository::push_manifest`).

use axum::extract::Request;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures_util::StreamExt;

use super::{header_str, AppState};
use crate::api::error::{ApiError, ApiResult};
use crate::index::ManifestRecord;
use amber_oci::digest::Digest;
use amber_oci::names::{Reference, RepoName};

/// The manifest `r` names in `name`, if the repository holds it.
async fn lookup(
    reg: &AppState,
    name: &RepoName,
    r: &Reference,
) -> ApiResult<Option<(Digest, ManifestRecord)>> {
    match target(reg, name, r).await? {
        Some(digest) => record(reg, name, digest).await,
        None => Ok(None),
    }
}

/// The digest `r` names in `name` now: itself, or where the tag points.
async fn target(reg: &AppState, name: &RepoName, r: &Reference) -> ApiResult<Option<Digest>> {
    Ok(match r {
        Reference::Digest(d) => Some(d.clone()),
        Reference::Tag(t) => reg.tag(name, t).await?,
    })
}

/// Manifest `digest` with `name`'s record of it, if the repository holds it.
async fn record(
    reg: &AppState,
    name: &RepoName,
    digest: Digest,
) -> ApiResult<Option<(Digest, ManifestRecord)>> {
    Ok(reg.manifest(name, &digest).await?.map(|rec| (digest, rec)))
}

/// The manifest `r` names in `name`; pulled through from the upstream first when
/// `name` mirrors one and does not hold it yet.
pub async fn find(
    reg: &AppState,
    name: &RepoName,
    r: &Reference,
) -> ApiResult<(Digest, ManifestRecord)> {
    match lookup(reg, name, r).await? {
        Some(found) => Ok(found),
        None => pull_through(reg, name, r).await,
    }
}

/// [`find`] once `name` was found not to hold what `r` names.
async fn pull_through(
    reg: &AppState,
    name: &RepoName,
    r: &Reference,
) -> ApiResult<(Digest, ManifestRecord)> {
    if crate::upstream::pull_through(reg, name, r)
        .await
        .map_err(ApiError::upstream)?
    {
        if let Some(found) = lookup(reg, name, r).await? {
            return Ok(found);
        }
    }
    Err(ApiError::manifest_unknown(match r {
        Reference::Tag(t) => format!("{name}:{t}"),
        Reference::Digest(d) => format!("{name}@{d}"),
    }))
}

/// What a GET or HEAD of a manifest answers with.
struct Served {
    digest: Digest,
    media_type: String,
    size: u64,
    /// The manifest's bytes, when read (always for a GET).
    bytes: Option<Bytes>,
}

/// What `get` answers with through `name`'s record of the manifest `target` names (`r`
/// resolved), pulled through from the upstream when the repository does not hold it; the
/// bytes are read for a GET only.
async fn through_record(
    reg: &AppState,
    name: &RepoName,
    r: &Reference,
    target: Option<Digest>,
    head: bool,
) -> ApiResult<Served> {
    let found = match target {
        Some(digest) => record(reg, name, digest).await?,
        None => None,
    };
    let (digest, rec) = match found {
        Some(found) => found,
        None => pull_through(reg, name, r).await?,
    };
    let bytes = match head {
        true => None,
        false => Some(reg.manifest_bytes(&digest).await?),
    };
    Ok(Served {
        digest,
        media_type: rec.media_type,
        size: rec.size,
        bytes,
    })
}

/// GET or HEAD of manifest `r` in `name`. By tag, the manifest's bytes held in memory or
/// in the index answer with the media type they declare (`Registry::held_manifest`),
/// without the repository's record of the manifest; otherwise the record gives the media
/// type and size, and a GET reads the bytes after it.
pub async fn get(reg: &AppState, name: RepoName, r: Reference, head: bool) -> ApiResult<Response> {
    let target = target(reg, &name, &r).await?;
    let held = match (&r, &target) {
        (Reference::Tag(_), Some(digest)) => {
            reg.held_manifest(digest)?
                .map(|(media_type, bytes)| Served {
                    digest: digest.clone(),
                    media_type,
                    size: bytes.len() as u64,
                    bytes: Some(bytes),
                })
        }
        _ => None,
    };
    let served = match held {
        Some(served) => served,
        None => through_record(reg, &name, &r, target, head).await?,
    };
    let body = match served.bytes {
        Some(bytes) if !head => {
            metrics::counter!(crate::metrics::BYTES_OUT).increment(bytes.len() as u64);
            axum::body::Body::from(bytes)
        }
        _ => axum::body::Body::empty(),
    };
    Ok(Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, served.media_type)
        .header(header::CONTENT_LENGTH, served.size)
        .header(header::ETAG, format!("\"{}\"", served.digest))
        .header("Docker-Content-Digest", served.digest.to_string())
        .body(body)
        .map_err(|e| ApiError::internal("response", e))?
        .into_response())
}

/// Reads a request body of at most `limit` bytes.
async fn read_limited(req: Request, limit: usize) -> ApiResult<bytes::Bytes> {
    let mut body = req.into_body().into_data_stream();
    let mut buf = bytes::BytesMut::new();
    while let Some(chunk) = body.next().await {
        let chunk =
            chunk.map_err(|e| ApiError::manifest_invalid(format!("reading manifest body: {e}")))?;
        if buf.len() + chunk.len() > limit {
            return Err(ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "MANIFEST_INVALID",
                format!("manifest is larger than this registry's limit of {limit} bytes"),
            ));
        }
        buf.extend_from_slice(&chunk);
    }
    metrics::counter!(crate::metrics::BYTES_IN).increment(buf.len() as u64);
    Ok(buf.freeze())
}

pub async fn put(
    reg: &AppState,
    name: RepoName,
    r: Reference,
    req: Request,
) -> ApiResult<Response> {
    let content_type = header_str(req.headers(), header::CONTENT_TYPE).map(str::to_string);
    let bytes = read_limited(req, reg.config.max_manifest_bytes).await?;
    let pushed =
        crate::repository::push_manifest(reg, &name, &r, bytes, content_type.as_deref()).await?;
    let (digest, parsed) = (pushed.digest, pushed.parsed);
    let mut resp = (
        StatusCode::CREATED,
        [
            (header::LOCATION, format!("/v2/{name}/manifests/{digest}")),
            (header::CONTENT_LENGTH, "0".to_string()),
        ],
    )
        .into_response();
    let h = resp.headers_mut();
    h.insert(
        "Docker-Content-Digest",
        digest
            .to_string()
            .parse()
            .expect("digest is a header value"),
    );
    if let Some(s) = &parsed.subject {
        h.insert(
            "OCI-Subject",
            s.digest
                .to_string()
                .parse()
                .expect("digest is a header value"),
        );
    }
    Ok(resp)
}
