//! The registry's amber API under `/amber/v1/`, read by nodes:
//! - `GET /amber/v1/resolve/<name>/<tag-or-digest>` -> `Resolve`;
//! - `GET /amber/v1/envs/<env-digest>` -> the block manifest envelope (immutable);
//! - `GET|HEAD /amber/v1/chunks/<chunk-id>` -> zstd bytes (immutable, Range);
//! - `POST /amber/v1/imports` with an `ImportRequest` -> newline-delimited `ImportEvent`s:
//!   copies images from other registries into this one (`amber-registry import`).
//!
//! Errors are the distribution spec's `{"errors":[{"code","message"}]}` with the codes
//! `MANIFEST_UNKNOWN`, `NAME_INVALID`, `DIGEST_INVALID`, `ENV_UNKNOWN`, `CHUNK_UNKNOWN`.

use amber_oci::digest::Digest;
use amber_oci::env::{ChunkId, EnvDigest};
use amber_oci::names::{Reference, RepoName};
use serde::{Deserialize, Serialize};

/// Where an image is in its conversion to an env.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum ConversionState {
    /// Not a container image (an artifact): never converted.
    None,
    Queued,
    Running,
    Done,
    Failed,
}

/// The answer of `resolve`: what a reference names now, and its env once converted.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Resolve {
    pub name: String,
    pub reference: String,
    /// The manifest the reference names (an index for a multi-platform image).
    pub manifest_digest: Digest,
    /// The image manifest amber converts and boots (the linux/amd64 entry of an index).
    pub image_digest: Digest,
    /// Set once `state` is `done`.
    pub env_digest: Option<EnvDigest>,
    pub state: ConversionState,
    /// Why the conversion failed, when `state` is `failed`.
    pub error: Option<String>,
    /// Where the manifest came from, when it was imported from another registry
    /// (`amber-registry import` or pull-through) rather than pushed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<ImageSource>,
}

/// Where an imported manifest came from.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct ImageSource {
    /// The reference it was imported by, in full (`docker.io/library/python:3.11-slim`).
    pub reference: String,
    /// Its digest on the upstream: the digest of the bytes amber stores.
    pub digest: Digest,
    /// When it was imported (seconds since the Unix epoch).
    pub imported_unix: u64,
}

/// `POST /amber/v1/imports`
pub const IMPORTS_PATH: &str = "/amber/v1/imports";

/// What to import: `sources` are references (`host/name:tag`, `host/name@sha256:…`, or
/// `host/name` for every tag of a repository); a short name is Docker Hub's, as the
/// Docker CLI reads it. Each lands in the repository `mirror_repository` names.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct ImportRequest {
    pub sources: Vec<String>,
    /// Every platform of a multi-platform index (default: only linux/amd64, stored as
    /// that image's manifest under the tag).
    #[serde(default)]
    pub all_platforms: bool,
    /// Credentials per upstream registry host (`host[:port]`, as references name it).
    #[serde(default)]
    pub credentials: std::collections::BTreeMap<String, UpstreamCredential>,
    /// Images imported at once (default 4).
    #[serde(default)]
    pub jobs: Option<usize>,
}

/// How to authenticate to an upstream: Basic credentials (also what the Docker token
/// flow exchanges for a bearer token) or a bearer token as it is.
#[derive(Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase", tag = "kind")]
pub enum UpstreamCredential {
    Basic { username: String, password: String },
    Bearer { token: String },
}

impl std::fmt::Debug for UpstreamCredential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            UpstreamCredential::Basic { username, .. } => write!(f, "Basic({username}, ***)"),
            UpstreamCredential::Bearer { .. } => f.write_str("Bearer(***)"),
        }
    }
}

/// One line of an import's answer.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case", tag = "event")]
pub enum ImportEvent {
    /// The sources expanded (repositories to their tags): this many images to import.
    Planned { images: usize },
    /// An image's manifests were read: `bytes` of blobs are to be fetched.
    Started {
        source: String,
        target: String,
        blobs: usize,
        bytes: u64,
    },
    /// Blob bytes fetched since the last such event (progress).
    Fetched { bytes: u64 },
    /// An image finished: stored (`error` none) or refused, with nothing of it stored.
    Finished {
        source: String,
        target: String,
        manifest_digest: Option<Digest>,
        /// Blobs transferred from the upstream, and blobs already held (not transferred).
        blobs_fetched: usize,
        blobs_present: usize,
        bytes_fetched: u64,
        error: Option<String>,
    },
    /// The whole run.
    Summary {
        images_imported: usize,
        images_failed: usize,
        blobs_fetched: usize,
        blobs_present: usize,
        bytes_fetched: u64,
    },
}

/// `/amber/v1/resolve/<name>/<reference>`
pub fn resolve_path(name: &RepoName, reference: &Reference) -> String {
    format!("/amber/v1/resolve/{name}/{reference}")
}

/// `/amber/v1/envs/<env>`
pub fn env_path(env: &EnvDigest) -> String {
    format!("/amber/v1/envs/{env}")
}

/// `/amber/v1/chunks/<chunk>`
pub fn chunk_path(chunk: &ChunkId) -> String {
    format!("/amber/v1/chunks/{chunk}")
}
