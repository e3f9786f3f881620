//! Files in and out of a sandbox for the node API, streamed over the guest protocol's
//! tar copies (`PUT`/`GET` sessions): one file as raw bytes (wrapped in, or unwrapped
//! from, a one-entry tar on the host), or a directory as a tar stream passed through.
//!
//! Nothing is buffered whole: bytes go to the guest as they arrive and come back as the
//! guest sends them, one frame (at most 1 MiB) at a time.

use bytes::Bytes;
use futures_util::{Stream, StreamExt};

use amber_guest::{Get, Put, DATA, ERROR, EXIT, GET, PUT};

use crate::mux::{Mux, Session};

/// Why a copy failed.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    #[error("{0}: no such file or directory in the sandbox")]
    NotFound(String),
    #[error("{path} is a {what} in the sandbox, not a regular file (use the archive endpoint)")]
    NotAFile { path: String, what: &'static str },
    #[error("{0}")]
    Bad(String),
    #[error("the request body: {0}")]
    Body(String),
    #[error("the sandbox stopped during the copy")]
    Stopped,
}

fn guest_error(path: &str, message: String) -> FileError {
    if message.contains("os error 2") {
        FileError::NotFound(path.to_string())
    } else {
        FileError::Bad(message)
    }
}

/// Waits for the guest's end of a copy into the sandbox.
async fn finish(s: &mut Session, path: &str) -> Result<(), FileError> {
    let mut agent_error = None;
    loop {
        let f = s.recv().await.ok_or(FileError::Stopped)?;
        match f.kind {
            ERROR => agent_error = Some(String::from_utf8_lossy(&f.payload).into_owned()),
            EXIT => {
                return match agent_error {
                    Some(e) => Err(guest_error(path, e)),
                    None if amber_guest::parse_status(&f.payload) == 0 => Ok(()),
                    None => Err(FileError::Bad(format!("copying to {path} failed"))),
                }
            }
            _ => {}
        }
    }
}

/// The 512-byte tar header of one regular file named `.`.
fn file_header(len: u64, mode: u32) -> [u8; 512] {
    let mut h = tar::Header::new_ustar();
    h.set_path(".").expect("a short name");
    h.set_size(len);
    h.set_mode(mode);
    h.set_entry_type(tar::EntryType::Regular);
    h.set_mtime(0);
    h.set_cksum();
    *h.as_bytes()
}

/// Writes `body` (exactly `len` bytes) to the file `path` in the sandbox, creating its
/// parent directories; the file gets `mode`.
pub async fn put_file<E: std::fmt::Display>(
    mux: &Mux,
    path: &str,
    len: u64,
    mode: u32,
    body: impl Stream<Item = Result<Bytes, E>>,
) -> Result<(), FileError> {
    let mut s = open_put(mux, path).await?;
    s.tx.send(DATA, &file_header(len, mode))
        .await
        .map_err(|_| FileError::Stopped)?;
    let mut sent = 0u64;
    let mut body = std::pin::pin!(body);
    let mut failure = None;
    while let Some(piece) = body.next().await {
        match piece {
            Ok(b) => {
                sent += b.len() as u64;
                if sent > len {
                    failure = Some(FileError::Body(format!(
                        "more than its Content-Length of {len} bytes"
                    )));
                    break;
                }
                s.tx.send(DATA, &b).await.map_err(|_| FileError::Stopped)?;
            }
            Err(e) => {
                failure = Some(FileError::Body(e.to_string()));
                break;
            }
        }
    }
    if failure.is_none() && sent < len {
        failure = Some(FileError::Body(format!(
            "{sent} bytes, less than its Content-Length of {len}"
        )));
    }
    if failure.is_none() {
        // Pad the entry to a whole block, then the two zero blocks that end a tar.
        let pad = (512 - (len % 512) as usize) % 512;
        s.tx.send(DATA, &vec![0u8; pad + 1024])
            .await
            .map_err(|_| FileError::Stopped)?;
    }
    // A broken stream ends here too: the guest's unpacking fails on the short entry and
    // leaves at most that one file partly written.
    s.tx.send(DATA, &[]).await.map_err(|_| FileError::Stopped)?;
    let done = finish(&mut s, path).await;
    match failure {
        Some(f) => Err(f),
        None => done,
    }
}

async fn open_put(mux: &Mux, path: &str) -> Result<Session, FileError> {
    if !path.starts_with('/') {
        return Err(FileError::Bad(format!("{path:?} is not an absolute path")));
    }
    let s = mux.open();
    let head = Put {
        dest: path.to_string(),
        name: String::new(),
    };
    s.tx.send(PUT, &serde_json::to_vec(&head).expect("json"))
        .await
        .map_err(|_| FileError::Stopped)?;
    Ok(s)
}

/// Unpacks the tar stream `body` into the directory `path` in the sandbox (created when
/// missing). Entries that would leave it and hard links are refused.
pub async fn put_archive<E: std::fmt::Display>(
    mux: &Mux,
    path: &str,
    body: impl Stream<Item = Result<Bytes, E>>,
) -> Result<(), FileError> {
    let mut s = open_put(mux, path).await?;
    let mut body = std::pin::pin!(body);
    let mut failure = None;
    while let Some(piece) = body.next().await {
        match piece {
            Ok(b) if b.is_empty() => {}
            Ok(b) => s.tx.send(DATA, &b).await.map_err(|_| FileError::Stopped)?,
            Err(e) => {
                failure = Some(FileError::Body(e.to_string()));
                break;
            }
        }
    }
    s.tx.send(DATA, &[]).await.map_err(|_| FileError::Stopped)?;
    let done = finish(&mut s, path).await;
    match failure {
        Some(f) => Err(f),
        None => done,
    }
}

/// The tar stream of `path` (file, tree or symlink; first entry `.`) as the guest sends
/// it. Answers only once the guest has sent its first bytes or its error.
pub async fn get_archive(
    mux: &Mux,
    path: &str,
) -> Result<impl Stream<Item = Result<Bytes, FileError>> + Send + 'static, FileError> {
    let (first, s) = open_get(mux, path).await?;
    Ok(data_stream(s, path.to_string(), first))
}

async fn open_get(mux: &Mux, path: &str) -> Result<(Bytes, Session), FileError> {
    if !path.starts_with('/') {
        return Err(FileError::Bad(format!("{path:?} is not an absolute path")));
    }
    let mut s = mux.open();
    let req = Get {
        path: path.to_string(),
    };
    s.tx.send(GET, &serde_json::to_vec(&req).expect("json"))
        .await
        .map_err(|_| FileError::Stopped)?;
    let mut agent_error = None;
    loop {
        let f = s.recv().await.ok_or(FileError::Stopped)?;
        match f.kind {
            DATA if !f.payload.is_empty() => return Ok((Bytes::from(f.payload), s)),
            ERROR => agent_error = Some(String::from_utf8_lossy(&f.payload).into_owned()),
            EXIT => {
                return Err(match agent_error {
                    Some(e) => guest_error(path, e),
                    None => FileError::Bad(format!("{path}: the guest sent nothing")),
                })
            }
            _ => {}
        }
    }
}

fn data_stream(
    s: Session,
    path: String,
    first: Bytes,
) -> impl Stream<Item = Result<Bytes, FileError>> + Send + 'static {
    futures_util::stream::unfold(
        (s, Some(first), path, None::<String>, false),
        |(mut s, first, path, mut agent_error, done)| async move {
            if let Some(b) = first {
                return Some((Ok(b), (s, None, path, agent_error, done)));
            }
            if done {
                return None;
            }
            loop {
                let Some(f) = s.recv().await else {
                    return Some((Err(FileError::Stopped), (s, None, path, agent_error, true)));
                };
                match f.kind {
                    DATA if !f.payload.is_empty() => {
                        let b = Bytes::from(f.payload);
                        return Some((Ok(b), (s, None, path, agent_error, false)));
                    }
                    ERROR => agent_error = Some(String::from_utf8_lossy(&f.payload).into_owned()),
                    EXIT => {
                        return agent_error
                            .take()
                            .map(|e| (Err(FileError::Bad(e)), (s, None, path, None, true)))
                    }
                    _ => {}
                }
            }
        },
    )
}

/// The regular file `path`'s size and bytes. A directory, symlink or other kind of file
/// is refused before any byte is sent.
pub async fn get_file(
    mux: &Mux,
    path: &str,
) -> Result<
    (
        u64,
        impl Stream<Item = Result<Bytes, FileError>> + Send + 'static,
    ),
    FileError,
> {
    let (first, s) = open_get(mux, path).await?;
    let mut stream = Box::pin(data_stream(s, path.to_string(), first));
    let mut head = Vec::new();
    while head.len() < 512 {
        match stream.next().await {
            Some(Ok(b)) => head.extend_from_slice(&b),
            Some(Err(e)) => return Err(e),
            None => return Err(FileError::Bad(format!("{path}: a short tar stream"))),
        }
    }
    let mut block = [0u8; 512];
    block.copy_from_slice(&head[..512]);
    let h = tar::Header::from_byte_slice(&block);
    let what = match h.entry_type() {
        tar::EntryType::Regular | tar::EntryType::Continuous => None,
        tar::EntryType::Directory => Some("directory"),
        tar::EntryType::Symlink => Some("symbolic link"),
        _ => Some("special file"),
    };
    if let Some(what) = what {
        return Err(FileError::NotAFile {
            path: path.to_string(),
            what,
        });
    }
    let size = h
        .entry_size()
        .map_err(|e| FileError::Bad(format!("{path}: {e}")))?;
    let rest = Bytes::from(head.split_off(512));
    let body = futures_util::stream::unfold(
        (stream, Some(rest), size),
        |(mut stream, first, left)| async move {
            if left == 0 {
                return None;
            }
            let b = match first {
                Some(b) if !b.is_empty() => b,
                _ => match stream.next().await? {
                    Ok(b) => b,
                    Err(e) => return Some((Err(e), (stream, None, 0))),
                },
            };
            let take = (b.len() as u64).min(left);
            let piece = b.slice(..take as usize);
            Some((Ok(piece), (stream, None, left - take)))
        },
    );
    Ok((size, body))
}
