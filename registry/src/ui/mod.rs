//! The catalog pages under `/ui/`: find an environment, see what it is made of, copy how
//! to run it. Server-rendered HTML (no JavaScript, no build step) on the registry's own
//! listener, over the same domain calls as the API (`repository`, `records`, `envs`,
//! `index`), with the same accounts and rights: with authentication on, a viewer signs
//! in (a session cookie, or an `Authorization` header as the API takes) and sees only the
//! repositories their account may pull; others answer as if they did not exist.
//!
//! Every list is one bounded page of the index (`Index::search_repos` scans at most
//! [`SCAN_BUDGET`] names per page), so a page costs the same at a million images.
//! Responses carry `Server-Timing: render;dur=<ms>`.

mod chart;
mod format;
mod pages;

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::Request;
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};

use crate::auth::{Account, Refusal};
use crate::registry::Registry;
use amber_oci::names::{Reference, RepoName};

/// Repositories (or tags) per page.
pub const PAGE: usize = 50;
/// The most repository names one list or search page looks at.
pub const SCAN_BUDGET: usize = 20_000;
/// How long a sign-in lasts.
const SESSION_TTL: Duration = Duration::from_secs(12 * 3600);
const COOKIE: &str = "amber_session";
/// The largest sign-in form accepted.
const MAX_FORM: usize = 16 << 10;

/// Who is looking.
pub enum Viewer {
    /// Authentication is off: everything is visible.
    Anyone,
    Account(Account),
}

impl Viewer {
    pub fn may_pull(&self, repo: &str) -> bool {
        match self {
            Viewer::Anyone => true,
            Viewer::Account(a) => a.may_pull(repo),
        }
    }

    pub fn name(&self) -> Option<&str> {
        match self {
            Viewer::Anyone => None,
            Viewer::Account(a) => Some(&a.name),
        }
    }
}

/// What went wrong serving a page, as the viewer sees it.
pub enum PageError {
    NotFound(String),
    BadRequest(String),
    Internal(String),
}

impl<E: std::fmt::Display> From<E> for PageError {
    fn from(e: E) -> PageError {
        tracing::error!(error = %e, "catalog page");
        PageError::Internal(e.to_string())
    }
}

type PageResult = Result<maud::Markup, PageError>;

/// Serves one `/ui` request.
pub async fn dispatch(reg: &Arc<Registry>, req: Request) -> Response {
    let start = Instant::now();
    let mut resp = route(reg, req).await;
    let ms = start.elapsed().as_secs_f64() * 1000.0;
    if let Ok(v) = HeaderValue::from_str(&format!("render;dur={ms:.2}")) {
        resp.headers_mut().insert("Server-Timing", v);
    }
    resp
}

async fn route(reg: &Arc<Registry>, req: Request) -> Response {
    let path = req.uri().path().to_string();
    let rest = path.strip_prefix("/ui").unwrap_or("");
    let params: Vec<(String, String)> =
        serde_urlencoded::from_str(req.uri().query().unwrap_or("")).unwrap_or_default();
    let q = |k: &str| {
        params
            .iter()
            .find(|(key, _)| key == k)
            .map(|(_, v)| v.clone())
    };
    match (req.method().clone(), rest) {
        (Method::GET, "/login") => {
            let next = q("next").unwrap_or_default();
            return html(StatusCode::OK, pages::login(&next, None));
        }
        (Method::POST, "/login") => return login(reg, req).await,
        (Method::POST, "/logout") => return logout(),
        _ => {}
    }
    if req.method() != Method::GET && req.method() != Method::HEAD {
        return html(
            StatusCode::METHOD_NOT_ALLOWED,
            pages::error(None, "The catalog pages are read-only."),
        );
    }
    let viewer = match viewer(reg, &req) {
        Ok(v) => v,
        Err(Refusal::RateLimited(msg)) => {
            return html(StatusCode::TOO_MANY_REQUESTS, pages::error(None, &msg))
        }
        Err(Refusal::Unauthenticated(_)) => return to_login(req.uri()),
    };
    let host = req
        .headers()
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .unwrap_or("localhost")
        .to_string();
    drop(req);
    let page = match rest {
        "" | "/" => pages::home(reg, &viewer).await,
        "/search" => {
            pages::search(
                reg,
                &viewer,
                q("q").unwrap_or_default().trim(),
                q("after").as_deref(),
            )
            .await
        }
        _ => match rest.strip_prefix("/r/") {
            Some(name) => match RepoName::parse(name) {
                Ok(name) => pages::repository(reg, &viewer, &name, q("last").as_deref()).await,
                Err(_) => Err(PageError::NotFound(format!("no repository {name:?}"))),
            },
            None => match rest.strip_prefix("/i/").and_then(|r| r.rsplit_once('/')) {
                Some((name, reference)) => {
                    match (RepoName::parse(name), Reference::parse(reference)) {
                        (Ok(n), Ok(r)) => pages::image(reg, &viewer, &host, &n, &r).await,
                        _ => Err(PageError::NotFound(format!(
                            "no image {name}/{reference}: not a repository name and a tag or digest"
                        ))),
                    }
                }
                None => Err(PageError::NotFound(format!("no page {path}"))),
            },
        },
    };
    match page {
        Ok(markup) => html(StatusCode::OK, markup),
        Err(PageError::NotFound(msg)) => {
            html(StatusCode::NOT_FOUND, pages::error(Some(&viewer), &msg))
        }
        Err(PageError::BadRequest(msg)) => {
            html(StatusCode::BAD_REQUEST, pages::error(Some(&viewer), &msg))
        }
        Err(PageError::Internal(msg)) => html(
            StatusCode::INTERNAL_SERVER_ERROR,
            pages::error(Some(&viewer), &format!("internal error: {msg}")),
        ),
    }
}

fn html(status: StatusCode, markup: maud::Markup) -> Response {
    (
        status,
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CACHE_CONTROL, "no-store"),
        ],
        markup.into_string(),
    )
        .into_response()
}

/// The viewer of a request: anyone with authentication off; else the account of its
/// session cookie or of its `Authorization` header.
fn viewer(reg: &Registry, req: &Request) -> Result<Viewer, Refusal> {
    let Some(auth) = &reg.auth else {
        return Ok(Viewer::Anyone);
    };
    if let Some(token) = session_cookie(req) {
        if let Ok(account) = auth.session_account(&token) {
            return Ok(Viewer::Account(account));
        }
    }
    let authorization = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    let principal = crate::blocking::run(|| auth.authenticate(authorization))?;
    principal
        .lister(auth)
        .map(Viewer::Account)
        .ok_or_else(|| Refusal::Unauthenticated("the token's account no longer exists".into()))
}

fn session_cookie(req: &Request) -> Option<String> {
    req.headers()
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|c| c.trim().split_once('='))
        .find(|(k, _)| *k == COOKIE)
        .map(|(_, v)| v.to_string())
}

/// Where a sign-in may send the viewer back to: a catalog page, nothing else.
fn safe_next(next: &str) -> &str {
    if next.starts_with("/ui/") && !next.starts_with("/ui//") && !next.contains('\\') {
        next
    } else {
        "/ui/"
    }
}

fn to_login(uri: &axum::http::Uri) -> Response {
    let next = uri.path_and_query().map_or("/ui/", |p| p.as_str());
    let q = serde_urlencoded::to_string([("next", next)]).expect("encodes");
    redirect(&format!("/ui/login?{q}"), None)
}

fn redirect(to: &str, cookie: Option<String>) -> Response {
    let mut resp = Response::builder()
        .status(StatusCode::SEE_OTHER)
        .header(header::LOCATION, to);
    if let Some(c) = cookie {
        resp = resp.header(header::SET_COOKIE, c);
    }
    resp.body(Body::empty())
        .expect("a valid redirect")
        .into_response()
}

#[derive(serde::Deserialize)]
struct LoginForm {
    user: String,
    password: String,
    #[serde(default)]
    next: String,
}

async fn login(reg: &Registry, req: Request) -> Response {
    let bytes = match axum::body::to_bytes(req.into_body(), MAX_FORM).await {
        Ok(b) => b,
        Err(_) => {
            return html(
                StatusCode::PAYLOAD_TOO_LARGE,
                pages::login("", Some("The sign-in form is too large.")),
            )
        }
    };
    let form: LoginForm = match serde_urlencoded::from_bytes(&bytes) {
        Ok(f) => f,
        Err(e) => {
            return html(
                StatusCode::BAD_REQUEST,
                pages::login("", Some(&format!("The sign-in form is incomplete: {e}."))),
            )
        }
    };
    let next = safe_next(&form.next).to_string();
    let Some(auth) = &reg.auth else {
        return redirect(&next, None);
    };
    match crate::blocking::run(|| auth.login(&form.user, &form.password)) {
        Ok(account) => {
            let token = auth.issue_session(&account, SESSION_TTL);
            let cookie = format!(
                "{COOKIE}={token}; Path=/ui; HttpOnly; SameSite=Lax; Max-Age={}",
                SESSION_TTL.as_secs()
            );
            tracing::info!(user = %account.name, "signed in to the catalog pages");
            redirect(&next, Some(cookie))
        }
        Err(Refusal::RateLimited(msg)) => html(
            StatusCode::TOO_MANY_REQUESTS,
            pages::login(&next, Some(&msg)),
        ),
        Err(Refusal::Unauthenticated(_)) => html(
            StatusCode::UNAUTHORIZED,
            pages::login(&next, Some("Wrong user name or password.")),
        ),
    }
}

fn logout() -> Response {
    redirect(
        "/ui/login",
        Some(format!(
            "{COOKIE}=; Path=/ui; HttpOnly; SameSite=Lax; Max-Age=0"
        )),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sign_in_only_sends_back_to_catalog_pages() {
        assert_eq!(safe_next("/ui/r/team/app"), "/ui/r/team/app");
        assert_eq!(safe_next("https://evil.example/"), "/ui/");
        assert_eq!(safe_next("//evil.example/ui/"), "/ui/");
        assert_eq!(safe_next("/ui//evil.example"), "/ui/");
        assert_eq!(safe_next("/v2/_catalog"), "/ui/");
        assert_eq!(safe_next(""), "/ui/");
    }
}
