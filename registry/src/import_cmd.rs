//! `amber-registry import`: asks a running registry to import images from other
//! registries (`POST /amber/v1/imports`) and shows its progress: one display for the
//! run (images done, bytes fetched) and a line per image on stdout.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use amber_api::registry::{ImportEvent, ImportRequest, UpstreamCredential, IMPORTS_PATH};
use amber_registry::upstream::docker_config_credentials;
use anyhow::Context as _;
use futures_util::StreamExt;

#[derive(clap::Args)]
pub struct ImportArgs {
    /// What to import: `host/name:tag`, `host/name@sha256:…`, or `host/name` for every tag
    /// of a repository (a short name is Docker Hub's). Each lands in amber as
    /// `<host>/<name>` (`:` in the host as `-`: `127.0.0.1-5001/name`).
    sources: Vec<String>,
    /// A file of references, one per line (`#` starts a comment).
    #[arg(long)]
    from_file: Option<PathBuf>,
    /// Every platform of a multi-platform image (default: linux/amd64, under the tag).
    #[arg(long)]
    all_platforms: bool,
    /// Images imported at once.
    #[arg(long, default_value_t = 4)]
    jobs: usize,
    /// The amber registry to import into.
    #[arg(long, env = "AMBER_REGISTRY", default_value = "http://127.0.0.1:5000")]
    registry: String,
    /// Credentials, for the upstreams and for amber itself: a Docker config.json
    /// (default `$DOCKER_CONFIG/config.json`, else `~/.docker/config.json`, if present).
    #[arg(long)]
    authfile: Option<PathBuf>,
}

fn default_authfile() -> Option<PathBuf> {
    let dir = std::env::var_os("DOCKER_CONFIG")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".docker")))?;
    Some(dir.join("config.json")).filter(|p| p.exists())
}

fn read_sources(args: &ImportArgs) -> anyhow::Result<Vec<String>> {
    let mut sources = args.sources.clone();
    if let Some(f) = &args.from_file {
        let text = std::fs::read_to_string(f)
            .with_context(|| format!("reading the list of references {}", f.display()))?;
        sources.extend(
            text.lines()
                .map(|l| l.split('#').next().unwrap_or("").trim())
                .filter(|l| !l.is_empty())
                .map(str::to_string),
        );
    }
    anyhow::ensure!(
        !sources.is_empty(),
        "nothing to import: name references, or --from-file FILE"
    );
    Ok(sources)
}

fn host_of(url: &str) -> &str {
    let rest = url.split_once("://").map(|(_, r)| r).unwrap_or(url);
    rest.split('/').next().unwrap_or(rest)
}

/// Runs the import; the exit status is a failure when any image failed.
pub async fn run(args: ImportArgs) -> anyhow::Result<std::process::ExitCode> {
    let sources = read_sources(&args)?;
    let credentials: BTreeMap<String, UpstreamCredential> =
        match args.authfile.clone().or_else(default_authfile) {
            Some(path) => docker_config_credentials(&path)?,
            None => BTreeMap::new(),
        };
    let registry = args.registry.trim_end_matches('/').to_string();
    let mut req = reqwest::Client::new()
        .post(format!("{registry}{IMPORTS_PATH}"))
        .json(&ImportRequest {
            sources,
            all_platforms: args.all_platforms,
            credentials: credentials.clone(),
            jobs: Some(args.jobs),
        });
    if let Some(UpstreamCredential::Basic { username, password }) =
        credentials.get(host_of(&registry))
    {
        req = req.basic_auth(username, Some(password));
    }
    let resp = req
        .send()
        .await
        .with_context(|| format!("POST {registry}{IMPORTS_PATH}"))?;
    if !resp.status().is_success() {
        let status = resp.status();
        let body = resp.text().await.unwrap_or_default();
        anyhow::bail!("{registry} refused the import: HTTP {status}: {body}");
    }
    let bars = indicatif::MultiProgress::new();
    let style = |t: &str| indicatif::ProgressStyle::with_template(t).expect("a valid template");
    let images = bars.add(
        indicatif::ProgressBar::new(0)
            .with_style(style("{prefix:>8} [{bar:30}] {pos}/{len} images {msg}")),
    );
    images.set_prefix("import");
    let bytes = bars.add(indicatif::ProgressBar::new(0).with_style(style(
        "{prefix:>8} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
    )));
    bytes.set_prefix("fetch");
    let mut body = resp.bytes_stream();
    let mut pending = Vec::new();
    let mut summary = None;
    let mut handle = |line: &[u8]| -> anyhow::Result<()> {
        if line.iter().all(u8::is_ascii_whitespace) {
            return Ok(());
        }
        let event: ImportEvent = serde_json::from_slice(line).with_context(|| {
            format!(
                "reading the registry's answer: {}",
                String::from_utf8_lossy(line)
            )
        })?;
        match event {
            ImportEvent::Planned { images: n } => images.set_length(n as u64),
            ImportEvent::Started { bytes: n, .. } => bytes.inc_length(n),
            ImportEvent::Fetched { bytes: n } => bytes.inc(n),
            ImportEvent::Finished {
                source,
                target,
                manifest_digest,
                blobs_fetched,
                blobs_present,
                bytes_fetched,
                error,
            } => {
                images.inc(1);
                let line = match (manifest_digest, error) {
                    (_, Some(e)) => format!("failed   {source}: {e}"),
                    (Some(d), None) => format!(
                        "imported {source} -> {target}@{d} ({blobs_fetched} blobs fetched, {bytes_fetched} bytes; {blobs_present} already here)"
                    ),
                    (None, None) => format!("imported {source} -> {target}"),
                };
                bars.suspend(|| println!("{line}"));
            }
            ImportEvent::Summary { .. } => summary = Some(event),
        }
        Ok(())
    };
    while let Some(piece) = body.next().await {
        let piece = piece.context("the registry's answer ended early; re-run to continue")?;
        pending.extend_from_slice(&piece);
        while let Some(nl) = pending.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = pending.drain(..=nl).collect();
            handle(&line)?;
        }
    }
    handle(&pending)?;
    images.finish_and_clear();
    bytes.finish_and_clear();
    let Some(ImportEvent::Summary {
        images_imported,
        images_failed,
        blobs_fetched,
        blobs_present,
        bytes_fetched,
    }) = summary
    else {
        anyhow::bail!("the registry's answer ended before its summary; re-run to continue");
    };
    println!(
        "{images_imported} images imported, {images_failed} failed; {blobs_fetched} blobs fetched ({bytes_fetched} bytes), {blobs_present} already here"
    );
    Ok(if images_failed == 0 {
        std::process::ExitCode::SUCCESS
    } else {
        std::process::ExitCode::FAILURE
    })
}
