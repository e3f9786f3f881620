//! `amber-guest`: PID 1 of an amber microVM. Loads the modules the initramfs carries,
//! waits for the host's `BOOT` on the virtio-serial port `amber`, mounts the env's EROFS
//! root (read-only) under an overlay with a tmpfs upper, moves itself into that root, and
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

use std::collections::HashMap;
use std::ffi::{CString, OsStr};
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use amber_guest::{
    copy, read_frame, status_payload, write_frame, Boot, Frame, Get, Put, Request, BOOT, DATA,
    ERROR, EXEC, EXIT, GET, MAX_PAYLOAD, PORT_NAME, PUT, READY, SHUTDOWN, SIGNAL, STDERR, STDIN,
    STDOUT,
};

const NEWROOT: &str = "/newroot";

fn cstr(s: impl AsRef<OsStr>) -> CString {
    CString::new(s.as_ref().as_bytes()).expect("no NUL in paths")
}

fn errno() -> std::io::Error {
    std::io::Error::last_os_error()
}

fn mount(
    src: &str,
    target: &str,
    fstype: &str,
    flags: libc::c_ulong,
    data: &str,
) -> Result<(), String> {
    let _ = std::fs::create_dir_all(target);
    let (s, t, f, d) = (cstr(src), cstr(target), cstr(fstype), cstr(data));
    // SAFETY: all pointers are valid NUL-terminated strings for the call's duration.
    let r = unsafe { libc::mount(s.as_ptr(), t.as_ptr(), f.as_ptr(), flags, d.as_ptr().cast()) };
    if r != 0 {
        return Err(format!("mount {fstype} {src} on {target}: {}", errno()));
    }
    Ok(())
}

fn load_modules() {
    let Ok(rd) = std::fs::read_dir("/lib/modules") else {
        return;
    };
    let mut mods: Vec<PathBuf> = rd.filter_map(|e| e.ok().map(|e| e.path())).collect();
    mods.sort();
    for m in mods {
        let Ok(f) = File::open(&m) else { continue };
        let params = cstr("");
        // SAFETY: finit_module reads the open module file and the empty parameter string.
        let r = unsafe { libc::syscall(libc::SYS_finit_module, f.as_raw_fd(), params.as_ptr(), 0) };
        if r != 0 {
            let e = errno();
            if e.raw_os_error() != Some(libc::EEXIST) {
                eprintln!("amber-guest: loading {}: {e}", m.display());
            }
        }
    }
}

/// Waits (bounded) for the root disk and the control port to appear.
fn wait_for_devices() -> Result<PathBuf, String> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let port = std::fs::read_dir("/sys/class/virtio-ports")
            .ok()
            .and_then(|rd| {
                rd.filter_map(Result::ok).find_map(|e| {
                    let name = std::fs::read_to_string(e.path().join("name")).ok()?;
                    (name.trim() == PORT_NAME).then(|| Path::new("/dev").join(e.file_name()))
                })
            });
        if let Some(p) = port.filter(|p| p.exists() && Path::new("/dev/vda").exists()) {
            return Ok(p);
        }
        if Instant::now() > deadline {
            return Err("the root disk /dev/vda or the control port did not appear".into());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn mount_root() -> Result<(), String> {
    mount("/dev/vda", "/lower", "erofs", libc::MS_RDONLY, "")?;
    mount("tmpfs", "/rw", "tmpfs", 0, "mode=0755")?;
    std::fs::create_dir_all("/rw/upper").map_err(|e| e.to_string())?;
    std::fs::create_dir_all("/rw/work").map_err(|e| e.to_string())?;
    // The merged root takes its owner and mode from the upper directory: copy the env's.
    {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata("/lower").map_err(|e| format!("stat of the env root: {e}"))?;
        let upper = cstr("/rw/upper");
        // SAFETY: valid path; plain chown/chmod.
        unsafe {
            libc::chown(upper.as_ptr(), m.uid(), m.gid());
            libc::chmod(upper.as_ptr(), m.mode() & 0o7777);
        }
    }
    mount(
        "overlay",
        NEWROOT,
        "overlay",
        0,
        "lowerdir=/lower,upperdir=/rw/upper,workdir=/rw/work",
    )?;
    mount(
        "proc",
        &format!("{NEWROOT}/proc"),
        "proc",
        libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
        "",
    )?;
    mount(
        "sysfs",
        &format!("{NEWROOT}/sys"),
        "sysfs",
        libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC | libc::MS_RDONLY,
        "",
    )?;
    mount(
        "tmpfs",
        &format!("{NEWROOT}/dev"),
        "tmpfs",
        libc::MS_NOSUID,
        "mode=755,size=65536k",
    )?;
    for (name, major, minor) in [
        ("null", 1, 3),
        ("zero", 1, 5),
        ("full", 1, 7),
        ("random", 1, 8),
        ("urandom", 1, 9),
        ("tty", 5, 0),
    ] {
        let p = cstr(format!("{NEWROOT}/dev/{name}"));
        // SAFETY: creating a device node at a valid path.
        unsafe {
            libc::mknod(
                p.as_ptr(),
                libc::S_IFCHR | 0o666,
                libc::makedev(major, minor),
            )
        };
    }
    mount(
        "devpts",
        &format!("{NEWROOT}/dev/pts"),
        "devpts",
        libc::MS_NOSUID | libc::MS_NOEXEC,
        "newinstance,ptmxmode=0666,mode=0620",
    )?;
    mount(
        "shm",
        &format!("{NEWROOT}/dev/shm"),
        "tmpfs",
        libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
        "mode=1777,size=65536k",
    )?;
    for (link, target) in [
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
        ("ptmx", "pts/ptmx"),
    ] {
        let _ = std::os::unix::fs::symlink(target, format!("{NEWROOT}/dev/{link}"));
    }
    Ok(())
}

struct Ids {
    uid: u32,
    gid: u32,
    groups: Vec<u32>,
    home: String,
}

/// Resolves an image `User` the way docker does, from the env's /etc/passwd and /etc/group.
fn resolve_user(spec: &str) -> Result<Ids, String> {
    // Called after `boot` moved the agent into the sandbox root.
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    let passwd = read("/etc/passwd");
    let group = read("/etc/group");
    let (u, g) = match spec.split_once(':') {
        Some((u, g)) => (u, Some(g)),
        None => (spec, None),
    };
    let u = if u.is_empty() { "0" } else { u };
    let entry = passwd
        .lines()
        .map(|l| l.split(':').collect::<Vec<_>>())
        .find(|f| f.len() >= 7 && (f[0] == u || (u.parse::<u32>().is_ok() && f[2] == u)));
    let (uid, mut gid, name, home) = match (&entry, u.parse::<u32>()) {
        (Some(f), _) => (
            f[2].parse().unwrap_or(0),
            f[3].parse().unwrap_or(0),
            f[0].to_string(),
            f[5].to_string(),
        ),
        (None, Ok(n)) => (n, 0, String::new(), "/".to_string()),
        (None, Err(_)) => {
            return Err(format!(
                "unable to find user {u}: no matching entries in passwd file"
            ))
        }
    };
    if let Some(g) = g {
        gid = match g.parse::<u32>() {
            Ok(n) => n,
            Err(_) => group
                .lines()
                .map(|l| l.split(':').collect::<Vec<_>>())
                .find(|f| f.len() >= 3 && f[0] == g)
                .and_then(|f| f[2].parse().ok())
                .ok_or_else(|| {
                    format!("unable to find group {g}: no matching entries in group file")
                })?,
        };
    }
    let mut groups = vec![gid];
    if !name.is_empty() && g.is_none() {
        for f in group.lines().map(|l| l.split(':').collect::<Vec<_>>()) {
            if f.len() >= 4 && f[3].split(',').any(|m| m == name) {
                if let Ok(n) = f[2].parse::<u32>() {
                    if !groups.contains(&n) {
                        groups.push(n);
                    }
                }
            }
        }
    }
    Ok(Ids {
        uid,
        gid,
        groups,
        home: if home.is_empty() { "/".into() } else { home },
    })
}

fn pipe() -> Result<(OwnedFd, OwnedFd), String> {
    let mut fds = [0; 2];
    // SAFETY: fds has room for the two descriptors pipe2 writes.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(format!("pipe: {}", errno()));
    }
    // SAFETY: pipe2 just returned these descriptors to us.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// The port's write side, shared by every thread.
#[derive(Clone)]
struct Port(Arc<Mutex<File>>);

impl Port {
    fn send(&self, kind: u8, session: u32, payload: &[u8]) {
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

    fn fail(&self, session: u32, msg: &str, code: i32) {
        self.send(ERROR, session, msg.as_bytes());
        self.send(EXIT, session, &status_payload(code));
    }
}

/// Exit statuses of children, handed from the reaper to the thread that forked them.
#[derive(Default)]
struct Reaper {
    waiting: HashMap<libc::pid_t, SyncSender<i32>>,
}

/// Reads SIGCHLD from a signalfd and reaps every child, known or orphaned.
fn reap(reaper: Arc<Mutex<Reaper>>) {
    // SAFETY: building a signal set and a signalfd for SIGCHLD, blocked in every thread.
    let fd = unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGCHLD);
        libc::signalfd(-1, &set, libc::SFD_CLOEXEC)
    };
    if fd < 0 {
        eprintln!("amber-guest: signalfd: {}", errno());
        return;
    }
    let mut info = [0u8; 128];
    loop {
        // SAFETY: reading one signalfd_siginfo into a buffer of its size.
        let n = unsafe { libc::read(fd, info.as_mut_ptr().cast(), info.len()) };
        if n < 0 && errno().raw_os_error() != Some(libc::EINTR) {
            eprintln!("amber-guest: reading the signalfd: {}", errno());
            return;
        }
        loop {
            let mut status = 0;
            // SAFETY: reaping any child without blocking.
            let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
            if pid <= 0 {
                break;
            }
            let code = if libc::WIFEXITED(status) {
                libc::WEXITSTATUS(status)
            } else {
                128 + libc::WTERMSIG(status)
            };
            if let Some(tx) = reaper.lock().unwrap().waiting.remove(&pid) {
                let _ = tx.send(code);
            }
        }
    }
}

/// Bytes from the port's reader thread, as a `Read` (an empty message is the end).
struct ChannelReader {
    rx: Receiver<Vec<u8>>,
    buf: Vec<u8>,
    pos: usize,
    done: bool,
}

impl ChannelReader {
    fn new(rx: Receiver<Vec<u8>>) -> ChannelReader {
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
struct FrameWriter {
    port: Port,
    session: u32,
    buf: Vec<u8>,
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

/// What the reader thread routes to a live session.
#[derive(Default)]
struct Live {
    pid: Option<libc::pid_t>,
    input: Option<SyncSender<Vec<u8>>>,
}

type Sessions = Arc<Mutex<HashMap<u32, Live>>>;

/// Forks and execs `req`; returns the child's pid, its stdout and stderr pipes, the write
/// end of its stdin (when the host sends stdin) and where its exit status will arrive.
#[allow(clippy::type_complexity)]
fn spawn(
    req: &Request,
    reaper: &Mutex<Reaper>,
) -> Result<
    (
        libc::pid_t,
        OwnedFd,
        OwnedFd,
        Option<OwnedFd>,
        Receiver<i32>,
    ),
    String,
> {
    let ids = resolve_user(&req.user)?;
    let mut env = req.env.clone();
    if !env.iter().any(|e| e.starts_with("HOME=")) {
        env.push(format!("HOME={}", ids.home));
    }
    let path_var = env
        .iter()
        .find_map(|e| e.strip_prefix("PATH="))
        .unwrap_or("/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
        .to_string();
    let argv0 = req.argv.first().ok_or("empty command")?.clone();
    let (out_r, out_w) = pipe()?;
    let (err_r, err_w) = pipe()?;
    let (in_r, in_w) = if req.stdin {
        let (r, w) = pipe()?;
        (Some(r), Some(w))
    } else {
        (None, None)
    };
    // Everything the child needs is built before fork: after it, in a process with
    // threads, the child may only make async-signal-safe calls.
    let c_argv: Vec<CString> = req.argv.iter().map(cstr).collect();
    let c_env: Vec<CString> = env.iter().map(cstr).collect();
    let mut argv: Vec<*const libc::c_char> = c_argv.iter().map(|a| a.as_ptr()).collect();
    argv.push(std::ptr::null());
    let mut envp: Vec<*const libc::c_char> = c_env.iter().map(|a| a.as_ptr()).collect();
    envp.push(std::ptr::null());
    let candidates: Vec<CString> = if argv0.contains('/') {
        vec![cstr(&argv0)]
    } else {
        path_var
            .split(':')
            .filter(|d| !d.is_empty())
            .map(|d| cstr(format!("{d}/{argv0}")))
            .collect()
    };
    let not_found = format!("exec: \"{argv0}\": executable file not found in $PATH\n");
    let c_cwd = cstr(if req.cwd.is_empty() { "/" } else { &req.cwd });
    let in_fd = in_r.as_ref().map(|f| f.as_raw_fd()).unwrap_or(-1);
    let (tx, rx) = sync_channel(1);
    // The reaper cannot hand out this child's status before it is registered.
    let mut reg = reaper.lock().unwrap();
    // SAFETY: see above; the child uses only raw syscalls on prepared data.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(format!("fork: {}", errno()));
    }
    if pid == 0 {
        // SAFETY: in the forked child, which uses raw syscalls only on data prepared
        // before the fork (no allocation, no locks another thread might hold).
        unsafe {
            let mut none: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut none);
            libc::sigprocmask(libc::SIG_SETMASK, &none, std::ptr::null_mut());
            // The agent ignores SIGPIPE (Rust does); a command starts with the default.
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
            let stdin = if in_fd >= 0 {
                in_fd
            } else {
                libc::open(c"/dev/null".as_ptr(), libc::O_RDONLY)
            };
            libc::dup2(stdin, 0);
            libc::dup2(out_w.as_raw_fd(), 1);
            libc::dup2(err_w.as_raw_fd(), 2);
            libc::setsid();
            if libc::chdir(c_cwd.as_ptr()) != 0 {
                libc::_exit(125);
            }
            libc::setgroups(ids.groups.len(), ids.groups.as_ptr());
            if libc::setgid(ids.gid) != 0 || libc::setuid(ids.uid) != 0 {
                libc::_exit(125);
            }
            let mut denied = false;
            for cand in &candidates {
                libc::execve(cand.as_ptr(), argv.as_ptr(), envp.as_ptr());
                if *libc::__errno_location() == libc::EACCES {
                    denied = true;
                }
            }
            libc::write(2, not_found.as_ptr().cast(), not_found.len());
            libc::_exit(if denied { 126 } else { 127 });
        }
    }
    reg.waiting.insert(pid, tx);
    drop(reg);
    Ok((pid, out_r, err_r, in_w, rx))
}

/// Forwards the command's stdout and stderr until both close, then its exit status.
fn forward_output(port: &Port, session: u32, out_r: OwnedFd, err_r: OwnedFd) -> Result<(), String> {
    let mut fds = [
        libc::pollfd {
            fd: out_r.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: err_r.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    let mut open = 2;
    let mut buf = vec![0u8; 64 << 10];
    while open > 0 {
        // SAFETY: fds is a valid array of two pollfd.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
        if n < 0 {
            if errno().raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return Err(format!("poll: {}", errno()));
        }
        for (i, kind) in [(0, STDOUT), (1, STDERR)] {
            if fds[i].fd < 0 || fds[i].revents == 0 {
                continue;
            }
            // SAFETY: reading into our buffer from an open pipe.
            let r = unsafe { libc::read(fds[i].fd, buf.as_mut_ptr().cast(), buf.len()) };
            if r > 0 {
                port.send(kind, session, &buf[..r as usize]);
            } else {
                fds[i].fd = -1;
                open -= 1;
            }
        }
    }
    Ok(())
}

/// Writes what the host sends for stdin into the command's stdin pipe.
fn feed_stdin(rx: Receiver<Vec<u8>>, w: OwnedFd) {
    let mut f = File::from(w);
    let mut r = ChannelReader::new(rx);
    // A command that exits without reading its stdin gives EPIPE: the rest is dropped.
    let _ = std::io::copy(&mut r, &mut f);
    drop(f);
    let _ = std::io::copy(&mut r, &mut std::io::sink());
}

fn exec(
    port: Port,
    sessions: Sessions,
    reaper: Arc<Mutex<Reaper>>,
    session: u32,
    req: Request,
    stdin: Option<Receiver<Vec<u8>>>,
) {
    let spawned = spawn(&req, &reaper);
    let (pid, out_r, err_r, in_w, status) = match spawned {
        Ok(s) => s,
        Err(e) => {
            sessions.lock().unwrap().remove(&session);
            return port.fail(session, &e, 125);
        }
    };
    {
        let mut s = sessions.lock().unwrap();
        let live = s.entry(session).or_default();
        live.pid = Some(pid);
        if let (Some(w), Some(rx)) = (in_w, stdin) {
            std::thread::spawn(move || feed_stdin(rx, w));
        }
    }
    let forwarded = forward_output(&port, session, out_r, err_r);
    let code = status.recv().unwrap_or(125);
    sessions.lock().unwrap().remove(&session);
    match forwarded {
        Ok(()) => port.send(EXIT, session, &status_payload(code)),
        Err(e) => port.fail(session, &e, code),
    }
}

fn put(port: Port, session: u32, req: Put, rx: Receiver<Vec<u8>>) {
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

fn get(port: Port, session: u32, req: Get) {
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

/// Mounts the root, sets the hostname, and moves this process into the root, so commands
/// and copies see exactly the sandbox's file system.
fn boot(b: &Boot) -> Result<(), String> {
    mount_root()?;
    let h = cstr(&b.hostname);
    // SAFETY: valid buffer and length.
    if unsafe { libc::sethostname(h.as_ptr(), b.hostname.len()) } != 0 {
        return Err(format!("sethostname {:?}: {}", b.hostname, errno()));
    }
    if b.root_device {
        let dev = std::fs::read_to_string("/sys/block/vda/dev")
            .map_err(|e| format!("reading /sys/block/vda/dev: {e}"))?;
        let (major, minor) = dev
            .trim()
            .split_once(':')
            .and_then(|(a, b)| Some((a.parse().ok()?, b.parse().ok()?)))
            .ok_or_else(|| format!("bad /sys/block/vda/dev {dev:?}"))?;
        let p = cstr(format!("{NEWROOT}/dev/vda"));
        // SAFETY: creating a block device node at a valid path.
        if unsafe {
            libc::mknod(
                p.as_ptr(),
                libc::S_IFBLK | 0o400,
                libc::makedev(major, minor),
            )
        } != 0
        {
            return Err(format!("mknod /dev/vda: {}", errno()));
        }
    }
    let root = cstr(NEWROOT);
    // SAFETY: plain chdir/chroot with valid paths.
    unsafe {
        if libc::chdir(root.as_ptr()) != 0 || libc::chroot(c".".as_ptr()) != 0 {
            return Err(format!("entering the root: {}", errno()));
        }
        libc::chdir(c"/".as_ptr());
    }
    Ok(())
}

/// Reads frames from the host and dispatches them until `SHUTDOWN` or the end of the port.
fn dispatch(mut input: File, port: Port) -> Result<(), String> {
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
            EXEC | PUT | GET if !booted || session == 0 => {
                port.fail(session, "the sandbox is not booted", 125)
            }
            EXEC | PUT | GET if sessions.lock().unwrap().contains_key(&session) => {
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
                    // SAFETY: signalling our own child.
                    unsafe { libc::kill(pid, amber_guest::parse_status(&payload)) };
                }
            }
            other => eprintln!("amber-guest: ignoring frame kind {other} for session {session}"),
        }
    }
}

fn serve() -> Result<(), String> {
    mount("devtmpfs", "/dev", "devtmpfs", 0, "")?;
    mount("proc", "/proc", "proc", 0, "")?;
    mount("sysfs", "/sys", "sysfs", 0, "")?;
    load_modules();
    let port_path = wait_for_devices()?;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&port_path)
        .map_err(|e| format!("opening {}: {e}", port_path.display()))?;
    let port = Port(Arc::new(Mutex::new(
        file.try_clone().map_err(|e| e.to_string())?,
    )));
    dispatch(file, port)
}

fn main() {
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
