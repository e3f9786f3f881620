//! Listings served from the index: tags, `_catalog` (both paginated with `n` and `last`
//! and a `Link` header) and referrers (with the `artifactType` filter; the registry's
//! own block-manifest referrers only through that filter). Over a shared
//! bucket the index is first brought up to date from the store's records (records.rs):
//! for a catalog page, only the page's own range of them (one listing request).

use axum::extract::Request;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};

use super::{param, query, AppState};
use crate::api::error::{ApiError, ApiResult};
use amber_oci::digest::Digest;
use amber_oci::media::OCI_INDEX;
use amber_oci::names::RepoName;

/// Page size when the client gives no `n`, and the largest one it may ask for.
const DEFAULT_PAGE: usize = 1000;
const MAX_PAGE: usize = 10_000;

fn page_params(req: &Request) -> ApiResult<(Option<String>, usize)> {
    let q = query(req);
    let n = match param(&q, "n") {
        None => DEFAULT_PAGE,
        Some(v) => v
            .parse::<usize>()
            .map_err(|_| {
                ApiError::new(
                    StatusCode::BAD_REQUEST,
                    "PAGINATION_NUMBER_INVALID",
                    format!("n={v:?} is not a number"),
                )
            })?
            .min(MAX_PAGE),
    };
    Ok((param(&q, "last").map(str::to_string), n))
}

fn paged(path: &str, body: Value, items: &[String], more: bool, n: usize) -> Response {
    let mut resp = (StatusCode::OK, axum::Json(body)).into_response();
    if let (true, Some(last)) = (more, items.last()) {
        let q = serde_urlencoded::to_string([("n", n.to_string()), ("last", last.clone())])
            .expect("encodes");
        if let Ok(v) = format!("<{path}?{q}>; rel=\"next\"").parse() {
            resp.headers_mut().insert(header::LINK, v);
        }
    }
    resp
}

pub async fn tags(reg: &AppState, name: RepoName, req: Request) -> ApiResult<Response> {
    let (last, n) = page_params(&req)?;
    // The page's names and the one after them (which says whether more follow).
    reg.refresh_tags(&name, last.as_deref(), n + 1).await?;
    if !reg.index.repo_exists(&name)? {
        return Err(ApiError::name_unknown(&name));
    }
    let (tags, more) = reg.index.tags(&name, last.as_deref(), n)?;
    let body = json!({"name": name.as_str(), "tags": tags});
    Ok(paged(
        &format!("/v2/{name}/tags/list"),
        body,
        &tags,
        more,
        n,
    ))
}

/// `_catalog`, showing only the repositories `visible` accepts (the caller's pull rights).
pub async fn catalog(
    reg: &AppState,
    req: Request,
    visible: &(dyn Fn(&str) -> bool + Sync),
) -> ApiResult<Response> {
    let (last, n) = page_params(&req)?;
    let mut repos = Vec::new();
    let mut cursor = last;
    // More pages exist when one more visible repository follows the n collected: index
    // pages of n + 1 decide that in one page when every repository is visible.
    let more = 'scan: loop {
        // Over a shared bucket, the store's names in the range of this index page first
        // (one listing; the index page, and the one name after it that says whether more
        // follow, end at or before the store's n + 2).
        reg.refresh_catalog(cursor.as_deref(), n + 2).await?;
        let (page, page_more) = reg.index.catalog(cursor.as_deref(), n + 1)?;
        cursor = page.last().cloned();
        for r in page {
            if visible(&r) {
                if repos.len() == n {
                    break 'scan true;
                }
                repos.push(r);
            }
        }
        if !page_more {
            break false;
        }
    };
    let body = json!({"repositories": repos});
    Ok(paged("/v2/_catalog", body, &repos, more, n))
}

pub async fn referrers(
    reg: &AppState,
    name: RepoName,
    subject: Digest,
    req: Request,
) -> ApiResult<Response> {
    let q = query(&req);
    let filter = param(&q, "artifactType");
    reg.refresh_referrers(&name, &subject).await?;
    let mut manifests = reg.index.referrers(&name, &subject)?;
    // The registry's own derived artifacts (the block manifest of a converted image) are
    // listed only when asked for by their artifactType: a client sees exactly the
    // referrers clients pushed, as on any other registry.
    let derived = |d: &Value| {
        d.get("artifactType").and_then(Value::as_str) == Some(crate::convert::BLOCK_MANIFEST_TYPE)
    };
    match filter {
        Some(f) => manifests.retain(|d| d.get("artifactType").and_then(Value::as_str) == Some(f)),
        None => manifests.retain(|d| !derived(d)),
    }
    let body = json!({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": manifests});
    let mut resp = (
        StatusCode::OK,
        [(header::CONTENT_TYPE, OCI_INDEX)],
        body.to_string(),
    )
        .into_response();
    if filter.is_some() {
        resp.headers_mut().insert(
            "OCI-Filters-Applied",
            "artifactType".parse().expect("literal"),
        );
    }
    Ok(resp)
}
