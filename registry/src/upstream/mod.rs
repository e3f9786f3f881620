//! Upstream registries: copying images from other OCI registries into amber
//! (`amber-registry import`, `POST /amber/v1/imports`) and pulling through to the
//! configured ones (`upstreams`) on the first reference to an image they hold.
//!
//! An image of upstream `host` lives in amber under `<mirror_prefix(host)>/<repository>`
//! (`docker.io/library/python`, `127.0.0.1-5001/team/task`): one name for import,
//! pull-through and the node's resolve of `host/name:tag`. Once there it is served from
//! amber alone: a tag imported once is not looked up upstream again, so the upstream's
//! tag may move or the upstream disappear and the reference still names the same bytes.
//!
//! Invariants kept here (import.rs):
//! - every manifest and blob is checked against its digest before it is stored; a blob
//!   whose bytes do not match is never published;
//! - an image becomes visible (blobs linked into the repository, manifests stored, the
//!   tag moved) only after every blob it needs is in the store: an image that fails
//!   leaves nothing in its repository. Blobs it fetched before failing stay in the
//!   content store, unlinked, so a re-run does not fetch them again;
//! - blobs the store holds already (in any repository) are linked, not fetched.

mod client;
mod import;

pub use crate::docker_config::{docker_config_credentials, CredentialsError};
pub use crate::mirrors::{UpstreamSpec, Upstreams};
pub use client::{UpstreamClient, UpstreamError};
pub use import::{import, pull_through, ImportError, ImportOptions};
