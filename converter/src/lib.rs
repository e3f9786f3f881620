//! amber's block-image format and the converter from OCI images to block images.
//!
//! Pure and deterministic: no network, no clock, no host paths. The caller supplies the
//! layer streams, a scratch file for file data, and a `ChunkSink` for the chunks; the
//! result is a `BlockManifest` whose `env_digest` names the device.
//!
//! Modules: `layer` (decompression, diff_ids), `tree` (layers -> merged tree),
//! `erofs` (tree -> EROFS layout), `chunk` (device -> chunks), `manifest` (ids, the
//! block manifest, the env digest), `chain` (a layer chain's state, kept so a later
//! image with the same lower layers reads only its own), `oci` (reading OCI layouts and
//! docker archives).

pub mod chain;
pub mod chunk;
pub mod erofs;
pub mod layer;
pub mod manifest;
pub mod oci;
pub mod tree;

use std::collections::HashMap;
use std::io::{self, BufWriter, Read, Seek, SeekFrom, Write};

use chain::ChainState;
use chunk::{ChunkSink, ChunkSource, Chunker, DataLocation, FileData, RawSink};
use manifest::{BlockManifest, FORMAT_VERSION};
use tree::DataSource;

/// One layer to apply, in order.
pub struct LayerInput<'a> {
    /// How errors name the layer (its digest, or its path in an archive).
    pub name: String,
    /// The layer blob as stored: gzip, zstd or uncompressed tar (detected from the bytes).
    pub reader: Box<dyn Read + 'a>,
}

#[derive(Debug, thiserror::Error)]
pub enum ConvertError {
    #[error(transparent)]
    Tree(#[from] tree::TreeError),
    #[error(transparent)]
    Erofs(#[from] erofs::ErofsError),
    #[error("layer {layer}: {source}")]
    Layer {
        layer: String,
        #[source]
        source: io::Error,
    },
    #[error("{what}: {source}")]
    Io {
        what: &'static str,
        #[source]
        source: io::Error,
    },
}

fn io_err(what: &'static str) -> impl Fn(io::Error) -> ConvertError {
    move |source| ConvertError::Io { what, source }
}

/// What a conversion produced.
#[derive(Debug)]
pub struct Converted {
    pub manifest: BlockManifest,
    pub diff_ids: Vec<String>,
    /// Uncompressed layer bytes read.
    pub layer_bytes: u64,
    pub inodes: u64,
    pub chunks: u64,
    /// The states `Reuse::keep` asked for, in chain order.
    pub chains: Vec<ChainState>,
    /// Where each small file of the device sits in its pack (what a layer's bytes can
    /// be rebuilt from: a registry keeps an uncompressed layer as references to these).
    pub packed: Vec<PackedFile>,
}

/// A small file (below `chunk::LARGE_FILE`) as the device lays it out: `len` bytes at
/// `offset` of pack chunk `chunk` (`None`: the pack was all zeros, a hole).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PackedFile {
    /// blake3 of the file's bytes.
    pub hash: [u8; 32],
    pub len: u64,
    pub chunk: Option<manifest::ChunkId>,
    pub offset: u32,
}

/// Converts `layers` (applied in order) into a block device.
pub fn convert<'a, 's, S: Read + Write + Seek>(
    layers: impl IntoIterator<Item = LayerInput<'a>>,
    scratch: &mut S,
    sink: &'s mut dyn ChunkSink,
    raw: Option<&'s mut dyn RawSink>,
    progress: &mut dyn FnMut(&str),
) -> Result<Converted, ConvertError> {
    convert_with_limits(
        layers,
        scratch,
        sink,
        raw,
        progress,
        tree::Limits::default(),
    )
}

/// `convert` within `limits` (entry count, deadline): past them it stops with
/// `TreeError::Limit`.
pub fn convert_with_limits<'a, 's, S: Read + Write + Seek>(
    layers: impl IntoIterator<Item = LayerInput<'a>>,
    scratch: &mut S,
    sink: &'s mut dyn ChunkSink,
    raw: Option<&'s mut dyn RawSink>,
    progress: &mut dyn FnMut(&str),
    limits: tree::Limits,
) -> Result<Converted, ConvertError> {
    convert_reusing(
        layers,
        scratch,
        sink,
        raw,
        progress,
        limits,
        Reuse::default(),
    )
}

/// Work a conversion reuses and keeps for others (`chain`).
#[derive(Default)]
pub struct Reuse<'s> {
    /// The state of the image's first `start.layers` layers: those layers are not
    /// passed to `convert_reusing`, only the ones above them.
    pub start: Option<ChainState>,
    /// Chain lengths (above `start`'s, at most the image's layer count) whose states to
    /// return in `Converted::chains`.
    pub keep: Vec<u32>,
    /// Reads back the bytes of files from `start` when a pack mixes them with new files
    /// (required with `start`).
    pub source: Option<&'s mut dyn ChunkSource>,
    /// When `keep` names the whole image's chain: asked once every chunk of the device
    /// is handed to the sink, with the image's inode count, whether to compute that
    /// state after all (a caller that keeps it only when it is small beside what the
    /// conversion stored says no before paying for it). Without it, it is computed.
    pub keep_whole: Option<Box<dyn FnOnce(u64) -> bool + 's>>,
    /// Asked at each layer boundary below the whole image that `keep` does not name,
    /// with the chain's length, the uncompressed bytes of its top layer and the tree's
    /// inode count: whether to keep that state too (a caller may keep a chain no image
    /// had before when reading its top layer again would cost far more than storing it).
    pub keep_also: Option<Box<KeepAlso<'s>>>,
}

/// `Reuse::keep_also`: (chain length, top layer's uncompressed bytes, inodes) -> keep.
pub type KeepAlso<'s> = dyn FnMut(u32, u64, u64) -> bool + 's;

/// `convert_with_limits` from a reused chain state, keeping the states `reuse.keep`
/// asks for. The env digest is the same as a conversion of every layer gives.
pub fn convert_reusing<'a, 's, S: Read + Write + Seek>(
    layers: impl IntoIterator<Item = LayerInput<'a>>,
    scratch: &mut S,
    sink: &'s mut dyn ChunkSink,
    raw: Option<&'s mut dyn RawSink>,
    progress: &mut dyn FnMut(&str),
    limits: tree::Limits,
    reuse: Reuse<'s>,
) -> Result<Converted, ConvertError> {
    let Reuse {
        start,
        keep,
        mut source,
        keep_whole,
        mut keep_also,
    } = reuse;
    let layers: Vec<LayerInput<'a>> = layers.into_iter().collect();
    let (mut t, mut stored, mut diff_ids, mut layer_bytes, first) = match start {
        Some(s) => (
            tree::Tree {
                inodes: s.inodes,
                limits,
            },
            s.data,
            s.diff_ids,
            s.layer_bytes,
            s.layers,
        ),
        None => {
            let mut t = tree::Tree::new();
            t.limits = limits;
            (t, Vec::new(), Vec::new(), 0, 0)
        }
    };
    // (chain length, tree, diff ids, layer bytes) at each layer boundary to keep below
    // the whole image's (whose tree is `t` itself, taken once the device is chunked).
    let mut kept = Vec::new();
    let whole = first + layers.len() as u32;
    let whole_wanted = whole > first && keep.contains(&whole);
    let mut scratch_len = scratch
        .seek(SeekFrom::End(0))
        .map_err(io_err("scratch file"))?;
    {
        let mut w = BufWriter::with_capacity(1 << 20, &mut *scratch);
        // Large files go straight to the sink, except with a raw sink, which needs
        // every byte at its device offset when the device is laid out.
        let mut streamed = raw.is_none().then(|| StreamedFiles {
            sink: &mut *sink,
            table: &mut stored,
            buf: Vec::new(),
        });
        for (i, l) in layers.into_iter().enumerate() {
            let index = first + i as u32;
            progress(&format!("layer {}: {}", index + 1, l.name));
            let mut r =
                layer::LayerReader::new(l.reader).map_err(|source| ConvertError::Layer {
                    layer: l.name.clone(),
                    source,
                })?;
            t.apply_layer(
                index,
                &l.name,
                &mut r,
                &mut w,
                &mut scratch_len,
                streamed.as_mut().map(|s| s as &mut dyn tree::LargeFiles),
            )?;
            let (diff_id, n) = r.finish().map_err(|source| ConvertError::Layer {
                layer: l.name.clone(),
                source,
            })?;
            diff_ids.push(diff_id);
            layer_bytes += n;
            let wanted = index + 1 < whole
                && (keep.contains(&(index + 1))
                    || keep_also
                        .as_mut()
                        .is_some_and(|also| also(index + 1, n, t.inodes.len() as u64)));
            if wanted {
                kept.push((index + 1, t.inodes.clone(), diff_ids.clone(), layer_bytes));
            }
        }
        w.flush().map_err(io_err("scratch file"))?;
    }
    progress("laying out the file system");
    let uuid_src = blake3::hash(format!("amber erofs uuid v1\n{}", diff_ids.join("\n")).as_bytes());
    let uuid: [u8; 16] = uuid_src.as_bytes()[..16].try_into().expect("16 bytes");
    let image = erofs::build(&t, uuid)?;
    let mut whole_tree = whole_wanted.then_some(t);
    progress("chunking");
    let mut chunker = Chunker::new(&mut *sink, raw.map(|r| r as &mut dyn RawSink));
    if let Some(src) = source.as_deref_mut() {
        chunker = chunker.with_source(src as &mut dyn ChunkSource);
    }
    // Device order: each metadata segment after the files laid out before it.
    let mut segments = image.meta.iter().peekable();
    for f in &image.files {
        while let Some(m) = segments.next_if(|m| m.block < f.block) {
            chunker
                .metadata(m.block * erofs::BLOCK_SIZE, &m.bytes)
                .map_err(io_err("storing metadata chunks"))?;
        }
        let data = &f.data;
        let at = f.block * erofs::BLOCK_SIZE;
        match data.source {
            DataSource::Scratch { offset } => {
                scratch
                    .seek(SeekFrom::Start(offset))
                    .map_err(io_err("scratch file"))?;
                let mut r = (&mut *scratch).take(data.len);
                chunker.file(
                    at,
                    data.len,
                    &data.hash,
                    FileData::Read(&mut r),
                    erofs::BLOCK_SIZE,
                )
            }
            DataSource::Stored(i) => chunker.file(
                at,
                data.len,
                &data.hash,
                FileData::Stored(stored_location(&stored, i)?),
                erofs::BLOCK_SIZE,
            ),
        }
        .map_err(io_err("storing file chunks"))?;
    }
    for m in segments {
        chunker
            .metadata(m.block * erofs::BLOCK_SIZE, &m.bytes)
            .map_err(io_err("storing metadata chunks"))?;
    }
    let chunked = chunker.finish().map_err(io_err("storing file chunks"))?;
    if let Some(t) = whole_tree.take() {
        if keep_whole.is_none_or(|wanted| wanted(image.inodes)) {
            kept.push((whole, t.inodes, diff_ids.clone(), layer_bytes));
        }
    }
    let manifest = BlockManifest {
        version: FORMAT_VERSION,
        device_size: image.device_size,
        block_size: erofs::BLOCK_SIZE as u32,
        filesystem: "erofs".into(),
        extents: chunked.extents,
    };
    debug_assert!(manifest.validate().is_ok());
    let packed = image
        .files
        .iter()
        .zip(&chunked.locations)
        .filter_map(|(f, loc)| match loc {
            DataLocation::Packed { chunk, offset, .. } if f.data.len > 0 => Some(PackedFile {
                hash: f.data.hash,
                len: f.data.len,
                chunk: *chunk,
                offset: *offset,
            }),
            _ => None,
        })
        .collect();
    let placed: HashMap<tree::InodeId, DataLocation> = image
        .files
        .iter()
        .map(|f| f.inode)
        .zip(chunked.locations)
        .collect();
    let mut chains = Vec::with_capacity(kept.len());
    for (layers, inodes, diff_ids, layer_bytes) in kept {
        progress(&format!("keeping the state of layers 1-{layers}"));
        chains.push(chain_state(
            layers,
            inodes,
            diff_ids,
            layer_bytes,
            &stored,
            &placed,
            scratch,
            &mut *sink,
            source.as_deref_mut().map(|s| s as &mut dyn ChunkSource),
        )?);
    }
    Ok(Converted {
        manifest,
        diff_ids,
        layer_bytes,
        inodes: image.inodes,
        chunks: chunked.chunks,
        chains,
        packed,
    })
}

/// Large files stored as chunks while their layer streams (`tree::LargeFiles`), named
/// by entries appended to the conversion's table of stored files.
struct StreamedFiles<'a> {
    sink: &'a mut dyn ChunkSink,
    table: &'a mut Vec<DataLocation>,
    buf: Vec<u8>,
}

impl tree::LargeFiles for StreamedFiles<'_> {
    fn take(&mut self, len: u64, data: &mut dyn Read) -> io::Result<u32> {
        let n = u32::try_from(self.table.len())
            .map_err(|_| io::Error::other("more than 2^32 stored files"))?;
        let location =
            chunk::store_large_file(self.sink, data, len, erofs::BLOCK_SIZE, &mut self.buf)?;
        self.table.push(location);
        Ok(n)
    }
}

fn stored_location(stored: &[DataLocation], i: u32) -> Result<&DataLocation, ConvertError> {
    stored.get(i as usize).ok_or_else(|| ConvertError::Io {
        what: "reused layer chain state",
        source: io::Error::new(
            io::ErrorKind::InvalidData,
            format!("file data {i} is not in the state's table"),
        ),
    })
}

/// The `ChainState` of a tree kept at a layer boundary: every file it can reach gets
/// its location, from the final layout, from the reused state, or (for a file a later
/// layer hid) by chunking it now, apart from the device.
#[allow(clippy::too_many_arguments)]
fn chain_state<S: Read + Seek>(
    layers: u32,
    mut inodes: Vec<tree::Inode>,
    diff_ids: Vec<String>,
    layer_bytes: u64,
    stored: &[DataLocation],
    placed: &HashMap<tree::InodeId, DataLocation>,
    scratch: &mut S,
    sink: &mut dyn ChunkSink,
    source: Option<&mut dyn ChunkSource>,
) -> Result<ChainState, ConvertError> {
    let walk = tree::Tree {
        inodes: std::mem::take(&mut inodes),
        limits: tree::Limits::default(),
    };
    let order = walk.walk().order;
    inodes = walk.inodes;
    let mut reachable = vec![false; inodes.len()];
    for &id in &order {
        reachable[id] = true;
    }
    let mut data = Vec::new();
    // Hidden files: chunked by a chunker of their own, at made-up offsets (only their
    // chunks and locations matter).
    let mut hidden = Chunker::new(sink, None);
    if let Some(src) = source {
        hidden = hidden.with_source(src);
    }
    let mut hidden_at = 0u64;
    let mut hidden_slots = Vec::new();
    for (id, inode) in inodes.iter_mut().enumerate() {
        let tree::Kind::File { data: d } = &mut inode.kind else {
            continue;
        };
        if !reachable[id] {
            d.source = DataSource::Stored(u32::MAX);
            continue;
        }
        let loc = match d.source {
            DataSource::Stored(i) => stored_location(stored, i)?.clone(),
            DataSource::Scratch { .. } if d.len == 0 => DataLocation::Large { pieces: vec![] },
            DataSource::Scratch { offset } => match placed.get(&id) {
                Some(loc) => loc.clone(),
                None => {
                    scratch
                        .seek(SeekFrom::Start(offset))
                        .map_err(io_err("scratch file"))?;
                    let mut r = (&mut *scratch).take(d.len);
                    hidden
                        .file(
                            hidden_at,
                            d.len,
                            &d.hash,
                            FileData::Read(&mut r),
                            erofs::BLOCK_SIZE,
                        )
                        .map_err(io_err("storing chunks of hidden files"))?;
                    hidden_at += d.len.div_ceil(erofs::BLOCK_SIZE) * erofs::BLOCK_SIZE;
                    hidden_slots.push(data.len());
                    DataLocation::Large { pieces: vec![] } // replaced below
                }
            },
        };
        d.source = DataSource::Stored(data.len() as u32);
        data.push(loc);
    }
    let hidden = hidden
        .finish()
        .map_err(io_err("storing chunks of hidden files"))?;
    for (slot, loc) in hidden_slots.into_iter().zip(hidden.locations) {
        data[slot] = loc;
    }
    Ok(ChainState {
        format: chain::CHAIN_FORMAT,
        layers,
        diff_ids,
        layer_bytes,
        inodes,
        data,
    })
}
