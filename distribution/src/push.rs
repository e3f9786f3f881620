//! Pushing into one repository: blobs streamed in one upload session each (POST, one
//! PATCH, PUT with the digest), cross-repository mounts, manifests through `oci-client`.
//! The authorization is asked once per pusher: the bearer token the registry's token
//! flow gives for pull and push on the repository, or the Basic credentials when the
//! registry asks for those.

use amber_oci::digest::{Algorithm, Digest};
use amber_oci::names::{Reference, Tag};
use bytes::Bytes;
use oci_client::RegistryOperation;

use crate::error::chain;
use crate::{Credentials, DistributionClient, DistributionError};

/// The most of a refusal's body quoted in an error.
const MAX_QUOTED_BODY: usize = 4 << 10;

enum Authorization {
    None,
    Basic { username: String, password: String },
    Bearer(String),
}

/// Pushes into one repository of a registry.
pub struct Pusher<'a> {
    client: &'a DistributionClient,
    repo: String,
    authorization: Authorization,
}

impl<'a> Pusher<'a> {
    pub(crate) async fn new(
        client: &'a DistributionClient,
        repo: &str,
    ) -> Result<Pusher<'a>, DistributionError> {
        let latest = Tag::parse("latest").expect("a tag");
        let r = client.reference(repo, &Reference::Tag(latest));
        let token = client
            .oci
            .auth(
                &r,
                &client.credentials.registry_auth(),
                RegistryOperation::Push,
            )
            .await
            .map_err(|e| client.error(format!("push access to {repo}"), e))?;
        let authorization = match (token, &client.credentials) {
            (Some(token), _) => Authorization::Bearer(token),
            (None, Credentials::Bearer { token }) => Authorization::Bearer(token.clone()),
            (None, Credentials::Basic { username, password }) => Authorization::Basic {
                username: username.clone(),
                password: password.clone(),
            },
            (None, Credentials::Anonymous) => Authorization::None,
        };
        Ok(Pusher {
            client,
            repo: repo.to_string(),
            authorization,
        })
    }

    fn url(&self, path: &str) -> String {
        let scheme = if self.client.endpoint.plain_http {
            "http"
        } else {
            "https"
        };
        format!("{scheme}://{}/v2/{}{path}", self.client.host(), self.repo)
    }

    /// An upload session's `Location` as a URL (registries may answer a path).
    fn location(&self, what: &str, r: &reqwest::Response) -> Result<String, DistributionError> {
        let loc = r
            .headers()
            .get(reqwest::header::LOCATION)
            .and_then(|v| v.to_str().ok())
            .ok_or_else(|| self.failed(what, format!("HTTP {} without a Location", r.status())))?;
        if loc.starts_with("http://") || loc.starts_with("https://") {
            return Ok(loc.to_string());
        }
        let base = self.url("");
        let origin_end = base.find("/v2/").expect("a /v2/ URL");
        Ok(format!("{}{loc}", &base[..origin_end]))
    }

    fn failed(&self, what: &str, why: String) -> DistributionError {
        DistributionError::Failed {
            host: self.client.host().into(),
            what: what.into(),
            why,
        }
    }

    fn request(&self, method: reqwest::Method, url: &str) -> reqwest::RequestBuilder {
        let req = self.client.http.request(method, url);
        match &self.authorization {
            Authorization::None => req,
            Authorization::Basic { username, password } => req.basic_auth(username, Some(password)),
            Authorization::Bearer(t) => req.bearer_auth(t),
        }
    }

    /// Sends `req`; an answer whose status is not in `ok` is an error naming `what`.
    async fn send(
        &self,
        what: &str,
        req: reqwest::RequestBuilder,
        ok: &[u16],
    ) -> Result<reqwest::Response, DistributionError> {
        let r = req.send().await.map_err(|e| self.failed(what, chain(&e)))?;
        let status = r.status().as_u16();
        if ok.contains(&status) {
            return Ok(r);
        }
        let body = r.text().await.unwrap_or_default();
        let body: String = body.chars().take(MAX_QUOTED_BODY).collect();
        let host = self.client.host().to_string();
        Err(match status {
            404 => DistributionError::NotFound {
                host,
                what: what.into(),
            },
            401 | 403 => DistributionError::Denied {
                host,
                what: what.into(),
                why: format!("HTTP {status}: {body}"),
            },
            _ => DistributionError::Failed {
                host,
                what: what.into(),
                why: format!("HTTP {status}: {body}"),
            },
        })
    }

    /// Whether the repository holds blob `d`.
    pub async fn has_blob(&self, d: &Digest) -> Result<bool, DistributionError> {
        let url = self.url(&format!("/blobs/{d}"));
        let what = format!("blob {d} of {}", self.repo);
        let r = self
            .send(
                &what,
                self.request(reqwest::Method::HEAD, &url),
                &[200, 404],
            )
            .await?;
        Ok(r.status() == reqwest::StatusCode::OK)
    }

    /// Mounts blob `d` of repository `from` here; `false` when the registry would not
    /// (the upload session it opened instead is cancelled).
    pub async fn mount(&self, d: &Digest, from: &str) -> Result<bool, DistributionError> {
        let url = self.url(&format!("/blobs/uploads/?mount={d}&from={from}"));
        let what = format!("mounting blob {d} of {from} into {}", self.repo);
        let r = self
            .send(
                &what,
                self.request(reqwest::Method::POST, &url),
                &[201, 202],
            )
            .await?;
        if r.status() == reqwest::StatusCode::CREATED {
            return Ok(true);
        }
        if let Ok(session) = self.location(&what, &r) {
            let _ = self.request(reqwest::Method::DELETE, &session).send().await;
        }
        Ok(false)
    }

    /// Makes blob `d` of repository `from` (same registry) present here: already there,
    /// mounted, or copied as a verified stream.
    pub async fn ensure_blob_from(&self, d: &Digest, from: &str) -> Result<(), DistributionError> {
        if self.has_blob(d).await? || self.mount(d, from).await? {
            return Ok(());
        }
        let stream = self.client.blob_stream(from, d).await?;
        self.upload(d, None, reqwest::Body::wrap_stream(stream))
            .await
    }

    /// Uploads `body` (`size` bytes when known) as blob `d`: POST, one streamed PATCH,
    /// PUT with the digest (the registry checks it before the blob exists).
    pub async fn upload(
        &self,
        d: &Digest,
        size: Option<u64>,
        body: reqwest::Body,
    ) -> Result<(), DistributionError> {
        let what = format!("upload of blob {d} to {}", self.repo);
        let url = self.url("/blobs/uploads/");
        let r = self
            .send(&what, self.request(reqwest::Method::POST, &url), &[202])
            .await?;
        let session = self.location(&what, &r)?;
        let mut patch = self
            .request(reqwest::Method::PATCH, &session)
            .header(reqwest::header::CONTENT_TYPE, "application/octet-stream");
        if let Some(n) = size.filter(|n| *n > 0) {
            patch = patch.header(reqwest::header::CONTENT_LENGTH, n);
        }
        let r = self.send(&what, patch.body(body), &[202]).await?;
        let session = self.location(&what, &r)?;
        let sep = if session.contains('?') { '&' } else { '?' };
        let put = format!("{session}{sep}digest={d}");
        self.send(&what, self.request(reqwest::Method::PUT, &put), &[201])
            .await?;
        Ok(())
    }

    /// Pushes `bytes` as a blob unless the repository has it; their sha256 digest.
    pub async fn push_bytes(&self, bytes: Bytes) -> Result<Digest, DistributionError> {
        let d = Digest::of(Algorithm::Sha256, &bytes);
        if !self.has_blob(&d).await? {
            let n = bytes.len() as u64;
            self.upload(&d, Some(n), bytes.into()).await?;
        }
        Ok(d)
    }

    /// Puts manifest `bytes` (of `media_type`) under `reference` (a tag or its digest).
    pub async fn put_manifest(
        &self,
        reference: &str,
        bytes: Vec<u8>,
        media_type: &str,
    ) -> Result<(), DistributionError> {
        let what = format!("manifest {}:{reference}", self.repo);
        let r = Reference::parse(reference)
            .map_err(|e| self.failed(&what, format!("not a tag or digest: {e}")))?;
        let content_type = reqwest::header::HeaderValue::from_str(media_type)
            .map_err(|e| self.failed(&what, format!("media type {media_type:?}: {e}")))?;
        self.client
            .oci
            .push_manifest_raw(&self.client.reference(&self.repo, &r), bytes, content_type)
            .await
            .map_err(|e| self.client.error(what, e))?;
        Ok(())
    }
}
