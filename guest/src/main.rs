//! `amber-guest`: PID 1 of an amber microVM. Loads the modules the initramfs carries,
//! waits for the host's `BOOT` on the virtio-serial port `amber`, mounts the env's EROFS
//! root (read-only) under an overlay whose upper is the sandbox's disk (or a tmpfs), moves itself into that root, and
//! then serves sessions (see the protocol in lib.rs) until the host asks it to power off:
//! commands run as the image's user with stdin, stdout, stderr, signals and exit status
//! carried over the port, and tar streams copied in and out.
//!
//! Threads: one reads the port and dispatches frames; one per command forwards its
//! output; one per copy; one reaps every child (PID 1 also adopts orphans). SIGCHLD is
//! blocked everywhere and read from a signalfd by the reaper. Writes to the port go
//! through one mutex, so frames never interleave.
//!
//! Messages about the agent itself go to the kernel console (ttyS0), never into a
//! command's output.
//!
//! Modules: `rootfs` (modules, devices, mounts, the move into the root), `users` (the
//! image's `User` as docker resolves it), `process` (fork/exec, output, the reaper),
//! `files` (tar copies and snapshots), `modprobe` (the kernel's module loader), `net` (loopback, the network interface, resolver
//! and hosts files), `port` (frames to the host), `sys` (libc wrappers); this file
//! dispatches the host's frames.

use std::fs::File;
use std::sync::mpsc::sync_channel;
use std::sync::{Arc, Mutex};

use amber_guest::{
    read_frame, Boot, Frame, Get, Put, Request, BOOT, DATA, EXEC, GET, PAUSE, PUT, READY, SHUTDOWN,
    SIGNAL, SNAPSHOT, STDIN,
};

use crate::files::{get, put, snapshot};
use crate::port::Port;
use crate::process::{exec, reap, Live, Reaper, Sessions};
use crate::rootfs::{boot, load_modules, wait_for_devices};
use crate::sys::mount;

mod files;
mod modprobe;
mod net;
mod port;
mod process;
mod rootfs;
mod sys;
mod users;

/// Reads frames from the host and dispatches them until `SHUTDOWN` or the end of the port.
fn dispatch(mut input: File, port: Port, module_failures: &[String]) -> Result<(), String> {
    let sessions: Sessions = Arc::default();
    let reaper: Arc<Mutex<Reaper>> = Arc::default();
    {
        let r = reaper.clone();
        std::thread::spawn(move || reap(r));
    }
    let mut booted = false;
    loop {
        let Frame {
            kind,
            session,
            payload,
        } = match read_frame(&mut input) {
            Ok(Some(f)) => f,
            Ok(None) => return Ok(()),
            Err(e) => return Err(format!("reading from the host: {e}")),
        };
        match kind {
            BOOT if !booted && !module_failures.is_empty() => port.fail(
                0,
                &format!(
                    "kernel modules of the initramfs did not load (the initramfs is damaged or not built for this kernel): {}",
                    module_failures.join("; ")
                ),
                125,
            ),
            BOOT if !booted => {
                let b: Boot =
                    serde_json::from_slice(&payload).map_err(|e| format!("bad BOOT: {e}"))?;
                match boot(&b) {
                    Ok(()) => {
                        booted = true;
                        let ready = amber_guest::Ready {
                            protocol: amber_guest::PROTOCOL_VERSION,
                        };
                        port.send(READY, 0, &serde_json::to_vec(&ready).expect("json"));
                    }
                    Err(e) => port.fail(0, &e, 125),
                }
            }
            SHUTDOWN => return Ok(()),
            PAUSE => pause(&mut input, &port)?,
            EXEC | PUT | GET | SNAPSHOT if !booted || session == 0 => {
                port.fail(session, "the sandbox is not booted", 125)
            }
            EXEC | PUT | GET | SNAPSHOT if sessions.lock().unwrap().contains_key(&session) => {
                port.fail(session, &format!("session {session} is already open"), 125)
            }
            EXEC => match serde_json::from_slice::<Request>(&payload) {
                Ok(req) => {
                    // Stdin is queued from now on, even before the command has started.
                    let (tx, rx) = sync_channel(16);
                    let live = Live {
                        pid: None,
                        input: req.stdin.then_some(tx),
                    };
                    let rx = req.stdin.then_some(rx);
                    sessions.lock().unwrap().insert(session, live);
                    let (p, s, r) = (port.clone(), sessions.clone(), reaper.clone());
                    std::thread::spawn(move || exec(p, s, r, session, req, rx));
                }
                Err(e) => port.fail(session, &format!("bad EXEC: {e}"), 125),
            },
            PUT => match serde_json::from_slice::<Put>(&payload) {
                Ok(req) => {
                    let (tx, rx) = sync_channel(16);
                    sessions.lock().unwrap().insert(
                        session,
                        Live {
                            pid: None,
                            input: Some(tx),
                        },
                    );
                    let (p, s) = (port.clone(), sessions.clone());
                    std::thread::spawn(move || {
                        put(p, session, req, rx);
                        s.lock().unwrap().remove(&session);
                    });
                }
                Err(e) => port.fail(session, &format!("bad PUT: {e}"), 125),
            },
            GET => match serde_json::from_slice::<Get>(&payload) {
                Ok(req) => {
                    let p = port.clone();
                    std::thread::spawn(move || get(p, session, req));
                }
                Err(e) => port.fail(session, &format!("bad GET: {e}"), 125),
            },
            SNAPSHOT => {
                let p = port.clone();
                std::thread::spawn(move || snapshot(p, session));
            }
            STDIN | DATA => {
                // Take the sender out of the lock: a full channel must not block others.
                let tx = sessions.lock().unwrap().get_mut(&session).and_then(|l| {
                    if payload.is_empty() {
                        l.input.take()
                    } else {
                        l.input.clone()
                    }
                });
                if let Some(tx) = tx {
                    let _ = tx.send(payload);
                }
            }
            SIGNAL => {
                let pid = sessions.lock().unwrap().get(&session).and_then(|l| l.pid);
                if let Some(pid) = pid {
                    // The command leads its own process group (setsid): the signal goes to
                    // the whole group, so a timeout also ends what a shell started.
                    let sig = amber_guest::parse_status(&payload);
                    // SAFETY: signalling our own child's process group, or the child.
                    unsafe {
                        if libc::kill(-pid, sig) != 0 {
                            libc::kill(pid, sig);
                        }
                    }
                }
            }
            other => eprintln!("amber-guest: ignoring frame kind {other} for session {session}"),
        }
    }
}

/// Answers `PAUSE`: holds the port's write lock (no thread writes a frame) from the
/// `QUIESCED` answer until the host's `RESUME`, then sets the clock the host sent.
fn pause(input: &mut File, port: &Port) -> Result<(), String> {
    let mut out = port.0.lock().unwrap_or_else(|p| p.into_inner());
    amber_guest::write_frame(&mut *out, amber_guest::QUIESCED, 0, &[])
        .map_err(|e| format!("writing to the host: {e}"))?;
    loop {
        match read_frame(input) {
            Ok(Some(f)) if f.kind == amber_guest::RESUME => {
                match serde_json::from_slice::<amber_guest::Resume>(&f.payload) {
                    Ok(r) if r.unix_ns > 0 => {
                        let ts = libc::timespec {
                            tv_sec: (r.unix_ns / 1_000_000_000) as libc::time_t,
                            tv_nsec: (r.unix_ns % 1_000_000_000) as libc::c_long,
                        };
                        // SAFETY: a valid timespec; PID 1 runs as root.
                        if unsafe { libc::clock_settime(libc::CLOCK_REALTIME, &ts) } != 0 {
                            let e = std::io::Error::last_os_error();
                            eprintln!("amber-guest: setting the clock: {e}");
                        }
                    }
                    _ => eprintln!("amber-guest: RESUME without the host's time"),
                }
                return Ok(());
            }
            Ok(Some(f)) => eprintln!("amber-guest: frame kind {} while paused, ignored", f.kind),
            Ok(None) => return Ok(()),
            Err(e) => return Err(format!("reading from the host: {e}")),
        }
    }
}

fn serve() -> Result<(), String> {
    mount("devtmpfs", "/dev", "devtmpfs", 0, "")?;
    mount("proc", "/proc", "proc", 0, "")?;
    mount("sysfs", "/sys", "sysfs", 0, "")?;
    let module_failures = load_modules();
    let port_path = wait_for_devices()?;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&port_path)
        .map_err(|e| format!("opening {}: {e}", port_path.display()))?;
    let port = Port(Arc::new(Mutex::new(
        file.try_clone().map_err(|e| e.to_string())?,
    )));
    dispatch(file, port, &module_failures)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.first().is_some_and(|a| a.ends_with("modprobe")) {
        std::process::exit(modprobe::main(&args[1..]));
    }
    if std::process::id() != 1 {
        eprintln!("amber-guest runs as the init of an amber microVM");
        std::process::exit(2);
    }
    // SIGCHLD goes to the reaper's signalfd; every thread inherits this mask.
    // SAFETY: plain signal mask manipulation before any thread exists.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGCHLD);
        libc::sigprocmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
    }
    if let Err(e) = serve() {
        eprintln!("amber-guest: {e}");
    }
    // SAFETY: flushing and rebooting; with QEMU's -no-reboot a reboot ends the VM.
    unsafe {
        libc::sync();
        libc::reboot(libc::RB_AUTOBOOT);
    }
}
