//! Running a session's command: fork and exec as the image's user with its env and cwd,
//! stdin fed from the host, stdout and stderr forwarded as frames, and the exit status
//! from the reaper, which also adopts every orphan (the agent is PID 1).

use std::collections::HashMap;
use std::ffi::CString;
use std::fs::File;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Mutex};

use amber_guest::{status_payload, Request, EXIT, STDERR, STDOUT};

use crate::port::{ChannelReader, Port};
use crate::sys::{cstr, errno, pipe};
use crate::users::resolve_user;

/// Exit statuses of children, handed from the reaper to the thread that forked them.
#[derive(Default)]
pub(crate) struct Reaper {
    pub(crate) waiting: HashMap<libc::pid_t, SyncSender<i32>>,
}

/// Reads SIGCHLD from a signalfd and reaps every child, known or orphaned.
pub(crate) fn reap(reaper: Arc<Mutex<Reaper>>) {
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

/// What the reader thread routes to a live session.
#[derive(Default)]
pub(crate) struct Live {
    pub(crate) pid: Option<libc::pid_t>,
    pub(crate) input: Option<SyncSender<Vec<u8>>>,
}

pub(crate) type Sessions = Arc<Mutex<HashMap<u32, Live>>>;

/// Forks and execs `req`; returns the child's pid, its stdout and stderr pipes, the write
/// end of its stdin (when the host sends stdin) and where its exit status will arrive.
#[allow(clippy::type_complexity)]
pub(crate) fn spawn(
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
    // What runc (and so `docker exec`) answers: a name searched in PATH that does not
    // exec is "not found" (127) whatever the reason, as Go's LookPath skips entries it
    // cannot search or run; an explicit path that cannot be run is "permission denied"
    // (126), one that does not exist "no such file or directory" (127).
    let searched = !argv0.contains('/');
    let not_found = format!("exec: \"{argv0}\": executable file not found in $PATH\n");
    let denied_msg = format!("exec: \"{argv0}\": permission denied\n");
    let missing_msg = format!("exec: \"{argv0}\": no such file or directory\n");
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
            let (msg, code) = if searched {
                (&not_found, 127)
            } else if denied {
                (&denied_msg, 126)
            } else {
                (&missing_msg, 127)
            };
            libc::write(2, msg.as_ptr().cast(), msg.len());
            libc::_exit(code);
        }
    }
    reg.waiting.insert(pid, tx);
    drop(reg);
    Ok((pid, out_r, err_r, in_w, rx))
}

/// Forwards the command's stdout and stderr until both close, then its exit status.
pub(crate) fn forward_output(
    port: &Port,
    session: u32,
    out_r: OwnedFd,
    err_r: OwnedFd,
) -> Result<(), String> {
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
pub(crate) fn feed_stdin(rx: Receiver<Vec<u8>>, w: OwnedFd) {
    let mut f = File::from(w);
    let mut r = ChannelReader::new(rx);
    // A command that exits without reading its stdin gives EPIPE: the rest is dropped.
    let _ = std::io::copy(&mut r, &mut f);
    drop(f);
    let _ = std::io::copy(&mut r, &mut std::io::sink());
}

pub(crate) fn exec(
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
