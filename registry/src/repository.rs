//! The repository layer: what it means to push a manifest, link a blob, move a tag and
//! queue a conversion, independent of HTTP. The distribution API's handlers, `reindex`,
//! `fsck` and importers call this; they differ only in where the bytes come from.
//!
//! Invariants kept here:
//! - a manifest is stored and linked only after its bytes were validated, match the
//!   digest they were pushed under, and every blob and child manifest they name is in
//!   the repository (blob sizes as the manifest says), except layers whose bytes live
//!   elsewhere (`urls`, non-distributable);
//! - the manifest's bytes are in the store before any record names them (records.rs
//!   keeps store-before-index);
//! - every container image pushed (or the linux/amd64 entry of a pushed index) is
//!   queued for conversion exactly once per image digest (convert.rs).

use std::sync::Arc;

use amber_oci::digest::{Algorithm, Digest};
use amber_oci::manifest::{parse_manifest, ManifestError, ParsedManifest};
use amber_oci::media::non_distributable;
use amber_oci::names::{Reference, RepoName};
use bytes::Bytes;
use serde_json::Value;

use crate::index::{ManifestRecord, ManifestWrite};
use crate::records::RecordError;
use crate::registry::Registry;
use crate::store::{ObjectKey, StoreError};

/// Why a manifest push was refused or failed.
#[derive(Debug, thiserror::Error)]
pub enum PushError {
    #[error(transparent)]
    Invalid(#[from] ManifestError),
    #[error("manifest bytes have digest {actual}, not {expected}")]
    DigestMismatch { expected: Digest, actual: Digest },
    #[error("the manifest gives blob {digest} a size of {claimed} bytes but it has {actual}")]
    BlobSize {
        digest: Digest,
        claimed: u64,
        actual: u64,
    },
    #[error("blob {digest} referenced by the manifest is not in repository {repo}; push it first")]
    BlobUnknown { repo: RepoName, digest: Digest },
    #[error("manifest {digest} listed by the index is not in repository {repo}; push it first")]
    ChildUnknown { repo: RepoName, digest: Digest },
    #[error(transparent)]
    Record(#[from] RecordError),
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// A stored manifest.
pub struct PushedManifest {
    pub digest: Digest,
    pub parsed: ParsedManifest,
}

/// Pushes manifest `bytes` (sent with `content_type`) to `repo` under `reference`:
/// validates, stores, links, moves the tag, records a referrer, queues conversion.
pub async fn push_manifest(
    reg: &Arc<Registry>,
    repo: &RepoName,
    reference: &Reference,
    bytes: Bytes,
    content_type: Option<&str>,
) -> Result<PushedManifest, PushError> {
    store_manifest(reg, repo, reference, bytes, content_type, None).await
}

/// [`push_manifest`] for a manifest imported from another registry: the same checks
/// and effects, and the record says where it came from.
pub async fn store_manifest(
    reg: &Arc<Registry>,
    repo: &RepoName,
    reference: &Reference,
    bytes: Bytes,
    content_type: Option<&str>,
    source: Option<amber_api::registry::ImageSource>,
) -> Result<PushedManifest, PushError> {
    let parsed = parse_manifest(&bytes, content_type)?;
    let digest = match reference {
        Reference::Digest(d) => {
            let actual = Digest::of(d.algorithm(), &bytes);
            if &actual != d {
                return Err(PushError::DigestMismatch {
                    expected: d.clone(),
                    actual,
                });
            }
            actual
        }
        Reference::Tag(_) => Digest::of(Algorithm::Sha256, &bytes),
    };
    for b in &parsed.blobs {
        match reg.repo_blob(repo, &b.digest).await? {
            Some(actual) if actual != b.size => {
                return Err(PushError::BlobSize {
                    digest: b.digest.clone(),
                    claimed: b.size,
                    actual,
                })
            }
            Some(_) => {}
            None if b.has_urls || non_distributable(&b.media_type) => {}
            None => {
                return Err(PushError::BlobUnknown {
                    repo: repo.clone(),
                    digest: b.digest.clone(),
                })
            }
        }
    }
    for c in &parsed.children {
        if reg.manifest(repo, &c.digest).await?.is_none() {
            return Err(PushError::ChildUnknown {
                repo: repo.clone(),
                digest: c.digest.clone(),
            });
        }
    }
    reg.store
        .put(&ObjectKey::blob(&digest), bytes.clone())
        .await?;
    reg.manifest_pushed(&digest, &bytes)?;
    let tag = match reference {
        Reference::Tag(t) => Some(t),
        Reference::Digest(_) => None,
    };
    let referrer = parsed.subject.as_ref().map(|s| {
        let mut d = serde_json::json!({
            "mediaType": parsed.media_type,
            "digest": digest.to_string(),
            "size": bytes.len(),
        });
        if let Some(a) = &parsed.artifact_type {
            d["artifactType"] = Value::String(a.clone());
        }
        if let Some(a) = &parsed.annotations {
            d["annotations"] = a.clone();
        }
        (&s.digest, d)
    });
    reg.link_manifest(ManifestWrite {
        repo,
        digest: &digest,
        record: ManifestRecord {
            media_type: parsed.media_type.clone(),
            size: bytes.len() as u64,
            source,
        },
        tag,
        tag_immutable: reg.config.tags_immutable(repo.as_str()),
        referrer,
    })
    .await?;
    tracing::info!(%repo, %reference, %digest, media_type = %parsed.media_type, "manifest pushed");
    crate::convert_queue::on_manifest_pushed(reg, repo, &digest, &parsed).await;
    Ok(PushedManifest { digest, parsed })
}

/// Why an image's conversion could not be looked up.
#[derive(Debug, thiserror::Error)]
pub enum LookupError {
    #[error("index {0} has no linux/amd64 image")]
    NoLinuxAmd64(Digest),
    #[error("stored index {digest} is unreadable: {source}")]
    CorruptIndex {
        digest: Digest,
        #[source]
        source: ManifestError,
    },
    #[error("the index's env digest {0:?} is not an env digest")]
    CorruptEnv(String),
    #[error(transparent)]
    Record(#[from] RecordError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Index(#[from] crate::index::IndexError),
}

/// The image a stored manifest stands for, and where its conversion stands.
pub struct ImageConversion {
    /// The manifest itself, or an index's linux/amd64 entry.
    pub image: Digest,
    pub env: Option<amber_converter::manifest::EnvDigest>,
    pub state: amber_api::registry::ConversionState,
    /// The conversion record (error, times), when there is one.
    pub record: Option<crate::index::Conversion>,
}

/// The image manifest `digest` (of media type `media_type`) stands for and its conversion:
/// what `resolve` answers and the catalog pages show.
pub async fn image_conversion(
    reg: &Registry,
    digest: &Digest,
    media_type: &str,
) -> Result<ImageConversion, LookupError> {
    use amber_api::registry::ConversionState as State;
    use amber_oci::manifest::ManifestKind;
    let mut image = digest.clone();
    if ManifestKind::of(media_type) == Some(ManifestKind::Index) {
        let bytes = reg.manifest_bytes(digest).await?;
        let index = parse_manifest(&bytes, Some(media_type)).map_err(|source| {
            LookupError::CorruptIndex {
                digest: digest.clone(),
                source,
            }
        })?;
        image = index
            .linux_amd64()
            .map(|d| d.digest.clone())
            .ok_or_else(|| LookupError::NoLinuxAmd64(digest.clone()))?;
    }
    // Another replica may have converted it: the store's record fills the index.
    let record = reg.conversion(&image).await?;
    // A success carries its env digest (written with the image's env mapping in one
    // batch): the mapping is looked up only for a record without one.
    let env = match record.as_ref() {
        Some(c) if c.state == crate::index::ConversionState::Done && c.env_digest.is_some() => {
            c.env_digest.clone()
        }
        _ => reg.index.image_env(&image)?,
    };
    let env = env
        .map(|e| e.parse().map_err(|_| LookupError::CorruptEnv(e)))
        .transpose()?;
    let state = match (&env, &record) {
        (Some(_), _) => State::Done,
        (None, Some(c)) => match c.state {
            crate::index::ConversionState::Queued => State::Queued,
            crate::index::ConversionState::Running => State::Running,
            crate::index::ConversionState::Done => State::Done,
            crate::index::ConversionState::Failed => State::Failed,
        },
        (None, None) => State::None,
    };
    Ok(ImageConversion {
        image,
        env,
        state,
        record,
    })
}
