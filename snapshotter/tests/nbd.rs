//! The lazy NBD export against a real registry and QEMU's own NBD client (qemu-img,
//! qemu-io): bit-identical device, lazy fetching, warm cache, and a corrupted chunk in
//! the registry's store reaching the client only as an I/O error.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use amber_converter::manifest::EnvDigest;
use amber_snapshotter::cache::ChunkCache;
use amber_snapshotter::device::LazyDevice;
use amber_snapshotter::source::{RegistryClient, RegistrySource};
use amber_testkit::layer::Layer;
use amber_testkit::registry::{push_image, recompressed, settled};
use amber_testkit::Registry;
use std::time::Duration;

/// A layer with one 12 MiB file of varied bytes and some small files.
fn layer() -> Vec<u8> {
    let big: Vec<u8> = (0..12u32 << 20)
        .map(|i| (i.wrapping_mul(2654435761) >> 17) as u8)
        .collect();
    (0..50)
        .fold(Layer::new().file("opt/big.bin", 0o644, &big), |l, i| {
            l.file(
                &format!("etc/conf{i}"),
                0o644,
                format!("setting {i}\n").as_bytes(),
            )
        })
        .tar()
}

/// Pushes a one-layer image and waits for its conversion; returns the env digest.
async fn push_and_convert(reg: &Registry) -> EnvDigest {
    let config =
        r#"{"architecture":"amd64","os":"linux","rootfs":{"type":"layers","diff_ids":[]}}"#;
    push_image(reg, "nbd/img", "v1", &layer(), config).await;
    let v = settled(reg, "nbd/img", "v1").await;
    assert_eq!(v["state"], "done", "{v}");
    v["env_digest"].as_str().unwrap().parse().unwrap()
}

/// The device assembled directly from the registry (the reference bytes).
async fn reference_device(reg: &Registry, env: &EnvDigest) -> Vec<u8> {
    let src = RegistrySource::new(&RegistryClient::new(
        &reg.url(""),
        None,
        Duration::from_secs(60),
    ));
    let m = src.manifest(env).await.unwrap().manifest;
    let mut dev = vec![0u8; m.device_size as usize];
    for e in &m.extents {
        let z = amber_snapshotter::source::ChunkSource::fetch(&src, &e.chunk)
            .await
            .unwrap();
        let d = zstd::bulk::decompress(&z, e.length as usize).unwrap();
        dev[e.offset as usize..(e.offset + e.length) as usize].copy_from_slice(&d);
    }
    dev
}

struct Export {
    socket: PathBuf,
    cache: Arc<ChunkCache>,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl Drop for Export {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn export(reg: &Registry, env: &EnvDigest, cache_dir: &Path, work: &Path) -> Export {
    let src = Arc::new(RegistrySource::new(&RegistryClient::new(
        &reg.url(""),
        None,
        Duration::from_secs(60),
    )));
    let m = src.manifest(env).await.unwrap().manifest;
    let cache = Arc::new(ChunkCache::open(cache_dir, 1 << 30, src).unwrap());
    let device = Arc::new(LazyDevice::new(m, cache.clone()));
    let socket = work.join(format!("nbd-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&socket);
    let listener = tokio::net::UnixListener::bind(&socket).unwrap();
    let task = tokio::spawn(amber_snapshotter::nbd::serve(
        listener,
        "amber".into(),
        device,
    ));
    Export {
        socket,
        cache,
        task,
    }
}

fn nbd_uri(socket: &Path) -> String {
    format!("nbd+unix:///amber?socket={}", socket.display())
}

/// Runs a QEMU tool off the async runtime (it talks to our server on this runtime).
async fn qemu(tool: &str, args: Vec<String>) -> std::process::Output {
    let tool = tool.to_string();
    tokio::task::spawn_blocking(move || {
        Command::new(&tool)
            .args(&args)
            .output()
            .unwrap_or_else(|e| panic!("{tool} is required (qemu-utils): {e}"))
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn qemu_reads_a_bit_identical_device_lazily_and_a_warm_cache_fetches_nothing() {
    let reg = Registry::start(&[]);
    let env = push_and_convert(&reg).await;
    let want = reference_device(&reg, &env).await;
    let work = tempfile::tempdir().unwrap();
    let cache_dir = work.path().join("cache");

    // Lazy: one 4 KiB read at the start fetches one chunk, not the device.
    let ex = export(&reg, &env, &cache_dir, work.path()).await;
    let out = qemu(
        "qemu-io",
        vec![
            "-r".into(),
            "-f".into(),
            "raw".into(),
            "-c".into(),
            "read -v 1024 16".into(),
            nbd_uri(&ex.socket),
        ],
    )
    .await;
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("e2 e1 f5 e0"),
        "the EROFS magic at byte 1024: {text}"
    );
    assert_eq!(ex.cache.stats.fetches.load(Relaxed), 1);
    assert!(ex.cache.stats.fetched_chunk_bytes.load(Relaxed) <= (1 << 20));

    // The whole device through QEMU's NBD client equals the reference bytes.
    let raw = work.path().join("dev.raw");
    let out = qemu(
        "qemu-img",
        vec![
            "convert".into(),
            "-f".into(),
            "raw".into(),
            "-O".into(),
            "raw".into(),
            nbd_uri(&ex.socket),
            raw.display().to_string(),
        ],
    )
    .await;
    assert!(out.status.success(), "{out:?}");
    let got = std::fs::read(&raw).unwrap();
    assert_eq!(got.len(), want.len());
    assert_eq!(amber_testkit::sha256(&got), amber_testkit::sha256(&want));
    drop(ex);

    // Warm: a new export over the same node cache fetches nothing.
    let ex = export(&reg, &env, &cache_dir, work.path()).await;
    let out = qemu(
        "qemu-img",
        vec![
            "convert".into(),
            "-f".into(),
            "raw".into(),
            "-O".into(),
            "raw".into(),
            nbd_uri(&ex.socket),
            raw.display().to_string(),
        ],
    )
    .await;
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        amber_testkit::sha256(&std::fs::read(&raw).unwrap()),
        amber_testkit::sha256(&want)
    );
    assert_eq!(ex.cache.stats.fetches.load(Relaxed), 0, "warm cache");
    // Writes are refused: the export is read-only.
    let out = qemu(
        "qemu-io",
        vec![
            "-f".into(),
            "raw".into(),
            "-c".into(),
            "write 0 4096".into(),
            nbd_uri(&ex.socket),
        ],
    )
    .await;
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !out.status.success()
            || all.contains("failed")
            || all.contains("read-only")
            || all.contains("Operation not permitted"),
        "{all}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_chunk_corrupted_in_the_registry_store_is_an_io_error_for_the_client() {
    let reg = Registry::start(&[]);
    let env = push_and_convert(&reg).await;
    let src = RegistrySource::new(&RegistryClient::new(
        &reg.url(""),
        None,
        Duration::from_secs(60),
    ));
    let m = src.manifest(&env).await.unwrap().manifest;
    // Corrupt the stored chunk holding the start of the big file (the largest extent),
    // once recompression will not replace it.
    recompressed(&reg).await;
    let victim = m.extents.iter().max_by_key(|e| e.length).unwrap().clone();
    let path = reg.chunk_file(&victim.chunk.to_string());
    let other: Vec<u8> = vec![0x42; victim.length as usize];
    std::fs::write(&path, zstd::bulk::compress(&other, 3).unwrap()).unwrap();

    let work = tempfile::tempdir().unwrap();
    let ex = export(&reg, &env, &work.path().join("cache"), work.path()).await;
    let cmd = format!("read -v {} 4096", victim.offset);
    let out = qemu(
        "qemu-io",
        vec![
            "-r".into(),
            "-f".into(),
            "raw".into(),
            "-c".into(),
            cmd,
            nbd_uri(&ex.socket),
        ],
    )
    .await;
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(all.contains("Input/output error"), "{all}");
    assert!(
        !all.contains("42 42 42 42"),
        "corrupt bytes reached the client: {all}"
    );
    assert_eq!(ex.cache.stats.integrity_failures.load(Relaxed), 1);
    assert!(!ex.cache.contains(&victim.chunk));
    // Other chunks still read fine.
    let out = qemu(
        "qemu-io",
        vec![
            "-r".into(),
            "-f".into(),
            "raw".into(),
            "-c".into(),
            "read 0 4096".into(),
            nbd_uri(&ex.socket),
        ],
    )
    .await;
    assert!(out.status.success(), "{out:?}");
}
