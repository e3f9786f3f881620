//! Access control at the HTTP edge: what each request needs (a repository right, or
//! just an authenticated caller), the 401/403/429 answers Docker clients understand, and
//! the token endpoint `GET /token` of the Docker token flow. The rules themselves are
//! in `crate::auth`; with authentication off every request passes.

use axum::extract::Request;
use axum::http::{header, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use super::{header_str, param, query, AppState};
use crate::api::error::ApiError;
use crate::auth::{Action, Principal, Refusal};
use amber_oci::names::Route;

/// What a request needs.
#[derive(Debug, PartialEq, Eq)]
pub enum Need {
    /// Any authenticated caller (`/v2/`, the catalog, which is then filtered).
    Caller,
    /// A caller that may pull something (content-addressed chunks and envs).
    SomePull,
    /// A right on one repository.
    Repo(String, Action),
}

impl Need {
    /// The Docker scope string that would satisfy this need.
    fn scope(&self) -> Option<String> {
        match self {
            Need::Repo(name, Action::Pull) => Some(format!("repository:{name}:pull")),
            Need::Repo(name, Action::Push) => Some(format!("repository:{name}:pull,push")),
            _ => None,
        }
    }
}

/// The need of a distribution API request.
pub fn need_of(method: &Method, route: &Route) -> Need {
    let write = !matches!(*method, Method::GET | Method::HEAD);
    let repo = |name: &amber_oci::names::RepoName| {
        Need::Repo(
            name.as_str().to_string(),
            if write { Action::Push } else { Action::Pull },
        )
    };
    match route {
        Route::Base | Route::Catalog => Need::Caller,
        Route::Tags(n) | Route::Referrers(n, _) | Route::Manifest(n, _) | Route::Blob(n, _) => {
            repo(n)
        }
        Route::UploadStart(n) | Route::Upload(n, _) => {
            Need::Repo(n.as_str().to_string(), Action::Push)
        }
    }
}

/// The need of an amber API request (`/amber/v1/...`).
pub fn need_of_amber(path: &str) -> Need {
    if path == amber_api::registry::IMPORTS_PATH {
        // Checked per target repository by the handler (push rights).
        return Need::Caller;
    }
    match path
        .strip_prefix("/amber/v1/resolve/")
        .and_then(|r| r.rsplit_once('/'))
    {
        Some((name, _)) => Need::Repo(name.to_string(), Action::Pull),
        None => Need::SomePull,
    }
}

/// `Auth::authenticate` off the async workers' cooperative path: a Basic login not seen
/// recently costs an argon2 verification (tens of milliseconds of CPU).
fn authenticate(
    auth: &crate::auth::Auth,
    authorization: Option<&str>,
) -> Result<Principal, Refusal> {
    crate::blocking::run(|| auth.authenticate(authorization))
}

/// Authenticates `req` and checks `need`. Ok(None) when authentication is off.
pub fn check(reg: &AppState, req: &Request, need: &Need) -> Result<Option<Principal>, ApiError> {
    let Some(auth) = &reg.auth else {
        return Ok(None);
    };
    let authorization = header_str(req.headers(), header::AUTHORIZATION);
    let principal = match authenticate(auth, authorization) {
        Ok(p) => p,
        Err(Refusal::RateLimited(msg)) => return Err(too_many(msg)),
        Err(Refusal::Unauthenticated(msg)) => return Err(challenge(auth, req, need, msg)),
    };
    let allowed = match need {
        Need::Caller => true,
        Need::SomePull => principal.may_pull_some(),
        Need::Repo(name, action) => principal.may(*action, name),
    };
    if allowed {
        return Ok(Some(principal));
    }
    let what = match need {
        Need::Repo(name, action) => format!("{} on {name}", action.as_str()),
        _ => "pulling".into(),
    };
    Err(match principal {
        // A token without the scope: the client may ask for a new one (Docker does).
        Principal::Token(_) => {
            challenge(auth, req, need, format!("the token does not grant {what}"))
        }
        Principal::Account(a) => ApiError::new(
            StatusCode::FORBIDDEN,
            "DENIED",
            format!("{} may not {what}", a.name),
        ),
    })
}

/// 401 with the Bearer challenge pointing to this registry's token endpoint.
fn challenge(auth: &crate::auth::Auth, req: &Request, need: &Need, msg: String) -> ApiError {
    let host = header_str(req.headers(), header::HOST).unwrap_or("localhost");
    let proto = req
        .headers()
        .get("x-forwarded-proto")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("http");
    let mut value = format!(
        "Bearer realm=\"{proto}://{host}/token\",service=\"{}\"",
        auth.service
    );
    if let Some(scope) = need.scope() {
        value.push_str(&format!(",scope=\"{scope}\""));
    }
    ApiError::new(StatusCode::UNAUTHORIZED, "UNAUTHORIZED", msg)
        .with_header(header::WWW_AUTHENTICATE, &value)
}

fn too_many(msg: String) -> ApiError {
    ApiError::new(StatusCode::TOO_MANY_REQUESTS, "TOOMANYREQUESTS", msg).with_header(
        header::RETRY_AFTER,
        &crate::auth::FAILURE_WINDOW.as_secs().to_string(),
    )
}

/// `GET /token?service=amber&scope=repository:<name>:<actions>&...` with Basic auth:
/// a bearer token with the asked actions the account holds.
pub async fn token(reg: &AppState, req: Request) -> Response {
    let Some(auth) = &reg.auth else {
        return ApiError::new(
            StatusCode::NOT_FOUND,
            "UNSUPPORTED",
            "authentication is off on this registry: no tokens to issue",
        )
        .into_response();
    };
    if req.method() != Method::GET {
        return ApiError::unsupported("the token endpoint answers GET").into_response();
    }
    let authorization = header_str(req.headers(), header::AUTHORIZATION);
    let account = match authenticate(auth, authorization) {
        Ok(Principal::Account(a)) => a,
        Ok(Principal::Token(_)) => {
            return ApiError::new(
                StatusCode::UNAUTHORIZED,
                "UNAUTHORIZED",
                "log in with a user name and password (Basic), not a token",
            )
            .into_response()
        }
        Err(Refusal::RateLimited(msg)) => return too_many(msg).into_response(),
        Err(Refusal::Unauthenticated(msg)) => {
            return ApiError::new(StatusCode::UNAUTHORIZED, "UNAUTHORIZED", msg)
                .with_header(header::WWW_AUTHENTICATE, "Basic realm=\"amber\"")
                .into_response()
        }
    };
    let q = query(&req);
    if let Some(service) = param(&q, "service") {
        if service != auth.service {
            return ApiError::new(
                StatusCode::BAD_REQUEST,
                "UNSUPPORTED",
                format!(
                    "unknown service {service:?}: this registry is {:?}",
                    auth.service
                ),
            )
            .into_response();
        }
    }
    let scopes: Vec<String> = q
        .iter()
        .filter(|(k, _)| k == "scope")
        .map(|(_, v)| v.clone())
        .collect();
    let (token, claims) = auth.issue(&account, &scopes);
    tracing::info!(user = %account.name, scopes = ?scopes, granted = claims.access.len(), "token issued");
    (
        StatusCode::OK,
        axum::Json(json!({
            "token": token,
            "access_token": token,
            "expires_in": claims.exp - claims.iat,
        })),
    )
        .into_response()
}
