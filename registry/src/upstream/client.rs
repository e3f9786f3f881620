//! Reading one upstream registry through `oci-client`: manifests as raw bytes checked
//! against their digest, blobs as streams (digest-checked again where they are stored),
//! tag lists page by page. Anonymous, Basic, and the Docker token flow (oci-client asks
//! the realm a 401 names for a bearer token, with the Basic credentials if any).

use amber_api::registry::UpstreamCredential;
use amber_oci::digest::{Algorithm, Digest};
use amber_oci::media::{DOCKER_LIST, DOCKER_MANIFEST, OCI_INDEX, OCI_MANIFEST};
use amber_oci::names::Reference;
use bytes::Bytes;
use futures_util::StreamExt;
use oci_client::errors::{OciDistributionError, OciErrorCode};
use oci_client::secrets::RegistryAuth;

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

/// Manifest media types asked for, in order of preference.
const ACCEPT: &[&str] = &[OCI_INDEX, OCI_MANIFEST, DOCKER_LIST, DOCKER_MANIFEST];
/// Tags asked for per page.
const TAG_PAGE: usize = 1000;

/// A client of one upstream registry.
pub struct UpstreamClient {
    client: oci_client::Client,
    spec: UpstreamSpec,
    auth: RegistryAuth,
}

impl UpstreamClient {
    pub fn new(spec: UpstreamSpec, credential: Option<&UpstreamCredential>) -> UpstreamClient {
        let protocol = if spec.plain_http {
            oci_client::client::ClientProtocol::Http
        } else {
            oci_client::client::ClientProtocol::Https
        };
        let client = oci_client::Client::new(oci_client::client::ClientConfig {
            protocol,
            connect_timeout: Some(std::time::Duration::from_secs(10)),
            read_timeout: Some(std::time::Duration::from_secs(60)),
            user_agent: concat!("amber-registry/", env!("CARGO_PKG_VERSION")),
            ..Default::default()
        });
        let auth = match credential {
            None => RegistryAuth::Anonymous,
            Some(UpstreamCredential::Basic { username, password }) => {
                RegistryAuth::Basic(username.clone(), password.clone())
            }
            Some(UpstreamCredential::Bearer { token }) => RegistryAuth::Bearer(token.clone()),
        };
        UpstreamClient { client, spec, auth }
    }

    pub fn host(&self) -> &str {
        &self.spec.host
    }

    fn reference(&self, repo: &str, r: &Reference) -> oci_client::Reference {
        match r {
            Reference::Tag(t) => oci_client::Reference::with_tag(
                self.spec.endpoint.clone(),
                repo.to_string(),
                t.to_string(),
            ),
            Reference::Digest(d) => oci_client::Reference::with_digest(
                self.spec.endpoint.clone(),
                repo.to_string(),
                d.to_string(),
            ),
        }
    }

    fn error(&self, what: String, e: OciDistributionError) -> UpstreamError {
        let host = self.spec.host.clone();
        let not_found = |errors: &[oci_client::errors::OciError]| {
            errors.iter().map(|e| &e.code).any(|c| {
                matches!(
                    c,
                    OciErrorCode::ManifestUnknown
                        | OciErrorCode::NameUnknown
                        | OciErrorCode::BlobUnknown
                        | OciErrorCode::NotFound
                )
            })
        };
        match e {
            OciDistributionError::RegistryError { envelope, .. } if not_found(&envelope.errors) => {
                UpstreamError::NotFound { host, what }
            }
            OciDistributionError::ServerError { code: 404, .. }
            | OciDistributionError::ImageManifestNotFoundError(_) => {
                UpstreamError::NotFound { host, what }
            }
            OciDistributionError::UnauthorizedError { .. }
            | OciDistributionError::AuthenticationFailure(_) => UpstreamError::Denied {
                host,
                what,
                why: e.to_string(),
            },
            OciDistributionError::RegistryError { ref envelope, .. }
                if envelope.errors.iter().any(|x| {
                    matches!(x.code, OciErrorCode::Denied | OciErrorCode::Unauthorized)
                }) =>
            {
                UpstreamError::Denied {
                    host,
                    what,
                    why: e.to_string(),
                }
            }
            OciDistributionError::DigestError(d) => UpstreamError::Corrupt {
                host,
                what,
                why: d.to_string(),
            },
            other => UpstreamError::Failed {
                host,
                what,
                why: other.to_string(),
            },
        }
    }

    /// The manifest `r` of `repo`: its bytes and their digest (sha256, or the algorithm
    /// of a digest reference), checked here against a digest reference.
    pub async fn manifest(
        &self,
        repo: &str,
        r: &Reference,
    ) -> Result<(Bytes, Digest), UpstreamError> {
        let what = format!("manifest {repo}:{r}");
        let (bytes, _) = self
            .client
            .pull_manifest_raw(&self.reference(repo, r), &self.auth, ACCEPT)
            .await
            .map_err(|e| self.error(what.clone(), e))?;
        let bytes = Bytes::from(bytes);
        let digest = match r {
            Reference::Digest(want) => {
                let actual = Digest::of(want.algorithm(), &bytes);
                if &actual != want {
                    return Err(UpstreamError::Integrity {
                        host: self.spec.host.clone(),
                        what,
                        expected: want.to_string(),
                        actual: actual.to_string(),
                    });
                }
                actual
            }
            Reference::Tag(_) => Digest::of(Algorithm::Sha256, &bytes),
        };
        Ok((bytes, digest))
    }

    /// Blob `digest` of `repo` as a stream (the caller checks its digest as it stores it).
    pub async fn blob(&self, repo: &str, digest: &Digest) -> Result<ByteStream, UpstreamError> {
        let what = format!("blob {digest} of {repo}");
        let d = digest.to_string();
        let stream = self
            .client
            .pull_blob_stream(
                &self.reference(repo, &Reference::Digest(digest.clone())),
                d.as_str(),
            )
            .await
            .map_err(|e| self.error(what, e))?;
        // oci-client checks the digest as the stream ends; its error says so as
        // InvalidData, which the importer reports as an integrity error.
        Ok(Box::pin(stream.stream.map(|r| {
            r.map_err(|e| {
                match e
                    .get_ref()
                    .and_then(|i| i.downcast_ref::<oci_client::errors::DigestError>())
                {
                    Some(d) => std::io::Error::new(std::io::ErrorKind::InvalidData, d.to_string()),
                    None => e,
                }
            })
        })))
    }

    /// Every tag of `repo`, in the order the upstream lists them.
    pub async fn tags(&self, repo: &str) -> Result<Vec<String>, UpstreamError> {
        let what = format!("the tags of {repo}");
        let latest = amber_oci::names::Tag::parse("latest").expect("a tag");
        let r = self.reference(repo, &Reference::Tag(latest));
        let mut out: Vec<String> = Vec::new();
        let mut seen = std::collections::HashSet::new();
        let mut last: Option<String> = None;
        loop {
            let page = self
                .client
                .list_tags(&r, &self.auth, Some(TAG_PAGE), last.as_deref())
                .await
                .map_err(|e| self.error(what.clone(), e))?;
            let n = page.tags.len();
            let before = out.len();
            last = page.tags.last().cloned();
            for t in page.tags {
                if seen.insert(t.clone()) {
                    out.push(t);
                }
            }
            // A registry that ignores `n`/`last` sends everything at once.
            if n < TAG_PAGE || out.len() == before {
                return Ok(out);
            }
        }
    }
}
