//! amberd's HTTP layer: the node API (`amber_api::node`) as axum routes. Handlers only
//! read the request, call `service::Node`, and write its answer or its error as
//! `ErrorBody` with the status of its kind; nothing else lives here. The OpenAPI document
//! served at `/v1/openapi.json` is generated from these handlers' annotations.
//!
//! The same routes serve the Unix socket (no authentication: the socket's permissions
//! are the access control) and TCP (`Authorization: Bearer <token>` on every route but
//! `/v1/health`).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::extract::{DefaultBodyLimit, Path, Query, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use futures_util::StreamExt;
use serde::Deserialize;
use utoipa::OpenApi;

use amber_api::node::{
    ApiError, BatchItem, BatchResult, CreateBatch, CreateSandbox, CreateSnapshot, Deleted,
    ErrorBody, ErrorKind, ExecFrame, ExecRequest, ExecResult, Health, NodeInfo, Prefetch,
    PrefetchFrame, ProcessInfo, ProcessList, SandboxInfo, SandboxList, SetTimeout, SignalRequest,
    SnapshotInfo,
};

use crate::files::{self, FileError};
use crate::process::Process;
use crate::service::{Activity, Node, NodeError};

/// The content type of streamed frames.
pub const NDJSON: &str = "application/x-ndjson";
/// The header of a streamed exec naming its process, whose output can be read again.
pub const PROCESS_HEADER: &str = "x-amber-process";
/// The `Upgrade` protocol of `/attach`: the guest protocol's frames, relayed.
pub const ATTACH_PROTOCOL: &str = "amber-frames";

type AppState = Arc<Node>;

/// An error answer.
pub struct Failure(pub ErrorKind, pub String);

impl IntoResponse for Failure {
    fn into_response(self) -> Response {
        let status =
            StatusCode::from_u16(self.0.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let body = ErrorBody {
            error: ApiError {
                kind: self.0,
                message: self.1,
            },
        };
        (status, Json(body)).into_response()
    }
}

impl From<NodeError> for Failure {
    fn from(e: NodeError) -> Failure {
        Failure(e.kind(), e.to_string())
    }
}

impl From<FileError> for Failure {
    fn from(e: FileError) -> Failure {
        let kind = match &e {
            FileError::NotFound(_) => ErrorKind::NotFound,
            FileError::Stopped => ErrorKind::NotRunning,
            FileError::NotAFile { .. } | FileError::Bad(_) | FileError::Body(_) => {
                ErrorKind::BadRequest
            }
        };
        Failure(kind, e.to_string())
    }
}

fn rejected(e: impl std::fmt::Display) -> Failure {
    Failure(ErrorKind::BadRequest, e.to_string())
}

type Answer<T> = Result<T, Failure>;

fn json<T>(j: Result<Json<T>, JsonRejection>) -> Answer<T> {
    j.map(|Json(t)| t).map_err(|e| rejected(e.body_text()))
}

fn path<T>(p: Result<Path<T>, PathRejection>) -> Answer<T> {
    p.map(|Path(t)| t).map_err(|e| rejected(e.body_text()))
}

fn query<T>(q: Result<Query<T>, QueryRejection>) -> Answer<T> {
    q.map(|Query(t)| t).map_err(|e| rejected(e.body_text()))
}

#[derive(OpenApi)]
#[openapi(
    info(
        title = "amberd node API",
        description = "Sandboxes (microVMs of pinned environments) on one amber node: create, wait, exec, files, list, delete.",
        version = "1"
    ),
    paths(
        create_sandbox, create_batch, list_sandboxes, delete_by_labels, get_sandbox,
        wait_sandbox, delete_sandbox, set_timeout, snapshot_sandbox, pause_sandbox, resume_sandbox, exec, exec_stream, start_process,
        list_processes, get_process, process_output, signal_process, put_file, get_file,
        put_archive, get_archive, attach, prefetch, node_info, health, openapi_json
    ),
    components(schemas(ErrorBody, ExecFrame, PrefetchFrame)),
    modifiers(&BearerAuth)
)]
pub struct ApiDoc;

struct BearerAuth;

impl utoipa::Modify for BearerAuth {
    fn modify(&self, api: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
        let c = api.components.get_or_insert_with(Default::default);
        c.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

/// The routes, with `token` required as a bearer token when given (TCP).
pub fn router(node: Arc<Node>, token: Option<String>) -> Router {
    let files = Router::new()
        .route("/v1/sandboxes/{id}/files", put(put_file).get(get_file))
        .route(
            "/v1/sandboxes/{id}/archive",
            put(put_archive).get(get_archive),
        )
        .layer(DefaultBodyLimit::disable());
    let r = Router::new()
        .route(
            "/v1/sandboxes",
            post(create_sandbox)
                .get(list_sandboxes)
                .delete(delete_by_labels),
        )
        .route("/v1/sandboxes/batch", post(create_batch))
        .route(
            "/v1/sandboxes/{id}",
            get(get_sandbox).delete(delete_sandbox),
        )
        .route("/v1/sandboxes/{id}/wait", get(wait_sandbox))
        .route("/v1/sandboxes/{id}/timeout", put(set_timeout))
        .route("/v1/sandboxes/{id}/snapshot", post(snapshot_sandbox))
        .route("/v1/sandboxes/{id}/pause", post(pause_sandbox))
        .route("/v1/sandboxes/{id}/resume", post(resume_sandbox))
        .route("/v1/sandboxes/{id}/exec", post(exec))
        .route("/v1/sandboxes/{id}/exec/stream", post(exec_stream))
        .route(
            "/v1/sandboxes/{id}/processes",
            post(start_process).get(list_processes),
        )
        .route("/v1/sandboxes/{id}/processes/{pid}", get(get_process))
        .route(
            "/v1/sandboxes/{id}/processes/{pid}/output",
            get(process_output),
        )
        .route(
            "/v1/sandboxes/{id}/processes/{pid}/signal",
            post(signal_process),
        )
        .route("/v1/sandboxes/{id}/attach", get(attach))
        .route("/v1/prefetch", post(prefetch))
        .route("/v1/node", get(node_info))
        .route("/v1/openapi.json", get(openapi_json))
        .merge(files)
        .fallback(|| async {
            Failure(
                ErrorKind::NotFound,
                "no such route in the node API (see /v1/openapi.json)".into(),
            )
        });
    let r = match token {
        Some(t) => r.layer(axum::middleware::from_fn_with_state(
            Arc::new(t),
            require_token,
        )),
        None => r,
    };
    r.route("/v1/health", get(health)).with_state(node)
}

async fn require_token(
    State(token): State<Arc<String>>,
    req: Request,
    next: axum::middleware::Next,
) -> Response {
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    let ok = given.is_some_and(|g| {
        // Compare in constant time: a token must not leak through timing.
        g.len() == token.len()
            && g.bytes()
                .zip(token.bytes())
                .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                == 0
    });
    if ok {
        next.run(req).await
    } else {
        let mut r = Failure(
            ErrorKind::Unauthorized,
            "this node API needs `Authorization: Bearer <token>` (the token amberd was started with)"
                .into(),
        )
        .into_response();
        r.headers_mut()
            .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        r
    }
}

#[utoipa::path(post, path = "/v1/sandboxes", request_body = CreateSandbox,
    responses(
        (status = 201, description = "Created (and ready, unless `wait` was false)", body = SandboxInfo),
        (status = 200, description = "The sandbox an earlier create with the same idempotency key made", body = SandboxInfo),
        (status = 400, body = ErrorBody), (status = 404, description = "No such image", body = ErrorBody),
        (status = 429, description = "The node is full", body = ErrorBody),
        (status = 502, description = "Integrity error", body = ErrorBody),
        (status = 503, body = ErrorBody)),
    security((), ("bearer" = [])))]
async fn create_sandbox(
    State(node): State<AppState>,
    body: Result<Json<CreateSandbox>, JsonRejection>,
) -> Answer<Response> {
    let c = json(body)?;
    let (info, new) = node.create(c).await?;
    let status = if new {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((status, Json(info)).into_response())
}

#[utoipa::path(post, path = "/v1/sandboxes/batch", request_body = CreateBatch,
    responses((status = 200, description = "One result per request, in order", body = BatchResult),
        (status = 400, body = ErrorBody)),
    security((), ("bearer" = [])))]
async fn create_batch(
    State(node): State<AppState>,
    body: Result<Json<CreateBatch>, JsonRejection>,
) -> Answer<Json<BatchResult>> {
    let b = json(body)?;
    if b.sandboxes.len() > 1024 {
        return Err(rejected("a batch holds at most 1024 sandboxes"));
    }
    let creates = b.sandboxes.into_iter().map(|c| {
        let node = node.clone();
        async move {
            match node.create(c).await {
                Ok((info, _)) => BatchItem {
                    sandbox: Some(info),
                    error: None,
                },
                Err(e) => BatchItem {
                    sandbox: None,
                    error: Some(ApiError {
                        kind: e.kind(),
                        message: e.to_string(),
                    }),
                },
            }
        }
    });
    let results = futures_util::future::join_all(creates).await;
    Ok(Json(BatchResult { results }))
}

#[derive(Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
struct ListQuery {
    /// `key=value[,key=value…]`: only sandboxes with all these labels.
    label: Option<String>,
    /// Also the ended sandboxes the node still remembers.
    all: Option<bool>,
}

fn labels(q: Option<&str>) -> Answer<Vec<(String, String)>> {
    let Some(q) = q else { return Ok(Vec::new()) };
    q.split(',')
        .filter(|s| !s.is_empty())
        .map(|kv| match kv.split_once('=') {
            Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
            _ => Err(rejected(format!("label {kv:?} is not key=value"))),
        })
        .collect()
}

#[utoipa::path(get, path = "/v1/sandboxes", params(ListQuery),
    responses((status = 200, body = SandboxList), (status = 400, body = ErrorBody)),
    security((), ("bearer" = [])))]
async fn list_sandboxes(
    State(node): State<AppState>,
    q: Result<Query<ListQuery>, QueryRejection>,
) -> Answer<Json<SandboxList>> {
    let q = query(q)?;
    let l = labels(q.label.as_deref())?;
    Ok(Json(SandboxList {
        sandboxes: node.list(&l, q.all.unwrap_or(false)),
    }))
}

#[derive(Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
struct LabelQuery {
    /// `key=value[,key=value…]` (required: deleting every sandbox takes a label).
    label: String,
}

#[utoipa::path(delete, path = "/v1/sandboxes", params(LabelQuery),
    responses((status = 200, body = Deleted), (status = 400, body = ErrorBody)),
    security((), ("bearer" = [])))]
async fn delete_by_labels(
    State(node): State<AppState>,
    q: Result<Query<LabelQuery>, QueryRejection>,
) -> Answer<Json<Deleted>> {
    let q = query(q)?;
    let l = labels(Some(&q.label))?;
    if l.is_empty() {
        return Err(rejected("give at least one label key=value"));
    }
    Ok(Json(Deleted {
        deleted: node.delete_by_labels(&l).await,
    }))
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}", params(("id" = String, Path)),
    responses((status = 200, body = SandboxInfo), (status = 404, body = ErrorBody)),
    security((), ("bearer" = [])))]
async fn get_sandbox(
    State(node): State<AppState>,
    id: Result<Path<String>, PathRejection>,
) -> Answer<Json<SandboxInfo>> {
    Ok(Json(node.get(&path(id)?)?))
}

#[derive(Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
struct WaitQuery {
    /// Seconds to wait at most (default 600).
    timeout_s: Option<u32>,
    /// Wait until the sandbox has ended (its VM stopped, `reason` set), not only until
    /// it is no longer creating (default false).
    ended: Option<bool>,
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/wait", params(("id" = String, Path), WaitQuery),
    responses((status = 200, description = "No longer creating, or ended if `ended` was asked (or the wait's timeout passed)", body = SandboxInfo),
        (status = 404, body = ErrorBody)),
    security((), ("bearer" = [])))]
async fn wait_sandbox(
    State(node): State<AppState>,
    id: Result<Path<String>, PathRejection>,
    q: Result<Query<WaitQuery>, QueryRejection>,
) -> Answer<Json<SandboxInfo>> {
    let (id, q) = (path(id)?, query(q)?);
    let t = Duration::from_secs(q.timeout_s.unwrap_or(600).into());
    Ok(Json(node.wait(&id, t, q.ended.unwrap_or(false)).await?))
}

#[utoipa::path(delete, path = "/v1/sandboxes/{id}", params(("id" = String, Path)),
    responses((status = 200, description = "Stopped", body = SandboxInfo), (status = 404, body = ErrorBody)),
    security((), ("bearer" = [])))]
async fn delete_sandbox(
    State(node): State<AppState>,
    id: Result<Path<String>, PathRejection>,
) -> Answer<Json<SandboxInfo>> {
    Ok(Json(node.delete(&path(id)?).await?))
}

#[utoipa::path(put, path = "/v1/sandboxes/{id}/timeout", params(("id" = String, Path)),
    request_body = SetTimeout,
    responses((status = 200, body = SandboxInfo), (status = 400, body = ErrorBody),
        (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)),
    security((), ("bearer" = [])))]
async fn set_timeout(
    State(node): State<AppState>,
    id: Result<Path<String>, PathRejection>,
    body: Result<Json<SetTimeout>, JsonRejection>,
) -> Answer<Json<SandboxInfo>> {
    let (id, t) = (path(id)?, json(body)?);
    Ok(Json(node.set_timeout(&id, t.lifetime_s)?))
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/snapshot", params(("id" = String, Path)),
    request_body = CreateSnapshot,
    responses(
        (status = 201, description = "Pushed (and converted, unless `wait` was false); the sandbox keeps running", body = SnapshotInfo),
        (status = 400, description = "A bad tag, or a sandbox without a writable disk or an image", body = ErrorBody),
        (status = 404, body = ErrorBody),
        (status = 409, description = "The sandbox is not running", body = ErrorBody),
        (status = 503, description = "The registry refused or is unreachable", body = ErrorBody)),
    security((), ("bearer" = [])))]
async fn snapshot_sandbox(
    State(node): State<AppState>,
    id: Result<Path<String>, PathRejection>,
    body: Result<Json<CreateSnapshot>, JsonRejection>,
) -> Answer<Response> {
    let (id, r) = (path(id)?, json(body)?);
    let info = node.snapshot(&id, &r).await?;
    Ok((StatusCode::CREATED, Json(info)).into_response())
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/pause", params(("id" = String, Path)),
    responses(
        (status = 200, description = "Paused: saved to a file on the node (`state_bytes`), no VM runs", body = SandboxInfo),
        (status = 400, description = "Already paused, or an agent too old to pause", body = ErrorBody),
        (status = 404, body = ErrorBody), (status = 409, body = ErrorBody),
        (status = 500, description = "Saving failed; the sandbox ended", body = ErrorBody)),
    security((), ("bearer" = [])))]
async fn pause_sandbox(
    State(node): State<AppState>,
    id: Result<Path<String>, PathRejection>,
) -> Answer<Json<SandboxInfo>> {
    Ok(Json(node.pause(&path(id)?).await?))
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/resume", params(("id" = String, Path)),
    responses(
        (status = 200, description = "Running again where it was paused", body = SandboxInfo),
        (status = 400, description = "Not paused", body = ErrorBody),
        (status = 404, body = ErrorBody), (status = 409, body = ErrorBody),
        (status = 429, description = "No room on the node for its vCPUs and memory now", body = ErrorBody),
        (status = 503, description = "Restoring failed; the sandbox ended", body = ErrorBody)),
    security((), ("bearer" = [])))]
async fn resume_sandbox(
    State(node): State<AppState>,
    id: Result<Path<String>, PathRejection>,
) -> Answer<Json<SandboxInfo>> {
    Ok(Json(node.resume(&path(id)?).await?))
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/exec", params(("id" = String, Path)),
    request_body = ExecRequest,
    responses((status = 200, description = "The command ended (see `exit_code` and `timed_out`)", body = ExecResult),
        (status = 400, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, description = "The sandbox is not running", body = ErrorBody),
        (status = 502, body = ErrorBody)),
    security((), ("bearer" = [])))]
async fn exec(
    State(node): State<AppState>,
    id: Result<Path<String>, PathRejection>,
    body: Result<Json<ExecRequest>, JsonRejection>,
) -> Answer<Json<ExecResult>> {
    let (id, r) = (path(id)?, json(body)?);
    let (p, _activity) = node.exec(&id, &r, false).await?;
    p.result()
        .await
        .map(Json)
        .map_err(|(kind, message)| Failure(kind, message))
}

/// Frames of `p` from `from` on, as NDJSON lines, until its last frame.
fn frames(p: Arc<Process>, from: u64, activity: Option<Activity>) -> Body {
    let stream = futures_util::stream::unfold(
        (p, from, false, activity),
        |(p, next, done, activity)| async move {
            if done {
                return None;
            }
            loop {
                let (frames, ended) = p.frames_from(next);
                if !frames.is_empty() {
                    let mut text = Vec::new();
                    let mut last = next;
                    let mut end = false;
                    for f in &frames {
                        ndjson_line(&mut text, f);
                        last = f.seq() + 1;
                        end |= f.is_end();
                    }
                    let chunk: Result<Bytes, Infallible> = Ok(Bytes::from(text));
                    return Some((chunk, (p, last, end, activity)));
                }
                if ended {
                    return None;
                }
                p.wait_past(next).await;
            }
        },
    );
    Body::from_stream(stream)
}

/// Appends `frame` to `out` as one line of a streamed answer.
fn ndjson_line(out: &mut Vec<u8>, frame: &impl serde::Serialize) {
    serde_json::to_writer(&mut *out, frame).expect("frames serialize");
    out.push(b'\n');
}

fn ndjson(body: Body) -> Response {
    ([(header::CONTENT_TYPE, NDJSON)], body).into_response()
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/exec/stream", params(("id" = String, Path)),
    request_body = ExecRequest,
    responses((status = 200, description = "Newline-delimited `ExecFrame`s: output in order, then `exit` (or `error`). The header `x-amber-process` names the process, whose output `…/processes/{pid}/output` serves again.", content_type = "application/x-ndjson", body = ExecFrame),
        (status = 400, body = ErrorBody), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)),
    security((), ("bearer" = [])))]
async fn exec_stream(
    State(node): State<AppState>,
    id: Result<Path<String>, PathRejection>,
    body: Result<Json<ExecRequest>, JsonRejection>,
) -> Answer<Response> {
    let (id, r) = (path(id)?, json(body)?);
    let (p, activity) = node.exec(&id, &r, true).await?;
    let pid = p.id;
    let mut resp = ndjson(frames(p, 0, Some(activity)));
    resp.headers_mut()
        .insert(PROCESS_HEADER, HeaderValue::from(pid));
    Ok(resp)
}

#[utoipa::path(post, path = "/v1/prefetch", request_body = Prefetch,
    responses((status = 200, description = "Newline-delimited `PrefetchFrame`s: how much of the image's env the node's cache holds, as its chunks arrive, then `done` (or `error`).", content_type = "application/x-ndjson", body = PrefetchFrame),
        (status = 400, body = ErrorBody), (status = 404, body = ErrorBody), (status = 502, body = ErrorBody)),
    security((), ("bearer" = [])))]
async fn prefetch(
    State(node): State<AppState>,
    body: Result<Json<Prefetch>, JsonRejection>,
) -> Answer<Response> {
    let r = json(body)?;
    let frames = node.prefetch(&r.image).await?;
    let lines = futures_util::stream::unfold(frames, |mut frames| async move {
        let mut line = Vec::new();
        ndjson_line(&mut line, &frames.recv().await?);
        Some((Ok::<_, Infallible>(Bytes::from(line)), frames))
    });
    Ok(ndjson(Body::from_stream(lines)))
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/processes", params(("id" = String, Path)),
    request_body = ExecRequest,
    responses((status = 201, description = "Started in the background", body = ProcessInfo),
        (status = 400, body = ErrorBody), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)),
    security((), ("bearer" = [])))]
async fn start_process(
    State(node): State<AppState>,
    id: Result<Path<String>, PathRejection>,
    body: Result<Json<ExecRequest>, JsonRejection>,
) -> Answer<Response> {
    let (id, r) = (path(id)?, json(body)?);
    let (p, _activity) = node.exec(&id, &r, true).await?;
    Ok((StatusCode::CREATED, Json(p.info())).into_response())
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/processes", params(("id" = String, Path)),
    responses((status = 200, body = ProcessList), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)),
    security((), ("bearer" = [])))]
async fn list_processes(
    State(node): State<AppState>,
    id: Result<Path<String>, PathRejection>,
) -> Answer<Json<ProcessList>> {
    Ok(Json(ProcessList {
        processes: node.processes(&path(id)?)?,
    }))
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/processes/{pid}",
    params(("id" = String, Path), ("pid" = u32, Path)),
    responses((status = 200, body = ProcessInfo), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody)),
    security((), ("bearer" = [])))]
async fn get_process(
    State(node): State<AppState>,
    p: Result<Path<(String, u32)>, PathRejection>,
) -> Answer<Json<ProcessInfo>> {
    let (id, pid) = path(p)?;
    Ok(Json(node.process(&id, pid)?.info()))
}

#[derive(Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
struct OutputQuery {
    /// The first sequence number wanted (default 0).
    from: Option<u64>,
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/processes/{pid}/output",
    params(("id" = String, Path), ("pid" = u32, Path), OutputQuery),
    responses((status = 200, description = "`ExecFrame`s from `from` on, following the process until it ends", content_type = "application/x-ndjson", body = ExecFrame),
        (status = 400, body = ErrorBody), (status = 404, body = ErrorBody)),
    security((), ("bearer" = [])))]
async fn process_output(
    State(node): State<AppState>,
    p: Result<Path<(String, u32)>, PathRejection>,
    q: Result<Query<OutputQuery>, QueryRejection>,
) -> Answer<Response> {
    let ((id, pid), q) = (path(p)?, query(q)?);
    let p = node.process(&id, pid)?;
    Ok(ndjson(frames(p, q.from.unwrap_or(0), None)))
}

/// A signal's number from `15`, `TERM` or `SIGTERM`.
fn signal_number(s: &str) -> Option<i32> {
    if let Ok(n) = s.parse::<i32>() {
        return (1..=64).contains(&n).then_some(n);
    }
    let name = s.strip_prefix("SIG").unwrap_or(s);
    Some(match name {
        "HUP" => libc::SIGHUP,
        "INT" => libc::SIGINT,
        "QUIT" => libc::SIGQUIT,
        "KILL" => libc::SIGKILL,
        "USR1" => libc::SIGUSR1,
        "USR2" => libc::SIGUSR2,
        "TERM" => libc::SIGTERM,
        "CONT" => libc::SIGCONT,
        "STOP" => libc::SIGSTOP,
        "ALRM" => libc::SIGALRM,
        _ => return None,
    })
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/processes/{pid}/signal",
    params(("id" = String, Path), ("pid" = u32, Path)), request_body = SignalRequest,
    responses((status = 200, body = ProcessInfo), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody)),
    security((), ("bearer" = [])))]
async fn signal_process(
    State(node): State<AppState>,
    p: Result<Path<(String, u32)>, PathRejection>,
    body: Result<Json<SignalRequest>, JsonRejection>,
) -> Answer<Json<ProcessInfo>> {
    let ((id, pid), s) = (path(p)?, json(body)?);
    let n = signal_number(&s.signal).ok_or_else(|| {
        rejected(format!(
            "{:?} is not a signal (give 15, TERM or SIGTERM)",
            s.signal
        ))
    })?;
    let p = node.process(&id, pid)?;
    p.signal(n).await;
    Ok(Json(p.info()))
}

#[derive(Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
struct FileQuery {
    /// An absolute path in the sandbox.
    path: String,
    /// Octal mode of an uploaded file (default 644).
    mode: Option<String>,
}

#[utoipa::path(put, path = "/v1/sandboxes/{id}/files", params(("id" = String, Path), FileQuery),
    request_body(content = Vec<u8>, content_type = "application/octet-stream", description = "The file's bytes (Content-Length required)"),
    responses((status = 204, description = "Written (parents created)"), (status = 400, body = ErrorBody),
        (status = 404, body = ErrorBody), (status = 409, body = ErrorBody), (status = 411, body = ErrorBody)),
    security((), ("bearer" = [])))]
async fn put_file(
    State(node): State<AppState>,
    id: Result<Path<String>, PathRejection>,
    q: Result<Query<FileQuery>, QueryRejection>,
    headers: HeaderMap,
    body: Body,
) -> Answer<StatusCode> {
    let (id, q) = (path(id)?, query(q)?);
    let mode = match &q.mode {
        Some(m) => u32::from_str_radix(m, 8)
            .ok()
            .filter(|m| *m <= 0o7777)
            .ok_or_else(|| rejected(format!("mode {m:?} is not an octal file mode")))?,
        None => 0o644,
    };
    let len = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .ok_or_else(|| {
            Failure(
                ErrorKind::BadRequest,
                "a file upload needs Content-Length (or use /archive with a tar stream)".into(),
            )
        })?;
    let (running, _activity) = node.running(&id).await?;
    files::put_file(&running.mux, &q.path, len, mode, body.into_data_stream()).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
struct PathQuery {
    /// An absolute path in the sandbox.
    path: String,
}

fn file_body<S>(s: S, activity: Activity) -> Body
where
    S: futures_util::Stream<Item = Result<Bytes, FileError>> + Send + 'static,
{
    Body::from_stream(s.map(move |r| {
        let _held = &activity;
        r.map_err(std::io::Error::other)
    }))
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/files", params(("id" = String, Path), PathQuery),
    responses((status = 200, description = "The file's bytes", content_type = "application/octet-stream", body = Vec<u8>),
        (status = 400, description = "Not a regular file", body = ErrorBody), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)),
    security((), ("bearer" = [])))]
async fn get_file(
    State(node): State<AppState>,
    id: Result<Path<String>, PathRejection>,
    q: Result<Query<PathQuery>, QueryRejection>,
) -> Answer<Response> {
    let (id, q) = (path(id)?, query(q)?);
    let (running, activity) = node.running(&id).await?;
    let (size, stream) = files::get_file(&running.mux, &q.path).await?;
    Ok((
        [
            (header::CONTENT_TYPE, "application/octet-stream".to_string()),
            (header::CONTENT_LENGTH, size.to_string()),
        ],
        file_body(stream, activity),
    )
        .into_response())
}

#[utoipa::path(put, path = "/v1/sandboxes/{id}/archive", params(("id" = String, Path), PathQuery),
    request_body(content = Vec<u8>, content_type = "application/octet-stream", description = "A tar stream, unpacked into `path`"),
    responses((status = 204, description = "Unpacked"), (status = 400, body = ErrorBody),
        (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)),
    security((), ("bearer" = [])))]
async fn put_archive(
    State(node): State<AppState>,
    id: Result<Path<String>, PathRejection>,
    q: Result<Query<PathQuery>, QueryRejection>,
    body: Body,
) -> Answer<StatusCode> {
    let (id, q) = (path(id)?, query(q)?);
    let (running, _activity) = node.running(&id).await?;
    files::put_archive(&running.mux, &q.path, body.into_data_stream()).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/archive", params(("id" = String, Path), PathQuery),
    responses((status = 200, description = "A tar stream of `path` (its first entry is `.`, the path itself)", content_type = "application/x-tar", body = Vec<u8>),
        (status = 400, body = ErrorBody), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)),
    security((), ("bearer" = [])))]
async fn get_archive(
    State(node): State<AppState>,
    id: Result<Path<String>, PathRejection>,
    q: Result<Query<PathQuery>, QueryRejection>,
) -> Answer<Response> {
    let (id, q) = (path(id)?, query(q)?);
    let (running, activity) = node.running(&id).await?;
    let stream = files::get_archive(&running.mux, &q.path).await?;
    Ok((
        [(header::CONTENT_TYPE, "application/x-tar")],
        file_body(stream, activity),
    )
        .into_response())
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/attach", params(("id" = String, Path)),
    responses((status = 101, description = "`Upgrade: amber-frames`: the connection carries the guest protocol's frames (sessions for exec with stdin and signals, and tar copies), as the `amber` CLI uses it"),
        (status = 400, description = "Not an upgrade request", body = ErrorBody),
        (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)),
    security((), ("bearer" = [])))]
async fn attach(
    State(node): State<AppState>,
    id: Result<Path<String>, PathRejection>,
    mut req: Request,
) -> Answer<Response> {
    let id = path(id)?;
    let wants = req
        .headers()
        .get(header::UPGRADE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case(ATTACH_PROTOCOL));
    if !wants {
        return Err(rejected(format!(
            "attach is an HTTP upgrade: send `Connection: Upgrade` and `Upgrade: {ATTACH_PROTOCOL}`"
        )));
    }
    let (running, activity) = node.running(&id).await?;
    let on_upgrade = hyper::upgrade::on(&mut req);
    tokio::spawn(async move {
        if let Ok(upgraded) = on_upgrade.await {
            let io = hyper_util::rt::TokioIo::new(upgraded);
            crate::sandbox::relay(io, running.mux, running.device, running.defaults).await;
        }
        drop(activity);
    });
    Ok((
        StatusCode::SWITCHING_PROTOCOLS,
        [
            (header::CONNECTION, "upgrade"),
            (header::UPGRADE, ATTACH_PROTOCOL),
        ],
    )
        .into_response())
}

#[derive(Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
struct NodeQuery {
    /// Also say how much of this image's env the cache holds (resolved through the registry).
    image: Option<String>,
}

#[utoipa::path(get, path = "/v1/node", params(NodeQuery),
    responses((status = 200, body = NodeInfo), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody)),
    security((), ("bearer" = [])))]
async fn node_info(
    State(node): State<AppState>,
    q: Result<Query<NodeQuery>, QueryRejection>,
) -> Answer<Json<NodeInfo>> {
    let q = query(q)?;
    Ok(Json(node.info(q.image.as_deref()).await?))
}

#[utoipa::path(get, path = "/v1/health", responses((status = 200, body = Health)))]
async fn health() -> Json<Health> {
    Json(Health {
        status: "ok".into(),
        version: env!("CARGO_PKG_VERSION").into(),
    })
}

#[utoipa::path(get, path = "/v1/openapi.json",
    responses((status = 200, description = "This document", content_type = "application/json")),
    security((), ("bearer" = [])))]
async fn openapi_json() -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        ApiDoc::openapi()
            .to_pretty_json()
            .expect("the document serializes"),
    )
        .into_response()
}
