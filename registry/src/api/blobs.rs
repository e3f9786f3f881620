//! Blob HEAD and GET, with single `Range` requests.

use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};

use super::{counted_body, header_str, AppState};
use crate::api::error::{ApiError, ApiResult};
use crate::store::ObjectKey;
use amber_oci::digest::Digest;
use amber_oci::names::RepoName;

/// A byte range request against an object of `size` bytes, resolved to `start..end`.
/// `None` for no (or an ignorable multi-range) header; an error for unsatisfiable or
/// malformed ranges.
pub fn parse_range(
    header: Option<&str>,
    size: u64,
) -> Result<Option<std::ops::Range<u64>>, String> {
    let Some(h) = header else { return Ok(None) };
    let spec = h
        .trim()
        .strip_prefix("bytes=")
        .ok_or_else(|| format!("Range {h:?} is not a bytes range"))?;
    if spec.contains(',') {
        // Multiple ranges: serving the whole object is allowed by RFC 9110.
        return Ok(None);
    }
    let (a, b) = spec
        .split_once('-')
        .ok_or_else(|| format!("Range {h:?} is malformed"))?;
    let num = |s: &str| {
        s.trim()
            .parse::<u64>()
            .map_err(|_| format!("Range {h:?} is malformed"))
    };
    let r = match (a.trim().is_empty(), b.trim().is_empty()) {
        (true, true) => return Err(format!("Range {h:?} is malformed")),
        (true, false) => {
            let n = num(b)?;
            if n == 0 {
                return Err(format!("Range {h:?} asks for no bytes"));
            }
            size.saturating_sub(n)..size
        }
        (false, true) => num(a)?..size,
        (false, false) => {
            let (s, e) = (num(a)?, num(b)?);
            if e < s {
                return Err(format!("Range {h:?} ends before it starts"));
            }
            s..(e.saturating_add(1)).min(size)
        }
    };
    if r.start >= size {
        return Err(format!(
            "Range {h:?} starts past the end of a {size}-byte blob"
        ));
    }
    Ok(Some(r))
}

/// How to serve one immutable stored object.
pub struct ObjectResponse<'a> {
    pub key: ObjectKey,
    pub size: u64,
    pub range: Option<&'a str>,
    pub head: bool,
    pub content_type: &'static str,
    /// The content address, used as the ETag.
    pub etag: String,
    pub extra: Vec<(&'static str, String)>,
    /// The object's bytes when the caller read them whole (`size` is their length): the
    /// answer is cut from them instead of read again.
    pub bytes: Option<bytes::Bytes>,
}

/// Serves an immutable stored object: whole, or one `Range` (206), or 416 with the size.
/// How long a presigned URL handed out in a redirect stays valid.
const PRESIGNED_TTL: std::time::Duration = std::time::Duration::from_secs(15 * 60);

pub async fn serve_object(reg: &AppState, o: ObjectResponse<'_>) -> ApiResult<Response> {
    // With `s3_redirect`, object bytes come straight from the bucket: the client follows
    // a short-lived presigned URL (Range and all), and the registry only answers for
    // access and existence.
    // A layer blob kept as a recipe (`crate::recipe`) has no object to redirect to: it
    // is rebuilt here, so a blob is looked at before its URL is handed out.
    let redirect = !o.head
        && reg.config.s3.redirect.unwrap_or(false)
        && (o.key.blob_digest().is_none() || reg.store.stat(&o.key).await?.is_some());
    if redirect {
        if let Some(url) = reg.store.presign_get(&o.key, PRESIGNED_TTL).await? {
            metrics::counter!(crate::metrics::REDIRECTS).increment(1);
            return Ok(Response::builder()
                .status(StatusCode::TEMPORARY_REDIRECT)
                .header(header::LOCATION, url)
                .header(header::CACHE_CONTROL, "no-store")
                .body(axum::body::Body::empty())
                .map_err(|e| ApiError::internal("response", e))?
                .into_response());
        }
    }
    let size = o.size;
    let range = parse_range(o.range, size).map_err(|msg| {
        ApiError::new(StatusCode::RANGE_NOT_SATISFIABLE, "RANGE_INVALID", msg)
            .with_header(header::CONTENT_RANGE, &format!("bytes */{size}"))
    })?;
    let (status, r) = match range {
        Some(r) => (StatusCode::PARTIAL_CONTENT, r),
        None => (StatusCode::OK, 0..size),
    };
    let mut builder = Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, o.content_type)
        .header(header::CONTENT_LENGTH, r.end - r.start)
        .header(header::ACCEPT_RANGES, "bytes")
        .header(header::ETAG, format!("\"{}\"", o.etag))
        .header(header::CACHE_CONTROL, "public, max-age=31536000, immutable");
    for (k, v) in o.extra {
        builder = builder.header(k, v);
    }
    if status == StatusCode::PARTIAL_CONTENT {
        builder = builder.header(
            header::CONTENT_RANGE,
            format!("bytes {}-{}/{size}", r.start, r.end - 1),
        );
    }
    let body = match o.bytes {
        _ if o.head => axum::body::Body::empty(),
        Some(b) => {
            metrics::counter!(crate::metrics::BYTES_OUT).increment(r.end - r.start);
            axum::body::Body::from(b.slice(r.start as usize..r.end as usize))
        }
        None => counted_body(crate::recipe::read_object(&reg.store, &o.key, r).await?),
    };
    Ok(builder
        .body(body)
        .map_err(|e| ApiError::internal("response", e))?
        .into_response())
}

pub async fn get(
    reg: &AppState,
    name: RepoName,
    digest: Digest,
    headers: &HeaderMap,
    head: bool,
) -> ApiResult<Response> {
    let size = reg
        .repo_blob(&name, &digest)
        .await?
        .ok_or_else(|| ApiError::blob_unknown(&digest))?;
    serve_object(
        reg,
        ObjectResponse {
            key: ObjectKey::blob(&digest),
            size,
            range: header_str(headers, header::RANGE),
            head,
            content_type: "application/octet-stream",
            etag: digest.to_string(),
            extra: vec![("Docker-Content-Digest", digest.to_string())],
            bytes: None,
        },
    )
    .await
}

#[cfg(test)]
mod tests {
    use super::parse_range;

    #[test]
    fn ranges() {
        assert_eq!(parse_range(None, 10), Ok(None));
        assert_eq!(parse_range(Some("bytes=0-4"), 10), Ok(Some(0..5)));
        assert_eq!(parse_range(Some("bytes=5-"), 10), Ok(Some(5..10)));
        assert_eq!(parse_range(Some("bytes=-3"), 10), Ok(Some(7..10)));
        assert_eq!(parse_range(Some("bytes=-30"), 10), Ok(Some(0..10)));
        assert_eq!(parse_range(Some("bytes=8-100"), 10), Ok(Some(8..10)));
        assert_eq!(parse_range(Some("bytes=0-1,3-4"), 10), Ok(None));
        for bad in [
            "bytes=10-",
            "bytes=20-30",
            "bytes=5-2",
            "bytes=-0",
            "bytes=-",
            "items=0-1",
            "bytes=a-b",
        ] {
            assert!(parse_range(Some(bad), 10).is_err(), "{bad}");
        }
        assert!(parse_range(Some("bytes=0-0"), 0).is_err());
    }
}
