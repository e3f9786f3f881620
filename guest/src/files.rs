//! Copies in and out of the sandbox: tar streams over a session (`amber cp`).

use std::path::Path;
use std::sync::mpsc::Receiver;

use amber_guest::{copy, status_payload, Get, Put, DATA, EXIT};

use crate::port::{ChannelReader, FrameWriter, Port};

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
