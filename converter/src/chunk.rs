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

pub struct Chunker<'a> {
    sink: &'a mut dyn ChunkSink,
    raw: Option<&'a mut dyn RawSink>,
    extents: Vec<Extent>,
    pack: Vec<u8>,
    pack_start: u64,
    pub chunks: u64,
}

fn is_zero(b: &[u8]) -> bool {
    // SAFETY: every bit pattern is a valid u128, and align_to only reinterprets the
    // aligned middle of the slice, leaving the unaligned ends as bytes.
    let (pre, mid, post) = unsafe { b.align_to::<u128>() };
    pre.iter().all(|&x| x == 0) && mid.iter().all(|&x| x == 0) && post.iter().all(|&x| x == 0)
}

impl<'a> Chunker<'a> {
    pub fn new(sink: &'a mut dyn ChunkSink, raw: Option<&'a mut dyn RawSink>) -> Chunker<'a> {
        Chunker {
            sink,
            raw,
            extents: Vec::new(),
            pack: Vec::new(),
            pack_start: 0,
            chunks: 0,
        }
    }

    fn emit(&mut self, offset: u64, data: &[u8]) -> io::Result<()> {
        if data.is_empty() || is_zero(data) {
            return Ok(());
        }
        if let Some(raw) = self.raw.as_mut() {
            raw.write_at(offset, data)?;
        }
        let id = ChunkId::of(data);
        self.sink.put(id, data)?;
        self.chunks += 1;
        self.extents.push(Extent {
            offset,
            length: data.len() as u64,
            chunk: id,
        });
        Ok(())
    }

    /// Metadata at device offset `offset` (block aligned), cut every MAX_CHUNK.
    pub fn metadata(&mut self, offset: u64, data: &[u8]) -> io::Result<()> {
        for (i, piece) in data.chunks(MAX_CHUNK as usize).enumerate() {
            self.emit(offset + i as u64 * MAX_CHUNK, piece)?;
        }
        Ok(())
    }

    fn flush_pack(&mut self) -> io::Result<()> {
        let pack = std::mem::take(&mut self.pack);
        self.emit(self.pack_start, &pack)?;
        self.pack = pack;
        self.pack.clear();
        Ok(())
    }

    /// One regular file placed at `offset` (block aligned); `data` yields its `len` bytes
    /// (zero-padded here to the block end). `hash` is blake3 of the content (only read for
    /// files below `LARGE_FILE`).
    pub fn file(
        &mut self,
        offset: u64,
        len: u64,
        hash: &[u8; 32],
        data: &mut dyn io::Read,
        block: u64,
    ) -> io::Result<()> {
        let padded = len.div_ceil(block) * block;
        if len >= LARGE_FILE {
            self.flush_pack()?;
            let mut buf = vec![0u8; MAX_CHUNK as usize];
            let mut done = 0u64;
            while done < padded {
                let n = (padded - done).min(MAX_CHUNK) as usize;
                let real = (len - done).min(n as u64) as usize;
                data.read_exact(&mut buf[..real])?;
                buf[real..n].fill(0);
                self.emit(offset + done, &buf[..n])?;
                done += n as u64;
            }
            return Ok(());
        }
        if !self.pack.is_empty() && self.pack.len() as u64 + padded > MAX_CHUNK {
            self.flush_pack()?;
        }
        if self.pack.is_empty() {
            self.pack_start = offset;
        }
        debug_assert_eq!(self.pack_start + self.pack.len() as u64, offset);
        let start = self.pack.len();
        self.pack.resize(start + padded as usize, 0);
        data.read_exact(&mut self.pack[start..start + len as usize])?;
        let h = u64::from_le_bytes(hash[..8].try_into().expect("8 bytes"));
        if h.trailing_zeros() >= PACK_BITS {
            self.flush_pack()?;
        }
        Ok(())
    }

    /// Flushes the last pack; returns the extents and the number of chunks emitted.
    pub fn finish(mut self) -> io::Result<(Vec<Extent>, u64)> {
        self.flush_pack()?;
        Ok((self.extents, self.chunks))
    }
}

/// Hands chunks to `threads` worker threads that store them with `put` (hashing is done
/// by the chunker; compressing and writing happen here, in parallel with the chunker).
/// At most `2 * threads` chunks wait in the queue. `finish` reports the first error.
pub struct ParallelSink {
    tx: Option<std::sync::mpsc::SyncSender<(ChunkId, Vec<u8>)>>,
    workers: Vec<std::thread::JoinHandle<()>>,
    error: std::sync::Arc<std::sync::Mutex<Option<io::Error>>>,
}

pub type PutFn = dyn Fn(ChunkId, &[u8]) -> io::Result<()> + Send + Sync;

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
        }
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
            &mut &big[..],
            4096,
        )
        .unwrap();
        let zeros = vec![0u8; MAX_CHUNK as usize];
        let at = 8192 + big.len() as u64;
        c.file(
            at,
            zeros.len() as u64,
            &file_hash(false),
            &mut &zeros[..],
            4096,
        )
        .unwrap();
        let (ext, _) = c.finish().unwrap();
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
            c.file(off, 100, &file_hash(*cut), &mut &data[..], 4096)
                .unwrap();
            off += 4096;
        }
        let (ext, _) = c.finish().unwrap();
        let shape: Vec<(u64, u64)> = ext.iter().map(|e| (e.offset, e.length)).collect();
        assert_eq!(shape, vec![(0, 3 * 4096), (3 * 4096, 2 * 4096)]);
    }
}
