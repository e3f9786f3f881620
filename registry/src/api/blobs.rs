//! Blob HEAD and GET, with single `Range` requests.

use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};

use super::{counted_body, header_str, AppState};
use crate::digest::Digest;
use crate::error::{ApiError, ApiResult};
use crate::names::RepoName;
use crate::store::ObjectKey;

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

pub async fn get(
    reg: &AppState,
    name: RepoName,
    digest: Digest,
    headers: &HeaderMap,
    head: bool,
) -> ApiResult<Response> {
    let size = reg
        .index
        .repo_blob(&name, &digest)?
        .ok_or_else(|| ApiError::blob_unknown(&digest))?;
    let range = parse_range(header_str(headers, header::RANGE), size).map_err(|msg| {
        ApiError::new(StatusCode::RANGE_NOT_SATISFIABLE, "RANGE_INVALID", msg)
            .with_header(header::CONTENT_RANGE, &format!("bytes */{size}"))
    })?;
    let (status, r) = match range {
        Some(r) => (StatusCode::PARTIAL_CONTENT, r),
        None => (StatusCode::OK, 0..size),
    };
    let mut builder = Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "application/octet-stream")
        .header(header::CONTENT_LENGTH, r.end - r.start)
        .header(header::ACCEPT_RANGES, "bytes")
        .header(header::ETAG, format!("\"{digest}\""))
        .header(header::CACHE_CONTROL, "max-age=31536000, immutable")
        .header("Docker-Content-Digest", digest.to_string());
    if status == StatusCode::PARTIAL_CONTENT {
        builder = builder.header(
            header::CONTENT_RANGE,
            format!("bytes {}-{}/{size}", r.start, r.end - 1),
        );
    }
    let body = if head {
        axum::body::Body::empty()
    } else {
        counted_body(reg.store.read(&ObjectKey::blob(&digest), r).await?)
    };
    Ok(builder
        .body(body)
        .map_err(|e| ApiError::internal("response", e))?
        .into_response())
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
