//! Configurable limits: upload size, uploads at once, header and idle timeouts. Each
//! bad client gets a clear answer (or its connection closed) and loses nothing
//! acknowledged; other clients keep being served.

mod common;

use std::time::Duration;

use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

async fn in_flight(s: &Server) -> u64 {
    metric(&metrics_text(s).await, "amber_uploads_in_flight")
}

/// Polls an observable condition (not a sleep standing in for one).
async fn until<F: std::future::Future<Output = bool>>(what: &str, mut f: impl FnMut() -> F) {
    for _ in 0..6000 {
        if f().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("never: {what}");
}

async fn start_upload(s: &Server, repo: &str) -> String {
    let r = client()
        .post(s.url(&format!("/v2/{repo}/blobs/uploads/")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    r.headers()["location"].to_str().unwrap().to_string()
}

async fn offset(s: &Server, location: &str) -> String {
    let r = client().get(s.url(location)).send().await.unwrap();
    assert_eq!(r.status(), 204);
    r.headers()["range"].to_str().unwrap().to_string()
}

/// A streamed (chunked, no length) body fed from a channel the test controls.
fn channel_body() -> (
    tokio::sync::mpsc::Sender<Result<Vec<u8>, std::io::Error>>,
    reqwest::Body,
) {
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let stream = tokio_stream_from(rx);
    (tx, reqwest::Body::wrap_stream(stream))
}

fn tokio_stream_from(
    mut rx: tokio::sync::mpsc::Receiver<Result<Vec<u8>, std::io::Error>>,
) -> impl futures_util::Stream<Item = Result<Vec<u8>, std::io::Error>> {
    futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

#[tokio::test]
async fn blobs_past_max_blob_bytes_get_413_and_keep_what_was_acknowledged() {
    let s = Server::start(&["--max-blob-bytes", "1000"]);
    // Single request with a length: refused before reading.
    let data = vec![7u8; 1001];
    let r = client()
        .post(s.url(&format!(
            "/v2/lim/a/blobs/uploads/?digest={}",
            sha256(&data)
        )))
        .body(data)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 413);
    assert_eq!(error_code(r).await, "SIZE_INVALID");
    // Streamed without a length: cut off past the limit.
    let loc = start_upload(&s, "lim/a").await;
    let chunks: Vec<Result<Vec<u8>, std::io::Error>> = (0..4).map(|_| Ok(vec![1u8; 500])).collect();
    let r = client()
        .patch(s.url(&loc))
        .body(reqwest::Body::wrap_stream(futures_util::stream::iter(
            chunks,
        )))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 413);
    assert_eq!(offset(&s, &loc).await, "0-0");
    // Within the limit it works; the next chunk that would pass it is refused and the
    // session keeps its 500 bytes, then completes.
    let r = client()
        .patch(s.url(&loc))
        .body(vec![1u8; 500])
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    let r = client()
        .patch(s.url(&loc))
        .body(vec![1u8; 600])
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 413);
    let msg = r.text().await.unwrap();
    assert!(msg.contains("keeps its first 500 bytes"), "{msg}");
    assert_eq!(offset(&s, &loc).await, "0-499");
    let whole = vec![1u8; 1000];
    let r = client()
        .put(s.url(&format!("{loc}?digest={}", sha256(&whole))))
        .body(vec![1u8; 500])
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
}

#[tokio::test]
async fn uploads_past_max_concurrent_uploads_get_429() {
    let s = Server::start(&["--max-concurrent-uploads", "1"]);
    let first = start_upload(&s, "lim/b").await;
    let second = start_upload(&s, "lim/b").await;
    let (tx, body) = channel_body();
    let url = s.url(&first);
    let held = tokio::spawn(async move {
        client()
            .patch(url)
            .body(body)
            .send()
            .await
            .unwrap()
            .status()
    });
    tx.send(Ok(vec![2u8; 100])).await.unwrap();
    until("the first upload is in flight", || async {
        in_flight(&s).await == 1
    })
    .await;
    let r = client()
        .patch(s.url(&second))
        .body(vec![3u8; 10])
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["retry-after"], "1");
    assert_eq!(error_code(r).await, "TOOMANYREQUESTS");
    // Reads are not uploads: still served.
    assert_eq!(
        client().get(s.url("/v2/")).send().await.unwrap().status(),
        200
    );
    drop(tx);
    assert_eq!(held.await.unwrap(), 202);
    let r = client()
        .patch(s.url(&second))
        .body(vec![3u8; 10])
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
}

#[tokio::test]
async fn slow_clients_are_cut_off_by_the_header_and_idle_timeouts() {
    let s = Server::start(&["--header-timeout-secs", "1", "--idle-timeout-secs", "2"]);
    // Headers that never finish: the server closes the connection.
    let mut c = tokio::net::TcpStream::connect(&s.addr).await.unwrap();
    c.write_all(b"GET /v2/ HTTP/1.1\r\nHost: amber\r\n")
        .await
        .unwrap();
    let mut buf = Vec::new();
    let n = tokio::time::timeout(Duration::from_secs(60), c.read_to_end(&mut buf))
        .await
        .expect("the server closes a connection whose headers never finish");
    assert!(n.is_ok());
    assert!(
        buf.is_empty() || String::from_utf8_lossy(&buf).starts_with("HTTP/1.1 408"),
        "{:?}",
        String::from_utf8_lossy(&buf)
    );
    // A body that stalls: the connection is cut, nothing of it is acknowledged.
    let loc = start_upload(&s, "lim/c").await;
    let mut c = tokio::net::TcpStream::connect(&s.addr).await.unwrap();
    c.write_all(
        format!("PATCH {loc} HTTP/1.1\r\nHost: amber\r\nTransfer-Encoding: chunked\r\n\r\n10\r\n0123456789abcdef\r\n")
            .as_bytes(),
    )
    .await
    .unwrap();
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(60), c.read_to_end(&mut buf))
        .await
        .expect("the server cuts a stalled upload")
        .ok();
    assert!(
        !String::from_utf8_lossy(&buf).contains(" 202 "),
        "{:?}",
        String::from_utf8_lossy(&buf)
    );
    assert_eq!(offset(&s, &loc).await, "0-0");
    // Other clients were served all along, and the session still takes data.
    let r = client()
        .patch(s.url(&loc))
        .body(vec![4u8; 16])
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
}
