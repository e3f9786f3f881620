//! What the registry tells about an env beyond its block manifest: its summary (device
//! size, chunks, stored bytes), noted once in the index, how much of it other envs share,
//! and the registry's stored bytes over time. The catalog pages read these; conversions
//! note each new env; a background pass notes envs converted before the index kept
//! summaries and samples the stored bytes once a minute.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use amber_converter::manifest::{EnvDigest, ManifestEnvelope};

use crate::index::{EnvInfo, Sharing};
use crate::registry::Registry;
use crate::store::{ObjectKey, StoreError};

#[derive(Debug, thiserror::Error)]
pub enum EnvError {
    #[error("env {0} is not in this registry")]
    Unknown(String),
    #[error("the stored block manifest of env {env} is unreadable: {reason}")]
    Corrupt { env: String, reason: String },
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Index(#[from] crate::index::IndexError),
}

/// The block manifest envelope of `env`, from the store.
pub async fn envelope(reg: &Registry, env: &str) -> Result<ManifestEnvelope, EnvError> {
    let digest: EnvDigest = env.parse().map_err(|_| EnvError::Unknown(env.into()))?;
    let stored = match reg.store.read_all(&ObjectKey::env(&digest)).await {
        Ok(b) => b,
        Err(StoreError::NotFound(_)) => return Err(EnvError::Unknown(env.into())),
        Err(e) => return Err(e.into()),
    };
    let corrupt = |reason: String| EnvError::Corrupt {
        env: env.into(),
        reason,
    };
    let json = crate::convert::decode_envelope(&stored).map_err(|e| corrupt(e.to_string()))?;
    serde_json::from_slice(&json).map_err(|e| corrupt(e.to_string()))
}

/// The distinct chunk ids an envelope names, in order.
pub fn chunk_ids(envelope: &ManifestEnvelope) -> Vec<String> {
    envelope
        .manifest
        .extents
        .iter()
        .map(|e| e.chunk.to_string())
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect()
}

/// The summary of `env`: the index's, or made from its envelope and noted.
pub async fn info(reg: &Registry, env: &str) -> Result<EnvInfo, EnvError> {
    if let Some(info) = reg.index.env(env)? {
        return Ok(info);
    }
    let envelope = envelope(reg, env).await?;
    note(reg, env, &envelope).await
}

/// [`info`] when the caller holds the envelope already.
pub async fn info_of(
    reg: &Registry,
    env: &str,
    envelope: &ManifestEnvelope,
) -> Result<EnvInfo, EnvError> {
    match reg.index.env(env)? {
        Some(info) => Ok(info),
        None => note(reg, env, envelope).await,
    }
}

/// Notes `env` from its envelope: the summary, counted once in the totals, and one more
/// env naming each of its chunks.
pub async fn note(
    reg: &Registry,
    env: &str,
    envelope: &ManifestEnvelope,
) -> Result<EnvInfo, EnvError> {
    let chunks = chunk_ids(envelope);
    let mut chunk_bytes = 0;
    for id in &chunks {
        chunk_bytes += match reg.index.chunk(id)? {
            Some(n) => n,
            // Stored by another replica: the store knows its size.
            None => match id.parse() {
                Ok(c) => reg.store.stat(&ObjectKey::chunk(&c)).await?.unwrap_or(0),
                Err(_) => 0,
            },
        };
    }
    let m = &envelope.manifest;
    let info = EnvInfo {
        device_size: m.device_size,
        filesystem: m.filesystem.clone(),
        extents: m.extents.len() as u64,
        chunks: chunks.len() as u64,
        chunk_bytes,
    };
    reg.index.put_env(env, &info, &chunks)?;
    Ok(info)
}

/// How much of `envelope`'s chunks other envs name too.
pub fn sharing(reg: &Registry, envelope: &ManifestEnvelope) -> Result<Sharing, EnvError> {
    Ok(reg.index.sharing(&chunk_ids(envelope))?)
}

/// Hours since the epoch, the unit of the stored-bytes history.
pub fn hour_now() -> u64 {
    crate::clock::now_unix() / 3600
}

/// Records this hour's stored bytes in the history.
pub fn sample_stored_bytes(reg: &Registry) -> Result<(), EnvError> {
    let totals = reg.index.totals()?;
    reg.index
        .record_stored_bytes(hour_now(), totals.stored_bytes())?;
    Ok(())
}

/// Starts the background pass: notes every env the index maps an image to but has no
/// summary of (envs converted before summaries were kept, or by another replica), then
/// samples the stored bytes once a minute.
pub fn start(reg: &Arc<Registry>) {
    reg.spawn_background(|reg| async move {
        let mut after: Option<String> = None;
        loop {
            let (envs, next) = match reg.index.envs_to_note(after.as_deref(), 256) {
                Ok(page) => page,
                Err(e) => {
                    tracing::warn!(error = %e, "listing envs to summarize");
                    break;
                }
            };
            for env in envs {
                if let Err(e) = info(&reg, &env).await {
                    tracing::warn!(%env, error = %e, "summarizing an env");
                }
            }
            match next {
                Some(n) => after = Some(n),
                None => break,
            }
        }
        let mut tick = tokio::time::interval(Duration::from_secs(60));
        loop {
            tick.tick().await;
            if let Err(e) = sample_stored_bytes(&reg) {
                tracing::warn!(error = %e, "sampling stored bytes");
            }
        }
    });
}
