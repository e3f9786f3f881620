//! amber's one client of OCI distribution registries: the node reading images and boot
//! files from its registry and pushing snapshots and boot files to it, and the registry
//! importing from upstreams, all go through [`DistributionClient`]. It is a thin layer
//! over `oci-client`, which does the requests and the authentication (anonymous, Basic,
//! and Docker's token flow: a 401's `WWW-Authenticate` realm is asked for a bearer token
//! with the Basic credentials if any).
//!
//! Invariants kept here, for every caller:
//! - a manifest asked for by digest, and every blob, is checked against its digest before
//!   the caller gets its last byte (`oci-client` checks manifests and streams; a bounded
//!   blob read hashes too, so its error can name the digest the registry's bytes have); a
//!   mismatch is [`DistributionError::Integrity`];
//! - what is read into memory is bounded by the caller's limit ([`TooLarge`] otherwise).
//!   Blobs are bounded as they stream; a manifest is read whole by `oci-client` and its
//!   size checked after (registries cap manifests at a few MiB);
//! - pushes stream: a blob is never held whole in memory here.
//!
//! [`TooLarge`]: DistributionError::TooLarge

mod error;
mod push;

use std::pin::Pin;
use std::time::Duration;

use amber_oci::digest::{Algorithm, Digest};
use amber_oci::names::Reference;
use bytes::Bytes;
use futures_util::{Stream, StreamExt};
use oci_client::secrets::RegistryAuth;

pub use error::DistributionError;
pub use push::Pusher;

/// A blob's bytes as they arrive.
pub type BlobStream = Pin<Box<dyn Stream<Item = std::io::Result<Bytes>> + Send>>;

/// Where a registry is: `host[:port]`, and whether it speaks plain HTTP.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    pub host: String,
    pub plain_http: bool,
}

impl Endpoint {
    /// The endpoint of a base URL (`http://127.0.0.1:5000`, `https://r.example/`);
    /// `None` when it is not an http(s) URL with a host.
    pub fn from_url(url: &str) -> Option<Endpoint> {
        let (scheme, rest) = url.split_once("://")?;
        let plain_http = match scheme {
            "http" => true,
            "https" => false,
            _ => return None,
        };
        let host = rest.split('/').next().filter(|h| !h.is_empty())?;
        Some(Endpoint {
            host: host.to_string(),
            plain_http,
        })
    }
}

/// The credentials a client presents.
#[derive(Clone, PartialEq, Eq)]
pub enum Credentials {
    Anonymous,
    Basic { username: String, password: String },
    Bearer { token: String },
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Credentials::Anonymous => f.write_str("Anonymous"),
            Credentials::Basic { username, .. } => write!(f, "Basic({username}, …)"),
            Credentials::Bearer { .. } => f.write_str("Bearer(…)"),
        }
    }
}

impl Credentials {
    /// `name:secret` (amber's `AMBER_REGISTRY_CREDENTIALS`) as Basic credentials.
    pub fn from_pair(pair: &str) -> Credentials {
        let (username, password) = pair.trim().split_once(':').unwrap_or((pair.trim(), ""));
        Credentials::Basic {
            username: username.into(),
            password: password.into(),
        }
    }

    fn registry_auth(&self) -> RegistryAuth {
        match self {
            Credentials::Anonymous => RegistryAuth::Anonymous,
            Credentials::Basic { username, password } => {
                RegistryAuth::Basic(username.clone(), password.clone())
            }
            Credentials::Bearer { token } => RegistryAuth::Bearer(token.clone()),
        }
    }
}

/// Manifest media types asked for when the caller takes any manifest, in order of
/// preference.
pub const ANY_MANIFEST: &[&str] = &[
    amber_oci::media::OCI_INDEX,
    amber_oci::media::OCI_MANIFEST,
    amber_oci::media::DOCKER_LIST,
    amber_oci::media::DOCKER_MANIFEST,
];
/// Tags asked for per page.
const TAG_PAGE: usize = 1000;

/// A client of one registry.
#[derive(Clone)]
pub struct DistributionClient {
    oci: oci_client::Client,
    endpoint: Endpoint,
    credentials: Credentials,
    /// For what `oci-client` does not offer: HEAD of a blob, streamed uploads.
    http: reqwest::Client,
}

impl std::fmt::Debug for DistributionClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DistributionClient")
            .field("endpoint", &self.endpoint)
            .field("credentials", &self.credentials)
            .finish()
    }
}

impl DistributionClient {
    /// A client of `endpoint` presenting `credentials`; a connection may take
    /// `connect_timeout` and each read `read_timeout`.
    pub fn new(
        endpoint: Endpoint,
        credentials: Credentials,
        connect_timeout: Duration,
        read_timeout: Duration,
        user_agent: &'static str,
    ) -> DistributionClient {
        let protocol = if endpoint.plain_http {
            oci_client::client::ClientProtocol::Http
        } else {
            oci_client::client::ClientProtocol::Https
        };
        let oci = oci_client::Client::new(oci_client::client::ClientConfig {
            protocol,
            connect_timeout: Some(connect_timeout),
            read_timeout: Some(read_timeout),
            user_agent,
            ..Default::default()
        });
        let http = reqwest::Client::builder()
            .connect_timeout(connect_timeout)
            .read_timeout(read_timeout)
            .user_agent(user_agent)
            .build()
            .expect("HTTP client");
        DistributionClient {
            oci,
            endpoint,
            credentials,
            http,
        }
    }

    /// `host[:port]` of the registry.
    pub fn host(&self) -> &str {
        &self.endpoint.host
    }

    /// Whether the client presents credentials.
    pub fn has_credentials(&self) -> bool {
        self.credentials != Credentials::Anonymous
    }

    fn reference(&self, repo: &str, r: &Reference) -> oci_client::Reference {
        let host = self.endpoint.host.clone();
        match r {
            Reference::Tag(t) => {
                oci_client::Reference::with_tag(host, repo.to_string(), t.to_string())
            }
            Reference::Digest(d) => {
                oci_client::Reference::with_digest(host, repo.to_string(), d.to_string())
            }
        }
    }

    fn blob_reference(&self, repo: &str, d: &Digest) -> oci_client::Reference {
        self.reference(repo, &Reference::Digest(d.clone()))
    }

    /// The manifest `r` of `repo` (one of the `accept` media types): its bytes and their
    /// digest (sha256, or the algorithm of a digest reference), checked against a digest
    /// reference; at most `limit` bytes.
    pub async fn manifest(
        &self,
        repo: &str,
        r: &Reference,
        accept: &[&str],
        limit: usize,
    ) -> Result<(Bytes, Digest), DistributionError> {
        let what = format!("manifest {repo}:{r}");
        let (bytes, _) = self
            .oci
            .pull_manifest_raw(
                &self.reference(repo, r),
                &self.credentials.registry_auth(),
                accept,
            )
            .await
            .map_err(|e| self.error(what.clone(), e))?;
        if bytes.len() > limit {
            return Err(DistributionError::TooLarge {
                host: self.host().into(),
                what,
                limit,
            });
        }
        let bytes = Bytes::from(bytes);
        let digest = match r {
            // oci-client checked the bytes against it (and the registry's digest header).
            Reference::Digest(want) => want.clone(),
            Reference::Tag(_) => Digest::of(Algorithm::Sha256, &bytes),
        };
        Ok((bytes, digest))
    }

    /// Blob `digest` of `repo` as a stream; the stream ends with an `InvalidData` error
    /// when the bytes do not hash to `digest` (the caller that stores them checks again).
    pub async fn blob_stream(
        &self,
        repo: &str,
        digest: &Digest,
    ) -> Result<BlobStream, DistributionError> {
        let what = format!("blob {digest} of {repo}");
        // Pulls are authorised like a manifest read (oci-client's token cache is per
        // operation and repository).
        self.oci
            .store_auth_if_needed(self.host(), &self.credentials.registry_auth())
            .await;
        let stream = self
            .oci
            .pull_blob_stream(
                &self.blob_reference(repo, digest),
                digest.to_string().as_str(),
            )
            .await
            .map_err(|e| self.error(what, e))?;
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

    /// Blob `digest` of `repo`, at most `limit` bytes, checked against its digest.
    pub async fn blob(
        &self,
        repo: &str,
        digest: &Digest,
        limit: usize,
    ) -> Result<Bytes, DistributionError> {
        let what = format!("blob {digest} of {repo}");
        let mut stream = self.blob_stream(repo, digest).await?;
        let mut body = bytes::BytesMut::new();
        let mut hasher = digest.algorithm().hasher();
        while let Some(piece) = stream.next().await {
            let piece = match piece {
                Ok(p) => p,
                // The verifying stream's verdict: reported below, with the digest the
                // bytes have.
                Err(e) if e.kind() == std::io::ErrorKind::InvalidData => break,
                Err(e) => {
                    return Err(DistributionError::Failed {
                        host: self.host().into(),
                        what,
                        why: e.to_string(),
                    })
                }
            };
            if body.len() + piece.len() > limit {
                return Err(DistributionError::TooLarge {
                    host: self.host().into(),
                    what,
                    limit,
                });
            }
            hasher.update(&piece);
            body.extend_from_slice(&piece);
        }
        // oci-client's stream checks it too; this hash is the one an error names.
        let actual = hasher.finish();
        if &actual != digest {
            return Err(DistributionError::Integrity {
                host: self.host().into(),
                what,
                expected: digest.to_string(),
                actual: actual.to_string(),
            });
        }
        Ok(body.freeze())
    }

    /// Every tag of `repo`, in the order the registry lists them.
    pub async fn tags(&self, repo: &str) -> Result<Vec<String>, DistributionError> {
        let what = format!("the tags of {repo}");
        let latest = amber_oci::names::Tag::parse("latest").expect("a tag");
        let r = self.reference(repo, &Reference::Tag(latest));
        let auth = self.credentials.registry_auth();
        let mut out: Vec<String> = Vec::new();
        let mut seen = std::collections::HashSet::new();
        let mut last: Option<String> = None;
        loop {
            let page = self
                .oci
                .list_tags(&r, &auth, Some(TAG_PAGE), last.as_deref())
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

    /// A pusher into `repo`, authorised for pull and push there.
    pub async fn pusher(&self, repo: &str) -> Result<Pusher<'_>, DistributionError> {
        Pusher::new(self, repo).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints() {
        assert_eq!(
            Endpoint::from_url("http://127.0.0.1:5000"),
            Some(Endpoint {
                host: "127.0.0.1:5000".into(),
                plain_http: true
            })
        );
        assert_eq!(
            Endpoint::from_url("https://r.example/x"),
            Some(Endpoint {
                host: "r.example".into(),
                plain_http: false
            })
        );
        assert_eq!(Endpoint::from_url("ftp://x"), None);
        assert_eq!(Endpoint::from_url("http://"), None);
        assert_eq!(Endpoint::from_url("127.0.0.1:5000"), None);
    }

    #[test]
    fn credential_pairs() {
        assert_eq!(
            Credentials::from_pair("robot:s3:cret\n"),
            Credentials::Basic {
                username: "robot".into(),
                password: "s3:cret".into()
            }
        );
        assert!(!format!("{:?}", Credentials::from_pair("a:secret")).contains("secret"));
    }
}
