//! Crash loop: seeded push + convert cycles on one data directory, each cut by SIGKILL
//! at a seeded point (between requests, in the middle of a streamed upload, or while
//! the pushed image converts), restarting every time. Afterwards every acknowledged
//! blob and manifest is intact and every acknowledged image converted, and fsck finds
//! nothing wrong.
//!
//! `AMBER_FAULT_CYCLES` sets the number of cycles (20 here; the full 100-cycle run is
//! `AMBER_FAULT_CYCLES=100 cargo test -p amber-registry --test faults`).

mod common;

use common::*;
use serde_json::json;
use tokio::sync::mpsc;

/// splitmix64: a seeded generator, enough for fault plans and file contents.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

fn layer_tar(rng: &mut Rng, cycle: u64) -> Vec<u8> {
    (0..3)
        .fold(Layer::new(), |l, i| {
            let len = 20_000 + rng.below(60_000) as usize;
            l.file(&format!("cycle{cycle}/file{i}"), 0o644, &rng.bytes(len))
        })
        .tar()
}

/// What a push reports as it goes: each acknowledged step.
enum Step {
    Blob(String, Vec<u8>),
    /// Part of a streamed upload is on its way (the request is in flight).
    Streaming,
    Manifest(String, String),
}

/// Pushes one image: config and first layer in single requests, the second layer as a
/// streamed PATCH in parts, then the manifest. Stops at the first failure (the kill).
async fn push(
    addr: String,
    repo: String,
    tag: String,
    blobs: Vec<Vec<u8>>,
    steps: mpsc::Sender<Step>,
) {
    let url = |p: &str| format!("http://{addr}{p}");
    let c = client();
    let mut digests = Vec::new();
    for blob in &blobs[..2] {
        let d = sha256(blob);
        let Ok(r) = c
            .post(url(&format!("/v2/{repo}/blobs/uploads/?digest={d}")))
            .body(blob.clone())
            .send()
            .await
        else {
            return;
        };
        if r.status() != 201 {
            return;
        }
        digests.push(d.clone());
        let _ = steps.send(Step::Blob(d, blob.clone())).await;
    }
    let last = &blobs[2];
    let Ok(r) = c
        .post(url(&format!("/v2/{repo}/blobs/uploads/")))
        .send()
        .await
    else {
        return;
    };
    let Some(loc) = r
        .headers()
        .get("location")
        .map(|v| v.to_str().unwrap().to_string())
    else {
        return;
    };
    let (tx, mut rx) = mpsc::channel::<Result<Vec<u8>, std::io::Error>>(1);
    let body =
        reqwest::Body::wrap_stream(futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx)));
    let patch = tokio::spawn(c.patch(url(&loc)).body(body).send());
    let half = last.len() / 2;
    if tx.send(Ok(last[..half].to_vec())).await.is_err() {
        return;
    }
    let _ = steps.send(Step::Streaming).await;
    if tx.send(Ok(last[half..].to_vec())).await.is_err() {
        return;
    }
    drop(tx);
    match patch.await {
        Ok(Ok(r)) if r.status() == 202 => {}
        _ => return,
    }
    let d = sha256(last);
    let Ok(r) = c.put(url(&format!("{loc}?digest={d}"))).send().await else {
        return;
    };
    if r.status() != 201 {
        return;
    }
    digests.push(d.clone());
    let _ = steps.send(Step::Blob(d, last.clone())).await;
    let m = json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": digests[0], "size": blobs[0].len()},
        "layers": [
            {"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": digests[1], "size": blobs[1].len()},
            {"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": digests[2], "size": blobs[2].len()},
        ],
    })
    .to_string();
    let Ok(r) = c
        .put(url(&format!("/v2/{repo}/manifests/{tag}")))
        .header("Content-Type", "application/vnd.oci.image.manifest.v1+json")
        .body(m.clone())
        .send()
        .await
    else {
        return;
    };
    if r.status() == 201 {
        let _ = steps.send(Step::Manifest(tag, m)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigkill_loop_loses_no_acknowledged_push_and_fsck_finds_nothing() {
    let cycles: u64 = std::env::var("AMBER_FAULT_CYCLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20);
    let tmp = tempfile::tempdir().unwrap();
    let mut rng = Rng(0x0061_6d62_6572);
    let mut blobs_acked: Vec<(String, Vec<u8>)> = Vec::new();
    let mut manifests_acked: Vec<(String, String)> = Vec::new();
    for cycle in 0..cycles {
        let mut s = Server::start_in(tmp.path(), &[]);
        let config = json!({"architecture": "amd64", "os": "linux", "cycle": cycle, "rootfs": {"type": "layers", "diff_ids": []}})
            .to_string()
            .into_bytes();
        let blobs = vec![
            config,
            layer_tar(&mut rng, cycle),
            layer_tar(&mut rng, cycle),
        ];
        // The kill point: after 0-4 of the push's steps (2 blobs, mid-stream, the third
        // blob), or after the manifest's acknowledgement, while the image converts
        // (3 times in 8).
        let kill_after = rng.below(8).min(5);
        let (tx, mut rx) = mpsc::channel(8);
        let task = tokio::spawn(push(
            s.addr.clone(),
            "faults/img".into(),
            format!("c{cycle}"),
            blobs,
            tx,
        ));
        let mut seen = 0;
        while seen < kill_after {
            match rx.recv().await {
                Some(Step::Blob(d, b)) => blobs_acked.push((d, b)),
                Some(Step::Manifest(t, m)) => manifests_acked.push((t, m)),
                Some(Step::Streaming) => {}
                None => break,
            }
            seen += 1;
        }
        s.kill9();
        task.await.unwrap();
        // Acknowledgements that raced the kill count too.
        while let Ok(step) = rx.try_recv() {
            match step {
                Step::Blob(d, b) => blobs_acked.push((d, b)),
                Step::Manifest(t, m) => manifests_acked.push((t, m)),
                Step::Streaming => {}
            }
        }
    }
    assert!(
        !manifests_acked.is_empty(),
        "the plan acknowledged no push at all"
    );
    let s = Server::start_in(tmp.path(), &[]);
    for (d, b) in &blobs_acked {
        let r = client()
            .get(s.url(&format!("/v2/faults/img/blobs/{d}")))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "acknowledged blob {d}");
        assert_eq!(sha256(&r.bytes().await.unwrap()), *d);
        assert!(b.len() > 1);
    }
    for (tag, m) in &manifests_acked {
        let r = client()
            .get(s.url(&format!("/v2/faults/img/manifests/{tag}")))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "acknowledged manifest {tag}");
        assert_eq!(r.text().await.unwrap(), *m);
        // Converted: interrupted conversions resume after the restart.
        let v = settled(&s, "faults/img", tag).await;
        assert_eq!(v["state"], "done", "conversion of {tag}: {v}");
    }
    drop(s);
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_amber-registry"))
        .args(["fsck", "--data"])
        .arg(tmp.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(stdout.contains(", 0 problems"), "{stdout}");
    eprintln!(
        "{cycles} cycles: {} blobs and {} manifests acknowledged, all intact",
        blobs_acked.len(),
        manifests_acked.len()
    );
}
