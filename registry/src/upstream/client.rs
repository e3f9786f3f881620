//! Reading one upstream registry through amber's one distribution client
//! (`amber-distribution`, over `oci-client`): manifests as raw bytes checked against
//! their digest, blobs as streams (digest-checked again where they are stored), tag
//! lists page by page. Anonymous, Basic, and the Docker token flow.

use amber_api::registry::UpstreamCredential;
use amber_distribution::{
    Credentials, DistributionClient, DistributionError, Endpoint, ANY_MANIFEST,
};
use amber_oci::digest::Digest;
use amber_oci::names::Reference;
use bytes::Bytes;

use super::UpstreamSpec;
use crate::store::ByteStream;

/// Why an upstream could not give what was asked.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    #[error("{what} is not on {host}")]
    NotFound { host: String, what: String },
    #[error("{host} refused access to {what}: {why} (credentials: a Docker config.json, `--authfile` or `upstream_auth_file`)")]
    Denied {
        host: String,
        what: String,
        why: String,
    },
    #[error("reading {what} from {host}: {why}")]
    Failed {
        host: String,
        what: String,
        why: String,
    },
    #[error("integrity error: {what} from {host}: {why}; nothing of it was stored")]
    Corrupt {
        host: String,
        what: String,
        why: String,
    },
    #[error("integrity error: {what} from {host} has digest {actual}, not {expected}; nothing of it was stored")]
    Integrity {
        host: String,
        what: String,
        expected: String,
        actual: String,
    },
}

/// The most an upstream manifest may take when read (the default `max_manifest_bytes`;
/// storing it checks the configured limit again).
const MAX_MANIFEST_BYTES: usize = 4 << 20;

/// A client of one upstream registry: amber's one verified distribution client, with
/// the importer's words for what went wrong.
pub struct UpstreamClient {
    client: DistributionClient,
    spec: UpstreamSpec,
}

impl From<DistributionError> for UpstreamError {
    fn from(e: DistributionError) -> UpstreamError {
        match e {
            DistributionError::NotFound { host, what } => UpstreamError::NotFound { host, what },
            DistributionError::Denied { host, what, why } => {
                UpstreamError::Denied { host, what, why }
            }
            DistributionError::Failed { host, what, why } => {
                UpstreamError::Failed { host, what, why }
            }
            DistributionError::Corrupt { host, what, why } => {
                UpstreamError::Corrupt { host, what, why }
            }
            DistributionError::Integrity {
                host,
                what,
                expected,
                actual,
            } => UpstreamError::Integrity {
                host,
                what,
                expected,
                actual,
            },
            DistributionError::TooLarge { host, what, limit } => UpstreamError::Failed {
                host,
                what,
                why: format!("larger than the {limit} bytes a manifest may take"),
            },
        }
    }
}

impl UpstreamClient {
    pub fn new(spec: UpstreamSpec, credential: Option<&UpstreamCredential>) -> UpstreamClient {
        let credentials = match credential {
            None => Credentials::Anonymous,
            Some(UpstreamCredential::Basic { username, password }) => Credentials::Basic {
                username: username.clone(),
                password: password.clone(),
            },
            Some(UpstreamCredential::Bearer { token }) => Credentials::Bearer {
                token: token.clone(),
            },
        };
        let client = DistributionClient::new(
            Endpoint {
                host: spec.endpoint.clone(),
                plain_http: spec.plain_http,
            },
            credentials,
            std::time::Duration::from_secs(10),
            std::time::Duration::from_secs(60),
            concat!("amber-registry/", env!("CARGO_PKG_VERSION")),
        );
        UpstreamClient { client, spec }
    }

    pub fn host(&self) -> &str {
        &self.spec.host
    }

    /// Errors name the upstream as configured (`docker.io`), not its endpoint.
    fn named(&self, e: DistributionError) -> UpstreamError {
        let mut e = UpstreamError::from(e);
        match &mut e {
            UpstreamError::NotFound { host, .. }
            | UpstreamError::Denied { host, .. }
            | UpstreamError::Failed { host, .. }
            | UpstreamError::Corrupt { host, .. }
            | UpstreamError::Integrity { host, .. } => *host = self.spec.host.clone(),
        }
        e
    }

    /// The manifest `r` of `repo`: its bytes and their digest (sha256, or the algorithm
    /// of a digest reference), checked against a digest reference.
    pub async fn manifest(
        &self,
        repo: &str,
        r: &Reference,
    ) -> Result<(Bytes, Digest), UpstreamError> {
        self.client
            .manifest(repo, r, ANY_MANIFEST, MAX_MANIFEST_BYTES)
            .await
            .map_err(|e| self.named(e))
    }

    /// Blob `digest` of `repo` as a stream (the caller checks its digest as it stores it).
    pub async fn blob(&self, repo: &str, digest: &Digest) -> Result<ByteStream, UpstreamError> {
        self.client
            .blob_stream(repo, digest)
            .await
            .map_err(|e| self.named(e))
    }

    /// Every tag of `repo`, in the order the upstream lists them.
    pub async fn tags(&self, repo: &str) -> Result<Vec<String>, UpstreamError> {
        self.client.tags(repo).await.map_err(|e| self.named(e))
    }
}
