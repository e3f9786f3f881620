//! Manifests: GET/HEAD by tag or digest (the exact bytes pushed, with their stored media
//! type) and PUT with validation, tag update and referrer indexing.

use axum::extract::Request;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use serde_json::Value;

use super::{header_str, AppState};
use crate::digest::{Algorithm, Digest};
use crate::error::{ApiError, ApiResult};
use crate::index::{ManifestRecord, ManifestWrite};
use crate::names::{Reference, RepoName};
use crate::store::ObjectKey;

pub const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
pub const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
pub const DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
pub const DOCKER_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";

/// The kinds of manifest this registry stores.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ManifestKind {
    /// OCI image manifest or Docker schema 2 manifest: config + layers.
    Image,
    /// OCI image index or Docker manifest list: child manifests.
    Index,
}

fn kind_of(media_type: &str) -> Option<ManifestKind> {
    match media_type {
        OCI_MANIFEST | DOCKER_MANIFEST => Some(ManifestKind::Image),
        OCI_INDEX | DOCKER_LIST => Some(ManifestKind::Index),
        _ => None,
    }
}

/// A descriptor's fields that the registry checks.
pub struct Descriptor {
    pub media_type: String,
    pub digest: Digest,
    pub size: u64,
    pub has_urls: bool,
}

fn descriptor(v: &Value, what: &str) -> ApiResult<Descriptor> {
    let bad = |m: &str| ApiError::manifest_invalid(format!("{what}: {m}"));
    let o = v.as_object().ok_or_else(|| bad("not an object"))?;
    let media_type = o
        .get("mediaType")
        .and_then(Value::as_str)
        .ok_or_else(|| bad("mediaType missing"))?
        .to_string();
    let digest = o
        .get("digest")
        .and_then(Value::as_str)
        .ok_or_else(|| bad("digest missing"))?
        .parse()
        .map_err(|e: crate::digest::DigestError| bad(&e.to_string()))?;
    let size = o
        .get("size")
        .and_then(Value::as_u64)
        .ok_or_else(|| bad("size missing or not a non-negative integer"))?;
    let has_urls = o
        .get("urls")
        .is_some_and(|u| u.as_array().is_some_and(|a| !a.is_empty()));
    Ok(Descriptor {
        media_type,
        digest,
        size,
        has_urls,
    })
}

/// Layers that clients may not push (their bytes live elsewhere).
fn non_distributable(media_type: &str) -> bool {
    media_type.contains("nondistributable") || media_type.contains(".foreign.")
}

/// What a validated manifest says that the index needs.
pub struct ParsedManifest {
    pub media_type: String,
    pub kind: ManifestKind,
    pub subject: Option<Descriptor>,
    pub artifact_type: Option<String>,
    pub annotations: Option<Value>,
    /// Blobs (config, layers) this manifest needs in the repository.
    pub blobs: Vec<Descriptor>,
    /// Child manifests (of an index).
    pub children: Vec<Descriptor>,
    /// The whole document, for fields the registry does not model (platforms).
    pub document: Value,
}

/// Validates manifest bytes sent with `content_type`. Pure; no storage access.
pub fn parse_manifest(bytes: &[u8], content_type: Option<&str>) -> ApiResult<ParsedManifest> {
    let v: Value = serde_json::from_slice(bytes)
        .map_err(|e| ApiError::manifest_invalid(format!("manifest is not valid JSON: {e}")))?;
    let o = v
        .as_object()
        .ok_or_else(|| ApiError::manifest_invalid("manifest is not a JSON object"))?;
    if o.get("schemaVersion").and_then(Value::as_u64) != Some(2) {
        return Err(ApiError::manifest_invalid(
            "schemaVersion must be 2 (Docker schema 1 manifests are not supported)",
        ));
    }
    let field = o.get("mediaType").and_then(Value::as_str);
    let header = content_type
        .map(|c| c.split(';').next().unwrap_or("").trim())
        .filter(|c| kind_of(c).is_some());
    let media_type = match (header, field) {
        (Some(h), Some(f)) if h != f => {
            return Err(ApiError::manifest_invalid(format!(
                "Content-Type {h} does not match the manifest's mediaType {f}"
            )))
        }
        (Some(h), _) => h.to_string(),
        (None, Some(f)) => f.to_string(),
        (None, None) => {
            return Err(ApiError::manifest_invalid(format!(
                "unsupported manifest media type {:?}; this registry stores {OCI_MANIFEST}, {OCI_INDEX}, {DOCKER_MANIFEST} and {DOCKER_LIST}",
                content_type.unwrap_or("")
            )))
        }
    };
    let kind = kind_of(&media_type).ok_or_else(|| {
        ApiError::manifest_invalid(format!("unsupported manifest media type {media_type:?}"))
    })?;
    let subject = o
        .get("subject")
        .map(|s| descriptor(s, "subject"))
        .transpose()?;
    let mut blobs = Vec::new();
    let mut children = Vec::new();
    let mut artifact_type = o
        .get("artifactType")
        .and_then(Value::as_str)
        .map(str::to_string);
    match kind {
        ManifestKind::Image => {
            let config = descriptor(o.get("config").unwrap_or(&Value::Null), "config")?;
            if artifact_type.is_none() {
                artifact_type = Some(config.media_type.clone());
            }
            blobs.push(config);
            let layers = o
                .get("layers")
                .and_then(Value::as_array)
                .ok_or_else(|| ApiError::manifest_invalid("layers missing or not an array"))?;
            for (i, l) in layers.iter().enumerate() {
                blobs.push(descriptor(l, &format!("layers[{i}]"))?);
            }
        }
        ManifestKind::Index => {
            let ms = o
                .get("manifests")
                .and_then(Value::as_array)
                .ok_or_else(|| ApiError::manifest_invalid("manifests missing or not an array"))?;
            for (i, m) in ms.iter().enumerate() {
                children.push(descriptor(m, &format!("manifests[{i}]"))?);
            }
        }
    }
    Ok(ParsedManifest {
        media_type,
        kind,
        subject,
        artifact_type,
        annotations: o.get("annotations").cloned(),
        blobs,
        children,
        document: v,
    })
}

async fn resolve(reg: &AppState, name: &RepoName, r: &Reference) -> ApiResult<Digest> {
    match r {
        Reference::Digest(d) => Ok(d.clone()),
        Reference::Tag(t) => reg
            .tag(name, t)
            .await?
            .ok_or_else(|| ApiError::manifest_unknown(format!("{name}:{t}"))),
    }
}

pub async fn get(reg: &AppState, name: RepoName, r: Reference, head: bool) -> ApiResult<Response> {
    let digest = resolve(reg, &name, &r).await?;
    let rec = reg
        .manifest(&name, &digest)
        .await?
        .ok_or_else(|| ApiError::manifest_unknown(format!("{name}@{digest}")))?;
    let builder = Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, &rec.media_type)
        .header(header::CONTENT_LENGTH, rec.size)
        .header(header::ETAG, format!("\"{digest}\""))
        .header("Docker-Content-Digest", digest.to_string());
    let body = if head {
        axum::body::Body::empty()
    } else {
        let bytes = reg.store.read_all(&ObjectKey::blob(&digest)).await?;
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
    let parsed = parse_manifest(&bytes, content_type.as_deref())?;
    let digest = match &r {
        Reference::Digest(d) => {
            let actual = Digest::of(d.algorithm(), &bytes);
            if &actual != d {
                return Err(ApiError::digest_invalid(format!(
                    "manifest bytes have digest {actual}, not {d}"
                )));
            }
            actual
        }
        Reference::Tag(_) => Digest::of(Algorithm::Sha256, &bytes),
    };
    for b in &parsed.blobs {
        match reg.repo_blob(&name, &b.digest).await? {
            Some(size) if size != b.size => {
                return Err(ApiError::manifest_invalid(format!(
                    "the manifest gives blob {} a size of {} bytes but it has {size}",
                    b.digest, b.size
                )))
            }
            Some(_) => {}
            None if b.has_urls || non_distributable(&b.media_type) => {}
            None => {
                return Err(ApiError::new(
                    StatusCode::BAD_REQUEST,
                    "MANIFEST_BLOB_UNKNOWN",
                    format!(
                    "blob {} referenced by the manifest is not in repository {name}; push it first",
                    b.digest
                ),
                ))
            }
        }
    }
    for c in &parsed.children {
        if reg.manifest(&name, &c.digest).await?.is_none() {
            return Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "MANIFEST_BLOB_UNKNOWN",
                format!(
                    "manifest {} listed by the index is not in repository {name}; push it first",
                    c.digest
                ),
            ));
        }
    }
    reg.store
        .put(&ObjectKey::blob(&digest), bytes.clone())
        .await?;
    let tag = match &r {
        Reference::Tag(t) => Some(t),
        Reference::Digest(_) => None,
    };
    let referrer = parsed.subject.as_ref().map(|s| {
        let mut d = serde_json::json!({
            "mediaType": parsed.media_type,
            "digest": digest.to_string(),
            "size": bytes.len(),
        });
        if let Some(a) = &parsed.artifact_type {
            d["artifactType"] = Value::String(a.clone());
        }
        if let Some(a) = &parsed.annotations {
            d["annotations"] = a.clone();
        }
        (&s.digest, d)
    });
    reg.link_manifest(ManifestWrite {
        repo: &name,
        digest: &digest,
        record: ManifestRecord {
            media_type: parsed.media_type.clone(),
            size: bytes.len() as u64,
        },
        tag,
        tag_immutable: reg.config.tags_immutable(name.as_str()),
        referrer,
    })
    .await?;
    tracing::info!(repo = %name, reference = %r, %digest, media_type = %parsed.media_type, "manifest pushed");
    crate::convert::on_manifest_pushed(reg, &name, &digest, &parsed);
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

#[cfg(test)]
mod tests {
    use super::*;

    const D: &str = "sha256:2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824";

    fn image(extra: &str) -> String {
        format!(
            r#"{{"schemaVersion":2,"mediaType":"{OCI_MANIFEST}","config":{{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"{D}","size":5}},"layers":[{{"mediaType":"application/vnd.oci.image.layer.v1.tar+gzip","digest":"{D}","size":5}}]{extra}}}"#
        )
    }

    #[test]
    fn parses_image_manifest_with_subject() {
        let m = image(&format!(
            r#","subject":{{"mediaType":"{OCI_MANIFEST}","digest":"{D}","size":1}},"artifactType":"application/x-test""#
        ));
        let p = parse_manifest(m.as_bytes(), Some(OCI_MANIFEST)).unwrap();
        assert_eq!(p.kind, ManifestKind::Image);
        assert_eq!(p.blobs.len(), 2);
        assert_eq!(p.subject.unwrap().digest.to_string(), D);
        assert_eq!(p.artifact_type.as_deref(), Some("application/x-test"));
    }

    #[test]
    fn media_type_from_field_when_header_is_generic() {
        let p = parse_manifest(image("").as_bytes(), Some("application/json")).unwrap();
        assert_eq!(p.media_type, OCI_MANIFEST);
        assert_eq!(
            p.artifact_type.as_deref(),
            Some("application/vnd.oci.image.config.v1+json")
        );
    }

    #[test]
    fn malformed_manifests_are_refused() {
        let cases: Vec<(String, Option<&str>, &str)> = vec![
            ("not json".into(), Some(OCI_MANIFEST), "not valid JSON"),
            ("[]".into(), Some(OCI_MANIFEST), "not a JSON object"),
            (
                r#"{"schemaVersion":1}"#.into(),
                Some(OCI_MANIFEST),
                "schemaVersion",
            ),
            (image(""), Some(DOCKER_MANIFEST), "does not match"),
            (
                r#"{"schemaVersion":2}"#.into(),
                Some("text/plain"),
                "unsupported manifest media type",
            ),
            (
                format!(r#"{{"schemaVersion":2,"mediaType":"{OCI_MANIFEST}","layers":[]}}"#),
                None,
                "config",
            ),
            (
                format!(
                    r#"{{"schemaVersion":2,"mediaType":"{OCI_INDEX}","manifests":[{{"mediaType":"x","digest":"sha256:bad","size":1}}]}}"#
                ),
                None,
                "manifests[0]",
            ),
        ];
        for (body, ct, want) in cases {
            let err = parse_manifest(body.as_bytes(), ct)
                .err()
                .unwrap_or_else(|| panic!("{body} accepted"));
            assert_eq!(err.status, StatusCode::BAD_REQUEST);
            assert!(err.message.contains(want), "{body}: {}", err.message);
        }
    }
}
