//! Agents behind an HTTP CONNECT proxy (tinyproxy, started here on
//! loopback): QUIC is skipped with the reason said, HTTP/2 and WebSocket go
//! through the proxy, and proxy credentials are used and checked.

use std::{sync::Arc, time::Duration};

use otter_e2e::{
    TestHub,
    double::{WAIT, field, get, start_agent_with, wait_connected},
    tool_missing, with_token,
};
use otter_proto::resource::v1::resource_service_client::ResourceServiceClient;
use otter_tunnel::TransportKind;

/// A server process of the test on a loopback port (with its folder);
/// killed when dropped.
struct Daemon {
    child: std::process::Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A free loopback port.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Starts `cmd` and waits (bounded) until it listens on `port`.
fn daemon(mut cmd: std::process::Command, port: u16, dir: tempfile::TempDir) -> Daemon {
    let child = cmd
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let d = Daemon {
        child,
        port,
        _dir: dir,
    };
    for _ in 0..100 {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return d;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("{cmd:?} did not start listening on port {port}");
}

/// A tinyproxy on a free loopback port.
type Tinyproxy = Daemon;

fn tinyproxy(auth: Option<(&str, &str)>) -> Option<Tinyproxy> {
    let bin = std::path::Path::new("/usr/bin/tinyproxy");
    if !bin.exists() {
        tool_missing("tinyproxy (scripts/setup.sh installs it)");
        return None;
    }
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let log = dir.path().join("tinyproxy.log");
    let mut conf = format!(
        "Port {port}\nListen 127.0.0.1\nAllow 127.0.0.1\nTimeout 60\nMaxClients 50\nLogLevel Info\nLogFile \"{}\"\nPidFile \"{}\"\n",
        log.display(),
        dir.path().join("pid").display()
    );
    if let Some((u, p)) = auth {
        conf.push_str(&format!("BasicAuth {u} {p}\n"));
    }
    let conf_path = dir.path().join("tinyproxy.conf");
    std::fs::write(&conf_path, conf).unwrap();
    let mut cmd = std::process::Command::new(bin);
    cmd.arg("-d").arg("-c").arg(&conf_path);
    Some(daemon(cmd, port, dir))
}

fn proxy(url: &str) -> otter_tunnel::proxy::Proxy {
    otter_tunnel::proxy::Proxy::new(url::Url::parse(url).unwrap(), "").unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tunnels_through_a_connect_proxy() {
    let Some(tp) = tinyproxy(None) else { return };
    let hub = TestHub::start().await;
    let token = hub.hub.mint_join_token("edge-1").unwrap();
    let url = format!("http://127.0.0.1:{}", tp.port);
    let agent = start_agent_with(&hub, "edge-1", "a1", &token, TransportKind::Quic, |c| {
        c.transports = vec![TransportKind::Quic, TransportKind::H2, TransportKind::Ws];
        c.proxy = Some(proxy(&url));
    });
    let s = agent
        .agent
        .wait_for(WAIT, |s| s.connected.is_some())
        .await
        .expect("connects through the proxy");
    assert_eq!(s.connected, Some(TransportKind::H2));
    let quic = &s.attempts[0];
    assert_eq!(quic.0, TransportKind::Quic);
    assert!(
        quic.1.as_ref().unwrap_err().contains("QUIC skipped"),
        "{:?}",
        s.attempts
    );
    let channel = hub.channel().await;
    wait_connected(&channel, &hub.admin_token, 1).await;
    let r = ResourceServiceClient::new(channel.clone())
        .get(with_token(get("edge-1", "via-proxy"), &hub.admin_token))
        .await
        .unwrap();
    assert_eq!(field(r.get_ref(), "name"), "via-proxy");

    // The agent's own account of how it got through shows in ListLinks.
    let mut links =
        otter_proto::link::v1::link_service_client::LinkServiceClient::new(channel.clone());
    let mut diag = None;
    for _ in 0..100 {
        let l = links
            .list_links(with_token(
                otter_proto::link::v1::ListLinksRequest {},
                &hub.admin_token,
            ))
            .await
            .unwrap()
            .into_inner()
            .links
            .remove(0);
        // The round-trip time comes with the first keepalive answer.
        if l.diagnosis
            .as_ref()
            .is_some_and(|d| !d.attempts.is_empty() && d.rtt_micros.is_some())
        {
            diag = l.diagnosis;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let diag = diag.expect("diagnosis reported");
    assert_eq!(
        diag.proxy.as_deref(),
        Some(format!("{url}/").as_str()),
        "proxy without credentials"
    );
    assert_eq!(diag.attempts[0].transport.as_deref(), Some("quic"));
    assert_eq!(diag.attempts[0].ok, Some(false));
    assert!(
        diag.attempts[0]
            .error
            .as_deref()
            .unwrap_or("")
            .contains("QUIC skipped")
    );
    assert_eq!(diag.attempts[1].transport.as_deref(), Some("h2"));
    assert_eq!(diag.attempts[1].ok, Some(true));
    assert!(diag.rtt_micros.is_some(), "round-trip time measured");
    agent.agent.shutdown().await;

    // The WebSocket transport through the same proxy.
    let token = hub.hub.mint_join_token("edge-2").unwrap();
    let ws = start_agent_with(&hub, "edge-2", "a2", &token, TransportKind::Ws, |c| {
        c.proxy = Some(proxy(&url))
    });
    let s = ws
        .agent
        .wait_for(WAIT, |s| s.connected.is_some())
        .await
        .expect("WebSocket through the proxy");
    assert_eq!(s.connected, Some(TransportKind::Ws));
    ws.agent.shutdown().await;
    hub.hub.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_credentials_are_sent_and_checked() {
    let Some(tp) = tinyproxy(Some(("otter", "s3cret"))) else {
        return;
    };
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let hub = TestHub::start_with(dir, None, |_| {}).await;
    let token = hub.hub.mint_join_token("edge-1").unwrap();
    // An agent of its own: its Register goes straight to the hub and spends
    // its join token even though its tunnel cannot pass the proxy.
    let wrong_token = hub.hub.mint_join_token("edge-0").unwrap();
    let wrong = start_agent_with(&hub, "edge-0", "a0", &wrong_token, TransportKind::H2, |c| {
        c.proxy = Some(proxy(&format!("http://otter:nope@127.0.0.1:{}", tp.port)));
    });
    let s = wrong
        .agent
        .wait_for(WAIT, |s| !s.attempts.is_empty())
        .await
        .expect("an attempt");
    assert!(s.connected.is_none());
    let err = s.attempts[0].1.as_ref().unwrap_err();
    // tinyproxy answers 401 where the RFC says 407; both mean the same here.
    assert!(err.contains("401") || err.contains("407"), "{err}");
    assert!(
        err.contains("proxy credentials"),
        "says what is wrong: {err}"
    );
    assert!(
        !err.contains("nope"),
        "the password stays out of messages: {err}"
    );
    wrong.agent.shutdown().await;
    let right = start_agent_with(&hub, "edge-1", "a1", &token, TransportKind::H2, |c| {
        c.proxy = Some(proxy(&format!("http://otter:s3cret@127.0.0.1:{}", tp.port)));
    });
    let s = right
        .agent
        .wait_for(WAIT, |s| s.connected.is_some())
        .await
        .expect("connects with credentials");
    assert_eq!(s.connected, Some(TransportKind::H2));
    right.agent.shutdown().await;
    hub.hub.shutdown().await;
}

/// stunnel (Debian's) terminating TLS in front of a tinyproxy: together an
/// `https://` CONNECT proxy.
struct TlsProxy {
    stunnel: Daemon,
    ca_pem: String,
    _inner: Tinyproxy,
}

fn tls_proxy(auth: Option<(&str, &str)>) -> Option<TlsProxy> {
    let bin = std::path::Path::new("/usr/bin/stunnel4");
    if !bin.exists() {
        tool_missing("stunnel4 (scripts/setup.sh installs it)");
        return None;
    }
    let inner = tinyproxy(auth)?;
    let dir = tempfile::tempdir().unwrap();
    // The proxy's own certificate, from a CA only the agent is told about.
    let ca = otter_pki::CertificateAuthority::generate("proxy test CA").unwrap();
    let (cert, key) = ca.issue_server_cert(&["localhost".into()]).unwrap();
    std::fs::write(dir.path().join("proxy.crt"), cert).unwrap();
    std::fs::write(dir.path().join("proxy.key"), key).unwrap();
    let port = free_port();
    let conf = format!(
        "foreground = yes\npid =\nsyslog = no\noutput = {d}/stunnel.log\n[proxy]\naccept = 127.0.0.1:{port}\nconnect = 127.0.0.1:{inner}\ncert = {d}/proxy.crt\nkey = {d}/proxy.key\n",
        d = dir.path().display(),
        inner = inner.port,
    );
    let conf_path = dir.path().join("stunnel.conf");
    std::fs::write(&conf_path, conf).unwrap();
    let mut cmd = std::process::Command::new(bin);
    cmd.arg(&conf_path);
    Some(TlsProxy {
        stunnel: daemon(cmd, port, dir),
        ca_pem: ca.cert_pem().to_owned(),
        _inner: inner,
    })
}

fn https_proxy(url: &str, ca_pem: &str) -> otter_tunnel::proxy::Proxy {
    otter_pki::tls::install_default_provider();
    let tls = otter_pki::tls::public_client_config(Some(ca_pem), &[]).unwrap();
    proxy(url).with_tls(Arc::new(tls))
}

/// An `https://` proxy: TLS to the proxy (verified against its CA), CONNECT
/// with credentials inside that, then the hub's TLS inside the tunnel, for
/// both TCP transports; a proxy certificate the agent cannot verify is
/// refused with a message that says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tunnels_through_an_https_proxy() {
    let Some(tp) = tls_proxy(Some(("otter", "s3cret"))) else {
        return;
    };
    let hub = TestHub::start().await;
    let url = format!("https://otter:s3cret@localhost:{}", tp.stunnel.port);
    let token = hub.hub.mint_join_token("edge-1").unwrap();
    let agent = start_agent_with(&hub, "edge-1", "a1", &token, TransportKind::Quic, |c| {
        c.transports = vec![TransportKind::Quic, TransportKind::H2, TransportKind::Ws];
        c.proxy = Some(https_proxy(&url, &tp.ca_pem));
    });
    let s = agent
        .agent
        .wait_for(WAIT, |s| s.connected.is_some())
        .await
        .expect("connects through the https proxy");
    assert_eq!(s.connected, Some(TransportKind::H2));
    let channel = hub.channel().await;
    wait_connected(&channel, &hub.admin_token, 1).await;
    let r = ResourceServiceClient::new(channel.clone())
        .get(with_token(get("edge-1", "via-tls-proxy"), &hub.admin_token))
        .await
        .unwrap();
    assert_eq!(field(r.get_ref(), "name"), "via-tls-proxy");
    agent.agent.shutdown().await;

    let token = hub.hub.mint_join_token("edge-2").unwrap();
    let ws = start_agent_with(&hub, "edge-2", "a2", &token, TransportKind::Ws, |c| {
        c.proxy = Some(https_proxy(&url, &tp.ca_pem));
    });
    let s = ws
        .agent
        .wait_for(WAIT, |s| s.connected.is_some())
        .await
        .expect("WebSocket through the https proxy");
    assert_eq!(s.connected, Some(TransportKind::Ws));
    ws.agent.shutdown().await;

    // Trusting only the public roots, the proxy's certificate fails.
    let token = hub.hub.mint_join_token("edge-3").unwrap();
    let untrusted = start_agent_with(&hub, "edge-3", "a3", &token, TransportKind::H2, |c| {
        let tls = otter_pki::tls::public_client_config(None, &[]).unwrap();
        c.proxy = Some(proxy(&url).with_tls(Arc::new(tls)));
    });
    let s = untrusted
        .agent
        .wait_for(WAIT, |s| !s.attempts.is_empty())
        .await
        .expect("an attempt");
    assert!(s.connected.is_none());
    let err = s.attempts[0].1.as_ref().unwrap_err();
    assert!(
        err.contains("TLS to proxy") && err.contains("certificate"),
        "says what is wrong: {err}"
    );
    assert!(!err.contains("s3cret"), "no credentials in messages: {err}");
    untrusted.agent.shutdown().await;
    hub.hub.shutdown().await;
}
