//! Two registry replicas, each with its own RocksDB index, over one S3 bucket (moto, which
//! implements conditional writes): a push through one is pullable through the other at
//! once; eight clients moving one tag through both end with one winner both report; a
//! replica killed with SIGKILL mid-push loses nothing acknowledged; `reindex` rebuilds an
//! index that answers every query as the old one did; a replica killed in the middle of a
//! conversion and of an upload leaves both for the other replica to finish; two requests
//! racing to append at one offset through both never publish the loser's bytes; catalog and
//! tag-list pages cost one listing request each, and list in name order through the
//! other replica.

mod common;

use common::*;
use serde_json::Value;

const OCI: &str = "application/vnd.oci.image.manifest.v1+json";

fn replica(data: &std::path::Path, prefix: &str) -> Server {
    replica_with(data, prefix, &[])
}

fn replica_with(data: &std::path::Path, prefix: &str, extra: &[&str]) -> Server {
    let mut args = s3_args("moto", prefix);
    args.extend(extra.iter().map(|a| a.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Server::start_in(data, &args)
}

async fn get(s: &Server, path: &str, accept: &str) -> (u16, String, Vec<u8>) {
    let r = client()
        .get(s.url(path))
        .header("Accept", accept)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let ct = r
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    (status, ct, r.bytes().await.unwrap().to_vec())
}

async fn tag_of(s: &Server, repo: &str, tag: &str) -> String {
    let r = client()
        .head(s.url(&format!("/v2/{repo}/manifests/{tag}")))
        .header("Accept", OCI)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r.headers()["docker-content-digest"]
        .to_str()
        .unwrap()
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replicas_over_one_bucket_agree_and_reindex_rebuilds_the_index() {
    let prefix = format!("replicas-{}/", uuid::Uuid::new_v4());
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let mut a = replica(da.path(), &prefix);
    let b = replica(db.path(), &prefix);

    // A push through A is pullable by digest, and by tag, through B at once.
    let m = image_manifest(&a, "team/app", "first", "").await;
    let r = put_manifest(&a, "team/app", "v1", OCI, &m).await;
    assert_eq!(r.status(), 201);
    let first = sha256(m.as_bytes());
    let (status, ct, body) = get(&b, &format!("/v2/team/app/manifests/{first}"), OCI).await;
    assert_eq!(
        (status, ct.as_str(), body),
        (200, OCI, m.as_bytes().to_vec())
    );
    assert_eq!(tag_of(&b, "team/app", "v1").await, first);
    let v: Value = serde_json::from_str(&m).unwrap();
    let layer = v["layers"][0]["digest"].as_str().unwrap();
    let (status, _, body) = get(&b, &format!("/v2/team/app/blobs/{layer}"), "*/*").await;
    assert_eq!((status, body), (200, b"layer bytes of first".to_vec()));
    // B can mount A's blob into another repository.
    let r = client()
        .post(b.url(&format!(
            "/v2/team/other/blobs/uploads/?mount={layer}&from=team/app"
        )))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);

    // Eight clients move one tag through both replicas at once: every push succeeds and
    // both replicas then report the same winner, one of the eight.
    let mut manifests = Vec::new();
    for i in 0..8 {
        let via = if i % 2 == 0 { &a } else { &b };
        manifests.push(image_manifest(via, "team/app", &format!("racer-{i}"), "").await);
    }
    let pushes = manifests.iter().enumerate().map(|(i, m)| {
        let via = if i % 2 == 0 { &a } else { &b };
        put_manifest(via, "team/app", "latest", OCI, m)
    });
    for r in futures_util::future::join_all(pushes).await {
        assert_eq!(r.status(), 201, "{}", r.text().await.unwrap());
    }
    let (wa, wb) = (
        tag_of(&a, "team/app", "latest").await,
        tag_of(&b, "team/app", "latest").await,
    );
    assert_eq!(wa, wb);
    assert!(manifests.iter().any(|m| sha256(m.as_bytes()) == wa));

    // An artifact with a subject, pushed through B, is a referrer through A.
    let art = image_manifest(
        &b,
        "team/app",
        "sbom",
        &format!(r#","artifactType":"application/example.sbom","subject":{{"mediaType":"{OCI}","digest":"{first}","size":{}}}"#, m.len()),
    )
    .await;
    assert_eq!(
        put_manifest(&b, "team/app", &sha256(art.as_bytes()), OCI, &art)
            .await
            .status(),
        201
    );
    let (status, _, body) = get(&a, &format!("/v2/team/app/referrers/{first}"), "*/*").await;
    assert_eq!(status, 200);
    let refs: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(
        refs["manifests"][0]["digest"],
        sha256(art.as_bytes()).as_str(),
        "{refs}"
    );

    // SIGKILL of A in the middle of a streamed upload: what was acknowledged stays.
    let r = client()
        .post(a.url("/v2/team/app/blobs/uploads/"))
        .send()
        .await
        .unwrap();
    let location = r.headers()["location"].to_str().unwrap().to_string();
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Vec<u8>, std::io::Error>>(1);
    let url = if location.starts_with('/') {
        a.url(&location)
    } else {
        location
    };
    let patch = tokio::spawn(
        client()
            .patch(url)
            .body(reqwest::Body::wrap_stream(tokio_stream_from(rx)))
            .send(),
    );
    tx.send(Ok(vec![1u8; 4 << 20])).await.unwrap();
    tx.send(Ok(vec![2u8; 4 << 20])).await.unwrap();
    a.kill9();
    drop(tx);
    let _ = patch.await;
    assert_eq!(
        get(&b, &format!("/v2/team/app/manifests/{first}"), OCI)
            .await
            .0,
        200
    );
    assert_eq!(tag_of(&b, "team/app", "latest").await, wa);
    let a = replica(da.path(), &prefix);
    assert_eq!(tag_of(&a, "team/app", "latest").await, wa);

    // A repository whose name extends another's: the reindex's walk finds it inside
    // team/app's part of the bucket.
    let m = image_manifest(&a, "team/app/web", "nested", "").await;
    let r = put_manifest(&a, "team/app/web", "v1", OCI, &m).await;
    assert_eq!(r.status(), 201);

    // reindex: a fresh data dir over the same bucket answers every query as B does.
    let queries = vec![
        ("/v2/_catalog".to_string(), "*/*"),
        ("/v2/team/app/web/tags/list".to_string(), "*/*"),
        ("/v2/team/app/web/manifests/v1".to_string(), OCI),
        ("/v2/team/app/tags/list".to_string(), "*/*"),
        ("/v2/team/app/manifests/v1".to_string(), OCI),
        ("/v2/team/app/manifests/latest".to_string(), OCI),
        (format!("/v2/team/app/manifests/{first}"), OCI),
        (format!("/v2/team/app/blobs/{layer}"), "*/*"),
        (format!("/v2/team/other/blobs/{layer}"), "*/*"),
        (format!("/v2/team/app/referrers/{first}"), "*/*"),
        (format!("/amber/v1/resolve/team/app/{first}"), "*/*"),
    ];
    // B learns everything the bucket holds by reading through: its answers are the
    // reference (B saw half of the pushes itself).
    let mut before = Vec::new();
    for (q, accept) in &queries {
        before.push(get(&b, q, accept).await);
    }
    let text = |i: usize| String::from_utf8_lossy(&before[i].2).into_owned();
    assert_eq!(
        text(0),
        r#"{"repositories":["team/app","team/app/web","team/other"]}"#
    );
    assert_eq!(text(1), r#"{"name":"team/app/web","tags":["v1"]}"#);
    assert_eq!(before[2].0, 200);
    assert_eq!(text(3), r#"{"name":"team/app","tags":["latest","v1"]}"#);
    assert!(text(9).contains(&sha256(art.as_bytes())), "{}", text(9));
    assert!(text(10).contains(r#""state":"failed""#), "{}", text(10));
    let dc = tempfile::tempdir().unwrap();
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_amber-registry"));
    cmd.arg("reindex")
        .arg("--data")
        .arg(dc.path())
        .args(s3_args("moto", &prefix));
    let out = run(&mut cmd);
    // What the reindex cost in S3 requests, then what it found.
    let (cost, found) = out.trim().split_once('\n').unwrap_or(("", &out));
    assert!(cost.starts_with("S3 requests: "), "{out}");
    assert!(found.starts_with("reindexed "), "{out}");
    let c = replica(dc.path(), &prefix);
    for ((q, accept), want) in queries.iter().zip(&before) {
        let got = get(&c, q, accept).await;
        assert_eq!(
            &got,
            want,
            "{q}: reindexed {:?} vs {:?}",
            String::from_utf8_lossy(&got.2),
            String::from_utf8_lossy(&want.2)
        );
    }
    drop(a);
}

async fn resolve(s: &Server, repo: &str, reference: &str) -> Value {
    get_json(s, &format!("/amber/v1/resolve/{repo}/{reference}")).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_killed_mid_conversion_and_mid_upload_leaves_both_to_the_other() {
    let prefix = format!("takeover-{}/", uuid::Uuid::new_v4());
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    // Short leases, so the takeover happens within seconds.
    let lease = ["--conversion-lease-secs", "2"];
    let mut a = replica_with(da.path(), &prefix, &lease);
    let b = replica_with(db.path(), &prefix, &lease);

    // An upload started through A, its first chunk acknowledged by A.
    let location = start_upload(&a, "team/big").await;
    let blob = incompressible(3 << 20, 7);
    let half = blob.len() / 2;
    let r = client()
        .patch(a.url(&location))
        .header("Content-Range", format!("0-{}", half - 1))
        .body(blob[..half].to_vec())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    assert_eq!(r.headers()["range"], format!("0-{}", half - 1).as_str());

    // An image whose conversion takes seconds (96 MiB of file data no compressor
    // shrinks, as an uncompressed layer), pushed through A.
    let layer = Layer::new()
        .file("data/big.bin", 0o644, &incompressible(96 << 20, 11))
        .tar();
    let config =
        r#"{"architecture":"amd64","os":"linux","rootfs":{"type":"layers","diff_ids":[]}}"#;
    let cd = push_blob(&a, "team/big", config.as_bytes()).await;
    let ld = push_blob(&a, "team/big", &layer).await;
    let manifest = format!(
        r#"{{"schemaVersion":2,"mediaType":"{OCI}","config":{{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"{cd}","size":{}}},"layers":[{{"mediaType":"application/vnd.oci.image.layer.v1.tar","digest":"{ld}","size":{}}}]}}"#,
        config.len(),
        layer.len()
    );
    assert_eq!(
        put_manifest(&a, "team/big", "v1", OCI, &manifest)
            .await
            .status(),
        201
    );

    // SIGKILL of A as soon as it reports the conversion running.
    let mut seen = Vec::new();
    loop {
        let state = resolve(&a, "team/big", "v1").await["state"].clone();
        if seen.last() != Some(&state) {
            seen.push(state.clone());
        }
        if state == "running" {
            break;
        }
        assert!(
            state == "queued",
            "conversion went {seen:?} before A was killed"
        );
        tokio::task::yield_now().await;
    }
    a.kill9();
    let v = resolve(&b, "team/big", "v1").await;
    assert_ne!(v["state"], "done", "A was killed before it finished: {v}");

    // B finishes the upload from the offset A acknowledged.
    let r = client().get(b.url(&location)).send().await.unwrap();
    assert_eq!(r.status(), 204);
    assert_eq!(r.headers()["range"], format!("0-{}", half - 1).as_str());
    let digest = sha256(&blob);
    let r = client()
        .patch(b.url(&location))
        .header("Content-Range", format!("{half}-{}", blob.len() - 1))
        .body(blob[half..].to_vec())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    let sep = if location.contains('?') { '&' } else { '?' };
    let r = client()
        .put(b.url(&format!("{location}{sep}digest={digest}")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201, "{}", r.text().await.unwrap());
    assert_eq!(
        get(&b, &format!("/v2/team/big/blobs/{digest}"), "*/*")
            .await
            .2,
        blob
    );

    // B takes the conversion over once A's lease runs out, and finishes it.
    let v = settled(&b, "team/big", "v1").await;
    assert_eq!(v["state"], "done", "{v}");
    let env = v["env_digest"].as_str().unwrap().to_string();
    assert_eq!(
        metric(
            &metrics_text(&b).await,
            "amber_conversions_taken_over_total"
        ),
        1
    );
    let (status, _, _) = get(&b, &format!("/amber/v1/envs/{env}"), "*/*").await;
    assert_eq!(status, 200);

    // A, restarted, reports the env B made and serves the blob B completed.
    let a = replica_with(da.path(), &prefix, &lease);
    assert_eq!(
        resolve(&a, "team/big", "v1").await["env_digest"],
        env.as_str()
    );
    assert_eq!(
        get(&a, &format!("/v2/team/big/blobs/{digest}"), "*/*")
            .await
            .2,
        blob
    );
}

/// Two requests appending different bytes at one offset of one session at once, through
/// two replicas: the one acknowledged first is the upload. The other's bytes land after it
/// (before the blob is published, and, in a second session, after), its request fails,
/// and the blob published under the first one's digest holds the first one's bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn racing_appends_through_two_replicas_never_publish_the_losers_bytes() {
    let prefix = format!("race-{}/", uuid::Uuid::new_v4());
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let a = replica(da.path(), &prefix);
    let b = replica(db.path(), &prefix);
    for (round, lands_after_publish) in [(0u64, false), (1, true)] {
        let ours = incompressible(256 << 10, 20 + round);
        let theirs = incompressible(256 << 10, 40 + round);
        let digest = sha256(&ours);
        let location = start_upload(&a, "team/race").await;

        // B's request has read the session (offset 0) and is receiving its body.
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Vec<u8>, std::io::Error>>(1);
        let loser = tokio::spawn(
            client()
                .patch(b.url(&location))
                .body(reqwest::Body::wrap_stream(tokio_stream_from(rx)))
                .send(),
        );
        tx.send(Ok(theirs[..1024].to_vec())).await.unwrap();
        while metric(&metrics_text(&b).await, "amber_uploads_in_flight") != 1 {
            tokio::task::yield_now().await;
        }

        // A's request at the same offset is acknowledged first.
        let r = client()
            .patch(a.url(&location))
            .header("Content-Range", format!("0-{}", ours.len() - 1))
            .body(ours.clone())
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 202);
        let sep = if location.contains('?') { '&' } else { '?' };
        let finish = || {
            client()
                .put(a.url(&format!("{location}{sep}digest={digest}")))
                .send()
        };
        if lands_after_publish {
            assert_eq!(finish().await.unwrap().status(), 201);
        }

        // B's bytes land now; its request is not acknowledged.
        tx.send(Ok(theirs[1024..].to_vec())).await.unwrap();
        drop(tx);
        let r = loser.await.unwrap().unwrap();
        let status = r.status();
        let body = r.text().await.unwrap();
        assert_eq!(status, 400, "{body}");
        assert!(
            body.contains("BLOB_UPLOAD_INVALID") && body.contains("at the same time"),
            "{body}"
        );

        if !lands_after_publish {
            let r = client().get(b.url(&location)).send().await.unwrap();
            assert_eq!(r.status(), 204);
            assert_eq!(
                r.headers()["range"],
                format!("0-{}", ours.len() - 1).as_str()
            );
            // A completes with the running hash it kept of the bytes it acknowledged.
            let r = finish().await.unwrap();
            assert_eq!(r.status(), 201, "{}", r.text().await.unwrap());
        }
        for s in [&a, &b] {
            let (status, _, got) = get(s, &format!("/v2/team/race/blobs/{digest}"), "*/*").await;
            assert_eq!(status, 200);
            assert!(
                got == ours,
                "round {round}: the blob holds bytes that are not its digest's"
            );
        }
    }
}

/// A channel as a request body stream.
fn tokio_stream_from(
    rx: tokio::sync::mpsc::Receiver<Result<Vec<u8>, std::io::Error>>,
) -> impl futures_util::Stream<Item = Result<Vec<u8>, std::io::Error>> {
    futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|v| (v, rx)) })
}

/// Pages of `path` (`key` holds each page's names) read through `s` with n=2, with the
/// S3 listing requests each page cost.
async fn pages_of(s: &Server, path: &str, key: &str) -> (Vec<String>, Vec<f64>) {
    let lists = || async {
        metrics_text(s)
            .await
            .lines()
            .filter(|l| {
                l.starts_with("amber_s3_requests_total{") && l.contains("op=\"ListObjectsV2\"")
            })
            .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
            .sum::<f64>()
    };
    let (mut seen, mut costs, mut last) = (Vec::new(), Vec::new(), None::<String>);
    loop {
        let url = match &last {
            Some(l) => format!("{path}?n=2&last={l}"),
            None => format!("{path}?n=2"),
        };
        let before = lists().await;
        let r = client().get(s.url(&url)).send().await.unwrap();
        assert_eq!(r.status(), 200, "{url}");
        let more = r.headers().get("link").is_some();
        let v: Value = r.json().await.unwrap();
        costs.push(lists().await - before);
        let page: Vec<String> = v[key]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r.as_str().unwrap().to_string())
            .collect();
        seen.extend(page.clone());
        if !more {
            return (seen, costs);
        }
        last = page.last().cloned();
    }
}

/// Over a shared bucket a catalog or tag-list page reads only its own range of the
/// store's records (one listing request, however many repositories or tags there are):
/// repositories pushed through one replica, names inside other names included, and
/// their tags, page through the other in name order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_catalog_and_tags_page_through_the_other_replica_one_listing_per_page() {
    let prefix = format!("catalog-{}/", uuid::Uuid::new_v4());
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    // Long leases: no background sweep lists the bucket while the requests are counted.
    let a = replica(da.path(), &prefix);
    let b = replica_with(db.path(), &prefix, &["--conversion-lease-secs", "3600"]);
    // `cat/a/b` needs `cat/a` to be a directory on a file-backed store (s3s-fs, fs).
    for repo in ["cat/a", "cat/a/b", "cat/c", "cat/a-b", "cat/b"] {
        push_blob(&a, repo, repo.as_bytes()).await;
    }
    let m = image_manifest(&a, "cat/c", "tags", "").await;
    for t in ["v3", "v1", "v5", "v2", "v4"] {
        assert_eq!(put_manifest(&a, "cat/c", t, OCI, &m).await.status(), 201);
    }
    let (seen, costs) = pages_of(&b, "/v2/_catalog", "repositories").await;
    assert!(
        costs.iter().all(|&c| c == 1.0),
        "listings per page: {costs:?}"
    );
    assert_eq!(seen, ["cat/a", "cat/a-b", "cat/a/b", "cat/b", "cat/c"]);
    let (tags, costs) = pages_of(&b, "/v2/cat/c/tags/list", "tags").await;
    assert_eq!(tags, ["v1", "v2", "v3", "v4", "v5"]);
    assert!(
        costs.iter().all(|&c| c == 1.0),
        "listings per page: {costs:?}"
    );
}
