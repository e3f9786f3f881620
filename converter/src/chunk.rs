//! Cutting the device into chunks for dedup, naming them by blake3, and handing them to
//! a `ChunkSink`.
//!
//! Rules (docs/architecture.md, "Formats"):
//! - metadata (superblock, inodes, directories) is chunked apart from file data, cut
//!   every `MAX_CHUNK` bytes from its start;
//! - a large file (at least `LARGE_FILE` bytes) starts its own chunk and is cut every
//!   `MAX_CHUNK` bytes of the file, so identical large files give identical chunks
//!   wherever they sit;
//! - small files are packed; a pack ends after a file whose content hash has
//!   `PACK_BITS` low zero bits, or before a file that would take it past `MAX_CHUNK`.
//!   Cuts depend on content and on the pack so far, never on device offsets, so adding
//!   or changing one file only changes its own pack;
//! - an all-zero range is a hole: no chunk, no extent.

use std::io;

use serde::{Deserialize, Serialize};

use crate::manifest::{ChunkId, Extent};

pub const MAX_CHUNK: u64 = 1 << 20;
pub const LARGE_FILE: u64 = 256 << 10;
/// A pack ends after a file whose hash has this many low zero bits (about 4 small
/// files a pack). Chosen by the corpus benchmark: 2 stores 4% less than 4 (a changed
/// source file drags fewer neighbours into a new chunk), for three times the chunks.
pub const PACK_BITS: u32 = 2;

/// Receives every chunk of a device (it may already have some: chunks are immutable).
pub trait ChunkSink {
    fn put(&mut self, id: ChunkId, data: &[u8]) -> io::Result<()>;
}

/// Receives the device's bytes at their offsets (for `--raw`); holes are not written.
pub trait RawSink {
    fn write_at(&mut self, offset: u64, data: &[u8]) -> io::Result<()>;
}

impl RawSink for Vec<u8> {
    fn write_at(&mut self, offset: u64, data: &[u8]) -> io::Result<()> {
        let end = offset as usize + data.len();
        if self.len() < end {
            self.resize(end, 0);
        }
        self[offset as usize..end].copy_from_slice(data);
        Ok(())
    }
}

impl RawSink for std::fs::File {
    fn write_at(&mut self, offset: u64, data: &[u8]) -> io::Result<()> {
        std::os::unix::fs::FileExt::write_all_at(self, data, offset)
    }
}

/// Where a file's bytes are in the chunk store, as a conversion laid them out. Kept in a
/// `chain::ChainState` so a later conversion can use the file without its layer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum DataLocation {
    /// A file of at least `LARGE_FILE` bytes: one entry per `MAX_CHUNK` piece of its
    /// block-padded data, `None` for a piece that is all zeros (a hole).
    Large { pieces: Vec<Option<ChunkId>> },
    /// A smaller file: at `offset` in the pack chunk `chunk`, which is `chunk_len` bytes
    /// long (`None`: the pack was all zeros, a hole).
    Packed {
        chunk: Option<ChunkId>,
        offset: u32,
        chunk_len: u32,
    },
}

/// Reads chunks back from the store, for files whose bytes a conversion did not read
/// from a layer (`DataLocation`). What it returns is checked against the id here.
pub trait ChunkSource {
    /// The uncompressed bytes of chunk `id`.
    fn chunk(&mut self, id: &ChunkId) -> io::Result<Vec<u8>>;
}

/// The bytes of one regular file handed to `Chunker::file`.
pub enum FileData<'r> {
    /// Read from a stream (a layer's bytes in the scratch file).
    Read(&'r mut dyn io::Read),
    /// Already in the chunk store.
    Stored(&'r DataLocation),
}

/// A small file waiting in the current pack.
struct Member {
    /// Index of the `Chunker::file` call (its entry in `locations`).
    call: usize,
    /// Offset in the pack and length of the file's bytes.
    at: usize,
    len: usize,
    /// Where the bytes are if they were not read (the pack holds zeros there until the
    /// pack is cut, and then only if the pack is not a chunk the store has already).
    stored: Option<DataLocation>,
}

/// What a chunker produced.
pub struct Chunked {
    pub extents: Vec<Extent>,
    pub chunks: u64,
    /// Where each `file` call's bytes ended up, in call order.
    pub locations: Vec<DataLocation>,
}

pub struct Chunker<'a> {
    sink: &'a mut dyn ChunkSink,
    raw: Option<&'a mut dyn RawSink>,
    source: Option<&'a mut dyn ChunkSource>,
    extents: Vec<Extent>,
    pack: Vec<u8>,
    pack_start: u64,
    members: Vec<Member>,
    locations: Vec<DataLocation>,
    /// The last chunk read back from `source` (neighbouring files share packs).
    fetched: Option<(ChunkId, Vec<u8>)>,
    pub chunks: u64,
}

fn is_zero(b: &[u8]) -> bool {
    // SAFETY: every bit pattern is a valid u128, and align_to only reinterprets the
    // aligned middle of the slice, leaving the unaligned ends as bytes.
    let (pre, mid, post) = unsafe { b.align_to::<u128>() };
    pre.iter().all(|&x| x == 0) && mid.iter().all(|&x| x == 0) && post.iter().all(|&x| x == 0)
}

fn bad_location(what: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what)
}

impl<'a> Chunker<'a> {
    pub fn new(sink: &'a mut dyn ChunkSink, raw: Option<&'a mut dyn RawSink>) -> Chunker<'a> {
        Chunker {
            sink,
            raw,
            source: None,
            extents: Vec::new(),
            pack: Vec::new(),
            pack_start: 0,
            members: Vec::new(),
            locations: Vec::new(),
            fetched: None,
            chunks: 0,
        }
    }

    /// A chunker that can take `FileData::Stored` files, reading them from `source` when
    /// their bytes are needed.
    pub fn with_source(mut self, source: &'a mut dyn ChunkSource) -> Chunker<'a> {
        self.source = Some(source);
        self
    }

    /// Stores `data` as the chunk at `offset`; `None` for a hole.
    fn emit(&mut self, offset: u64, data: &[u8]) -> io::Result<Option<ChunkId>> {
        if data.is_empty() || is_zero(data) {
            return Ok(None);
        }
        if let Some(raw) = self.raw.as_mut() {
            raw.write_at(offset, data)?;
        }
        let id = ChunkId::of(data);
        self.sink.put(id, data)?;
        self.known(offset, data.len() as u64, id);
        Ok(Some(id))
    }

    /// Records a chunk the store already has.
    fn known(&mut self, offset: u64, length: u64, chunk: ChunkId) {
        self.chunks += 1;
        self.extents.push(Extent {
            offset,
            length,
            chunk,
        });
    }

    /// The bytes of a stored chunk, verified against its id.
    fn fetch(&mut self, id: &ChunkId) -> io::Result<&[u8]> {
        if self.fetched.as_ref().is_none_or(|(have, _)| have != id) {
            let source = self.source.as_mut().ok_or_else(|| {
                io::Error::other("a stored file's bytes are needed but no chunk source was given")
            })?;
            let bytes = source.chunk(id)?;
            if ChunkId::of(&bytes) != *id {
                return Err(bad_location(format!(
                    "chunk {id} read back from the store does not match its id"
                )));
            }
            self.fetched = Some((*id, bytes));
        }
        Ok(&self.fetched.as_ref().expect("just fetched").1)
    }

    /// Metadata at device offset `offset` (block aligned), cut every MAX_CHUNK.
    pub fn metadata(&mut self, offset: u64, data: &[u8]) -> io::Result<()> {
        // A pack holds consecutive files: metadata after them ends it.
        self.flush_pack()?;
        for (i, piece) in data.chunks(MAX_CHUNK as usize).enumerate() {
            self.emit(offset + i as u64 * MAX_CHUNK, piece)?;
        }
        Ok(())
    }

    fn flush_pack(&mut self) -> io::Result<()> {
        if self.members.is_empty() {
            return Ok(());
        }
        let members = std::mem::take(&mut self.members);
        let mut pack = std::mem::take(&mut self.pack);
        let len = pack.len();
        // A pack made only of stored files that sat at the same offsets of one chunk of
        // the same length is that chunk: its bytes are not needed.
        let first = match &members[0].stored {
            Some(DataLocation::Packed { chunk, .. }) => Some(*chunk),
            _ => None,
        };
        let whole = first.filter(|c| {
            self.raw.is_none()
                && members.iter().all(|m| {
                    matches!(&m.stored, Some(DataLocation::Packed { chunk, offset, chunk_len })
                        if chunk == c && *offset as usize == m.at && *chunk_len as usize == len)
                })
        });
        let chunk = match whole {
            Some(chunk) => {
                if let Some(id) = chunk {
                    self.known(self.pack_start, len as u64, id);
                }
                chunk
            }
            None => {
                for m in &members {
                    match &m.stored {
                        None | Some(DataLocation::Packed { chunk: None, .. }) => {}
                        Some(DataLocation::Packed {
                            chunk: Some(id),
                            offset,
                            ..
                        }) => {
                            let from = *offset as usize;
                            let bytes = self.fetch(id)?;
                            let src = bytes.get(from..from + m.len).ok_or_else(|| {
                                bad_location(format!(
                                    "stored file at {from}+{} lies outside chunk {id}",
                                    m.len
                                ))
                            })?;
                            pack[m.at..m.at + m.len].copy_from_slice(src);
                        }
                        Some(DataLocation::Large { .. }) => {
                            return Err(bad_location(
                                "a small file's stored bytes are in large-file pieces".into(),
                            ))
                        }
                    }
                }
                self.emit(self.pack_start, &pack)?
            }
        };
        for m in &members {
            self.locations[m.call] = DataLocation::Packed {
                chunk,
                offset: m.at as u32,
                chunk_len: len as u32,
            };
        }
        pack.clear();
        self.pack = pack;
        Ok(())
    }

    /// One regular file placed at `offset` (block aligned), `len` bytes (zero-padded here
    /// to the block end). `hash` is blake3 of the content (only read for files below
    /// `LARGE_FILE`).
    pub fn file(
        &mut self,
        offset: u64,
        len: u64,
        hash: &[u8; 32],
        data: FileData<'_>,
        block: u64,
    ) -> io::Result<()> {
        let call = self.locations.len();
        // Replaced once the file's chunks are known.
        self.locations
            .push(DataLocation::Large { pieces: Vec::new() });
        let padded = len.div_ceil(block) * block;
        if len >= LARGE_FILE {
            self.flush_pack()?;
            let count = padded.div_ceil(MAX_CHUNK) as usize;
            let piece_len = |i: usize| (padded - i as u64 * MAX_CHUNK).min(MAX_CHUNK);
            if let FileData::Stored(DataLocation::Large { pieces }) = &data {
                if pieces.len() != count {
                    return Err(bad_location(format!(
                        "a stored file of {len} bytes has {} pieces, not {count}",
                        pieces.len()
                    )));
                }
            }
            let pieces = match data {
                FileData::Stored(DataLocation::Large { pieces }) if self.raw.is_none() => {
                    for (i, p) in pieces.iter().enumerate() {
                        if let Some(id) = p {
                            self.known(offset + i as u64 * MAX_CHUNK, piece_len(i), *id);
                        }
                    }
                    pieces.clone()
                }
                FileData::Stored(DataLocation::Large { pieces }) => {
                    // With a raw sink every byte is written: read the pieces back.
                    let mut out = Vec::with_capacity(count);
                    for (i, p) in pieces.iter().enumerate() {
                        let n = piece_len(i) as usize;
                        let bytes = match p {
                            Some(id) => self.fetch(id)?.to_vec(),
                            None => vec![0; n],
                        };
                        if bytes.len() != n {
                            return Err(bad_location(format!(
                                "piece {i} of a stored file is {} bytes, not {n}",
                                bytes.len()
                            )));
                        }
                        out.push(self.emit(offset + i as u64 * MAX_CHUNK, &bytes)?);
                    }
                    out
                }
                FileData::Stored(DataLocation::Packed { .. }) => {
                    return Err(bad_location(
                        "a large file's stored bytes are in a pack".into(),
                    ))
                }
                FileData::Read(data) => {
                    let mut out = Vec::with_capacity(count);
                    read_pieces(data, len, block, &mut Vec::new(), |i, piece| {
                        out.push(self.emit(offset + i as u64 * MAX_CHUNK, piece)?);
                        Ok(())
                    })?;
                    out
                }
            };
            self.locations[call] = DataLocation::Large { pieces };
            return Ok(());
        }
        if !self.pack.is_empty() && self.pack.len() as u64 + padded > MAX_CHUNK {
            self.flush_pack()?;
        }
        if self.pack.is_empty() {
            self.pack_start = offset;
        }
        debug_assert_eq!(self.pack_start + self.pack.len() as u64, offset);
        let at = self.pack.len();
        self.pack.resize(at + padded as usize, 0);
        let stored = match data {
            FileData::Read(data) => {
                data.read_exact(&mut self.pack[at..at + len as usize])?;
                None
            }
            FileData::Stored(loc) => Some(loc.clone()),
        };
        self.members.push(Member {
            call,
            at,
            len: len as usize,
            stored,
        });
        let h = u64::from_le_bytes(hash[..8].try_into().expect("8 bytes"));
        if h.trailing_zeros() >= PACK_BITS {
            self.flush_pack()?;
        }
        Ok(())
    }

    /// Flushes the last pack; returns the extents, the number of chunks and where each
    /// file went.
    pub fn finish(mut self) -> io::Result<Chunked> {
        self.flush_pack()?;
        Ok(Chunked {
            extents: self.extents,
            chunks: self.chunks,
            locations: self.locations,
        })
    }
}

/// Reads a large file's `len` bytes from `data`, zero-padded to a multiple of `block`,
/// and hands each `MAX_CHUNK` piece to `piece(index, bytes)` (`buf` is the reusable
/// buffer the pieces are read into).
fn read_pieces(
    data: &mut dyn io::Read,
    len: u64,
    block: u64,
    buf: &mut Vec<u8>,
    mut piece: impl FnMut(usize, &[u8]) -> io::Result<()>,
) -> io::Result<()> {
    let padded = len.div_ceil(block) * block;
    buf.resize(MAX_CHUNK as usize, 0);
    for i in 0..padded.div_ceil(MAX_CHUNK) as usize {
        let done = i as u64 * MAX_CHUNK;
        let n = (padded - done).min(MAX_CHUNK) as usize;
        let real = (len - done).min(n as u64) as usize;
        data.read_exact(&mut buf[..real])?;
        buf[real..n].fill(0);
        piece(i, &buf[..n])?;
    }
    Ok(())
}

/// Stores a large file (at least `LARGE_FILE` bytes) straight into `sink`, before the
/// device is laid out: its pieces depend only on its own bytes, so they are the chunks
/// `Chunker::file` would cut wherever the file lands, and it takes the returned
/// location as `FileData::Stored` without reading the bytes again.
pub fn store_large_file(
    sink: &mut dyn ChunkSink,
    data: &mut dyn io::Read,
    len: u64,
    block: u64,
    buf: &mut Vec<u8>,
) -> io::Result<DataLocation> {
    debug_assert!(len >= LARGE_FILE);
    let mut pieces = Vec::with_capacity(len.div_ceil(MAX_CHUNK) as usize);
    read_pieces(data, len, block, buf, |_, piece| {
        pieces.push(if is_zero(piece) {
            None
        } else {
            let id = ChunkId::of(piece);
            sink.put(id, piece)?;
            Some(id)
        });
        Ok(())
    })?;
    Ok(DataLocation::Large { pieces })
}

/// Hands chunks to `threads` worker threads that store them with `put` (hashing is done
/// by the chunker; compressing and writing happen here, in parallel with the chunker).
/// At most `2 * threads` chunks wait in the queue. `finish` reports the first error.
/// With `with_known`, a chunk the store already has is not handed over at all.
pub struct ParallelSink {
    tx: Option<std::sync::mpsc::SyncSender<(ChunkId, Vec<u8>)>>,
    workers: Vec<std::thread::JoinHandle<()>>,
    error: std::sync::Arc<std::sync::Mutex<Option<io::Error>>>,
    known: Option<Box<KnownFn>>,
}

pub type PutFn = dyn Fn(ChunkId, &[u8]) -> io::Result<()> + Send + Sync;
/// Whether the store has a chunk already (a cheap check, made on the chunker's thread).
pub type KnownFn = dyn Fn(&ChunkId) -> io::Result<bool> + Send;

impl ParallelSink {
    pub fn new(threads: usize, put: std::sync::Arc<PutFn>) -> ParallelSink {
        let threads = threads.max(1);
        let (tx, rx) = std::sync::mpsc::sync_channel::<(ChunkId, Vec<u8>)>(threads * 2);
        let rx = std::sync::Arc::new(std::sync::Mutex::new(rx));
        let error = std::sync::Arc::new(std::sync::Mutex::new(None::<io::Error>));
        let workers = (0..threads)
            .map(|_| {
                let (rx, put, error) = (rx.clone(), put.clone(), error.clone());
                std::thread::spawn(move || loop {
                    let job = rx.lock().unwrap_or_else(|p| p.into_inner()).recv();
                    let Ok((id, data)) = job else { return };
                    if let Err(e) = put(id, &data) {
                        error
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .get_or_insert(e);
                    }
                })
            })
            .collect();
        ParallelSink {
            tx: Some(tx),
            workers,
            error,
            known: None,
        }
    }

    /// Skips chunks `known` says the store has, on the caller's thread: most chunks of
    /// an image on a shared base exist, and each hand-over to a worker costs a copy of
    /// the chunk and two thread switches.
    pub fn with_known(mut self, known: Box<KnownFn>) -> ParallelSink {
        self.known = Some(known);
        self
    }

    fn take_error(&self) -> Option<io::Error> {
        self.error.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    /// Waits for every queued chunk to be stored.
    pub fn finish(mut self) -> io::Result<()> {
        self.tx = None;
        for w in self.workers.drain(..) {
            w.join()
                .map_err(|_| io::Error::other("a chunk worker panicked"))?;
        }
        self.take_error().map_or(Ok(()), Err)
    }
}

impl ChunkSink for ParallelSink {
    fn put(&mut self, id: ChunkId, data: &[u8]) -> io::Result<()> {
        if let Some(e) = self.take_error() {
            return Err(e);
        }
        if let Some(known) = &self.known {
            if known(&id)? {
                return Ok(());
            }
        }
        self.tx
            .as_ref()
            .expect("not finished")
            .send((id, data.to_vec()))
            .map_err(|_| io::Error::other("chunk workers stopped"))
    }
}

impl Drop for ParallelSink {
    fn drop(&mut self) {
        self.tx = None;
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

/// A chunk store in a directory: `<dir>/<2 hex>/<64 hex>.zst`, each written once through
/// a temporary name. Used by `amber-convert`; safe to share between threads.
pub struct DirChunkStore {
    dir: std::path::PathBuf,
    level: i32,
    pub written: std::sync::atomic::AtomicU64,
    pub written_bytes: std::sync::atomic::AtomicU64,
    pub existing: std::sync::atomic::AtomicU64,
}

impl DirChunkStore {
    pub fn new(dir: impl Into<std::path::PathBuf>, level: i32) -> io::Result<DirChunkStore> {
        let dir = dir.into();
        std::fs::create_dir_all(&dir)?;
        Ok(DirChunkStore {
            dir,
            level,
            written: Default::default(),
            written_bytes: Default::default(),
            existing: Default::default(),
        })
    }

    pub fn path(dir: &std::path::Path, id: &ChunkId) -> std::path::PathBuf {
        let hex = id.hex();
        dir.join(&hex[..2]).join(format!("{hex}.zst"))
    }

    pub fn put(&self, id: ChunkId, data: &[u8]) -> io::Result<()> {
        use std::sync::atomic::Ordering::Relaxed;
        let path = Self::path(&self.dir, &id);
        if path.exists() {
            self.existing.fetch_add(1, Relaxed);
            return Ok(());
        }
        let compressed = zstd::bulk::compress(data, self.level)?;
        std::fs::create_dir_all(path.parent().expect("has parent"))?;
        let tmp = path.with_extension(format!(
            "tmp{}.{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        std::fs::write(&tmp, &compressed)?;
        std::fs::rename(&tmp, &path)?;
        self.written.fetch_add(1, Relaxed);
        self.written_bytes
            .fetch_add(compressed.len() as u64, Relaxed);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Default)]
    struct Mem(Vec<(ChunkId, usize)>);
    impl ChunkSink for Mem {
        fn put(&mut self, id: ChunkId, data: &[u8]) -> io::Result<()> {
            self.0.push((id, data.len()));
            Ok(())
        }
    }

    fn file_hash(zero_bits: bool) -> [u8; 32] {
        let mut h = [0xffu8; 32];
        if zero_bits {
            h[0] = 0;
        }
        h
    }

    #[test]
    fn large_files_start_their_own_chunks_and_zero_ranges_are_holes() {
        let mut sink = Mem::default();
        let mut c = Chunker::new(&mut sink, None);
        c.metadata(0, &[1u8; 8192]).unwrap();
        let big = vec![7u8; (MAX_CHUNK + 4096) as usize];
        c.file(
            8192,
            big.len() as u64,
            &file_hash(false),
            FileData::Read(&mut &big[..]),
            4096,
        )
        .unwrap();
        let zeros = vec![0u8; MAX_CHUNK as usize];
        let at = 8192 + big.len() as u64;
        c.file(
            at,
            zeros.len() as u64,
            &file_hash(false),
            FileData::Read(&mut &zeros[..]),
            4096,
        )
        .unwrap();
        let ext = c.finish().unwrap().extents;
        let shape: Vec<(u64, u64)> = ext.iter().map(|e| (e.offset, e.length)).collect();
        assert_eq!(
            shape,
            vec![(0, 8192), (8192, MAX_CHUNK), (8192 + MAX_CHUNK, 4096)]
        );
    }

    #[test]
    fn small_files_pack_until_a_content_defined_cut() {
        let mut sink = Mem::default();
        let mut c = Chunker::new(&mut sink, None);
        let mut off = 0;
        for (i, cut) in [false, false, true, false, true].iter().enumerate() {
            let data = [i as u8 + 1; 100];
            c.file(
                off,
                100,
                &file_hash(*cut),
                FileData::Read(&mut &data[..]),
                4096,
            )
            .unwrap();
            off += 4096;
        }
        let ext = c.finish().unwrap().extents;
        let shape: Vec<(u64, u64)> = ext.iter().map(|e| (e.offset, e.length)).collect();
        assert_eq!(shape, vec![(0, 3 * 4096), (3 * 4096, 2 * 4096)]);
    }
}
