//! Conversion on push: every pushed image manifest (or the linux/amd64 entry of an index)
//! becomes a block device, in a bounded pool of workers.
//!
//! Invariants kept here:
//! - an image's state (queued, running, done, failed + error) is in the index, so it
//!   survives a restart, and unfinished conversions are resumed at startup;
//! - the mapping image digest -> env digest is written once; an image that has one is
//!   never converted again, whatever the converter version;
//! - a chunk already in the store is not written again;
//! - the block manifest envelope is stored under its env digest and published as an OCI
//!   referrer of the image manifest (artifactType `application/vnd.amber.block-manifest.v1+json`).

use std::io::{self, Read};
use std::sync::Arc;

use amber_converter::chunk::ParallelSink;
use amber_converter::manifest::{ChunkId, ManifestEnvelope, Provenance};
use amber_converter::LayerInput;
use bytes::Bytes;
use serde_json::{json, Value};
use tokio::runtime::Handle;
use tokio_util::io::{StreamReader, SyncIoBridge};

use crate::clock::now_unix;
use crate::index::{Conversion, ConversionState, ManifestRecord, ManifestWrite};
use crate::registry::Registry;
use crate::store::{ObjectKey, ObjectStore};
use amber_oci::digest::{Algorithm, Digest};
use amber_oci::manifest::{ManifestKind, ParsedManifest};
use amber_oci::names::RepoName;

pub const BLOCK_MANIFEST_TYPE: &str = amber_oci::media::BLOCK_MANIFEST_ARTIFACT;
/// The referrer artifact's layer: the envelope JSON as one zstd frame.
pub const BLOCK_MANIFEST_ZSTD_TYPE: &str = amber_oci::media::BLOCK_MANIFEST_LAYER;
/// zstd level of new chunks. Only chunks the store does not have yet are compressed, so
/// a slower, tighter level costs little once a corpus shares its bases (corpus
/// benchmark: level 9 stores 7% less than level 3).
pub const CHUNK_ZSTD_LEVEL: i32 = 9;
/// Largest envelope accepted when decompressing one (a 10 GiB device in 256 KiB
/// extents is about 6 MiB of JSON).
const MAX_ENVELOPE: usize = 256 << 20;

/// The stored form of an envelope: its JSON as one zstd frame (a block manifest is
/// mostly hex chunk ids; compressed it takes about a third).
pub fn encode_envelope(json: &[u8]) -> std::io::Result<Bytes> {
    Ok(Bytes::from(zstd::bulk::compress(json, 19)?))
}

/// The JSON of a stored envelope (zstd frame; JSON as stored before compression).
pub fn decode_envelope(stored: &[u8]) -> std::io::Result<Vec<u8>> {
    if !stored.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
        return Ok(stored.to_vec());
    }
    // Streamed with a bound: a frame's declared size is not trusted for an allocation.
    let mut out = Vec::new();
    zstd::stream::read::Decoder::new(stored)?
        .take(MAX_ENVELOPE as u64 + 1)
        .read_to_end(&mut out)?;
    if out.len() > MAX_ENVELOPE {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "envelope larger than 256 MiB",
        ));
    }
    Ok(out)
}

const EMPTY_TYPE: &str = amber_oci::media::OCI_EMPTY;
pub const ENV_ANNOTATION: &str = "dev.amber.env-digest";

pub const CONVERSIONS_STARTED: &str = "amber_conversions_started_total";
pub const CONVERSIONS_FAILED: &str = "amber_conversions_failed_total";
pub const CHUNKS_WRITTEN: &str = "amber_chunks_written_total";
pub const CHUNKS_EXISTING: &str = "amber_chunks_existing_total";
/// Compressed bytes of the chunks this registry wrote (the store's growth from conversions).
pub const CHUNK_BYTES_WRITTEN: &str = "amber_chunk_bytes_written_total";

/// Image config media types whose manifests are container images (others are artifacts).
fn is_image_config(media_type: &str) -> bool {
    matches!(
        media_type,
        amber_oci::media::OCI_CONFIG | amber_oci::media::DOCKER_CONFIG
    )
}

/// Decides what a pushed (already validated) manifest means for conversion; queues the
/// image if needed.
pub fn on_manifest_pushed(
    reg: &Arc<Registry>,
    repo: &RepoName,
    digest: &Digest,
    parsed: &ParsedManifest,
) {
    let target = match parsed.kind {
        ManifestKind::Image => {
            let config_ok = parsed
                .blobs
                .first()
                .is_some_and(|c| is_image_config(&c.media_type));
            if !config_ok || parsed.subject.is_some() {
                return; // an artifact, not a container image
            }
            digest.clone()
        }
        ManifestKind::Index => match parsed.linux_amd64() {
            Some(d) => d.digest.clone(),
            None => return,
        },
    };
    if let Err(e) = enqueue(reg, repo, &target) {
        tracing::error!(error = %e, image = %target, "queueing conversion");
    }
}

/// Queues `image` unless it has an env digest or is queued or running already.
pub fn enqueue(reg: &Arc<Registry>, repo: &RepoName, image: &Digest) -> anyhow::Result<()> {
    if reg.index.image_env(image)?.is_some() {
        return Ok(());
    }
    if let Some(c) = reg.index.conversion(image)? {
        if matches!(c.state, ConversionState::Queued | ConversionState::Running) {
            return Ok(());
        }
    }
    let c = Conversion {
        repo: repo.to_string(),
        state: ConversionState::Queued,
        error: None,
        env_digest: None,
        updated_unix: now_unix(),
    };
    reg.index.put_conversion(image, &c)?;
    spawn(reg.clone(), image.clone());
    Ok(())
}

/// Re-queues conversions that a restart interrupted.
pub fn resume(reg: &Arc<Registry>) -> anyhow::Result<usize> {
    let mut n = 0;
    for (image, c) in reg.index.conversions()? {
        if matches!(c.state, ConversionState::Queued | ConversionState::Running)
            && reg.index.image_env(&image)?.is_none()
        {
            spawn(reg.clone(), image);
            n += 1;
        }
    }
    Ok(n)
}

fn spawn(reg: Arc<Registry>, image: Digest) {
    if reg.config.convert_workers == 0 {
        return; // conversion disabled: stays queued until a restart with workers
    }
    tokio::spawn(async move {
        let Ok(_permit) = reg.convert_slots.clone().acquire_owned().await else {
            return;
        };
        let Ok(Some(mut c)) = reg.index.conversion(&image) else {
            return;
        };
        if reg.index.image_env(&image).ok().flatten().is_some() {
            return;
        }
        c.state = ConversionState::Running;
        c.updated_unix = now_unix();
        let _ = reg.index.put_conversion(&image, &c);
        metrics::counter!(CONVERSIONS_STARTED).increment(1);
        tracing::info!(%image, repo = %c.repo, "conversion started");
        let handle = Handle::current();
        let job_reg = reg.clone();
        let job_image = image.clone();
        let repo = c.repo.clone();
        let result = tokio::task::spawn_blocking(move || {
            convert_image(&job_reg, &handle, &repo, &job_image)
        })
        .await
        .unwrap_or_else(|e| Err(anyhow::anyhow!("conversion task panicked: {e}")));
        match result {
            Ok(env) => {
                c.state = ConversionState::Done;
                c.env_digest = Some(env.clone());
                c.error = None;
                c.updated_unix = now_unix();
                if let Err(e) = reg.record_conversion(&image, &c).await {
                    tracing::error!(%image, error = %e, "recording conversion in the store");
                }
                match reg.index.finish_conversion(&image, &env, &c) {
                    Ok(_) => tracing::info!(%image, %env, "conversion done"),
                    Err(e) => tracing::error!(%image, error = %e, "recording conversion"),
                }
            }
            Err(e) => {
                metrics::counter!(CONVERSIONS_FAILED).increment(1);
                tracing::warn!(%image, error = %format!("{e:#}"), "conversion failed");
                c.state = ConversionState::Failed;
                c.error = Some(format!("{e:#}"));
                c.updated_unix = now_unix();
                if let Err(e) = reg.record_conversion(&image, &c).await {
                    tracing::error!(%image, error = %e, "recording conversion in the store");
                }
                let _ = reg.index.put_conversion(&image, &c);
            }
        }
    });
}

/// A blocking reader over a stored object.
fn object_reader(
    store: &Arc<dyn ObjectStore>,
    handle: &Handle,
    key: ObjectKey,
    size: u64,
) -> anyhow::Result<impl Read> {
    let stream = handle.block_on(store.read(&key, 0..size))?;
    Ok(SyncIoBridge::new_with_handle(
        StreamReader::new(stream),
        handle.clone(),
    ))
}

/// Stores one chunk, zstd-compressed, unless the store has it. The index answers for
/// chunks this replica has seen; for others one existence check (a HEAD on S3) decides,
/// so a chunk that exists costs no write and a new one two requests.
fn store_chunk(reg: &Registry, handle: &Handle, id: ChunkId, data: &[u8]) -> io::Result<()> {
    let name = id.to_string();
    if reg.index.chunk(&name).map_err(io::Error::other)?.is_some() {
        metrics::counter!(CHUNKS_EXISTING).increment(1);
        return Ok(());
    }
    let key = ObjectKey::chunk(&id);
    if let Some(size) = handle
        .block_on(reg.store.stat(&key))
        .map_err(io::Error::other)?
    {
        reg.index.put_chunk(&name, size).map_err(io::Error::other)?;
        metrics::counter!(CHUNKS_EXISTING).increment(1);
        return Ok(());
    }
    let compressed = zstd::bulk::compress(data, CHUNK_ZSTD_LEVEL)?;
    let size = compressed.len() as u64;
    handle
        .block_on(reg.store.put(&key, Bytes::from(compressed)))
        .map_err(io::Error::other)?;
    reg.index.put_chunk(&name, size).map_err(io::Error::other)?;
    metrics::counter!(CHUNKS_WRITTEN).increment(1);
    metrics::counter!(CHUNK_BYTES_WRITTEN).increment(size);
    Ok(())
}

/// Converts one stored image manifest; returns its env digest.
fn convert_image(
    reg: &Arc<Registry>,
    handle: &Handle,
    repo: &str,
    image: &Digest,
) -> anyhow::Result<String> {
    let repo = RepoName::parse(repo)?;
    let bytes = handle.block_on(reg.store.read_all(&ObjectKey::blob(image)))?;
    let v: Value = serde_json::from_slice(&bytes)?;
    let layers = v["layers"].as_array().cloned().unwrap_or_default();
    let mut inputs = Vec::new();
    for l in &layers {
        let d: Digest = l["digest"].as_str().unwrap_or_default().parse()?;
        let size = reg.index.blob_size(&d)?.ok_or_else(|| {
            anyhow::anyhow!(
                "layer {d} is not stored (non-distributable layers cannot be converted)"
            )
        })?;
        inputs.push(LayerInput {
            name: d.to_string(),
            reader: Box::new(object_reader(
                &reg.store,
                handle,
                ObjectKey::blob(&d),
                size,
            )?),
        });
    }
    let scratch_dir = reg.config.data.join("tmp");
    std::fs::create_dir_all(&scratch_dir)?;
    let mut scratch = tempfile::tempfile_in(&scratch_dir)?;
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let (sink_reg, sink_handle) = (reg.clone(), handle.clone());
    let mut sink = ParallelSink::new(
        threads,
        Arc::new(move |id, data: &[u8]| store_chunk(&sink_reg, &sink_handle, id, data)),
    );
    let limits = amber_converter::tree::Limits {
        max_entries: reg.config.max_image_entries,
        deadline: Some(
            std::time::Instant::now() + std::time::Duration::from_secs(reg.config.max_convert_secs),
        ),
    };
    let out = amber_converter::convert_with_limits(
        inputs,
        &mut scratch,
        &mut sink,
        None,
        &mut |_| {},
        limits,
    )?;
    sink.finish()?;
    let env = out.manifest.env_digest();
    let envelope = ManifestEnvelope {
        env_digest: env,
        manifest: out.manifest,
        provenance: Provenance {
            image: Some(image.to_string()),
            diff_ids: out.diff_ids,
            converter: format!("amber-registry {}", env!("CARGO_PKG_VERSION")),
        },
    };
    let envelope_bytes = encode_envelope(&serde_json::to_vec(&envelope)?)?;
    handle.block_on(reg.store.put(&ObjectKey::env(&env), envelope_bytes.clone()))?;
    publish_referrer(
        reg,
        handle,
        &repo,
        image,
        bytes.len() as u64,
        &v,
        &envelope_bytes,
        &env.to_string(),
    )?;
    Ok(env.to_string())
}

/// Stores the envelope as a blob and an artifact manifest whose subject is the image.
#[allow(clippy::too_many_arguments)]
fn publish_referrer(
    reg: &Registry,
    handle: &Handle,
    repo: &RepoName,
    image: &Digest,
    image_size: u64,
    image_manifest: &Value,
    envelope: &Bytes,
    env: &str,
) -> anyhow::Result<()> {
    let put_blob = |data: Bytes| -> anyhow::Result<(Digest, u64)> {
        let d = Digest::of(Algorithm::Sha256, &data);
        let n = data.len() as u64;
        handle.block_on(reg.store.put(&ObjectKey::blob(&d), data))?;
        handle.block_on(reg.link_blob(repo, &d, n))?;
        Ok((d, n))
    };
    let (env_blob, env_size) = put_blob(envelope.clone())?;
    let (empty, empty_size) = put_blob(Bytes::from_static(b"{}"))?;
    let image_type = image_manifest["mediaType"]
        .as_str()
        .unwrap_or(amber_oci::media::OCI_MANIFEST);
    let artifact = json!({
        "schemaVersion": 2,
        "mediaType": amber_oci::media::OCI_MANIFEST,
        "artifactType": BLOCK_MANIFEST_TYPE,
        "config": {"mediaType": EMPTY_TYPE, "digest": empty.to_string(), "size": empty_size},
        "layers": [{"mediaType": BLOCK_MANIFEST_ZSTD_TYPE, "digest": env_blob.to_string(), "size": env_size}],
        "subject": {"mediaType": image_type, "digest": image.to_string(), "size": image_size},
        "annotations": {ENV_ANNOTATION: env},
    });
    let bytes = Bytes::from(serde_json::to_vec(&artifact)?);
    let digest = Digest::of(Algorithm::Sha256, &bytes);
    handle.block_on(reg.store.put(&ObjectKey::blob(&digest), bytes.clone()))?;
    let descriptor = json!({
        "mediaType": amber_oci::media::OCI_MANIFEST,
        "digest": digest.to_string(),
        "size": bytes.len(),
        "artifactType": BLOCK_MANIFEST_TYPE,
        "annotations": {ENV_ANNOTATION: env},
    });
    handle.block_on(reg.link_manifest(ManifestWrite {
        repo,
        digest: &digest,
        record: ManifestRecord {
            media_type: amber_oci::media::OCI_MANIFEST.into(),
            size: bytes.len() as u64,
            source: None,
        },
        tag: None,
        tag_immutable: false,
        referrer: Some((image, descriptor)),
    }))?;
    Ok(())
}
