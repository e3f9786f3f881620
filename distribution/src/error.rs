//! What a registry's answer meant, by kind: the caller decides what to say about each
//! (which credentials to set, whether anything was stored).

use oci_client::errors::{OciDistributionError, OciErrorCode};

use crate::DistributionClient;

/// Why a registry could not give or take what was asked.
#[derive(Debug, thiserror::Error)]
pub enum DistributionError {
    #[error("{what} is not on {host}")]
    NotFound { host: String, what: String },
    #[error("{host} refused access to {what}: {why}")]
    Denied {
        host: String,
        what: String,
        why: String,
    },
    #[error("{what} on {host}: {why}")]
    Failed {
        host: String,
        what: String,
        why: String,
    },
    #[error("integrity error: {what} from {host}: {why}")]
    Corrupt {
        host: String,
        what: String,
        why: String,
    },
    #[error("integrity error: {what} from {host} has digest {actual}, not {expected}")]
    Integrity {
        host: String,
        what: String,
        expected: String,
        actual: String,
    },
    #[error("{what} from {host} is larger than the {limit} bytes allowed")]
    TooLarge {
        host: String,
        what: String,
        limit: usize,
    },
}

impl DistributionError {
    /// Whether the registry refused the credentials or the rights they carry.
    pub fn is_denied(&self) -> bool {
        matches!(self, DistributionError::Denied { .. })
    }
}

fn not_found(errors: &[oci_client::errors::OciError]) -> bool {
    errors.iter().map(|e| &e.code).any(|c| {
        matches!(
            c,
            OciErrorCode::ManifestUnknown
                | OciErrorCode::NameUnknown
                | OciErrorCode::BlobUnknown
                | OciErrorCode::NotFound
        )
    })
}

fn denied(errors: &[oci_client::errors::OciError]) -> bool {
    errors
        .iter()
        .any(|x| matches!(x.code, OciErrorCode::Denied | OciErrorCode::Unauthorized))
}

impl DistributionClient {
    /// What `e`, met while asking for `what`, means.
    pub(crate) fn error(&self, what: String, e: OciDistributionError) -> DistributionError {
        let host = self.host().to_string();
        match e {
            OciDistributionError::RegistryError { envelope, .. } if not_found(&envelope.errors) => {
                DistributionError::NotFound { host, what }
            }
            OciDistributionError::ServerError { code: 404, .. }
            | OciDistributionError::ImageManifestNotFoundError(_) => {
                DistributionError::NotFound { host, what }
            }
            OciDistributionError::UnauthorizedError { .. }
            | OciDistributionError::AuthenticationFailure(_)
            | OciDistributionError::ServerError {
                code: 401 | 403, ..
            } => DistributionError::Denied {
                host,
                what,
                why: e.to_string(),
            },
            OciDistributionError::RegistryError { ref envelope, .. }
                if denied(&envelope.errors) =>
            {
                DistributionError::Denied {
                    host,
                    what,
                    why: e.to_string(),
                }
            }
            OciDistributionError::DigestError(
                oci_client::errors::DigestError::VerificationError { expected, actual },
            ) => DistributionError::Integrity {
                host,
                what,
                expected,
                actual,
            },
            OciDistributionError::DigestError(d) => DistributionError::Corrupt {
                host,
                what,
                why: d.to_string(),
            },
            OciDistributionError::RequestError(r)
                if r.status() == Some(reqwest::StatusCode::NOT_FOUND) =>
            {
                DistributionError::NotFound { host, what }
            }
            OciDistributionError::RequestError(r)
                if matches!(r.status().map(|s| s.as_u16()), Some(401 | 403)) =>
            {
                DistributionError::Denied {
                    host,
                    what,
                    why: chain(&r),
                }
            }
            // A reqwest error's text alone hides why a request failed: the chain says it.
            OciDistributionError::RequestError(r) => DistributionError::Failed {
                host,
                what,
                why: chain(&r),
            },
            other => DistributionError::Failed {
                host,
                what,
                why: other.to_string(),
            },
        }
    }
}

/// An error and its sources, `: `-separated.
pub(crate) fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}
