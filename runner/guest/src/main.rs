//! `amber-guest`: PID 1 of an amber microVM. Loads the modules the initramfs carries,
//! mounts the env's EROFS root (read-only) under an overlay with a tmpfs upper, receives
//! one request from the host over the virtio-serial port `amber`, runs it as the image's
//! user in the new root, streams stdout and stderr back, reports the exit status, and
//! powers the VM off.
//!
//! Messages about the agent itself go to the kernel console (ttyS0), never into the
//! command's output.

use std::ffi::{CString, OsStr};
use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use amber_guest::{write_frame, Request, AGENT_ERROR, EXIT, PORT_NAME, STDERR, STDOUT};

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
    let read = |p: &str| std::fs::read_to_string(format!("{NEWROOT}{p}")).unwrap_or_default();
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

/// Runs the request; returns its exit status.
fn run_command(req: &Request, port: &mut File) -> Result<i32, String> {
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
    let c_argv: Vec<CString> = req.argv.iter().map(cstr).collect();
    let c_env: Vec<CString> = env.iter().map(cstr).collect();
    let cwd = if req.cwd.is_empty() {
        "/".to_string()
    } else {
        req.cwd.clone()
    };
    // SAFETY: fork in a single-threaded process; the child only calls async-signal-safe
    // functions and allocation-free code paths up to execve (strings are prepared above,
    // except the PATH candidates, built before fork below).
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
    let c_root = cstr(NEWROOT);
    let c_cwd = cstr(&cwd);
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(format!("fork: {}", errno()));
    }
    if pid == 0 {
        // SAFETY (child): raw syscalls only.
        unsafe {
            let devnull = libc::open(c"/dev/null".as_ptr(), libc::O_RDONLY);
            libc::dup2(devnull, 0);
            libc::dup2(out_w.as_raw_fd(), 1);
            libc::dup2(err_w.as_raw_fd(), 2);
            libc::setsid();
            if libc::chroot(c_root.as_ptr()) != 0 || libc::chdir(c"/".as_ptr()) != 0 {
                libc::_exit(125);
            }
            if libc::chdir(c_cwd.as_ptr()) != 0 {
                libc::_exit(125);
            }
            libc::setgroups(ids.groups.len(), ids.groups.as_ptr());
            if libc::setgid(ids.gid) != 0 || libc::setuid(ids.uid) != 0 {
                libc::_exit(125);
            }
            let mut argv: Vec<*const libc::c_char> = c_argv.iter().map(|a| a.as_ptr()).collect();
            argv.push(std::ptr::null());
            let mut envp: Vec<*const libc::c_char> = c_env.iter().map(|a| a.as_ptr()).collect();
            envp.push(std::ptr::null());
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
    drop(out_w);
    drop(err_w);
    // Forward both pipes until they close.
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
                write_frame(port, kind, &buf[..r as usize]).map_err(|e| e.to_string())?;
            } else {
                fds[i].fd = -1;
                open -= 1;
            }
        }
    }
    let mut status = 0;
    // SAFETY: waiting for our own child.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    Ok(if libc::WIFEXITED(status) {
        libc::WEXITSTATUS(status)
    } else {
        128 + libc::WTERMSIG(status)
    })
}

fn serve() -> Result<(), String> {
    mount("devtmpfs", "/dev", "devtmpfs", 0, "")?;
    mount("proc", "/proc", "proc", 0, "")?;
    mount("sysfs", "/sys", "sysfs", 0, "")?;
    load_modules();
    let port_path = wait_for_devices()?;
    let mut port = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&port_path)
        .map_err(|e| format!("opening {}: {e}", port_path.display()))?;
    let mut line = String::new();
    BufReader::new(port.try_clone().map_err(|e| e.to_string())?)
        .read_line(&mut line)
        .map_err(|e| format!("reading the request: {e}"))?;
    let req: Request = serde_json::from_str(&line).map_err(|e| format!("bad request: {e}"))?;
    let result = mount_root().and_then(|()| {
        let h = cstr(&req.hostname);
        // SAFETY: valid buffer and length.
        unsafe { libc::sethostname(h.as_ptr(), req.hostname.len()) };
        run_command(&req, &mut port)
    });
    match result {
        Ok(code) => write_frame(&mut port, EXIT, &code.to_be_bytes()).map_err(|e| e.to_string())?,
        Err(e) => {
            write_frame(&mut port, AGENT_ERROR, e.as_bytes()).map_err(|e| e.to_string())?;
            write_frame(&mut port, EXIT, &125i32.to_be_bytes()).map_err(|e| e.to_string())?;
        }
    }
    let _ = port.flush();
    let mut rest = Vec::new();
    // Wait for the host to close the port, so no frame is lost when the VM stops.
    let _ = port.read_to_end(&mut rest);
    Ok(())
}

fn main() {
    if std::process::id() != 1 {
        eprintln!("amber-guest runs as the init of an amber microVM");
        std::process::exit(2);
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
