//! Tar streams over a session: copies in and out of the sandbox (`amber cp`), and the
//! sandbox's changes as a layer (`SNAPSHOT`).

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::mpsc::Receiver;

use amber_guest::{copy, layer, status_payload, Get, Put, DATA, EXIT};

use crate::port::{ChannelReader, FrameWriter, Port};
use crate::rootfs::{mount_points, upper_dir, writable_disk};
use crate::sys::errno;

// <linux/fs.h>: _IOWR('X', 119, int) and _IOWR('X', 120, int).
const FIFREEZE: libc::c_ulong = 0xC004_5877;
const FITHAW: libc::c_ulong = 0xC004_5878;

/// A frozen file system: every write to it waits (and its dirty data is on the disk)
/// until this is dropped.
struct Frozen<'a>(&'a File);

impl<'a> Frozen<'a> {
    fn new(fs: &'a File) -> Result<Frozen<'a>, String> {
        // SAFETY: an ioctl on an open descriptor; FIFREEZE takes no argument.
        if unsafe { libc::ioctl(fs.as_raw_fd(), FIFREEZE, 0) } != 0 {
            let e = errno();
            return Err(match e.raw_os_error() {
                Some(libc::EBUSY) => "another snapshot of this sandbox is being taken".into(),
                _ => format!("freezing the writable disk: {e}"),
            });
        }
        Ok(Frozen(fs))
    }
}

impl Drop for Frozen<'_> {
    fn drop(&mut self) {
        // SAFETY: as in `new`.
        if unsafe { libc::ioctl(self.0.as_raw_fd(), FITHAW, 0) } != 0 {
            eprintln!("amber-guest: thawing the writable disk: {}", errno());
        }
    }
}

/// Answers a `SNAPSHOT`: the writable disk frozen while its upper directory is written
/// out as a layer, so the layer is the sandbox's files at one instant.
pub(crate) fn snapshot(port: Port, session: u32) {
    let Some(disk) = writable_disk() else {
        return port.fail(
            session,
            "this sandbox keeps its writes in guest memory (it was created with disk 0): a snapshot needs its writable disk",
            1,
        );
    };
    let mut w = FrameWriter {
        port: port.clone(),
        session,
        buf: Vec::new(),
    };
    let written = Frozen::new(disk).and_then(|frozen| {
        let r = layer::write(&upper_dir(disk), mount_points(), &mut w).map_err(|e| e.to_string());
        drop(frozen);
        r
    });
    match written {
        Ok(_) => {
            port.send(DATA, session, &[]);
            port.send(EXIT, session, &status_payload(0));
        }
        Err(e) => port.fail(session, &format!("snapshot: {e}"), 1),
    }
}

pub(crate) fn put(port: Port, session: u32, req: Put, rx: Receiver<Vec<u8>>) {
    let target = copy::target(Path::new(&req.dest), &req.name);
    match copy::unpack(ChannelReader::new(rx), &target) {
        Ok(()) => port.send(EXIT, session, &status_payload(0)),
        Err(e) => port.fail(
            session,
            &format!("copying into {}: {e}", target.display()),
            1,
        ),
    }
}

pub(crate) fn get(port: Port, session: u32, req: Get) {
    let mut w = FrameWriter {
        port: port.clone(),
        session,
        buf: Vec::new(),
    };
    match copy::pack(Path::new(&req.path), &mut w) {
        Ok(()) => {
            port.send(DATA, session, &[]);
            port.send(EXIT, session, &status_payload(0));
        }
        Err(e) => port.fail(session, &e.to_string(), 1),
    }
}
