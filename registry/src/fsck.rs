//! `amber-registry fsck`: re-hashes every stored object (blobs by their OCI digest,
//! layer recipes by the digest of the blob they rebuild, chunks by blake3 of their decompressed bytes, block manifests by their env digest) and
//! checks the index against the store, and looks for upload data nothing refers to.
//! Reports problems and changes nothing; `repair` then removes only unreferenced partial
//! data (staged uploads no session refers to).

use amber_converter::manifest::{ChunkId, ManifestEnvelope};
use futures_util::StreamExt;

use crate::registry::Registry;
use crate::store::ObjectKey;

/// One inconsistency found by fsck.
#[derive(Debug, PartialEq, Eq)]
pub enum Problem {
    /// An object whose bytes do not hash to its name.
    CorruptObject { key: String, actual: String },
    /// An object whose key is not a digest.
    UnexpectedObject { key: String },
    /// The index knows a blob the store does not have, or has with another size.
    MissingObject { digest: String },
    SizeMismatch {
        digest: String,
        indexed: u64,
        stored: u64,
    },
    /// Staged upload data no upload session refers to (left by a crash or an expiry
    /// that did not finish).
    OrphanStaging { id: String, bytes: u64 },
    /// Upload data kept where a blob could be published from it (s3: `data/`) that no
    /// blob names and no upload session refers to: a crash between an append and its
    /// acknowledgement, or between a session's end and its publish. Left for a person:
    /// a push that ended in between can make a false one, so check it twice.
    UnlinkedUpload { key: String, bytes: u64 },
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Problem::CorruptObject { key, actual } => {
                write!(f, "object {key} is corrupt: its bytes hash to {actual}")
            }
            Problem::UnexpectedObject { key } => write!(f, "object {key} is not named by a digest"),
            Problem::OrphanStaging { id, bytes } => write!(
                f,
                "staged upload data {id} ({bytes} bytes) belongs to no upload session"
            ),
            Problem::UnlinkedUpload { key, bytes } => write!(
                f,
                "upload data {key} ({bytes} bytes) is named by no blob and no upload session"
            ),
            Problem::MissingObject { digest } => {
                write!(f, "indexed blob {digest} is missing from the store")
            }
            Problem::SizeMismatch {
                digest,
                indexed,
                stored,
            } => {
                write!(
                    f,
                    "blob {digest} is indexed with {indexed} bytes but stored with {stored}"
                )
            }
        }
    }
}

/// Runs every check; returns the number of objects checked and the problems found.
pub async fn check(reg: &Registry) -> anyhow::Result<(usize, Vec<Problem>)> {
    let mut problems = Vec::new();
    let keys = reg.store.list("blobs/").await?;
    for key in &keys {
        let Some(digest) = key.blob_digest() else {
            problems.push(Problem::UnexpectedObject {
                key: key.as_str().into(),
            });
            continue;
        };
        let size = reg.store.stat(key).await?.unwrap_or(0);
        let mut hasher = digest.algorithm().hasher();
        let mut s = reg.store.read(key, 0..size).await?;
        while let Some(chunk) = s.next().await {
            hasher.update(&chunk?);
        }
        let actual = hasher.finish();
        if actual != digest {
            problems.push(Problem::CorruptObject {
                key: key.as_str().into(),
                actual: actual.to_string(),
            });
        }
    }
    // Recipes: each rebuilds, from its chunks and literals, exactly the blob it names.
    let recipe_keys = reg.store.list("recipes/").await?;
    for key in &recipe_keys {
        let Some(digest) = key.recipe_digest() else {
            problems.push(Problem::UnexpectedObject {
                key: key.as_str().into(),
            });
            continue;
        };
        if let Err(e) = crate::recipe::check(&reg.store, &digest).await {
            problems.push(Problem::CorruptObject {
                key: key.as_str().into(),
                actual: e.to_string(),
            });
        }
    }
    // Chunks: zstd bytes whose decompressed content hashes (blake3) to the name.
    let chunk_keys = reg.store.list("chunks/").await?;
    for key in &chunk_keys {
        let name = key.as_str().rsplit('/').next().unwrap_or("");
        let Ok(id) = format!("blake3:{name}").parse::<ChunkId>() else {
            problems.push(Problem::UnexpectedObject {
                key: key.as_str().into(),
            });
            continue;
        };
        let bytes = reg.store.read_all(key).await?;
        let actual = zstd::stream::decode_all(&bytes[..]).map(|d| ChunkId::of(&d));
        match actual {
            Ok(a) if a == id => {}
            Ok(a) => problems.push(Problem::CorruptObject {
                key: key.as_str().into(),
                actual: a.to_string(),
            }),
            Err(e) => problems.push(Problem::CorruptObject {
                key: key.as_str().into(),
                actual: format!("undecodable zstd: {e}"),
            }),
        }
    }
    // Block manifests: stored under the digest of their canonical encoding.
    let env_keys = reg.store.list("envs/").await?;
    for key in &env_keys {
        let name = key.as_str().rsplit('/').next().unwrap_or("");
        let bytes = reg.store.read_all(key).await?;
        let actual = crate::convert::decode_envelope(&bytes)
            .map_err(|e| e.to_string())
            .and_then(|json| {
                serde_json::from_slice::<ManifestEnvelope>(&json).map_err(|e| e.to_string())
            })
            .map(|e| e.manifest.env_digest().hex());
        if actual.as_deref().ok() != Some(name) {
            let actual = actual.unwrap_or_else(|e| format!("unparsable envelope: {e}"));
            problems.push(Problem::CorruptObject {
                key: key.as_str().into(),
                actual,
            });
        }
    }
    for (digest, indexed) in reg.index.blobs()? {
        match crate::recipe::stored_size(reg.store.as_ref(), &ObjectKey::blob(&digest)).await? {
            None => problems.push(Problem::MissingObject {
                digest: digest.to_string(),
            }),
            Some(stored) if stored != indexed => problems.push(Problem::SizeMismatch {
                digest: digest.to_string(),
                indexed,
                stored,
            }),
            Some(_) => {}
        }
    }
    let staged = reg.store.list_staged().await?;
    for id in &staged {
        if !in_session(reg, id).await? {
            let bytes = reg.store.staged_len(id).await?.unwrap_or(0);
            problems.push(Problem::OrphanStaging {
                id: id.clone(),
                bytes,
            });
        }
    }
    let unlinked = reg.store.unlinked_uploads().await?;
    for u in &unlinked {
        if !in_session(reg, &u.id).await? {
            problems.push(Problem::UnlinkedUpload {
                key: u.key.clone(),
                bytes: u.bytes,
            });
        }
    }
    Ok((
        keys.len()
            + recipe_keys.len()
            + chunk_keys.len()
            + env_keys.len()
            + staged.len()
            + unlinked.len(),
        problems,
    ))
}

/// Whether upload `id` has a live session (its staged data is still in use).
async fn in_session(reg: &Registry, id: &str) -> anyhow::Result<bool> {
    Ok(match crate::uploads::SessionId::parse(id) {
        Some(sid) => reg.upload_session(&sid).await?.is_some(),
        None => false,
    })
}

/// Removes what `check` found that is unreferenced partial data; returns what was
/// removed. Everything else (a corrupt or missing object) needs a person: it is left
/// as it is. Over a shared bucket another replica's sessions are not in this index, so
/// nothing is removed there.
pub async fn repair(reg: &Registry, problems: &[Problem]) -> anyhow::Result<Vec<String>> {
    if reg.config.storage == crate::config::StorageKind::S3 {
        anyhow::bail!(
            "fsck --repair works on local storage only: over S3 other replicas' upload sessions are not in this index (they expire on their own)"
        );
    }
    let mut removed = Vec::new();
    for p in problems {
        if let Problem::OrphanStaging { id, .. } = p {
            reg.store.remove_staged(id, &[]).await?;
            removed.push(format!("staged upload data {id}"));
        }
    }
    Ok(removed)
}
