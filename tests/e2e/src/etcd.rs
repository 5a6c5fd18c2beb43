//! A real etcd (Debian's `etcd-server`) on loopback, one member, for the
//! tests of hub replicas sharing a store.

use std::{
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use crate::{TestHub, double::WAIT, procs::free_port};

/// One etcd member with its data in a temporary directory; killed when
/// dropped.
#[derive(Debug)]
pub struct Etcd {
    child: Option<Child>,
    bin: &'static str,
    name: String,
    pub client_port: u16,
    peer_port: u16,
    /// `--initial-cluster`: every member's name and peer URL.
    cluster: String,
    pub dir: tempfile::TempDir,
}

fn etcd_bin() -> Option<&'static str> {
    let bin = ["/usr/bin/etcd", "/usr/local/bin/etcd"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists());
    if bin.is_none() {
        crate::tool_missing("etcd (Debian's etcd-server; scripts/setup.sh installs it)");
    }
    bin
}

impl Etcd {
    /// Starts etcd and waits until it answers; none (with the message of
    /// [`crate::tool_missing`]) when the binary is not installed.
    pub fn start() -> Option<Etcd> {
        let mut one = Self::cluster(1)?;
        one.pop()
    }

    /// `n` members forming one cluster, each started and answering; none
    /// when etcd is not installed.
    pub fn cluster(n: usize) -> Option<Vec<Etcd>> {
        let bin = etcd_bin()?;
        let ports: Vec<(u16, u16)> = (0..n).map(|_| (free_port(), free_port())).collect();
        let cluster = ports
            .iter()
            .enumerate()
            .map(|(i, (_, peer))| format!("m{i}=http://127.0.0.1:{peer}"))
            .collect::<Vec<_>>()
            .join(",");
        let mut members: Vec<Etcd> = ports
            .into_iter()
            .enumerate()
            .map(|(i, (client_port, peer_port))| Etcd {
                child: None,
                bin,
                name: format!("m{i}"),
                client_port,
                peer_port,
                cluster: cluster.clone(),
                dir: tempfile::tempdir().expect("etcd dir"),
            })
            .collect();
        // All at once: a member answers only once a quorum has formed.
        for m in &mut members {
            m.spawn();
        }
        for m in &members {
            m.wait_healthy();
        }
        Some(members)
    }

    fn spawn(&mut self) {
        let client = format!("http://127.0.0.1:{}", self.client_port);
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("etcd.log"))
            .expect("etcd log");
        // A member started again finds its data and rejoins; the initial
        // cluster only matters the first time.
        let child = Command::new(self.bin)
            .args(["--name", &self.name])
            .arg("--data-dir")
            .arg(self.dir.path().join("data"))
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &self.cluster])
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("etcd starts");
        self.child = Some(child);
    }

    /// Kills this member (SIGKILL), keeping its data.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts a stopped member again on its data; returns once it answers
    /// (which needs a quorum of the cluster up).
    pub fn restart(&mut self) {
        self.stop();
        self.spawn();
        self.wait_healthy();
    }

    /// `etcd://` with every member's client address, as `otter hub
    /// --store` takes it.
    pub fn urls(members: &[Etcd]) -> String {
        let hosts: Vec<String> = members
            .iter()
            .map(|m| format!("127.0.0.1:{}", m.client_port))
            .collect();
        format!("etcd://{}", hosts.join(","))
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
        self.stop();
    }
}

impl Etcd {
    /// The store's revision now (each write adds one), from etcd's JSON
    /// gateway.
    pub fn revision(&self) -> Option<i64> {
        let v = self.range(r#"{"key":"AA=="}"#)?;
        v["header"]["revision"].as_str()?.parse().ok()
    }

    /// How many keys start with `prefix` (one of the hub's trees under the
    /// default prefix: `/otterscale-link/tunnels/`).
    pub fn keys_under(&self, prefix: &str) -> Option<u64> {
        use base64::Engine;
        let b64 = |b: &[u8]| base64::engine::general_purpose::STANDARD.encode(b);
        let mut end = prefix.as_bytes().to_vec();
        *end.last_mut()? += 1;
        let v = self.range(&format!(
            r#"{{"key":"{}","range_end":"{}","count_only":true}}"#,
            b64(prefix.as_bytes()),
            b64(&end)
        ))?;
        // etcd leaves `count` out when it is zero.
        v["count"].as_str().map_or(Ok(0), str::parse).ok()
    }

    /// A range request's answer from etcd's JSON gateway.
    fn range(&self, body: &str) -> Option<serde_json::Value> {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(("127.0.0.1", self.client_port)).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
        write!(
            s,
            "POST /v3/kv/range HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .ok()?;
        let mut answer = String::new();
        s.read_to_string(&mut answer).ok()?;
        let json = answer.split("\r\n\r\n").nth(1)?;
        serde_json::from_str(json).ok()
    }
}

impl Etcd {
    /// Key-value requests (reads, puts, deletes and transactions) this
    /// member has taken so far, from its own metrics.
    pub fn kv_requests(&self) -> u64 {
        use std::io::{Read, Write};
        let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", self.client_port)) else {
            return 0;
        };
        let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
        let _ = s.write_all(b"GET /metrics HTTP/1.0\r\n\r\n");
        let mut text = String::new();
        let _ = s.read_to_string(&mut text);
        text.lines()
            .filter(|l| l.starts_with("grpc_server_started_total{"))
            .filter(|l| l.contains("grpc_service=\"etcdserverpb.KV\""))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>() as u64
    }
}

/// A new random store key (`--store-key-file`) in `dir`.
pub fn store_key(dir: &std::path::Path) -> std::path::PathBuf {
    let key = dir.join("store.key");
    let secret: [u8; 32] = rand::random();
    std::fs::write(&key, hex::encode(secret)).expect("store key");
    key
}

/// `n` hub replicas (`r0`, `r1`, …) started at once on `etcd`'s empty
/// store, each with its own data dir, sharing one store key (and, with
/// `peers`, each with a peer port). Checks they agree on one CA and one
/// first admin token; returns them with that token.
pub async fn start_replicas(etcd: &Etcd, n: usize, peers: bool) -> (Vec<TestHub>, String) {
    start_replicas_on(&etcd.url(), n, peers).await
}

/// [`start_replicas`] on the etcd cluster at `store` (an `etcd://` URL).
pub async fn start_replicas_on(store: &str, n: usize, peers: bool) -> (Vec<TestHub>, String) {
    start_replicas_tuned(store, n, peers, |_, _| {}).await
}

/// [`start_replicas_on`], `tune` changing replica `i`'s configuration.
pub async fn start_replicas_tuned(
    store: &str,
    n: usize,
    peers: bool,
    tune: impl Fn(usize, &mut otter_hub::HubConfig),
) -> (Vec<TestHub>, String) {
    let dirs: Vec<_> = (0..n)
        .map(|_| std::sync::Arc::new(tempfile::tempdir().expect("data dir")))
        .collect();
    // Read by every replica at its start only.
    let key = store_key(dirs[0].path());
    let configs = dirs.iter().enumerate().map(|(i, dir)| {
        let mut config = replica_config(store, &key, dir.path(), i, peers);
        tune(i, &mut config);
        config
    });
    let started = futures::future::join_all(configs.map(otter_hub::Hub::start)).await;
    let hubs: Vec<otter_hub::Hub> = started
        .into_iter()
        .map(|h| h.expect("replica starts"))
        .collect();
    for h in &hubs[1..] {
        assert_eq!(h.ca_pem(), hubs[0].ca_pem(), "one CA");
    }
    let tokens: Vec<String> = dirs
        .iter()
        .filter_map(|d| std::fs::read_to_string(d.path().join("hub").join("admin-token")).ok())
        .collect();
    assert_eq!(tokens.len(), 1, "one first admin token, on one replica");
    let root = tokens[0].trim().to_owned();
    let hubs = hubs
        .into_iter()
        .zip(dirs)
        .map(|(hub, dir)| TestHub {
            hub,
            dir,
            admin_token: root.clone(),
        })
        .collect();
    (hubs, root)
}

/// The configuration of replica `r{i}` with its data under `dir`.
fn replica_config(
    store: &str,
    key: &std::path::Path,
    dir: &std::path::Path,
    i: usize,
    peers: bool,
) -> otter_hub::HubConfig {
    let mut c = otter_hub::HubConfig::new(dir.join("hub"));
    c.api_listen = "127.0.0.1:0".parse().expect("address");
    c.tunnel_listen = "127.0.0.1:0".parse().expect("address");
    c.keepalive = otter_tunnel::Keepalive::every(Duration::from_secs(1));
    c.drain_timeout = Duration::from_secs(2);
    c.store = Some(otter_hub::etcd::EtcdOptions::from_url(store).expect("store URL"));
    c.store_key_file = Some(key.to_owned());
    c.recheck_tokens_every = Duration::from_millis(300);
    c.replica = format!("r{i}");
    if peers {
        c.peer_listen = Some("127.0.0.1:0".parse().expect("address"));
    }
    c
}

/// Replica `r{i}` started later on the store the replicas of
/// [`start_replicas_on`] run on (`first` is the first of them, whose data
/// dir holds the store key).
pub async fn add_replica(store: &str, first: &TestHub, i: usize, peers: bool) -> TestHub {
    let dir = std::sync::Arc::new(tempfile::tempdir().expect("data dir"));
    let key = first.dir.path().join("store.key");
    let config = replica_config(store, &key, dir.path(), i, peers);
    TestHub {
        hub: otter_hub::Hub::start(config).await.expect("replica starts"),
        dir,
        admin_token: first.admin_token.clone(),
    }
}

/// The ports of a replica run as a process: API, tunnel, peer.
pub type ReplicaPorts = (u16, u16, u16);

/// A hub replica as a process on the etcd cluster at `store` (an
/// `etcd://` URL), sealed with `key`, its data in `dir/<name>` and its
/// ports on 127.0.0.1; `extra` arguments after those.
pub fn replica_proc(
    name: &str,
    dir: &std::path::Path,
    store: &str,
    key: &std::path::Path,
    (api, tunnel, peer): ReplicaPorts,
    extra: &[String],
) -> crate::procs::Proc {
    let mut args: Vec<String> = [
        "hub".to_owned(),
        "--data-dir".into(),
        dir.join(name).display().to_string(),
        "--store".into(),
        store.to_owned(),
        "--store-key-file".into(),
        key.display().to_string(),
        "--replica-name".into(),
        name.to_owned(),
        "--listen".into(),
        format!("127.0.0.1:{api}"),
        "--tunnel-listen".into(),
        format!("127.0.0.1:{tunnel}"),
        "--peer-listen".into(),
        format!("127.0.0.1:{peer}"),
    ]
    .to_vec();
    args.extend_from_slice(extra);
    crate::procs::Proc::start(name, crate::procs::Role::Otter, &args, dir, None)
}

/// Replica processes `r0`…, each on free loopback ports, with what a test
/// needs of them.
#[derive(Debug)]
pub struct ReplicaProcs {
    pub procs: Vec<crate::procs::Proc>,
    pub ports: Vec<ReplicaPorts>,
    /// The first admin token (one replica wrote it).
    pub token: String,
    /// The hub CA bundle.
    pub ca: String,
}

/// `n` replicas as processes ([`replica_proc`]) with `extra` arguments each,
/// returned once every API port accepts connections.
pub async fn replica_procs(
    dir: &std::path::Path,
    store: &str,
    key: &std::path::Path,
    n: usize,
    extra: &[String],
) -> ReplicaProcs {
    let ports: Vec<ReplicaPorts> = (0..n)
        .map(|_| (free_port(), free_port(), free_port()))
        .collect();
    let procs = (0..n)
        .map(|i| replica_proc(&format!("r{i}"), dir, store, key, ports[i], extra))
        .collect();
    for p in &ports {
        let addr = std::net::SocketAddr::from(([127, 0, 0, 1], p.0));
        let started = Instant::now();
        while tokio::net::TcpStream::connect(addr).await.is_err() {
            assert!(
                started.elapsed() < WAIT,
                "replica on port {} did not start",
                p.0
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let token = (0..n)
        .find_map(|i| std::fs::read_to_string(dir.join(format!("r{i}")).join("admin-token")).ok())
        .expect("an admin token")
        .trim()
        .to_owned();
    // Written once the ports are bound.
    let ca = crate::procs::read_when_whole(
        &dir.join("r0").join("ca.crt"),
        WAIT,
        crate::procs::whole_pem,
    )
    .expect("the CA bundle");
    ReplicaProcs {
        procs,
        ports,
        token,
        ca,
    }
}

/// A join token for `cluster` in the default tenant, written into the
/// store sealed with `key` as a replica would write it.
pub fn join_token_on(store: &str, key: &std::path::Path, cluster: &str) -> String {
    let opts = otter_hub::etcd::EtcdOptions::from_url(store).expect("store URL");
    let store = otter_hub::sealed::SealedStore::new(
        otter_hub::etcd::EtcdStore::connect(&opts).expect("store"),
        &otter_hub::sealed::read_key(key).expect("store key"),
    )
    .expect("sealed store");
    otter_hub::tenancy::claim_cluster(&store, cluster, "default")
        .expect("claim")
        .expect("an unclaimed name");
    otter_hub::tokens::mint_join_token(&store, cluster, "default", Duration::from_secs(600))
        .expect("join token")
}
