//! The host <-> guest protocol over the virtio-serial port named `amber`, shared by the
//! guest agent (this crate's binary), the runner, and a sandbox's API socket (which
//! relays the same frames between `amber exec`/`cp` clients and the VM).
//!
//! Every message is a frame: `[kind: u8][session: u32 BE][len: u32 BE][payload]`.
//! Session 0 is the VM itself (`BOOT`, `READY`, `SHUTDOWN`); every other session is one
//! command or one file copy, opened by the host with `EXEC`, `PUT` or `GET` and closed by
//! the guest with `EXIT`. Frames of one session arrive in the order they were sent.

use std::io::{self, Read, Write};

use serde::{Deserialize, Serialize};

pub mod layer;

pub const PORT_NAME: &str = "amber";

/// Bytes of a frame header.
pub const HEADER: usize = 9;
/// The largest payload a frame may carry.
pub const MAX_PAYLOAD: usize = 1 << 20;

// Host -> guest.
/// Session 0, payload JSON [`Boot`]: mount the root and get ready.
pub const BOOT: u8 = 1;
/// Payload JSON [`Request`]: run a command in this session.
pub const EXEC: u8 = 2;
/// Bytes for the command's stdin; an empty payload closes it.
pub const STDIN: u8 = 3;
/// Payload: a signal number as i32 BE, sent to the session's process group (the command
/// leads one).
pub const SIGNAL: u8 = 4;
/// Payload JSON [`Put`]: a tar stream follows as `DATA` frames (empty `DATA` ends it).
pub const PUT: u8 = 5;
/// Payload JSON [`Get`]: the guest answers with a tar stream as `DATA` frames.
pub const GET: u8 = 6;
/// A piece of a tar stream (either direction); an empty payload ends it.
pub const DATA: u8 = 7;
/// Session 0: sync the disks and power off.
pub const SHUTDOWN: u8 = 8;
/// Payload JSON [`Snapshot`]: freeze the sandbox's writable disk, answer with its changes
/// to the env as an OCI layer (an uncompressed tar in `DATA` frames, an empty `DATA`
/// ends it, written by [`layer::write`]), thaw it, and `EXIT` 0. Protocol 2 and later.
pub const SNAPSHOT: u8 = 9;
/// Session 0: the host is about to stop the VM and save it (pause). The agent finishes
/// the frame it is writing, answers `QUIESCED`, and writes nothing more until `RESUME`;
/// the host writes nothing after `PAUSE` but `RESUME`. Both directions of the port are
/// then at a frame boundary, so the saved VM resumes on a new connection cleanly.
/// Protocol 2 and later.
pub const PAUSE: u8 = 10;
/// Session 0, payload JSON [`Resume`]: the VM was restored; set the clock and go on.
pub const RESUME: u8 = 11;

// Guest -> host.
pub const STDOUT: u8 = 16;
pub const STDERR: u8 = 17;
/// Payload: the exit status as i32 BE (128 + signal when killed by a signal). Closes the
/// session.
pub const EXIT: u8 = 18;
/// Payload: a message from the agent itself (it could not do what the session asked);
/// an `EXIT` follows.
pub const ERROR: u8 = 19;
/// Session 0, payload JSON [`Ready`]: the root is mounted; sessions may be opened.
pub const READY: u8 = 20;
/// Session 0: the answer to `PAUSE`.
pub const QUIESCED: u8 = 21;

/// The version of this protocol the agent speaks, sent in `READY`. Raise it with any
/// change a host of the previous version would misread; a host accepts every version
/// from [`MIN_PROTOCOL_VERSION`] to [`PROTOCOL_VERSION`].
///
/// History: 0 (an empty `READY` payload) is the protocol before versions were sent;
/// 1 has the same frames and sends its version; 2 adds `SNAPSHOT`, `PAUSE`, `QUIESCED`
/// and `RESUME`.
pub const PROTOCOL_VERSION: u32 = 2;
/// The first protocol version with `SNAPSHOT` and `PAUSE`.
pub const SNAPSHOT_PROTOCOL: u32 = 2;
/// The oldest agent protocol this host still drives (old receipts boot old initramfs).
pub const MIN_PROTOCOL_VERSION: u32 = 0;

/// What the agent says when it is ready.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Ready {
    pub protocol: u32,
}

impl Ready {
    /// The `READY` payload's protocol version (an empty payload is version 0).
    pub fn parse(payload: &[u8]) -> Result<Ready, String> {
        if payload.is_empty() {
            return Ok(Ready { protocol: 0 });
        }
        serde_json::from_slice(payload).map_err(|e| format!("unreadable READY payload: {e}"))
    }

    /// Ok when this host can drive an agent of this version; else why not.
    pub fn check(&self) -> Result<(), String> {
        if (MIN_PROTOCOL_VERSION..=PROTOCOL_VERSION).contains(&self.protocol) {
            Ok(())
        } else {
            Err(format!(
                "the guest agent speaks protocol version {}, and this amber speaks versions {MIN_PROTOCOL_VERSION} to {PROTOCOL_VERSION}: use an amber release that speaks version {} (a receipt pins its initramfs, and so its agent)",
                self.protocol, self.protocol
            ))
        }
    }
}

/// How the VM is set up once, before any command runs.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Boot {
    pub hostname: String,
    /// Also create /dev/vda (the env's read-only root device) in the sandbox's /dev, for
    /// checking it bit for bit. Off by default: `docker run` has no such node.
    #[serde(default)]
    pub root_device: bool,
    /// The smallest block of free guest memory (as a page order) the guest hands back to
    /// the host through the balloon's free page reporting; `None` keeps the kernel's
    /// default (order 9, 2 MiB, the host's huge page). The host asks for 0 when it backs
    /// guest memory with small pages (TCG), so memory freed in small pieces goes back too.
    /// An older agent ignores it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub page_reporting_order: Option<u32>,
    /// The sandbox's writes go to its own disk (a virtio-blk device with the serial
    /// [`WRITABLE_DISK_SERIAL`], an ext4 file system the host made) instead of guest
    /// memory. An older agent ignores it and keeps its writes in a tmpfs.
    #[serde(default)]
    pub writable_disk: bool,
    /// The sandbox's network interface, when it has one. An older agent ignores it (and
    /// the sandbox has no network).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<Network>,
}

/// How the agent sets up the guest's network interface: the one with this MAC gets a
/// static address and a default route; /etc/resolv.conf and /etc/hosts are mounted
/// over the image's, as `docker run` does, so they are not part of the sandbox's
/// changes (a snapshot does not carry them).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Network {
    /// `52:54:00:12:34:56`
    pub mac: String,
    pub address: std::net::Ipv4Addr,
    pub prefix_len: u8,
    pub gateway: std::net::Ipv4Addr,
    pub nameserver: std::net::Ipv4Addr,
    /// Extra /etc/hosts lines: (address, names).
    #[serde(default)]
    pub hosts: Vec<(String, String)>,
}

/// The virtio-blk serial of the env's read-only root device.
pub const ENV_DISK_SERIAL: &str = "amber-env";
/// The virtio-blk serial of a sandbox's writable disk.
pub const WRITABLE_DISK_SERIAL: &str = "amber-rw";
/// The virtio-blk serial of the kernel's module tree (an EROFS whose root is
/// `lib/modules/<release>`), from which the agent loads what the kernel asks for.
pub const MODULES_DISK_SERIAL: &str = "amber-modules";

/// What to run, resolved by the host from the image config and the user's flags.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Request {
    pub argv: Vec<String>,
    pub env: Vec<String>,
    pub cwd: String,
    /// `user`, `uid`, `user:group` or `uid:gid`, as in the image config; empty is root.
    pub user: String,
    /// Whether the host sends stdin (`STDIN` frames); otherwise it is /dev/null.
    #[serde(default)]
    pub stdin: bool,
}

/// Copy a tar stream into the sandbox. When `dest` is an existing directory the copy
/// lands at `dest/name`, otherwise at `dest` (as `docker cp` does).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Put {
    pub dest: String,
    pub name: String,
}

/// Copy `path` (a file, a directory tree or a symlink) out of the sandbox as a tar stream
/// whose first entry is `.`, the path itself.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Get {
    pub path: String,
}

/// What the host says when it resumes a saved VM.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Resume {
    /// The host's clock (nanoseconds since the Unix epoch): the guest's stood still while
    /// it was saved.
    pub unix_ns: u64,
}

/// What a `SNAPSHOT` session asks: nothing yet (room for options).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Snapshot {}

pub fn header(kind: u8, session: u32, len: usize) -> [u8; HEADER] {
    let mut h = [0u8; HEADER];
    h[0] = kind;
    h[1..5].copy_from_slice(&session.to_be_bytes());
    h[5..].copy_from_slice(&(len as u32).to_be_bytes());
    h
}

/// (kind, session, payload length) of a header; an error when the length is too large.
pub fn parse_header(h: &[u8; HEADER]) -> io::Result<(u8, u32, usize)> {
    let session = u32::from_be_bytes(h[1..5].try_into().expect("4 bytes"));
    let len = u32::from_be_bytes(h[5..].try_into().expect("4 bytes")) as usize;
    if len > MAX_PAYLOAD {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("a frame of {len} bytes (at most {MAX_PAYLOAD})"),
        ));
    }
    Ok((h[0], session, len))
}

/// One frame; the caller serialises writers so frames never interleave.
pub fn write_frame(w: &mut impl Write, kind: u8, session: u32, payload: &[u8]) -> io::Result<()> {
    let mut buf = Vec::with_capacity(HEADER + payload.len());
    buf.extend_from_slice(&header(kind, session, payload.len()));
    buf.extend_from_slice(payload);
    w.write_all(&buf)?;
    w.flush()
}

/// A received frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frame {
    pub kind: u8,
    pub session: u32,
    pub payload: Vec<u8>,
}

/// Reads one frame; `None` at a clean end of stream.
pub fn read_frame(r: &mut impl Read) -> io::Result<Option<Frame>> {
    let mut h = [0u8; HEADER];
    match r.read_exact(&mut h) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let (kind, session, len) = parse_header(&h)?;
    let mut payload = vec![0u8; len];
    r.read_exact(&mut payload)?;
    Ok(Some(Frame {
        kind,
        session,
        payload,
    }))
}

/// An exit status payload.
pub fn status_payload(code: i32) -> [u8; 4] {
    code.to_be_bytes()
}

/// The exit status an `EXIT` payload carries (125, the runtime's own failure, if garbled).
pub fn parse_status(p: &[u8]) -> i32 {
    p.get(..4)
        .and_then(|b| b.try_into().ok())
        .map(i32::from_be_bytes)
        .unwrap_or(125)
}

/// Tar streams for `amber cp`, written and read the same way on both sides.
pub mod copy {
    use std::io::{self, Read, Write};
    use std::path::{Component, Path, PathBuf};

    /// Writes `path` (not following a symlink at it) as a tar stream rooted at `.`.
    pub fn pack(path: &Path, w: impl Write) -> io::Result<()> {
        let meta = std::fs::symlink_metadata(path)
            .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
        let mut b = tar::Builder::new(w);
        b.follow_symlinks(false);
        if meta.is_dir() {
            b.append_dir_all(".", path)?;
        } else {
            b.append_path_with_name(path, ".")?;
        }
        b.into_inner()?.flush()
    }

    /// Where a copy named `name` lands: inside `dest` when that is a directory, else `dest`.
    pub fn target(dest: &Path, name: &str) -> PathBuf {
        if dest.is_dir() && !name.is_empty() {
            dest.join(name)
        } else {
            dest.to_path_buf()
        }
    }

    fn bad(msg: String) -> io::Error {
        io::Error::new(io::ErrorKind::InvalidData, msg)
    }

    /// Unpacks a stream written by [`pack`] at `target`. Entries that would leave `target`
    /// and hard links are refused. The whole stream is read even after an error, so the
    /// sender is never left blocked.
    pub fn unpack(mut r: impl Read, target: &Path) -> io::Result<()> {
        let result = unpack_entries(&mut r, target);
        io::copy(&mut r, &mut io::sink())?;
        result
    }

    fn unpack_entries(r: &mut impl Read, target: &Path) -> io::Result<()> {
        let mut archive = tar::Archive::new(r);
        for entry in archive.entries()? {
            let mut entry = entry?;
            let name = entry.path()?.into_owned();
            let mut rel = PathBuf::new();
            for c in name.components() {
                match c {
                    Component::CurDir => {}
                    Component::Normal(p) => rel.push(p),
                    _ => {
                        return Err(bad(format!(
                            "entry {} leaves the destination",
                            name.display()
                        )))
                    }
                }
            }
            if entry.header().entry_type().is_hard_link() {
                return Err(bad(format!("entry {} is a hard link", name.display())));
            }
            let dst = if rel.as_os_str().is_empty() {
                target.to_path_buf()
            } else {
                target.join(&rel)
            };
            if let Some(parent) = dst.parent() {
                std::fs::create_dir_all(parent)?;
            }
            entry
                .unpack(&dst)
                .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", dst.display())))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip() {
        let mut buf = Vec::new();
        write_frame(&mut buf, STDOUT, 7, b"hello").unwrap();
        write_frame(&mut buf, EXIT, 7, &status_payload(-3)).unwrap();
        let mut r = &buf[..];
        let f = read_frame(&mut r).unwrap().unwrap();
        assert_eq!(
            (f.kind, f.session, &f.payload[..]),
            (STDOUT, 7, &b"hello"[..])
        );
        let f = read_frame(&mut r).unwrap().unwrap();
        assert_eq!((f.kind, parse_status(&f.payload)), (EXIT, -3));
        assert_eq!(read_frame(&mut r).unwrap(), None);
    }

    #[test]
    fn an_oversized_frame_is_refused() {
        let h = header(DATA, 1, MAX_PAYLOAD + 1);
        let err = read_frame(&mut &h[..]).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        assert_eq!(parse_status(b"\x00"), 125);
    }

    #[test]
    fn a_tree_copies_into_a_directory_and_onto_a_new_name() {
        let src = std::env::temp_dir().join(format!("amber-copy-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&src);
        std::fs::create_dir_all(src.join("tree/sub")).unwrap();
        std::fs::write(src.join("tree/sub/f"), b"data").unwrap();
        std::os::unix::fs::symlink("sub/f", src.join("tree/link")).unwrap();
        let mut tar = Vec::new();
        copy::pack(&src.join("tree"), &mut tar).unwrap();
        std::fs::create_dir(src.join("into")).unwrap();
        for (dest, want) in [("into", "into/tree"), ("renamed", "renamed")] {
            let t = copy::target(&src.join(dest), "tree");
            copy::unpack(&tar[..], &t).unwrap();
            assert_eq!(
                std::fs::read(src.join(want).join("sub/f")).unwrap(),
                b"data"
            );
            assert_eq!(
                std::fs::read_link(src.join(want).join("link")).unwrap(),
                std::path::Path::new("sub/f")
            );
        }
        // An entry that climbs out is refused, and the rest of the stream is consumed.
        let mut h = tar::Header::new_old();
        h.as_old_mut().name[..4].copy_from_slice(b"../x");
        h.set_size(1);
        h.set_mode(0o644);
        h.set_entry_type(tar::EntryType::Regular);
        h.set_cksum();
        let mut bytes = h.as_bytes().to_vec();
        bytes.push(b'x');
        bytes.resize(512 * 4, 0);
        let err = copy::unpack(&bytes[..], &src.join("evil")).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::InvalidData, "{err}");
        std::fs::remove_dir_all(&src).unwrap();
    }

    #[test]
    fn protocol_versions() {
        assert_eq!(Ready::parse(b"").unwrap().protocol, 0);
        assert!(Ready::parse(b"").unwrap().check().is_ok());
        let now = serde_json::to_vec(&Ready {
            protocol: PROTOCOL_VERSION,
        })
        .unwrap();
        assert!(Ready::parse(&now).unwrap().check().is_ok());
        let future = Ready {
            protocol: PROTOCOL_VERSION + 1,
        };
        assert!(future
            .check()
            .unwrap_err()
            .contains("speaks protocol version"));
        assert!(Ready::parse(b"{").is_err());
    }
}
