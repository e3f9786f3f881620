//! The pages: each gathers what it shows through the domain calls, then renders it
//! with `maud` (which escapes every value it is given).

use std::sync::Arc;

use maud::{html, Markup, DOCTYPE};
use serde_json::Value;

use super::format::{bytes, time};
use super::{PageError, PageResult, Viewer, PAGE, SCAN_BUDGET};
use crate::registry::Registry;
use crate::repository::image_conversion;
use crate::store::ObjectKey;
use amber_api::registry::ConversionState;
use amber_oci::digest::Digest;
use amber_oci::manifest::ManifestKind;
use amber_oci::names::{Reference, RepoName};

const STYLE: &str = r#"
body{font:15px/1.45 system-ui,sans-serif;margin:0;color:#1d232a;background:#f7f7f5}
header{background:#2b2118;color:#f4e7d3;padding:.6em 1.5em;display:flex;gap:1.5em;align-items:center}
header a{color:#f8c471;text-decoration:none;font-weight:600}
header form{margin:0}
header .who{margin-left:auto;font-size:.9em}
main{max-width:1100px;margin:1.5em auto;padding:0 1.5em}
h1{font-size:1.5em;margin:.2em 0 .6em;word-break:break-all}
h2{font-size:1.1em;margin:1.6em 0 .5em}
table{border-collapse:collapse;width:100%;background:#fff}
th,td{text-align:left;padding:.35em .6em;border-bottom:1px solid #e4e2dc;vertical-align:top}
th{background:#efece6;font-weight:600}
td.n,th.n{text-align:right;font-variant-numeric:tabular-nums}
code,.digest{font-family:ui-monospace,monospace;font-size:.88em;word-break:break-all}
pre{background:#2b2118;color:#f4e7d3;padding:.8em 1em;white-space:pre-wrap;word-break:break-all;border-radius:4px}
.cards{display:flex;flex-wrap:wrap;gap:1em}
.card{background:#fff;border:1px solid #e4e2dc;border-radius:4px;padding:.7em 1em;min-width:9em}
.card b{display:block;font-size:1.35em}
.state-done{color:#1e7b34}.state-failed{color:#b02a1a}.state-running,.state-queued{color:#a0670a}
.error{background:#fbe9e7;border:1px solid #e0a59c;padding:.6em 1em}
.more{margin:1em 0}
input[type=search],input[type=text],input[type=password]{font-size:1em;padding:.3em .5em;min-width:22em}
dl{display:grid;grid-template-columns:max-content auto;gap:.3em 1.2em;background:#fff;padding:.8em 1em;border:1px solid #e4e2dc}
dt{font-weight:600}dd{margin:0}
"#;

fn layout(viewer: Option<&Viewer>, title: &str, body: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " · amber" }
                style { (maud::PreEscaped(STYLE)) }
            }
            body {
                header {
                    a href="/ui/" { "amber" }
                    form action="/ui/search" method="get" {
                        input type="search" name="q" placeholder="Search repositories" aria-label="Search repositories";
                        " "
                        button type="submit" { "Search" }
                    }
                    @if let Some(name) = viewer.and_then(Viewer::name) {
                        span.who {
                            "Signed in as " b { (name) } " "
                            form style="display:inline" action="/ui/logout" method="post" {
                                button type="submit" { "Sign out" }
                            }
                        }
                    }
                }
                main { (body) }
            }
        }
    }
}

pub fn error(viewer: Option<&Viewer>, msg: &str) -> Markup {
    layout(
        viewer,
        "Not available",
        html! {
            h1 { "Not available" }
            p.error { (msg) }
            p { a href="/ui/" { "Back to the catalog" } }
        },
    )
}

pub fn login(next: &str, problem: Option<&str>) -> Markup {
    layout(
        None,
        "Sign in",
        html! {
            h1 { "Sign in to the amber registry" }
            @if let Some(p) = problem { p.error { (p) } }
            form action="/ui/login" method="post" {
                input type="hidden" name="next" value=(next);
                p { label { "User " input type="text" name="user" autocomplete="username" required; } }
                p { label { "Password or token " input type="password" name="password" autocomplete="current-password" required; } }
                p { button type="submit" id="sign-in" { "Sign in" } }
            }
        },
    )
}

fn state_cell(state: ConversionState) -> Markup {
    let (class, label) = match state {
        ConversionState::Done => ("state-done", "converted"),
        ConversionState::Failed => ("state-failed", "failed"),
        ConversionState::Running => ("state-running", "converting"),
        ConversionState::Queued => ("state-queued", "queued"),
        ConversionState::None => ("", "not converted"),
    };
    html! { span class=(class) { (label) } }
}

fn short(d: &str) -> &str {
    let hex = d.split_once(':').map_or(d, |(_, h)| h);
    &hex[..hex.len().min(12)]
}

fn repo_list(repos: &[String]) -> Markup {
    html! {
        table #repositories {
            tr { th { "Repository" } }
            @for r in repos {
                tr { td { a href={ "/ui/r/" (r) } { (r) } } }
            }
        }
    }
}

/// A bounded page of the repositories `viewer` may pull whose names contain `needle`.
async fn visible_repos(
    reg: &Registry,
    viewer: &Viewer,
    needle: &str,
    after: Option<&str>,
) -> Result<(Vec<String>, Option<String>), PageError> {
    // Over a shared bucket the store's names in this range first (as `_catalog`).
    reg.refresh_catalog(after, PAGE + 2).await?;
    Ok(reg
        .index
        .search_repos(needle, after, PAGE, SCAN_BUDGET, &|r| viewer.may_pull(r))?)
}

pub async fn home(reg: &Arc<Registry>, viewer: &Viewer) -> PageResult {
    let totals = reg.index.totals()?;
    // Two weeks of hourly samples, the last one as of now.
    let mut history = reg.index.stored_bytes_history(24 * 14)?;
    let now = (crate::envs::hour_now(), totals.stored_bytes());
    match history.last_mut() {
        Some(last) if last.0 == now.0 => *last = now,
        _ => history.push(now),
    }
    let (repos, next) = visible_repos(reg, viewer, "", None).await?;
    Ok(layout(
        Some(viewer),
        "Catalog",
        html! {
            h1 { "Environments" }
            div.cards #totals {
                div.card { b #total-images { (totals.images) } "images converted" }
                div.card { b #total-envs { (totals.envs) } "envs" }
                div.card { b #total-stored { (bytes(totals.stored_bytes())) } "stored (blobs and chunks)" }
                div.card { b #total-chunks { (bytes(totals.chunk_bytes)) } (totals.chunks) " chunks" }
                div.card {
                    b #total-dedup { @match totals.dedup_ratio() { Some(r) => { (format!("{r:.2}x")) }, None => "–" } }
                    "dedup (env chunk bytes ÷ chunk bytes stored)"
                }
            }
            h2 { "Stored bytes over time" }
            (super::chart::stored_bytes(&history))
            h2 { "Repositories" }
            (repo_list(&repos))
            @if let Some(n) = next {
                p.more { a href={ "/ui/search?" (query(&[("q", ""), ("after", &n)])) } { "More repositories" } }
            }
        },
    ))
}

fn query(pairs: &[(&str, &str)]) -> String {
    serde_urlencoded::to_string(pairs).expect("encodes")
}

pub async fn search(
    reg: &Arc<Registry>,
    viewer: &Viewer,
    needle: &str,
    after: Option<&str>,
) -> PageResult {
    if needle.len() > 256 {
        return Err(PageError::BadRequest(
            "a search is at most 256 characters".into(),
        ));
    }
    let (repos, next) = visible_repos(reg, viewer, needle, after).await?;
    let title = if needle.is_empty() {
        "Repositories".to_string()
    } else {
        format!("Repositories matching “{needle}”")
    };
    Ok(layout(
        Some(viewer),
        &title,
        html! {
            h1 { (title) }
            @if repos.is_empty() && next.is_none() {
                p #no-results { "No repository you may pull matches." }
            } @else {
                (repo_list(&repos))
            }
            @if let Some(n) = next {
                p.more {
                    a href={ "/ui/search?" (query(&[("q", needle), ("after", &n)])) } {
                        @if repos.is_empty() { "Searched up to " code { (n) } "; search on" } @else { "More" }
                    }
                }
            }
        },
    ))
}

fn not_visible(name: &RepoName) -> PageError {
    PageError::NotFound(format!("no repository {name} that you may pull"))
}

pub async fn repository(
    reg: &Arc<Registry>,
    viewer: &Viewer,
    name: &RepoName,
    last: Option<&str>,
) -> PageResult {
    if !viewer.may_pull(name.as_str()) {
        return Err(not_visible(name));
    }
    reg.refresh_tags(name, last, PAGE + 1).await?;
    if !reg.index.repo_exists(name)? {
        return Err(not_visible(name));
    }
    let (tags, more) = reg.index.tags(name, last, PAGE)?;
    let mut rows = Vec::new();
    for t in &tags {
        let Ok(tag) = amber_oci::names::Tag::parse(t) else {
            continue;
        };
        let Some(digest) = reg.index.tag(name, &tag)? else {
            continue;
        };
        let Some(rec) = reg.index.manifest(name, &digest)? else {
            continue;
        };
        let conv = image_conversion(reg, &digest, &rec.media_type).await.ok();
        rows.push((t.clone(), digest, rec, conv));
    }
    Ok(layout(
        Some(viewer),
        name.as_str(),
        html! {
            h1 { (name.as_str()) }
            h2 { "Tags" }
            @if rows.is_empty() { p { "No tags." } } @else {
                table #tags {
                    tr { th { "Tag" } th { "Digest" } th { "Kind" } th { "Conversion" } th { "Env" } }
                    @for (t, d, rec, conv) in &rows {
                        tr {
                            td { a href={ "/ui/i/" (name.as_str()) "/" (t) } { (t) } }
                            td.digest { a href={ "/ui/i/" (name.as_str()) "/" (d) } { (short(&d.to_string())) } }
                            td { (kind(&rec.media_type)) }
                            td { @if let Some(c) = conv { (state_cell(c.state)) } @else { "–" } }
                            td.digest { @if let Some(e) = conv.as_ref().and_then(|c| c.env.as_ref()) { (short(&e.to_string())) } }
                        }
                    }
                }
            }
            @if more {
                @if let Some(l) = tags.last() {
                    p.more { a href={ "/ui/r/" (name.as_str()) "?" (query(&[("last", l)])) } { "More tags" } }
                }
            }
        },
    ))
}

fn kind(media_type: &str) -> &'static str {
    match ManifestKind::of(media_type) {
        Some(ManifestKind::Index) => "index",
        _ => "image",
    }
}

/// What the image page shows of a manifest's own JSON.
struct Layer {
    media_type: String,
    digest: String,
    size: u64,
}

fn layers_of(manifest: &Value) -> Vec<Layer> {
    manifest["layers"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .map(|l| Layer {
            media_type: l["mediaType"].as_str().unwrap_or("").to_string(),
            digest: l["digest"].as_str().unwrap_or("").to_string(),
            size: l["size"].as_u64().unwrap_or(0),
        })
        .collect()
}

fn platform_of(config: &Value) -> String {
    let mut p = format!(
        "{}/{}",
        config["os"].as_str().unwrap_or("?"),
        config["architecture"].as_str().unwrap_or("?")
    );
    if let Some(v) = config["variant"].as_str() {
        p.push('/');
        p.push_str(v);
    }
    p
}

pub async fn image(
    reg: &Arc<Registry>,
    viewer: &Viewer,
    host: &str,
    name: &RepoName,
    reference: &Reference,
) -> PageResult {
    if !viewer.may_pull(name.as_str()) {
        return Err(not_visible(name));
    }
    let missing = || PageError::NotFound(format!("no manifest {reference} in {name}"));
    let digest = match reference {
        Reference::Digest(d) => d.clone(),
        Reference::Tag(t) => reg.tag(name, t).await?.ok_or_else(missing)?,
    };
    let rec = reg.manifest(name, &digest).await?.ok_or_else(missing)?;
    let stored = reg.store.read_all(&ObjectKey::blob(&digest)).await?;
    let manifest: Value = serde_json::from_slice(&stored)?;
    let conv = image_conversion(reg, &digest, &rec.media_type).await;
    // The image manifest (an index's linux/amd64 entry) and its config.
    let (image_manifest, children) = match ManifestKind::of(&rec.media_type) {
        Some(ManifestKind::Index) => {
            let children: Vec<(String, String)> = manifest["manifests"]
                .as_array()
                .map(Vec::as_slice)
                .unwrap_or_default()
                .iter()
                .map(|m| {
                    let p = &m["platform"];
                    (
                        m["digest"].as_str().unwrap_or("").to_string(),
                        platform_of(p),
                    )
                })
                .collect();
            let child = match &conv {
                Ok(c) => {
                    serde_json::from_slice(&reg.store.read_all(&ObjectKey::blob(&c.image)).await?)?
                }
                Err(_) => Value::Null,
            };
            (child, children)
        }
        _ => (manifest.clone(), Vec::new()),
    };
    let config = match image_manifest["config"]["digest"]
        .as_str()
        .map(str::parse::<Digest>)
    {
        Some(Ok(d)) => match reg.store.read_all(&ObjectKey::blob(&d)).await {
            Ok(b) => serde_json::from_slice(&b).unwrap_or(Value::Null),
            Err(_) => Value::Null,
        },
        _ => Value::Null,
    };
    let layers = layers_of(&image_manifest);
    let layer_bytes: u64 = layers.iter().map(|l| l.size).sum();
    let env = conv.as_ref().ok().and_then(|c| c.env);
    let env_details = match &env {
        Some(e) => {
            let env = e.to_string();
            let envelope = crate::envs::envelope(reg, &env).await?;
            let info = crate::envs::info_of(reg, &env, &envelope).await?;
            let shared = crate::envs::sharing(reg, &envelope)?;
            Some((info, shared))
        }
        None => None,
    };
    reg.refresh_referrers(name, &digest).await?;
    let referrers = reg.index.referrers(name, &digest)?;
    let pinned = format!("{host}/{name}@{digest}");
    let title = format!("{name}:{reference}");
    Ok(layout(
        Some(viewer),
        &title,
        html! {
            h1 { (name.as_str()) @match reference { Reference::Tag(t) => { ":" (t.as_str()) }, Reference::Digest(_) => {} } }
            dl {
                dt { "Manifest digest" } dd.digest #manifest-digest { (digest) }
                @if let Ok(c) = &conv {
                    @if c.image != digest { dt { "Image digest (linux/amd64)" } dd.digest #image-digest { (c.image) } }
                }
                dt { "Media type" } dd { code { (rec.media_type) } }
                dt { "Platform" } dd #platform { @if config.is_null() { "–" } @else { (platform_of(&config)) } }
                @if let Some(created) = config["created"].as_str() { dt { "Created" } dd { (created) } }
                dt { "Conversion" }
                dd #conversion {
                    @match &conv {
                        Ok(c) => {
                            (state_cell(c.state))
                            @if let Some(r) = &c.record {
                                @if let (Some(s), ConversionState::Done | ConversionState::Failed) = (r.started_unix, c.state) {
                                    " in " (r.updated_unix.saturating_sub(s)) " s"
                                }
                                ", " (time(r.updated_unix))
                                @if let Some(e) = &r.error { div.error { (e) } }
                            }
                        },
                        Err(e) => { span.state-failed { (e.to_string()) } },
                    }
                }
                dt { "Env digest" }
                dd.digest #env-digest { @if let Some(e) = &env { (e) } @else { "–" } }
                @if let Some((info, shared)) = &env_details {
                    dt { "Env size" } dd #env-size { (bytes(info.device_size)) " " (info.filesystem) " device, " (info.extents) " extents" }
                    dt { "Chunks" } dd #env-chunks { (info.chunks) " chunks, " (bytes(info.chunk_bytes)) " stored" }
                    dt { "Shared with other envs" }
                    dd #env-shared {
                        (shared.chunks) " of " (info.chunks) " chunks, " (bytes(shared.bytes))
                        @if info.chunk_bytes > 0 { " (" (format!("{:.0}", 100.0 * shared.bytes as f64 / info.chunk_bytes as f64)) "% of its stored bytes)" }
                    }
                }
                @if let Some(src) = &rec.source {
                    dt { "Imported from" } dd #source { code { (src.reference) } " (" span.digest { (src.digest) } "), " (time(src.imported_unix)) }
                }
            }
            h2 { "Run it" }
            pre #run-cli { "amber run " (pinned) " -- uname -a" }
            @if let Some(e) = &env { pre #run-env { "amber run " (e) " -- uname -a" } }
            pre #run-python {
                "from amber_sandbox import AsyncAmber\n\n"
                "async with AsyncAmber() as amber:\n"
                "    async with await amber.create(\"" (pinned) "\") as sandbox:\n"
                "        print((await sandbox.exec(\"uname -a\")).stdout)"
            }
            @if !children.is_empty() {
                h2 { "Platforms" }
                table {
                    tr { th { "Platform" } th { "Manifest" } }
                    @for (d, p) in &children {
                        tr { td { (p) } td.digest { a href={ "/ui/i/" (name.as_str()) "/" (d) } { (d) } } }
                    }
                }
            }
            h2 { "Layers" }
            table #layers {
                tr { th { "#" } th { "Digest" } th { "Media type" } th.n { "Size" } }
                @for (i, l) in layers.iter().enumerate() {
                    tr { td { (i + 1) } td.digest { (l.digest) } td { code { (l.media_type) } } td.n { (bytes(l.size)) } }
                }
                tr { td {} td { b { (layers.len()) " layers" } } td {} td.n { b { (bytes(layer_bytes)) } } }
            }
            h2 { "Referrers" }
            @if referrers.is_empty() { p { "None." } } @else {
                table #referrers {
                    tr { th { "Artifact type" } th { "Digest" } th.n { "Size" } }
                    @for r in &referrers {
                        tr {
                            td { code { (r["artifactType"].as_str().unwrap_or(r["mediaType"].as_str().unwrap_or(""))) } }
                            td.digest { (r["digest"].as_str().unwrap_or("")) }
                            td.n { (bytes(r["size"].as_u64().unwrap_or(0))) }
                        }
                    }
                }
            }
        },
    ))
}
