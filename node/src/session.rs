//! The host's side of one session: run a command (stdin in, stdout and stderr out
//! unchanged, signals forwarded, exit status back) or copy a tree in or out of a sandbox.
//! The same code drives a VM's control port (`amber run`) and a sandbox's API socket
//! (`amber exec`, `amber cp`).

use std::io::Read;
use std::path::{Path, PathBuf};

use amber_guest::{
    Frame, Request, DATA, ERROR, EXEC, EXIT, GET, PUT, SIGNAL, STDERR, STDIN, STDOUT,
};
use anyhow::{bail, Context};
use sha2::Digest as _;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;

use crate::mux::{Session, SessionTx};

/// What a command produced: its status and the digests of what it wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Outcome {
    pub status: i32,
    pub stdout: String,
    pub stderr: String,
}

/// The session's stream ended before the guest said how it finished.
#[derive(Debug, thiserror::Error)]
#[error("the sandbox stopped before the command finished")]
pub struct Stopped;

/// Signals `amber` passes on to the command, as `docker run` does by default.
const FORWARDED: &[i32] = &[
    libc::SIGINT,
    libc::SIGTERM,
    libc::SIGHUP,
    libc::SIGQUIT,
    libc::SIGUSR1,
    libc::SIGUSR2,
];

fn forward_signals(tx: SessionTx) -> Vec<tokio::task::JoinHandle<()>> {
    use tokio::signal::unix::{signal, SignalKind};
    FORWARDED
        .iter()
        .filter_map(|&n| {
            let mut s = signal(SignalKind::from_raw(n)).ok()?;
            let tx = tx.clone();
            Some(tokio::spawn(async move {
                while s.recv().await.is_some() {
                    let _ = tx.send(SIGNAL, &n.to_be_bytes()).await;
                }
            }))
        })
        .collect()
}

async fn pump_stdin(tx: SessionTx, mut input: impl AsyncRead + Unpin) {
    let mut buf = vec![0u8; 64 << 10];
    loop {
        match input.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if tx.send(STDIN, &buf[..n]).await.is_err() {
                    return;
                }
            }
        }
    }
    let _ = tx.send(STDIN, &[]).await;
}

/// Runs `req` in the session. Stdin is read from `stdin` when the request asks for it;
/// output goes to `out` and `err` as it arrives.
pub async fn exec(
    mut s: Session,
    req: &Request,
    stdin: Option<Box<dyn AsyncRead + Send + Unpin>>,
    mut out: impl AsyncWrite + Unpin,
    mut err: impl AsyncWrite + Unpin,
) -> anyhow::Result<Outcome> {
    s.tx.send(EXEC, &serde_json::to_vec(req)?).await?;
    let mut pumps = forward_signals(s.tx.clone());
    if let (true, Some(input)) = (req.stdin, stdin) {
        pumps.push(tokio::spawn(pump_stdin(s.tx.clone(), input)));
    }
    let (mut out_hash, mut err_hash) = (sha2::Sha256::new(), sha2::Sha256::new());
    let mut agent_error = None;
    let result = loop {
        let Some(Frame { kind, payload, .. }) = s.recv().await else {
            break Err(Stopped.into());
        };
        match kind {
            STDOUT => {
                out_hash.update(&payload);
                out.write_all(&payload).await?;
                out.flush().await?;
            }
            STDERR => {
                err_hash.update(&payload);
                err.write_all(&payload).await?;
                err.flush().await?;
            }
            ERROR => agent_error = Some(String::from_utf8_lossy(&payload).into_owned()),
            EXIT => {
                if let Some(e) = agent_error {
                    break Err(anyhow::anyhow!("the guest could not run the command: {e}"));
                }
                break Ok(Outcome {
                    status: amber_guest::parse_status(&payload),
                    stdout: format!("sha256:{}", hex::encode(out_hash.finalize())),
                    stderr: format!("sha256:{}", hex::encode(err_hash.finalize())),
                });
            }
            _ => {}
        }
    };
    for p in pumps {
        p.abort();
    }
    result
}

/// Waits for the guest's answer to a copy: `EXIT 0`, or its error.
async fn finish_copy(s: &mut Session, what: &str) -> anyhow::Result<()> {
    let mut agent_error = None;
    loop {
        let Some(f) = s.recv().await else {
            return Err(Stopped).with_context(|| what.to_string());
        };
        match f.kind {
            ERROR => agent_error = Some(String::from_utf8_lossy(&f.payload).into_owned()),
            EXIT => {
                return match agent_error {
                    Some(e) => bail!("{what}: {e}"),
                    None if amber_guest::parse_status(&f.payload) == 0 => Ok(()),
                    None => bail!("{what}: failed"),
                }
            }
            _ => {}
        }
    }
}

/// Copies the local `src` into the sandbox at `dest` (inside it when it is a directory).
pub async fn put(mut s: Session, src: &Path, dest: &str) -> anyhow::Result<()> {
    let name = src
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    std::fs::symlink_metadata(src).with_context(|| format!("{}", src.display()))?;
    let head = amber_guest::Put {
        dest: dest.to_string(),
        name,
    };
    s.tx.send(PUT, &serde_json::to_vec(&head)?).await?;
    let (tx, mut rx) = mpsc::channel::<Vec<u8>>(8);
    let src_path = src.to_path_buf();
    let packer = tokio::task::spawn_blocking(move || {
        amber_guest::copy::pack(
            &src_path,
            ChannelWriter {
                tx,
                buf: Vec::new(),
            },
        )
    });
    while let Some(piece) = rx.recv().await {
        s.tx.send(DATA, &piece).await?;
    }
    let packed = packer.await?;
    s.tx.send(DATA, &[]).await?;
    packed.with_context(|| format!("reading {}", src.display()))?;
    finish_copy(&mut s, &format!("copying {} to {dest}", src.display())).await
}

/// Copies `src` out of the sandbox to the local `dest` (inside it when it is a directory).
pub async fn get(mut s: Session, src: &str, dest: &Path) -> anyhow::Result<()> {
    let name = Path::new(src)
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let target: PathBuf = amber_guest::copy::target(dest, &name);
    s.tx.send(
        GET,
        &serde_json::to_vec(&amber_guest::Get {
            path: src.to_string(),
        })?,
    )
    .await?;
    let (tx, rx) = mpsc::channel::<Vec<u8>>(8);
    let t = target.clone();
    let unpacker = tokio::task::spawn_blocking(move || {
        amber_guest::copy::unpack(
            ChannelReader {
                rx,
                buf: Vec::new(),
                pos: 0,
            },
            &t,
        )
    });
    let what = format!("copying {src} to {}", dest.display());
    let mut agent_error = None;
    let status = loop {
        let Some(f) = s.recv().await else {
            drop(tx);
            let _ = unpacker.await;
            return Err(Stopped).context(what);
        };
        match f.kind {
            DATA if !f.payload.is_empty() => {
                // A failed unpacker has gone: the rest of the stream is dropped.
                let _ = tx.send(f.payload).await;
            }
            ERROR => agent_error = Some(String::from_utf8_lossy(&f.payload).into_owned()),
            EXIT => break amber_guest::parse_status(&f.payload),
            _ => {}
        }
    };
    drop(tx);
    let unpacked = unpacker.await?;
    if let Some(e) = agent_error {
        bail!("{what}: {e}");
    }
    anyhow::ensure!(status == 0, "{what}: failed");
    unpacked.with_context(|| format!("writing {}", target.display()))
}

/// A tar stream handed to the async side in pieces.
struct ChannelWriter {
    tx: mpsc::Sender<Vec<u8>>,
    buf: Vec<u8>,
}

impl std::io::Write for ChannelWriter {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.buf.extend_from_slice(b);
        if self.buf.len() >= 256 << 10 {
            self.flush()?;
        }
        Ok(b.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        if !self.buf.is_empty() {
            let piece = std::mem::take(&mut self.buf);
            self.tx
                .blocking_send(piece)
                .map_err(|_| std::io::Error::other("the copy was cancelled"))?;
        }
        Ok(())
    }
}

/// Pieces from the async side as a `Read` on a blocking thread; the end of the channel is
/// the end of the stream.
struct ChannelReader {
    rx: mpsc::Receiver<Vec<u8>>,
    buf: Vec<u8>,
    pos: usize,
}

impl Read for ChannelReader {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        while self.pos == self.buf.len() {
            match self.rx.blocking_recv() {
                Some(b) => {
                    self.buf = b;
                    self.pos = 0;
                }
                None => return Ok(0),
            }
        }
        let n = out.len().min(self.buf.len() - self.pos);
        out[..n].copy_from_slice(&self.buf[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}
