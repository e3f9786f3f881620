//! Upload sessions: their records in the object store (`_records/uploads/<id>`), so that
//! every replica over one bucket can continue, finish or cancel an upload another
//! replica started (no sticky load balancing), and recovery and expiry of abandoned
//! sessions.
//!
//! Invariants kept here:
//! - a session's record is created before any of its staged data, and removed after its
//!   staged data is dropped or just before it is published (a store may publish staged
//!   data in place, and a session's removal removes its data); so staged data without a
//!   record is an orphan, a crash's leftover, or (s3) the first segment of a published
//!   blob, which its removal leaves alone;
//! - the acknowledged offset only moves forward, with compare-and-swap on the record's
//!   version, after the staged bytes up to it are durable; staged bytes past it belong
//!   to a request that never finished and are never read (fs cuts them off before the
//!   next append; s3 keeps them in objects no segment names);
//! - two requests writing one session at once (through two replicas) cannot both be
//!   acknowledged: the second compare-and-swap fails, and its request drops the segment
//!   it wrote;
//! - the record lists the session's acknowledged segments ([`Segment`]), moved by the same
//!   compare-and-swap as the offset; every read and publish takes them from it. On a
//!   shared store each append writes an object of its own (`crate::store::s3`), so the
//!   bytes below the acknowledged offset never change: a running hash kept by the replica
//!   that acknowledged them (`HashState`, valid while its length is the offset) is the
//!   hash of what is published, and a request that lost cannot change them, before or
//!   after the publish.

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::registry::Registry;
use crate::store::{RecordKey, Segment, StoreError, Version};

/// An upload session; its data is the staged object of the same id.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct UploadSession {
    pub repo: String,
    /// Bytes acknowledged to the client; staged data past this is from an interrupted
    /// request and is cut off before the next append.
    pub offset: u64,
    pub created_unix: u64,
    pub updated_unix: u64,
    /// The acknowledged appends, holding bytes `0..offset` (none while it is 0). A record
    /// of a registry before segments has none and an offset above 0: its staged bytes are
    /// not known by name, and the session answers as unknown (the client starts again).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub segments: Vec<Segment>,
}

impl UploadSession {
    /// A new session of repository `repo` at time `now`.
    pub fn new(repo: &str, now: u64) -> UploadSession {
        UploadSession {
            repo: repo.to_string(),
            offset: 0,
            created_unix: now,
            updated_unix: now,
            segments: Vec::new(),
        }
    }

    /// Whether its record was written by a registry before segments (bytes staged, none
    /// named).
    pub fn unnamed(&self) -> bool {
        self.offset > 0 && self.segments.is_empty()
    }
}

/// The id of an upload session: a UUID the registry made. Anything else names no session.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SessionId(uuid::Uuid);

impl SessionId {
    pub fn new() -> SessionId {
        SessionId(uuid::Uuid::new_v4())
    }

    /// The session named in a request path, if it is one the registry could have made.
    pub fn parse(s: &str) -> Option<SessionId> {
        uuid::Uuid::try_parse(s).ok().map(SessionId)
    }

    fn record(&self) -> RecordKey {
        RecordKey::upload(&self.0)
    }
}

impl Default for SessionId {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Display for SessionId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum UploadError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("upload session {id} record is not valid: {why}")]
    Corrupt { id: String, why: String },
    #[error("another request changed upload {id} at the same time; ask for its status and resume from the offset it reports")]
    Moved { id: String },
}

impl Registry {
    /// Session `id` and its record's version, or `None` when it does not exist.
    pub async fn upload_session(
        &self,
        id: &SessionId,
    ) -> Result<Option<(UploadSession, Version)>, UploadError> {
        let Some((v, version)) = self.store.get_record(&id.record()).await? else {
            return Ok(None);
        };
        let s = serde_json::from_slice(&v).map_err(|e| UploadError::Corrupt {
            id: id.to_string(),
            why: e.to_string(),
        })?;
        Ok(Some((s, version)))
    }

    /// Writes session `id`: a new one when `expected` is `None`, else only if its record
    /// is still at `expected`. Returns the new version.
    pub async fn put_upload_session(
        &self,
        id: &SessionId,
        s: &UploadSession,
        expected: Option<&Version>,
    ) -> Result<Version, UploadError> {
        let value = Bytes::from(serde_json::to_vec(s).expect("session serializes"));
        self.store
            .put_record(&id.record(), value, expected)
            .await?
            .ok_or_else(|| UploadError::Moved { id: id.to_string() })
    }

    /// Ends session `id` (its record `s`): its staged data first, then its record.
    pub async fn drop_upload_session(
        &self,
        id: &SessionId,
        s: &UploadSession,
    ) -> Result<(), UploadError> {
        let name = id.to_string();
        let segments = if s.unnamed() {
            // A record of before segments: its first segment is the unnamed one.
            vec![Segment::default()]
        } else {
            s.segments.clone()
        };
        self.store.remove_staged(&name, &segments).await?;
        self.store.delete_record(&id.record()).await?;
        self.forget_session(&name);
        Ok(())
    }

    /// Forgets session `id` whose staged data was published as a blob.
    pub async fn finish_upload_session(&self, id: &SessionId) -> Result<(), UploadError> {
        self.store.delete_record(&id.record()).await?;
        self.forget_session(&id.to_string());
        Ok(())
    }

    /// Every session with its record (for recovery, expiry and fsck). A record that
    /// vanished while listing (a finished upload) is left out.
    pub async fn upload_sessions(&self) -> Result<Vec<(SessionId, UploadSession)>, UploadError> {
        let mut out = Vec::new();
        for key in self.store.list_records(RecordKey::UPLOADS).await? {
            let Some(id) = key
                .as_str()
                .strip_prefix(RecordKey::UPLOADS)
                .and_then(SessionId::parse)
            else {
                continue;
            };
            if let Some((s, _)) = self.upload_session(&id).await? {
                out.push((id, s));
            }
        }
        Ok(out)
    }

    /// Brings upload sessions and staged data back into agreement after a restart, for
    /// a store this process owns alone (fs): staged bytes past the acknowledged offset
    /// (an interrupted request) are cut off, sessions whose data is gone are dropped,
    /// staged data without a session is removed. Over a shared bucket another replica
    /// may be in the middle of an append, so only orphans are removed there, and the
    /// rest is done lazily by the next append to each session.
    /// Returns (sessions kept, sessions dropped, orphans removed).
    pub async fn recover_uploads(&self) -> Result<(usize, usize, usize), UploadError> {
        let sessions = self.upload_sessions().await?;
        let shared = self.config.storage != crate::config::StorageKind::Fs;
        let (mut kept, mut dropped) = (0, 0);
        for (id, mut s) in sessions.iter().cloned() {
            if shared {
                kept += 1;
                continue;
            }
            match self.store.staged_len(&id.to_string()).await? {
                None if s.offset == 0 => kept += 1,
                None => {
                    self.drop_upload_session(&id, &s).await?;
                    dropped += 1;
                }
                Some(len) if len > s.offset => {
                    self.store
                        .truncate_staged(&id.to_string(), s.offset)
                        .await?;
                    kept += 1;
                }
                Some(len) if len < s.offset => {
                    // Cannot happen when the disk honours fsync; keep what is really there.
                    s.offset = len;
                    s.segments.retain(|seg| seg.start < len);
                    if let Some((_, version)) = self.upload_session(&id).await? {
                        self.put_upload_session(&id, &s, Some(&version)).await?;
                    }
                    kept += 1;
                }
                Some(_) => kept += 1,
            }
        }
        let known: std::collections::HashSet<String> =
            sessions.iter().map(|(id, _)| id.to_string()).collect();
        let mut orphans = 0;
        for staged in self.store.list_staged().await? {
            if known.contains(&staged) {
                continue;
            }
            // A session created after the listing above is not an orphan.
            if let Some(id) = SessionId::parse(&staged) {
                if self.upload_session(&id).await?.is_some() {
                    continue;
                }
            }
            self.store.remove_staged(&staged, &[]).await?;
            orphans += 1;
        }
        Ok((kept, dropped, orphans))
    }

    /// Removes sessions idle for `upload_ttl_secs` or more at time `now`, with their data.
    pub async fn expire_uploads(&self, now: u64) -> Result<usize, UploadError> {
        let mut n = 0;
        for (id, s) in self.upload_sessions().await? {
            if s.updated_unix.saturating_add(self.config.upload_ttl_secs) > now {
                continue;
            }
            let lock = self.session_lock(&id.to_string());
            let Ok(_guard) = lock.try_lock() else {
                continue; // a request is using it right now: not abandoned
            };
            self.drop_upload_session(&id, &s).await?;
            n += 1;
        }
        if n > 0 {
            metrics::counter!(crate::metrics::UPLOAD_SESSIONS_EXPIRED).increment(n as u64);
            tracing::info!(expired = n, "removed abandoned upload sessions");
        }
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use futures_util::stream;

    fn registry(dir: &std::path::Path, ttl: u64) -> Registry {
        let config = Config {
            data: dir.to_path_buf(),
            upload_ttl_secs: ttl,
            ..Config::default()
        };
        Registry::in_data_dir(config)
    }

    async fn session(reg: &Registry, updated: u64, data: &'static [u8], acked: u64) -> SessionId {
        let id = SessionId::new();
        let mut s = UploadSession::new("r", updated);
        let v = reg.put_upload_session(&id, &s, None).await.unwrap();
        let body = Box::pin(stream::iter([Ok(bytes::Bytes::from_static(data))]));
        let appended = reg
            .store
            .append_staged(&id.to_string(), 0, body, None, &mut |_| {})
            .await
            .unwrap();
        s.offset = acked;
        s.segments = appended.segment.into_iter().collect();
        reg.put_upload_session(&id, &s, Some(&v)).await.unwrap();
        id
    }

    #[tokio::test]
    async fn abandoned_sessions_expire_with_their_data() {
        let dir = tempfile::tempdir().unwrap();
        let reg = registry(dir.path(), 3600);
        let old = session(&reg, 1_000, b"old", 3).await;
        let fresh = session(&reg, 5_000, b"fresh", 5).await;
        assert_eq!(
            reg.expire_uploads(4_599).await.unwrap(),
            0,
            "nothing idle for an hour yet"
        );
        assert_eq!(reg.expire_uploads(4_600).await.unwrap(), 1);
        assert!(reg.upload_session(&old).await.unwrap().is_none());
        assert_eq!(
            reg.store.staged_len(&old.to_string()).await.unwrap(),
            None,
            "its data is removed"
        );
        assert!(reg.upload_session(&fresh).await.unwrap().is_some());
        assert_eq!(
            reg.store.staged_len(&fresh.to_string()).await.unwrap(),
            Some(5)
        );
    }

    #[tokio::test]
    async fn recovery_cuts_unacknowledged_bytes_and_drops_orphans() {
        let dir = tempfile::tempdir().unwrap();
        let reg = registry(dir.path(), 3600);
        let a = session(&reg, 1, b"acked+unacked", 5).await;
        // Staged data without a session: a crash between removing a record's data and
        // the record, or data of a session that never was.
        let b = SessionId::new().to_string();
        let body = Box::pin(stream::iter([Ok(bytes::Bytes::from_static(b"orphan"))]));
        reg.store
            .append_staged(&b, 0, body, None, &mut |_| {})
            .await
            .unwrap();
        // A session whose data is gone (published just before a crash).
        let gone = UploadSession {
            offset: 9,
            segments: vec![Segment::default()],
            ..UploadSession::new("r", 1)
        };
        let gone_id = SessionId::new();
        reg.put_upload_session(&gone_id, &gone, None).await.unwrap();
        assert_eq!(reg.recover_uploads().await.unwrap(), (1, 1, 1));
        assert_eq!(reg.store.staged_len(&a.to_string()).await.unwrap(), Some(5));
        assert_eq!(reg.store.staged_len(&b).await.unwrap(), None);
        assert!(reg.upload_session(&gone_id).await.unwrap().is_none());
    }

    #[tokio::test]
    async fn a_stale_version_cannot_move_a_session() {
        let dir = tempfile::tempdir().unwrap();
        let reg = registry(dir.path(), 3600);
        let id = SessionId::new();
        let mut s = UploadSession::new("r", 1);
        let v0 = reg.put_upload_session(&id, &s, None).await.unwrap();
        s.offset = 10;
        reg.put_upload_session(&id, &s, Some(&v0)).await.unwrap();
        s.offset = 20;
        assert!(matches!(
            reg.put_upload_session(&id, &s, Some(&v0)).await,
            Err(UploadError::Moved { .. })
        ));
        assert_eq!(reg.upload_session(&id).await.unwrap().unwrap().0.offset, 10);
        assert!(SessionId::parse("../../etc").is_none());
    }
}
