//! Where chunks and block manifests come from: the registry's amber API
//! (`/amber/v1/chunks/<id>`, `/amber/v1/envs/<env>`), or anything else implementing
//! `ChunkSource`.

use amber_converter::manifest::{ChunkId, EnvDigest, ManifestEnvelope};
use amber_distribution::{Credentials, DistributionClient, DistributionError, Endpoint};
use async_trait::async_trait;
use bytes::Bytes;

#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error("chunk {0} is not in the registry")]
    NotFound(String),
    #[error("fetching {what} from {url}: {source}")]
    Http {
        what: String,
        url: String,
        #[source]
        source: reqwest::Error,
    },
    #[error("fetching {what} from {url}: HTTP {status}")]
    Status {
        what: String,
        url: String,
        status: u16,
    },
    #[error("block manifest {env} from {url} is invalid: {msg}")]
    BadManifest {
        env: String,
        url: String,
        msg: String,
    },
}

/// Fetches the stored (zstd) bytes of chunks.
#[async_trait]
pub trait ChunkSource: Send + Sync + 'static {
    async fn fetch(&self, id: &ChunkId) -> Result<Bytes, SourceError>;
}

/// The registry's amber API over HTTP.
pub struct RegistrySource {
    base: String,
    http: reqwest::Client,
}

/// Environment variable the binaries read the registry credentials from (`name:secret`,
/// a robot's token for nodes). Libraries take them as `RegistryClient::new`'s argument.
pub const CREDENTIALS_ENV: &str = "AMBER_REGISTRY_CREDENTIALS";

/// How a node reaches its registry: the base URL; for amber's own API (resolve, chunks,
/// block manifests) an HTTP client with timeouts and the account's credentials on every
/// request (reqwest drops them on a redirect to another host: presigned S3 URLs need
/// none); for the OCI distribution API (manifests, blobs, pushes) the one verified
/// client, [`DistributionClient`]; and whether there are credentials (for hints).
#[derive(Clone, Debug)]
pub struct RegistryClient {
    base: String,
    pub http: reqwest::Client,
    distribution: DistributionClient,
    has_credentials: bool,
}

impl RegistryClient {
    /// A client of the registry at `base` sending `credentials` (`name:secret`) as Basic
    /// auth; each request may take at most `timeout`.
    pub fn new(
        base: &str,
        credentials: Option<&str>,
        timeout: std::time::Duration,
    ) -> RegistryClient {
        let mut headers = reqwest::header::HeaderMap::new();
        if let Some(creds) = credentials {
            use base64::Engine;
            let b64 = base64::engine::general_purpose::STANDARD.encode(creds.trim());
            if let Ok(mut v) = reqwest::header::HeaderValue::from_str(&format!("Basic {b64}")) {
                v.set_sensitive(true);
                headers.insert(reqwest::header::AUTHORIZATION, v);
            }
        }
        let http = reqwest::Client::builder()
            .connect_timeout(std::time::Duration::from_secs(10))
            .timeout(timeout)
            .default_headers(headers)
            .build()
            .expect("HTTP client");
        let base = base.trim_end_matches('/').to_string();
        // A base that is no http(s) URL fails every request, each saying which host.
        let endpoint = Endpoint::from_url(&base).unwrap_or(Endpoint {
            host: base.clone(),
            plain_http: false,
        });
        let distribution = DistributionClient::new(
            endpoint,
            credentials.map_or(Credentials::Anonymous, Credentials::from_pair),
            std::time::Duration::from_secs(10),
            timeout,
            concat!("amber-node/", env!("CARGO_PKG_VERSION")),
        );
        RegistryClient {
            base,
            http,
            distribution,
            has_credentials: credentials.is_some(),
        }
    }

    /// The registry's OCI distribution API: every manifest and blob the node reads or
    /// pushes goes through it.
    pub fn distribution(&self) -> &DistributionClient {
        &self.distribution
    }

    /// What to do about `e`, for error messages, when the registry refused to let the
    /// account `action` (`pull`, `push to`) a repository.
    pub fn denied_hint(&self, e: &DistributionError, action: &str) -> String {
        if e.is_denied() {
            // 401 and 403 read alike from here: the hint names both causes.
            if self.has_credentials {
                format!(" (check that the account in {CREDENTIALS_ENV} exists and may {action} this repository)")
            } else {
                self.access_hint(reqwest::StatusCode::UNAUTHORIZED)
            }
        } else {
            String::new()
        }
    }

    /// The registry's base URL (no trailing `/`).
    pub fn base(&self) -> &str {
        &self.base
    }

    /// `base` + `path`.
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// What to do about a refused request, for error messages: empty unless `status` is
    /// 401 (no or wrong credentials) or 403 (the account lacks pull rights).
    pub fn access_hint(&self, status: reqwest::StatusCode) -> String {
        match status {
            reqwest::StatusCode::UNAUTHORIZED if !self.has_credentials => {
                format!(" (the registry requires credentials: set {CREDENTIALS_ENV}=name:secret)")
            }
            reqwest::StatusCode::UNAUTHORIZED => {
                format!(" (the registry refused the credentials in {CREDENTIALS_ENV})")
            }
            reqwest::StatusCode::FORBIDDEN => {
                format!(" (the account in {CREDENTIALS_ENV} may not pull this repository)")
            }
            _ => String::new(),
        }
    }
}

impl RegistrySource {
    pub fn new(client: &RegistryClient) -> RegistrySource {
        RegistrySource {
            base: client.base.clone(),
            http: client.http.clone(),
        }
    }

    async fn get(&self, what: String, url: String) -> Result<Bytes, SourceError> {
        let r = self
            .http
            .get(&url)
            .send()
            .await
            .map_err(|source| SourceError::Http {
                what: what.clone(),
                url: url.clone(),
                source,
            })?;
        if r.status() == reqwest::StatusCode::NOT_FOUND {
            return Err(SourceError::NotFound(what));
        }
        if !r.status().is_success() {
            return Err(SourceError::Status {
                what,
                url,
                status: r.status().as_u16(),
            });
        }
        r.bytes()
            .await
            .map_err(|source| SourceError::Http { what, url, source })
    }

    /// The block manifest of `env`, checked against its digest.
    pub async fn manifest(&self, env: &EnvDigest) -> Result<ManifestEnvelope, SourceError> {
        let url = format!("{}/amber/v1/envs/{env}", self.base);
        let body = self.get(format!("env {env}"), url.clone()).await?;
        let bad = |msg: String| SourceError::BadManifest {
            env: env.to_string(),
            url: url.clone(),
            msg,
        };
        let envelope: ManifestEnvelope =
            serde_json::from_slice(&body).map_err(|e| bad(e.to_string()))?;
        if envelope.manifest.env_digest() != *env {
            return Err(bad(format!(
                "its content hashes to {}",
                envelope.manifest.env_digest()
            )));
        }
        envelope
            .manifest
            .validate()
            .map_err(|e| bad(e.to_string()))?;
        Ok(envelope)
    }
}

#[async_trait]
impl ChunkSource for RegistrySource {
    async fn fetch(&self, id: &ChunkId) -> Result<Bytes, SourceError> {
        let url = format!("{}/amber/v1/chunks/{id}", self.base);
        self.get(format!("chunk {id}"), url).await
    }
}
