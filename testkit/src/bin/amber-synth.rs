//! `amber-synth`: pushes synthetic task images of a realistic shape to any OCI registry,
//! for the metadata-at-scale benchmark (`scripts/bench --only scale`).
//!
//! Shape, all of it a function of the image number (the same arguments push the same
//! bytes): repositories `synth/rNNNNNNN` of `--tags-per-repo` images tagged `v0`, `v1`, …;
//! every image is one of `--bases` shared base layers (about 200 KiB of small files,
//! mounted from `synth/base` once per repository) plus a layer of its own (a few small
//! files: the task) and a config of its own; every `--referrer-every`th image also gets a
//! referrer (an artifact manifest whose subject is the image, as an SBOM or a signature
//! is). Requests go over HTTP/1.1 with `--concurrency` connections; a worker pushes one
//! repository at a time.
//!
//! `push` pushes images `--from` (default 0) to `--images` and writes one line per image (`repo<TAB>tag<TAB>manifest digest`) to `--list`
//! (appended), and prints a JSON summary on stdout; `--seconds` stops starting new repositories after that
//! long (for a peer measured "at the size it reaches in the same time").
//! `wait-converted` resolves every image of a list through amber's
//! `/amber/v1/resolve` until each has its env, and prints how long that took.

use std::io::{BufRead, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sha2::{Digest as _, Sha256};

const MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
const CONFIG: &str = "application/vnd.oci.image.config.v1+json";
const LAYER: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
const EMPTY: &str = "application/vnd.oci.empty.v1+json";
const REFERRER_TYPE: &str = "application/vnd.example.task-report.v1+json";

struct Args {
    registry: String,
    /// The first image to push (rounded down to a whole repository): a second push
    /// with `--from` = the first's `--images` grows the same registry.
    from: u64,
    images: u64,
    tags_per_repo: u64,
    bases: u64,
    referrer_every: u64,
    concurrency: usize,
    seconds: Option<f64>,
    list: String,
}

fn usage() -> ! {
    eprintln!(
        "usage: amber-synth push --registry HOST:PORT --images N --list FILE [--from N] \
         [--tags-per-repo 8] [--bases 8] [--referrer-every 4] [--concurrency 64] [--seconds S]\n\
         \x20      amber-synth wait-converted --registry HOST:PORT --list FILE [--concurrency 64]"
    );
    std::process::exit(2)
}

fn parse(args: &[String]) -> Args {
    let mut a = Args {
        registry: String::new(),
        from: 0,
        images: 0,
        tags_per_repo: 8,
        bases: 8,
        referrer_every: 4,
        concurrency: 64,
        seconds: None,
        list: String::new(),
    };
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let value = it.next().unwrap_or_else(|| usage());
        let num = || value.parse::<u64>().unwrap_or_else(|_| usage());
        match flag.as_str() {
            "--registry" => a.registry = value.clone(),
            "--from" => a.from = num(),
            "--images" => a.images = num(),
            "--tags-per-repo" => a.tags_per_repo = num().max(1),
            "--bases" => a.bases = num().max(1),
            "--referrer-every" => a.referrer_every = num(),
            "--concurrency" => a.concurrency = num().max(1) as usize,
            "--seconds" => a.seconds = Some(value.parse().unwrap_or_else(|_| usage())),
            "--list" => a.list = value.clone(),
            _ => usage(),
        }
    }
    if a.registry.is_empty() || a.list.is_empty() {
        usage()
    }
    a
}

fn sha256(b: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(b)))
}

/// A gzip-compressed tar of `files` (path, bytes), with fixed owners and times; its
/// digest and its uncompressed (diff id) digest.
fn layer(files: &[(String, Vec<u8>)]) -> (Vec<u8>, String) {
    let mut tar = tar::Builder::new(Vec::new());
    for (path, data) in files {
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_mtime(1_700_000_000);
        h.set_uid(0);
        h.set_gid(0);
        h.set_entry_type(tar::EntryType::Regular);
        tar.append_data(&mut h, path, &data[..])
            .expect("tar in memory");
    }
    let raw = tar.into_inner().expect("tar in memory");
    let diff_id = sha256(&raw);
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(&raw).expect("gzip in memory");
    (gz.finish().expect("gzip in memory"), diff_id)
}

/// Base layer `b`: 200 small files of pseudo-random text (a package tree's shape).
fn base_layer(b: u64) -> (Vec<u8>, String) {
    let mut files = Vec::new();
    for f in 0..200u64 {
        let mut xof = blake3::Hasher::new();
        xof.update(format!("base {b} file {f}").as_bytes());
        let mut data = vec![0u8; 512 + (f as usize * 37) % 1536];
        xof.finalize_xof().fill(&mut data);
        // Text-like, so it compresses as source files do.
        let text: Vec<u8> = data
            .iter()
            .map(|x| b"abcdefghij klmnop\n"[*x as usize % 18])
            .collect();
        files.push((format!("usr/lib/base{b}/pkg{:03}/mod{f}.py", f / 10), text));
    }
    layer(&files)
}

/// The image's own layer: the task's files.
fn task_layer(i: u64) -> (Vec<u8>, String) {
    layer(&[
        (
            "task/task.json".into(),
            format!("{{\"task\":{i},\"split\":\"train\",\"timeout\":600}}\n").into_bytes(),
        ),
        (
            "task/run.sh".into(),
            format!("#!/bin/sh\nexec python3 /task/solve.py --task {i}\n").into_bytes(),
        ),
        (
            "task/tests/test_task.py".into(),
            format!("def test_task_{i}():\n    assert solve({i}) == {}\n", i * 7).into_bytes(),
        ),
    ])
}

struct Base {
    gz: Vec<u8>,
    digest: String,
    diff_id: String,
}

struct Client {
    http: reqwest::Client,
    base_url: String,
    requests: AtomicU64,
}

impl Client {
    async fn send(
        &self,
        req: reqwest::RequestBuilder,
        what: &str,
    ) -> anyhow::Result<reqwest::Response> {
        self.requests.fetch_add(1, Ordering::Relaxed);
        let resp = req
            .send()
            .await
            .map_err(|e| anyhow::anyhow!("{what}: {e}"))?;
        if !resp.status().is_success() {
            let status = resp.status();
            let body = resp.text().await.unwrap_or_default();
            anyhow::bail!("{what}: {status}: {body}");
        }
        Ok(resp)
    }

    /// A monolithic upload (POST with `?digest=`), or a mount where `from` is given.
    async fn blob(
        &self,
        repo: &str,
        digest: &str,
        bytes: &[u8],
        from: Option<&str>,
    ) -> anyhow::Result<()> {
        let url = format!("{}/v2/{repo}/blobs/uploads/", self.base_url);
        if let Some(from) = from {
            let resp = self
                .send(
                    self.http
                        .post(&url)
                        .query(&[("mount", digest), ("from", from)]),
                    &format!("mount of {digest} into {repo}"),
                )
                .await?;
            if resp.status() == reqwest::StatusCode::CREATED {
                return Ok(());
            }
            // 202: not mountable here; finish the session it opened with the bytes.
            return self.blob_session(repo, digest, bytes, resp).await;
        }
        let resp = self
            .send(
                self.http
                    .post(&url)
                    .query(&[("digest", digest)])
                    .header("content-type", "application/octet-stream")
                    .body(bytes.to_vec()),
                &format!("upload of {digest} to {repo}"),
            )
            .await?;
        if resp.status() == reqwest::StatusCode::ACCEPTED {
            // A registry without monolithic POST opened a session: PUT the bytes to it.
            return self.blob_session(repo, digest, bytes, resp).await;
        }
        Ok(())
    }

    /// Finishes the upload session `resp` opened with `bytes` in one PUT.
    async fn blob_session(
        &self,
        repo: &str,
        digest: &str,
        bytes: &[u8],
        resp: reqwest::Response,
    ) -> anyhow::Result<()> {
        let location = resp
            .headers()
            .get("location")
            .and_then(|l| l.to_str().ok())
            .ok_or_else(|| anyhow::anyhow!("upload to {repo}: 202 without a Location"))?
            .to_string();
        let url = if location.starts_with('/') {
            format!("{}{location}", self.base_url)
        } else {
            location
        };
        let sep = if url.contains('?') { '&' } else { '?' };
        self.send(
            self.http
                .put(format!("{url}{sep}digest={digest}"))
                .header("content-type", "application/octet-stream")
                .body(bytes.to_vec()),
            &format!("upload of {digest} to {repo}"),
        )
        .await?;
        Ok(())
    }

    async fn manifest(&self, repo: &str, reference: &str, body: Vec<u8>) -> anyhow::Result<String> {
        let digest = sha256(&body);
        self.send(
            self.http
                .put(format!("{}/v2/{repo}/manifests/{reference}", self.base_url))
                .header("content-type", MANIFEST)
                .body(body),
            &format!("manifest {repo}:{reference}"),
        )
        .await?;
        Ok(digest)
    }
}

fn descriptor(media_type: &str, digest: &str, size: usize) -> serde_json::Value {
    serde_json::json!({"mediaType": media_type, "digest": digest, "size": size})
}

/// Pushes repository `r`: its images `r * tags_per_repo ..`, below `a.images`.
async fn push_repo(
    c: &Client,
    a: &Args,
    bases: &[Base],
    r: u64,
    out: &Mutex<Vec<String>>,
) -> anyhow::Result<u64> {
    let repo = format!("synth/r{r:07}");
    let first = r * a.tags_per_repo;
    let last = (first + a.tags_per_repo).min(a.images);
    let mut mounted = vec![false; bases.len()];
    let empty = b"{}";
    let empty_digest = sha256(empty);
    let mut empty_pushed = false;
    let mut lines = Vec::new();
    for i in first..last {
        let b = (i % a.bases) as usize;
        let base = &bases[b];
        if !mounted[b] {
            c.blob(&repo, &base.digest, &base.gz, Some("synth/base"))
                .await?;
            mounted[b] = true;
        }
        let (own, own_diff) = task_layer(i);
        let own_digest = sha256(&own);
        c.blob(&repo, &own_digest, &own, None).await?;
        let config = serde_json::to_vec(&serde_json::json!({
            "architecture": "amd64",
            "os": "linux",
            "config": {
                "Env": ["PATH=/usr/local/bin:/usr/bin:/bin", format!("TASK_ID={i}")],
                "Cmd": ["/bin/sh", "/task/run.sh"],
                "WorkingDir": "/task",
                "Labels": {"dev.example.task": i.to_string(), "dev.example.suite": format!("suite-{}", i % 97)}
            },
            "rootfs": {"type": "layers", "diff_ids": [base.diff_id, own_diff]},
            "history": [{"created_by": format!("base {b}")}, {"created_by": format!("COPY task {i}")}]
        }))?;
        let config_digest = sha256(&config);
        c.blob(&repo, &config_digest, &config, None).await?;
        let manifest = serde_json::to_vec(&serde_json::json!({
            "schemaVersion": 2,
            "mediaType": MANIFEST,
            "config": descriptor(CONFIG, &config_digest, config.len()),
            "layers": [
                descriptor(LAYER, &base.digest, base.gz.len()),
                descriptor(LAYER, &own_digest, own.len()),
            ],
            "annotations": {"org.opencontainers.image.title": format!("task {i}")}
        }))?;
        let size = manifest.len();
        let tag = format!("v{}", i - first);
        let digest = c.manifest(&repo, &tag, manifest).await?;
        if a.referrer_every > 0 && i % a.referrer_every == 0 {
            if !empty_pushed {
                c.blob(&repo, &empty_digest, empty, None).await?;
                empty_pushed = true;
            }
            let report = format!("{{\"task\":{i},\"passed\":true,\"tests\":12}}").into_bytes();
            let report_digest = sha256(&report);
            c.blob(&repo, &report_digest, &report, None).await?;
            let referrer = serde_json::to_vec(&serde_json::json!({
                "schemaVersion": 2,
                "mediaType": MANIFEST,
                "artifactType": REFERRER_TYPE,
                "config": descriptor(EMPTY, &empty_digest, empty.len()),
                "layers": [descriptor(REFERRER_TYPE, &report_digest, report.len())],
                "subject": descriptor(MANIFEST, &digest, size),
            }))?;
            let rd = sha256(&referrer);
            c.manifest(&repo, &rd, referrer).await?;
        }
        lines.push(format!("{repo}\t{tag}\t{digest}"));
    }
    out.lock().expect("list lock").extend(lines);
    Ok(last - first)
}

async fn push(a: Args) -> anyhow::Result<()> {
    let c = Arc::new(client(&a.registry, a.concurrency)?);
    let bases: Arc<Vec<Base>> = Arc::new(
        (0..a.bases)
            .map(|b| {
                let (gz, diff_id) = base_layer(b);
                Base {
                    digest: sha256(&gz),
                    gz,
                    diff_id,
                }
            })
            .collect(),
    );
    for base in bases.iter() {
        c.blob("synth/base", &base.digest, &base.gz, None).await?;
    }
    let repos = a.images.div_ceil(a.tags_per_repo);
    let next = Arc::new(AtomicU64::new(a.from / a.tags_per_repo));
    let pushed = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let out = Arc::new(Mutex::new(Vec::new()));
    let start = Instant::now();
    let a = Arc::new(a);
    let mut workers = Vec::new();
    for _ in 0..a.concurrency {
        let (c, a, bases, next, pushed, stop, out) = (
            c.clone(),
            a.clone(),
            bases.clone(),
            next.clone(),
            pushed.clone(),
            stop.clone(),
            out.clone(),
        );
        workers.push(tokio::spawn(async move {
            loop {
                if stop.load(Ordering::Relaxed) {
                    return Ok::<(), anyhow::Error>(());
                }
                if let Some(s) = a.seconds {
                    if start.elapsed().as_secs_f64() >= s {
                        stop.store(true, Ordering::Relaxed);
                        return Ok(());
                    }
                }
                let r = next.fetch_add(1, Ordering::Relaxed);
                if r >= repos {
                    return Ok(());
                }
                let n = push_repo(&c, &a, &bases, r, &out).await?;
                let done = pushed.fetch_add(n, Ordering::Relaxed) + n;
                if done / 10_000 != (done - n) / 10_000 {
                    eprintln!(
                        "amber-synth: {done} images in {:.0} s",
                        start.elapsed().as_secs_f64()
                    );
                }
            }
        }));
    }
    for w in workers {
        w.await??;
    }
    let secs = start.elapsed().as_secs_f64();
    let lines = out.lock().expect("list lock");
    let mut f = std::io::BufWriter::new(
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&a.list)?,
    );
    for l in lines.iter() {
        writeln!(f, "{l}")?;
    }
    f.flush()?;
    let images = pushed.load(Ordering::Relaxed);
    println!(
        "{}",
        serde_json::json!({
            "images": images,
            "repositories": lines.len() as u64 / a.tags_per_repo.max(1),
            "seconds": secs,
            "images_per_second": images as f64 / secs,
            "requests": c.requests.load(Ordering::Relaxed),
        })
    );
    Ok(())
}

fn client(registry: &str, concurrency: usize) -> anyhow::Result<Client> {
    Ok(Client {
        http: reqwest::Client::builder()
            .pool_max_idle_per_host(concurrency)
            .timeout(Duration::from_secs(120))
            .build()?,
        base_url: format!("http://{registry}"),
        requests: AtomicU64::new(0),
    })
}

async fn wait_converted(a: Args) -> anyhow::Result<()> {
    let c = Arc::new(client(&a.registry, a.concurrency)?);
    let list: Vec<String> = std::io::BufReader::new(std::fs::File::open(&a.list)?)
        .lines()
        .collect::<Result<_, _>>()?;
    let list = Arc::new(list);
    let start = Instant::now();
    let next = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let mut workers = Vec::new();
    for _ in 0..a.concurrency {
        let (c, list, next, failed) = (c.clone(), list.clone(), next.clone(), failed.clone());
        workers.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed) as usize;
                let Some(line) = list.get(i) else {
                    return Ok::<(), anyhow::Error>(());
                };
                let mut parts = line.split('\t');
                let (repo, tag) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
                let mut wait = Duration::from_millis(50);
                loop {
                    let resp = c
                        .send(
                            c.http
                                .get(format!("{}/amber/v1/resolve/{repo}/{tag}", c.base_url)),
                            &format!("resolve {repo}:{tag}"),
                        )
                        .await?;
                    let r: amber_resolve::Resolve = resp.json().await?;
                    match r.state.as_str() {
                        "done" => break,
                        "failed" => {
                            failed.fetch_add(1, Ordering::Relaxed);
                            eprintln!("amber-synth: {repo}:{tag} failed to convert: {:?}", r.error);
                            break;
                        }
                        // Polling a remote service: back off while it works.
                        _ => tokio::time::sleep(wait).await,
                    }
                    wait = (wait * 2).min(Duration::from_secs(2));
                }
            }
        }));
    }
    for w in workers {
        w.await??;
    }
    println!(
        "{}",
        serde_json::json!({
            "images": list.len(),
            "failed": failed.load(Ordering::Relaxed),
            "seconds": start.elapsed().as_secs_f64(),
            "requests": c.requests.load(Ordering::Relaxed),
        })
    );
    Ok(())
}

/// The fields of amber's resolve answer this tool reads.
mod amber_resolve {
    #[derive(serde::Deserialize)]
    pub struct Resolve {
        pub state: String,
        pub error: Option<String>,
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some((cmd, rest)) = args.split_first() else {
        usage()
    };
    let a = parse(rest);
    match cmd.as_str() {
        "push" => push(a).await,
        "wait-converted" => wait_converted(a).await,
        _ => usage(),
    }
}
