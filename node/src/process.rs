//! A command running in a sandbox as the node API sees it (`amberd`'s exec): its output
//! kept as numbered frames so a client can read them again from any sequence number after
//! a dropped connection, its timeout (the command's process group is killed), and how it
//! ended.
//!
//! Invariants kept here:
//! - frames are numbered from 0 in the order the guest sent them, stdout and stderr in
//!   one sequence, and the last frame is exactly one `Exit` or `Error`;
//! - text is split only between whole UTF-8 characters (a character cut by a pipe read is
//!   carried into the next frame), so valid UTF-8 output arrives unchanged;
//! - the log holds at most its bound of output bytes: a `Head` log (a command whose result
//!   is answered at once) drops what comes after and says `truncated`; a `Tail` log (a
//!   background process) drops its oldest frames and moves `first_seq`.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use amber_api::node::{ErrorKind, ExecFrame, ExecResult, ProcessInfo, ProcessStatus};
use amber_guest::{Request, ERROR, EXEC, EXIT, SIGNAL, STDERR, STDIN, STDOUT};
use amber_snapshotter::device::LazyDevice;

use crate::mux::Mux;

/// Resolves, once the sandbox has ended, to why it did (None if that is not known soon):
/// what a command cut short by the end of its sandbox tells its caller.
pub type EndReason = std::pin::Pin<Box<dyn std::future::Future<Output = Option<String>> + Send>>;

/// How long a killed command may take to report its end before the node stops waiting.
const KILL_GRACE: Duration = Duration::from_secs(2);

/// Which output a full log drops.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Retain {
    /// Keep the first bytes (a result answered in one piece).
    Head,
    /// Keep the last bytes (a background process read as it goes).
    Tail,
}

struct Log {
    frames: VecDeque<ExecFrame>,
    first_seq: u64,
    next_seq: u64,
    bytes: usize,
    truncated: bool,
    ended: bool,
    exit_code: Option<i32>,
    timed_out: bool,
    carry: [Vec<u8>; 2],
}

/// One command and its output.
pub struct Process {
    pub id: u32,
    pub argv: Vec<String>,
    bound: usize,
    retain: Retain,
    log: Mutex<Log>,
    /// The next sequence number, published to readers waiting for more.
    seq: tokio::sync::watch::Sender<u64>,
    signals: tokio::sync::mpsc::Sender<i32>,
    started: Instant,
}

impl Process {
    /// Starts `req` in a new session of `mux` and records its output. `stdin` is written
    /// and closed; `timeout` kills the command's process group. A chunk of the env that
    /// failed verification while it ran ends it with an integrity error.
    #[allow(clippy::too_many_arguments)]
    pub fn spawn(
        id: u32,
        mux: &Mux,
        device: Arc<LazyDevice>,
        mut req: Request,
        stdin: Option<Vec<u8>>,
        timeout: Option<Duration>,
        bound: usize,
        retain: Retain,
        end_reason: EndReason,
    ) -> Arc<Process> {
        req.stdin = stdin.is_some();
        let (signals, signal_rx) = tokio::sync::mpsc::channel(8);
        let p = Arc::new(Process {
            id,
            argv: req.argv.clone(),
            bound,
            retain,
            log: Mutex::new(Log {
                frames: VecDeque::new(),
                first_seq: 0,
                next_seq: 0,
                bytes: 0,
                truncated: false,
                ended: false,
                exit_code: None,
                timed_out: false,
                carry: [Vec::new(), Vec::new()],
            }),
            seq: tokio::sync::watch::channel(0).0,
            signals,
            started: Instant::now(),
        });
        let session = mux.open();
        tokio::spawn(drive(
            p.clone(),
            session,
            device,
            req,
            stdin,
            timeout,
            signal_rx,
            end_reason,
        ));
        p
    }

    /// Sends `signal` to the command's process group.
    pub async fn signal(&self, signal: i32) {
        let _ = self.signals.send(signal).await;
    }

    pub fn info(&self) -> ProcessInfo {
        let l = self.log.lock().unwrap();
        ProcessInfo {
            id: self.id,
            argv: self.argv.clone(),
            status: if l.ended {
                ProcessStatus::Exited
            } else {
                ProcessStatus::Running
            },
            exit_code: l.exit_code,
            timed_out: l.timed_out,
            next_seq: l.next_seq,
            first_seq: l.first_seq,
        }
    }

    pub fn ended(&self) -> bool {
        self.log.lock().unwrap().ended
    }

    /// The frames numbered `from` and later that the log holds now, and whether the last
    /// frame has been recorded.
    pub fn frames_from(&self, from: u64) -> (Vec<ExecFrame>, bool) {
        let l = self.log.lock().unwrap();
        let skip = from.saturating_sub(l.first_seq) as usize;
        (l.frames.iter().skip(skip).cloned().collect(), l.ended)
    }

    /// Waits until a frame numbered `from` or later exists, or the command ended.
    pub async fn wait_past(&self, from: u64) {
        let mut rx = self.seq.subscribe();
        let _ = rx.wait_for(|&next| next > from).await;
    }

    /// Waits for the end and answers the whole result (a `Head` log).
    pub async fn result(&self) -> Result<ExecResult, (ErrorKind, String)> {
        let mut rx = self.seq.subscribe();
        loop {
            {
                let l = self.log.lock().unwrap();
                if l.ended {
                    let (mut stdout, mut stderr) = (String::new(), String::new());
                    for f in &l.frames {
                        match f {
                            ExecFrame::Stdout { data, .. } => stdout.push_str(data),
                            ExecFrame::Stderr { data, .. } => stderr.push_str(data),
                            ExecFrame::Error { kind, message, .. } => {
                                return Err((*kind, message.clone()))
                            }
                            ExecFrame::Exit { .. } => {}
                        }
                    }
                    return Ok(ExecResult {
                        exit_code: l.exit_code.unwrap_or(-1),
                        stdout,
                        stderr,
                        timed_out: l.timed_out,
                        truncated: l.truncated,
                        duration_ms: self.started.elapsed().as_millis() as u64,
                    });
                }
            }
            if rx.changed().await.is_err() {
                return Err((ErrorKind::Internal, "the command's recorder ended".into()));
            }
        }
    }

    fn output(&self, stream: usize, payload: &[u8]) {
        let mut l = self.log.lock().unwrap();
        let text = decode(&mut l.carry[stream], payload, false);
        self.push_text(&mut l, stream, text);
    }

    fn push_text(&self, l: &mut Log, stream: usize, text: String) {
        if text.is_empty() {
            return;
        }
        if self.retain == Retain::Head && l.bytes + text.len() > self.bound {
            l.truncated = true;
            return;
        }
        let seq = l.next_seq;
        l.bytes += text.len();
        l.frames.push_back(if stream == 0 {
            ExecFrame::Stdout { seq, data: text }
        } else {
            ExecFrame::Stderr { seq, data: text }
        });
        l.next_seq += 1;
        while self.retain == Retain::Tail && l.bytes > self.bound && l.frames.len() > 1 {
            if let Some(ExecFrame::Stdout { data, .. } | ExecFrame::Stderr { data, .. }) =
                l.frames.pop_front()
            {
                l.bytes -= data.len();
            }
            l.first_seq += 1;
            l.truncated = true;
        }
        self.seq.send_replace(l.next_seq);
    }

    fn end(&self, frame: impl FnOnce(u64) -> ExecFrame, exit: Option<(i32, bool)>) {
        let mut l = self.log.lock().unwrap();
        if l.ended {
            return;
        }
        for stream in 0..2 {
            let text = decode(&mut l.carry[stream], &[], true);
            self.push_text(&mut l, stream, text);
        }
        let seq = l.next_seq;
        l.frames.push_back(frame(seq));
        l.next_seq += 1;
        l.ended = true;
        if let Some((code, timed_out)) = exit {
            l.exit_code = Some(code);
            l.timed_out = timed_out;
        }
        self.seq.send_replace(l.next_seq);
    }

    fn exit(&self, exit_code: i32, timed_out: bool) {
        self.end(
            |seq| ExecFrame::Exit {
                seq,
                exit_code,
                timed_out,
            },
            Some((exit_code, timed_out)),
        );
    }

    fn error(&self, kind: ErrorKind, message: String) {
        self.end(|seq| ExecFrame::Error { seq, kind, message }, None);
    }
}

/// `": <why the sandbox ended>"` for a message, or nothing when that is not known.
async fn ended_because(end_reason: EndReason) -> String {
    match end_reason.await {
        Some(r) => format!(": {r}"),
        None => String::new(),
    }
}

#[allow(clippy::too_many_arguments)]
async fn drive(
    p: Arc<Process>,
    mut s: crate::mux::Session,
    device: Arc<LazyDevice>,
    req: Request,
    stdin: Option<Vec<u8>>,
    timeout: Option<Duration>,
    mut signals: tokio::sync::mpsc::Receiver<i32>,
    end_reason: EndReason,
) {
    let body = serde_json::to_vec(&req).expect("Request serializes");
    if let Err(e) = s.tx.send(EXEC, &body).await {
        // The VM's control port is sealed (it is being paused) or closed (the sandbox
        // ended): say which, and why the sandbox ended when that is known.
        let why = if crate::mux::is_sealed(&e) {
            String::new()
        } else {
            ended_because(end_reason).await
        };
        return p.error(
            ErrorKind::NotRunning,
            format!("the command could not be sent to the sandbox ({e}){why}"),
        );
    }
    if let Some(input) = stdin {
        let tx = s.tx.clone();
        tokio::spawn(async move {
            if !input.is_empty() {
                let _ = tx.send(STDIN, &input).await;
            }
            let _ = tx.send(STDIN, &[]).await;
        });
    }
    let deadline = timeout.map(|t| tokio::time::Instant::now() + t);
    let mut killed_at: Option<tokio::time::Instant> = None;
    let mut agent_error = None;
    loop {
        let until = match (killed_at, deadline) {
            (Some(k), _) => Some(k + KILL_GRACE),
            (None, d) => d,
        };
        let frame = tokio::select! {
            f = s.recv() => f,
            Some(sig) = signals.recv() => {
                let _ = s.tx.send(SIGNAL, &sig.to_be_bytes()).await;
                continue;
            }
            _ = async {
                match until {
                    Some(t) => tokio::time::sleep_until(t).await,
                    None => std::future::pending().await,
                }
            } => {
                if killed_at.is_some() {
                    // Something outside the group holds its output open: stop waiting.
                    return p.exit(128 + libc::SIGKILL, true);
                }
                let _ = s.tx.send(SIGNAL, &libc::SIGKILL.to_be_bytes()).await;
                killed_at = Some(tokio::time::Instant::now());
                continue;
            }
        };
        let Some(f) = frame else {
            let why = ended_because(end_reason).await;
            return p.error(
                ErrorKind::NotRunning,
                format!("the sandbox stopped before the command finished{why}"),
            );
        };
        match f.kind {
            STDOUT => p.output(0, &f.payload),
            STDERR => p.output(1, &f.payload),
            ERROR => agent_error = Some(String::from_utf8_lossy(&f.payload).into_owned()),
            EXIT => {
                if let Some(e) = device.integrity_failure() {
                    return p.error(ErrorKind::Integrity, e.to_string());
                }
                if let Some(e) = agent_error {
                    return p.error(
                        ErrorKind::BadRequest,
                        format!("the guest could not run the command: {e}"),
                    );
                }
                let code = amber_guest::parse_status(&f.payload);
                return p.exit(code, killed_at.is_some());
            }
            _ => {}
        }
    }
}

/// Text of `payload` after what `carry` held, keeping an incomplete UTF-8 character at
/// the end in `carry` for the next piece (unless `last`). Invalid bytes become U+FFFD.
fn decode(carry: &mut Vec<u8>, payload: &[u8], last: bool) -> String {
    carry.extend_from_slice(payload);
    let keep = if last { 0 } else { incomplete_tail(carry) };
    let cut = carry.len() - keep;
    let text = String::from_utf8_lossy(&carry[..cut]).into_owned();
    carry.drain(..cut);
    text
}

/// How many bytes at the end of `b` begin a UTF-8 character that is not complete yet.
fn incomplete_tail(b: &[u8]) -> usize {
    for back in 1..=3.min(b.len()) {
        let c = b[b.len() - back];
        if c & 0b1100_0000 == 0b1000_0000 {
            continue; // a continuation byte: look further back
        }
        let need = match c {
            0xC0..=0xDF => 2,
            0xE0..=0xEF => 3,
            0xF0..=0xF7 => 4,
            _ => 1,
        };
        return if need > back { back } else { 0 };
    }
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_character_cut_between_reads_arrives_whole() {
        let text = "héllo → wörld 🎉";
        let bytes = text.as_bytes();
        for cut in 0..bytes.len() {
            let mut carry = Vec::new();
            let mut out = decode(&mut carry, &bytes[..cut], false);
            out += &decode(&mut carry, &bytes[cut..], false);
            out += &decode(&mut carry, &[], true);
            assert_eq!(out, text, "cut at {cut}");
        }
        let mut carry = Vec::new();
        assert_eq!(decode(&mut carry, b"a\xffb", false), "a\u{fffd}b");
        assert_eq!(decode(&mut carry, b"\xe2\x86", false), "");
        assert_eq!(decode(&mut carry, &[], true), "\u{fffd}");
    }
}
