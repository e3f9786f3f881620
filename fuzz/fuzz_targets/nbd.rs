//! The NBD server on arbitrary client bytes: handshake, options and transmission
//! requests against a small lazy device (two chunks, one hole). The server must answer
//! or close the connection, never panic or hang.
#![no_main]
use std::sync::{Arc, OnceLock};

use amber_converter::manifest::{BlockManifest, ChunkId, Extent, FORMAT_VERSION};
use amber_snapshotter::cache::ChunkCache;
use amber_snapshotter::device::LazyDevice;
use amber_snapshotter::source::{ChunkSource, SourceError};
use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

struct Memory(Vec<(ChunkId, Bytes)>);

#[async_trait::async_trait]
impl ChunkSource for Memory {
    async fn fetch(&self, id: &ChunkId) -> Result<Bytes, SourceError> {
        Ok(self.0.iter().find(|(c, _)| c == id).map(|(_, z)| z.clone()).expect("known chunk"))
    }
}

struct Fixture {
    rt: tokio::runtime::Runtime,
    device: Arc<LazyDevice>,
    _dir: tempfile::TempDir,
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let mut chunks = Vec::new();
        let mut extents = Vec::new();
        for (i, fill) in [(0u64, 0x5au8), (3, 0xa5)] {
            let data = vec![fill; 4096];
            let id = ChunkId::of(&data);
            chunks.push((id, Bytes::from(zstd::bulk::compress(&data, 1).unwrap())));
            extents.push(Extent { offset: i * 4096, length: 4096, chunk: id });
        }
        let manifest = BlockManifest {
            version: FORMAT_VERSION,
            device_size: 5 * 4096,
            block_size: 4096,
            filesystem: "erofs".into(),
            extents,
        };
        let cache = ChunkCache::open(dir.path(), 1 << 20, Arc::new(Memory(chunks))).unwrap();
        Fixture {
            rt: tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap(),
            device: Arc::new(LazyDevice::new(manifest, Arc::new(cache))),
            _dir: dir,
        }
    })
}

fuzz_target!(|data: &[u8]| {
    let f = fixture();
    let input = data.to_vec();
    f.rt.block_on(async {
        let (client, server) = tokio::io::duplex(1 << 16);
        let serve = tokio::spawn(amber_snapshotter::nbd::handle(server, "amber", f.device.clone()));
        let (mut r, mut w) = tokio::io::split(client);
        let drain = tokio::spawn(async move {
            let mut buf = vec![0u8; 1 << 16];
            while matches!(r.read(&mut buf).await, Ok(n) if n > 0) {}
        });
        let _ = w.write_all(&input).await;
        let _ = w.shutdown().await;
        drop(w);
        let _ = serve.await.expect("the NBD server does not panic");
        drain.abort();
    });
});
