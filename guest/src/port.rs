//! The virtio-serial port to the host: frames written under one lock (so they never
//! interleave), and adapters between a session's frames and byte streams.

use std::fs::File;
use std::io::{Read, Write};
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex};

use amber_guest::{status_payload, write_frame, DATA, ERROR, EXIT, MAX_PAYLOAD};

/// The port's write side, shared by every thread.
#[derive(Clone)]
pub(crate) struct Port(pub(crate) Arc<Mutex<File>>);

impl Port {
    pub(crate) fn send(&self, kind: u8, session: u32, payload: &[u8]) {
        let mut f = self.0.lock().unwrap_or_else(|p| p.into_inner());
        for piece in payload.chunks(MAX_PAYLOAD).chain(
            // An empty payload is a frame too (EOF markers).
            payload.is_empty().then_some(&[][..]),
        ) {
            if let Err(e) = write_frame(&mut *f, kind, session, piece) {
                eprintln!("amber-guest: writing to the host: {e}");
                return;
            }
        }
    }

    pub(crate) fn fail(&self, session: u32, msg: &str, code: i32) {
        self.send(ERROR, session, msg.as_bytes());
        self.send(EXIT, session, &status_payload(code));
    }
}

/// Bytes from the port's reader thread, as a `Read` (an empty message is the end).
pub(crate) struct ChannelReader {
    pub(crate) rx: Receiver<Vec<u8>>,
    pub(crate) buf: Vec<u8>,
    pub(crate) pos: usize,
    pub(crate) done: bool,
}

impl ChannelReader {
    pub(crate) fn new(rx: Receiver<Vec<u8>>) -> ChannelReader {
        ChannelReader {
            rx,
            buf: Vec::new(),
            pos: 0,
            done: false,
        }
    }
}

impl Read for ChannelReader {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        while self.pos == self.buf.len() {
            if self.done {
                return Ok(0);
            }
            match self.rx.recv() {
                Ok(b) if !b.is_empty() => {
                    self.buf = b;
                    self.pos = 0;
                }
                _ => self.done = true,
            }
        }
        let n = out.len().min(self.buf.len() - self.pos);
        out[..n].copy_from_slice(&self.buf[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}

/// A tar stream sent to the host as `DATA` frames.
pub(crate) struct FrameWriter {
    pub(crate) port: Port,
    pub(crate) session: u32,
    pub(crate) buf: Vec<u8>,
}

impl Write for FrameWriter {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.buf.extend_from_slice(b);
        if self.buf.len() >= 256 << 10 {
            self.flush()?;
        }
        Ok(b.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        if !self.buf.is_empty() {
            self.port.send(DATA, self.session, &self.buf);
            self.buf.clear();
        }
        Ok(())
    }
}
