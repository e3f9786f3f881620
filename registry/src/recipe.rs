//! Layer recipes: an uncompressed layer blob kept as the chunks that already hold its
//! files' bytes, plus the few bytes no chunk holds (tar headers, padding, files the env
//! does not have), instead of as a second copy of those bytes.
//!
//! A snapshot's layer is an uncompressed tar of what the sandbox wrote, and converting it
//! stores every one of those bytes again as chunks: keeping the blob too doubled what a
//! snapshot costs. Once an image converts, each of its uncompressed tar layers that the
//! conversion read is scanned once: a regular file's bytes become references to the
//! chunk (and offset) that holds them (a small file: its place in its pack, from the
//! converter; a large file: its 1 MiB pieces, whose chunk ids follow from the bytes
//! alone), all-zero runs become zeros, and everything else is kept as literal bytes in
//! zstd frames. gzip or zstd layers are never rebuilt: their bytes depend on the
//! compressor, so only the blob itself can give them back.
//!
//! Invariants:
//! - a recipe is published only after rebuilding the blob from it (every chunk read
//!   back and checked against its id) gave exactly the blob's digest and size; the blob
//!   object is removed only after its recipe is published, so the blob's bytes are
//!   readable at every instant (`read_object` falls back to the recipe);
//! - reading through a recipe checks every chunk against its id and every literal frame
//!   against its length, and the recipe object carries a blake3 checksum of its index: a
//!   damaged recipe or chunk is an error, never wrong bytes;
//! - nothing here depends on the converter's layout rules beyond what the converter
//!   reports (`PackedFile`) and the large-file piece rule (`chunk::MAX_CHUNK` pieces of
//!   block-padded bytes), and a change to either only makes a new recipe fail its check.
//!
//! Object layout: `MAGIC`, the index's length (u32 LE), blake3 of the index, the index
//! (zstd of postcard), then the literal frames.

use std::cell::RefCell;
use std::collections::HashMap;
use std::io::{self, Read};
use std::ops::Range;
use std::rc::Rc;
use std::sync::Arc;

use amber_converter::chunk::{LARGE_FILE, MAX_CHUNK};
use amber_converter::erofs::BLOCK_SIZE;
use amber_converter::manifest::ChunkId;
use amber_converter::PackedFile;
use amber_oci::digest::Digest;
use bytes::Bytes;
use futures_util::StreamExt;
use serde::{Deserialize, Serialize};

use crate::store::{ByteStream, ObjectKey, ObjectStore, StoreError};

const MAGIC: &[u8; 8] = b"amberrc1";
const HEADER: u64 = 8 + 4 + 32;
/// Literal bytes per zstd frame (a read decompresses whole frames).
const FRAME: usize = 1 << 20;
const LITERAL_ZSTD_LEVEL: i32 = 3;
/// Blobs smaller than this are kept as they are (a recipe saves too little).
pub const MIN_BLOB: u64 = 1 << 20;
/// A recipe is kept only if chunks or zeros give at least this share of the blob.
const MIN_SHARED: f64 = 0.5;
/// Largest compressed literal region (the object is built in memory).
const MAX_LITERAL_STORED: usize = 64 << 20;
/// Largest index accepted when decoding (a 100 GiB layer is about 5 MiB of pieces).
const MAX_INDEX: u64 = 256 << 20;

/// Metrics: recipes published, and the blob bytes they replaced.
pub const RECIPES_MADE: &str = "amber_layer_recipes_total";
pub const RECIPE_BLOB_BYTES: &str = "amber_layer_recipe_blob_bytes_total";

/// One run of the blob's bytes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
enum Piece {
    /// `len` bytes at offset `at` of the literal stream.
    Literal { at: u64, len: u64 },
    /// `len` zero bytes.
    Zeros { len: u64 },
    /// `len` bytes at `offset` of chunk `id` (uncompressed).
    Chunk { id: [u8; 32], offset: u32, len: u32 },
}

impl Piece {
    fn len(&self) -> u64 {
        match self {
            Piece::Literal { len, .. } | Piece::Zeros { len } => *len,
            Piece::Chunk { len, .. } => *len as u64,
        }
    }
}

/// One zstd frame of the literal stream: literal bytes `at..at + len`, stored at
/// `stored` (from the start of the frame region), `stored_len` bytes.
#[derive(Debug, Serialize, Deserialize)]
struct Frame {
    at: u64,
    len: u32,
    stored: u64,
    stored_len: u32,
}

#[derive(Serialize, Deserialize)]
struct Index {
    blob: String,
    size: u64,
    pieces: Vec<Piece>,
    frames: Vec<Frame>,
}

#[derive(Debug, thiserror::Error)]
pub enum RecipeError {
    #[error("recipe of {0} is damaged: {1}")]
    Damaged(String, String),
    #[error("reading the layer: {0}")]
    Layer(#[source] io::Error),
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl RecipeError {
    /// As an error reading the object `key` (a damaged recipe is bad data there).
    fn for_store(self, key: &ObjectKey) -> StoreError {
        match self {
            RecipeError::Store(e) => e,
            e => StoreError::io(
                key.as_str(),
                io::Error::new(io::ErrorKind::InvalidData, e.to_string()),
            ),
        }
    }
}

/// A decoded recipe: how to rebuild blob `blob` of `size` bytes.
pub struct Recipe {
    pub blob: Digest,
    pub size: u64,
    pieces: Vec<Piece>,
    /// Offset in the blob where each piece starts.
    starts: Vec<u64>,
    frames: Vec<Frame>,
    /// Where the frame region starts in the recipe object.
    frames_base: u64,
}

impl Recipe {
    fn new(index: Index, frames_base: u64) -> Result<Recipe, String> {
        let blob: Digest = index.blob.parse().map_err(|e| format!("{e}"))?;
        let mut starts = Vec::with_capacity(index.pieces.len());
        let mut at = 0u64;
        for p in &index.pieces {
            starts.push(at);
            at = at.checked_add(p.len()).ok_or("pieces overflow")?;
        }
        if at != index.size {
            return Err(format!("pieces add up to {at} bytes, not {}", index.size));
        }
        let mut lit = 0u64;
        for f in &index.frames {
            if f.at != lit {
                return Err("literal frames are not contiguous".into());
            }
            lit += f.len as u64;
        }
        for p in &index.pieces {
            if let Piece::Literal { at, len } = p {
                if at + len > lit {
                    return Err("a literal piece lies past the frames".into());
                }
            }
        }
        Ok(Recipe {
            blob,
            size: index.size,
            pieces: index.pieces,
            starts,
            frames: index.frames,
            frames_base,
        })
    }

    /// The index's length and checksum, from the object's first `HEADER` bytes.
    fn decode_header(head: &[u8]) -> Result<(u64, [u8; 32]), String> {
        let rest = head.strip_prefix(MAGIC).ok_or("bad magic")?;
        if rest.len() < 36 {
            return Err("truncated header".into());
        }
        let len = u32::from_le_bytes(rest[..4].try_into().expect("4 bytes")) as u64;
        let sum: [u8; 32] = rest[4..36].try_into().expect("32 bytes");
        Ok((len, sum))
    }

    fn decode_index(packed: &[u8], sum: &[u8; 32], frames_base: u64) -> Result<Recipe, String> {
        if blake3::hash(packed).as_bytes() != sum {
            return Err("index checksum mismatch".into());
        }
        let mut plain = Vec::new();
        zstd::stream::read::Decoder::new(packed)
            .map_err(|e| e.to_string())?
            .take(MAX_INDEX + 1)
            .read_to_end(&mut plain)
            .map_err(|e| e.to_string())?;
        if plain.len() as u64 > MAX_INDEX {
            return Err("index larger than 256 MiB".into());
        }
        let index: Index = postcard::from_bytes(&plain).map_err(|e| e.to_string())?;
        Recipe::new(index, frames_base)
    }

    /// Loads the recipe of `blob`, `None` if it has none.
    pub async fn load(
        store: &dyn ObjectStore,
        blob: &Digest,
    ) -> Result<Option<Recipe>, RecipeError> {
        let key = ObjectKey::recipe(blob);
        let damaged = |why: String| RecipeError::Damaged(blob.to_string(), why);
        // No stat first: the header read answers whether there is a recipe.
        let read = |range: Range<u64>, what: &'static str| {
            let key = &key;
            async move {
                match store.read(key, range).await {
                    Ok(s) => Ok(Some(collect(s).await?)),
                    Err(StoreError::NotFound(_)) => Ok(None),
                    Err(StoreError::BadRange { .. }) => {
                        Err(damaged(format!("{what} runs past the object")))
                    }
                    Err(e) => Err(RecipeError::Store(e)),
                }
            }
        };
        let Some(head) = read(0..HEADER, "the header").await? else {
            return Ok(None);
        };
        let (len, sum) = Recipe::decode_header(&head).map_err(damaged)?;
        let packed = read(HEADER..HEADER + len, "the index")
            .await?
            .ok_or_else(|| damaged("it is gone".into()))?;
        let recipe = Recipe::decode_index(&packed, &sum, HEADER + len).map_err(damaged)?;
        if recipe.blob != *blob {
            return Err(damaged(format!("it rebuilds {}", recipe.blob)));
        }
        Ok(Some(recipe))
    }

    /// Bytes of the blob that chunks or zeros give (the rest is literal).
    pub fn shared_bytes(&self) -> u64 {
        shared_bytes(&self.pieces)
    }
}

fn shared_bytes(pieces: &[Piece]) -> u64 {
    pieces
        .iter()
        .filter(|p| !matches!(p, Piece::Literal { .. }))
        .map(Piece::len)
        .sum()
}

async fn collect(mut s: ByteStream) -> Result<Vec<u8>, StoreError> {
    let mut out = Vec::new();
    while let Some(b) = s.next().await {
        out.extend_from_slice(&b.map_err(|e| StoreError::io("reading a recipe", e))?);
    }
    Ok(out)
}

/// Where a recipe's literal frames are read from.
enum Literals {
    /// The published recipe object.
    Store(ObjectKey),
    /// A recipe object not published yet (checking it before it is).
    Memory(Bytes),
}

/// Streams `range` of a published object; a blob that was replaced by its recipe is
/// rebuilt from it. Every reader of layer blobs goes through here.
pub async fn read_object(
    store: &Arc<dyn ObjectStore>,
    key: &ObjectKey,
    range: Range<u64>,
) -> Result<ByteStream, StoreError> {
    match store.read(key, range.clone()).await {
        Err(StoreError::NotFound(what)) => {
            let Some(blob) = key.blob_digest() else {
                return Err(StoreError::NotFound(what));
            };
            match Recipe::load(store.as_ref(), &blob).await {
                Ok(Some(recipe)) => {
                    if range.start > range.end || range.end > recipe.size {
                        return Err(StoreError::BadRange {
                            key: key.as_str().into(),
                            start: range.start,
                            end: range.end,
                            size: recipe.size,
                        });
                    }
                    let literals = Literals::Store(ObjectKey::recipe(&blob));
                    Ok(rebuild(store.clone(), Arc::new(recipe), literals, range))
                }
                Ok(None) => Err(StoreError::NotFound(what)),
                Err(e) => Err(e.for_store(key)),
            }
        }
        other => other,
    }
}

/// The size of a published object, or of the blob its recipe rebuilds.
pub async fn stored_size(
    store: &dyn ObjectStore,
    key: &ObjectKey,
) -> Result<Option<u64>, StoreError> {
    if let Some(size) = store.stat(key).await? {
        return Ok(Some(size));
    }
    let Some(blob) = key.blob_digest() else {
        return Ok(None);
    };
    match Recipe::load(store, &blob).await {
        Ok(r) => Ok(r.map(|r| r.size)),
        Err(e) => Err(e.for_store(key)),
    }
}

/// Streams `range` of the blob `recipe` rebuilds (a task produces the bytes; memory is
/// one chunk and one literal frame, whatever the range).
fn rebuild(
    store: Arc<dyn ObjectStore>,
    recipe: Arc<Recipe>,
    literals: Literals,
    range: Range<u64>,
) -> ByteStream {
    let (tx, rx) = tokio::sync::mpsc::channel::<io::Result<Bytes>>(4);
    tokio::spawn(async move {
        let mut reader = PieceReader {
            store,
            recipe: recipe.clone(),
            literals,
            chunk: None,
            frame: None,
        };
        let first = recipe.starts.partition_point(|&s| s <= range.start).max(1) - 1;
        for i in first..recipe.pieces.len() {
            let start = recipe.starts[i];
            if start >= range.end {
                break;
            }
            let piece = &recipe.pieces[i];
            let from = range.start.max(start) - start;
            let to = range.end.min(start + piece.len()) - start;
            if from >= to {
                continue;
            }
            let mut at = from;
            while at < to {
                let n = (to - at).min(MAX_CHUNK);
                let bytes = reader.bytes(piece, at..at + n).await;
                let failed = bytes.is_err();
                if tx.send(bytes).await.is_err() || failed {
                    return;
                }
                at += n;
            }
        }
    });
    Box::pin(futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    }))
}

/// What a zeros piece reads as (a read asks for at most `MAX_CHUNK` bytes at once).
static ZEROS: [u8; MAX_CHUNK as usize] = [0; MAX_CHUNK as usize];

/// Reads the bytes of pieces, keeping the last chunk and literal frame it decompressed
/// (neighbouring small files share packs; literal pieces share frames).
struct PieceReader {
    store: Arc<dyn ObjectStore>,
    recipe: Arc<Recipe>,
    literals: Literals,
    chunk: Option<([u8; 32], Bytes)>,
    frame: Option<(usize, Bytes)>,
}

fn damaged(what: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what)
}

impl PieceReader {
    /// Bytes `r` of `piece` (at most `MAX_CHUNK` of them).
    async fn bytes(&mut self, piece: &Piece, r: Range<u64>) -> io::Result<Bytes> {
        match piece {
            Piece::Zeros { .. } => Ok(Bytes::from_static(&ZEROS[..(r.end - r.start) as usize])),
            Piece::Chunk { id, offset, .. } => {
                let data = self.chunk(id).await?;
                let (a, b) = (*offset as u64 + r.start, *offset as u64 + r.end);
                if b > data.len() as u64 {
                    return Err(damaged(format!(
                        "chunk {} has {} bytes; the recipe of {} reads to {b}",
                        ChunkId(*id),
                        data.len(),
                        self.recipe.blob
                    )));
                }
                Ok(data.slice(a as usize..b as usize))
            }
            Piece::Literal { at, .. } => {
                let (mut from, to) = (at + r.start, at + r.end);
                let mut out = Vec::with_capacity((to - from) as usize);
                while from < to {
                    let i = self.recipe.frames.partition_point(|f| f.at <= from) - 1;
                    let frame = self.frame(i).await?;
                    let f_at = self.recipe.frames[i].at;
                    let end = to.min(f_at + frame.len() as u64);
                    out.extend_from_slice(&frame[(from - f_at) as usize..(end - f_at) as usize]);
                    from = end;
                }
                Ok(Bytes::from(out))
            }
        }
    }

    async fn chunk(&mut self, id: &[u8; 32]) -> io::Result<Bytes> {
        if let Some((have, data)) = &self.chunk {
            if have == id {
                return Ok(data.clone());
            }
        }
        let chunk = ChunkId(*id);
        let stored = self
            .store
            .read_all(&ObjectKey::chunk(&chunk))
            .await
            .map_err(|e| io::Error::other(format!("chunk {chunk}: {e}")))?;
        let mut data = Vec::new();
        zstd::stream::read::Decoder::new(&stored[..])?
            .take(MAX_CHUNK + 1)
            .read_to_end(&mut data)?;
        if ChunkId::of(&data) != chunk {
            return Err(damaged(format!(
                "chunk {chunk} does not match its id (rebuilding {})",
                self.recipe.blob
            )));
        }
        let data = Bytes::from(data);
        self.chunk = Some((*id, data.clone()));
        Ok(data)
    }

    async fn frame(&mut self, i: usize) -> io::Result<Bytes> {
        if let Some((have, data)) = &self.frame {
            if *have == i {
                return Ok(data.clone());
            }
        }
        let f = &self.recipe.frames[i];
        let start = self.recipe.frames_base + f.stored;
        let end = start + f.stored_len as u64;
        let stored = match &self.literals {
            Literals::Memory(b) => b
                .get(start as usize..end as usize)
                .map(Bytes::copy_from_slice)
                .ok_or_else(|| damaged("a literal frame lies past the recipe".into()))?,
            Literals::Store(key) => Bytes::from(
                collect(
                    self.store
                        .read(key, start..end)
                        .await
                        .map_err(io::Error::other)?,
                )
                .await
                .map_err(io::Error::other)?,
            ),
        };
        let mut data = Vec::with_capacity(f.len as usize);
        zstd::stream::read::Decoder::new(&stored[..])?
            .take(f.len as u64 + 1)
            .read_to_end(&mut data)?;
        if data.len() != f.len as usize {
            return Err(damaged(format!(
                "literal frame {i} of the recipe of {} has {} bytes, not {}",
                self.recipe.blob,
                data.len(),
                f.len
            )));
        }
        let data = Bytes::from(data);
        self.frame = Some((i, data.clone()));
        Ok(data)
    }
}

/// Where the small files of an env sit, by content: what a layer's files are looked up in.
pub struct PackedFiles(HashMap<([u8; 32], u64), (Option<ChunkId>, u32)>);

impl PackedFiles {
    pub fn new(files: &[PackedFile]) -> PackedFiles {
        PackedFiles(
            files
                .iter()
                .map(|f| ((f.hash, f.len), (f.chunk, f.offset)))
                .collect(),
        )
    }
}

/// Remembers what the tar reader consumed since the last piece was emitted.
struct Pending {
    /// Blob offset of `buf[0]`.
    start: u64,
    buf: Vec<u8>,
}

/// Passes the layer's bytes to the tar reader, keeping a copy in `Pending`.
struct Tee<R> {
    inner: R,
    pending: Rc<RefCell<Pending>>,
}

impl<R: Read> Read for Tee<R> {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(out)?;
        self.pending.borrow_mut().buf.extend_from_slice(&out[..n]);
        Ok(n)
    }
}

/// Collects pieces and the literal stream.
struct Builder {
    pieces: Vec<Piece>,
    frames: Vec<Frame>,
    region: Vec<u8>,
    frame: Vec<u8>,
    literal_len: u64,
    size: u64,
}

impl Builder {
    fn push(&mut self, p: Piece) {
        if p.len() == 0 {
            return;
        }
        self.size += p.len();
        match (self.pieces.last_mut(), &p) {
            (Some(Piece::Literal { len, .. }), Piece::Literal { len: n, .. }) => *len += n,
            (Some(Piece::Zeros { len }), Piece::Zeros { len: n }) => *len += n,
            _ => self.pieces.push(p),
        }
    }

    fn literal(&mut self, mut bytes: &[u8]) -> io::Result<()> {
        self.push(Piece::Literal {
            at: self.literal_len,
            len: bytes.len() as u64,
        });
        self.literal_len += bytes.len() as u64;
        while !bytes.is_empty() {
            let n = bytes.len().min(FRAME - self.frame.len());
            self.frame.extend_from_slice(&bytes[..n]);
            bytes = &bytes[n..];
            if self.frame.len() == FRAME {
                self.cut_frame()?;
            }
        }
        Ok(())
    }

    fn cut_frame(&mut self) -> io::Result<()> {
        if self.frame.is_empty() {
            return Ok(());
        }
        let packed = zstd::bulk::compress(&self.frame, LITERAL_ZSTD_LEVEL)?;
        self.frames.push(Frame {
            at: self.literal_len - self.frame.len() as u64,
            len: self.frame.len() as u32,
            stored: self.region.len() as u64,
            stored_len: packed.len() as u32,
        });
        self.region.extend_from_slice(&packed);
        self.frame.clear();
        if self.region.len() > MAX_LITERAL_STORED {
            return Err(io::Error::other("literal bytes past the recipe limit"));
        }
        Ok(())
    }
}

/// What `plan` made of a layer.
pub struct Planned {
    /// The encoded recipe object.
    pub object: Bytes,
    pub recipe: Arc<Recipe>,
}

/// Scans uncompressed tar layer `blob` (`layer`: its bytes) and plans its recipe over
/// `packed` and the chunks `has_chunk` confirms. `None` when chunks would give less
/// than half the blob (or the layer is not a tar this scan follows): keep the blob.
pub fn plan(
    blob: &Digest,
    layer: impl Read,
    packed: &PackedFiles,
    has_chunk: &mut dyn FnMut(&ChunkId) -> io::Result<bool>,
) -> Result<Option<Planned>, RecipeError> {
    let pending = Rc::new(RefCell::new(Pending {
        start: 0,
        buf: Vec::new(),
    }));
    let mut b = Builder {
        pieces: Vec::new(),
        frames: Vec::new(),
        region: Vec::new(),
        frame: Vec::new(),
        literal_len: 0,
        size: 0,
    };
    let tee = Tee {
        inner: io::BufReader::with_capacity(1 << 20, layer),
        pending: pending.clone(),
    };
    let mut archive = tar::Archive::new(tee);
    // Everything consumed before `at` becomes literal; `pending` then starts at `at`.
    let flush = |b: &mut Builder, at: u64| -> io::Result<bool> {
        let mut p = pending.borrow_mut();
        if p.start + p.buf.len() as u64 != at {
            return Ok(false);
        }
        b.literal(&p.buf)?;
        p.start = at;
        p.buf.clear();
        Ok(true)
    };
    // The bytes just read of a file (the last `n` of `pending`) are accounted for.
    let consumed = |n: u64| {
        let mut p = pending.borrow_mut();
        p.start += n;
        p.buf.clear();
    };
    let mut piece = vec![0u8; MAX_CHUNK as usize];
    let entries = archive.entries().map_err(RecipeError::Layer)?;
    for entry in entries {
        let mut e = entry.map_err(RecipeError::Layer)?;
        let kind = e.header().entry_type();
        let len = e.size();
        if !matches!(kind, tar::EntryType::Regular | tar::EntryType::Continuous) || len == 0 {
            continue;
        }
        if !flush(&mut b, e.raw_file_position()).map_err(RecipeError::Layer)? {
            return Ok(None);
        }
        if len < LARGE_FILE {
            let data = &mut piece[..len as usize];
            e.read_exact(data).map_err(RecipeError::Layer)?;
            consumed(len);
            let hash = *blake3::hash(data).as_bytes();
            match packed.0.get(&(hash, len)) {
                Some((Some(chunk), offset)) => b.push(Piece::Chunk {
                    id: chunk.0,
                    offset: *offset,
                    len: len as u32,
                }),
                Some((None, _)) => b.push(Piece::Zeros { len }),
                None => b.literal(data).map_err(RecipeError::Layer)?,
            }
            continue;
        }
        // A large file: its pieces are the chunks the converter cut, named by content.
        let mut done = 0u64;
        while done < len {
            let real = (len - done).min(MAX_CHUNK) as usize;
            e.read_exact(&mut piece[..real])
                .map_err(RecipeError::Layer)?;
            consumed(real as u64);
            let padded = (real as u64).div_ceil(BLOCK_SIZE) * BLOCK_SIZE;
            piece[real..padded as usize].fill(0);
            let bytes = &piece[..padded as usize];
            if bytes.iter().all(|&x| x == 0) {
                b.push(Piece::Zeros { len: real as u64 });
            } else {
                let id = ChunkId::of(bytes);
                if has_chunk(&id).map_err(RecipeError::Layer)? {
                    b.push(Piece::Chunk {
                        id: id.0,
                        offset: 0,
                        len: real as u32,
                    });
                } else {
                    b.literal(&piece[..real]).map_err(RecipeError::Layer)?;
                }
            }
            done += real as u64;
        }
    }
    // The end-of-archive blocks and anything after them.
    let mut tee = archive.into_inner();
    io::copy(&mut tee, &mut io::sink()).map_err(RecipeError::Layer)?;
    let end = {
        let p = pending.borrow();
        p.start + p.buf.len() as u64
    };
    if !flush(&mut b, end).map_err(RecipeError::Layer)? {
        return Ok(None);
    }
    b.cut_frame().map_err(RecipeError::Layer)?;
    let index = Index {
        blob: blob.to_string(),
        size: b.size,
        pieces: b.pieces,
        frames: b.frames,
    };
    let shared = shared_bytes(&index.pieces);
    if (shared as f64) < MIN_SHARED * index.size as f64 {
        return Ok(None);
    }
    let plain = postcard::to_allocvec(&index).map_err(|e| {
        RecipeError::Damaged(blob.to_string(), format!("index does not encode: {e}"))
    })?;
    let packed_index =
        zstd::bulk::compress(&plain, LITERAL_ZSTD_LEVEL).map_err(RecipeError::Layer)?;
    let mut object = Vec::with_capacity(HEADER as usize + packed_index.len() + b.region.len());
    object.extend_from_slice(MAGIC);
    object.extend_from_slice(&(packed_index.len() as u32).to_le_bytes());
    object.extend_from_slice(blake3::hash(&packed_index).as_bytes());
    object.extend_from_slice(&packed_index);
    object.extend_from_slice(&b.region);
    let frames_base = HEADER + packed_index.len() as u64;
    let recipe = Recipe::new(index, frames_base)
        .map_err(|why| RecipeError::Damaged(blob.to_string(), why))?;
    Ok(Some(Planned {
        object: Bytes::from(object),
        recipe: Arc::new(recipe),
    }))
}

/// Rebuilds the blob from a planned recipe (chunks from `store`, literals from the
/// planned object) and checks it is the blob: its digest and size.
pub async fn verify(store: Arc<dyn ObjectStore>, planned: &Planned) -> Result<(), RecipeError> {
    let literals = Literals::Memory(planned.object.clone());
    rebuilds_its_blob(store, planned.recipe.clone(), literals).await
}

/// Checks the published recipe of `blob` (fsck): it rebuilds exactly the blob.
pub async fn check(store: &Arc<dyn ObjectStore>, blob: &Digest) -> Result<(), RecipeError> {
    let recipe = Recipe::load(store.as_ref(), blob)
        .await?
        .ok_or_else(|| RecipeError::Damaged(blob.to_string(), "it is gone".into()))?;
    let literals = Literals::Store(ObjectKey::recipe(blob));
    rebuilds_its_blob(store.clone(), Arc::new(recipe), literals).await
}

async fn rebuilds_its_blob(
    store: Arc<dyn ObjectStore>,
    recipe: Arc<Recipe>,
    literals: Literals,
) -> Result<(), RecipeError> {
    let mut s = rebuild(store, recipe.clone(), literals, 0..recipe.size);
    let mut hasher = recipe.blob.algorithm().hasher();
    let mut n = 0u64;
    while let Some(b) = s.next().await {
        let b = b.map_err(|e| RecipeError::Damaged(recipe.blob.to_string(), e.to_string()))?;
        n += b.len() as u64;
        hasher.update(&b);
    }
    let actual = hasher.finish();
    if actual != recipe.blob || n != recipe.size {
        return Err(RecipeError::Damaged(
            recipe.blob.to_string(),
            format!("it rebuilds {n} bytes with digest {actual}"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::fs::FsStore;
    use amber_oci::digest::Algorithm;

    /// A tar layer: small files (two with the same bytes), a large file with an all-zero
    /// MiB and an odd tail, an empty file, a directory, a symlink and a long name (a PAX
    /// or GNU header the tar reader folds into the entry).
    fn layer() -> Vec<u8> {
        let mut t = tar::Builder::new(Vec::new());
        let mut add = |path: &str, data: &[u8], kind: tar::EntryType| {
            let mut h = tar::Header::new_gnu();
            h.set_entry_type(kind);
            h.set_size(data.len() as u64);
            h.set_mode(0o644);
            h.set_mtime(1_700_000_000);
            if kind == tar::EntryType::Symlink {
                h.set_link_name("small-0").unwrap();
            }
            t.append_data(&mut h, path, data).unwrap();
        };
        add("etc/", b"", tar::EntryType::Directory);
        for i in 0..20u32 {
            let body: Vec<u8> = (0..3000 + i * 517).map(|j| (j * 7 + i) as u8).collect();
            add(&format!("etc/small-{i}"), &body, tar::EntryType::Regular);
        }
        add(
            "etc/copy",
            &(0..3000u32).map(|j| (j * 7) as u8).collect::<Vec<_>>(),
            tar::EntryType::Regular,
        );
        add("etc/empty", b"", tar::EntryType::Regular);
        add("etc/link", b"", tar::EntryType::Symlink);
        let mut large: Vec<u8> = (0..(3 << 20) + 12_345u32)
            .map(|j| (j % 251) as u8)
            .collect();
        large[1 << 20..2 << 20].fill(0);
        let long = format!("usr/{}/large.bin", "d".repeat(150));
        add(&long, &large, tar::EntryType::Regular);
        t.into_inner().unwrap()
    }

    /// Converts `layer` and stores its chunks in a fresh fs store; the store and where
    /// the env's small files sit.
    async fn converted(layer: &[u8]) -> (tempfile::TempDir, Arc<dyn ObjectStore>, Vec<PackedFile>) {
        struct Keep(HashMap<ChunkId, Vec<u8>>);
        impl amber_converter::chunk::ChunkSink for Keep {
            fn put(&mut self, id: ChunkId, data: &[u8]) -> io::Result<()> {
                self.0.insert(id, data.to_vec());
                Ok(())
            }
        }
        let mut sink = Keep(HashMap::new());
        let mut scratch = tempfile::tempfile().unwrap();
        let out = amber_converter::convert(
            [amber_converter::LayerInput {
                name: "layer".into(),
                reader: Box::new(layer),
            }],
            &mut scratch,
            &mut sink,
            None,
            &mut |_| {},
        )
        .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn ObjectStore> = Arc::new(FsStore::open(dir.path()).unwrap());
        for (id, data) in sink.0 {
            let z = zstd::bulk::compress(&data, 3).unwrap();
            store
                .put(&ObjectKey::chunk(&id), Bytes::from(z))
                .await
                .unwrap();
        }
        (dir, store, out.packed)
    }

    fn has_chunk_in(store: &Arc<dyn ObjectStore>) -> impl FnMut(&ChunkId) -> io::Result<bool> + '_ {
        let handle = tokio::runtime::Handle::current();
        move |id| {
            let stored = handle.block_on(store.stat(&ObjectKey::chunk(id)));
            Ok(stored.map_err(io::Error::other)?.is_some())
        }
    }

    async fn read(store: &Arc<dyn ObjectStore>, key: &ObjectKey, r: Range<u64>) -> Vec<u8> {
        collect(read_object(store, key, r).await.unwrap())
            .await
            .unwrap()
    }

    /// `layer()`, converted into a fresh store, and its planned recipe.
    struct Case {
        layer: Vec<u8>,
        digest: Digest,
        dir: tempfile::TempDir,
        store: Arc<dyn ObjectStore>,
        planned: Planned,
    }

    async fn planned() -> Case {
        let layer = layer();
        let digest = Digest::of(Algorithm::Sha256, &layer);
        let (dir, store, packed) = converted(&layer).await;
        let packed = PackedFiles::new(&packed);
        let planned = tokio::task::block_in_place(|| {
            plan(&digest, &layer[..], &packed, &mut has_chunk_in(&store))
        })
        .unwrap()
        .expect("chunks hold most of the layer");
        Case {
            layer,
            digest,
            dir,
            store,
            planned,
        }
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn a_layer_rebuilt_from_its_recipe_is_the_blob_byte_for_byte() {
        let Case {
            layer,
            digest,
            store,
            planned,
            dir: _dir, // kept: the store lives in it
        } = planned().await;
        // Every file's bytes come from chunks or zeros: only headers, padding and the
        // end of the archive are literal.
        let literal = layer.len() as u64 - planned.recipe.shared_bytes();
        assert!(literal < 40 * 1024, "{literal} literal bytes");
        assert!(
            planned.object.len() < 8 * 1024,
            "{} bytes",
            planned.object.len()
        );
        verify(store.clone(), &planned).await.unwrap();
        store
            .put(&ObjectKey::recipe(&digest), planned.object.clone())
            .await
            .unwrap();
        // No blob object: reads rebuild it, whole and in ranges across piece edges.
        let key = ObjectKey::blob(&digest);
        assert_eq!(store.stat(&key).await.unwrap(), None);
        assert_eq!(
            stored_size(store.as_ref(), &key).await.unwrap(),
            Some(layer.len() as u64)
        );
        assert_eq!(read(&store, &key, 0..layer.len() as u64).await, layer);
        let n = layer.len() as u64;
        for r in [
            0..1,
            511..513,
            1000..70_000,
            (1 << 20)..(2 << 20) + 7,
            n - 1024..n,
        ] {
            assert_eq!(
                read(&store, &key, r.clone()).await,
                &layer[r.start as usize..r.end as usize]
            );
        }
        assert!(matches!(
            read_object(&store, &key, 0..n + 1).await.map(|_| ()),
            Err(StoreError::BadRange { .. })
        ));
        check(&store, &digest).await.unwrap();
        // A blob with neither object nor recipe is simply not found.
        let other = ObjectKey::blob(&Digest::of(Algorithm::Sha256, b"other"));
        assert!(matches!(
            read_object(&store, &other, 0..1).await.map(|_| ()),
            Err(StoreError::NotFound(_))
        ));
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn a_layer_chunks_hold_little_of_is_kept_as_it_is() {
        let layer = layer();
        let (_dir, store, _) = converted(&layer).await;
        // Another layer: the same tar with a 4 MiB file no chunk holds.
        let mut other = tar::Builder::new(Vec::new());
        let mut h = tar::Header::new_gnu();
        h.set_size(4 << 20);
        h.set_mode(0o644);
        let noise: Vec<u8> = (0..4u32 << 20)
            .map(|j| (j.wrapping_mul(2654435761) >> 13) as u8)
            .collect();
        other.append_data(&mut h, "new.bin", &noise[..]).unwrap();
        let other = other.into_inner().unwrap();
        let digest = Digest::of(Algorithm::Sha256, &other);
        let planned = tokio::task::block_in_place(|| {
            plan(
                &digest,
                &other[..],
                &PackedFiles::new(&[]),
                &mut has_chunk_in(&store),
            )
        })
        .unwrap();
        assert!(planned.is_none());
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn a_damaged_chunk_or_recipe_is_an_error_never_wrong_bytes() {
        let Case {
            layer,
            digest,
            dir,
            store,
            planned,
        } = planned().await;
        store
            .put(&ObjectKey::recipe(&digest), planned.object.clone())
            .await
            .unwrap();
        // One chunk the recipe reads, overwritten with other (valid zstd) bytes.
        let Some(Piece::Chunk { id, .. }) = planned
            .recipe
            .pieces
            .iter()
            .find(|p| matches!(p, Piece::Chunk { .. }))
        else {
            panic!("no chunk piece");
        };
        let path = dir.path().join(ObjectKey::chunk(&ChunkId(*id)).as_str());
        std::fs::write(&path, zstd::bulk::compress(b"not the chunk", 3).unwrap()).unwrap();
        assert!(matches!(
            verify(store.clone(), &planned).await,
            Err(RecipeError::Damaged(..))
        ));
        assert!(check(&store, &digest).await.is_err());
        let key = ObjectKey::blob(&digest);
        let mut s = read_object(&store, &key, 0..layer.len() as u64)
            .await
            .unwrap();
        let mut failed = false;
        while let Some(b) = s.next().await {
            if b.is_err() {
                failed = true;
                break;
            }
        }
        assert!(failed, "a damaged chunk ends the read with an error");
        // A recipe whose index is damaged is refused when loaded.
        let recipe_path = dir.path().join(ObjectKey::recipe(&digest).as_str());
        let mut bytes = std::fs::read(&recipe_path).unwrap();
        bytes[HEADER as usize + 3] ^= 0xff;
        std::fs::write(&recipe_path, bytes).unwrap();
        assert!(matches!(
            Recipe::load(store.as_ref(), &digest).await,
            Err(RecipeError::Damaged(..))
        ));
    }
}
