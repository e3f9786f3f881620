//! Concurrency, memory and crash behaviour of uploads, against the real binary.

mod common;

use std::time::Duration;

use common::*;
use futures_util::{stream, StreamExt};
use sha2::Digest as _;

/// Deterministic pseudo-random 1 MiB blocks: block `i` of a stream seeded by `seed`.
fn block(seed: u64, i: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(1 << 20);
    let mut x = seed ^ i.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    while out.len() < 1 << 20 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out
}

fn blocks(seed: u64, n: u64) -> impl futures_util::Stream<Item = Result<Vec<u8>, std::io::Error>> {
    stream::iter(0..n).map(move |i| Ok(block(seed, i)))
}

fn digest_of_blocks(seed: u64, n: u64) -> String {
    let mut h = sha2::Sha256::new();
    for i in 0..n {
        h.update(block(seed, i));
    }
    format!("sha256:{}", hex::encode(h.finalize()))
}

async fn bytes_in(s: &Server) -> u64 {
    metric(&metrics_text(s).await, "amber_http_body_bytes_in_total")
}

/// Waits until the server has stored at least `n` request body bytes (an observable
/// condition, polled; not a sleep standing in for one).
async fn wait_bytes_in(s: &Server, n: u64) {
    for _ in 0..6000 {
        if bytes_in(s).await >= n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("server never received {n} bytes");
}

fn header(r: &reqwest::Response, name: &str) -> String {
    r.headers()[name].to_str().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixteen_concurrent_pushes_of_one_blob_leave_one_intact_blob() {
    let s = Server::start(&[]);
    let digest = digest_of_blocks(16, 4);
    let pushes = (0..16).map(|_| {
        let (s, digest) = (&s, digest.clone());
        async move {
            let c = client();
            let r = c
                .post(s.url("/v2/conc/blob/blobs/uploads/"))
                .send()
                .await
                .unwrap();
            let loc = header(&r, "location");
            let r = c
                .patch(s.url(&loc))
                .body(reqwest::Body::wrap_stream(blocks(16, 4)))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 202);
            c.put(s.url(&format!("{loc}?digest={digest}")))
                .send()
                .await
                .unwrap()
                .status()
        }
    });
    for status in futures_util::future::join_all(pushes).await {
        assert_eq!(status, 201);
    }
    let body = get_bytes(&s, &format!("/v2/conc/blob/blobs/{digest}")).await;
    assert_eq!(sha256(&body), digest);
    let hex = digest.strip_prefix("sha256:").unwrap();
    let stored: Vec<_> = files_under(&s.data.join("store/blobs"))
        .into_iter()
        .filter(|p| p.ends_with(hex))
        .collect();
    assert_eq!(stored.len(), 1, "one stored object");
    assert_eq!(
        std::fs::read_dir(s.data.join("store/_staging"))
            .unwrap()
            .count(),
        0,
        "no staged leftovers"
    );
}

#[tokio::test]
async fn a_1gib_blob_is_pushed_and_pulled_in_bounded_memory() {
    let s = Server::start(&[]);
    let n = 1024; // 1 MiB blocks
    let digest = digest_of_blocks(1, n);
    let c = client();
    let r = c
        .post(s.url("/v2/big/blob/blobs/uploads/"))
        .send()
        .await
        .unwrap();
    let loc = header(&r, "location");
    let r = c
        .patch(s.url(&loc))
        .body(reqwest::Body::wrap_stream(blocks(1, n)))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    assert_eq!(header(&r, "range"), format!("0-{}", (n << 20) - 1));
    let r = c
        .put(s.url(&format!("{loc}?digest={digest}")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);

    let r = c
        .get(s.url(&format!("/v2/big/blob/blobs/{digest}")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let mut h = sha2::Sha256::new();
    let mut len = 0u64;
    let mut body = r.bytes_stream();
    while let Some(chunk) = body.next().await {
        let chunk = chunk.unwrap();
        len += chunk.len() as u64;
        h.update(&chunk);
    }
    assert_eq!(len, n << 20);
    assert_eq!(format!("sha256:{}", hex::encode(h.finalize())), digest);
    let peak = s.peak_rss_kib();
    assert!(
        peak < 100 * 1024,
        "registry peak RSS was {peak} KiB for a 1 GiB blob"
    );
    eprintln!("registry peak RSS for a 1 GiB push + pull: {peak} KiB");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigkill_mid_upload_keeps_completed_pushes_and_shows_no_partial_blob() {
    let tmp = tempfile::tempdir().unwrap();
    let mut s = Server::start_in(tmp.path(), &[]);
    let c = client();

    // Completed before the crash: a blob and a tagged manifest.
    let m = image_manifest(&s, "crash/x", "done", "").await;
    let r = put_manifest(
        &s,
        "crash/x",
        "v1",
        "application/vnd.oci.image.manifest.v1+json",
        &m,
    )
    .await;
    assert_eq!(r.status(), 201);
    let done = push_blob(&s, "crash/x", &block(7, 0)).await;

    // Session 1: one acknowledged 1 MiB chunk, then a second chunk cut off mid-stream.
    let full1: Vec<u8> = [block(9, 0), block(9, 1)].concat();
    let r = c
        .post(s.url("/v2/crash/x/blobs/uploads/"))
        .send()
        .await
        .unwrap();
    let loc1 = header(&r, "location");
    let r = c
        .patch(s.url(&loc1))
        .header("Content-Range", format!("0-{}", (1 << 20) - 1))
        .body(block(9, 0))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    // Session 2: nothing acknowledged, cut off mid-stream.
    let r = c
        .post(s.url("/v2/crash/x/blobs/uploads/"))
        .send()
        .await
        .unwrap();
    let loc2 = header(&r, "location");
    let before = bytes_in(&s).await;

    let half = |seed: u64, i: u64| {
        let first = block(seed, i)[..512 * 1024].to_vec();
        stream::iter([Ok::<_, std::io::Error>(first)]).chain(stream::pending())
    };
    let (u1, u2) = (s.url(&loc1), s.url(&loc2));
    let t1 = tokio::spawn(async move {
        client()
            .patch(u1)
            .body(reqwest::Body::wrap_stream(half(9, 1)))
            .send()
            .await
    });
    let t2 = tokio::spawn(async move {
        client()
            .patch(u2)
            .body(reqwest::Body::wrap_stream(half(11, 0)))
            .send()
            .await
    });
    wait_bytes_in(&s, before + 1024 * 1024).await;
    s.kill9();
    assert!(
        t1.await.unwrap().is_err() && t2.await.unwrap().is_err(),
        "interrupted requests fail"
    );

    let s = Server::start_in(tmp.path(), &[]);
    // Every completed push is intact.
    let r = c
        .get(s.url("/v2/crash/x/manifests/v1"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.text().await.unwrap(), m);
    let body = c
        .get(s.url(&format!("/v2/crash/x/blobs/{done}")))
        .send()
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    assert_eq!(sha256(&body), done);
    // No partial blob is visible.
    let d1 = sha256(&full1);
    let d2 = sha256(&block(11, 0));
    for d in [&d1, &d2] {
        assert_eq!(
            c.head(s.url(&format!("/v2/crash/x/blobs/{d}")))
                .send()
                .await
                .unwrap()
                .status(),
            404
        );
    }
    // Interrupted sessions resume from what was acknowledged.
    let r = c.get(s.url(&loc1)).send().await.unwrap();
    assert_eq!(r.status(), 204);
    assert_eq!(header(&r, "range"), format!("0-{}", (1 << 20) - 1));
    let r = c
        .patch(s.url(&loc1))
        .header("Content-Range", format!("{}-{}", 1 << 20, (2 << 20) - 1))
        .body(block(9, 1))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    let r = c
        .put(s.url(&format!("{loc1}?digest={d1}")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201, "{}", r.text().await.unwrap());
    let r = c.get(s.url(&loc2)).send().await.unwrap();
    assert_eq!(r.status(), 204);
    assert_eq!(header(&r, "range"), "0-0");
    let r = c
        .put(s.url(&format!("{loc2}?digest={d2}")))
        .body(block(11, 0))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let body = c
        .get(s.url(&format!("/v2/crash/x/blobs/{d1}")))
        .send()
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    assert_eq!(body.len(), 2 << 20);
    assert_eq!(sha256(&body), d1);
    drop(s);

    // fsck agrees: every object hashes to its name and the index matches the store.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_amber-registry"))
        .args(["fsck", "--data"])
        .arg(tmp.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "fsck: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains(", 0 problems"), "{stdout}");
}

#[tokio::test]
async fn fsck_reports_a_corrupted_object() {
    let tmp = tempfile::tempdir().unwrap();
    let s = Server::start_in(tmp.path(), &[]);
    let d = push_blob(&s, "fsck/x", b"precious bytes").await;
    drop(s);
    let hex = d.strip_prefix("sha256:").unwrap();
    let path = tmp
        .path()
        .join(format!("store/blobs/sha256/{}/{hex}", &hex[..2]));
    std::fs::write(&path, b"precious bytez").unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_amber-registry"))
        .args(["fsck", "--data"])
        .arg(tmp.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success());
    assert!(
        stdout.contains(&format!(
            "object blobs/sha256/{}/{hex} is corrupt",
            &hex[..2]
        )),
        "{stdout}"
    );
    assert!(stdout.contains("1 problems"), "{stdout}");
}

#[tokio::test]
async fn fsck_repair_removes_only_orphaned_staged_uploads() {
    let tmp = tempfile::tempdir().unwrap();
    let s = Server::start_in(tmp.path(), &[]);
    // A live session with 5 bytes acknowledged.
    let r = client()
        .post(s.url("/v2/fsck/live/blobs/uploads/"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    let location = header(&r, "location");
    let r = client()
        .patch(s.url(&location))
        .body("12345")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    drop(s);
    // What a crash can leave: staged bytes whose session record is gone.
    let orphan = tmp.path().join("store/_staging/0000dead-beef");
    std::fs::write(&orphan, b"orphan bytes").unwrap();
    let fsck = |repair: bool| {
        let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_amber-registry"));
        c.args(["fsck", "--data"]).arg(tmp.path());
        if repair {
            c.arg("--repair");
        }
        let out = c.output().unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    };
    let (ok, out) = fsck(false);
    assert!(!ok, "{out}");
    assert!(
        out.contains("staged upload data 0000dead-beef (12 bytes) belongs to no upload session"),
        "{out}"
    );
    assert!(out.contains(", 1 problems"), "{out}");
    assert!(orphan.exists(), "fsck without --repair changes nothing");
    let (ok, out) = fsck(true);
    assert!(ok, "{out}");
    assert!(
        out.contains("removed: staged upload data 0000dead-beef"),
        "{out}"
    );
    assert!(!orphan.exists());
    let (ok, out) = fsck(false);
    assert!(ok, "{out}");
    // The live session was left alone: it resumes and completes after a restart.
    let s = Server::start_in(tmp.path(), &[]);
    let r = client().get(s.url(&location)).send().await.unwrap();
    assert_eq!(r.status(), 204);
    assert_eq!(header(&r, "range"), "0-4");
    let whole = b"123456789";
    let d = sha256(whole);
    let r = client()
        .put(s.url(&format!("{location}?digest={d}")))
        .body(&whole[5..])
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let r = client()
        .get(s.url(&format!("/v2/fsck/live/blobs/{d}")))
        .send()
        .await
        .unwrap();
    assert_eq!(&r.bytes().await.unwrap()[..], whole);
}
