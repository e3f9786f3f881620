//! Where chunks and block manifests come from: the registry's amber API
//! (`/amber/v1/chunks/<id>`, `/amber/v1/envs/<env>`), or anything else implementing
//! `ChunkSource`.

use amber_converter::manifest::{ChunkId, EnvDigest, ManifestEnvelope};
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

/// How a node reaches its registry: the base URL, an HTTP client with timeouts and the
/// account's credentials on every request (reqwest drops them on a redirect to another
/// host: presigned S3 URLs need none), and whether there are credentials (for hints).
#[derive(Clone, Debug)]
pub struct RegistryClient {
    base: String,
    pub http: reqwest::Client,
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
        RegistryClient {
            base: base.trim_end_matches('/').to_string(),
            http,
            has_credentials: credentials.is_some(),
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
