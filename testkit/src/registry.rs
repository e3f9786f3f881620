//! The real `amber-registry serve` on a loopback port with its own data directory, and
//! the HTTP helpers tests use against it (blobs, manifests, resolve, metrics, chunks).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use sha2::Digest as _;

use crate::tools::{proc_status_kib, sha256, workspace_bin};

/// Where a test registry keeps its objects.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Storage {
    Fs,
    /// The moto server scripts/test started (AMBER_TEST_S3_ENDPOINTS), under a fresh prefix.
    S3,
}

/// The URL of the S3-compatible server called `name` that scripts/test started.
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

/// A running `amber-registry serve`; stopped (SIGKILL) when dropped, failing the test if it
/// panicked meanwhile. Its stderr goes to `registry.log` in its data directory.
pub struct Registry {
    child: Child,
    pub addr: String,
    pub data: PathBuf,
    /// Further `serve` arguments it was started with (kept across restarts).
    extra: Vec<String>,
    _tmp: Option<tempfile::TempDir>,
}

impl Registry {
    /// A registry on a fresh data directory (index) and, for S3, a fresh bucket prefix.
    pub fn start_on(storage: Storage, extra: &[&str]) -> Registry {
        match storage {
            Storage::Fs => Registry::start(extra),
            Storage::S3 => {
                let prefix = format!("test-{}/", uuid::Uuid::new_v4());
                let mut args = s3_args("moto", &prefix);
                args.extend(extra.iter().map(|s| s.to_string()));
                let args: Vec<&str> = args.iter().map(String::as_str).collect();
                Registry::start(&args)
            }
        }
    }

    /// A registry on a fresh data directory.
    pub fn start(extra: &[&str]) -> Registry {
        let tmp = tempfile::tempdir().expect("temp dir");
        let mut s = Registry::start_in(tmp.path(), extra);
        s._tmp = Some(tmp);
        s
    }

    /// A registry on `data` (kept by the caller, e.g. across a restart), any free port.
    pub fn start_in(data: &Path, extra: &[&str]) -> Registry {
        Registry::start_at(data, "127.0.0.1:0", extra)
    }

    /// A registry on `data` listening on `listen`.
    pub fn start_at(data: &Path, listen: &str, extra: &[&str]) -> Registry {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(data.join("registry.log"))
            .expect("log file");
        let mut child = Command::new(workspace_bin("amber-registry"))
            .arg("serve")
            .arg("--listen")
            .arg(listen)
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
        Registry {
            child,
            addr,
            data: data.to_path_buf(),
            extra: extra.iter().map(|s| s.to_string()).collect(),
            _tmp: None,
        }
    }

    /// Stops the process and starts it again on the same address, data and arguments.
    pub fn restart(self) -> Registry {
        let extra = self.extra.clone();
        let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
        self.restart_with(&extra)
    }

    /// Stops the process and starts it again on the same address and data, with `extra`
    /// as its further arguments.
    pub fn restart_with(mut self, extra: &[&str]) -> Registry {
        let (data, addr, tmp) = (self.data.clone(), self.addr.clone(), self._tmp.take());
        drop(self);
        let mut r = Registry::start_at(&data, &addr, extra);
        r._tmp = tmp;
        r
    }

    /// `http://ADDR` + `path` (`url("")` is the registry's base URL).
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGTERM, as a service manager stops it; returns the exit status once the process
    /// has ended (it drains requests and stops its conversions first).
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        let pid = libc::pid_t::try_from(self.child.id()).expect("a pid");
        // SAFETY: signals our own child process, which has not been waited for yet.
        let sent = unsafe { libc::kill(pid, libc::SIGTERM) };
        assert_eq!(sent, 0, "SIGTERM to amber-registry {pid}");
        self.child.wait().expect("waiting for amber-registry")
    }

    /// What the process wrote to its log (every start on this data directory).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.data.join("registry.log")).unwrap_or_default()
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

    /// GET `path` from a thread without a runtime; asserts success.
    pub fn get(&self, path: &str) -> Vec<u8> {
        let url = self.url(path);
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async {
            let r = reqwest::get(&url).await.expect("GET");
            assert!(r.status().is_success(), "GET {url}: {}", r.status());
            r.bytes().await.expect("body").to_vec()
        })
    }

    pub fn json(&self, path: &str) -> serde_json::Value {
        serde_json::from_slice(&self.get(path)).expect("a JSON answer")
    }

    /// A sample from /metrics, summed over every label set whose labels contain `labels`.
    pub fn metric_sum(&self, name: &str, labels: &str) -> f64 {
        String::from_utf8(self.get("/metrics"))
            .expect("metrics are text")
            .lines()
            .filter(|l| {
                l.starts_with(name)
                    && (l[name.len()..].starts_with(' ') || l[name.len()..].starts_with('{'))
                    && l.contains(labels)
            })
            .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
            .sum()
    }

    /// The env digest an image was converted to; the conversion must be `done`.
    pub fn env_of(&self, name: &str, reference: &str) -> String {
        let v = self.json(&format!("/amber/v1/resolve/{name}/{reference}"));
        assert_eq!(v["state"], "done", "{v}");
        v["env_digest"].as_str().unwrap().to_string()
    }

    /// sha256 of the device the env's manifest describes, assembled here from the
    /// registry's chunks (zstd, checked against their blake3 ids) and zero gaps.
    pub fn device_sha256(&self, env: &str) -> String {
        let envelope = self.json(&format!("/amber/v1/envs/{env}"));
        let m = &envelope["manifest"];
        let size = m["device_size"].as_u64().unwrap();
        let mut h = sha2::Sha256::new();
        let mut at = 0u64;
        let zeros = |h: &mut sha2::Sha256, n: u64| {
            let z = vec![0u8; 1 << 20];
            let mut left = n;
            while left > 0 {
                let k = left.min(z.len() as u64) as usize;
                h.update(&z[..k]);
                left -= k as u64;
            }
        };
        for e in m["extents"].as_array().unwrap() {
            let (off, len) = (e["offset"].as_u64().unwrap(), e["length"].as_u64().unwrap());
            let chunk = e["chunk"].as_str().unwrap();
            assert!(off >= at, "extents overlap");
            zeros(&mut h, off - at);
            let data = verified_chunk(&self.get(&format!("/amber/v1/chunks/{chunk}")), chunk, len);
            h.update(&data);
            at = off + len;
        }
        zeros(&mut h, size - at);
        hex::encode(h.finalize())
    }

    /// Waits until the registry has recompressed every chunk its conversions wrote at
    /// their fast level (`amber_chunks_to_recompress` reads 0): a test that changes a
    /// chunk's file must wait, or recompression may replace the file after it. Gives up
    /// after 10 minutes. Not from an async test: see [`recompressed`].
    pub fn wait_recompressed(&self) {
        for _ in 0..60_000 {
            if self.metric_sum("amber_chunks_to_recompress", "") == 0.0 {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        panic!("the registry never finished recompressing its chunks");
    }

    /// The store file of a chunk (the fs backend's layout, docs/architecture.md); see
    /// [`Registry::wait_recompressed`] before changing it.
    pub fn chunk_file(&self, chunk: &str) -> PathBuf {
        let hex = chunk.strip_prefix("blake3:").unwrap();
        self.data
            .join("store/chunks/blake3")
            .join(&hex[..2])
            .join(hex)
    }

    /// The store file of a blob (the fs backend's layout).
    pub fn blob_file(&self, digest: &str) -> PathBuf {
        let (alg, hex) = digest.split_once(':').expect("algorithm:hex");
        self.data
            .join("store/blobs")
            .join(alg)
            .join(&hex[..2])
            .join(hex)
    }
}

impl Drop for Registry {
    /// SIGKILL; then, unless the test is failing already, fails it if the registry
    /// panicked at any time (a panic in a request task answers 500 or drops the
    /// connection, which a test may not notice).
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            return;
        }
        let log = self.log();
        if let Some(at) = log.find("panicked at") {
            let from = log[..at].rfind('\n').map_or(0, |n| n + 1);
            let to = log[at..].find("\n\n").map_or(log.len(), |n| at + n);
            panic!("amber-registry panicked: {}", &log[from..to]);
        }
    }
}

/// An HTTP client that does not follow redirects (tests look at them).
pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .expect("client")
}

/// Starts an upload session in `repo` (POST, 202); its location.
pub async fn start_upload(s: &Registry, repo: &str) -> String {
    let r = client()
        .post(s.url(&format!("/v2/{repo}/blobs/uploads/")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    r.headers()["location"].to_str().unwrap().to_string()
}

/// Pushes `data` as a blob of `repo` in one request; asserts 201; returns its digest.
pub async fn push_blob(s: &Registry, repo: &str, data: &[u8]) -> String {
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
    s: &Registry,
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
pub async fn image_manifest(s: &Registry, repo: &str, seed: &str, extra: &str) -> String {
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

/// Pushes an image of one gzip layer (`layer_tar`) and its config as `repo:tag`; returns
/// the manifest digest.
pub async fn push_image(
    s: &Registry,
    repo: &str,
    tag: &str,
    layer_tar: &[u8],
    config: &str,
) -> String {
    let layer = crate::layer::gzip(layer_tar);
    let ld = push_blob(s, repo, &layer).await;
    let cd = push_blob(s, repo, config.as_bytes()).await;
    let manifest = format!(
        r#"{{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"{cd}","size":{}}},"layers":[{{"mediaType":"application/vnd.oci.image.layer.v1.tar+gzip","digest":"{ld}","size":{}}}]}}"#,
        config.len(),
        layer.len()
    );
    let r = put_manifest(
        s,
        repo,
        tag,
        "application/vnd.oci.image.manifest.v1+json",
        &manifest,
    )
    .await;
    assert_eq!(r.status(), 201, "{}", r.text().await.unwrap());
    sha256(manifest.as_bytes())
}

/// The spec error code of an error response.
pub async fn error_code(r: reqwest::Response) -> String {
    let v: serde_json::Value = r.json().await.expect("error body is JSON");
    v["errors"][0]["code"]
        .as_str()
        .expect("errors[0].code")
        .to_string()
}

/// The value of an unlabelled counter or gauge in a `/metrics` text (0 when absent).
pub fn metric(text: &str, name: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .map(|v| v.trim().parse::<f64>().unwrap() as u64)
        .unwrap_or(0)
}

/// The registry's `/metrics` text.
pub async fn metrics_text(s: &Registry) -> String {
    client()
        .get(s.url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// [`Registry::wait_recompressed`] for an async test.
pub async fn recompressed(s: &Registry) {
    for _ in 0..60_000 {
        if metric(&metrics_text(s).await, "amber_chunks_to_recompress") == 0 {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    panic!("the registry never finished recompressing its chunks");
}

/// Polls the resolve endpoint until the conversion settles (done or failed); gives up
/// after 10 minutes (the fidelity images convert for minutes on a loaded machine).
pub async fn settled(s: &Registry, repo: &str, reference: &str) -> serde_json::Value {
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

/// GET `path` and decode its JSON answer (any status: the caller checks the body).
pub async fn get_json<T: serde::de::DeserializeOwned>(s: &Registry, path: &str) -> T {
    client()
        .get(s.url(path))
        .send()
        .await
        .unwrap_or_else(|e| panic!("GET {path}: {e}"))
        .json()
        .await
        .unwrap_or_else(|e| panic!("GET {path}: the answer is not the JSON expected: {e}"))
}

/// GET `path`; its body (any status).
pub async fn get_bytes(s: &Registry, path: &str) -> Vec<u8> {
    client()
        .get(s.url(path))
        .send()
        .await
        .unwrap_or_else(|e| panic!("GET {path}: {e}"))
        .bytes()
        .await
        .unwrap_or_else(|e| panic!("GET {path}: reading the body: {e}"))
        .to_vec()
}

/// A chunk from the amber API, decompressed and checked against its id and length.
pub async fn chunk(s: &Registry, id: &str, len: u64) -> Vec<u8> {
    verified_chunk(
        &get_bytes(s, &format!("/amber/v1/chunks/{id}")).await,
        id,
        len,
    )
}

/// A stored chunk's bytes, decompressed and checked against its id and length.
fn verified_chunk(stored: &[u8], id: &str, len: u64) -> Vec<u8> {
    let data = zstd::bulk::decompress(stored, len as usize).expect("a chunk is one zstd frame");
    assert_eq!(format!("blake3:{}", blake3::hash(&data).to_hex()), id);
    assert_eq!(data.len() as u64, len);
    data
}
