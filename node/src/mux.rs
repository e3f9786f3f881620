//! The guest protocol's frames over an async byte stream (the VM's control port or a
//! sandbox's API socket), split into sessions: one task reads frames and routes each to
//! its session's channel; writers share the stream through one lock, so frames never
//! interleave.
//!
//! Backpressure: a session's channel holds a few frames; when its owner stops reading,
//! the reader task waits, as a pipe would.

use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use amber_guest::{parse_header, Frame, HEADER};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;

type Writer = Box<dyn AsyncWrite + Send + Unpin>;

struct Inner {
    writer: tokio::sync::Mutex<Writer>,
    routes: Mutex<HashMap<u32, mpsc::Sender<Frame>>>,
    /// Frames for sessions nobody opened (the other side opened them): see `accept`.
    unrouted: Mutex<Option<mpsc::Sender<Frame>>>,
    next: AtomicU32,
    /// True once the stream's reading side ended.
    closed: tokio::sync::watch::Sender<bool>,
    /// Set (under the writer's lock) by `seal_with`: no frame is written after it.
    sealed: std::sync::atomic::AtomicBool,
}

/// One framed stream; cheap to clone.
#[derive(Clone)]
pub struct Mux(Arc<Inner>);

/// Reads one frame from an async stream; `None` at a clean end.
pub async fn read_frame(r: &mut (impl AsyncRead + Unpin)) -> io::Result<Option<Frame>> {
    let mut h = [0u8; HEADER];
    match r.read_exact(&mut h).await {
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let (kind, session, len) = parse_header(&h)?;
    let mut payload = vec![0u8; len];
    r.read_exact(&mut payload).await?;
    Ok(Some(Frame {
        kind,
        session,
        payload,
    }))
}

impl Mux {
    /// Starts routing frames read from `stream`. Frames for sessions this side did not
    /// open go to the receiver returned (the sandbox daemon serves those); others drop.
    pub fn new<S>(stream: S) -> (Mux, mpsc::Receiver<Frame>)
    where
        S: AsyncRead + AsyncWrite + Send + 'static,
    {
        let (mut r, w) = tokio::io::split(stream);
        let (tx, rx) = mpsc::channel(64);
        let mux = Mux(Arc::new(Inner {
            writer: tokio::sync::Mutex::new(Box::new(w)),
            routes: Mutex::default(),
            unrouted: Mutex::new(Some(tx)),
            next: AtomicU32::new(1),
            closed: tokio::sync::watch::channel(false).0,
            sealed: std::sync::atomic::AtomicBool::new(false),
        }));
        let inner = mux.0.clone();
        tokio::spawn(async move {
            loop {
                let frame = match read_frame(&mut r).await {
                    Ok(Some(f)) => f,
                    Ok(None) => break,
                    Err(e) => {
                        tracing::warn!("reading frames: {e}");
                        break;
                    }
                };
                let route = inner.routes.lock().unwrap().get(&frame.session).cloned();
                let route = route.or_else(|| inner.unrouted.lock().unwrap().clone());
                if let Some(tx) = route {
                    let _ = tx.send(frame).await;
                }
            }
            // The end of the stream ends every session.
            inner.routes.lock().unwrap().clear();
            inner.unrouted.lock().unwrap().take();
            inner.closed.send_replace(true);
        });
        (mux, rx)
    }

    /// Closes this side's direction of the stream: the peer reads the end of it, and
    /// every session it has open ends. Frames sent afterwards fail.
    pub async fn shutdown(&self) {
        let _ = self.0.writer.lock().await.shutdown().await;
    }

    /// Resolves once the other side closed the stream (or it broke).
    pub fn closed(&self) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> {
        let mut rx = self.0.closed.subscribe();
        Box::pin(async move {
            let _ = rx.wait_for(|c| *c).await;
        })
    }

    /// Opens a new session with a fresh id.
    pub fn open(&self) -> Session {
        let id = self.0.next.fetch_add(1, Ordering::Relaxed);
        self.session(id)
    }

    /// The session with this id (0 is the VM's own), routed to the returned handle.
    pub fn session(&self, id: u32) -> Session {
        let (tx, rx) = mpsc::channel(64);
        self.0.routes.lock().unwrap().insert(id, tx);
        Session {
            tx: SessionTx {
                id,
                mux: self.clone(),
            },
            rx,
        }
    }

    pub async fn send(&self, kind: u8, session: u32, payload: &[u8]) -> io::Result<()> {
        self.write(kind, session, payload, false).await
    }

    /// Writes one last frame: every `send` after it fails, so nothing follows it on the
    /// stream (a VM being paused must see its last frame whole).
    pub async fn seal_with(&self, kind: u8, session: u32, payload: &[u8]) -> io::Result<()> {
        self.write(kind, session, payload, true).await
    }

    /// One frame under the writer's lock, unless the stream is sealed; `seal` seals it
    /// after this frame.
    async fn write(&self, kind: u8, session: u32, payload: &[u8], seal: bool) -> io::Result<()> {
        let mut w = self.0.writer.lock().await;
        if self.0.sealed.load(Ordering::SeqCst) {
            return Err(io::Error::new(io::ErrorKind::BrokenPipe, Sealed));
        }
        if seal {
            self.0.sealed.store(true, Ordering::SeqCst);
        }
        w.write_all(&amber_guest::header(kind, session, payload.len()))
            .await?;
        w.write_all(payload).await?;
        w.flush().await
    }

    fn close(&self, id: u32) {
        self.0.routes.lock().unwrap().remove(&id);
    }
}

/// The sending half of a session; cheap to clone (stdin and signal pumps hold copies).
#[derive(Clone)]
pub struct SessionTx {
    pub id: u32,
    mux: Mux,
}

impl SessionTx {
    pub async fn send(&self, kind: u8, payload: &[u8]) -> io::Result<()> {
        for piece in payload.chunks(amber_guest::MAX_PAYLOAD) {
            self.mux.send(kind, self.id, piece).await?;
        }
        if payload.is_empty() {
            self.mux.send(kind, self.id, &[]).await?;
        }
        Ok(())
    }
}

/// Why a frame was not sent on a sealed stream (`Mux::seal_with`): the VM is being
/// paused, not gone.
#[derive(Debug, thiserror::Error)]
#[error("the VM is being paused")]
pub struct Sealed;

/// Whether a send failed because the stream is sealed (the VM is being paused) rather
/// than closed.
pub fn is_sealed(e: &io::Error) -> bool {
    e.get_ref().is_some_and(|inner| inner.is::<Sealed>())
}

/// One session: frames sent with `tx`, frames received in order from `recv`.
pub struct Session {
    pub tx: SessionTx,
    rx: mpsc::Receiver<Frame>,
}

impl Session {
    /// The next frame; `None` when the stream ended.
    pub async fn recv(&mut self) -> Option<Frame> {
        self.rx.recv().await
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        self.tx.mux.close(self.tx.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn sessions_are_routed_and_unopened_ones_are_handed_over() {
        let (a, b) = tokio::io::duplex(1 << 16);
        let (left, _) = Mux::new(a);
        let (right, mut incoming) = Mux::new(b);
        let mut s1 = left.open();
        let mut s2 = left.open();
        s1.tx.send(amber_guest::EXEC, b"one").await.unwrap();
        s2.tx.send(amber_guest::EXEC, b"two").await.unwrap();
        let f1 = incoming.recv().await.unwrap();
        let f2 = incoming.recv().await.unwrap();
        assert_eq!((f1.session, &f1.payload[..]), (s1.tx.id, &b"one"[..]));
        assert_eq!((f2.session, &f2.payload[..]), (s2.tx.id, &b"two"[..]));
        right
            .send(amber_guest::STDOUT, s2.tx.id, b"to two")
            .await
            .unwrap();
        right
            .send(amber_guest::STDOUT, s1.tx.id, b"to one")
            .await
            .unwrap();
        assert_eq!(s1.recv().await.unwrap().payload, b"to one");
        assert_eq!(s2.recv().await.unwrap().payload, b"to two");
        drop(right);
        drop(incoming);
    }
}
