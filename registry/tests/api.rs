//! The OCI Distribution API, endpoint by endpoint, against the real binary.

mod common;

use common::*;
use futures_util::stream;

const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
const DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
const DOCKER_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";

fn h<'a>(r: &'a reqwest::Response, name: &str) -> &'a str {
    r.headers()
        .get(name)
        .unwrap_or_else(|| panic!("header {name} missing"))
        .to_str()
        .unwrap()
}

#[tokio::test]
async fn base_endpoint_announces_the_api_version() {
    let s = Server::start(&[]);
    let r = client().get(s.url("/v2/")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(h(&r, "docker-distribution-api-version"), "registry/2.0");
}

#[tokio::test]
async fn blob_head_get_and_ranges() {
    let s = Server::start(&[]);
    let data = b"0123456789abcdef";
    let d = push_blob(&s, "r/a", data).await;
    let c = client();
    let url = s.url(&format!("/v2/r/a/blobs/{d}"));
    let r = c.head(&url).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(h(&r, "content-length"), "16");
    assert_eq!(h(&r, "docker-content-digest"), d);
    let r = c.get(&url).send().await.unwrap();
    assert_eq!(&r.bytes().await.unwrap()[..], data);

    let r = c
        .get(&url)
        .header("Range", "bytes=2-5")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 206);
    assert_eq!(h(&r, "content-range"), "bytes 2-5/16");
    assert_eq!(&r.bytes().await.unwrap()[..], b"2345");
    let r = c
        .get(&url)
        .header("Range", "bytes=-3")
        .send()
        .await
        .unwrap();
    assert_eq!(&r.bytes().await.unwrap()[..], b"def");
    let r = c
        .get(&url)
        .header("Range", "bytes=10-")
        .send()
        .await
        .unwrap();
    assert_eq!(&r.bytes().await.unwrap()[..], b"abcdef");

    // Unsatisfiable and malformed ranges get 416 with the size.
    for bad in ["bytes=16-", "bytes=100-200", "bytes=9-3", "pages=1-2"] {
        let r = c.get(&url).header("Range", bad).send().await.unwrap();
        assert_eq!(r.status(), 416, "{bad}");
        assert_eq!(h(&r, "content-range"), "bytes */16");
    }
    // The blob is not visible from another repository.
    let r = c
        .get(s.url(&format!("/v2/r/other/blobs/{d}")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    assert_eq!(error_code(r).await, "BLOB_UNKNOWN");
}

#[tokio::test]
async fn chunked_upload_with_content_range_and_out_of_order_chunk() {
    let s = Server::start(&[]);
    let c = client();
    let r = c
        .post(s.url("/v2/r/chunked/blobs/uploads/"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    let loc = h(&r, "location").to_string();
    assert!(loc.starts_with("/v2/r/chunked/blobs/uploads/"));
    assert_eq!(h(&r, "range"), "0-0");
    assert!(!h(&r, "docker-upload-uuid").is_empty());

    let r = c
        .patch(s.url(&loc))
        .header("Content-Range", "0-4")
        .header("Content-Type", "application/octet-stream")
        .body("hello")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    assert_eq!(h(&r, "range"), "0-4");
    // Out of order: starts at 10 while the upload has 5 bytes.
    let r = c
        .patch(s.url(&loc))
        .header("Content-Range", "10-14")
        .body("xxxxx")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 416);
    assert_eq!(h(&r, "range"), "0-4");
    // Content-Range and body disagree.
    let r = c
        .patch(s.url(&loc))
        .header("Content-Range", "5-9")
        .body("ab")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    assert_eq!(error_code(r).await, "BLOB_UPLOAD_INVALID");

    let r = c.get(s.url(&loc)).send().await.unwrap();
    assert_eq!(r.status(), 204);
    assert_eq!(h(&r, "range"), "0-4");

    let r = c
        .patch(s.url(&loc))
        .header("Content-Range", "bytes=5-10")
        .body(" world")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    assert_eq!(h(&r, "range"), "0-10");
    let d = sha256(b"hello world!");
    // The final chunk rides on the PUT.
    let r = c
        .put(s.url(&format!("{loc}?digest={d}")))
        .body("!")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    assert_eq!(h(&r, "location"), format!("/v2/r/chunked/blobs/{d}"));
    assert_eq!(h(&r, "docker-content-digest"), d);
    let got = c
        .get(s.url(&format!("/v2/r/chunked/blobs/{d}")))
        .send()
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    assert_eq!(&got[..], b"hello world!");
    // The session is gone once finished.
    let r = c.get(s.url(&loc)).send().await.unwrap();
    assert_eq!(r.status(), 404);
    assert_eq!(error_code(r).await, "BLOB_UPLOAD_UNKNOWN");
}

#[tokio::test]
async fn streamed_patch_without_content_range_as_docker_sends_it() {
    let s = Server::start(&[]);
    let c = client();
    let r = c
        .post(s.url("/v2/r/streamed/blobs/uploads/"))
        .send()
        .await
        .unwrap();
    let loc = h(&r, "location").to_string();
    let parts: Vec<Result<Vec<u8>, std::io::Error>> =
        (0..64).map(|i| Ok(vec![i as u8; 65536])).collect();
    let all: Vec<u8> = (0..64).flat_map(|i| vec![i as u8; 65536]).collect();
    // A streamed body is sent with Transfer-Encoding: chunked and no Content-Length.
    let r = c
        .patch(s.url(&loc))
        .body(reqwest::Body::wrap_stream(stream::iter(parts)))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    assert_eq!(h(&r, "range"), format!("0-{}", all.len() - 1));
    let d = sha256(&all);
    let r = c
        .put(s.url(&format!("{loc}?digest={d}")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let r = c
        .head(s.url(&format!("/v2/r/streamed/blobs/{d}")))
        .send()
        .await
        .unwrap();
    assert_eq!(h(&r, "content-length"), all.len().to_string());
}

#[tokio::test]
async fn wrong_or_missing_digest_is_refused_and_nothing_is_published() {
    let s = Server::start(&[]);
    let c = client();
    let wrong = sha256(b"something else");
    let r = c
        .post(s.url(&format!("/v2/r/d/blobs/uploads/?digest={wrong}")))
        .body("data")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    assert_eq!(error_code(r).await, "DIGEST_INVALID");
    let r = c
        .head(s.url(&format!("/v2/r/d/blobs/{wrong}")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let r = c
        .post(s.url("/v2/r/d/blobs/uploads/"))
        .send()
        .await
        .unwrap();
    let loc = h(&r, "location").to_string();
    let r = c.put(s.url(&loc)).body("x").send().await.unwrap();
    assert_eq!(r.status(), 400, "PUT without ?digest=");
    assert_eq!(error_code(r).await, "DIGEST_INVALID");
    let r = c
        .put(s.url(&format!("{loc}?digest=sha256:nothex")))
        .send()
        .await
        .unwrap();
    assert_eq!(error_code(r).await, "DIGEST_INVALID");
    let r = c
        .put(s.url(&format!("{loc}?digest=md5:abcd")))
        .send()
        .await
        .unwrap();
    assert_eq!(error_code(r).await, "DIGEST_INVALID");
}

#[tokio::test]
async fn sha512_blobs_and_manifests() {
    let s = Server::start(&[]);
    let c = client();
    let data = b"sha512 content";
    let d = sha512(data);
    let r = c
        .post(s.url(&format!("/v2/r/s512/blobs/uploads/?digest={d}")))
        .body(data.to_vec())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let r = c
        .get(s.url(&format!("/v2/r/s512/blobs/{d}")))
        .send()
        .await
        .unwrap();
    assert_eq!(h(&r, "docker-content-digest"), d);
    assert_eq!(&r.bytes().await.unwrap()[..], data);

    let m = image_manifest(&s, "r/s512", "512", "").await;
    let md = sha512(m.as_bytes());
    let r = put_manifest(&s, "r/s512", &md, OCI_MANIFEST, &m).await;
    assert_eq!(r.status(), 201);
    assert_eq!(h(&r, "docker-content-digest"), md);
    let r = c
        .get(s.url(&format!("/v2/r/s512/manifests/{md}")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.text().await.unwrap(), m);
}

#[tokio::test]
async fn cross_repository_mount_or_fallback_to_a_session() {
    let s = Server::start(&[]);
    let c = client();
    let d = push_blob(&s, "src/repo", b"shared layer").await;
    let r = c
        .post(s.url(&format!(
            "/v2/dst/repo/blobs/uploads/?mount={d}&from=src/repo"
        )))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    assert_eq!(h(&r, "location"), format!("/v2/dst/repo/blobs/{d}"));
    let r = c
        .get(s.url(&format!("/v2/dst/repo/blobs/{d}")))
        .send()
        .await
        .unwrap();
    assert_eq!(&r.bytes().await.unwrap()[..], b"shared layer");
    // Source does not have it: 202 with a new session.
    let missing = sha256(b"nope");
    let r = c
        .post(s.url(&format!(
            "/v2/dst/repo/blobs/uploads/?mount={missing}&from=src/repo"
        )))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    assert!(h(&r, "location").starts_with("/v2/dst/repo/blobs/uploads/"));
    // Without `from`: a session too.
    let r = c
        .post(s.url(&format!("/v2/dst/other/blobs/uploads/?mount={d}")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    let r = c
        .post(s.url(&format!(
            "/v2/dst/repo/blobs/uploads/?mount={d}&from=Bad..Name"
        )))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    assert_eq!(error_code(r).await, "NAME_INVALID");
}

#[tokio::test]
async fn cancelled_upload_is_gone() {
    let s = Server::start(&[]);
    let c = client();
    let r = c
        .post(s.url("/v2/r/c/blobs/uploads/"))
        .send()
        .await
        .unwrap();
    let loc = h(&r, "location").to_string();
    c.patch(s.url(&loc)).body("partial").send().await.unwrap();
    let r = c.delete(s.url(&loc)).send().await.unwrap();
    assert_eq!(r.status(), 204);
    for r in [
        c.get(s.url(&loc)).send().await.unwrap(),
        c.patch(s.url(&loc)).body("more").send().await.unwrap(),
        c.delete(s.url(&loc)).send().await.unwrap(),
    ] {
        assert_eq!(r.status(), 404);
        assert_eq!(error_code(r).await, "BLOB_UPLOAD_UNKNOWN");
    }
    // A session of another repository is not reachable through this one.
    let r = c
        .post(s.url("/v2/r/c/blobs/uploads/"))
        .send()
        .await
        .unwrap();
    let id = h(&r, "docker-upload-uuid").to_string();
    let r = c
        .get(s.url(&format!("/v2/r/other/blobs/uploads/{id}")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let staging = std::fs::read_dir(s.data.join("store/_staging"))
        .unwrap()
        .count();
    assert_eq!(staging, 0, "cancelled and empty sessions hold no data");
    // A session a registry before named segments left mid-upload (bytes acknowledged,
    // none named): unknown, so the client starts again, rather than read by guesswork.
    // Written as that registry kept records (a file each), imported at the restart.
    let old = uuid::Uuid::new_v4();
    let file = s.data.join(format!("store/_records/uploads/{old}"));
    std::fs::create_dir_all(file.parent().unwrap()).unwrap();
    std::fs::write(
        &file,
        r#"{"repo":"r/c","offset":7,"created_unix":1,"updated_unix":1}"#,
    )
    .unwrap();
    let s = s.restart();
    assert!(!file.exists(), "imported into the records database");
    // A new client: the old one's pooled connections went with the old process.
    let c = client();
    let loc = format!("/v2/r/c/blobs/uploads/{old}");
    for r in [
        c.get(s.url(&loc)).send().await.unwrap(),
        c.patch(s.url(&loc)).body("more").send().await.unwrap(),
    ] {
        assert_eq!(r.status(), 404);
        assert_eq!(error_code(r).await, "BLOB_UPLOAD_UNKNOWN");
    }
}

#[tokio::test]
async fn manifests_round_trip_exact_bytes_for_all_four_media_types() {
    let s = Server::start(&[]);
    let c = client();
    // Odd whitespace: the registry must return exactly what was pushed.
    let m = image_manifest(&s, "m/x", "one", "")
        .await
        .replace(",\"layers\"", ",\n  \"layers\"");
    let r = put_manifest(&s, "m/x", "v1", OCI_MANIFEST, &m).await;
    assert_eq!(r.status(), 201);
    let d = h(&r, "docker-content-digest").to_string();
    assert_eq!(d, sha256(m.as_bytes()));
    assert_eq!(h(&r, "location"), format!("/v2/m/x/manifests/{d}"));
    for reference in ["v1", d.as_str()] {
        let r = c
            .get(s.url(&format!("/v2/m/x/manifests/{reference}")))
            .header("Accept", OCI_MANIFEST)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(h(&r, "content-type"), OCI_MANIFEST);
        assert_eq!(h(&r, "docker-content-digest"), d);
        assert_eq!(r.text().await.unwrap(), m);
        let r = c
            .head(s.url(&format!("/v2/m/x/manifests/{reference}")))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(h(&r, "content-length"), m.len().to_string());
    }
    // Docker schema 2 manifest.
    let dm = image_manifest(&s, "m/x", "two", "")
        .await
        .replace(OCI_MANIFEST, DOCKER_MANIFEST);
    let r = put_manifest(&s, "m/x", "docker", DOCKER_MANIFEST, &dm).await;
    assert_eq!(r.status(), 201);
    let dd = h(&r, "docker-content-digest").to_string();
    let r = c
        .get(s.url("/v2/m/x/manifests/docker"))
        .send()
        .await
        .unwrap();
    assert_eq!(h(&r, "content-type"), DOCKER_MANIFEST);
    assert_eq!(r.text().await.unwrap(), dm);
    // OCI index and Docker manifest list over them.
    for (mt, child_mt, tag) in [
        (OCI_INDEX, OCI_MANIFEST, "index"),
        (DOCKER_LIST, DOCKER_MANIFEST, "list"),
    ] {
        let (cd, cs) = if child_mt == OCI_MANIFEST {
            (&d, m.len())
        } else {
            (&dd, dm.len())
        };
        let idx = format!(
            r#"{{"schemaVersion":2,"mediaType":"{mt}","manifests":[{{"mediaType":"{child_mt}","digest":"{cd}","size":{cs},"platform":{{"architecture":"amd64","os":"linux"}}}}]}}"#
        );
        let r = put_manifest(&s, "m/x", tag, mt, &idx).await;
        assert_eq!(r.status(), 201, "{mt}");
        let r = c
            .get(s.url(&format!("/v2/m/x/manifests/{tag}")))
            .send()
            .await
            .unwrap();
        assert_eq!(h(&r, "content-type"), mt);
        assert_eq!(r.text().await.unwrap(), idx);
    }
    // Identical content pushed again is accepted.
    let r = put_manifest(&s, "m/x", "v1", OCI_MANIFEST, &m).await;
    assert_eq!(r.status(), 201);
    // Unknown references.
    let r = c.get(s.url("/v2/m/x/manifests/nope")).send().await.unwrap();
    assert_eq!(r.status(), 404);
    assert_eq!(error_code(r).await, "MANIFEST_UNKNOWN");
    let r = c
        .get(s.url(&format!("/v2/m/other/manifests/{d}")))
        .send()
        .await
        .unwrap();
    assert_eq!(
        r.status(),
        404,
        "a manifest is only visible in the repository it was pushed to"
    );
}

/// A GET by tag answers from the manifest's bytes with the media type they declare; bytes
/// that declare none are answered with what each repository's record says, which can
/// differ between repositories for the same bytes (the Content-Type each push sent).
#[tokio::test]
async fn media_type_by_tag_is_the_declared_one_or_each_repository_s_own() {
    let s = Server::start(&[]);
    let c = client();
    let declared = format!("\"mediaType\":\"{OCI_MANIFEST}\",");
    let mut bytes = String::new();
    for (repo, content_type) in [("u/oci", OCI_MANIFEST), ("u/docker", DOCKER_MANIFEST)] {
        let m = image_manifest(&s, repo, "undeclared", "").await;
        let m = m.replace(&declared, "");
        assert!(
            !m.contains(OCI_MANIFEST) && !m.contains(DOCKER_MANIFEST),
            "{m}"
        );
        bytes = m;
        let r = put_manifest(&s, repo, "t", content_type, &bytes).await;
        assert_eq!(r.status(), 201, "{repo}");
    }
    for (repo, content_type) in [("u/oci", OCI_MANIFEST), ("u/docker", DOCKER_MANIFEST)] {
        // Twice, after the other repository's reads too: each answer is this repository's
        // record, never a media type kept from a read of the same bytes elsewhere.
        for _ in 0..2 {
            let r = c
                .get(s.url(&format!("/v2/{repo}/manifests/t")))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            assert_eq!(h(&r, "content-type"), content_type, "{repo}");
            assert_eq!(h(&r, "content-length"), bytes.len().to_string());
            assert_eq!(r.text().await.unwrap(), bytes);
        }
        let r = c
            .head(s.url(&format!("/v2/{repo}/manifests/t")))
            .send()
            .await
            .unwrap();
        assert_eq!(h(&r, "content-type"), content_type, "{repo}");
        assert_eq!(h(&r, "content-length"), bytes.len().to_string());
    }
    // Declared: HEAD and GET by tag agree with the push, from memory and with it off.
    for budget in ["67108864", "0"] {
        let s = Server::start(&["--manifest-cache-bytes", budget]);
        let m = image_manifest(&s, "d/x", "declared", "").await;
        let r = put_manifest(&s, "d/x", "t", "application/json", &m).await;
        assert_eq!(r.status(), 201);
        for head in [false, true] {
            let url = s.url("/v2/d/x/manifests/t");
            let r = if head { c.head(url) } else { c.get(url) }
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            assert_eq!(h(&r, "content-type"), OCI_MANIFEST, "budget {budget}");
            assert_eq!(h(&r, "content-length"), m.len().to_string());
            assert_eq!(h(&r, "docker-content-digest"), sha256(m.as_bytes()));
            let body = r.text().await.unwrap();
            assert_eq!(body, if head { "" } else { m.as_str() });
        }
    }
}

#[tokio::test]
async fn bad_manifests_get_4xx_with_the_spec_codes() {
    let s = Server::start(&[]);
    let m = image_manifest(&s, "m/bad", "b", "").await;
    let missing = sha256(b"never pushed");
    let cases: Vec<(String, &str, &str, u16, &str)> = vec![
        (
            "{not json".into(),
            OCI_MANIFEST,
            "t",
            400,
            "MANIFEST_INVALID",
        ),
        (
            r#"{"schemaVersion":1,"name":"x"}"#.into(),
            "application/vnd.docker.distribution.manifest.v1+prettyjws",
            "t",
            400,
            "MANIFEST_INVALID",
        ),
        (m.clone(), DOCKER_MANIFEST, "t", 400, "MANIFEST_INVALID"),
        (
            m.replace("\"size\":", "\"size\":1"),
            OCI_MANIFEST,
            "t",
            400,
            "MANIFEST_INVALID",
        ),
        (m.clone(), OCI_MANIFEST, &missing, 400, "DIGEST_INVALID"),
        (m.clone(), OCI_MANIFEST, "bad:tag", 400, "DIGEST_INVALID"),
        (m.clone(), OCI_MANIFEST, ".badtag", 400, "MANIFEST_INVALID"),
        (
            format!(
                r#"{{"schemaVersion":2,"mediaType":"{OCI_MANIFEST}","config":{{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"{missing}","size":3}},"layers":[]}}"#
            ),
            OCI_MANIFEST,
            "t",
            400,
            "MANIFEST_BLOB_UNKNOWN",
        ),
        (
            format!(
                r#"{{"schemaVersion":2,"mediaType":"{OCI_INDEX}","manifests":[{{"mediaType":"{OCI_MANIFEST}","digest":"{missing}","size":3}}]}}"#
            ),
            OCI_INDEX,
            "t",
            400,
            "MANIFEST_BLOB_UNKNOWN",
        ),
    ];
    for (body, mt, reference, status, code) in cases {
        let r = put_manifest(&s, "m/bad", reference, mt, &body).await;
        assert_eq!(r.status().as_u16(), status, "{reference} {body}");
        assert_eq!(error_code(r).await, code, "{body}");
    }
    // Larger than 4 MiB.
    let big = format!(
        r#"{{"schemaVersion":2,"pad":"{}"}}"#,
        "x".repeat(4 * 1024 * 1024)
    );
    let r = put_manifest(&s, "m/bad", "big", OCI_MANIFEST, &big).await;
    assert_eq!(r.status(), 413);
    assert_eq!(error_code(r).await, "MANIFEST_INVALID");
    // Nothing above was stored.
    let r = client()
        .get(s.url("/v2/m/bad/tags/list"))
        .send()
        .await
        .unwrap();
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["tags"], serde_json::json!([]));
}

#[tokio::test]
async fn non_distributable_layers_are_accepted_without_their_bytes() {
    let s = Server::start(&[]);
    let cfg = push_blob(&s, "m/nd", br#"{"os":"windows"}"#).await;
    let foreign = sha256(b"foreign layer not here");
    let m = format!(
        r#"{{"schemaVersion":2,"mediaType":"{DOCKER_MANIFEST}","config":{{"mediaType":"application/vnd.docker.container.image.v1+json","digest":"{cfg}","size":16}},"layers":[{{"mediaType":"application/vnd.docker.image.rootfs.foreign.diff.tar.gzip","digest":"{foreign}","size":99,"urls":["https://example.invalid/l"]}},{{"mediaType":"application/vnd.oci.image.layer.nondistributable.v1.tar+gzip","digest":"{foreign}","size":99}}]}}"#
    );
    let r = put_manifest(&s, "m/nd", "win", DOCKER_MANIFEST, &m).await;
    assert_eq!(r.status(), 201, "{}", r.text().await.unwrap());
}

#[tokio::test]
async fn referrers_with_subject_before_and_after_it_exists_and_artifact_type_filter() {
    let s = Server::start(&[]);
    let c = client();
    let subject = image_manifest(&s, "ref/x", "subject", "").await;
    let sd = sha256(subject.as_bytes());
    let empty = push_blob(&s, "ref/x", b"{}").await;
    let artifact = |kind: &str| {
        format!(
            r#"{{"schemaVersion":2,"mediaType":"{OCI_MANIFEST}","artifactType":"application/vnd.test.{kind}","config":{{"mediaType":"application/vnd.oci.empty.v1+json","digest":"{empty}","size":2}},"layers":[],"subject":{{"mediaType":"{OCI_MANIFEST}","digest":"{sd}","size":{}}},"annotations":{{"k":"{kind}"}}}}"#,
            subject.len()
        )
    };
    // The subject does not exist yet: accepted, with OCI-Subject.
    let sig = artifact("signature");
    let r = put_manifest(&s, "ref/x", &sha256(sig.as_bytes()), OCI_MANIFEST, &sig).await;
    assert_eq!(r.status(), 201);
    assert_eq!(h(&r, "oci-subject"), sd);
    let sbom = artifact("sbom");
    assert_eq!(
        put_manifest(&s, "ref/x", "sbom", OCI_MANIFEST, &sbom)
            .await
            .status(),
        201
    );
    assert_eq!(
        put_manifest(&s, "ref/x", "v1", OCI_MANIFEST, &subject)
            .await
            .status(),
        201
    );

    let r = c
        .get(s.url(&format!("/v2/ref/x/referrers/{sd}")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(h(&r, "content-type"), OCI_INDEX);
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["schemaVersion"], 2);
    let ms = v["manifests"].as_array().unwrap();
    assert_eq!(ms.len(), 2);
    let sig_desc = ms
        .iter()
        .find(|m| m["digest"] == sha256(sig.as_bytes()))
        .expect("signature listed");
    assert_eq!(sig_desc["artifactType"], "application/vnd.test.signature");
    assert_eq!(sig_desc["size"], sig.len());
    assert_eq!(sig_desc["annotations"]["k"], "signature");

    let r = c
        .get(s.url(&format!(
            "/v2/ref/x/referrers/{sd}?artifactType=application/vnd.test.sbom"
        )))
        .send()
        .await
        .unwrap();
    assert_eq!(h(&r, "oci-filters-applied"), "artifactType");
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["manifests"].as_array().unwrap().len(), 1);
    assert_eq!(v["manifests"][0]["digest"], sha256(sbom.as_bytes()));
    // No referrers: an empty index, not 404.
    let r = c
        .get(s.url(&format!("/v2/ref/x/referrers/{}", sha256(b"z"))))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["manifests"], serde_json::json!([]));
    let r = c
        .get(s.url("/v2/ref/x/referrers/sha256:short"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
}

#[tokio::test]
async fn tags_and_catalog_paginate_with_link_headers() {
    let s = Server::start(&[]);
    let c = client();
    let m = image_manifest(&s, "p/one", "p", "").await;
    for t in ["c", "a", "e", "b", "d"] {
        assert_eq!(
            put_manifest(&s, "p/one", t, OCI_MANIFEST, &m)
                .await
                .status(),
            201
        );
    }
    for repo in ["p/two", "p/three"] {
        push_blob(&s, repo, b"x").await;
    }
    let r = c
        .get(s.url("/v2/p/one/tags/list?n=2"))
        .send()
        .await
        .unwrap();
    assert_eq!(
        h(&r, "link"),
        "</v2/p/one/tags/list?n=2&last=b>; rel=\"next\""
    );
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v, serde_json::json!({"name": "p/one", "tags": ["a", "b"]}));
    let r = c
        .get(s.url("/v2/p/one/tags/list?n=2&last=b"))
        .send()
        .await
        .unwrap();
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["tags"], serde_json::json!(["c", "d"]));
    let r = c
        .get(s.url("/v2/p/one/tags/list?n=2&last=d"))
        .send()
        .await
        .unwrap();
    assert!(r.headers().get("link").is_none());
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["tags"], serde_json::json!(["e"]));
    let r = c.get(s.url("/v2/p/one/tags/list")).send().await.unwrap();
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["tags"], serde_json::json!(["a", "b", "c", "d", "e"]));

    let r = c.get(s.url("/v2/_catalog?n=2")).send().await.unwrap();
    assert_eq!(
        h(&r, "link"),
        "</v2/_catalog?n=2&last=p%2Fthree>; rel=\"next\""
    );
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["repositories"], serde_json::json!(["p/one", "p/three"]));
    let r = c
        .get(s.url("/v2/_catalog?n=2&last=p%2Fthree"))
        .send()
        .await
        .unwrap();
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["repositories"], serde_json::json!(["p/two"]));

    let r = c.get(s.url("/v2/p/none/tags/list")).send().await.unwrap();
    assert_eq!(r.status(), 404);
    assert_eq!(error_code(r).await, "NAME_UNKNOWN");
    let r = c.get(s.url("/v2/_catalog?n=x")).send().await.unwrap();
    assert_eq!(r.status(), 400);
}

#[tokio::test]
async fn nothing_can_be_deleted_and_immutable_tags_do_not_move() {
    let s = Server::start(&["--immutable-tags", "prod/*,exact"]);
    let c = client();
    let m1 = image_manifest(&s, "prod/app", "1", "").await;
    let m2 = image_manifest(&s, "prod/app", "2", "").await;
    let r = put_manifest(&s, "prod/app", "v1", OCI_MANIFEST, &m1).await;
    let d1 = h(&r, "docker-content-digest").to_string();
    for url in [
        format!("/v2/prod/app/manifests/{d1}"),
        "/v2/prod/app/manifests/v1".into(),
        format!("/v2/prod/app/blobs/{}", sha256(b"layer bytes of 1")),
    ] {
        let r = c.delete(s.url(&url)).send().await.unwrap();
        assert_eq!(r.status(), 405, "{url}");
        assert_eq!(error_code(r).await, "UNSUPPORTED");
    }
    assert_eq!(
        put_manifest(&s, "prod/app", "v1", OCI_MANIFEST, &m1)
            .await
            .status(),
        201,
        "same content again"
    );
    let r = put_manifest(&s, "prod/app", "v1", OCI_MANIFEST, &m2).await;
    assert_eq!(r.status(), 409);
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["errors"][0]["code"], "DENIED");
    assert!(v["errors"][0]["message"]
        .as_str()
        .unwrap()
        .contains("immutable"));
    let r = c
        .get(s.url("/v2/prod/app/manifests/v1"))
        .send()
        .await
        .unwrap();
    assert_eq!(
        h(&r, "docker-content-digest"),
        d1,
        "the tag still points to the first push"
    );
    // Other repositories' tags move.
    let n1 = image_manifest(&s, "dev/app", "1", "").await;
    let n2 = image_manifest(&s, "dev/app", "2", "").await;
    assert_eq!(
        put_manifest(&s, "dev/app", "latest", OCI_MANIFEST, &n1)
            .await
            .status(),
        201
    );
    let r = put_manifest(&s, "dev/app", "latest", OCI_MANIFEST, &n2).await;
    assert_eq!(r.status(), 201);
    let d2 = h(&r, "docker-content-digest").to_string();
    let r = c
        .get(s.url("/v2/dev/app/manifests/latest"))
        .send()
        .await
        .unwrap();
    assert_eq!(h(&r, "docker-content-digest"), d2);
}

#[tokio::test]
async fn bad_requests_get_4xx_never_5xx() {
    let s = Server::start(&[]);
    let c = client();
    let cases: &[(&str, &str, u16, &str)] = &[
        ("GET", "/v2/UPPER/tags/list", 400, "NAME_INVALID"),
        ("GET", "/v2/a..b/manifests/latest", 400, "NAME_INVALID"),
        ("GET", "/v2/a/blobs/sha256:123", 400, "DIGEST_INVALID"),
        (
            "GET",
            "/v2/a/blobs/sha1:da39a3ee5e6b4b0d3255bfef95601890afd80709",
            400,
            "DIGEST_INVALID",
        ),
        ("GET", "/v2/a/manifests/sha256:zz", 400, "DIGEST_INVALID"),
        // Not a valid tag: no such manifest can exist (the conformance suite asks).
        (
            "GET",
            "/v2/a/manifests/.INVALID_MANIFEST_NAME",
            404,
            "MANIFEST_UNKNOWN",
        ),
        (
            "PUT",
            "/v2/a/manifests/.INVALID_MANIFEST_NAME",
            400,
            "MANIFEST_INVALID",
        ),
        ("GET", "/v2/a/blobs/uploads/not-a-uuid!", 404, "NOT_FOUND"),
        (
            "PATCH",
            "/v2/a/blobs/uploads/00000000-0000-0000-0000-000000000000",
            404,
            "BLOB_UPLOAD_UNKNOWN",
        ),
        ("GET", "/v2/a/unknown/thing", 404, "NOT_FOUND"),
        ("POST", "/v2/a/manifests/latest", 405, "UNSUPPORTED"),
        ("GET", "/v3/", 404, "NOT_FOUND"),
        (
            "GET",
            "/v2/a/blobs/uploads/../../../etc/passwd",
            404,
            "NOT_FOUND",
        ),
    ];
    for (method, path, status, code) in cases {
        let r = c
            .request(method.parse().unwrap(), s.url(path))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), *status, "{method} {path}");
        assert_eq!(error_code(r).await, *code, "{method} {path}");
    }
}

#[tokio::test]
async fn metrics_count_requests_bytes_and_uploads() {
    let s = Server::start(&[]);
    let d = push_blob(&s, "met/x", &[7u8; 1000]).await;
    get_bytes(&s, &format!("/v2/met/x/blobs/{d}")).await;
    let text = metrics_text(&s).await;
    for want in [
        r#"amber_http_requests_total{route="upload_start",method="POST",status="201"} 1"#,
        r#"amber_http_requests_total{route="blob",method="GET",status="200"} 1"#,
        "amber_http_body_bytes_in_total 1000",
        "amber_http_body_bytes_out_total 1000",
        "amber_uploads_in_flight 0",
        // Buckets under a millisecond, where metadata reads are answered.
        r#"amber_http_request_duration_seconds_bucket{route="blob",method="GET",le="0.0001"}"#,
        r#"amber_http_request_duration_seconds_bucket{route="blob",method="GET",le="0.00025"}"#,
        r#"amber_http_request_duration_seconds_bucket{route="blob",method="GET",le="0.001"}"#,
    ] {
        assert!(text.contains(want), "{want} missing from:\n{text}");
    }
}

/// A small monolithic upload (POST `?digest=` with a Content-Length of at most 1 MiB) is
/// verified in memory and written once: no upload session, nothing staged. On S3: one
/// PutObject for the blob and one for the repository's link record, nothing listed or
/// deleted. A larger one still goes through a session, and both read back exactly.
async fn small_monolithic_uploads_are_one_write_on(storage: Storage) {
    let s = Server::start_on(storage, &[]);
    push_blob(&s, "one/write", b"first: the repository's catalog record").await;
    const OPS: [&str; 4] = ["PutObject", "DeleteObject", "ListObjectsV2", "HeadObject"];
    let ops = |text: String| -> Vec<u64> {
        OPS.iter()
            .map(|op| {
                metric(
                    &text.replace(&format!("{{op=\"{op}\"}}"), &format!("_{op}")),
                    &format!("amber_s3_requests_total_{op}"),
                )
            })
            .collect()
    };
    let before = ops(metrics_text(&s).await);
    let small = vec![5u8; 1 << 20];
    let d = push_blob(&s, "one/write", &small).await;
    let after = ops(metrics_text(&s).await);
    if storage == Storage::S3 {
        let delta: Vec<u64> = after.iter().zip(&before).map(|(a, b)| a - b).collect();
        assert_eq!(delta, vec![2, 0, 0, 0], "S3 requests by operation: {OPS:?}");
    } else {
        let records =
            amber_registry::store::fs_records::RecordDb::read_only(&s.data.join("store")).unwrap();
        let left = records.range("_records/uploads/", None, 10).unwrap();
        assert_eq!(left, [], "no session record");
        let staged = std::fs::read_dir(s.data.join("store/_staging"))
            .unwrap()
            .count();
        assert_eq!(staged, 0, "nothing staged");
    }
    assert_eq!(
        get_bytes(&s, &format!("/v2/one/write/blobs/{d}")).await,
        small
    );
    let big = vec![6u8; (1 << 20) + 1];
    let d = push_blob(&s, "one/write", &big).await;
    assert_eq!(
        get_bytes(&s, &format!("/v2/one/write/blobs/{d}")).await,
        big
    );
}

#[tokio::test]
async fn small_monolithic_uploads_are_one_write_fs() {
    small_monolithic_uploads_are_one_write_on(Storage::Fs).await;
}

#[tokio::test]
async fn small_monolithic_uploads_are_one_write_s3() {
    small_monolithic_uploads_are_one_write_on(Storage::S3).await;
}
