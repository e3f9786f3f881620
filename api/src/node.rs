//! The node API of `amberd`, versioned under `/v1/`, on a Unix socket (`<home>/amberd.sock`)
//! and optionally on TCP with a bearer token. Shaped after the hosted sandbox SDKs that RL
//! environment libraries call: create (one or a batch), wait, exec, files, list, delete.
//!
//! - `POST /v1/sandboxes` `CreateSandbox` -> 201 `SandboxInfo` (200 for a repeated
//!   idempotency key); `POST /v1/sandboxes/batch` `CreateBatch` -> `BatchResult`;
//! - `GET /v1/sandboxes[?label=k=v]` -> `SandboxList`; `GET /v1/sandboxes/{id}`;
//!   `GET /v1/sandboxes/{id}/wait`; `DELETE /v1/sandboxes/{id}`;
//!   `DELETE /v1/sandboxes?label=k=v` -> `Deleted`; `PUT /v1/sandboxes/{id}/timeout`;
//! - `POST /v1/sandboxes/{id}/exec` `ExecRequest` -> `ExecResult`; `…/exec/stream` ->
//!   newline-delimited `ExecFrame`s; `POST …/processes` -> `ProcessInfo` (a background
//!   process), `GET …/processes/{pid}/output?from=SEQ` -> `ExecFrame`s again from any
//!   sequence number, `POST …/processes/{pid}/signal` `SignalRequest`;
//! - `PUT|GET /v1/sandboxes/{id}/files?path=` raw bytes; `PUT|GET …/archive?path=` a tar;
//! - `POST /v1/sandboxes/{id}/snapshot` `CreateSnapshot` -> 201 `SnapshotInfo` (the
//!   sandbox's files as a new image in the registry; the sandbox keeps running);
//! - `POST /v1/sandboxes/{id}/pause` -> `SandboxInfo` (`paused`: saved to a file, its
//!   vCPUs and memory free), `POST …/resume` -> `SandboxInfo` (running where it was);
//! - `POST /v1/prefetch` `Prefetch` -> newline-delimited `PrefetchFrame`s: an image's env
//!   fetched into the node's cache, with its progress, before any sandbox boots it;
//! - `GET /v1/node[?image=REF]` -> `NodeInfo`; `GET /v1/health`; `GET /v1/openapi.json`.
//!
//! Every error is `ErrorBody` with a stable `kind` a client can branch on.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// The path prefix of this version of the API.
pub const PREFIX: &str = "/v1";

fn one() -> u32 {
    1
}

fn default_memory() -> u32 {
    512
}

fn yes() -> bool {
    true
}

/// A new sandbox: what it boots, its shape, and how long it may live.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CreateSandbox {
    /// `name:tag`, `name@sha256:…` or an env digest `blake3:…`.
    pub image: String,
    #[serde(default = "one")]
    #[cfg_attr(feature = "openapi", schema(minimum = 1, maximum = 64, default = 1))]
    pub cpus: u32,
    #[serde(default = "default_memory")]
    #[cfg_attr(feature = "openapi", schema(minimum = 128, default = 512))]
    pub memory_mib: u32,
    /// The sandbox's writable disk in MiB, where every write goes (a sparse file on the
    /// node: it costs what is written; a full disk is ENOSPC inside the guest): 64 to
    /// 1048576, or 0 to keep writes in guest memory. 8192 when unset.
    #[serde(default)]
    #[cfg_attr(feature = "openapi", schema(maximum = 1048576))]
    pub disk_mib: Option<u32>,
    /// Added to (and overriding) the image's environment for every command.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// The working directory of commands (the image's `WorkingDir` when unset).
    #[serde(default)]
    pub workdir: Option<String>,
    /// The user commands run as (the image's `User` when unset).
    #[serde(default)]
    pub user: Option<String>,
    #[serde(default)]
    pub hostname: Option<String>,
    /// Seconds after which the node ends the sandbox, whoever created it.
    #[serde(default)]
    pub lifetime_s: Option<u64>,
    /// Seconds without any API call on the sandbox after which the node ends it.
    #[serde(default)]
    pub idle_timeout_s: Option<u64>,
    /// A second create with the same key returns the first sandbox instead.
    #[serde(default)]
    pub idempotency_key: Option<String>,
    /// Answer only once the guest agent answers (the default), else at once.
    #[serde(default = "yes")]
    pub wait: bool,
    /// Boot exactly these boot files (`sha256:…`, as a receipt pins them) instead of the
    /// node's current ones.
    #[serde(default)]
    pub kernel: Option<String>,
    #[serde(default)]
    pub initramfs: Option<String>,
    /// `kvm` or `tcg` (the node's probe result when unset). With `kernel` and
    /// `initramfs` as well, the node needs no `amber setup` of its own.
    #[serde(default)]
    pub accel: Option<String>,
    /// Also expose the read-only root device as /dev/vda inside.
    #[serde(default)]
    pub root_device: bool,
    /// Fetch every chunk into the node cache before booting.
    #[serde(default)]
    pub prefetch: bool,
    /// A network interface (user-mode networking on the node). Without it the sandbox
    /// has no network at all, only its loopback.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<NetworkSpec>,
}

/// A sandbox's network: what it may reach, which host services it sees, which of its
/// ports the host reaches. Inside, the sandbox is 10.0.2.15/24 with its gateway (the
/// host) at 10.0.2.2, named `host.amber.internal`, and a DNS server at 10.0.2.3. What
/// is not allowed fails at once (connection refused, port unreachable).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct NetworkSpec {
    /// Destinations the sandbox may connect to over TCP and UDP: `ADDR`, `CIDR`,
    /// `ADDR:PORT` or `CIDR:PORT` (IPv4), e.g. `0.0.0.0/0:443`. The host's loopback is
    /// the gateway: `127.0.0.1:8080` lets the sandbox reach the host's port 8080 at
    /// 10.0.2.2:8080. Empty: nothing but the host services (and no DNS names but the
    /// gateway's).
    #[serde(default)]
    pub allow: Vec<String>,
    /// Host services reachable at the gateway whatever `allow` says: `PORT=ADDR:PORT`
    /// (the gateway's port, then the host's address), or `ADDR:PORT` for the same port.
    #[serde(default)]
    pub host_services: Vec<String>,
    /// Ports of the sandbox the host reaches: `PORT` (on 127.0.0.1, a free port) or
    /// `PORT=ADDR:PORT` (a loopback address of the host; port 0 picks one).
    #[serde(default)]
    pub ports: Vec<String>,
}

/// A sandbox's network as it runs.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct NetworkInfo {
    /// The sandbox's address inside.
    pub address: String,
    pub gateway: String,
    pub dns: String,
    pub allow: Vec<String>,
    pub host_services: Vec<String>,
    pub ports: Vec<PublishedPort>,
}

/// A port of the sandbox and where the host reaches it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PublishedPort {
    pub guest_port: u16,
    /// `ADDR:PORT` on the host.
    pub host: String,
}

#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum SandboxStatus {
    /// Booting; commands wait.
    Creating,
    Running,
    /// Ended: deleted, or past its lifetime or idle timeout (`reason` says which).
    Stopped,
    /// Did not start, or its VM died (`reason` says why).
    Failed,
    /// It was running when its `amberd` stopped; its VM was stopped with it.
    Lost,
    /// Saved to a file on its node (memory, devices, disk) and not running: `resume`
    /// continues it where it was. Its vCPUs and memory are free for others meanwhile.
    Paused,
}

/// A sandbox as the node sees it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SandboxInfo {
    pub id: String,
    /// The reference it was created from.
    pub image: String,
    pub image_digest: Option<String>,
    pub env_digest: String,
    pub status: SandboxStatus,
    /// Why it is not running (for `stopped`, `failed` and `lost`).
    pub reason: Option<String>,
    pub cpus: u32,
    pub memory_mib: u32,
    /// Its writable disk (0: writes in guest memory).
    #[serde(default)]
    pub disk_mib: u32,
    pub labels: BTreeMap<String, String>,
    pub hostname: String,
    /// Unix seconds.
    pub created_at: u64,
    /// Unix seconds at which the node ends it, if it has a lifetime.
    pub expires_at: Option<u64>,
    pub idle_timeout_s: Option<u64>,
    pub kernel: String,
    pub initramfs: String,
    pub accel: String,
    /// When it was created from a snapshot: the images that snapshot was made from,
    /// nearest first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub parents: Vec<Parent>,
    /// While paused: the bytes of its saved memory and device state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state_bytes: Option<u64>,
    /// Its network, when it was created with one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<NetworkInfo>,
}

/// One image in a snapshot's lineage.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Parent {
    /// `repository@sha256:…`
    pub image: String,
    pub env_digest: String,
}

/// Commit a sandbox's files as a new image (its image plus one layer of its changes).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CreateSnapshot {
    /// `name` or `name:tag` to push the image under (`latest` when no tag is given); by
    /// default the sandbox's own repository, by digest only.
    #[serde(default)]
    pub tag: Option<String>,
    /// Answer once the registry has converted the image (`env_digest` set), the default;
    /// else as soon as it is pushed.
    #[serde(default = "yes")]
    pub wait: bool,
}

/// A snapshot: an ordinary image in the registry, pinned by digest.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SnapshotInfo {
    /// The sandbox it was taken from (which keeps running).
    pub sandbox: String,
    /// `repository@sha256:…`: what `create` and `docker pull` take.
    pub image: String,
    /// `repository:tag`, when it was pushed under a tag.
    pub tag: Option<String>,
    pub image_digest: String,
    /// Its env (set once converted: always when `wait` was asked).
    pub env_digest: Option<String>,
    /// The new layer: its digest and size, and the size of the tar inside (the same:
    /// snapshot layers are uncompressed tars, which the registry keeps as recipes over
    /// the chunks they convert into).
    pub layer_digest: String,
    pub layer_bytes: u64,
    pub diff_bytes: u64,
    /// Milliseconds from asking the guest to the last byte of its changes: the
    /// sandbox's disk is frozen (writes wait) for about this long.
    pub frozen_ms: u64,
    /// Milliseconds until the image was pushed, and until it was converted (`wait`).
    pub pushed_ms: u64,
    pub converted_ms: Option<u64>,
    /// Its lineage, nearest first: the sandbox's image, then that image's own parents.
    pub parents: Vec<Parent>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SandboxList {
    pub sandboxes: Vec<SandboxInfo>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CreateBatch {
    pub sandboxes: Vec<CreateSandbox>,
}

/// One answer per request of the batch, in order: the sandbox or why not.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct BatchResult {
    pub results: Vec<BatchItem>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct BatchItem {
    pub sandbox: Option<SandboxInfo>,
    pub error: Option<ApiError>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Deleted {
    pub deleted: Vec<String>,
}

/// A new hard lifetime, counted from now.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct SetTimeout {
    pub lifetime_s: u64,
}

/// A command. Exactly one of `argv` and `command` (a shell string run by `/bin/sh -c`).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ExecRequest {
    #[serde(default)]
    pub argv: Option<Vec<String>>,
    #[serde(default)]
    pub command: Option<String>,
    #[serde(default)]
    pub cwd: Option<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub user: Option<String>,
    /// Seconds before the command's process group is killed (reported as `timed_out`).
    #[serde(default)]
    #[cfg_attr(feature = "openapi", schema(minimum = 0))]
    pub timeout_s: Option<f64>,
    /// Text written to the command's stdin, which is then closed (else /dev/null).
    #[serde(default)]
    pub stdin: Option<String>,
}

/// A finished command. Output is text (invalid UTF-8 replaced), cut at the node's bound.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ExecResult {
    pub exit_code: i32,
    pub stdout: String,
    pub stderr: String,
    /// Killed at its `timeout_s`.
    pub timed_out: bool,
    /// Output beyond the node's bound was dropped.
    pub truncated: bool,
    pub duration_ms: u64,
}

/// One line of a streamed command: output in order, numbered from 0, then its end.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ExecFrame {
    Stdout {
        seq: u64,
        data: String,
    },
    Stderr {
        seq: u64,
        data: String,
    },
    Exit {
        seq: u64,
        exit_code: i32,
        timed_out: bool,
    },
    /// The command could not run, or the sandbox ended under it.
    Error {
        seq: u64,
        kind: ErrorKind,
        message: String,
    },
}

impl ExecFrame {
    pub fn seq(&self) -> u64 {
        match self {
            ExecFrame::Stdout { seq, .. }
            | ExecFrame::Stderr { seq, .. }
            | ExecFrame::Exit { seq, .. }
            | ExecFrame::Error { seq, .. } => *seq,
        }
    }

    /// The last frame of a command.
    pub fn is_end(&self) -> bool {
        matches!(self, ExecFrame::Exit { .. } | ExecFrame::Error { .. })
    }
}

#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum ProcessStatus {
    Running,
    Exited,
}

/// A background process.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ProcessInfo {
    pub id: u32,
    pub argv: Vec<String>,
    pub status: ProcessStatus,
    pub exit_code: Option<i32>,
    pub timed_out: bool,
    /// The sequence number the next frame will carry.
    pub next_seq: u64,
    /// The first sequence number still held (older output was dropped at the bound).
    pub first_seq: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ProcessList {
    pub processes: Vec<ProcessInfo>,
}

/// A signal for a process's group, by number (15) or name (`TERM`, `SIGTERM`).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct SignalRequest {
    pub signal: String,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Resources {
    pub sandboxes: u32,
    pub cpus: u32,
    pub memory_mib: u64,
}

/// How much of an env's data this node's cache holds.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct CachedEnv {
    pub env_digest: String,
    pub chunks: u64,
    pub cached_chunks: u64,
    pub bytes: u64,
    pub cached_bytes: u64,
}

/// What to fetch into the node's cache: an image as `create` takes it (`name:tag`,
/// `name@sha256:…`, or an env digest `blake3:…`).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct Prefetch {
    pub image: String,
}

/// One line of a prefetch: how much of the env the cache holds, first before any fetch,
/// then as chunks arrive (a few times a second at most), then `done` (or `error`).
/// `fetched_bytes` counts the chunk bytes this prefetch brought from the registry
/// (uncompressed); the rest were in the cache already.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum PrefetchFrame {
    Progress {
        cache: CachedEnv,
        fetched_bytes: u64,
    },
    Done {
        cache: CachedEnv,
        fetched_bytes: u64,
    },
    /// A chunk could not be fetched or failed verification; nothing more is fetched.
    Error { kind: ErrorKind, message: String },
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct NodeInfo {
    pub version: String,
    pub api: String,
    pub registry: String,
    pub accel: String,
    pub capacity: Resources,
    pub used: Resources,
    pub free: Resources,
    pub cache_bytes: u64,
    pub cache_limit_bytes: u64,
    /// Envs this node has served, with how much of each its cache holds.
    pub envs: Vec<CachedEnv>,
    /// The env of `?image=`, when asked (resolved through the registry).
    pub image: Option<CachedEnv>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Health {
    pub status: String,
    pub version: String,
}

/// What went wrong, by kind (stable, for clients to branch on) and in words.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    BadRequest,
    Unauthorized,
    /// No such sandbox or process (or file, for downloads).
    NotFound,
    /// The image reference or env is not in the registry.
    ImageNotFound,
    /// The sandbox exists but is not running (its `reason` says why).
    NotRunning,
    /// The node has no room: sandboxes, vCPUs or memory (HTTP 429).
    Capacity,
    /// A chunk or manifest failed verification.
    Integrity,
    /// The command ran past its timeout.
    Timeout,
    /// The registry or a boot file is unavailable.
    Unavailable,
    Internal,
}

impl ErrorKind {
    pub fn status(self) -> u16 {
        match self {
            ErrorKind::BadRequest => 400,
            ErrorKind::Unauthorized => 401,
            ErrorKind::NotFound | ErrorKind::ImageNotFound => 404,
            ErrorKind::NotRunning => 409,
            ErrorKind::Capacity => 429,
            ErrorKind::Integrity => 502,
            ErrorKind::Timeout => 504,
            ErrorKind::Unavailable => 503,
            ErrorKind::Internal => 500,
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ApiError {
    pub kind: ErrorKind,
    pub message: String,
}

/// The body of every error answer.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ErrorBody {
    pub error: ApiError,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_minimal_create_takes_the_defaults_and_unknown_fields_are_refused() {
        let c: CreateSandbox = serde_json::from_str(r#"{"image":"a/b:1"}"#).unwrap();
        assert_eq!((c.cpus, c.memory_mib, c.wait), (1, 512, true));
        assert!(serde_json::from_str::<CreateSandbox>(r#"{"image":"a","cpu":2}"#).is_err());
    }

    #[test]
    fn frames_are_tagged_lines() {
        let f = ExecFrame::Stdout {
            seq: 3,
            data: "hi\n".into(),
        };
        assert_eq!(
            serde_json::to_string(&f).unwrap(),
            r#"{"type":"stdout","seq":3,"data":"hi\n"}"#
        );
        let e: ExecFrame =
            serde_json::from_str(r#"{"type":"exit","seq":4,"exit_code":0,"timed_out":false}"#)
                .unwrap();
        assert!(e.is_end());
        assert_eq!(e.seq(), 4);
    }
}
