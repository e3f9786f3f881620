//! The host <-> guest protocol over the virtio-serial port named `amber`, shared by the
//! guest agent (this crate's binary) and the runner.
//!
//! The host sends one `Request` as a JSON line. The guest answers with frames:
//! `[kind: u8][len: u32 big endian][payload]`, kinds below, ending with `EXIT`.

use std::io::{self, Read, Write};

use serde::{Deserialize, Serialize};

pub const PORT_NAME: &str = "amber";

pub const STDOUT: u8 = 1;
pub const STDERR: u8 = 2;
/// Payload: the exit status as i32 big endian (128 + signal when killed by a signal).
pub const EXIT: u8 = 3;
/// Payload: a message from the agent itself (it could not run the command).
pub const AGENT_ERROR: u8 = 4;

/// What to run, resolved by the host from the image config and the user's flags.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Request {
    pub argv: Vec<String>,
    pub env: Vec<String>,
    pub cwd: String,
    /// `user`, `uid`, `user:group` or `uid:gid`, as in the image config; empty is root.
    pub user: String,
    pub hostname: String,
}

pub fn write_frame(w: &mut impl Write, kind: u8, payload: &[u8]) -> io::Result<()> {
    let mut h = [0u8; 5];
    h[0] = kind;
    h[1..].copy_from_slice(&(payload.len() as u32).to_be_bytes());
    w.write_all(&h)?;
    w.write_all(payload)?;
    w.flush()
}

/// Reads one frame; `None` at a clean end of stream.
pub fn read_frame(r: &mut impl Read) -> io::Result<Option<(u8, Vec<u8>)>> {
    let mut h = [0u8; 5];
    match r.read_exact(&mut h) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let len = u32::from_be_bytes(h[1..].try_into().expect("4 bytes")) as usize;
    if len > 16 << 20 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("frame of {len} bytes"),
        ));
    }
    let mut p = vec![0u8; len];
    r.read_exact(&mut p)?;
    Ok(Some((h[0], p)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip() {
        let mut buf = Vec::new();
        write_frame(&mut buf, STDOUT, b"hello").unwrap();
        write_frame(&mut buf, EXIT, &7i32.to_be_bytes()).unwrap();
        let mut r = &buf[..];
        assert_eq!(
            read_frame(&mut r).unwrap(),
            Some((STDOUT, b"hello".to_vec()))
        );
        assert_eq!(
            read_frame(&mut r).unwrap(),
            Some((EXIT, 7i32.to_be_bytes().to_vec()))
        );
        assert_eq!(read_frame(&mut r).unwrap(), None);
    }
}
