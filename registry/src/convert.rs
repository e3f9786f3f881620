//! Conversion on push: every pushed image manifest (or the linux/amd64 entry of an index)
//! becomes a block device. Queueing, claiming and recording outcomes is `convert_queue`'s;
//! this module converts one image.
//!
//! Invariants kept here:
//! - the mapping image digest -> env digest is written once; an image that has one is
//!   never converted again, whatever the converter version;
//! - a chunk already in the store is not written again;
//! - a layer-chain state (`chains/…`) is stored only after every chunk it names, and is
//!   only ever an optimisation: one that cannot be read or used means a full conversion;
//! - the block manifest envelope is stored under its env digest and published as an OCI
//!   referrer of the image manifest (artifactType `application/vnd.amber.block-manifest.v1+json`).

use std::collections::HashMap;
use std::io::{self, Read};
use std::sync::{Arc, Mutex};

use amber_converter::chain::{chain_keys, ChainKey, ChainState};
use amber_converter::chunk::{ChunkSource, ParallelSink};

use crate::chain_flight::Listed;
use amber_converter::manifest::{ChunkId, EnvDigest, ManifestEnvelope, Provenance};
use amber_converter::{LayerInput, Reuse};
use bytes::Bytes;
use serde_json::{json, Value};
use tokio::runtime::Handle;
use tokio_util::io::{StreamReader, SyncIoBridge};

use crate::index::{ManifestRecord, ManifestWrite};
use crate::registry::Registry;
use crate::store::ObjectKey;
use amber_oci::digest::{Algorithm, Digest};
use amber_oci::names::RepoName;

pub const BLOCK_MANIFEST_TYPE: &str = amber_oci::media::BLOCK_MANIFEST_ARTIFACT;
/// The referrer artifact's layer: the envelope JSON as one zstd frame.
pub const BLOCK_MANIFEST_ZSTD_TYPE: &str = amber_oci::media::BLOCK_MANIFEST_LAYER;
/// Largest envelope accepted when decompressing one (a 10 GiB device in 256 KiB
/// extents is about 6 MiB of JSON).
const MAX_ENVELOPE: usize = 256 << 20;

/// zstd level of stored envelopes. A block manifest is mostly hex chunk ids, which any
/// level packs to about a third; level 19 saves another 10% but took 0.85 s on a 1 MiB
/// envelope (a 700 MiB image), most of a conversion that reuses its base (level 3:
/// 0.01 s).
const ENVELOPE_ZSTD_LEVEL: i32 = 3;

/// The stored form of an envelope: its JSON as one zstd frame.
pub fn encode_envelope(json: &[u8]) -> std::io::Result<Bytes> {
    Ok(Bytes::from(zstd::bulk::compress(
        json,
        ENVELOPE_ZSTD_LEVEL,
    )?))
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
/// Layers conversions read and decompressed.
pub const CONVERT_LAYERS_READ: &str = "amber_conversion_layers_read_total";
/// Layers conversions did not read because a kept layer-chain state covered them.
pub const CONVERT_LAYERS_REUSED: &str = "amber_conversion_layers_reused_total";

/// A blocking reader over a stored object.
fn object_reader(
    reg: &Arc<Registry>,
    handle: &Handle,
    key: ObjectKey,
    size: u64,
) -> anyhow::Result<impl Read> {
    let stream = handle.block_on(crate::recipe::read_object(&reg.store, &key, 0..size))?;
    Ok(UntilStopped {
        inner: SyncIoBridge::new_with_handle(StreamReader::new(stream), handle.clone()),
        stopping: reg.stopping.clone(),
    })
}

/// What a conversion's reads and chunk writes fail with once the server is stopping:
/// the conversion ends without an outcome, and its work item stays queued.
#[derive(Debug, thiserror::Error)]
#[error("the registry is stopping")]
pub struct Stopping;

/// The error a read or chunk write gives when the server is stopping.
fn stopping_error() -> io::Error {
    io::Error::other(Stopping)
}

/// A layer reader that fails with `Stopping` once the server stops, so a conversion ends
/// within one read of a SIGTERM instead of holding the process.
struct UntilStopped<R> {
    inner: R,
    stopping: tokio_util::sync::CancellationToken,
}

impl<R: Read> Read for UntilStopped<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.stopping.is_cancelled() {
            return Err(stopping_error());
        }
        self.inner.read(buf)
    }
}

/// A chunk a conversion wrote or found in the store, recorded in the index only once
/// the store's batch is synced (`ObjectStore::put_batched`): the index never names a
/// chunk that a crash could still cut short.
struct ChunkNote {
    id: ChunkId,
    /// Its stored (compressed) size.
    size: u64,
    /// Written below the store's level: waits for `recompress`.
    recompress: bool,
    /// Written by this conversion (in `Registry::unsynced_chunks` until recorded).
    written: bool,
}

/// Stores one chunk, zstd-compressed at the conversion's level, unless the store has it.
/// The index answers for chunks this replica has recorded; for others one existence
/// check (a HEAD on S3) decides, so a chunk that exists costs no write and a new one two
/// requests. What it wrote or found goes to `notes`, for the index once the batch is
/// synced. Returns the compressed bytes written (0 for a chunk the store had).
fn store_chunk(
    reg: &Registry,
    handle: &Handle,
    id: ChunkId,
    data: &[u8],
    notes: &Mutex<Vec<ChunkNote>>,
) -> io::Result<u64> {
    if reg.stopping.is_cancelled() {
        return Err(stopping_error());
    }
    let note = |n: ChunkNote| notes.lock().unwrap_or_else(|p| p.into_inner()).push(n);
    if indexed(reg, &id)? {
        metrics::counter!(CHUNKS_EXISTING).increment(1);
        return Ok(0);
    }
    let key = ObjectKey::chunk(&id);
    let damaged = match found_chunk(reg, handle, &id)? {
        Found::Whole { size, recompress } => {
            metrics::counter!(CHUNKS_EXISTING).increment(1);
            note(ChunkNote {
                id,
                size,
                recompress,
                written: false,
            });
            return Ok(0);
        }
        Found::Missing => false,
        Found::Damaged => true,
    };
    let level = reg.config.convert_zstd_level;
    let recompress = level < reg.config.chunk_zstd_level;
    let compressed = Bytes::from(compress_chunk(data, level)?);
    let size = compressed.len() as u64;
    if damaged {
        handle
            .block_on(reg.store.put_replacing(&key, compressed))
            .map_err(io::Error::other)?;
    } else {
        // Listed before it is linked: a conversion that finds the object trusts it.
        unsynced(reg).insert(id, recompress);
        reg.store
            .put_batched(handle, &key, compressed)
            .map_err(io::Error::other)?;
    }
    note(ChunkNote {
        id,
        size,
        recompress,
        written: !damaged,
    });
    metrics::counter!(CHUNKS_WRITTEN).increment(1);
    metrics::counter!(CHUNK_BYTES_WRITTEN).increment(size);
    Ok(size)
}

/// Whether the index records chunk `id` (stored, and durable).
fn indexed(reg: &Registry, id: &ChunkId) -> io::Result<bool> {
    Ok(reg
        .index
        .chunk(&id.to_string())
        .map_err(io::Error::other)?
        .is_some())
}

fn unsynced(reg: &Registry) -> std::sync::MutexGuard<'_, HashMap<ChunkId, bool>> {
    reg.unsynced_chunks
        .lock()
        .unwrap_or_else(|p| p.into_inner())
}

/// What the store holds under a chunk's key that the index does not record.
enum Found {
    Missing,
    /// Whole: `recompress` when this process wrote it below the store's level.
    Whole {
        size: u64,
        recompress: bool,
    },
    /// Bytes that are not the chunk: a batched write a crash cut short.
    Damaged,
}

/// Looks for chunk `id`, which the index does not record, in the store. An object this
/// process wrote in a batch not yet synced is whole; on a store where a crash can cut a
/// batched write short, any other object is read and checked against its id. Such an
/// object is rare: one left by a crash (or whose index entry a crash lost), or one that
/// another conversion recorded between the caller's look at the index and this one.
fn found_chunk(reg: &Registry, handle: &Handle, id: &ChunkId) -> io::Result<Found> {
    let key = ObjectKey::chunk(id);
    let Some(size) = reg
        .store
        .stat_blocking(handle, &key)
        .map_err(io::Error::other)?
    else {
        return Ok(Found::Missing);
    };
    if let Some(&recompress) = unsynced(reg).get(id) {
        return Ok(Found::Whole { size, recompress });
    }
    if !reg.store.batched_may_be_short() {
        return Ok(Found::Whole {
            size,
            recompress: false,
        });
    }
    let stored = handle
        .block_on(reg.store.read_all(&key))
        .map_err(io::Error::other)?;
    if decompress_chunk(&stored).is_ok_and(|bytes| ChunkId::of(&bytes) == *id) {
        return Ok(Found::Whole {
            size: stored.len() as u64,
            recompress: false,
        });
    }
    tracing::warn!(chunk = %id, "the stored chunk does not match its id (a write a crash cut short?); writing it again");
    Ok(Found::Damaged)
}

/// Records what a conversion's chunk writes left in `notes` once they are durable: one
/// sync of the store's batch, then the index (sizes, totals, recompression notes). The
/// chunks it wrote leave `Registry::unsynced_chunks` either way (after a failure, a
/// later conversion that finds one reads it to check it).
fn record_chunks(
    reg: &Registry,
    handle: &Handle,
    notes: Vec<ChunkNote>,
    converted: bool,
) -> anyhow::Result<()> {
    let recorded = if converted {
        index_chunks(reg, handle, &notes)
    } else {
        Ok(())
    };
    let mut unsynced = unsynced(reg);
    for n in notes.iter().filter(|n| n.written) {
        unsynced.remove(&n.id);
    }
    recorded
}

/// One sync of the store's batch, then every note in the index.
fn index_chunks(reg: &Registry, handle: &Handle, notes: &[ChunkNote]) -> anyhow::Result<()> {
    reg.store.sync_batch(handle)?;
    for n in notes {
        if reg
            .index
            .put_chunk(&n.id.to_string(), n.size, n.recompress)?
        {
            metrics::gauge!(crate::metrics::CHUNKS_TO_RECOMPRESS).increment(1);
        }
    }
    Ok(())
}

/// `data` as one zstd frame at `level`, with a compression context kept per thread: a
/// fresh context per chunk spent a tenth of a conversion allocating and clearing its
/// tables.
pub(crate) fn compress_chunk(data: &[u8], level: i32) -> io::Result<Vec<u8>> {
    thread_local! {
        static COMPRESSOR: std::cell::RefCell<Option<(i32, zstd::bulk::Compressor<'static>)>> =
            const { std::cell::RefCell::new(None) };
    }
    COMPRESSOR.with(|c| {
        let mut c = c.borrow_mut();
        if c.as_ref().is_none_or(|(l, _)| *l != level) {
            *c = Some((level, zstd::bulk::Compressor::new(level)?));
        }
        c.as_mut().expect("made above").1.compress(data)
    })
}

/// Reads chunks back from the store for a conversion that starts from a kept layer-chain
/// state (the converter checks each against its id).
struct StoreChunks {
    reg: Arc<Registry>,
    handle: Handle,
}

impl ChunkSource for StoreChunks {
    fn chunk(&mut self, id: &ChunkId) -> io::Result<Vec<u8>> {
        let stored = self
            .handle
            .block_on(self.reg.store.read_all(&ObjectKey::chunk(id)))
            .map_err(|e| io::Error::other(format!("reading chunk {id}: {e}")))?;
        decompress_chunk(&stored)
    }
}

/// The bytes of a stored chunk (one zstd frame), at most one byte past `MAX_CHUNK` (the
/// caller checks them against the chunk's id).
pub(crate) fn decompress_chunk(stored: &[u8]) -> io::Result<Vec<u8>> {
    let mut out = Vec::new();
    zstd::stream::read::Decoder::new(stored)?
        .take(amber_converter::chunk::MAX_CHUNK + 1)
        .read_to_end(&mut out)?;
    Ok(out)
}

/// The most layer-chain states one conversion keeps (each is a copy of the tree while
/// the conversion runs).
const MAX_KEPT_CHAINS: usize = 16;
/// The state of an image's whole chain is kept when it costs at most 1/this of the chunk
/// bytes the conversion stored: a big image (a base that sandboxes are snapshotted
/// from) keeps it, so its first snapshot converts only its own layer, while a task
/// image of a few new MiB over a shared base keeps none.
const WHOLE_CHAIN_STATE_SHARE: u64 = 50;
/// Fewer bytes than an encoded layer-chain state takes per inode (each small file's
/// entry holds its 32-byte blake3; measured states take about 34 bytes a file): how the
/// whole image's state is judged too large for `WHOLE_CHAIN_STATE_SHARE` before it is
/// computed (computing and encoding it took about 5% of the corpus's conversion CPU,
/// for states almost never kept).
const MIN_STATE_BYTES_PER_INODE: u64 = 16;
/// About what an encoded layer-chain state takes per inode (measured: a third of a MiB
/// per 10,000 files).
const STATE_BYTES_PER_INODE: u64 = 34;
/// A chain no image had before keeps its state when its top layer's uncompressed bytes
/// are at least this many times the state's (about 34 B an inode): a base layer, or a
/// task environment's dependencies, which the next image on it would read again (the
/// corpus: each base and each big environment layer was read twice). A state then costs
/// at most about a tenth of what that layer adds to the store.
const FIRST_SIGHT_LAYER_SHARE: u64 = 32;
/// How long a conversion waits for the state of its lower layers that another
/// conversion of this process is making (`chain_flight`) before it reads them itself.
const CHAIN_WAIT: std::time::Duration = std::time::Duration::from_secs(300);

/// What `.env` memo objects hold: the env of exactly one chain of layers.
#[derive(serde::Serialize, serde::Deserialize)]
struct ChainEnv {
    env: String,
}

/// The kept state of the longest chain among `keys` (prefixes of the image's layers)
/// that has one, if any. A damaged state is skipped (and replaced by this conversion).
fn longest_kept_chain(
    reg: &Registry,
    handle: &Handle,
    keys: &[ChainKey],
) -> anyhow::Result<Option<ChainState>> {
    for (i, key) in keys.iter().enumerate().rev() {
        let obj = ObjectKey::chain(key);
        if reg.store.stat_blocking(handle, &obj)?.is_none() {
            continue;
        }
        let bytes = handle.block_on(reg.store.read_all(&obj))?;
        match ChainState::decode(&bytes) {
            Ok(state) if state.layers as usize == i + 1 => return Ok(Some(state)),
            Ok(state) => tracing::warn!(
                chain = %key.hex(),
                layers = state.layers,
                "kept layer chain state has the wrong length; ignored"
            ),
            Err(e) => {
                tracing::warn!(chain = %key.hex(), error = %e, "kept layer chain state ignored")
            }
        }
    }
    Ok(None)
}

/// The env and stored envelope of a conversion of exactly these layers, if one ran.
fn converted_chain(
    reg: &Registry,
    handle: &Handle,
    key: &ChainKey,
) -> anyhow::Result<Option<(String, Bytes)>> {
    let memo = ObjectKey::chain_env(key);
    if reg.store.stat_blocking(handle, &memo)?.is_none() {
        return Ok(None);
    }
    let Ok(memo) = serde_json::from_slice::<ChainEnv>(&handle.block_on(reg.store.read_all(&memo))?)
    else {
        return Ok(None);
    };
    let Ok(env) = memo.env.parse::<EnvDigest>() else {
        return Ok(None);
    };
    let envelope = ObjectKey::env(&env);
    if reg.store.stat_blocking(handle, &envelope)?.is_none() {
        return Ok(None);
    }
    Ok(Some((
        memo.env,
        handle.block_on(reg.store.read_all(&envelope))?,
    )))
}

/// One layer of the image being converted.
struct Layer {
    digest: Digest,
    size: u64,
    /// An uncompressed tar (its media type says so): it may be kept as a recipe.
    uncompressed: bool,
}

/// What converting an image gave: its env digest, and the envelope when this conversion
/// made it (not when the env was reused), so the caller can note it without reading it
/// back from the store.
pub(crate) struct ImageConverted {
    pub env: String,
    pub envelope: Option<ManifestEnvelope>,
}

/// Converts one stored image manifest; returns its env digest. Work done before for the
/// same lower layers is reused (`amber_converter::chain`): the layers below the longest
/// kept chain are not read, and an image whose every layer was converted before (the
/// same layers under another config or tag) is not converted at all.
pub(crate) fn convert_image(
    reg: &Arc<Registry>,
    handle: &Handle,
    repo: &str,
    image: &Digest,
) -> anyhow::Result<ImageConverted> {
    let repo = RepoName::parse(repo)?;
    let bytes = handle.block_on(reg.store.read_all(&ObjectKey::blob(image)))?;
    let v: Value = serde_json::from_slice(&bytes)?;
    let mut layers = Vec::new();
    for l in v["layers"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
    {
        let d: Digest = l["digest"].as_str().unwrap_or_default().parse()?;
        // Another replica may have stored the layer: the store answers for its index.
        let size = match reg.index.blob_size(&d)? {
            Some(size) => Some(size),
            None => handle.block_on(crate::recipe::stored_size(
                reg.store.as_ref(),
                &ObjectKey::blob(&d),
            ))?,
        }
        .ok_or_else(|| {
            anyhow::anyhow!(
                "layer {d} is not stored (non-distributable layers cannot be converted)"
            )
        })?;
        let uncompressed = matches!(
            l["mediaType"].as_str(),
            Some(amber_oci::media::OCI_LAYER_TAR | amber_oci::media::DOCKER_LAYER_TAR)
        );
        layers.push(Layer {
            digest: d,
            size,
            uncompressed,
        });
    }
    let keys = chain_keys(
        &layers
            .iter()
            .map(|l| l.digest.to_string())
            .collect::<Vec<_>>(),
    );
    let reused = match keys.last() {
        Some(key) => converted_chain(reg, handle, key)?,
        None => None,
    };
    let (env, envelope, made) = match reused {
        Some((env, envelope)) => {
            metrics::counter!(CONVERT_LAYERS_REUSED).increment(layers.len() as u64);
            tracing::info!(%image, %env, "every layer converted before: env reused");
            (env, envelope, None)
        }
        None => {
            let (envelope, made) = convert_and_keep(reg, handle, image, &layers, &keys)?;
            (made.env_digest.to_string(), envelope, Some(made))
        }
    };
    publish_referrer(
        reg,
        handle,
        &repo,
        image,
        bytes.len() as u64,
        &v,
        &envelope,
        &env,
    )?;
    Ok(ImageConverted {
        env,
        envelope: made,
    })
}

/// Converts the image from the longest kept chain of its layers (or all of them), stores
/// its envelope, then the chain states it kept and the memo of its whole chain; returns
/// the envelope's stored bytes and the envelope (whose `env_digest` names the env).
fn convert_and_keep(
    reg: &Arc<Registry>,
    handle: &Handle,
    image: &Digest,
    layers: &[Layer],
    keys: &[ChainKey],
) -> anyhow::Result<(Bytes, ManifestEnvelope)> {
    let mut start = match keys.len() {
        0 => None,
        n => longest_kept_chain(reg, handle, &keys[..n - 1])?,
    };
    // A longer chain of this image's lower layers than the kept one is being converted
    // by another conversion of this process, which keeps its state: wait for it.
    if let Some(below) = keys.len().checked_sub(1) {
        let have = start.as_ref().map_or(0, |s| s.layers as usize);
        if let Some(k) = reg
            .chains_in_flight
            .longest_listed(&keys[..below])
            .filter(|&k| k >= have)
        {
            if reg
                .chains_in_flight
                .wait(&keys[k], &reg.stopping, CHAIN_WAIT)
            {
                start = longest_kept_chain(reg, handle, &keys[..below])?;
            }
        }
    }
    let ((out, new_bytes, listed), read) = match start {
        Some(state) => {
            let reused = state.layers as usize;
            match convert_layers(reg, handle, layers, keys, Some(state)) {
                Ok(out) => {
                    metrics::counter!(CONVERT_LAYERS_REUSED).increment(reused as u64);
                    (out, &layers[reused..])
                }
                // The image's own layers are refused (hostile entry, limits): converting
                // every layer would only fail again, later.
                Err(e)
                    if matches!(
                        e.downcast_ref(),
                        Some(amber_converter::ConvertError::Tree(_))
                    ) =>
                {
                    return Err(e)
                }
                // Cut short by the shutdown: converting every layer would be cut short
                // too, after a warning that misleads.
                Err(e) if reg.stopping.is_cancelled() => return Err(e),
                Err(e) => {
                    // A kept state is derived data: if it cannot be used (a chunk it
                    // names unreadable, say), convert every layer instead.
                    tracing::warn!(%image, error = %format!("{e:#}"), "conversion from a kept layer chain failed; converting every layer");
                    (convert_layers(reg, handle, layers, keys, None)?, layers)
                }
            }
        }
        None => (convert_layers(reg, handle, layers, keys, None)?, layers),
    };
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
    reg.store
        .put_blocking(handle, &ObjectKey::env(&env), envelope_bytes.clone())?;
    // Kept for later images, now that every chunk they name is stored.
    for state in &out.chains {
        let key = &keys[state.layers as usize - 1];
        let encoded = state.encode();
        let whole = state.layers as usize == keys.len();
        if whole && encoded.len() as u64 * WHOLE_CHAIN_STATE_SHARE > new_bytes {
            continue;
        }
        reg.store
            .put_blocking(handle, &ObjectKey::chain(key), Bytes::from(encoded))?;
    }
    drop(listed);
    if let Some(key) = keys.last() {
        let memo = serde_json::to_vec(&ChainEnv {
            env: env.to_string(),
        })?;
        reg.store
            .put_blocking(handle, &ObjectKey::chain_env(key), Bytes::from(memo))?;
    }
    // The uncompressed layers this conversion read are now mostly chunks.
    let mut recipes = read
        .iter()
        .filter(|l| l.uncompressed && l.size >= crate::recipe::MIN_BLOB)
        .peekable();
    if recipes.peek().is_some() {
        let packed = crate::recipe::PackedFiles::new(&out.packed);
        for layer in recipes {
            keep_as_recipe(reg, handle, layer, &packed);
        }
    }
    Ok((envelope_bytes, envelope))
}

/// Replaces an uncompressed layer blob (at least `recipe::MIN_BLOB` bytes) by its recipe when chunks hold most of it
/// (`crate::recipe`). Never fails the conversion: a layer that cannot be kept as a
/// recipe stays as it is.
fn keep_as_recipe(
    reg: &Arc<Registry>,
    handle: &Handle,
    layer: &Layer,
    packed: &crate::recipe::PackedFiles,
) {
    let d = &layer.digest;
    let started = std::time::Instant::now();
    let made = (|| -> anyhow::Result<Option<u64>> {
        let blob = ObjectKey::blob(d);
        if reg.store.stat_blocking(handle, &blob)?.is_none() {
            return Ok(None); // a recipe already, or another replica's doing
        }
        let reader = object_reader(reg, handle, blob.clone(), layer.size)?;
        let mut has_chunk = |id: &ChunkId| -> io::Result<bool> {
            Ok(indexed(reg, id)? || matches!(found_chunk(reg, handle, id)?, Found::Whole { .. }))
        };
        let Some(planned) = crate::recipe::plan(d, reader, packed, &mut has_chunk)? else {
            return Ok(None);
        };
        handle.block_on(crate::recipe::verify(reg.store.clone(), &planned))?;
        let stored = planned.object.len() as u64;
        reg.store
            .put_blocking(handle, &ObjectKey::recipe(d), planned.object)?;
        handle.block_on(reg.store.remove(&blob))?;
        Ok(Some(stored))
    })();
    match made {
        Ok(Some(stored)) => {
            metrics::counter!(crate::recipe::RECIPES_MADE).increment(1);
            metrics::counter!(crate::recipe::RECIPE_BLOB_BYTES).increment(layer.size);
            tracing::info!(layer = %d, blob_bytes = layer.size, recipe_bytes = stored, secs = started.elapsed().as_secs_f64(), "layer kept as a recipe over chunks");
        }
        Ok(None) => {}
        Err(e) => {
            tracing::warn!(layer = %d, error = %format!("{e:#}"), "layer kept as it is: no recipe")
        }
    }
}

/// Runs the converter over the layers above `start` (all of them without one), keeping
/// the states of the chains above it that no conversion kept yet; every chunk is stored
/// when this returns. Also returns the compressed bytes of the chunks it wrote, and the
/// listing of the chains below the whole image whose states it returns
/// (`chain_flight`), to hold until they are stored.
fn convert_layers(
    reg: &Arc<Registry>,
    handle: &Handle,
    layers: &[Layer],
    keys: &[ChainKey],
    start: Option<ChainState>,
) -> anyhow::Result<(amber_converter::Converted, u64, Listed)> {
    let first = start.as_ref().map_or(0, |s| s.layers as usize);
    metrics::counter!(CONVERT_LAYERS_READ).increment((layers.len() - first) as u64);
    tracing::debug!(
        layers = ?layers[first..].iter().map(|l| l.digest.to_string()).collect::<Vec<_>>(),
        reused = first,
        "reading layers"
    );
    let mut inputs = Vec::new();
    for l in &layers[first..] {
        inputs.push(LayerInput {
            name: l.digest.to_string(),
            reader: Box::new(object_reader(
                reg,
                handle,
                ObjectKey::blob(&l.digest),
                l.size,
            )?),
        });
    }
    // Every chain strictly inside the image and above `start` lacks a state (the search
    // for `start` went from the top down); one is kept for a chain another image had
    // (a shared base), and a chain seen for the first time is only marked. The whole
    // image's chain gets no marker: its `.env` memo, written when the conversion ends,
    // marks it (an image built FROM this one has it), so an image costs one file here.
    // Its state is computed, and stored only if it is cheap beside what the conversion
    // stored (`WHOLE_CHAIN_STATE_SHARE`).
    let mut keep = Vec::new();
    let mut unseen = Vec::new();
    for (k, key) in keys.iter().enumerate().skip(first) {
        let whole = k + 1 == keys.len();
        if whole {
            keep.push(k as u32 + 1);
            continue;
        }
        let marker = ObjectKey::chain_seen(key);
        let seen = reg.store.stat_blocking(handle, &marker)?.is_some()
            || reg
                .store
                .stat_blocking(handle, &ObjectKey::chain_env(key))?
                .is_some();
        if seen {
            if keep.len() < MAX_KEPT_CHAINS {
                keep.push(k as u32 + 1);
            }
        } else {
            reg.store.put_blocking(handle, &marker, Bytes::new())?;
            unseen.push(k as u32 + 1);
        }
    }
    // Listed: the chains below the whole image whose states this conversion keeps, or
    // may keep (`keep_also`, for a chain seen here first): another conversion over them
    // waits for this one rather than read the same layers beside it.
    let listed = reg.chains_in_flight.list(
        keep.iter()
            .chain(&unseen)
            .filter(|&&n| (n as usize) < keys.len())
            .map(|&n| keys[n as usize - 1]),
    );
    let scratch_dir = reg.config.data.join("tmp");
    std::fs::create_dir_all(&scratch_dir)?;
    let mut scratch = tempfile::tempfile_in(&scratch_dir)?;
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let (sink_reg, sink_handle) = (reg.clone(), handle.clone());
    let written = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let (sink_written, written_so_far) = (written.clone(), written.clone());
    let notes = Arc::new(Mutex::new(Vec::new()));
    let sink_notes = notes.clone();
    let known_reg = reg.clone();
    let mut sink = ParallelSink::new(
        threads,
        Arc::new(move |id, data: &[u8]| {
            let n = store_chunk(&sink_reg, &sink_handle, id, data, &sink_notes)?;
            sink_written.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
            Ok(())
        }),
    )
    // The index's answer only: a chunk it does not know goes to a worker, which asks
    // the store (a HEAD on S3) beside the chunker.
    .with_known(Box::new(move |id| {
        let have = indexed(&known_reg, id)?;
        if have {
            metrics::counter!(CHUNKS_EXISTING).increment(1);
        }
        Ok(have)
    }));
    let limits = amber_converter::tree::Limits {
        max_entries: reg.config.max_image_entries,
        deadline: Some(
            std::time::Instant::now() + std::time::Duration::from_secs(reg.config.max_convert_secs),
        ),
    };
    let mut source = StoreChunks {
        reg: reg.clone(),
        handle: handle.clone(),
    };
    let converted = amber_converter::convert_reusing(
        inputs,
        &mut scratch,
        &mut sink,
        None,
        &mut |_| {},
        limits,
        Reuse {
            start,
            keep,
            source: Some(&mut source),
            // A chain seen for the first time is kept too when its top layer is big
            // beside the state: the next image on it would read that layer again.
            keep_also: Some(Box::new(move |len, layer_bytes, inodes| {
                unseen.contains(&len)
                    && layer_bytes >= FIRST_SIGHT_LAYER_SHARE * inodes * STATE_BYTES_PER_INODE
            })),
            keep_whole: Some(Box::new(move |inodes| {
                // Stored only if it costs at most 1/WHOLE_CHAIN_STATE_SHARE of the chunk
                // bytes written (`convert_and_keep`): a state below its size floor that
                // misses that already is not computed.
                inodes * MIN_STATE_BYTES_PER_INODE * WHOLE_CHAIN_STATE_SHARE
                    <= written_so_far.load(std::sync::atomic::Ordering::Relaxed)
            })),
        },
    )
    .map_err(anyhow::Error::from)
    .and_then(|out| {
        sink.finish()?;
        Ok(out)
    });
    // Every worker has stopped (finished, or joined when dropped on an error).
    let notes = std::mem::take(&mut *notes.lock().unwrap_or_else(|p| p.into_inner()));
    record_chunks(reg, handle, notes, converted.is_ok())?;
    let out = converted?;
    Ok((
        out,
        written.load(std::sync::atomic::Ordering::Relaxed),
        listed,
    ))
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
        reg.store.put_blocking(handle, &ObjectKey::blob(&d), data)?;
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
    reg.store
        .put_blocking(handle, &ObjectKey::blob(&digest), bytes.clone())?;
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
