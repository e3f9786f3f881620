//! The registry's amber API under `/amber/v1/`, read by nodes:
//! - `GET /amber/v1/resolve/<name>/<tag-or-digest>` -> `Resolve`;
//! - `GET /amber/v1/envs/<env-digest>` -> the block manifest envelope (immutable);
//! - `GET|HEAD /amber/v1/chunks/<chunk-id>` -> zstd bytes (immutable, Range).
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
