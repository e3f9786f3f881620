//! Images from other registries: `amber-registry import` and pull-through, against real
//! upstreams on loopback: CNCF distribution (Debian's `docker-registry`) with htpasswd
//! Basic auth, and an amber registry with token auth. Each holds a Docker v2 image, an OCI
//! image and a multi-platform OCI index, built here byte by byte from the busybox root fs.
//!
//! One test, one node, one amber registry under test (`local`), so the VMs and the set-up
//! are shared:
//! - every image is imported with the CLI and `amber run` by its original reference;
//! - an import whose registry is killed midway (the upstream frozen with SIGSTOP after the
//!   first image, so the kill lands mid-transfer) completes when re-run, and the re-run
//!   transfers only what was missing;
//! - an upstream serving a blob whose bytes do not match its digest: the image is refused
//!   and nothing of it is visible (no tag, manifest or blob link; the bad bytes not stored);
//! - pull-through: `amber run upstream/name:tag` of an image never imported; then the
//!   upstream's tag moves and the upstream is stopped, and the reference still runs the
//!   first image.

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use amber_testkit::layer::{files_tar, gzip};
use common::*;

const DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
const DOCKER_CONFIG: &str = "application/vnd.docker.container.image.v1+json";
const DOCKER_LAYER: &str = "application/vnd.docker.image.rootfs.diff.tar.gzip";
const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
const OCI_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
const OCI_LAYER: &str = "application/vnd.oci.image.layer.v1.tar+gzip";

/// A CNCF distribution registry with htpasswd auth on a loopback port.
struct Distribution {
    child: Child,
    addr: String,
    root: PathBuf,
    _dir: tempfile::TempDir,
}

impl Distribution {
    fn start(user: &str, password: &str) -> Distribution {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("storage");
        let htpasswd = dir.path().join("htpasswd");
        let hash = bcrypt::hash(password, 5).unwrap();
        std::fs::write(&htpasswd, format!("{user}:{hash}\n")).unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let addr = format!("127.0.0.1:{port}");
        let config = dir.path().join("config.yml");
        std::fs::write(
            &config,
            format!(
                "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {}\n  delete:\n    enabled: false\nhttp:\n  addr: {addr}\nauth:\n  htpasswd:\n    realm: upstream\n    path: {}\n",
                root.display(),
                htpasswd.display()
            ),
        )
        .unwrap();
        let log = std::fs::File::create(dir.path().join("registry.log")).unwrap();
        let child = Command::new(require_tool("docker-registry"))
            .arg("serve")
            .arg(&config)
            .stdout(Stdio::from(log.try_clone().unwrap()))
            .stderr(Stdio::from(log))
            .spawn()
            .unwrap();
        let mut d = Distribution {
            child,
            addr,
            root,
            _dir: dir,
        };
        // Ready when it answers /v2/ (401: it wants credentials).
        for _ in 0..300 {
            if std::net::TcpStream::connect(&d.addr).is_ok() {
                return d;
            }
            assert!(
                d.child.try_wait().unwrap().is_none(),
                "docker-registry exited"
            );
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        panic!("docker-registry did not listen on {}", d.addr);
    }

    /// The file holding blob `digest`'s bytes in distribution's filesystem driver.
    fn blob_data(&self, digest: &str) -> PathBuf {
        let hex = digest.strip_prefix("sha256:").unwrap();
        self.root
            .join("docker/registry/v2/blobs/sha256")
            .join(&hex[..2])
            .join(hex)
            .join("data")
    }

    fn signal(&self, sig: &str) {
        ok(Command::new("kill")
            .arg(format!("-{sig}"))
            .arg(self.child.id().to_string()));
    }
}

impl Drop for Distribution {
    fn drop(&mut self) {
        self.signal("CONT");
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Where images are pushed for seeding: an upstream's base URL and its Basic login.
struct Upstream {
    addr: String,
    /// The base layer of every image (the busybox root fs, uncompressed).
    base: Vec<u8>,
    user: &'static str,
    password: &'static str,
}

impl Upstream {
    async fn blob(&self, repo: &str, data: &[u8]) -> serde_json::Value {
        let d = sha256(data);
        let http = client();
        let r = http
            .post(format!("http://{}/v2/{repo}/blobs/uploads/", self.addr))
            .basic_auth(self.user, Some(self.password))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 202, "{}", r.text().await.unwrap());
        let loc = r.headers()["location"].to_str().unwrap().to_string();
        let loc = if loc.starts_with('/') {
            format!("http://{}{loc}", self.addr)
        } else {
            loc
        };
        let sep = if loc.contains('?') { '&' } else { '?' };
        let r = http
            .put(format!("{loc}{sep}digest={d}"))
            .basic_auth(self.user, Some(self.password))
            .header("Content-Type", "application/octet-stream")
            .body(data.to_vec())
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 201, "{}", r.text().await.unwrap());
        serde_json::json!({"digest": d, "size": data.len()})
    }

    async fn manifest(&self, repo: &str, reference: &str, media_type: &str, body: &[u8]) -> String {
        let r = client()
            .put(format!(
                "http://{}/v2/{repo}/manifests/{reference}",
                self.addr
            ))
            .basic_auth(self.user, Some(self.password))
            .header("Content-Type", media_type)
            .body(body.to_vec())
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 201, "{}", r.text().await.unwrap());
        sha256(body)
    }

    /// An image: the busybox base, then a layer with `/which` holding `marker` and
    /// `extra` bytes of noise in `/noise`. Returns (manifest digest, size, its layers).
    async fn image(
        &self,
        repo: &str,
        reference: &str,
        docker: bool,
        arch: &str,
        marker: &str,
        extra: usize,
    ) -> (String, usize, Vec<String>) {
        // Incompressible noise (xorshift64*), different per marker.
        let mut x = 0x9e37_79b9_7f4a_7c15u64
            ^ (marker.len() as u64) << 32
            ^ marker.bytes().map(u64::from).sum::<u64>();
        let noise: Vec<u8> = (0..extra)
            .map(|_| {
                x ^= x >> 12;
                x ^= x << 25;
                x ^= x >> 27;
                (x.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 56) as u8
            })
            .collect();
        let top = files_tar(&[
            ("which", format!("{marker}\n").as_bytes()),
            ("noise", &noise),
        ]);
        let layers = [self.base.clone(), top];
        let mut diff_ids = Vec::new();
        let mut descs = Vec::new();
        let mut digests = Vec::new();
        for l in &layers {
            diff_ids.push(sha256(l));
            let gz = gzip(l);
            let mut desc = self.blob(repo, &gz).await;
            desc["mediaType"] = (if docker { DOCKER_LAYER } else { OCI_LAYER }).into();
            digests.push(desc["digest"].as_str().unwrap().to_string());
            descs.push(desc);
        }
        let config = serde_json::json!({
            "architecture": arch, "os": "linux",
            "config": {"Cmd": ["sh"], "Env": ["PATH=/bin"]},
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
        });
        let mut cdesc = self.blob(repo, config.to_string().as_bytes()).await;
        cdesc["mediaType"] = (if docker { DOCKER_CONFIG } else { OCI_CONFIG }).into();
        let media_type = if docker {
            DOCKER_MANIFEST
        } else {
            OCI_MANIFEST
        };
        let manifest = serde_json::json!({
            "schemaVersion": 2, "mediaType": media_type, "config": cdesc, "layers": descs,
        });
        let body = serde_json::to_vec_pretty(&manifest).unwrap();
        let d = self.manifest(repo, reference, media_type, &body).await;
        (d, body.len(), digests)
    }

    /// The three kinds of image under `kind/…:v1`: a Docker v2 image, an OCI image, and
    /// an OCI index of linux/amd64 and linux/arm64 images.
    async fn seed(&self, who: &str) {
        self.image(
            "kind/docker",
            "v1",
            true,
            "amd64",
            &format!("{who} docker v2"),
            0,
        )
        .await;
        self.image("kind/oci", "v1", false, "amd64", &format!("{who} oci"), 0)
            .await;
        let mut children = Vec::new();
        for arch in ["amd64", "arm64"] {
            let (d, size, _) = self
                .image(
                    "kind/index",
                    &format!("only-{arch}"),
                    false,
                    arch,
                    &format!("{who} index {arch}"),
                    0,
                )
                .await;
            children.push(serde_json::json!({
                "mediaType": OCI_MANIFEST, "digest": d, "size": size,
                "platform": {"architecture": arch, "os": "linux"},
            }));
        }
        let index =
            serde_json::json!({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": children});
        self.manifest(
            "kind/index",
            "v1",
            OCI_INDEX,
            &serde_json::to_vec(&index).unwrap(),
        )
        .await;
    }
}

/// `amber-registry import --jobs 1` of the references in file `list` into `local`.
fn import_list(local: &Registry, authfile: &Path, list: &Path) -> Command {
    let mut c = registry_bin();
    c.args([
        "import",
        "--jobs",
        "1",
        "--registry",
        &local.url(""),
        "--authfile",
    ])
    .arg(authfile)
    .arg("--from-file")
    .arg(list);
    c
}

/// `amber-registry import` into `local`, with `authfile`'s credentials.
fn import(local: &Registry, authfile: &Path, sources: &[&str]) -> std::process::Output {
    registry_bin()
        .args(["import", "--registry", &local.url(""), "--authfile"])
        .arg(authfile)
        .args(sources)
        .output()
        .unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// The figures of an import's summary line: (images imported, failed, blobs fetched,
/// bytes fetched, blobs already here).
fn summary(out: &str) -> (u64, u64, u64, u64, u64) {
    let line = out
        .lines()
        .find(|l| l.contains("images imported"))
        .unwrap_or_else(|| panic!("no summary in:\n{out}"));
    let nums: Vec<u64> = line
        .split(|c: char| !c.is_ascii_digit())
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().unwrap())
        .collect();
    (nums[0], nums[1], nums[2], nums[3], nums[4])
}

#[test]
fn images_from_other_registries_import_pull_through_and_run() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let work = tempfile::tempdir().unwrap();
    let base_tar = work.path().join("busybox.tar");
    ok(Command::new(repo_root().join("fixtures/busybox-rootfs.sh")).arg(&base_tar));
    let base = std::fs::read(&base_tar).unwrap();

    // Upstream one: distribution with htpasswd.
    let dist = Distribution::start("upstream-user", "upstream-secret");
    let d = Upstream {
        addr: dist.addr.clone(),
        base: base.clone(),
        user: "upstream-user",
        password: "upstream-secret",
    };
    // Upstream two: amber with token auth.
    let users = work.path().join("users.toml");
    add_operator(&users, "operator", "operator-secret");
    let amber_up = Registry::start(&["--auth", "token", "--users", users.to_str().unwrap()]);
    let a = Upstream {
        addr: amber_up.addr.clone(),
        base: base.clone(),
        user: "operator",
        password: "operator-secret",
    };
    rt.block_on(async {
        d.seed("distribution").await;
        a.seed("amber").await;
    });

    // Credentials for both, in Docker's config.json format.
    let authfile = work.path().join("config.json");
    let b64 = |s: &str| {
        use base64::Engine as _;
        base64::engine::general_purpose::STANDARD.encode(s)
    };
    std::fs::write(
        &authfile,
        serde_json::json!({"auths": {
            d.addr.clone(): {"auth": b64("upstream-user:upstream-secret")},
            a.addr.clone(): {"auth": b64("operator:operator-secret")},
        }})
        .to_string(),
    )
    .unwrap();

    // The registry under test pulls through to both.
    let local_data = tempfile::tempdir().unwrap();
    let upstreams = format!("{},{}", d.addr, a.addr);
    let mut local = Registry::start_in(
        local_data.path(),
        &[
            "--upstreams",
            &upstreams,
            "--upstream-auth-file",
            authfile.to_str().unwrap(),
        ],
    );
    let node = Node::setup(&local);

    // 1. Import every kind from both upstreams; run each by its original reference.
    let refs: Vec<(String, String)> = [(&d.addr, "distribution"), (&a.addr, "amber")]
        .iter()
        .flat_map(|(host, who)| {
            [
                (format!("{host}/kind/docker:v1"), format!("{who} docker v2")),
                (format!("{host}/kind/oci:v1"), format!("{who} oci")),
                (
                    format!("{host}/kind/index:v1"),
                    format!("{who} index amd64"),
                ),
            ]
        })
        .collect();
    let sources: Vec<&str> = refs.iter().map(|(r, _)| r.as_str()).collect();
    let out = import(&local, &authfile, &sources);
    let stdout = text(&out.stdout);
    assert!(
        out.status.success(),
        "import: {stdout}\n{}",
        text(&out.stderr)
    );
    let (imported, failed, fetched, _, _) = summary(&stdout);
    assert_eq!((imported, failed), (6, 0), "{stdout}");
    assert!(fetched > 0, "{stdout}");
    for (reference, marker) in &refs {
        let run = node.amber(&local, &["run", reference, "--", "cat", "/which"]);
        assert_eq!(
            text(&run.stdout),
            format!("{marker}\n"),
            "{reference}: {}",
            text(&run.stderr)
        );
        assert_eq!(run.status.code(), Some(0));
    }
    // Where each came from is recorded and shown by resolve.
    let mirror = |host: &str| host.replace(':', "-");
    let v = local.json(&format!(
        "/amber/v1/resolve/{}/kind/oci/v1",
        mirror(&d.addr)
    ));
    assert_eq!(
        v["source"]["reference"],
        format!("{}/kind/oci:v1", d.addr),
        "{v}"
    );
    assert_eq!(v["source"]["digest"], v["manifest_digest"], "{v}");
    // Importing the same images again transfers nothing.
    let again = import(&local, &authfile, &sources);
    let again_out = text(&again.stdout);
    assert!(again.status.success(), "{again_out}");
    assert_eq!(
        summary(&again_out).2,
        0,
        "nothing fetched twice: {again_out}"
    );

    // 2. An import killed midway, then re-run.
    let big = 8 << 20;
    rt.block_on(async {
        for name in ["a", "b", "c"] {
            d.image(
                &format!("many/{name}"),
                "v1",
                true,
                "amd64",
                &format!("many {name}"),
                big,
            )
            .await;
        }
    });
    let many: Vec<String> = ["a", "b", "c"]
        .iter()
        .map(|n| format!("{}/many/{n}:v1", d.addr))
        .collect();
    let list = work.path().join("many.txt");
    std::fs::write(&list, format!("# three images\n{}\n", many.join("\n"))).unwrap();
    let mut first = import_list(&local, &authfile, &list)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(first.stdout.take().unwrap()).lines();
    let done_first = lines.next().unwrap().unwrap();
    assert!(
        done_first.starts_with(&format!("imported {}", many[0])),
        "{done_first}"
    );
    // Freeze the upstream so the next image is mid-transfer, then kill the registry.
    dist.signal("STOP");
    local.kill9();
    let status = first.wait().unwrap();
    let mut err = String::new();
    std::io::Read::read_to_string(&mut first.stderr.take().unwrap(), &mut err).unwrap();
    assert!(
        !status.success() && err.contains("re-run to continue"),
        "{status}: {err}"
    );
    dist.signal("CONT");
    local = local.restart();
    let rerun = import_list(&local, &authfile, &list).output().unwrap();
    let rerun_out = text(&rerun.stdout);
    eprintln!("re-run after the kill:\n{rerun_out}");
    assert!(
        rerun.status.success(),
        "{rerun_out}\n{}",
        text(&rerun.stderr)
    );
    let (imported, failed, _, bytes, _) = summary(&rerun_out);
    assert_eq!((imported, failed), (3, 0), "{rerun_out}");
    let first_line = rerun_out.lines().find(|l| l.contains(&many[0])).unwrap();
    assert!(
        first_line.contains("0 blobs fetched"),
        "the finished image is not fetched again: {first_line}"
    );
    // Each image's own layer is about `big` bytes; the base is held since part 1.
    assert!(bytes > 0, "image c at least was missing: {rerun_out}");
    assert!(
        bytes < 2 * big as u64 + (1 << 20),
        "only b (in part) and c were fetched: {rerun_out}"
    );
    for (r, name) in many.iter().zip(["a", "b", "c"]) {
        let v = local.json(&format!(
            "/amber/v1/resolve/{}/many/{name}/v1",
            mirror(&d.addr)
        ));
        assert_eq!(v["source"]["reference"], r.as_str(), "{v}");
    }

    // 3. An upstream blob whose bytes do not match its digest.
    let (_, _, bad_layers) = rt.block_on(d.image("bad/img", "v1", false, "amd64", "bad", 4096));
    let victim = dist.blob_data(&bad_layers[1]);
    let mut bytes = std::fs::read(&victim).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    std::fs::write(&victim, &bytes).unwrap();
    let bad_ref = format!("{}/bad/img:v1", d.addr);
    let out = import(&local, &authfile, &[&bad_ref]);
    let bad_out = text(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{bad_out}");
    assert!(
        bad_out.contains(&format!("failed   {bad_ref}")) && bad_out.contains("integrity error"),
        "{bad_out}"
    );
    let bad_repo = format!("{}/bad/img", mirror(&d.addr));
    let http = client();
    rt.block_on(async {
        // A manifest GET pulls through (the upstream is configured): refused the same way.
        let r = http
            .get(local.url(&format!("/v2/{bad_repo}/manifests/v1")))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 502);
        let body = r.text().await.unwrap();
        assert!(
            body.contains("UPSTREAM_FAILED") && body.contains("integrity error"),
            "{body}"
        );
        for path in [
            format!("/v2/{bad_repo}/tags/list"),
            format!("/v2/{bad_repo}/blobs/{}", bad_layers[0]),
            format!("/v2/{bad_repo}/blobs/{}", bad_layers[1]),
        ] {
            let r = http.get(local.url(&path)).send().await.unwrap();
            assert_eq!(r.status(), 404, "{path} after a refused import");
        }
    });
    assert!(
        !local.blob_file(&bad_layers[1]).exists(),
        "the bad bytes are not stored"
    );

    // 4. Pull-through: never imported, run by its reference.
    rt.block_on(d.image("pt/img", "v1", true, "amd64", "first", 0));
    let pt = format!("{}/pt/img:v1", d.addr);
    let run = node.amber(&local, &["run", &pt, "--", "cat", "/which"]);
    assert_eq!(text(&run.stdout), "first\n", "{}", text(&run.stderr));
    // The upstream's tag moves, then the upstream goes away.
    rt.block_on(d.image("pt/img", "v1", true, "amd64", "second", 0));
    drop(dist);
    let run = node.amber(&local, &["run", &pt, "--", "cat", "/which"]);
    assert_eq!(text(&run.stdout), "first\n", "{}", text(&run.stderr));
    // An upstream image nobody has: a clear not-found.
    let missing = node.amber(
        &local,
        &["run", &format!("{}/pt/none:v1", a.addr), "--", "true"],
    );
    assert!(!missing.status.success());
    assert!(
        text(&missing.stderr).contains("MANIFEST_UNKNOWN"),
        "{}",
        text(&missing.stderr)
    );
    drop(amber_up);
}
