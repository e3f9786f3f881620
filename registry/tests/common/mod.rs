//! Test harness: runs the real `amber-registry` binary on a loopback port with its own
//! data directory, and small HTTP helpers for the distribution API.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use sha2::Digest as _;

pub struct Server {
    child: Child,
    pub addr: String,
    pub data: PathBuf,
    _tmp: Option<tempfile::TempDir>,
}

/// Where a test registry keeps its objects.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Storage {
    Fs,
    /// The moto server scripts/test started (AMBER_TEST_S3_ENDPOINTS), under a fresh prefix.
    S3,
}

/// `name=url` of the S3-compatible server called `name` that scripts/test started.
pub fn s3_endpoint(name: &str) -> String {
    let all = std::env::var("AMBER_TEST_S3_ENDPOINTS")
        .expect("AMBER_TEST_S3_ENDPOINTS is not set: scripts/test starts the S3 servers");
    all.split(',')
        .find_map(|p| p.strip_prefix(&format!("{name}=")))
        .unwrap_or_else(|| panic!("no {name} in AMBER_TEST_S3_ENDPOINTS={all}"))
        .to_string()
}

/// Flags that put a registry on the S3 server `name`, under a prefix of its own.
pub fn s3_args(name: &str, prefix: &str) -> Vec<String> {
    vec![
        "--storage".into(),
        "s3".into(),
        "--s3-endpoint".into(),
        s3_endpoint(name),
        "--s3-bucket".into(),
        std::env::var("AMBER_TEST_S3_BUCKET").unwrap_or_else(|_| "amber-test".into()),
        "--s3-prefix".into(),
        prefix.into(),
        "--s3-access-key-id".into(),
        "amber".into(),
        "--s3-secret-access-key".into(),
        "amber-secret".into(),
    ]
}

impl Server {
    /// A registry on a fresh data directory (index) and, for S3, a fresh bucket prefix.
    pub fn start_on(storage: Storage, extra: &[&str]) -> Server {
        match storage {
            Storage::Fs => Server::start(extra),
            Storage::S3 => {
                let prefix = format!("test-{}/", uuid::Uuid::new_v4());
                let mut args = s3_args("moto", &prefix);
                args.extend(extra.iter().map(|s| s.to_string()));
                let args: Vec<&str> = args.iter().map(String::as_str).collect();
                Server::start(&args)
            }
        }
    }

    /// A registry on a fresh data directory.
    pub fn start(extra: &[&str]) -> Server {
        let tmp = tempfile::tempdir().expect("temp dir");
        let mut s = Server::start_in(tmp.path(), extra);
        s._tmp = Some(tmp);
        s
    }

    /// A registry on `data` (kept by the caller, e.g. across a restart).
    pub fn start_in(data: &Path, extra: &[&str]) -> Server {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(data.join("registry.log"))
            .expect("log file");
        let mut child = Command::new(env!("CARGO_BIN_EXE_amber-registry"))
            .arg("serve")
            .arg("--listen")
            .arg("127.0.0.1:0")
            .arg("--data")
            .arg(data)
            .args(extra)
            .env_remove("AMBER_CONFIG")
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log))
            .spawn()
            .expect("starting amber-registry");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("reading the listening line");
        let addr = line
            .trim()
            .strip_prefix("listening on ")
            .unwrap_or_else(|| {
                panic!(
                    "amber-registry did not start: {line:?}; log:\n{}",
                    std::fs::read_to_string(data.join("registry.log")).unwrap_or_default()
                )
            })
            .to_string();
        Server {
            child,
            addr,
            data: data.to_path_buf(),
            _tmp: None,
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL, as a crash would.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Peak resident set size of the server process, in KiB (VmHWM from /proc).
    pub fn peak_rss_kib(&self) -> u64 {
        proc_status_kib(self.pid(), "VmHWM:")
    }
}

pub fn proc_status_kib(pid: u32, field: &str) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc status");
    s.lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("{field} missing from /proc/{pid}/status"))
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn sha256(data: &[u8]) -> String {
    format!("sha256:{}", hex::encode(sha2::Sha256::digest(data)))
}

pub fn sha512(data: &[u8]) -> String {
    format!("sha512:{}", hex::encode(sha2::Sha512::digest(data)))
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .expect("client")
}

/// Pushes `data` as a blob of `repo` in one request; asserts 201.
pub async fn push_blob(s: &Server, repo: &str, data: &[u8]) -> String {
    let d = sha256(data);
    let r = client()
        .post(s.url(&format!("/v2/{repo}/blobs/uploads/?digest={d}")))
        .body(data.to_vec())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201, "{}", r.text().await.unwrap());
    d
}

/// Pushes a manifest; returns the response.
pub async fn put_manifest(
    s: &Server,
    repo: &str,
    reference: &str,
    media_type: &str,
    body: &str,
) -> reqwest::Response {
    client()
        .put(s.url(&format!("/v2/{repo}/manifests/{reference}")))
        .header("Content-Type", media_type)
        .body(body.to_string())
        .send()
        .await
        .unwrap()
}

/// Pushes a config and one layer and returns an OCI image manifest referencing them.
pub async fn image_manifest(s: &Server, repo: &str, seed: &str, extra: &str) -> String {
    let config = format!(r#"{{"architecture":"amd64","os":"linux","seed":"{seed}"}}"#);
    let layer = format!("layer bytes of {seed}");
    let cd = push_blob(s, repo, config.as_bytes()).await;
    let ld = push_blob(s, repo, layer.as_bytes()).await;
    format!(
        r#"{{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"{cd}","size":{}}},"layers":[{{"mediaType":"application/vnd.oci.image.layer.v1.tar+gzip","digest":"{ld}","size":{}}}]{extra}}}"#,
        config.len(),
        layer.len()
    )
}

/// The spec error code of an error response.
pub async fn error_code(r: reqwest::Response) -> String {
    let v: serde_json::Value = r.json().await.expect("error body is JSON");
    v["errors"][0]["code"]
        .as_str()
        .expect("errors[0].code")
        .to_string()
}

/// A tool the test needs; fails loudly when it is missing.
pub fn require_tool(name: &str) -> PathBuf {
    std::env::var_os("PATH")
        .and_then(|p| std::env::split_paths(&p).map(|d| d.join(name)).find(|p| p.is_file()))
        .unwrap_or_else(|| panic!("`{name}` is required by this test but is not on PATH; run scripts/test, which installs it"))
}

/// Runs a command, panicking with its output if it fails; returns stdout.
pub fn run(cmd: &mut Command) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("running {cmd:?}: {e}"));
    if !out.status.success() {
        panic!(
            "{cmd:?} failed with {}:\nstdout:\n{}\nstderr:\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The repository root (for fixtures/).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// Runs the docker CLI against the test engine started by scripts/test.
pub fn docker(args: &[&str]) -> String {
    let host = std::env::var("AMBER_TEST_DOCKER_HOST").expect(
        "AMBER_TEST_DOCKER_HOST is not set: scripts/test starts a Docker engine and sets it",
    );
    require_tool("docker");
    run(Command::new("docker").arg("-H").arg(host).args(args))
}

/// The value of an unlabelled counter or gauge in a `/metrics` text (0 when absent).
pub fn metric(text: &str, name: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .map(|v| v.trim().parse::<f64>().unwrap() as u64)
        .unwrap_or(0)
}

/// The registry's `/metrics` text.
#[allow(dead_code)]
pub async fn metrics_text(s: &Server) -> String {
    client()
        .get(s.url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// Polls the resolve endpoint until the conversion settles (done or failed); gives up
/// after 10 minutes (the fidelity images convert for minutes on a loaded machine).
#[allow(dead_code)]
pub async fn settled(s: &Server, repo: &str, reference: &str) -> serde_json::Value {
    for _ in 0..60_000 {
        let v: serde_json::Value = client()
            .get(s.url(&format!("/amber/v1/resolve/{repo}/{reference}")))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        if v["state"] == "done" || v["state"] == "failed" {
            return v;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    panic!("conversion of {repo}:{reference} never settled");
}
