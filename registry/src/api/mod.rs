//! The HTTP surface: the OCI Distribution v1.1 API under `/v2/`, amber's API under
//! `/amber/v1/`, the catalog pages under `/ui/` (`crate::ui`), and `/metrics`.
//!
//! Repository names contain `/`, so every `/v2/` request goes through one dispatcher
//! that parses the path with `names::Route` and picks the handler by method and route.

mod access;
mod amber;
mod blobs;
pub mod error;
mod listing;
mod manifests;
mod uploads;

use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use futures_util::StreamExt;

use crate::api::error::ApiError;
use crate::registry::Registry;
use crate::store::ByteStream;
use amber_oci::names::{NameError, Route};

pub type AppState = Arc<Registry>;

/// The registry's router.
pub fn router(registry: AppState) -> Router {
    let handle = crate::metrics::install();
    Router::new()
        .route("/metrics", get(move || async move { handle.render() }))
        .fallback(dispatch)
        .layer(middleware::from_fn(observe))
        .with_state(registry)
}

async fn dispatch(State(reg): State<AppState>, req: Request) -> Response {
    if req.uri().path() == "/token" {
        return access::token(&reg, req).await;
    }
    if req.uri().path() == "/ui" || req.uri().path().starts_with("/ui/") {
        return crate::ui::dispatch(&reg, req).await;
    }
    if req.uri().path().starts_with("/amber/") {
        let principal = match access::check(&reg, &req, &access::need_of_amber(req.uri().path())) {
            Ok(p) => p,
            Err(refused) => return refused.into_response(),
        };
        return amber::dispatch(&reg, req, principal)
            .await
            .unwrap_or_else(IntoResponse::into_response);
    }
    let route = match Route::parse(req.uri().path()) {
        Ok(r) => r,
        // A manifest asked for by a reference that is not a valid tag cannot exist: 404,
        // as for any manifest that does not (a push under such a tag is still a 400).
        Err(NameError::BadTag(tag))
            if matches!(*req.method(), Method::GET | Method::HEAD)
                && req.uri().path().contains("/manifests/") =>
        {
            return ApiError::new(
                StatusCode::NOT_FOUND,
                "MANIFEST_UNKNOWN",
                format!("no manifest {tag:?}: it is neither a valid tag nor a digest"),
            )
            .into_response();
        }
        Err(e) => return ApiError::from(e).into_response(),
    };
    let method = req.method().clone();
    let principal = match access::check(&reg, &req, &access::need_of(&method, &route)) {
        Ok(p) => p,
        Err(refused) => return refused.into_response(),
    };
    // A cross-repository mount reads the source repository: without pull there, the
    // mount is not attempted and the client gets a plain upload session (202).
    let req = match (&route, &principal) {
        (Route::UploadStart(_), Some(p)) => {
            uploads::drop_unreadable_mount(req, |from| p.may(crate::auth::Action::Pull, from))
        }
        _ => req,
    };
    let result = match (&method, route) {
        (&Method::GET | &Method::HEAD, Route::Base) => Ok(base()),
        (&Method::GET, Route::Catalog) => {
            let lister = match (&principal, &reg.auth) {
                (Some(p), Some(auth)) => Some(p.lister(auth)),
                _ => None,
            };
            let visible = |repo: &str| match &lister {
                Some(account) => account.as_ref().is_some_and(|a| a.may_pull(repo)),
                None => true,
            };
            listing::catalog(&reg, req, &visible).await
        }
        (&Method::GET, Route::Tags(name)) => listing::tags(&reg, name, req).await,
        (&Method::GET, Route::Referrers(name, d)) => listing::referrers(&reg, name, d, req).await,
        (&Method::GET | &Method::HEAD, Route::Manifest(name, r)) => {
            manifests::get(&reg, name, r, method == Method::HEAD).await
        }
        (&Method::PUT, Route::Manifest(name, r)) => manifests::put(&reg, name, r, req).await,
        (&Method::GET | &Method::HEAD, Route::Blob(name, d)) => {
            blobs::get(&reg, name, d, req.headers(), method == Method::HEAD).await
        }
        (&Method::POST, Route::UploadStart(name)) => uploads::start(&reg, name, req).await,
        (&Method::GET, Route::Upload(name, id)) => uploads::status(&reg, name, id).await,
        (&Method::PATCH, Route::Upload(name, id)) => uploads::patch(&reg, name, id, req).await,
        (&Method::PUT, Route::Upload(name, id)) => uploads::finish(&reg, name, id, req).await,
        (&Method::DELETE, Route::Upload(name, id)) => uploads::cancel(&reg, name, id).await,
        (&Method::DELETE, Route::Manifest(..) | Route::Blob(..)) => Err(ApiError::unsupported(
            "this registry is immutable: manifests, tags and blobs cannot be deleted",
        )),
        (m, r) => Err(ApiError::unsupported(format!(
            "method {m} is not supported on the {} endpoint",
            r.label()
        ))),
    };
    result.unwrap_or_else(IntoResponse::into_response)
}

fn base() -> Response {
    (StatusCode::OK, axum::Json(serde_json::json!({}))).into_response()
}

/// Adds the API version header and records request metrics and a log line.
async fn observe(req: Request, next: Next) -> Response {
    let start = Instant::now();
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let route = if path == "/metrics" {
        "metrics"
    } else if path == "/ui" || path.starts_with("/ui/") {
        "ui"
    } else if let Some(rest) = path.strip_prefix("/amber/v1/") {
        match rest.split('/').next() {
            Some("resolve") => "amber_resolve",
            Some("envs") => "amber_env",
            Some("chunks") => "amber_chunk",
            Some("imports") => "amber_imports",
            _ => "unknown",
        }
    } else {
        Route::parse(&path).map(|r| r.label()).unwrap_or("unknown")
    };
    let mut resp = next.run(req).await;
    resp.headers_mut().insert(
        "Docker-Distribution-API-Version",
        HeaderValue::from_static("registry/2.0"),
    );
    let status = resp.status().as_u16().to_string();
    let labels = [
        ("route", route.to_string()),
        ("method", method.to_string()),
        ("status", status),
    ];
    metrics::counter!(crate::metrics::REQUESTS, &labels).increment(1);
    let secs = start.elapsed().as_secs_f64();
    metrics::histogram!(crate::metrics::LATENCY, &labels[..2]).record(secs);
    // Milliseconds to the microsecond (`ms=0.222`, not `ms=0.22200999999999999`).
    let ms = (secs * 1e6).round() / 1e3;
    tracing::info!(%method, %path, status = resp.status().as_u16(), ms, "request");
    resp
}

/// Wraps a store stream as a response body that counts the bytes it sends.
fn counted_body(s: ByteStream) -> Body {
    Body::from_stream(s.inspect(|r| {
        if let Ok(b) = r {
            metrics::counter!(crate::metrics::BYTES_OUT).increment(b.len() as u64);
        }
    }))
}

/// A request body as a store stream.
fn request_stream(req: Request) -> ByteStream {
    Box::pin(
        req.into_body()
            .into_data_stream()
            .map(|r| r.map_err(std::io::Error::other)),
    )
}

/// Parses `?a=b&c=d` into pairs, percent-decoded.
fn query(req: &Request) -> Vec<(String, String)> {
    let q = req.uri().query().unwrap_or("");
    serde_urlencoded::from_str(q).unwrap_or_default()
}

fn param<'a>(q: &'a [(String, String)], key: &str) -> Option<&'a str> {
    q.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
}

fn header_str(h: &HeaderMap, name: header::HeaderName) -> Option<&str> {
    h.get(name).and_then(|v| v.to_str().ok())
}
