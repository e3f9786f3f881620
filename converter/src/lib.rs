//! amber's block-image format and the converter from OCI images to block images.
//!
//! Pure and deterministic: no network, no clock, no host paths. The caller supplies the
//! layer streams, a scratch file for file data, and a `ChunkSink` for the chunks; the
//! result is a `BlockManifest` whose `env_digest` names the device.
//!
//! Modules: `layer` (decompression, diff_ids), `tree` (layers -> merged tree),
//! `erofs` (tree -> EROFS layout), `chunk` (device -> chunks), `manifest` (ids, the
//! block manifest, the env digest), `oci` (reading OCI layouts and docker archives).

pub mod chunk;
pub mod erofs;
pub mod layer;
pub mod manifest;
pub mod oci;
pub mod tree;

use std::io::{self, BufWriter, Read, Seek, SeekFrom, Write};

use chunk::{ChunkSink, Chunker, RawSink};
use manifest::{BlockManifest, FORMAT_VERSION};

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
    let mut t = tree::Tree::new();
    t.limits = limits;
    let mut diff_ids = Vec::new();
    let mut layer_bytes = 0;
    let mut scratch_len = scratch
        .seek(SeekFrom::End(0))
        .map_err(io_err("scratch file"))?;
    {
        let mut w = BufWriter::with_capacity(1 << 20, &mut *scratch);
        for (i, l) in layers.into_iter().enumerate() {
            progress(&format!("layer {}: {}", i + 1, l.name));
            let mut r =
                layer::LayerReader::new(l.reader).map_err(|source| ConvertError::Layer {
                    layer: l.name.clone(),
                    source,
                })?;
            t.apply_layer(i as u32, &l.name, &mut r, &mut w, &mut scratch_len)?;
            let (diff_id, n) = r.finish().map_err(|source| ConvertError::Layer {
                layer: l.name.clone(),
                source,
            })?;
            diff_ids.push(diff_id);
            layer_bytes += n;
        }
        w.flush().map_err(io_err("scratch file"))?;
    }
    progress("laying out the file system");
    let uuid_src = blake3::hash(format!("amber erofs uuid v1\n{}", diff_ids.join("\n")).as_bytes());
    let uuid: [u8; 16] = uuid_src.as_bytes()[..16].try_into().expect("16 bytes");
    let image = erofs::build(&t, uuid)?;
    drop(t);
    progress("chunking");
    let mut chunker = Chunker::new(sink, raw);
    chunker
        .metadata(0, &image.meta)
        .map_err(io_err("storing metadata chunks"))?;
    for f in &image.files {
        scratch
            .seek(SeekFrom::Start(f.data.offset))
            .map_err(io_err("scratch file"))?;
        let mut data = (&mut *scratch).take(f.data.len);
        chunker
            .file(
                f.block * erofs::BLOCK_SIZE,
                f.data.len,
                &f.data.hash,
                &mut data,
                erofs::BLOCK_SIZE,
            )
            .map_err(io_err("storing file chunks"))?;
    }
    let (extents, chunks) = chunker.finish().map_err(io_err("storing file chunks"))?;
    let manifest = BlockManifest {
        version: FORMAT_VERSION,
        device_size: image.device_size,
        block_size: erofs::BLOCK_SIZE as u32,
        filesystem: "erofs".into(),
        extents,
    };
    debug_assert!(manifest.validate().is_ok());
    Ok(Converted {
        manifest,
        diff_ids,
        layer_bytes,
        inodes: image.inodes,
        chunks,
    })
}
