//! Errors of the distribution API as the client sees them: an HTTP status and the spec's
//! JSON body `{"errors":[{"code","message","detail"}]}`.
//!
//! Client mistakes map to 4xx with the spec's code; only failures of the registry itself
//! are 5xx, and those are logged with their cause: 507 with `Retry-After` when the disk is
//! full, 503 with `Retry-After` when the object
//! store does not answer (retrying is safe), 500 for anything else (a corrupt index).

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

use crate::index::IndexError;
use crate::store::StoreError;
use amber_oci::names::NameError;

#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
    /// Extra headers, e.g. `Content-Range` on 416.
    pub headers: Vec<(header::HeaderName, HeaderValue)>,
}

pub type ApiResult<T> = Result<T, ApiError>;

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            code,
            message: message.into(),
            headers: Vec::new(),
        }
    }

    pub fn with_header(mut self, name: header::HeaderName, value: &str) -> ApiError {
        if let Ok(v) = HeaderValue::from_str(value) {
            self.headers.push((name, v));
        }
        self
    }

    pub fn blob_unknown(d: impl std::fmt::Display) -> ApiError {
        Self::new(
            StatusCode::NOT_FOUND,
            "BLOB_UNKNOWN",
            format!("blob {d} is unknown to this repository"),
        )
    }
    pub fn manifest_unknown(r: impl std::fmt::Display) -> ApiError {
        Self::new(
            StatusCode::NOT_FOUND,
            "MANIFEST_UNKNOWN",
            format!("manifest {r} is unknown to this repository"),
        )
    }
    pub fn name_unknown(n: impl std::fmt::Display) -> ApiError {
        Self::new(
            StatusCode::NOT_FOUND,
            "NAME_UNKNOWN",
            format!("repository {n} is not known to this registry"),
        )
    }
    pub fn upload_unknown(id: &str) -> ApiError {
        Self::new(
            StatusCode::NOT_FOUND,
            "BLOB_UPLOAD_UNKNOWN",
            format!(
                "upload session {id} does not exist (finished, cancelled, expired or interrupted)"
            ),
        )
    }
    pub fn upload_invalid(msg: impl Into<String>) -> ApiError {
        Self::new(StatusCode::BAD_REQUEST, "BLOB_UPLOAD_INVALID", msg)
    }
    pub fn digest_invalid(msg: impl Into<String>) -> ApiError {
        Self::new(StatusCode::BAD_REQUEST, "DIGEST_INVALID", msg)
    }
    pub fn manifest_invalid(msg: impl Into<String>) -> ApiError {
        Self::new(StatusCode::BAD_REQUEST, "MANIFEST_INVALID", msg)
    }
    pub fn unsupported(msg: impl Into<String>) -> ApiError {
        Self::new(StatusCode::METHOD_NOT_ALLOWED, "UNSUPPORTED", msg)
    }
    pub fn internal(context: &str, err: impl std::fmt::Display) -> ApiError {
        tracing::error!(%err, context, "internal error");
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "INTERNAL",
            format!("{context}: {err}"),
        )
    }
}

impl From<NameError> for ApiError {
    fn from(e: NameError) -> ApiError {
        match e {
            NameError::BadName(_) => {
                ApiError::new(StatusCode::BAD_REQUEST, "NAME_INVALID", e.to_string())
            }
            NameError::BadTag(_) => ApiError::manifest_invalid(e.to_string()),
            NameError::BadDigest(_) => ApiError::digest_invalid(e.to_string()),
            NameError::NotFound => {
                ApiError::new(StatusCode::NOT_FOUND, "NOT_FOUND", "no such endpoint")
            }
        }
    }
}

impl From<IndexError> for ApiError {
    fn from(e: IndexError) -> ApiError {
        match e {
            IndexError::TagImmutable { .. } => {
                ApiError::new(StatusCode::CONFLICT, "DENIED", e.to_string())
            }
            other => ApiError::internal("metadata index", other),
        }
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> ApiError {
        match e {
            // A full disk: nothing was acknowledged; retry once space is freed.
            StoreError::Io { ref source, .. }
                if source.kind() == std::io::ErrorKind::StorageFull =>
            {
                tracing::error!(err = %e, "storage full");
                ApiError::new(
                    StatusCode::INSUFFICIENT_STORAGE,
                    "INSUFFICIENT_STORAGE",
                    format!("the registry's storage is full, retry later: {e}"),
                )
                .with_header(header::RETRY_AFTER, "60")
            }
            // The store did not answer (S3 down, timeouts after retries): nothing was
            // acknowledged, so the client may retry the same request.
            StoreError::Io { .. } => {
                tracing::error!(err = %e, "object store unavailable");
                ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "UNAVAILABLE",
                    format!("object store unavailable, retry: {e}"),
                )
                .with_header(header::RETRY_AFTER, "5")
            }
            other => ApiError::internal("object store", other),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = serde_json::json!({
            "errors": [{"code": self.code, "message": self.message, "detail": null}]
        });
        let mut resp = (self.status, axum::Json(body)).into_response();
        for (k, v) in self.headers {
            resp.headers_mut().insert(k, v);
        }
        resp
    }
}

impl From<crate::uploads::UploadError> for ApiError {
    fn from(e: crate::uploads::UploadError) -> Self {
        use crate::uploads::UploadError;
        match e {
            UploadError::Store(e) => e.into(),
            e @ UploadError::Moved { .. } => ApiError::upload_invalid(e.to_string()),
            e @ UploadError::Corrupt { .. } => ApiError::internal("upload session", e),
        }
    }
}

impl From<crate::records::RecordError> for ApiError {
    fn from(e: crate::records::RecordError) -> Self {
        use crate::records::RecordError;
        match e {
            RecordError::Store(e) => e.into(),
            RecordError::Index(e) => e.into(),
            e @ RecordError::Contended { .. } => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "UNAVAILABLE",
                e.to_string(),
            ),
            e @ RecordError::Corrupt { .. } => ApiError::internal("records", e),
        }
    }
}

impl From<crate::repository::PushError> for ApiError {
    fn from(e: crate::repository::PushError) -> Self {
        use crate::repository::PushError;
        match e {
            PushError::Invalid(e) => ApiError::manifest_invalid(e.0),
            e @ PushError::DigestMismatch { .. } => ApiError::digest_invalid(e.to_string()),
            e @ PushError::BlobSize { .. } => ApiError::manifest_invalid(e.to_string()),
            e @ (PushError::BlobUnknown { .. } | PushError::ChildUnknown { .. }) => ApiError::new(
                StatusCode::BAD_REQUEST,
                "MANIFEST_BLOB_UNKNOWN",
                e.to_string(),
            ),
            PushError::Record(e) => e.into(),
            PushError::Store(e) => e.into(),
        }
    }
}

impl ApiError {
    /// A pull-through that did not complete: the upstream does not have it (404), or
    /// could not be read, refused us, or sent bad bytes (502, nothing stored).
    pub fn upstream(e: crate::upstream::ImportError) -> ApiError {
        use crate::upstream::{ImportError, UpstreamError};
        match e {
            ImportError::Upstream(UpstreamError::NotFound { .. }) => {
                ApiError::new(StatusCode::NOT_FOUND, "MANIFEST_UNKNOWN", e.to_string())
            }
            ImportError::Store(e) => e.into(),
            ImportError::Record(e) => e.into(),
            e => {
                tracing::warn!(err = %e, "pull-through failed");
                ApiError::new(
                    StatusCode::BAD_GATEWAY,
                    "UPSTREAM_FAILED",
                    format!("pulling through from the upstream failed: {e}"),
                )
            }
        }
    }
}
