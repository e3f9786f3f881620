//! The S3 server going away: stopped in the middle of an upload, the client gets a clean
//! retryable error (503 with Retry-After), no partial object becomes visible, reads the
//! index can answer keep being served (upload sessions, kept in the store, answer 503),
//! and once the server is back pushes succeed again.
//! Runs its own s3s-fs (data on disk, so it survives the restart).

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

use common::*;

const OCI: &str = "application/vnd.oci.image.manifest.v1+json";

struct S3sFs {
    child: Child,
}

impl S3sFs {
    /// s3s-fs on `root`, on `port` (0: a free one); returns it and its URL once it listens.
    fn start(root: &std::path::Path, port: u16) -> (S3sFs, String) {
        let bin = require_tool("s3s-fs");
        let port = if port == 0 {
            std::net::TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
                .port()
        } else {
            port
        };
        let mut child = Command::new(bin)
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["--access-key", "amber", "--secret-key", "amber-secret"])
            .arg(root)
            .env("RUST_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        loop {
            line.clear();
            assert!(
                out.read_line(&mut line).unwrap() > 0,
                "s3s-fs exited before listening"
            );
            if line.contains("server is running") {
                break;
            }
        }
        // Keep draining its log so it never blocks on a full pipe.
        std::thread::spawn(move || std::io::copy(&mut out, &mut std::io::sink()));
        (S3sFs { child }, format!("http://127.0.0.1:{port}"))
    }

    fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for S3sFs {
    fn drop(&mut self) {
        self.kill9();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn s3_going_away_mid_upload_is_a_clean_retryable_error_and_pushes_resume() {
    let root = tempfile::tempdir().unwrap();
    std::fs::create_dir(root.path().join("amber-test")).unwrap();
    let (mut s3, url) = S3sFs::start(root.path(), 0);
    let port: u16 = url.rsplit(':').next().unwrap().parse().unwrap();
    let args = vec![
        "--storage",
        "s3",
        "--s3-endpoint",
        &url,
        "--s3-bucket",
        "amber-test",
        "--s3-access-key-id",
        "amber",
        "--s3-secret-access-key",
        "amber-secret",
    ];
    let reg = Server::start(&args);
    let m = image_manifest(&reg, "faults/app", "before", "").await;
    assert_eq!(
        put_manifest(&reg, "faults/app", "v1", OCI, &m)
            .await
            .status(),
        201
    );
    let digest = sha256(m.as_bytes());
    let v: serde_json::Value = serde_json::from_str(&m).unwrap();
    let layer = v["layers"][0]["digest"].as_str().unwrap().to_string();

    // An upload streams 9 MiB (more than one multipart part), then S3 dies.
    let r = client()
        .post(reg.url("/v2/faults/app/blobs/uploads/"))
        .send()
        .await
        .unwrap();
    let location = reg.url(r.headers()["location"].to_str().unwrap());
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Vec<u8>, std::io::Error>>(1);
    let body =
        futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|v| (v, rx)) });
    let patch = tokio::spawn(
        client()
            .patch(&location)
            .body(reqwest::Body::wrap_stream(body))
            .send(),
    );
    let data: Vec<u8> = (0..(12u32 << 20)).map(|i| (i % 251) as u8).collect();
    tx.send(Ok(data[..9 << 20].to_vec())).await.unwrap();
    s3.kill9();
    tx.send(Ok(data[9 << 20..].to_vec())).await.unwrap();
    drop(tx);
    let r = patch.await.unwrap().unwrap();
    assert_eq!(r.status(), 503, "{}", r.text().await.unwrap());
    assert_eq!(r.headers()["retry-after"], "5");
    assert_eq!(error_code(r).await, "UNAVAILABLE");

    // Reads the index can answer are still served; reads of object bytes are 503.
    for path in [
        format!("/v2/faults/app/manifests/{digest}"),
        "/v2/faults/app/manifests/v1".to_string(),
    ] {
        let r = client()
            .head(reg.url(&path))
            .header("Accept", OCI)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "HEAD {path}");
    }
    let r = client()
        .head(reg.url(&format!("/v2/faults/app/blobs/{layer}")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let r = client()
        .get(reg.url("/v2/faults/app/tags/list"))
        .send()
        .await
        .unwrap();
    assert_eq!(
        r.text().await.unwrap(),
        r#"{"name":"faults/app","tags":["v1"]}"#
    );
    let r = client()
        .get(reg.url(&format!("/v2/faults/app/blobs/{layer}")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 503);
    // The session is a record in the store (any replica may continue it): its status is
    // a retryable 503 while the store is away.
    let r = client().get(&location).send().await.unwrap();
    assert_eq!(r.status(), 503);
    assert_eq!(error_code(r).await, "UNAVAILABLE");

    // S3 comes back (same data): nothing was acknowledged, so the session stands at 0
    // bytes; no partial object is visible, and the push resumes.
    let (_s3, _) = S3sFs::start(root.path(), port);
    let r = client().get(&location).send().await.unwrap();
    assert_eq!(r.status(), 204);
    assert_eq!(r.headers()["range"], "0-0");
    let want = sha256(&data);
    let r = client()
        .head(reg.url(&format!("/v2/faults/app/blobs/{want}")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let r = client()
        .patch(&location)
        .header("Content-Range", format!("0-{}", data.len() - 1))
        .body(data.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202, "{}", r.text().await.unwrap());
    let sep = if location.contains('?') { '&' } else { '?' };
    let r = client()
        .put(format!("{location}{sep}digest={want}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201, "{}", r.text().await.unwrap());
    let got = get_bytes(&reg, &format!("/v2/faults/app/blobs/{want}")).await;
    assert!(got == data, "the pushed blob reads back intact");
    let got = client()
        .get(reg.url(&format!("/v2/faults/app/blobs/{layer}")))
        .send()
        .await
        .unwrap();
    assert_eq!(
        got.bytes().await.unwrap(),
        "layer bytes of before".as_bytes()
    );
}
