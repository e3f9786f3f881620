//! What each bad import request gets (`POST /amber/v1/imports`, `amber-registry import`),
//! and a whole-repository import from another amber registry: every tag, its source
//! recorded, nothing fetched twice. (The end-to-end cases, with distribution and token
//! auth upstreams and VMs, are runner/tests/upstream.rs.)

mod common;

use std::process::Command;

use common::*;

fn import_cli(local: &Server, args: &[&str]) -> std::process::Output {
    Command::new(workspace_bin("amber-registry"))
        .args(["import", "--registry", &local.url("")])
        .args(args)
        .env("DOCKER_CONFIG", "/nonexistent")
        .output()
        .unwrap()
}

/// The NDJSON events of an import request's answer.
async fn events(local: &Server, body: serde_json::Value) -> Vec<serde_json::Value> {
    let r = client()
        .post(local.url("/amber/v1/imports"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r.text()
        .await
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[tokio::test]
async fn bad_import_requests_get_clear_errors_and_a_repository_imports_whole() {
    let local = Server::start(&[]);
    let upstream = Server::start(&[]);

    // Not JSON, no sources, the wrong method: 400, 400, 405, each saying what is wrong.
    let r = client()
        .post(local.url("/amber/v1/imports"))
        .body("sources=x")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    assert!(r.text().await.unwrap().contains("not an ImportRequest"));
    let r = client()
        .post(local.url("/amber/v1/imports"))
        .json(&serde_json::json!({"sources": []}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    assert!(r.text().await.unwrap().contains("names no sources"));
    let r = client()
        .get(local.url("/amber/v1/imports"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 405);

    // Sources that cannot be imported fail one by one, each with its reason; the run
    // goes on and its summary counts them.
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let ev = events(
        &local,
        serde_json::json!({"sources": [
            "blake3:0000000000000000000000000000000000000000000000000000000000000000",
            "UPPER/case:v1",
            format!("{}/absent:v1", upstream.addr),
            format!("{closed}/x:v1"),
        ]}),
    )
    .await;
    let errors: Vec<String> = ev
        .iter()
        .filter(|e| e["event"] == "finished")
        .map(|e| e["error"].as_str().unwrap_or("").to_string())
        .collect();
    assert_eq!(errors.len(), 4, "{ev:?}");
    assert!(
        errors[0].contains("an env digest names no upstream image"),
        "{errors:?}"
    );
    assert!(
        errors[1].contains("is not an image reference amber can import"),
        "{errors:?}"
    );
    assert!(
        errors
            .iter()
            .any(|e| e.contains(&format!("manifest absent:v1 is not on {}", upstream.addr))),
        "{errors:?}"
    );
    assert!(
        errors.iter().any(|e| e.contains(&format!("from {closed}"))),
        "{errors:?}"
    );
    let summary = ev.last().unwrap();
    assert_eq!(summary["event"], "summary");
    assert_eq!(
        (
            summary["images_imported"].as_u64(),
            summary["images_failed"].as_u64()
        ),
        (Some(0), Some(4))
    );

    // The CLI: nothing to import, an unreadable list, a registry that is not there.
    let out = import_cli(&local, &[]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("nothing to import"));
    let out = import_cli(&local, &["--from-file", "/nonexistent/list"]);
    assert!(String::from_utf8_lossy(&out.stderr)
        .contains("reading the list of references /nonexistent/list"));
    let out = Command::new(workspace_bin("amber-registry"))
        .args(["import", "--registry", &format!("http://{closed}"), "x/y:z"])
        .env("DOCKER_CONFIG", "/nonexistent")
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr)
        .contains(&format!("POST http://{closed}/amber/v1/imports")));

    // A whole repository: every tag, from another amber registry.
    let m1 = image_manifest(&upstream, "team/task", "one", "").await;
    let m2 = image_manifest(&upstream, "team/task", "two", "").await;
    for (tag, m) in [("v1", &m1), ("v2", &m2)] {
        let r = put_manifest(
            &upstream,
            "team/task",
            tag,
            "application/vnd.oci.image.manifest.v1+json",
            m,
        )
        .await;
        assert_eq!(r.status(), 201);
    }
    let repo = format!("{}/team/task", upstream.addr);
    let out = import_cli(&local, &[&repo]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("2 images imported, 0 failed"), "{stdout}");
    let mirror = upstream.addr.replace(':', "-");
    let tags =
        get_json::<serde_json::Value>(&local, &format!("/v2/{mirror}/team/task/tags/list")).await;
    assert_eq!(tags["tags"], serde_json::json!(["v1", "v2"]));
    let v =
        get_json::<serde_json::Value>(&local, &format!("/amber/v1/resolve/{mirror}/team/task/v2"))
            .await;
    assert_eq!(v["source"]["reference"], format!("{repo}:v2"));
    assert_eq!(
        v["manifest_digest"],
        sha256(m2.as_bytes()),
        "stored byte for byte"
    );
    // Again: nothing is fetched.
    let out = import_cli(&local, &[&repo]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("0 blobs fetched (0 bytes)"), "{stdout}");
}
