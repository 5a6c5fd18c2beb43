//! A real etcd (Debian's `etcd-server`) on loopback, one member, for the
//! tests of hub replicas sharing a store.

use std::{
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use crate::{double::WAIT, procs::free_port};

/// One etcd member with its data in a temporary directory; killed when
/// dropped.
#[derive(Debug)]
pub struct Etcd {
    child: Child,
    pub client_port: u16,
    pub dir: tempfile::TempDir,
}

impl Etcd {
    /// Starts etcd and waits until it answers; none (with the message of
    /// [`crate::tool_missing`]) when the binary is not installed.
    pub fn start() -> Option<Etcd> {
        let bin = ["/usr/bin/etcd", "/usr/local/bin/etcd"]
            .into_iter()
            .find(|p| std::path::Path::new(p).exists());
        let Some(bin) = bin else {
            crate::tool_missing("etcd (Debian's etcd-server; scripts/setup.sh installs it)");
            return None;
        };
        let dir = tempfile::tempdir().expect("etcd dir");
        let (client_port, peer_port) = (free_port(), free_port());
        let client = format!("http://127.0.0.1:{client_port}");
        let peer = format!("http://127.0.0.1:{peer_port}");
        let log = std::fs::File::create(dir.path().join("etcd.log")).expect("etcd log");
        let child = Command::new(bin)
            .args(["--name", "test"])
            .arg("--data-dir")
            .arg(dir.path().join("data"))
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("test={peer}")])
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("etcd starts");
        let etcd = Etcd {
            child,
            client_port,
            dir,
        };
        etcd.wait_healthy();
        Some(etcd)
    }

    /// `etcd://127.0.0.1:<port>`, as `otter hub --store` takes it.
    pub fn url(&self) -> String {
        format!("etcd://127.0.0.1:{}", self.client_port)
    }

    fn wait_healthy(&self) {
        let deadline = Instant::now() + WAIT;
        loop {
            let healthy = std::net::TcpStream::connect(("127.0.0.1", self.client_port))
                .ok()
                .and_then(|mut s| {
                    use std::io::{Read, Write};
                    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
                    s.write_all(b"GET /health HTTP/1.0\r\n\r\n").ok()?;
                    let mut answer = String::new();
                    s.read_to_string(&mut answer).ok()?;
                    Some(answer.contains("\"health\":\"true\""))
                })
                .unwrap_or(false);
            if healthy {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "etcd never became healthy:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The end of etcd's log.
    pub fn log(&self) -> String {
        let text = std::fs::read_to_string(self.dir.path().join("etcd.log")).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
