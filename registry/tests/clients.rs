//! Round trips with the real clients people use: the Docker engine, buildah + podman,
//! skopeo (multi-arch, OCI and Docker schema 2) and oras (artifacts with a subject).
//!
//! `scripts/test` starts a Docker engine and exports `AMBER_TEST_DOCKER_HOST`; every
//! tool is required, and a missing one fails the test.

mod common;

use std::path::{Path, PathBuf};

use std::process::Command;

use common::*;

/// The busybox root file system tar the fixture images build on.
fn base_rootfs(dir: &Path) -> PathBuf {
    let out = dir.join("busybox-rootfs.tar");
    run(Command::new(repo_root().join("fixtures/busybox-rootfs.sh")).arg(&out));
    out
}

#[tokio::test]
async fn docker_build_push_pull_run_round_trip() {
    docker_build_push_pull_run_round_trip_on(Storage::Fs).await;
}

#[tokio::test]
async fn docker_build_push_pull_run_round_trip_on_s3() {
    docker_build_push_pull_run_round_trip_on(Storage::S3).await;
}

async fn docker_build_push_pull_run_round_trip_on(storage: Storage) {
    let s = Server::start_on(storage, &[]);
    let tmp = tempfile::tempdir().unwrap();
    let base = base_rootfs(tmp.path());
    docker_ok(&["import", base.to_str().unwrap(), "amber-test/busybox:1"]);
    let image = format!("{}/test/hello:v1", s.addr);
    docker_ok(&[
        "build",
        "-q",
        "-t",
        &image,
        repo_root().join("fixtures/images/hello").to_str().unwrap(),
    ]);
    let push = docker_ok(&["push", &image]);
    let pushed = push
        .lines()
        .find_map(|l| l.split("digest: ").nth(1))
        .and_then(|r| r.split_whitespace().next())
        .unwrap_or_else(|| panic!("no digest in docker push output:\n{push}"))
        .to_string();
    docker_ok(&["rmi", &image]);
    let pull = docker_ok(&["pull", &image]);
    assert!(pull.contains(&pushed), "pulled digest differs:\n{pull}");
    let out = docker_ok(&["run", "--rm", "--network", "none", &image]);
    assert_eq!(out, "hello from an amber round trip\n1234\n");
    // The tag resolves to what docker printed, with docker's media type.
    let r = client()
        .head(s.url("/v2/test/hello/manifests/v1"))
        .header(
            "Accept",
            "application/vnd.docker.distribution.manifest.v2+json",
        )
        .send()
        .await
        .unwrap();
    assert_eq!(
        r.headers()["docker-content-digest"].to_str().unwrap(),
        pushed
    );
    docker_ok(&["rmi", &image]);
}

/// An isolated containers/image + containers/storage setup (vfs, this registry insecure).
struct Containers {
    dir: tempfile::TempDir,
}

impl Containers {
    fn new(registry: &str) -> Containers {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::write(
            d.join("registries.conf"),
            format!("unqualified-search-registries = []\n[[registry]]\nlocation = \"{registry}\"\ninsecure = true\n"),
        )
        .unwrap();
        std::fs::write(
            d.join("storage.conf"),
            format!(
                "[storage]\ndriver = \"vfs\"\nrunroot = \"{}\"\ngraphroot = \"{}\"\n",
                d.join("run").display(),
                d.join("graph").display()
            ),
        )
        .unwrap();
        Containers { dir }
    }

    fn cmd(&self, tool: &str) -> Command {
        let mut c = Command::new(require_tool(tool));
        c.env(
            "CONTAINERS_REGISTRIES_CONF",
            self.dir.path().join("registries.conf"),
        )
        .env(
            "CONTAINERS_STORAGE_CONF",
            self.dir.path().join("storage.conf"),
        )
        .env("TMPDIR", self.dir.path());
        c
    }

    /// Commits a busybox image for `arch` with `/arch` holding its name.
    fn base_image(&self, rootfs: &Path, arch: &str, name: &str) {
        let c = run(self.cmd("buildah").args(["from", "scratch"]))
            .trim()
            .to_string();
        run(self.cmd("buildah").args(["add", &c]).arg(rootfs).arg("/"));
        let marker = self.dir.path().join(format!("arch-{arch}"));
        std::fs::write(&marker, arch).unwrap();
        run(self
            .cmd("buildah")
            .args(["add", &c])
            .arg(&marker)
            .arg("/arch"));
        run(self
            .cmd("buildah")
            .args(["config", "--arch", arch, "--os", "linux", &c]));
        run(self.cmd("buildah").args(["commit", "-q", &c, name]));
        run(self.cmd("buildah").args(["rm", &c]));
    }
}

#[tokio::test]
async fn buildah_push_podman_pull_round_trip() {
    let s = Server::start(&[]);
    let ct = Containers::new(&s.addr);
    let rootfs = base_rootfs(ct.dir.path());
    ct.base_image(&rootfs, "amd64", "amber-test/busybox:1");
    let ctx = ct.dir.path().join("ctx");
    std::fs::create_dir(&ctx).unwrap();
    std::fs::write(
        ctx.join("Containerfile"),
        "FROM amber-test/busybox:1\nRUN echo \"built by buildah, $(cat /arch)\" > /msg\nCMD [\"cat\", \"/msg\"]\n",
    )
    .unwrap();
    let image = format!("{}/test/buildah:v1", s.addr);
    run(ct
        .cmd("buildah")
        .args(["bud", "--isolation", "chroot", "-q", "-t", &image])
        .arg(&ctx));
    run(ct.cmd("buildah").args(["push", &image]));
    run(ct.cmd("podman").args(["rmi", "-f", &image]));
    run(ct.cmd("podman").args(["pull", "-q", &image]));
    // This machine's runc may not raise rlimits: pin them to values it can set.
    let out = run(ct.cmd("podman").args([
        "run",
        "--rm",
        "--network",
        "none",
        "--ulimit",
        "nofile=1024:1024",
        "--ulimit",
        "nproc=1024:1024",
        &image,
    ]));
    assert_eq!(out, "built by buildah, amd64\n");
}

#[tokio::test]
async fn skopeo_copy_all_of_a_multi_arch_index_in_oci_and_docker_formats() {
    skopeo_copy_all_of_a_multi_arch_index_in_oci_and_docker_formats_on(Storage::Fs).await;
}

#[tokio::test]
async fn skopeo_copy_all_of_a_multi_arch_index_in_oci_and_docker_formats_on_s3() {
    skopeo_copy_all_of_a_multi_arch_index_in_oci_and_docker_formats_on(Storage::S3).await;
}

async fn skopeo_copy_all_of_a_multi_arch_index_in_oci_and_docker_formats_on(storage: Storage) {
    let s = Server::start_on(storage, &[]);
    let ct = Containers::new(&s.addr);
    let rootfs = base_rootfs(ct.dir.path());
    for arch in ["amd64", "arm64"] {
        ct.base_image(&rootfs, arch, &format!("amber-test/multi-{arch}"));
    }
    run(ct
        .cmd("buildah")
        .args(["manifest", "create", "amber-test/multi"]));
    for arch in ["amd64", "arm64"] {
        run(ct.cmd("buildah").args([
            "manifest",
            "add",
            "amber-test/multi",
            &format!("containers-storage:localhost/amber-test/multi-{arch}"),
        ]));
    }
    let layout = ct.dir.path().join("layout");
    let src = format!("oci:{}:multi", layout.display());
    run(ct.cmd("buildah").args([
        "manifest",
        "push",
        "-q",
        "--all",
        "--format",
        "oci",
        "amber-test/multi",
        &src,
    ]));
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(layout.join("index.json")).unwrap()).unwrap();
    let source_digest = index["manifests"][0]["digest"]
        .as_str()
        .unwrap()
        .to_string();

    for (tag, format, index_type, child_type) in [
        (
            "oci",
            None,
            "application/vnd.oci.image.index.v1+json",
            "application/vnd.oci.image.manifest.v1+json",
        ),
        (
            "v2s2",
            Some("v2s2"),
            "application/vnd.docker.distribution.manifest.list.v2+json",
            "application/vnd.docker.distribution.manifest.v2+json",
        ),
    ] {
        let dest = format!("docker://{}/test/multi:{tag}", s.addr);
        let mut copy = ct.cmd("skopeo");
        copy.args(["copy", "-q", "--all", "--dest-tls-verify=false"]);
        if let Some(f) = format {
            copy.args(["--format", f]);
        }
        run(copy.arg(&src).arg(&dest));
        let raw = run(ct
            .cmd("skopeo")
            .args(["inspect", "--raw", "--tls-verify=false", &dest]));
        let v: serde_json::Value = serde_json::from_str(&raw).unwrap();
        assert_eq!(v["mediaType"], index_type, "{raw}");
        let children = v["manifests"].as_array().unwrap();
        assert_eq!(children.len(), 2);
        let archs: Vec<&str> = children
            .iter()
            .map(|c| c["platform"]["architecture"].as_str().unwrap())
            .collect();
        assert_eq!(archs, ["amd64", "arm64"]);
        assert!(children.iter().all(|c| c["mediaType"] == child_type));
        if format.is_none() {
            assert_eq!(
                sha256(raw.as_bytes()),
                source_digest,
                "the OCI index is stored byte for byte"
            );
        }
        // Copy the whole index back out and read each architecture's marker file.
        let back = ct.dir.path().join(format!("back-{tag}"));
        run(ct
            .cmd("skopeo")
            .args(["copy", "-q", "--all", "--src-tls-verify=false", &dest])
            .arg(format!("oci:{}:x", back.display())));
        for arch in ["amd64", "arm64"] {
            let one = ct.dir.path().join(format!("one-{tag}-{arch}"));
            run(ct
                .cmd("skopeo")
                .args([
                    "copy",
                    "-q",
                    "--src-tls-verify=false",
                    "--override-arch",
                    arch,
                    &dest,
                ])
                .arg(format!("dir:{}", one.display())));
            let manifest: serde_json::Value =
                serde_json::from_slice(&std::fs::read(one.join("manifest.json")).unwrap()).unwrap();
            let layers = manifest["layers"].as_array().unwrap();
            let top = layers.last().unwrap()["digest"]
                .as_str()
                .unwrap()
                .strip_prefix("sha256:")
                .unwrap()
                .to_string();
            let listing = run(Command::new("tar")
                .arg("-xzOf")
                .arg(one.join(&top))
                .arg("arch"));
            assert_eq!(listing, arch);
        }
    }
}

#[tokio::test]
async fn oras_artifact_with_a_subject_is_listed_as_a_referrer() {
    let s = Server::start(&[]);
    require_tool("python3");
    let m = image_manifest(&s, "test/art", "subject", "").await;
    let r = put_manifest(
        &s,
        "test/art",
        "v1",
        "application/vnd.oci.image.manifest.v1+json",
        &m,
    )
    .await;
    assert_eq!(r.status(), 201);
    let subject = sha256(m.as_bytes());
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("sbom.json");
    std::fs::write(&file, "{\"spdxVersion\":\"SPDX-2.3\"}").unwrap();
    let out = run(Command::new("python3")
        .arg(repo_root().join("fixtures/clients/oras_referrer.py"))
        .args([&s.addr, "test/art", "v1"])
        .arg(&file)
        .arg(tmp.path().join("out")));
    assert!(out.contains(&format!("subject {subject}")), "{out}");
    assert_eq!(
        std::fs::read_to_string(tmp.path().join("out/sbom.json")).unwrap(),
        "{\"spdxVersion\":\"SPDX-2.3\"}"
    );
    let artifact = out.split_whitespace().nth(1).unwrap().to_string();
    let v: serde_json::Value = get_json(&s, &format!("/v2/test/art/referrers/{subject}")).await;
    let listed: Vec<&str> = v["manifests"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["digest"].as_str().unwrap())
        .collect();
    assert_eq!(listed, [artifact.as_str()]);
}
