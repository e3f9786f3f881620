//! A Rust client of the node API (`amber_api::node`), over amberd's Unix socket: what the
//! `amber` CLI and the tests call. `attach` upgrades a connection to the guest protocol's
//! frames, so `session::exec`, `put` and `get` drive a sandbox through amberd exactly as
//! they drive a VM's control port.

use std::path::Path;

use amber_api::node::{
    ApiError, BatchResult, CreateBatch, CreateSandbox, CreateSnapshot, ErrorBody, ErrorKind,
    Health, NodeInfo, Prefetch, PrefetchFrame, SandboxInfo, SandboxList, SnapshotInfo,
};
use serde::de::DeserializeOwned;

use crate::http::ATTACH_PROTOCOL;
use crate::mux::Mux;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("amberd does not answer on {socket}: {error}")]
    Unreachable { socket: String, error: String },
    #[error("{}", .0.message)]
    Api(ApiError),
    #[error("amberd answered {what}: {why}")]
    Protocol { what: String, why: String },
}

impl ClientError {
    pub fn kind(&self) -> Option<ErrorKind> {
        match self {
            ClientError::Api(e) => Some(e.kind),
            _ => None,
        }
    }
}

/// An error and its causes on one line, each cause once (an error that already quotes
/// its source is not repeated). reqwest's own message says only that sending failed; the
/// cause says why: no such socket, refused, reset.
pub fn with_causes(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let c_text = c.to_string();
        if !text.contains(&c_text) {
            text.push_str(": ");
            text.push_str(&c_text);
        }
        cause = c.source();
    }
    text
}

pub struct NodeClient {
    http: reqwest::Client,
    socket: String,
}

const BASE: &str = "http://amberd";

impl NodeClient {
    /// A client of the amberd listening on `socket`.
    pub fn unix(socket: &Path) -> NodeClient {
        NodeClient {
            http: reqwest::Client::builder()
                .unix_socket(socket)
                .build()
                .expect("a client over a Unix socket"),
            socket: socket.display().to_string(),
        }
    }

    fn url(path: &str) -> String {
        format!("{BASE}{path}")
    }

    async fn send(&self, req: reqwest::RequestBuilder) -> Result<reqwest::Response, ClientError> {
        let r = req.send().await.map_err(|e| ClientError::Unreachable {
            socket: self.socket.clone(),
            error: with_causes(&e),
        })?;
        if r.status().is_success() || r.status().as_u16() == 101 {
            return Ok(r);
        }
        let status = r.status();
        let body = r.bytes().await.unwrap_or_default();
        match serde_json::from_slice::<ErrorBody>(&body) {
            Ok(e) => Err(ClientError::Api(e.error)),
            Err(_) => Err(ClientError::Protocol {
                what: format!("HTTP {status}"),
                why: String::from_utf8_lossy(&body).into_owned(),
            }),
        }
    }

    async fn read<T: DeserializeOwned>(r: reqwest::Response) -> Result<T, ClientError> {
        let url = r.url().path().to_string();
        let body = r.bytes().await.map_err(|e| ClientError::Protocol {
            what: url.clone(),
            why: e.to_string(),
        })?;
        serde_json::from_slice(&body).map_err(|e| ClientError::Protocol {
            what: url,
            why: e.to_string(),
        })
    }

    pub async fn health(&self) -> Result<Health, ClientError> {
        Self::read(self.send(self.http.get(Self::url("/v1/health"))).await?).await
    }

    pub async fn node(&self) -> Result<NodeInfo, ClientError> {
        Self::read(self.send(self.http.get(Self::url("/v1/node"))).await?).await
    }

    pub async fn create(&self, c: &CreateSandbox) -> Result<SandboxInfo, ClientError> {
        let r = self
            .send(self.http.post(Self::url("/v1/sandboxes")).json(c))
            .await?;
        Self::read(r).await
    }

    /// Creates the batch's sandboxes on this node at once: one result per request.
    pub async fn create_batch(&self, b: &CreateBatch) -> Result<BatchResult, ClientError> {
        let r = self
            .send(self.http.post(Self::url("/v1/sandboxes/batch")).json(b))
            .await?;
        Self::read(r).await
    }

    pub async fn get(&self, id: &str) -> Result<SandboxInfo, ClientError> {
        let r = self
            .send(self.http.get(Self::url(&format!("/v1/sandboxes/{id}"))))
            .await?;
        Self::read(r).await
    }

    /// Waits (at most `timeout_s`) until the sandbox has ended; its final state.
    pub async fn wait_ended(&self, id: &str, timeout_s: u32) -> Result<SandboxInfo, ClientError> {
        let url = Self::url(&format!(
            "/v1/sandboxes/{id}/wait?ended=true&timeout_s={timeout_s}"
        ));
        Self::read(self.send(self.http.get(url)).await?).await
    }

    pub async fn list(&self) -> Result<Vec<SandboxInfo>, ClientError> {
        let r = self.send(self.http.get(Self::url("/v1/sandboxes"))).await?;
        Ok(Self::read::<SandboxList>(r).await?.sandboxes)
    }

    pub async fn delete(&self, id: &str) -> Result<SandboxInfo, ClientError> {
        let r = self
            .send(self.http.delete(Self::url(&format!("/v1/sandboxes/{id}"))))
            .await?;
        Self::read(r).await
    }

    pub async fn snapshot(
        &self,
        id: &str,
        c: &CreateSnapshot,
    ) -> Result<SnapshotInfo, ClientError> {
        let url = Self::url(&format!("/v1/sandboxes/{id}/snapshot"));
        Self::read(self.send(self.http.post(url).json(c)).await?).await
    }

    pub async fn pause(&self, id: &str) -> Result<SandboxInfo, ClientError> {
        let url = Self::url(&format!("/v1/sandboxes/{id}/pause"));
        Self::read(self.send(self.http.post(url)).await?).await
    }

    pub async fn resume(&self, id: &str) -> Result<SandboxInfo, ClientError> {
        let url = Self::url(&format!("/v1/sandboxes/{id}/resume"));
        Self::read(self.send(self.http.post(url)).await?).await
    }

    /// Fetches `image`'s env into the node's cache, calling `progress` with each frame
    /// the node sends; returns the last (`Done`). An `Error` frame is returned as
    /// `ClientError::Api` with its kind.
    pub async fn prefetch(
        &self,
        image: &str,
        mut progress: impl FnMut(&PrefetchFrame),
    ) -> Result<PrefetchFrame, ClientError> {
        let req = Prefetch {
            image: image.to_string(),
        };
        let mut r = self
            .send(self.http.post(Self::url("/v1/prefetch")).json(&req))
            .await?;
        let broken = |why: String| ClientError::Protocol {
            what: "the prefetch stream".into(),
            why,
        };
        let mut pending = Vec::new();
        loop {
            while let Some(end) = pending.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = pending.drain(..=end).collect();
                let frame: PrefetchFrame =
                    serde_json::from_slice(&line).map_err(|e| broken(e.to_string()))?;
                progress(&frame);
                match frame {
                    PrefetchFrame::Progress { .. } => {}
                    PrefetchFrame::Done { .. } => return Ok(frame),
                    PrefetchFrame::Error { kind, message } => {
                        return Err(ClientError::Api(ApiError { kind, message }))
                    }
                }
            }
            match r.chunk().await.map_err(|e| broken(e.to_string()))? {
                Some(b) => pending.extend_from_slice(&b),
                None => return Err(broken("it ended before its last frame".into())),
            }
        }
    }

    /// A connection to the sandbox carrying the guest protocol's frames.
    pub async fn attach(&self, id: &str) -> Result<Mux, ClientError> {
        let r = self
            .send(
                self.http
                    .get(Self::url(&format!("/v1/sandboxes/{id}/attach")))
                    .header(reqwest::header::CONNECTION, "upgrade")
                    .header(reqwest::header::UPGRADE, ATTACH_PROTOCOL),
            )
            .await?;
        let upgraded = r.upgrade().await.map_err(|e| ClientError::Protocol {
            what: "the attach upgrade".into(),
            why: e.to_string(),
        })?;
        Ok(Mux::new(upgraded).0)
    }
}
