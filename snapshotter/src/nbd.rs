//! An NBD server (fixed newstyle handshake; NBD_OPT_GO, NBD_OPT_INFO, NBD_OPT_EXPORT_NAME,
//! NBD_OPT_LIST, NBD_OPT_ABORT; NBD_CMD_READ, NBD_CMD_FLUSH, NBD_CMD_DISC) exporting one
//! read-only `LazyDevice` on a Unix socket, for QEMU's built-in NBD client.
//!
//! Requests are served concurrently; replies carry the request's cookie. A read that
//! fails (fetch error, integrity error) gets an NBD_EIO reply: the guest sees an I/O
//! error, never unverified bytes. Writes are refused with NBD_EPERM (the export is
//! read-only). Constants follow the NBD protocol document (NetworkBlockDevice/nbd,
//! doc/proto.md).

use std::sync::Arc;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixListener;
use tokio::sync::Mutex;

use crate::device::LazyDevice;

const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
const OPT_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
const REQUEST_MAGIC: u32 = 0x2560_9513;
const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;

const FLAG_FIXED_NEWSTYLE: u16 = 1;
const FLAG_NO_ZEROES: u16 = 2;
const FLAG_C_NO_ZEROES: u32 = 2;

const OPT_EXPORT_NAME: u32 = 1;
const OPT_ABORT: u32 = 2;
const OPT_LIST: u32 = 3;
const OPT_INFO: u32 = 6;
const OPT_GO: u32 = 7;

const REP_ACK: u32 = 1;
const REP_SERVER: u32 = 2;
const REP_INFO: u32 = 3;
const REP_ERR_UNSUP: u32 = (1 << 31) + 1;
const REP_ERR_INVALID: u32 = (1 << 31) + 3;
const REP_ERR_UNKNOWN: u32 = (1 << 31) + 6;

const INFO_EXPORT: u16 = 0;
const INFO_BLOCK_SIZE: u16 = 3;

const TFLAG_HAS_FLAGS: u16 = 1;
const TFLAG_READ_ONLY: u16 = 2;
const TFLAG_SEND_FLUSH: u16 = 4;
const TFLAG_CAN_MULTI_CONN: u16 = 1 << 8;

const CMD_READ: u16 = 0;
const CMD_WRITE: u16 = 1;
const CMD_DISC: u16 = 2;
const CMD_FLUSH: u16 = 3;

const EPERM: u32 = 1;
const EIO: u32 = 5;
const EINVAL: u32 = 22;

/// The largest read a client may ask for (advertised as the maximum block size).
const MAX_REQUEST: u32 = 32 << 20;
/// The largest option payload accepted during the handshake.
const MAX_OPTION: u32 = 64 << 10;

#[derive(Debug, thiserror::Error)]
pub enum NbdError {
    #[error("NBD connection: {0}")]
    Io(#[from] std::io::Error),
    #[error("NBD protocol violation: {0}")]
    Protocol(String),
}

/// Serves `device` as export `name` to every client connecting to `listener`.
pub async fn serve(
    listener: UnixListener,
    name: String,
    device: Arc<LazyDevice>,
) -> std::io::Result<()> {
    loop {
        let (conn, _) = listener.accept().await?;
        let (name, device) = (name.clone(), device.clone());
        tokio::spawn(async move {
            if let Err(e) = handle(conn, &name, device).await {
                tracing::warn!(error = %e, "NBD client disconnected with an error");
            }
        });
    }
}

fn tflags() -> u16 {
    TFLAG_HAS_FLAGS | TFLAG_READ_ONLY | TFLAG_SEND_FLUSH | TFLAG_CAN_MULTI_CONN
}

async fn opt_reply<S: AsyncWrite + Unpin>(
    c: &mut S,
    opt: u32,
    kind: u32,
    data: &[u8],
) -> std::io::Result<()> {
    let mut b = Vec::with_capacity(20 + data.len());
    b.extend_from_slice(&OPT_REPLY_MAGIC.to_be_bytes());
    b.extend_from_slice(&opt.to_be_bytes());
    b.extend_from_slice(&kind.to_be_bytes());
    b.extend_from_slice(&(data.len() as u32).to_be_bytes());
    b.extend_from_slice(data);
    c.write_all(&b).await
}

/// One client: handshake, then transmission until NBD_CMD_DISC or EOF.
pub async fn handle<S: AsyncRead + AsyncWrite + Unpin + Send + 'static>(
    mut c: S,
    name: &str,
    device: Arc<LazyDevice>,
) -> Result<(), NbdError> {
    let mut hello = Vec::with_capacity(18);
    hello.extend_from_slice(&NBDMAGIC.to_be_bytes());
    hello.extend_from_slice(&IHAVEOPT.to_be_bytes());
    hello.extend_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
    c.write_all(&hello).await?;
    let client_flags = c.read_u32().await?;
    let size = device.size();
    loop {
        if c.read_u64().await? != IHAVEOPT {
            return Err(NbdError::Protocol("option without IHAVEOPT magic".into()));
        }
        let opt = c.read_u32().await?;
        let len = c.read_u32().await?;
        if len > MAX_OPTION {
            return Err(NbdError::Protocol(format!("option {opt} of {len} bytes")));
        }
        let mut data = vec![0u8; len as usize];
        c.read_exact(&mut data).await?;
        match opt {
            OPT_EXPORT_NAME => {
                if !data.is_empty() && data != name.as_bytes() {
                    return Err(NbdError::Protocol(format!(
                        "unknown export {:?}",
                        String::from_utf8_lossy(&data)
                    )));
                }
                let mut b = Vec::new();
                b.extend_from_slice(&size.to_be_bytes());
                b.extend_from_slice(&tflags().to_be_bytes());
                if client_flags & FLAG_C_NO_ZEROES == 0 {
                    b.extend_from_slice(&[0u8; 124]);
                }
                c.write_all(&b).await?;
                break;
            }
            OPT_ABORT => {
                opt_reply(&mut c, opt, REP_ACK, &[]).await?;
                return Ok(());
            }
            OPT_LIST => {
                let mut d = (name.len() as u32).to_be_bytes().to_vec();
                d.extend_from_slice(name.as_bytes());
                opt_reply(&mut c, opt, REP_SERVER, &d).await?;
                opt_reply(&mut c, opt, REP_ACK, &[]).await?;
            }
            OPT_INFO | OPT_GO => {
                let parsed = (|| {
                    let n = u32::from_be_bytes(data.get(0..4)?.try_into().ok()?) as usize;
                    let req_name = data.get(4..4 + n)?;
                    let k = u16::from_be_bytes(data.get(4 + n..6 + n)?.try_into().ok()?) as usize;
                    let reqs = data.get(6 + n..6 + n + 2 * k)?;
                    Some((
                        req_name.to_vec(),
                        reqs.chunks(2)
                            .map(|r| u16::from_be_bytes([r[0], r[1]]))
                            .collect::<Vec<_>>(),
                    ))
                })();
                let Some((req_name, reqs)) = parsed else {
                    opt_reply(&mut c, opt, REP_ERR_INVALID, &[]).await?;
                    continue;
                };
                if !req_name.is_empty() && req_name != name.as_bytes() {
                    opt_reply(&mut c, opt, REP_ERR_UNKNOWN, b"no such export").await?;
                    continue;
                }
                let mut export = INFO_EXPORT.to_be_bytes().to_vec();
                export.extend_from_slice(&size.to_be_bytes());
                export.extend_from_slice(&tflags().to_be_bytes());
                opt_reply(&mut c, opt, REP_INFO, &export).await?;
                if reqs.contains(&INFO_BLOCK_SIZE) {
                    let mut bs = INFO_BLOCK_SIZE.to_be_bytes().to_vec();
                    bs.extend_from_slice(&1u32.to_be_bytes());
                    bs.extend_from_slice(&4096u32.to_be_bytes());
                    bs.extend_from_slice(&MAX_REQUEST.to_be_bytes());
                    opt_reply(&mut c, opt, REP_INFO, &bs).await?;
                }
                opt_reply(&mut c, opt, REP_ACK, &[]).await?;
                if opt == OPT_GO {
                    break;
                }
            }
            _ => opt_reply(&mut c, opt, REP_ERR_UNSUP, &[]).await?,
        }
    }
    transmission(c, device).await
}

async fn transmission<S: AsyncRead + AsyncWrite + Send + 'static>(
    c: S,
    device: Arc<LazyDevice>,
) -> Result<(), NbdError> {
    let (mut r, w) = tokio::io::split(c);
    let w = Arc::new(Mutex::new(w));
    let mut tasks = tokio::task::JoinSet::new();
    loop {
        let mut h = [0u8; 28];
        match r.read_exact(&mut h).await {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => break,
            Err(e) => return Err(e.into()),
        }
        let magic = u32::from_be_bytes(h[0..4].try_into().expect("4"));
        if magic != REQUEST_MAGIC {
            return Err(NbdError::Protocol(format!("request magic {magic:#x}")));
        }
        let kind = u16::from_be_bytes(h[6..8].try_into().expect("2"));
        let cookie = u64::from_be_bytes(h[8..16].try_into().expect("8"));
        let offset = u64::from_be_bytes(h[16..24].try_into().expect("8"));
        let len = u32::from_be_bytes(h[24..28].try_into().expect("4"));
        match kind {
            CMD_READ => {
                let (device, w) = (device.clone(), w.clone());
                tasks.spawn(async move {
                    let (err, data) = if len > MAX_REQUEST {
                        (EINVAL, None)
                    } else {
                        match device.read(offset, len as u64).await {
                            Ok(d) => (0, Some(d)),
                            Err(crate::device::ReadError::OutOfRange { .. }) => (EINVAL, None),
                            Err(e) => {
                                tracing::error!(error = %e, offset, len, "read failed; the guest gets EIO");
                                (EIO, None)
                            }
                        }
                    };
                    reply(&w, cookie, err, data.as_deref()).await
                });
            }
            CMD_WRITE => {
                // Consume the payload, then refuse: the export is read-only.
                let mut left = len as u64;
                let mut buf = vec![0u8; 64 << 10];
                while left > 0 {
                    let n = left.min(buf.len() as u64) as usize;
                    r.read_exact(&mut buf[..n]).await?;
                    left -= n as u64;
                }
                reply(&w, cookie, EPERM, None).await?;
            }
            CMD_FLUSH => reply(&w, cookie, 0, None).await?,
            CMD_DISC => break,
            _ => reply(&w, cookie, EINVAL, None).await?,
        }
        // Reap finished replies; a failed write ends the connection.
        while let Some(done) = tasks.try_join_next() {
            done.expect("reply task")?;
        }
    }
    while let Some(done) = tasks.join_next().await {
        done.expect("reply task")?;
    }
    Ok(())
}

async fn reply<W: AsyncWrite>(
    w: &Mutex<tokio::io::WriteHalf<W>>,
    cookie: u64,
    err: u32,
    data: Option<&[u8]>,
) -> std::io::Result<()> {
    let mut h = [0u8; 16];
    h[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    h[4..8].copy_from_slice(&err.to_be_bytes());
    h[8..16].copy_from_slice(&cookie.to_be_bytes());
    let mut w = w.lock().await;
    w.write_all(&h).await?;
    if let Some(d) = data {
        w.write_all(d).await?;
    }
    Ok(())
}
