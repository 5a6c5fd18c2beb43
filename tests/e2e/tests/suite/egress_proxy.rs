//! Agents behind an HTTP CONNECT proxy (tinyproxy, started here on
//! loopback): QUIC is skipped with the reason said, HTTP/2 and WebSocket go
//! through the proxy, and proxy credentials are used and checked.

use std::{sync::Arc, time::Duration};

use otter_e2e::{
    TestHub,
    double::{WAIT, field, get, start_agent_with, wait_connected},
    tool_missing,
    tools::{Daemon, daemon, free_port},
    with_token,
};
use otter_proto::resource::v1::resource_service_client::ResourceServiceClient;
use otter_tunnel::TransportKind;

/// A tinyproxy on a free loopback port.
type Tinyproxy = Daemon;

fn tinyproxy(auth: Option<(&str, &str)>) -> Option<Tinyproxy> {
    tinyproxy_to(auth, &[])
}

/// A tinyproxy that lets CONNECT through to `ports` only (any port when
/// empty), as a site's egress proxy that opened one port for the agent.
fn tinyproxy_to(auth: Option<(&str, &str)>, ports: &[u16]) -> Option<Tinyproxy> {
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
    for port in ports {
        conf.push_str(&format!("ConnectPort {port}\n"));
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
    let mut diag = None;
    for _ in 0..100 {
        let l = otter_e2e::double::link_of(&channel, &hub.admin_token, "edge-1").await;
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

/// The agent names who ended its tunnel: a proxy that went away (killed
/// with the tunnel's connection open) is the proxy, even though the TCP
/// connection looks the same as one the hub closed; a hub that closes
/// tunnels (a deleted link, its own stop) says goodbye first, over HTTP/2,
/// WebSocket and QUIC, and is named with its reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_names_who_ended_its_tunnel() {
    use otter_agent::ended::EndedBy;
    let Some(tp) = tinyproxy(None) else { return };
    let hub = TestHub::start().await;
    let via = format!("http://127.0.0.1:{}", tp.port);
    let mut agents = Vec::new();
    for (i, kind, proxied) in [
        (0, TransportKind::H2, true),
        (1, TransportKind::H2, false),
        (2, TransportKind::Ws, false),
        (3, TransportKind::Quic, false),
        (4, TransportKind::Quic, false),
    ] {
        let cluster = format!("edge-{i}");
        let token = hub.hub.mint_join_token(&cluster).unwrap();
        let agent = start_agent_with(&hub, &cluster, "a", &token, kind, |c| {
            if proxied {
                c.proxy = Some(proxy(&via));
            }
        });
        agent
            .agent
            .wait_for(WAIT, |s| s.connected.is_some())
            .await
            .expect("connects");
        agents.push(agent);
    }
    let ended = |i: usize| {
        let agent = &agents[i].agent;
        async move {
            agent
                .wait_for(WAIT, |s| s.last_tunnel_end.is_some())
                .await
                .and_then(|s| s.last_tunnel_end)
                .expect("the tunnel ended")
        }
    };

    // The proxy goes away.
    drop(tp);
    let e = ended(0).await;
    assert_eq!(e.by, EndedBy::Proxy, "{e}");
    assert!(e.why.contains(&via), "{e}");

    // The hub deletes a link: the goodbye carries the reason.
    for cluster in ["edge-1", "edge-3"] {
        let (code, body) = otter_e2e::admin_call(
            hub.hub.api_addr,
            hub.hub.ca_pem(),
            &hub.admin_token,
            http::Method::DELETE,
            &format!("/admin/v1/links/{cluster}"),
            None,
        )
        .await;
        assert_eq!(code, 200, "{body}");
    }
    for i in [1, 3] {
        let e = ended(i).await;
        assert_eq!(e.by, EndedBy::Hub, "{e}");
        assert_eq!(e.why, "the link was deleted");
    }

    // The hub stops.
    hub.hub.shutdown().await;
    for i in [2, 4] {
        let e = ended(i).await;
        assert_eq!(e.by, EndedBy::Hub, "{e}");
        assert_eq!(e.why, "hub shutting down");
    }
    for a in agents {
        a.agent.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_credentials_are_sent_and_checked() {
    let Some(tp) = tinyproxy(Some(("otter", "s3cret"))) else {
        return;
    };
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let hub = TestHub::start_with(dir, None, |_| {}).await;
    let token = hub.hub.mint_join_token("edge-1").unwrap();
    // Register takes the proxy too: refused there, it spends no token.
    let wrong = start_agent_with(&hub, "edge-1", "a1", &token, TransportKind::H2, |c| {
        c.proxy = Some(proxy(&format!("http://otter:nope@127.0.0.1:{}", tp.port)));
    });
    let s = wrong
        .agent
        .wait_for(WAIT, |s| !s.last_error.is_empty())
        .await
        .expect("an attempt");
    assert!(s.connected.is_none());
    assert_eq!(s.registrations, 0);
    let err = &s.last_error;
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
    // Register takes the proxy too, so that is where it fails.
    let s = untrusted
        .agent
        .wait_for(WAIT, |s| !s.last_error.is_empty())
        .await
        .expect("an attempt");
    assert!(s.connected.is_none());
    assert_eq!(s.registrations, 0);
    let err = &s.last_error;
    assert!(
        err.contains("TLS to proxy") && err.contains("certificate"),
        "says what is wrong: {err}"
    );
    assert!(!err.contains("s3cret"), "no credentials in messages: {err}");
    untrusted.agent.shutdown().await;
    hub.hub.shutdown().await;
}

/// Calls edge-1's agent `a1` every 250 ms until it has renewed `n` times
/// (40 s at most): every call is answered across the renewals.
async fn calls_until_renewed(hub: &TestHub, agent: &otter_e2e::double::TestAgent, n: u32) {
    let mut resources = ResourceServiceClient::new(hub.channel().await);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(40);
    while agent.agent.status().renewals < n {
        assert!(
            tokio::time::Instant::now() < deadline,
            "renewals: {:?}",
            agent.agent.status()
        );
        let r = resources
            .get(with_token(get("edge-1", "x"), &hub.admin_token))
            .await
            .expect("calls keep flowing across renewals");
        assert_eq!(field(r.get_ref(), "agent"), "a1");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// The lines of tinyproxy's log that open a tunnel to `port`.
fn connects_to(tp: &Tinyproxy, port: u16) -> usize {
    let log = std::fs::read_to_string(tp.dir().join("tinyproxy.log")).unwrap_or_default();
    log.lines()
        .filter(|l| l.contains("CONNECT") && l.contains(&format!(":{port} ")))
        .count()
}

/// Register and every renewal take the proxy too, not only the tunnel: an
/// agent whose way out is an authenticating proxy joins, renews (a 60 s
/// certificate renewed every 6 s here) and keeps serving calls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn register_and_renewals_go_through_the_proxy() {
    let Some(tp) = tinyproxy(Some(("otter", "s3cret"))) else {
        return;
    };
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let hub = TestHub::start_with(dir, None, |c| {
        c.agent_cert_lifetime = Duration::from_secs(60);
    })
    .await;
    let api_port = hub.hub.api_addr.port();
    let token = hub.hub.mint_join_token("edge-1").unwrap();
    let agent = start_agent_with(&hub, "edge-1", "a1", &token, TransportKind::H2, |c| {
        c.proxy = Some(proxy(&format!("http://otter:s3cret@127.0.0.1:{}", tp.port)));
        c.renew_at = 0.1;
    });
    agent
        .agent
        .wait_for(WAIT, |s| s.connected.is_some())
        .await
        .expect("joins through the proxy");
    assert!(
        connects_to(&tp, api_port) >= 1,
        "Register went through the proxy"
    );
    calls_until_renewed(&hub, &agent, 3).await;
    // Each renewal was a connection through the proxy, to the tunnel
    // port (the first try; the API port is the fallback).
    let tunnel_port = hub.hub.tunnel_addr.port();
    assert!(
        connects_to(&tp, tunnel_port) > 3,
        "renewals went through the proxy"
    );
    let status = agent.agent.status();
    assert_eq!(status.registrations, 1);
    assert_eq!(
        status.renewals_on_tunnel_port, status.renewals,
        "{status:?}"
    );
    agent.agent.shutdown().await;
    hub.hub.shutdown().await;
}

/// An agent process whose only proxy setting is `HTTPS_PROXY` in its
/// environment (as clusters inject it into every pod), with credentials:
/// it starts, joins and tunnels through the proxy, and its Kubernetes
/// client reaches the apiserver through it too unless `NO_PROXY` exempts
/// the apiserver. The password shows in none of its output.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_proxy_from_the_environment_is_honoured() {
    use otter_e2e::procs::{Proc, Role};
    let Some(tp) = tinyproxy(Some(("otter", "s3cret"))) else {
        return;
    };
    let hub = TestHub::start().await;
    let sim = kube_sim::KubeSim::start(otter_e2e::kube::sim_config())
        .await
        .unwrap();
    assert!(sim.url().starts_with("https://127.0.0.1:"), "{}", sim.url());
    let sim_port = sim.addr().port();
    let work = tempfile::tempdir().unwrap();
    let kubeconfig = work.path().join("kubeconfig");
    std::fs::write(&kubeconfig, sim.kubeconfig_yaml(kube_sim::ADMIN_TOKEN)).unwrap();
    let ca = work.path().join("hub-ca.crt");
    std::fs::write(&ca, hub.hub.ca_pem()).unwrap();
    let https_proxy = format!("http://otter:s3cret@127.0.0.1:{}", tp.port);
    let channel = hub.channel().await;
    let mut agents = Vec::new();
    // NO_PROXY empty; naming the apiserver; naming the hub.
    for (i, no_proxy) in ["", "127.0.0.1", "localhost"].into_iter().enumerate() {
        let cluster = format!("edge-{i}");
        let token_file = work.path().join(format!("token-{i}"));
        std::fs::write(&token_file, hub.hub.mint_join_token(&cluster).unwrap()).unwrap();
        let sim_connects = connects_to(&tp, sim_port);
        let (api, tunnel) = (hub.hub.api_addr.port(), hub.hub.tunnel_addr.port());
        let hub_before = (connects_to(&tp, api), connects_to(&tp, tunnel));
        let agent = Proc::start_env(
            &format!("agent-{i}"),
            Role::Agent,
            &[
                "--hub-url".into(),
                hub.api_url().to_string(),
                "--cluster".into(),
                cluster.clone(),
                "--agent-id".into(),
                "a".into(),
                "--hub-ca-file".into(),
                ca.display().to_string(),
                "--join-token-file".into(),
                token_file.display().to_string(),
                "--kubeconfig".into(),
                kubeconfig.display().to_string(),
                "--transports".into(),
                "quic,h2".into(),
            ],
            work.path(),
            None,
            &[
                ("HTTPS_PROXY", https_proxy.as_str()),
                ("NO_PROXY", no_proxy),
                ("RUST_LOG", "info"),
            ],
        );
        wait_connected(&channel, &hub.admin_token, i + 1).await;
        // A call the agent serves from the cluster.
        let r = ResourceServiceClient::new(channel.clone())
            .get(with_token(
                otter_proto::resource::v1::GetRequest {
                    cluster: Some(cluster.clone()),
                    version: Some("v1".into()),
                    resource: Some("namespaces".into()),
                    name: Some("default".into()),
                    ..Default::default()
                },
                &hub.admin_token,
            ))
            .await;
        assert!(r.is_ok(), "{r:?}\n{}", agent.tail(30));
        let hub_direct = no_proxy == "localhost";
        let hub_connects = (connects_to(&tp, api), connects_to(&tp, tunnel));
        if hub_direct {
            assert_eq!(hub_connects, hub_before, "NO_PROXY exempts the hub");
        } else {
            assert!(
                hub_connects.0 > hub_before.0 && hub_connects.1 > hub_before.1,
                "Register and the tunnel through the proxy: {hub_before:?} -> {hub_connects:?}"
            );
        }
        let through = connects_to(&tp, sim_port) > sim_connects;
        assert_eq!(
            through,
            no_proxy != "127.0.0.1",
            "the apiserver through the proxy unless NO_PROXY exempts it"
        );
        // What `otter links -o wide` shows: the route the tunnel took.
        let deadline = tokio::time::Instant::now() + WAIT;
        let route = loop {
            let link = otter_e2e::double::link_of(&channel, &hub.admin_token, &cluster).await;
            if let Some(d) = link.diagnosis.filter(|d| !d.attempts.is_empty()) {
                break d.proxy;
            }
            assert!(tokio::time::Instant::now() < deadline, "no diagnosis");
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        assert_eq!(
            route,
            (!hub_direct).then(|| format!("http://127.0.0.1:{}/", tp.port)),
            "the proxy shown is the one the tunnel took"
        );
        let output = format!("{}{}", agent.stdout(), agent.stderr());
        assert!(!output.contains("s3cret"), "the password leaked:\n{output}");
        agents.push(agent);
    }
    drop(agents);
    sim.shutdown().await;
    hub.hub.shutdown().await;
}

/// After enrollment the tunnel port is the one way out an agent needs.
/// Behind a proxy that lets CONNECT through to the tunnel port only, an
/// agent on its kept identity renews there (a 60 s certificate, renewed
/// every 6 s), keeps serving calls and never needs the API port.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewals_take_the_tunnel_port_when_it_is_the_only_way_out() {
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let hub = TestHub::start_with(dir, None, |c| {
        c.agent_cert_lifetime = Duration::from_secs(60);
    })
    .await;
    let (api_port, tunnel_port) = (hub.hub.api_addr.port(), hub.hub.tunnel_addr.port());
    let Some(tp) = tinyproxy_to(None, &[tunnel_port]) else {
        return;
    };
    // Enrolled where the API port was reachable; the identity is kept.
    let state = tempfile::tempdir().unwrap();
    let keep = || {
        Some(otter_agent::identity::IdentityStore::Dir(
            state.path().to_owned(),
        ))
    };
    let token = hub.hub.mint_join_token("edge-1").unwrap();
    let first = start_agent_with(&hub, "edge-1", "a1", &token, TransportKind::H2, |c| {
        c.state = keep();
    });
    first
        .agent
        .wait_for(WAIT, |s| s.connected.is_some())
        .await
        .expect("enrolls directly");
    first.agent.shutdown().await;

    // Moved behind the proxy: no token, its kept identity only.
    let agent = start_agent_with(&hub, "edge-1", "a1", "", TransportKind::H2, |c| {
        c.state = keep();
        c.proxy = Some(proxy(&format!("http://127.0.0.1:{}", tp.port)));
        c.renew_at = 0.1;
    });
    agent
        .agent
        .wait_for(WAIT, |s| s.connected.is_some())
        .await
        .expect("tunnels through the proxy");
    calls_until_renewed(&hub, &agent, 3).await;
    let status = agent.agent.status();
    assert_eq!(
        status.renewals_on_tunnel_port, status.renewals,
        "{status:?}"
    );
    assert_eq!(status.renewal_failures, 0, "{status:?}");
    assert_eq!(status.registrations, 0, "{status:?}");
    assert!(
        connects_to(&tp, tunnel_port) > 3,
        "renewals went through the proxy"
    );
    assert_eq!(
        connects_to(&tp, api_port),
        0,
        "nothing asked for the API port"
    );
    eprintln!(
        "tunnel-port-only proxy: {} renewals, all on the tunnel port; 0 connections to the API port",
        status.renewals
    );
    agent.agent.shutdown().await;
    hub.hub.shutdown().await;
}

/// `otter-agent doctor` as a process, the way it runs in the agent's pod,
/// with the site's proxy in `HTTPS_PROXY`: with the proxy's credentials
/// CONNECT works and the TCP checks pass through it; with a wrong password
/// the checks that need the proxy fail and say the proxy refused the
/// credentials. The password shows nowhere in the output.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_doctor_process_checks_connect_through_the_proxy() {
    use otter_e2e::{
        netns::strings,
        procs::{Proc, Role},
    };
    let Some(tp) = tinyproxy(Some(("agent", "s3cret"))) else {
        return;
    };
    let hub = TestHub::start().await;
    let dir = tempfile::tempdir().unwrap();
    // Enrolled once (its identity kept, with the hub's tunnel URLs), as an
    // agent whose tunnel later stopped coming up.
    let state = dir.path().join("state");
    otter_e2e::double::enrolled_once(&hub, "edge-1", "a1", &state).await;
    let token = dir.path().join("token");
    std::fs::write(&token, hub.hub.mint_join_token("edge-1").unwrap()).unwrap();
    let ca = dir.path().join("hub-ca.crt");
    std::fs::write(&ca, hub.hub.ca_pem()).unwrap();
    let args = strings(&[
        "--hub-url",
        hub.api_url().as_str(),
        "--cluster",
        "edge-1",
        "--agent-id",
        "a1",
        "--hub-ca-file",
        &ca.display().to_string(),
        "--join-token-file",
        &token.display().to_string(),
        "--state-dir",
        &state.display().to_string(),
        "--transports",
        "quic,h2",
        "doctor",
    ]);
    let run = |name: &str, password: &str| {
        let proxy = format!("http://agent:{password}@127.0.0.1:{}", tp.port);
        let env = [
            ("HTTPS_PROXY", proxy.as_str()),
            ("NO_PROXY", ""),
            ("no_proxy", ""),
        ];
        let mut p = Proc::start_env(name, Role::Agent, &args, dir.path(), None, &env);
        let code = tokio::task::block_in_place(|| p.wait(Duration::from_secs(60)));
        (code, p.stdout())
    };
    let line = |out: &str, check: &str| -> String {
        out.lines()
            .find(|l| l.split_whitespace().nth(1) == Some(check))
            .unwrap_or_else(|| panic!("no {check} line in:\n{out}"))
            .to_owned()
    };

    let (code, out) = run("doctor-through-proxy", "s3cret");
    println!("with the proxy's credentials:\n{out}");
    assert_eq!(code, Some(0), "{out}");
    let proxy = line(&out, "proxy");
    assert!(
        proxy.contains(&format!("127.0.0.1:{}", tp.port)) && proxy.contains("CONNECT"),
        "{proxy}"
    );
    for check in ["api-tcp", "api-tls", "tunnel-tcp", "tunnel-tls", "clock"] {
        assert!(line(&out, check).starts_with("ok"), "{check}:\n{out}");
    }
    assert!(!out.contains("s3cret"), "{out}");
    assert!(line(&out, "quic").starts_with("skip"), "{out}");

    let (code, out) = run("doctor-wrong-password", "wrong");
    println!("with a wrong password:\n{out}");
    assert_eq!(code, Some(1), "{out}");
    for check in ["api-tcp", "tunnel-tcp"] {
        let l = line(&out, check);
        assert!(l.starts_with("FAIL"), "{l}");
        // tinyproxy answers 401 where the standard says 407: either names the
        // credentials.
        assert!(
            l.contains("refused CONNECT") && l.contains("proxy credentials missing or wrong"),
            "{l}"
        );
    }
    assert!(!out.contains("wrong@"), "{out}");
    hub.hub.shutdown().await;
}
