//! Manifests over HTTP: GET/HEAD by tag or digest (the exact bytes pushed, with their
//! stored media type) and PUT, which reads a bounded body and hands it to the repository
//! layer (`crate::repository::push_manifest`).

use axum::extract::Request;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
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
    let digest = match r {
        Reference::Digest(d) => d.clone(),
        Reference::Tag(t) => match reg.tag(name, t).await? {
            Some(d) => d,
            None => return Ok(None),
        },
    };
    Ok(reg.manifest(name, &digest).await?.map(|rec| (digest, rec)))
}

/// The manifest `r` names in `name`; pulled through from the upstream first when
/// `name` mirrors one and does not hold it yet.
pub async fn find(
    reg: &AppState,
    name: &RepoName,
    r: &Reference,
) -> ApiResult<(Digest, ManifestRecord)> {
    if let Some(found) = lookup(reg, name, r).await? {
        return Ok(found);
    }
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

pub async fn get(reg: &AppState, name: RepoName, r: Reference, head: bool) -> ApiResult<Response> {
    let (digest, rec) = find(reg, &name, &r).await?;
    let builder = Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, &rec.media_type)
        .header(header::CONTENT_LENGTH, rec.size)
        .header(header::ETAG, format!("\"{digest}\""))
        .header("Docker-Content-Digest", digest.to_string());
    let body = if head {
        axum::body::Body::empty()
    } else {
        let bytes = reg.manifest_bytes(&digest).await?;
        metrics::counter!(crate::metrics::BYTES_OUT).increment(bytes.len() as u64);
        axum::body::Body::from(bytes)
    };
    Ok(builder
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
