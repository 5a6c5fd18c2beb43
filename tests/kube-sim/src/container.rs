//! The local process standing in for a container's command.
//!
//! Each pod works in a directory of its own under the server's root: its
//! working directory, `HOME` and `TMPDIR`, and, where the server may make
//! mount namespaces (it runs as root), its `/tmp` too, so `kubectl cp
//! pod:/tmp/x` lands in the pod's folder and not in the machine's. With
//! `tty`, the command runs on a real pseudo-terminal, as its session's
//! controlling terminal: an interactive shell prints its prompt, edits
//! lines and `tty` names a terminal; resizes reach it as the terminal's
//! window size. util-linux's `unshare` and `setsid` do what must happen
//! between fork and exec, so none of it is written here.

use std::{
    io,
    os::{fd::OwnedFd, unix::ffi::OsStrExt},
    path::{Path, PathBuf},
    process::{ExitStatus, Stdio},
};

use rustix::{
    pty::OpenptFlags,
    termios::{Winsize, tcsetwinsize},
};
use tokio::io::{AsyncRead, AsyncWrite};

use crate::exec::Opts;

const UNSHARE: &str = "/usr/bin/unshare";
const SETSID: &str = "/usr/bin/setsid";

/// Where the pods' directories live: one folder per server, removed with it.
#[derive(Debug)]
pub(crate) struct PodRoots {
    root: PathBuf,
    /// Whether commands get a `/tmp` of their pod's own.
    pub private_tmp: bool,
}

/// Prefix of the pods' folders, followed by the server's pid.
const ROOT_PREFIX: &str = "kube-sim-pods-";

impl PodRoots {
    pub fn create() -> io::Result<PodRoots> {
        let temp = std::env::temp_dir();
        sweep_stale(&temp);
        let root = temp.join(format!(
            "{ROOT_PREFIX}{}-{:016x}",
            std::process::id(),
            rand::random::<u64>()
        ));
        std::fs::create_dir_all(&root)?;
        let mut roots = PodRoots {
            root,
            private_tmp: false,
        };
        roots.private_tmp = roots.probe_private_tmp();
        Ok(roots)
    }

    /// The pod's directory, made on first use (its `tmp` inside).
    pub fn dir(&self, namespace: &str, pod: &str) -> io::Result<PathBuf> {
        // Names are DNS labels by the time a pod exists; the check keeps a
        // path out of them all the same.
        let clean = |s: &str| {
            s.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.')
        };
        if !clean(namespace) || !clean(pod) || pod.starts_with('.') || namespace.starts_with('.') {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "pod name is not a DNS label",
            ));
        }
        let dir = self.root.join(namespace).join(pod);
        std::fs::create_dir_all(dir.join("tmp"))?;
        Ok(dir)
    }

    /// A mount namespace needs privilege: tried once with a command that
    /// does nothing, so a server without it still runs commands.
    fn probe_private_tmp(&self) -> bool {
        let Ok(dir) = self.dir("kube-sim", "probe") else {
            return false;
        };
        let argv = in_pod_tmp(&dir.join("tmp"), vec!["true".into()]);
        std::process::Command::new(&argv[0])
            .args(&argv[1..])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }
}

/// Removes the pods' folders of servers whose process is gone. A server
/// removes its own when dropped, but a process that exits without
/// dropping it (killed, or ended by `exit`) cannot.
fn sweep_stale(temp: &Path) {
    let Ok(entries) = std::fs::read_dir(temp) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(ROOT_PREFIX))
            .and_then(|rest| rest.split_once('-'))
            .and_then(|(pid, _)| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if !Path::new("/proc").join(pid.to_string()).exists() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

impl Drop for PodRoots {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

/// `argv` run in a mount namespace of its own whose `/tmp` is `tmp`.
fn in_pod_tmp(tmp: &Path, argv: Vec<String>) -> Vec<String> {
    let mut out: Vec<String> = [
        UNSHARE,
        "--mount",
        "--propagation",
        "private",
        "--",
        "/bin/sh",
        "-c",
        "mount --bind \"$0\" /tmp && exec \"$@\"",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    out.push(tmp.display().to_string());
    out.extend(argv);
    out
}

/// Whether `program` names something this machine can run, as a runtime
/// checks before it starts a container process.
fn runnable(program: &str) -> bool {
    let is_exec = |p: &Path| {
        use std::os::unix::fs::PermissionsExt;
        std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    if program.contains('/') {
        return is_exec(Path::new(program));
    }
    std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|d| is_exec(&d.join(program))))
}

/// A running command: its pipes, or its terminal.
pub(crate) struct Proc {
    child: tokio::process::Child,
    pub stdin: Option<Box<dyn AsyncWrite + Send + Unpin>>,
    pub stdout: Option<Box<dyn AsyncRead + Send + Unpin>>,
    /// `None` with a terminal: stderr is the terminal too.
    pub stderr: Option<Box<dyn AsyncRead + Send + Unpin>>,
    /// The terminal's master side, for resizes.
    terminal: Option<OwnedFd>,
}

impl Proc {
    /// Starts `opts.command` in the pod's directory.
    pub fn spawn(roots: &PodRoots, opts: &Opts) -> io::Result<Proc> {
        if !runnable(&opts.command[0]) {
            // What runc says for a path and for a name.
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                match opts.command[0].contains('/') {
                    true => "no such file or directory",
                    false => "executable file not found in $PATH",
                },
            ));
        }
        let dir = roots.dir(&opts.namespace, &opts.pod)?;
        let mut argv = opts.command.clone();
        if opts.tty {
            // A session of its own with the terminal (its stdin) as the
            // controlling one, so job control and ^C work as at a console.
            argv.splice(
                0..0,
                [SETSID.into(), "--wait".into(), "--ctty".into(), "--".into()],
            );
        }
        if roots.private_tmp {
            argv = in_pod_tmp(&dir.join("tmp"), argv);
        }
        let mut cmd = tokio::process::Command::new(&argv[0]);
        cmd.args(&argv[1..])
            .current_dir(&dir)
            .env("HOME", &dir)
            .env(
                "TMPDIR",
                if roots.private_tmp {
                    PathBuf::from("/tmp")
                } else {
                    dir.join("tmp")
                },
            )
            .env("HOSTNAME", &opts.pod)
            .env("KUBE_SIM_NAMESPACE", &opts.namespace)
            .env("KUBE_SIM_POD", &opts.pod)
            .env("KUBE_SIM_CONTAINER", &opts.container)
            .kill_on_drop(true);
        let terminal = match opts.tty {
            true => {
                let (master, slave) = open_pty()?;
                cmd.env("TERM", "xterm")
                    .stdin(Stdio::from(slave.try_clone()?))
                    .stdout(Stdio::from(slave.try_clone()?))
                    .stderr(Stdio::from(slave));
                Some(master)
            }
            false => {
                cmd.stdin(if opts.stdin {
                    Stdio::piped()
                } else {
                    Stdio::null()
                })
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
                None
            }
        };
        let mut child = cmd.spawn()?;
        // The slave's copies held by `cmd` close with it here: the master
        // then reads end-of-file (EIO) once the command and its children
        // are gone.
        drop(cmd);
        Ok(match terminal {
            // Reads and writes on copies of their own, so a read waiting
            // for output never holds up what is typed.
            Some(master) => Proc {
                child,
                stdin: match opts.stdin {
                    true => Some(Box::new(tokio::fs::File::from_std(
                        master.try_clone()?.into(),
                    ))),
                    false => None,
                },
                stdout: Some(Box::new(tokio::fs::File::from_std(
                    master.try_clone()?.into(),
                ))),
                stderr: None,
                terminal: Some(master),
            },
            None => Proc {
                stdin: child
                    .stdin
                    .take()
                    .map(|s| Box::new(s) as Box<dyn AsyncWrite + Send + Unpin>),
                stdout: child.stdout.take().map(|s| Box::new(s) as _),
                stderr: child.stderr.take().map(|s| Box::new(s) as _),
                child,
                terminal: None,
            },
        })
    }

    /// The command's exit.
    pub async fn wait(&mut self) -> ExitStatus {
        self.child.wait().await.unwrap_or_default()
    }

    /// The client closed stdin: the pipe closes; a terminal gets ^D, which
    /// is what a person at it would type.
    pub async fn close_stdin(&mut self) {
        if let (Some(stdin), true) = (self.stdin.as_mut(), self.terminal.is_some()) {
            use tokio::io::AsyncWriteExt;
            let _ = stdin.write_all(&[4]).await;
        }
        self.stdin = None;
    }

    /// A window change: the terminal's size, which signals the command.
    pub fn resize(&self, width: u16, height: u16) {
        if let Some(t) = &self.terminal {
            let _ = tcsetwinsize(t, winsize(width, height));
        }
    }
}

fn winsize(width: u16, height: u16) -> Winsize {
    Winsize {
        ws_row: height,
        ws_col: width,
        ws_xpixel: 0,
        ws_ypixel: 0,
    }
}

/// A new pseudo-terminal (80x24): the master, and the slave for the
/// command. The master is read in a blocking thread (tokio's files), which
/// a read of end-of-file (EIO once every slave is closed) ends.
fn open_pty() -> io::Result<(OwnedFd, OwnedFd)> {
    let master = rustix::pty::openpt(OpenptFlags::RDWR | OpenptFlags::NOCTTY)?;
    rustix::pty::grantpt(&master)?;
    rustix::pty::unlockpt(&master)?;
    let name = rustix::pty::ptsname(&master, Vec::new())?;
    let slave: OwnedFd = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(std::ffi::OsStr::from_bytes(name.as_bytes()))?
        .into();
    tcsetwinsize(&slave, winsize(80, 24))?;
    Ok((master, slave))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gone_servers_pod_folders_are_swept_and_a_live_ones_kept() {
        let temp = tempfile::tempdir().unwrap();
        // No process has this pid: above any pid_max Linux allows.
        let gone = temp
            .path()
            .join(format!("{ROOT_PREFIX}4294967295-00000000000000aa"));
        let live = temp.path().join(format!(
            "{ROOT_PREFIX}{}-00000000000000bb",
            std::process::id()
        ));
        let other = temp.path().join("kube-sim-pods-not-a-pid");
        for d in [&gone, &live, &other] {
            std::fs::create_dir_all(d.join("default/web/tmp")).unwrap();
        }
        sweep_stale(temp.path());
        assert!(!gone.exists(), "the gone server's folder stays");
        assert!(live.exists(), "a live server's folder was removed");
        assert!(other.exists(), "a folder not named by a pid was removed");
    }
}
