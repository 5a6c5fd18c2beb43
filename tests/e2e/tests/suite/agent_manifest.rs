//! The way a cluster joins: `kubectl apply -f <manifest URL>` with real
//! kubectl against the Kubernetes API test server, then an agent started
//! with exactly what those objects hold registers and brings its tunnel up.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use otter_agent::{Agent, AgentConfig, config::Secret};
use otter_e2e::{
    TestHub,
    double::{WAIT, wait_connected},
    http_call, kubectl_133, run_bounded, tool_missing, with_token,
};
use otter_proto::link::v1::{GetAgentManifestRequest, link_service_client::LinkServiceClient};
use tonic::Code;

/// `kubectl apply -f <url>` against the cluster of `kubeconfig`, with only
/// `ca` trusted for fetching the URL (Go's HTTP client reads
/// `SSL_CERT_FILE`).
async fn kubectl_apply(
    kubectl: &std::path::Path,
    kubeconfig: &std::path::Path,
    url: &str,
    ca: &std::path::Path,
) -> (i32, String, String) {
    let mut cmd = std::process::Command::new(kubectl);
    cmd.arg("--kubeconfig")
        .arg(kubeconfig)
        .args(["apply", "-f", url])
        .env("SSL_CERT_FILE", ca);
    tokio::task::spawn_blocking(move || run_bounded(&mut cmd, Duration::from_secs(60)))
        .await
        .unwrap()
}

/// A key of a Secret as the test server holds it (`stringData` as
/// applied, or base64 `data`).
fn secret_value(secret: &serde_json::Value, key: &str) -> String {
    if let Some(v) = secret["stringData"][key].as_str() {
        return v.to_owned();
    }
    use base64::Engine;
    let b64 = secret["data"][key].as_str().expect("secret key");
    String::from_utf8(
        base64::engine::general_purpose::STANDARD
            .decode(b64)
            .unwrap(),
    )
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn manifest_url_applied_with_kubectl_joins_the_cluster() {
    let hub = TestHub::start().await;
    let mut link = LinkServiceClient::new(hub.channel().await);

    // Only admins may mint manifests.
    let bob = hub.hub.mint_api_token("bob", &["devs".into()]).unwrap();
    let e = link
        .get_agent_manifest(with_token(
            GetAgentManifestRequest {
                cluster: Some("edge-1".into()),
                ..Default::default()
            },
            &bob,
        ))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied);
    let e = link
        .get_agent_manifest(with_token(
            GetAgentManifestRequest {
                cluster: Some("Edge_1".into()),
                ..Default::default()
            },
            &hub.admin_token,
        ))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);

    let resp = link
        .get_agent_manifest(with_token(
            GetAgentManifestRequest {
                cluster: Some("edge-1".into()),
                extra_users: vec!["carol@example.com".into()],
                rancher_project_id: None,
                labels: [("env".to_owned(), "prod".to_owned())].into(),
            },
            &hub.admin_token,
        ))
        .await
        .unwrap()
        .into_inner();
    let url = resp.url.unwrap();
    assert!(
        url.starts_with(&format!(
            "https://localhost:{}/link/manifest/",
            hub.hub.api_addr.port()
        )),
        "{url}"
    );
    assert!(resp.manifest.unwrap().contains("kind: Deployment"));

    // The URL serves YAML to a plain GET; a tampered or expired one gets 401.
    let path = url
        .split_once(&format!(":{}", hub.hub.api_addr.port()))
        .unwrap()
        .1
        .to_owned();
    let get = |p: &str| http::Request::get(p).body(Full::new(Bytes::new())).unwrap();
    let (status, headers, body) =
        http_call(hub.hub.api_addr, hub.hub.ca_pem(), false, get(&path)).await;
    assert_eq!(status, 200);
    assert!(
        headers["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/yaml")
    );
    assert!(String::from_utf8_lossy(&body).contains("otterscale-system"));
    let mut tampered = path.clone().into_bytes();
    let i = tampered.len() - 3;
    tampered[i] = if tampered[i] == b'A' { b'B' } else { b'A' };
    let (status, _, body) = http_call(
        hub.hub.api_addr,
        hub.hub.ca_pem(),
        false,
        get(std::str::from_utf8(&tampered).unwrap()),
    )
    .await;
    assert_eq!(status, 401);
    assert!(
        String::from_utf8_lossy(&body).contains("otter agent-manifest"),
        "says what to do"
    );
    let expired = otter_hub::manifest::sign(
        &hub.hub.state.manifest_key,
        &otter_hub::manifest::claims(
            "edge-1",
            "default",
            &[],
            "",
            Duration::ZERO,
            &hub.hub.state.authority.current().active.fingerprint(),
        ),
    );
    let (status, _, body) = http_call(
        hub.hub.api_addr,
        hub.hub.ca_pem(),
        false,
        get(&format!("/link/manifest/{expired}")),
    )
    .await;
    assert_eq!(status, 401);
    assert!(String::from_utf8_lossy(&body).contains("expired"));

    // kubectl applies the URL against a member cluster (the test server).
    let Some(kubectl) = kubectl_133() else {
        tool_missing("kubectl 1.33");
        return;
    };
    let sim = kube_sim::KubeSim::start(kube_sim::SimConfig::default_with_admin())
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(&kubeconfig, sim.kubeconfig_yaml(kube_sim::ADMIN_TOKEN)).unwrap();
    let hub_ca = dir.path().join("hub-ca.pem");
    std::fs::write(&hub_ca, hub.hub.ca_pem()).unwrap();
    let (code, out, err) = kubectl_apply(&kubectl, &kubeconfig, &url, &hub_ca).await;
    assert_eq!(code, 0, "kubectl apply failed: {out}{err}");
    for line in [
        "namespace/otterscale-system created",
        "serviceaccount/otter-agent created",
        "clusterrole.rbac.authorization.k8s.io/otterscale:agent created",
        "secret/otter-agent created",
        "deployment.apps/otter-agent created",
    ] {
        assert!(out.contains(line), "missing {line:?} in:\n{out}");
    }

    // The manifest's bindings take effect: the named admins may do anything,
    // anyone else may not.
    for (user, group, allowed) in [
        ("otter:carol@example.com", "otter:default:devs", true),
        ("otter:anyone", "otter:default:admins", true),
        ("otter:mallory", "otter:default:members", false),
        ("otter:mallory", "otter:other:admins", false),
    ] {
        let mut cmd = std::process::Command::new(kubectl_133().unwrap());
        cmd.arg("--kubeconfig").arg(&kubeconfig).args([
            "get",
            "secrets",
            "-A",
            "--as",
            user,
            "--as-group",
            group,
        ]);
        let (code, out, err) =
            tokio::task::spawn_blocking(move || run_bounded(&mut cmd, Duration::from_secs(60)))
                .await
                .unwrap();
        assert_eq!(code == 0, allowed, "{user} in {group}: {out}{err}");
    }

    // Every object reads back.
    let ns = "otterscale-system";
    let deployment = sim
        .object("apps", "deployments", ns, "otter-agent")
        .expect("deployment");
    let secret = sim
        .object("", "secrets", ns, "otter-agent")
        .expect("secret");
    assert!(
        sim.object("", "serviceaccounts", ns, "otter-agent")
            .is_some()
    );
    assert!(
        sim.object(
            "rbac.authorization.k8s.io",
            "clusterroles",
            "",
            "otterscale:agent"
        )
        .is_some()
    );
    let admins = [
        "otterscale:tenant-admins".to_owned(),
        otter_hub::manifest::admin_binding_name("otter:carol@example.com"),
    ];
    for name in &admins {
        let b = sim
            .object("rbac.authorization.k8s.io", "clusterrolebindings", "", name)
            .expect("admin binding");
        assert_eq!(b["roleRef"]["name"], "cluster-admin");
    }

    // An agent started with exactly the Deployment's env and the Secret's data.
    let env = &deployment["spec"]["template"]["spec"]["containers"][0]["env"];
    let var = |name: &str| {
        env.as_array()
            .unwrap()
            .iter()
            .find(|e| e["name"] == name)
            .and_then(|e| e["value"].as_str())
            .unwrap_or_default()
            .to_owned()
    };
    let secret_value = |key: &str| secret_value(&secret, key);
    let ca = secret_value("hub-ca.crt");
    assert_eq!(
        otter_pki::ca::fingerprint_pem(&ca).unwrap(),
        var("OTTER_HUB_CA_FINGERPRINT")
    );
    let mut config = AgentConfig::new(
        url::Url::parse(&var("OTTER_HUB_URL")).unwrap(),
        &var("OTTER_CLUSTER"),
        "otter-agent-7d9f",
        &ca,
    );
    config.join_token = Secret(secret_value("join-token"));
    let agent = Agent::start(config, tonic::service::Routes::default()).unwrap();
    agent
        .wait_for(WAIT, |s| s.connected.is_some())
        .await
        .expect("agent from the manifest connects");
    wait_connected(&hub.channel().await, &hub.admin_token, 1).await;
    // The link carries the labels the manifest was asked with.
    let link = otter_e2e::double::link_of(&hub.channel().await, &hub.admin_token, "edge-1").await;
    assert_eq!(link.labels.get("env").map(String::as_str), Some("prod"));
    agent.shutdown().await;
    sim.shutdown().await;

    hub.hub.shutdown().await;
}

/// The agent's identity lives in its Secret, not in the pod: an agent pod
/// started again long after the join token expired (a node drained for a
/// Talos upgrade, another pod name) reconnects with it, and no usable join
/// token is left in the cluster.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rescheduled_agent_reconnects_from_its_secret_after_the_join_token_expired() {
    use otter_e2e::procs::{Proc, Role};
    const TOKEN_TTL: Duration = Duration::from_secs(4);
    let dir = std::sync::Arc::new(tempfile::tempdir().unwrap());
    let hub = TestHub::start_with(dir, None, |c| c.join_token_ttl = TOKEN_TTL).await;
    let Some(kubectl) = kubectl_133() else {
        tool_missing("kubectl 1.33");
        return;
    };
    let url = hub.manifest_url("edge-1").await;
    let sim = kube_sim::KubeSim::start(kube_sim::SimConfig::default_with_admin())
        .await
        .unwrap();
    let work = tempfile::tempdir().unwrap();
    let kubeconfig = work.path().join("kubeconfig");
    std::fs::write(&kubeconfig, sim.kubeconfig_yaml(kube_sim::ADMIN_TOKEN)).unwrap();
    let hub_ca = work.path().join("hub-ca.pem");
    std::fs::write(&hub_ca, hub.hub.ca_pem()).unwrap();
    let applied = std::time::Instant::now();
    let (code, out, err) = kubectl_apply(&kubectl, &kubeconfig, &url, &hub_ca).await;
    assert_eq!(code, 0, "kubectl apply failed: {out}{err}");
    let ns = "otterscale-system";
    let keys = || -> Vec<String> {
        let secret = sim
            .object("", "secrets", ns, "otter-agent")
            .expect("secret");
        let mut keys: Vec<String> = secret["data"]
            .as_object()
            .map(|d| d.keys().cloned().collect())
            .unwrap_or_default();
        keys.sort();
        keys
    };
    assert_eq!(keys(), ["hub-ca.crt", "join-token"]);

    // A pod of the Deployment: what its env says, with the cluster's
    // credentials (the test server's) for its own Secret.
    let pod = |name: &str| {
        Proc::start(
            name,
            Role::Agent,
            &[
                "--hub-url".into(),
                hub.api_url().to_string(),
                "--cluster".into(),
                "edge-1".into(),
                "--agent-id".into(),
                name.into(),
                "--hub-ca-file".into(),
                hub_ca.display().to_string(),
                "--state-secret".into(),
                "otter-agent".into(),
                "--state-namespace".into(),
                ns.into(),
                "--kubeconfig".into(),
                kubeconfig.display().to_string(),
                "--transports".into(),
                "h2".into(),
                "--keepalive-secs".into(),
                "1".into(),
                // The kernel picks the port; the agent's log says which.
                "--health-listen".into(),
                "127.0.0.1:0".into(),
            ],
            work.path(),
            None,
        )
    };
    let channel = hub.channel().await;
    let mut first = pod("otter-agent-5d8f7-abcde");
    wait_connected(&channel, &hub.admin_token, 1).await;
    // Enrolled: the identity is in the Secret, the join token is gone.
    assert_eq!(
        keys(),
        [
            "agent.crt",
            "agent.key",
            "hub-ca.crt",
            "hub-cas.crt",
            "tunnel-urls"
        ],
        "{}",
        first.tail(20)
    );
    // The probe port the kernel picked, from the agent's log, answers.
    let health = health_addr(&first.stderr())
        .unwrap_or_else(|| panic!("no health address logged:\n{}", first.tail(20)));
    let ready = otter_e2e::procs::http_get(health, "/readyz").await;
    assert!(
        ready.as_deref().is_some_and(
            |r| r.starts_with("tunnel up over ") && r.contains("certificate valid for")
        ),
        "{ready:?}"
    );
    first.kill9();
    let deadline = tokio::time::Instant::now() + WAIT;
    while hub.hub.state.registry.get("edge-1").is_some() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the killed agent's tunnel stays"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Long after: the token has expired (and was spent anyway).
    let expiry = applied + TOKEN_TTL + Duration::from_secs(1);
    tokio::time::sleep_until(expiry.into()).await;
    let second = pod("otter-agent-5d8f7-fghij");
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let link = otter_e2e::double::link_of(&channel, &hub.admin_token, "edge-1").await;
        // The hub sees the same agent, back on its kept certificate.
        if link.state == Some(otter_proto::link::v1::LinkState::Connected as i32)
            && hub.hub.state.registry.get("edge-1").is_some()
        {
            assert_eq!(link.agent_id.as_deref(), Some("otter-agent-5d8f7-abcde"));
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the rescheduled agent did not reconnect:\n{}",
            second.tail(30)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(second);
    sim.shutdown().await;
    hub.hub.shutdown().await;
}

/// The address in the agent's "health probes listening" log line (colours
/// and all).
fn health_addr(log: &str) -> Option<std::net::SocketAddr> {
    let line = log
        .lines()
        .find(|l| l.contains("health probes listening"))?;
    let mut plain = String::new();
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // An escape sequence runs to its final letter.
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            plain.push(c);
        }
    }
    plain
        .split_once("addr=")?
        .1
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// An agent with no join token and no identity kept from an earlier join
/// can never connect: it exits non-zero at once, saying what to do (a pod
/// shows CrashLoopBackOff with the message), rather than retry forever. The
/// same agent given a token gets past that check.
#[test]
fn an_agent_with_nothing_to_join_with_exits_with_the_fix() {
    use otter_e2e::procs::{Proc, Role};
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("hub-ca.crt");
    let pem = otter_pki::CertificateAuthority::generate("a hub CA").unwrap();
    std::fs::write(&ca, pem.cert_pem()).unwrap();
    let state = dir.path().join("state");
    std::fs::create_dir(&state).unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "a-token").unwrap();
    let args = |with_token: bool| {
        let mut a: Vec<String> = [
            "--hub-url",
            "https://localhost:9",
            "--cluster",
            "edge-9",
            "--hub-ca-file",
            &ca.display().to_string(),
            "--state-dir",
            &state.display().to_string(),
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
        if with_token {
            a.extend(["--join-token-file".into(), token.display().to_string()]);
        }
        a
    };
    // In JSON, as a log collector would take it: the line before the exit.
    let mut json_args = args(false);
    json_args.extend(["--log-format", "json", "--health-listen", "127.0.0.1:0"].map(String::from));
    let mut bare = Proc::start("agent-bare", Role::Agent, &json_args, dir.path(), None);
    let code = bare.wait(WAIT);
    assert!(matches!(code, Some(c) if c != 0), "exit code {code:?}");
    let said = bare.stderr();
    let logged: Vec<serde_json::Value> = said
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).expect("each log line one JSON object"))
        .collect();
    assert!(
        logged
            .iter()
            .any(|l| l["fields"]["message"] == "health probes listening" && l["level"] == "INFO"),
        "{said}"
    );
    assert!(
        said.contains("no join token and no identity from an earlier join")
            && said.contains("otter agent-manifest --cluster edge-9")
            && said.contains("--join-token-file"),
        "{said}"
    );
    eprintln!("{}", said.trim());
    let mut with = Proc::start("agent-token", Role::Agent, &args(true), dir.path(), None);
    // It stops later, on the missing cluster credentials, not on this.
    let _ = with.wait(WAIT);
    assert!(
        !with.stderr().contains("no join token"),
        "{}",
        with.stderr()
    );
}

/// The leaf certificate the hub's API port shows, trusting `ca`; `None`
/// when the handshake fails.
async fn api_leaf(hub: &TestHub, ca: &str) -> Option<Vec<u8>> {
    let tls = otter_pki::tls::client_config(ca, None, &[b"h2"]).unwrap();
    let tcp = tokio::net::TcpStream::connect(hub.hub.api_addr)
        .await
        .ok()?;
    let tls = tokio_rustls::TlsConnector::from(std::sync::Arc::new(tls))
        .connect("localhost".try_into().unwrap(), tcp)
        .await
        .ok()?;
    Some(tls.get_ref().1.peer_certificates()?.first()?.to_vec())
}

/// The hub's API with a certificate users' tools trust (a test CA stands
/// in for a public one): kubectl trusting only that CA applies the
/// manifest URL, the agent verifies Register with the CA the manifest hands
/// it while its tunnel stays pinned to the hub CA, and a certificate file
/// rewritten (as cert-manager renews) is shown without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_applies_the_manifest_url_trusting_only_the_api_certificates_ca() {
    let Some(kubectl) = kubectl_133() else {
        tool_missing("kubectl 1.33");
        return;
    };
    let work = tempfile::tempdir().unwrap();
    let public = otter_pki::CertificateAuthority::generate("a public CA").unwrap();
    let names = ["localhost".to_owned(), "127.0.0.1".to_owned()];
    let (cert, key) = public.issue_server_cert(&names).unwrap();
    let (cert_file, key_file, ca_file) = (
        work.path().join("tls.crt"),
        work.path().join("tls.key"),
        work.path().join("ca.crt"),
    );
    std::fs::write(&cert_file, &cert).unwrap();
    std::fs::write(&key_file, &key).unwrap();
    std::fs::write(&ca_file, public.cert_pem()).unwrap();
    let files = otter_hub::config::ApiTls {
        cert_file: cert_file.clone(),
        key_file: key_file.clone(),
        ca_file: Some(ca_file.clone()),
        reload_every: Duration::from_millis(100),
    };
    let dir = std::sync::Arc::new(tempfile::tempdir().unwrap());
    let hub = TestHub::start_with(dir, None, move |c| c.api_tls = Some(files)).await;
    // The API shows the public CA's certificate, not the hub CA's.
    assert!(api_leaf(&hub, hub.hub.ca_pem()).await.is_none());
    let first = api_leaf(&hub, public.cert_pem()).await.expect("handshake");

    let channel = hub.channel_with_ca(public.cert_pem()).await;
    let url = LinkServiceClient::new(channel.clone())
        .get_agent_manifest(with_token(
            GetAgentManifestRequest {
                cluster: Some("edge-1".into()),
                ..Default::default()
            },
            &hub.admin_token,
        ))
        .await
        .expect("GetAgentManifest")
        .into_inner()
        .url
        .expect("a manifest URL");
    let sim = kube_sim::KubeSim::start(kube_sim::SimConfig::default_with_admin())
        .await
        .unwrap();
    let kubeconfig = work.path().join("kubeconfig");
    std::fs::write(&kubeconfig, sim.kubeconfig_yaml(kube_sim::ADMIN_TOKEN)).unwrap();
    let (code, out, err) = kubectl_apply(&kubectl, &kubeconfig, &url, &ca_file).await;
    assert_eq!(code, 0, "kubectl apply with only the public CA: {out}{err}");

    // What the manifest tells the agent: the hub CA for the tunnel, the
    // public CA for the API.
    let ns = "otterscale-system";
    let secret = sim
        .object("", "secrets", ns, "otter-agent")
        .expect("secret");
    let secret_value = |key: &str| secret_value(&secret, key);
    assert_eq!(secret_value("hub-api-ca.crt"), public.cert_pem());
    let deployment = sim
        .object("apps", "deployments", ns, "otter-agent")
        .expect("deployment");
    let env = deployment["spec"]["template"]["spec"]["containers"][0]["env"].to_string();
    assert!(
        env.contains("OTTER_HUB_API_CA_FILE") && env.contains("/etc/otter/join/hub-api-ca.crt"),
        "{env}"
    );
    let mut config = AgentConfig::new(hub.api_url(), "edge-1", "a1", &secret_value("hub-ca.crt"));
    config.api_trust.ca_pem = Some(secret_value("hub-api-ca.crt"));
    config.join_token = Secret(secret_value("join-token"));
    let agent = Agent::start(config, tonic::service::Routes::default()).unwrap();
    agent
        .wait_for(WAIT, |s| s.connected.is_some())
        .await
        .expect("the agent registers through the public certificate and tunnels to the hub CA's");
    wait_connected(&channel, &hub.admin_token, 1).await;

    // cert-manager renews: the files are rewritten, the hub shows the new
    // certificate from then on, no restart.
    let (cert2, key2) = public.issue_server_cert(&names).unwrap();
    std::fs::write(&key_file, &key2).unwrap();
    std::fs::write(&cert_file, &cert2).unwrap();
    let renewed = otter_pki::tls::parse_certs(&cert2).unwrap()[0].to_vec();
    assert_ne!(renewed, first);
    let started = std::time::Instant::now();
    loop {
        if api_leaf(&hub, public.cert_pem()).await.as_deref() == Some(renewed.as_slice()) {
            break;
        }
        assert!(
            started.elapsed() < WAIT,
            "the rewritten certificate was never shown"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!(
        "the rewritten API certificate shown {:?} after the write",
        started.elapsed()
    );
    // Still the same agent, on its tunnel.
    assert_eq!(agent.status().connects, 1);
    agent.shutdown().await;
    sim.shutdown().await;
    hub.hub.shutdown().await;
}

/// The agent's Register says why it cannot reach the hub, in its status
/// and log line: a refused port, and a hub whose certificate is not from
/// the CA the agent was given.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_says_why_it_cannot_reach_the_hub() {
    let hub = TestHub::start().await;
    let stranger = otter_pki::CertificateAuthority::generate("not the hub's").unwrap();
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let cases = [
        (
            format!("https://localhost:{closed}"),
            hub.hub.ca_pem().to_owned(),
            ["connection refused", "is the hub running"],
        ),
        (
            hub.api_url().to_string(),
            stranger.cert_pem().to_owned(),
            ["not from a CA trusted here", "--hub-ca-file"],
        ),
    ];
    for (url, ca, expect) in cases {
        let mut config = AgentConfig::new(url.parse().unwrap(), "edge-1", "a1", &ca);
        config.join_token = Secret("a-token".into());
        let agent = Agent::start(config, tonic::service::Routes::default()).unwrap();
        let s = agent
            .wait_for(WAIT, |s| !s.last_error.is_empty())
            .await
            .expect("a failed Register");
        eprintln!("{}", s.last_error);
        for e in expect {
            assert!(s.last_error.contains(e), "{e:?} not in {:?}", s.last_error);
        }
        agent.shutdown().await;
    }
    hub.hub.shutdown().await;
}
