//! The amber API under `/amber/v1/` over HTTP; its types and paths are `amber_api::registry`'s.

use amber_api::registry::{ImportRequest, Resolve, IMPORTS_PATH};
use amber_converter::manifest::{ChunkId, EnvDigest};
use amber_oci::reference::ImageRef;
use axum::extract::Request;
use axum::http::{header, Method, StatusCode};
use axum::response::{IntoResponse, Response};

use super::{header_str, AppState};
use crate::api::error::{ApiError, ApiResult};
use crate::auth::{Action, Principal};
use crate::store::ObjectKey;
use amber_oci::names::{Reference, RepoName};

const IMMUTABLE: &str = "public, max-age=31536000, immutable";

pub async fn dispatch(
    reg: &AppState,
    req: Request,
    principal: Option<Principal>,
) -> ApiResult<Response> {
    let path = req.uri().path().to_string();
    let rest = path.strip_prefix("/amber/v1/").ok_or_else(not_found)?;
    let head = req.method() == Method::HEAD;
    if path == IMPORTS_PATH {
        if req.method() != Method::POST {
            return Err(ApiError::unsupported(format!("{IMPORTS_PATH} takes POST")));
        }
        return imports(reg, req, principal).await;
    }
    if req.method() != Method::GET && !head {
        drop(req);
        return Err(ApiError::unsupported(
            "the amber API is read-only but for POST /amber/v1/imports",
        ));
    }
    if let Some(r) = rest.strip_prefix("resolve/") {
        let (name, reference) = r.rsplit_once('/').ok_or_else(not_found)?;
        let (name, reference) = (RepoName::parse(name)?, Reference::parse(reference)?);
        return resolve(reg, name, reference, principal.as_ref()).await;
    }
    if let Some(d) = rest.strip_prefix("envs/") {
        let env: EnvDigest = d
            .parse()
            .map_err(|e: amber_converter::manifest::BadBlake3| {
                ApiError::digest_invalid(e.to_string())
            })?;
        return env_manifest(reg, env).await;
    }
    if let Some(c) = rest.strip_prefix("chunks/") {
        let id: ChunkId = c
            .parse()
            .map_err(|e: amber_converter::manifest::BadBlake3| {
                ApiError::digest_invalid(e.to_string())
            })?;
        let range = header_str(req.headers(), header::RANGE).map(str::to_string);
        return chunk(reg, id, range.as_deref(), head).await;
    }
    Err(not_found())
}

fn not_found() -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "NOT_FOUND",
        "no such amber API endpoint",
    )
}

/// A short name (`python`, `team/app`) that no repository here has: Docker Hub's image
/// of that name (`docker.io/library/python`) when Docker Hub is an upstream.
async fn docker_hub_name(reg: &AppState, name: &RepoName) -> ApiResult<Option<RepoName>> {
    if !reg.upstreams.has_docker_hub()
        || reg.upstreams.for_repo(name).is_some()
        || reg.index.repo_exists(name)?
    {
        return Ok(None);
    }
    let hub = match ImageRef::parse(&format!("docker.io/{name}")) {
        Ok(ImageRef::Image(n)) => n.mirror_repository(),
        _ => None,
    };
    Ok(hub)
}

async fn resolve(
    reg: &AppState,
    name: RepoName,
    r: Reference,
    principal: Option<&Principal>,
) -> ApiResult<Response> {
    let (name, (digest, rec)) = match super::manifests::find(reg, &name, &r).await {
        Ok(found) => (name, found),
        Err(e) if e.status == StatusCode::NOT_FOUND => match docker_hub_name(reg, &name).await? {
            // The caller was checked for `name`; Docker Hub's mirror needs its own right.
            Some(hub) if principal.is_none_or(|p| p.may(Action::Pull, hub.as_str())) => {
                let found = super::manifests::find(reg, &hub, &r).await?;
                (hub, found)
            }
            _ => return Err(e),
        },
        Err(e) => return Err(e),
    };
    // An index resolves to its linux/amd64 image.
    let found = crate::repository::image_conversion(reg, &digest, &rec.media_type)
        .await
        .map_err(lookup_error)?;
    let body = Resolve {
        name: name.to_string(),
        reference: r.to_string(),
        manifest_digest: digest,
        image_digest: found.image,
        env_digest: found.env,
        state: found.state,
        error: found.record.and_then(|c| c.error),
        source: rec.source,
    };
    Ok((StatusCode::OK, axum::Json(body)).into_response())
}

fn lookup_error(e: crate::repository::LookupError) -> ApiError {
    use crate::repository::LookupError;
    match e {
        LookupError::NoLinuxAmd64(_) => {
            ApiError::new(StatusCode::NOT_FOUND, "MANIFEST_UNKNOWN", e.to_string())
        }
        LookupError::Record(e) => e.into(),
        LookupError::Store(e) => e.into(),
        LookupError::Index(e) => e.into(),
        e => ApiError::internal("looking up the image's conversion", e),
    }
}

async fn env_manifest(reg: &AppState, env: EnvDigest) -> ApiResult<Response> {
    let key = ObjectKey::env(&env);
    let bytes = match reg.store.read_all(&key).await {
        Ok(b) => b,
        Err(crate::store::StoreError::NotFound(_)) => {
            return Err(ApiError::new(
                StatusCode::NOT_FOUND,
                "ENV_UNKNOWN",
                format!("env {env} is not in this registry"),
            ))
        }
        Err(e) => return Err(e.into()),
    };
    let bytes = crate::convert::decode_envelope(&bytes)
        .map_err(|e| ApiError::internal(&format!("envelope of {env}"), e))?;
    Ok((
        StatusCode::OK,
        [
            (
                header::CONTENT_TYPE,
                crate::convert::BLOCK_MANIFEST_TYPE.to_string(),
            ),
            (header::CACHE_CONTROL, IMMUTABLE.to_string()),
            (header::ETAG, format!("\"{env}\"")),
        ],
        bytes,
    )
        .into_response())
}

async fn chunk(
    reg: &AppState,
    id: ChunkId,
    range: Option<&str>,
    head: bool,
) -> ApiResult<Response> {
    let key = ObjectKey::chunk(&id);
    let unknown = || {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "CHUNK_UNKNOWN",
            format!("chunk {id} is not in this registry"),
        )
    };
    // Recompression (`crate::recompress`) may replace a chunk's object between a stat and
    // a read: a GET served here reads the chunk whole (one encoding, at most about 1 MiB)
    // and answers from those bytes. A HEAD, or a redirect to the bucket (S3 replaces an
    // object atomically), needs only the size.
    let (size, bytes) = if head || reg.config.s3.redirect.unwrap_or(false) {
        (reg.store.stat(&key).await?.ok_or_else(unknown)?, None)
    } else {
        match reg.store.read_all(&key).await {
            Ok(b) => (b.len() as u64, Some(b)),
            Err(crate::store::StoreError::NotFound(_)) => return Err(unknown()),
            Err(e) => return Err(e.into()),
        }
    };
    super::blobs::serve_object(
        reg,
        super::blobs::ObjectResponse {
            key,
            size,
            range,
            head,
            content_type: "application/zstd",
            // The encoding, not only the content: recompression replaces a chunk's bytes
            // by a strictly smaller frame, so id and size name the bytes served.
            etag: format!("{id}.{size}"),
            extra: Vec::new(),
            bytes,
        },
    )
    .await
}

/// The most an import request may take (its list of sources and credentials).
const MAX_IMPORT_REQUEST: usize = 4 << 20;

/// `POST /amber/v1/imports`: runs the import in the background and answers with its
/// events, one JSON object per line. The import goes on if the client goes away.
async fn imports(
    reg: &AppState,
    req: Request,
    principal: Option<Principal>,
) -> ApiResult<Response> {
    let bytes = axum::body::to_bytes(req.into_body(), MAX_IMPORT_REQUEST)
        .await
        .map_err(|e| {
            ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "SIZE_INVALID",
                format!("an import request is at most {MAX_IMPORT_REQUEST} bytes: {e}"),
            )
        })?;
    let request: ImportRequest = serde_json::from_slice(&bytes).map_err(|e| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "UNSUPPORTED",
            format!("the import request is not an ImportRequest: {e}"),
        )
    })?;
    if request.sources.is_empty() {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "UNSUPPORTED",
            "the import request names no sources",
        ));
    }
    if let Some(p) = &principal {
        for s in &request.sources {
            let target = match ImageRef::parse(s.trim()).map(|r| r.docker_normalized()) {
                Ok(ImageRef::Image(n)) => n.mirror_repository(),
                _ => None,
            };
            // Unparseable sources are reported in the answer, as failed images.
            if let Some(t) = target.filter(|t| !p.may(Action::Push, t.as_str())) {
                return Err(ApiError::new(
                    StatusCode::FORBIDDEN,
                    "DENIED",
                    format!("importing {s} writes {t}, which this account may not push to"),
                ));
            }
        }
    }
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let reg = reg.clone();
    tokio::spawn(async move { crate::upstream::import(&reg, request, tx).await });
    let lines = event_lines(rx);
    Ok((
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        axum::body::Body::from_stream(lines),
    )
        .into_response())
}

/// Each event as one JSON line.
fn event_lines(
    mut rx: tokio::sync::mpsc::UnboundedReceiver<amber_api::registry::ImportEvent>,
) -> impl futures_util::Stream<Item = Result<bytes::Bytes, std::convert::Infallible>> {
    futures_util::stream::poll_fn(move |cx| {
        rx.poll_recv(cx).map(|e| {
            e.map(|e| {
                let mut line = serde_json::to_vec(&e).expect("events serialize");
                line.push(b'\n');
                Ok(bytes::Bytes::from(line))
            })
        })
    })
}
