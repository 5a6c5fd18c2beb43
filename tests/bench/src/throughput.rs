//! Raw tunnel throughput: bytes from the hub side through one tunnel stream
//! to a TCP sink beside the agent, against direct loopback TCP and rathole.
//!
//! The hub side, the agent side and the sink each run on their own runtime
//! with named threads, so their CPU time is read apart from /proc.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::{Context, bail};
use otter_pki::{AgentIdentity, CertificateAuthority, csr, tls};
use otter_tunnel::{
    Acceptor, Opener,
    h2::{self, H2Settings},
    quic::{self, QuicSettings},
    transport::Accepted,
};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
    runtime::Runtime,
    sync::mpsc,
};
use tokio_util::sync::CancellationToken;

use crate::common::{Figure, Figures, cpu_secs, thread_cpu_secs};

/// Size of each write on the hub side.
const CHUNK: usize = 64 * 1024;
/// Measuring starts after this much warm-up.
const WARMUP: Duration = Duration::from_secs(1);

fn runtime(name: &str) -> anyhow::Result<Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name(name)
        .enable_all()
        .build()?)
}

/// Sleeps on `rt` (the caller is not inside a runtime).
fn sleep_on(rt: &Runtime, d: Duration) {
    rt.block_on(async { tokio::time::sleep(d).await });
}

struct Roles {
    hub: Runtime,
    agent: Runtime,
    sink: Runtime,
}

/// A TCP sink that discards what it reads and counts it.
async fn sink() -> anyhow::Result<(SocketAddr, Arc<AtomicU64>)> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let count = Arc::new(AtomicU64::new(0));
    let c = count.clone();
    tokio::spawn(async move {
        while let Ok((mut tcp, _)) = listener.accept().await {
            let c = c.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 256 * 1024];
                while let Ok(n) = tcp.read(&mut buf).await {
                    if n == 0 {
                        break;
                    }
                    c.fetch_add(n as u64, Ordering::Relaxed);
                }
            });
        }
    });
    Ok((addr, count))
}

/// Writes `CHUNK`s to `w` until `stop` is cancelled (bounded by `limit`).
async fn pump(mut w: impl tokio::io::AsyncWrite + Unpin, stop: CancellationToken, limit: Duration) {
    let buf = vec![0x5au8; CHUNK];
    let deadline = Instant::now() + limit;
    while !stop.is_cancelled() && Instant::now() < deadline {
        tokio::select! {
            r = w.write_all(&buf) => if r.is_err() { return },
            _ = stop.cancelled() => break,
        }
    }
    let _ = w.shutdown().await;
}

/// Measured rate and CPU per role of one run.
struct Sample {
    gbit: f64,
    hub_cpu_per_gb: Option<f64>,
    agent_cpu_per_gb: Option<f64>,
}

/// CPU readers for the two roles (threads of this process, or child processes).
type CpuReader = Box<dyn Fn() -> f64>;

/// Waits out the warm-up, then measures bytes at the sink and CPU of each
/// role over `secs`.
fn measure(
    ctl: &Runtime,
    count: &AtomicU64,
    secs: Duration,
    hub_cpu: &CpuReader,
    agent_cpu: &CpuReader,
) -> Sample {
    sleep_on(ctl, WARMUP);
    let (b0, h0, a0, t0) = (
        count.load(Ordering::Relaxed),
        hub_cpu(),
        agent_cpu(),
        Instant::now(),
    );
    sleep_on(ctl, secs);
    let (b1, h1, a1) = (count.load(Ordering::Relaxed), hub_cpu(), agent_cpu());
    let elapsed = t0.elapsed().as_secs_f64();
    let gb = (b1 - b0) as f64 / 1e9;
    let per_gb = |c: f64| if gb > 0.0 { Some(c / gb) } else { None };
    Sample {
        gbit: gb * 8.0 / elapsed,
        hub_cpu_per_gb: per_gb(h1 - h0),
        agent_cpu_per_gb: per_gb(a1 - a0),
    }
}

struct Pki {
    ca: CertificateAuthority,
    server: (String, String),
    client: (String, String),
}

fn pki() -> anyhow::Result<Pki> {
    let ca = CertificateAuthority::generate("bench CA")?;
    let server = ca.issue_server_cert(&["localhost".into(), "127.0.0.1".into()])?;
    let (key, csr) = csr::generate("bench", "agent-0")?;
    let id = AgentIdentity::new("bench", "agent-0")?;
    let cert = ca.sign_agent_csr(&csr, &id, Duration::from_secs(3600))?;
    Ok(Pki {
        ca,
        server,
        client: (cert.pem, key),
    })
}

/// Connects one tunnel of `kind`: the hub half on the hub runtime, the
/// agent half (which copies every stream to `sink_addr`) on the agent's.
fn tunnel(
    roles: &Roles,
    kind: &str,
    sink_addr: SocketAddr,
    stop: CancellationToken,
) -> anyhow::Result<Arc<dyn Opener>> {
    let p = pki()?;
    let client = |alpn: &[u8]| {
        tls::client_config(p.ca.cert_pem(), Some((&p.client.0, &p.client.1)), &[alpn])
    };
    let server = |alpn: &[u8]| {
        tls::server_config(
            &p.server.0,
            &p.server.1,
            p.ca.cert_pem(),
            tls::ClientAuth::Required,
            &[alpn],
        )
    };
    let (tx, mut rx) = mpsc::channel::<Accepted>(1);
    let any: SocketAddr = "127.0.0.1:0".parse()?;
    let hub_addr = if kind == "quic" {
        let server = server(quic::ALPN)?;
        let stop = stop.clone();
        roles.hub.block_on(roles.hub.spawn(async move {
            let endpoint = quic::hub_endpoint(any, server, &QuicSettings::default())?;
            let addr = endpoint.local_addr()?;
            tokio::spawn(quic::accept_loop(endpoint, tx, stop));
            anyhow::Ok(addr)
        }))??
    } else {
        // The TLS port serves HTTP/2 and WebSocket tunnels, told apart by ALPN.
        let server = Arc::new(tls::server_config(
            &p.server.0,
            &p.server.1,
            p.ca.cert_pem(),
            tls::ClientAuth::Required,
            &[h2::ALPN, otter_tunnel::ws::ALPN],
        )?);
        let stop = stop.clone();
        roles.hub.block_on(roles.hub.spawn(async move {
            let listener = TcpListener::bind(any).await?;
            let addr = listener.local_addr()?;
            tokio::spawn(h2::accept_loop(
                listener,
                server,
                H2Settings::default(),
                tx,
                stop,
            ));
            anyhow::Ok(addr)
        }))??
    };
    let client = client(match kind {
        "quic" => quic::ALPN,
        "ws" => otter_tunnel::ws::ALPN,
        _ => h2::ALPN,
    })?;
    let quic_kind = kind == "quic";
    let ws_kind = kind == "ws";
    roles.agent.spawn(async move {
        let acceptor: Box<dyn Acceptor> = if quic_kind {
            match quic::dial(hub_addr, "localhost", client, &QuicSettings::default()).await {
                Ok(a) => Box::new(a),
                Err(e) => return eprintln!("bench: QUIC dial failed: {e}"),
            }
        } else if ws_kind {
            let name = "localhost".try_into().expect("static name");
            match otter_tunnel::ws::dial(hub_addr, name, Arc::new(client), H2Settings::default())
                .await
            {
                Ok(a) => Box::new(a),
                Err(e) => return eprintln!("bench: WebSocket dial failed: {e}"),
            }
        } else {
            let name = "localhost".try_into().expect("static name");
            match h2::dial(hub_addr, name, Arc::new(client), H2Settings::default()).await {
                Ok(a) => Box::new(a),
                Err(e) => return eprintln!("bench: TLS dial failed: {e}"),
            }
        };
        agent_loop(acceptor, sink_addr, stop).await;
    });
    let accepted = roles
        .hub
        .block_on(async { tokio::time::timeout(Duration::from_secs(10), rx.recv()).await })
        .context("tunnel handshake timed out")?
        .context("tunnel accept loop ended")?;
    Ok(accepted.opener)
}

/// The agent side: every stream the hub opens is copied to the sink.
async fn agent_loop(
    mut acceptor: Box<dyn Acceptor>,
    sink_addr: SocketAddr,
    stop: CancellationToken,
) {
    loop {
        let next = tokio::select! {
            n = acceptor.accept() => n,
            _ = stop.cancelled() => return,
        };
        let Ok(Some(stream)) = next else { return };
        tokio::spawn(async move {
            let Ok(mut tcp) = TcpStream::connect(sink_addr).await else {
                return;
            };
            let _ = tcp.set_nodelay(true);
            // The same 64 KiB the hub side writes (tokio's copy reads 8 KiB).
            let mut recv = tokio::io::BufReader::with_capacity(CHUNK, stream.recv);
            let _ = tokio::io::copy_buf(&mut recv, &mut tcp).await;
        });
    }
}

/// One run over a library transport ("quic", "h2" or "ws").
fn run_transport(roles: &Roles, kind: &str, secs: Duration) -> anyhow::Result<Sample> {
    let stop = CancellationToken::new();
    let (sink_addr, count) = roles.sink.block_on(roles.sink.spawn(sink()))??;
    let opener = tunnel(roles, kind, sink_addr, stop.clone())?;
    let s = stop.clone();
    let limit = secs + WARMUP + Duration::from_secs(5);
    roles.hub.spawn(async move {
        match opener.open().await {
            Ok(stream) => pump(stream.send, s, limit).await,
            Err(e) => eprintln!("bench: open failed: {e}"),
        }
        // Keep the tunnel until the pump is done.
        drop(opener);
    });
    let hub: CpuReader = Box::new(|| thread_cpu_secs("bh-hub"));
    let agent: CpuReader = Box::new(|| thread_cpu_secs("bh-agent"));
    let sample = measure(&roles.sink, &count, secs, &hub, &agent);
    stop.cancel();
    sleep_on(&roles.sink, Duration::from_millis(300));
    Ok(sample)
}

/// Direct loopback TCP from the hub runtime to the sink.
fn run_direct(roles: &Roles, secs: Duration) -> anyhow::Result<Sample> {
    let stop = CancellationToken::new();
    let (sink_addr, count) = roles.sink.block_on(roles.sink.spawn(sink()))??;
    let s = stop.clone();
    let limit = secs + WARMUP + Duration::from_secs(5);
    roles.hub.spawn(async move {
        if let Ok(tcp) = TcpStream::connect(sink_addr).await {
            let _ = tcp.set_nodelay(true);
            pump(tcp, s, limit).await;
        }
    });
    let hub: CpuReader = Box::new(|| thread_cpu_secs("bh-hub"));
    let none: CpuReader = Box::new(|| 0.0);
    let mut sample = measure(&roles.sink, &count, secs, &hub, &none);
    sample.agent_cpu_per_gb = None;
    stop.cancel();
    sleep_on(&roles.sink, Duration::from_millis(300));
    Ok(sample)
}

// ---------------------------------------------------------------- rathole

/// A rathole server/client pair for one transport, killed on drop.
struct Rathole {
    server: Child,
    client: Child,
    entry: SocketAddr,
    _dir: tempfile::TempDir,
}

impl Drop for Rathole {
    fn drop(&mut self) {
        for c in [&mut self.server, &mut self.client] {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// Noise keys from `rathole --genkey` (private, public).
fn noise_keys(bin: &Path) -> anyhow::Result<(String, String)> {
    let out = Command::new(bin).arg("--genkey").output()?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let lines: Vec<&str> = text.lines().map(str::trim).collect();
    let after = |label: &str| {
        lines
            .iter()
            .position(|l| l.to_ascii_lowercase().starts_with(label))
            .and_then(|i| lines.get(i + 1))
            .map(|s| s.to_string())
    };
    match (after("private"), after("public")) {
        (Some(k), Some(p)) if !k.is_empty() && !p.is_empty() => Ok((k, p)),
        _ => bail!("could not read keys from `rathole --genkey`: {text}"),
    }
}

/// PKCS#12 identity for rathole's TLS server (through the openssl CLI) and
/// the CA file its client trusts.
fn tls_identity(dir: &Path) -> anyhow::Result<(PathBuf, PathBuf)> {
    let ca = CertificateAuthority::generate("bench rathole CA")?;
    let (cert, key) = ca.issue_server_cert(&["localhost".into()])?;
    let (c, k, ca_path, p12) = (
        dir.join("cert.pem"),
        dir.join("key.pem"),
        dir.join("ca.pem"),
        dir.join("identity.p12"),
    );
    std::fs::write(&c, cert)?;
    std::fs::write(&k, key)?;
    std::fs::write(&ca_path, ca.cert_pem())?;
    let status = Command::new("openssl")
        .args(["pkcs12", "-export", "-passout", "pass:bench", "-in"])
        .arg(&c)
        .arg("-inkey")
        .arg(&k)
        .arg("-out")
        .arg(&p12)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .context("openssl CLI")?;
    if !status.success() {
        bail!("openssl pkcs12 failed");
    }
    Ok((p12, ca_path))
}

fn start_rathole(bin: &Path, transport: &str, sink_addr: SocketAddr) -> anyhow::Result<Rathole> {
    let dir = tempfile::tempdir()?;
    let (control, entry) = (free_port()?, free_port()?);
    let (server_tx, client_tx) = match transport {
        "tcp" => (String::new(), String::new()),
        "tls" => {
            let (p12, ca) = tls_identity(dir.path())?;
            (
                format!(
                    "[server.transport]\ntype = \"tls\"\n[server.transport.tls]\npkcs12 = {:?}\npkcs12_password = \"bench\"\n",
                    p12.display().to_string()
                ),
                format!(
                    "[client.transport]\ntype = \"tls\"\n[client.transport.tls]\ntrusted_root = {:?}\nhostname = \"localhost\"\n",
                    ca.display().to_string()
                ),
            )
        }
        "noise" => {
            let (private, public) = noise_keys(bin)?;
            (
                format!(
                    "[server.transport]\ntype = \"noise\"\n[server.transport.noise]\nlocal_private_key = {private:?}\n"
                ),
                format!(
                    "[client.transport]\ntype = \"noise\"\n[client.transport.noise]\nremote_public_key = {public:?}\n"
                ),
            )
        }
        other => bail!("unknown rathole transport {other}"),
    };
    let server_toml = format!(
        "[server]\nbind_addr = \"127.0.0.1:{control}\"\ndefault_token = \"bench\"\n{server_tx}[server.services.bench]\nbind_addr = \"127.0.0.1:{entry}\"\nnodelay = true\n"
    );
    let client_toml = format!(
        "[client]\nremote_addr = \"127.0.0.1:{control}\"\ndefault_token = \"bench\"\n{client_tx}[client.services.bench]\nlocal_addr = \"{sink_addr}\"\nnodelay = true\n"
    );
    let (s, c) = (
        dir.path().join("server.toml"),
        dir.path().join("client.toml"),
    );
    std::fs::write(&s, server_toml)?;
    std::fs::write(&c, client_toml)?;
    let spawn = |flag: &str, cfg: &Path| {
        Command::new(bin)
            .arg(flag)
            .arg(cfg)
            .env("RUST_LOG", "error")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
    };
    let server = spawn("--server", &s)?;
    std::thread::sleep(Duration::from_millis(300));
    let client = spawn("--client", &c)?;
    Ok(Rathole {
        server,
        client,
        entry: SocketAddr::from(([127, 0, 0, 1], entry)),
        _dir: dir,
    })
}

fn run_rathole(
    roles: &Roles,
    bin: &Path,
    transport: &str,
    secs: Duration,
) -> anyhow::Result<Sample> {
    let (sink_addr, count) = roles.sink.block_on(roles.sink.spawn(sink()))??;
    let rathole = start_rathole(bin, transport, sink_addr)?;
    let stop = CancellationToken::new();
    let s = stop.clone();
    let entry = rathole.entry;
    let limit = secs + WARMUP + Duration::from_secs(15);
    let connected = Arc::new(AtomicU64::new(0));
    let flag = connected.clone();
    roles.hub.spawn(async move {
        // The entry port opens once the client has registered; retry bounded.
        for _ in 0..100 {
            if let Ok(tcp) = TcpStream::connect(entry).await {
                let _ = tcp.set_nodelay(true);
                flag.store(1, Ordering::SeqCst);
                return pump(tcp, s, limit).await;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    // Wait (bounded) for bytes to reach the sink before measuring.
    let begin = Instant::now();
    while count.load(Ordering::Relaxed) == 0 && begin.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(50));
    }
    if count.load(Ordering::Relaxed) == 0 {
        stop.cancel();
        bail!("no bytes reached the sink through rathole {transport}");
    }
    let (sp, cp) = (
        rathole.server.id().to_string(),
        rathole.client.id().to_string(),
    );
    let hub: CpuReader = Box::new(move || cpu_secs(&sp).unwrap_or(0.0));
    let agent: CpuReader = Box::new(move || cpu_secs(&cp).unwrap_or(0.0));
    let sample = measure(&roles.sink, &count, secs, &hub, &agent);
    stop.cancel();
    sleep_on(&roles.sink, Duration::from_millis(300));
    drop(rathole);
    Ok(sample)
}

// ---------------------------------------------------------------- driver

pub fn run(secs: Duration, runs: usize, rathole: Option<PathBuf>) -> anyhow::Result<Figures> {
    tls::install_default_provider();
    let roles = Roles {
        hub: runtime("bh-hub")?,
        agent: runtime("bh-agent")?,
        sink: runtime("bh-sink")?,
    };
    let mut figs = Figures::default();
    let base = Some("throughput.rathole-tls");
    let mut rathole_ok = rathole.is_some();
    let mut rathole_tls_ok = true;
    for run in 0..runs {
        eprintln!("bench: throughput run {}/{runs}", run + 1);
        // OTTER_BENCH_ONLY=quic (or h2) runs just that transport, for profiling.
        if let Ok(only) = std::env::var("OTTER_BENCH_ONLY") {
            let r = run_transport(&roles, &only, secs)?;
            figs.add(&format!("throughput.{only}"), "Gbit/s", None, r.gbit);
            for (role, c) in [("hub", r.hub_cpu_per_gb), ("agent", r.agent_cpu_per_gb)] {
                if let Some(c) = c {
                    figs.add(&format!("cpu-{role}.{only}"), "CPU s/GB", None, c);
                }
            }
            continue;
        }
        let mut rows: Vec<(&str, anyhow::Result<Sample>)> = vec![
            ("direct-tcp", run_direct(&roles, secs)),
            ("quic", run_transport(&roles, "quic", secs)),
            ("h2", run_transport(&roles, "h2", secs)),
            ("ws", run_transport(&roles, "ws", secs)),
        ];
        if let (true, Some(bin)) = (rathole_ok, rathole.as_deref()) {
            for t in ["tcp", "tls", "noise"] {
                if t == "tls" && !rathole_tls_ok {
                    continue;
                }
                let r = run_rathole(&roles, bin, t, secs);
                if let Err(e) = &r {
                    eprintln!("bench: rathole {t}: {e:#}");
                    if t == "tls" {
                        rathole_tls_ok = false;
                    }
                }
                rows.push((
                    match t {
                        "tcp" => "rathole-tcp",
                        "tls" => "rathole-tls",
                        _ => "rathole-noise",
                    },
                    r,
                ));
            }
            if rows.iter().skip(3).all(|(_, r)| r.is_err()) {
                rathole_ok = false;
            }
        }
        for (name, r) in rows {
            match r {
                Ok(s) => {
                    figs.add(&format!("throughput.{name}"), "Gbit/s", base, s.gbit);
                    if let Some(c) = s.hub_cpu_per_gb {
                        let b = Some("cpu-hub.rathole-tls");
                        figs.add(&format!("cpu-hub.{name}"), "CPU s/GB", b, c);
                    }
                    if let Some(c) = s.agent_cpu_per_gb {
                        let b = Some("cpu-agent.rathole-tls");
                        figs.add(&format!("cpu-agent.{name}"), "CPU s/GB", b, c);
                    }
                }
                Err(e) => eprintln!("bench: throughput {name} failed: {e:#}"),
            }
        }
    }
    figs.note(
        "cpu-hub.direct-tcp",
        "the writer alone (no tunnel): the cost of producing the bytes",
    );
    if rathole.is_none() {
        figs.push(Figure::skipped(
            "throughput.rathole-*",
            "rathole not installed (cargo install rathole failed or was skipped)",
        ));
    } else if !rathole_tls_ok {
        figs.push(Figure::skipped(
            "throughput.rathole-tls",
            "rathole TLS could not run (PKCS#12 identity or TLS support missing)",
        ));
    }
    Ok(figs)
}
