//! Tenants on one hub, as customers of a SaaS hub meet them: two tenants
//! with an admin and a member each, and an operator. Every way to a
//! cluster of the other tenant (gRPC, Connect, gRPC-Web, a session call,
//! the kubectl proxy, the admin API, manifests) is refused exactly like a
//! cluster that does not exist; the operator reaches nothing; tokens are
//! bounded to their tenant, revocable and expire.

use std::{sync::Arc, time::Duration};

use bytes::Bytes;
use http_body_util::Full;
use otter_e2e::{
    TestHub,
    double::{field, get, start_agent, wait_connected},
    http_call, with_token,
};
use otter_proto::{
    link::v1::{GetAgentManifestRequest, ListLinksRequest, link_service_client::LinkServiceClient},
    resource::v1::resource_service_client::ResourceServiceClient,
    runtime::v1::{WriteTtyRequest, runtime_service_client::RuntimeServiceClient},
};
use otter_tunnel::TransportKind;
use serde_json::{Value, json};

/// An admin API call as the CLI makes it: (status, body).
async fn admin(
    hub: &TestHub,
    token: &str,
    method: http::Method,
    path: &str,
    body: Option<Value>,
) -> (u16, String) {
    otter_e2e::admin_call(
        hub.hub.api_addr,
        hub.hub.ca_pem(),
        token,
        method,
        path,
        body,
    )
    .await
}

/// Mints a token through the admin API as `by`.
async fn mint(hub: &TestHub, by: &str, body: Value) -> String {
    otter_e2e::mint_via_admin(hub.hub.api_addr, hub.hub.ca_pem(), by, body)
        .await
        .0
}

/// Tenants acme and globex, made by the operator `root`, with their first
/// admins ann and gil; their tokens.
async fn acme_and_globex(hub: &TestHub, root: &str) -> (String, String) {
    for name in ["acme", "globex"] {
        let body = Some(json!({"name": name}));
        let (status, text) = admin(hub, root, http::Method::POST, "/admin/v1/tenants", body).await;
        assert_eq!(status, 200, "{text}");
    }
    let ann = json!({"name": "ann", "tenant": "acme", "role": "admin"});
    let gil = json!({"name": "gil", "tenant": "globex", "role": "admin"});
    (mint(hub, root, ann).await, mint(hub, root, gil).await)
}

/// A gRPC Get: the user the cluster saw, or (code, message).
async fn grpc_get(
    channel: &tonic::transport::Channel,
    token: &str,
    cluster: &str,
) -> Result<String, (tonic::Code, String)> {
    ResourceServiceClient::new(channel.clone())
        .get(with_token(get(cluster, "web"), token))
        .await
        .map(|r| field(r.get_ref(), "user"))
        .map_err(|s| (s.code(), s.message().to_owned()))
}

/// A Connect JSON Get over HTTP/1.1: (HTTP status, body).
async fn connect_get(hub: &TestHub, token: &str, cluster: &str) -> (u16, String) {
    let body = json!({"cluster": cluster, "version": "v1", "resource": "pods", "name": "web"});
    let req = http::Request::post("/otterscale.resource.v1.ResourceService/Get")
        .header("content-type", "application/json")
        .header("connect-protocol-version", "1")
        .header("authorization", format!("Bearer {token}"))
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let (status, _, body) = http_call(hub.hub.api_addr, hub.hub.ca_pem(), false, req).await;
    (status.as_u16(), String::from_utf8_lossy(&body).into_owned())
}

/// A kubectl-proxy GET: (HTTP status, body).
async fn kube_get(hub: &TestHub, token: &str, cluster: &str) -> (u16, String) {
    let req = http::Request::get(format!("/clusters/{cluster}/api/v1/namespaces"))
        .header("authorization", format!("Bearer {token}"))
        .body(Full::new(Bytes::new()))
        .unwrap();
    let (status, _, body) = http_call(hub.hub.api_addr, hub.hub.ca_pem(), false, req).await;
    (status.as_u16(), String::from_utf8_lossy(&body).into_owned())
}

/// The same answer with the cluster's name taken out.
fn without(answer: &str, cluster: &str) -> String {
    answer.replace(cluster, "<cluster>")
}

async fn links_seen(
    channel: &tonic::transport::Channel,
    token: &str,
) -> Vec<(String, Option<String>, Option<String>)> {
    LinkServiceClient::new(channel.clone())
        .list_links(with_token(ListLinksRequest {}, token))
        .await
        .unwrap()
        .into_inner()
        .links
        .into_iter()
        .map(|l| {
            (
                l.cluster.unwrap_or_default(),
                l.agent_id,
                l.certificate_serial,
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_reach_only_their_own_clusters() {
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let hub = TestHub::start_with(dir, None, |_| {}).await;
    let root = hub.admin_token.clone();
    let channel = hub.channel().await;

    // The first-start token is an operator: it makes the tenants and
    // names their first admins.
    let (ann, gil) = acme_and_globex(&hub, &root).await;
    // A tenant's admin mints its members (its tenant implied).
    let mel = mint(&hub, &ann, json!({"name": "mel", "groups": ["devs"]})).await;
    let gus = mint(&hub, &gil, json!({"name": "gus"})).await;
    let opal = mint(&hub, &root, json!({"name": "opal", "operator": true})).await;

    // Names: a tenant's admin claims one with a manifest; the other tenant
    // is told it is taken, and not by whom.
    let manifest = |token: &str, cluster: &str| {
        let mut client = LinkServiceClient::new(channel.clone());
        let req = with_token(
            GetAgentManifestRequest {
                cluster: Some(cluster.into()),
                ..Default::default()
            },
            token,
        );
        async move { client.get_agent_manifest(req).await }
    };
    manifest(&ann, "acme-2").await.expect("ann mints for acme");
    let taken = manifest(&gil, "acme-2").await.unwrap_err();
    assert_eq!(taken.code(), tonic::Code::AlreadyExists, "{taken:?}");
    assert!(!taken.message().contains("acme\""), "{taken:?}");
    for (who, token) in [("mel", &mel), ("opal", &opal)] {
        let refused = manifest(token, "x-1").await.unwrap_err();
        assert_eq!(
            refused.code(),
            tonic::Code::PermissionDenied,
            "{who}: {refused:?}"
        );
    }

    let acme_join = hub.hub.mint_join_token_in("acme-1", "acme").unwrap();
    let globex_join = hub.hub.mint_join_token_in("globex-1", "globex").unwrap();
    let _acme = start_agent(&hub, "acme-1", "a1", &acme_join, TransportKind::H2);
    let _globex = start_agent(&hub, "globex-1", "g1", &globex_join, TransportKind::H2);
    // Tenant admins each see their one link, with its agent.
    wait_connected(&channel, &ann, 1).await;
    wait_connected(&channel, &gil, 1).await;

    // ListLinks: a tenant's links only; agent and certificate to admins.
    let links = links_seen(&channel, &ann).await;
    assert_eq!(links.len(), 1, "{links:?}");
    assert_eq!(
        (links[0].0.as_str(), links[0].1.as_deref()),
        ("acme-1", Some("a1"))
    );
    assert!(links[0].2.is_some());
    assert_eq!(
        links_seen(&channel, &mel).await,
        [("acme-1".to_owned(), None, None)]
    );
    assert_eq!(links_seen(&channel, &gus).await.len(), 1);
    assert_eq!(links_seen(&channel, &gus).await[0].0, "globex-1");
    assert!(links_seen(&channel, &opal).await.is_empty());

    // A member reaches its tenant's cluster, as itself.
    assert_eq!(
        grpc_get(&channel, &mel, "acme-1").await,
        Ok("otter:mel".to_owned())
    );
    assert_eq!(
        grpc_get(&channel, &gus, "globex-1").await,
        Ok("otter:gus".to_owned())
    );

    // Every way to the other tenant's cluster answers as for no cluster.
    let mut refusals = 0;
    for (who, token, theirs) in [
        ("mel", &mel, "globex-1"),
        ("ann", &ann, "globex-1"),
        ("gus", &gus, "acme-1"),
        ("opal", &opal, "acme-1"),
        ("opal", &opal, "globex-1"),
        ("root", &root, "acme-1"),
    ] {
        let absent = grpc_get(&channel, token, "no-such-cluster")
            .await
            .unwrap_err();
        let other = grpc_get(&channel, token, theirs).await.unwrap_err();
        assert_eq!(absent.0, tonic::Code::NotFound, "{who}");
        assert_eq!(
            (other.0, without(&other.1, theirs)),
            (absent.0, without(&absent.1, "no-such-cluster")),
            "gRPC, {who} → {theirs}"
        );
        let absent = connect_get(&hub, token, "no-such-cluster").await;
        let other = connect_get(&hub, token, theirs).await;
        assert_eq!(absent.0, 404, "{who}: {absent:?}");
        assert_eq!(
            (other.0, without(&other.1, theirs)),
            (absent.0, without(&absent.1, "no-such-cluster")),
            "Connect, {who} → {theirs}"
        );
        // A session call routes by the cluster in its session id.
        let write = |cluster: &str| {
            let mut client = RuntimeServiceClient::new(channel.clone());
            let req = with_token(
                WriteTtyRequest {
                    session_id: Some(format!("{cluster}:0123456789abcdef")),
                    stdin: Some(b"id\n".to_vec()),
                },
                token,
            );
            async move { client.write_tty(req).await }
        };
        let absent = write("no-such-cluster").await.unwrap_err();
        let other = write(theirs).await.unwrap_err();
        assert_eq!(
            (other.code(), without(other.message(), theirs)),
            (absent.code(), without(absent.message(), "no-such-cluster")),
            "WriteTTY, {who} → {theirs}"
        );
        let absent = kube_get(&hub, token, "no-such-cluster").await;
        let other = kube_get(&hub, token, theirs).await;
        assert_eq!(absent.0, 404, "{who}: {absent:?}");
        assert_eq!(
            (other.0, without(&other.1, theirs)),
            (absent.0, without(&absent.1, "no-such-cluster")),
            "kubectl proxy, {who} → {theirs}"
        );
        for (method, path) in [
            (
                http::Method::POST,
                format!("/admin/v1/links/{theirs}/re-enroll"),
            ),
            (http::Method::DELETE, format!("/admin/v1/links/{theirs}")),
        ] {
            let absent = admin(
                &hub,
                token,
                method.clone(),
                &path.replace(theirs, "no-such-cluster"),
                None,
            )
            .await;
            let other = admin(&hub, token, method, &path, None).await;
            assert_eq!(absent.0, 404, "{who}: {absent:?}");
            assert_eq!(
                (other.0, without(&other.1, theirs)),
                (absent.0, without(&absent.1, "no-such-cluster")),
                "admin {path}, {who}"
            );
        }
        refusals += 6;
    }
    assert_eq!(refusals, 36);
    // Real kubectl tells another tenant's cluster from an absent one no
    // better.
    match otter_e2e::kubectl_133() {
        None => {
            otter_e2e::tool_missing("kubectl 1.33");
        }
        Some(kubectl) => {
            let dir = tempfile::tempdir().unwrap();
            let ca = dir.path().join("hub-ca.pem");
            std::fs::write(&ca, hub.hub.ca_pem()).unwrap();
            let port = hub.hub.api_addr.port();
            let kubectl_get = |cluster: &str| {
                let config = dir.path().join(format!("{cluster}.kubeconfig"));
                std::fs::write(
                    &config,
                    format!(
                        "apiVersion: v1\nkind: Config\ncurrent-context: c\n\
                         clusters: [{{name: c, cluster: {{server: \"https://localhost:{port}/clusters/{cluster}\", certificate-authority: {}}}}}]\n\
                         users: [{{name: u, user: {{token: {mel}}}}}]\n\
                         contexts: [{{name: c, context: {{cluster: c, user: u}}}}]\n",
                        ca.display()
                    ),
                )
                .unwrap();
                let (code, out, err) = otter_e2e::run_bounded(
                    std::process::Command::new(&kubectl)
                        .arg("--kubeconfig")
                        .arg(&config)
                        .args(["get", "namespaces"]),
                    Duration::from_secs(60),
                );
                // klog lines start with a time and a process id: compared
                // without them.
                let err: Vec<String> = err
                    .lines()
                    .map(|l| match l.split_once(".go:") {
                        Some((_, rest)) => rest.to_owned(),
                        None => l.to_owned(),
                    })
                    .collect();
                (code, out, without(&err.join("\n"), cluster))
            };
            let absent = tokio::task::block_in_place(|| kubectl_get("no-such-cluster"));
            let other = tokio::task::block_in_place(|| kubectl_get("globex-1"));
            assert_ne!(absent.0, 0, "{absent:?}");
            assert!(absent.2.contains("NotFound"), "{absent:?}");
            assert_eq!(other, absent, "kubectl 1.33, mel → globex-1");
        }
    }
    // The clusters are still there for their own tenants.
    assert_eq!(
        grpc_get(&channel, &gus, "globex-1").await,
        Ok("otter:gus".to_owned())
    );

    // Tokens stay inside their tenant, and name no built-in identity.
    for (who, token, body, code) in [
        ("ann", &ann, json!({"name": "x", "tenant": "globex"}), 403),
        ("ann", &ann, json!({"name": "x", "operator": true}), 403),
        ("mel", &mel, json!({"name": "x"}), 403),
        ("ann", &ann, json!({"name": "system:admin"}), 400),
        (
            "ann",
            &ann,
            json!({"name": "x", "groups": ["system:masters"]}),
            400,
        ),
        (
            "ann",
            &ann,
            json!({"name": "x", "groups": ["otterscale:admins"]}),
            400,
        ),
        ("ann", &ann, json!({"name": "x", "role": "owner"}), 400),
        (
            "opal",
            &opal,
            json!({"name": "x", "tenant": "nope", "role": "admin"}),
            404,
        ),
    ] {
        let (status, text) = admin(
            &hub,
            token,
            http::Method::POST,
            "/admin/v1/tokens",
            Some(body.clone()),
        )
        .await;
        assert_eq!(status, code, "{who} {body}: {text}");
    }
    // Tenants are the operators' business; a tenant holding clusters stays.
    let (status, _) = admin(
        &hub,
        &ann,
        http::Method::POST,
        "/admin/v1/tenants",
        Some(json!({"name": "x"})),
    )
    .await;
    assert_eq!(status, 403);
    let (status, text) = admin(
        &hub,
        &opal,
        http::Method::DELETE,
        "/admin/v1/tenants/globex",
        None,
    )
    .await;
    assert_eq!(status, 409, "{text}");
    let (status, text) = admin(&hub, &opal, http::Method::GET, "/admin/v1/tenants", None).await;
    assert_eq!(status, 200);
    let names: Vec<String> = serde_json::from_str::<Value>(&text).unwrap()["tenants"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(names, ["acme", "default", "globex"]);
    let (_, text) = admin(&hub, &mel, http::Method::GET, "/admin/v1/tenants", None).await;
    assert_eq!(
        serde_json::from_str::<Value>(&text).unwrap()["tenants"][0]["name"],
        "acme",
        "{text}"
    );
    // Metrics are the operators'.
    let req = |token: &str| {
        http::Request::get("/metrics")
            .header("authorization", format!("Bearer {token}"))
            .body(Full::new(Bytes::new()))
            .unwrap()
    };
    let (status, _, _) = http_call(hub.hub.api_addr, hub.hub.ca_pem(), false, req(&ann)).await;
    assert_eq!(status, 403);
    let (status, _, _) = http_call(hub.hub.api_addr, hub.hub.ca_pem(), false, req(&opal)).await;
    assert_eq!(status, 200);

    // Revocation: an admin lists its tenant's tokens and revokes one; the
    // other tenant's admin does not see it.
    let (_, text) = admin(&hub, &ann, http::Method::GET, "/admin/v1/tokens", None).await;
    let listed: Value = serde_json::from_str(&text).unwrap();
    let users: Vec<&str> = listed["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    assert_eq!(users.len(), 2, "{text}");
    assert!(users.contains(&"ann") && users.contains(&"mel"), "{text}");
    assert!(!text.contains("secret"), "{text}");
    let mel_id = listed["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "mel")
        .unwrap()["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let path = format!("/admin/v1/tokens/{mel_id}");
    let (status, _) = admin(&hub, &gil, http::Method::DELETE, &path, None).await;
    assert_eq!(status, 404, "another tenant's admin cannot revoke it");
    assert_eq!(
        grpc_get(&channel, &mel, "acme-1").await,
        Ok("otter:mel".to_owned())
    );
    let (status, text) = admin(&hub, &ann, http::Method::DELETE, &path, None).await;
    assert_eq!(status, 200, "{text}");
    let revoked = grpc_get(&channel, &mel, "acme-1").await.unwrap_err();
    assert_eq!(revoked.0, tonic::Code::Unauthenticated, "{revoked:?}");
    // An expiring token stops working.
    let brief = mint(&hub, &ann, json!({"name": "temp", "ttl_secs": 1})).await;
    assert_eq!(
        grpc_get(&channel, &brief, "acme-1").await,
        Ok("otter:temp".to_owned())
    );
    tokio::time::sleep(Duration::from_millis(2100)).await;
    let expired = grpc_get(&channel, &brief, "acme-1").await.unwrap_err();
    assert_eq!(expired.0, tonic::Code::Unauthenticated, "{expired:?}");

    // Deleting a link: the tunnel closes, the agent's certificate names no
    // link any more, and the name is free for anyone. A join token made
    // before (a manifest handed out earlier) enrolls nobody.
    let stale = hub.hub.mint_join_token_in("acme-1", "acme").unwrap();
    let (status, text) = admin(
        &hub,
        &ann,
        http::Method::DELETE,
        "/admin/v1/links/acme-1",
        None,
    )
    .await;
    assert_eq!(status, 200, "{text}");
    assert!(links_seen(&channel, &ann).await.is_empty());
    let gone = grpc_get(&channel, &ann, "acme-1").await.unwrap_err();
    assert_eq!(gone.0, tonic::Code::NotFound, "{gone:?}");
    assert!(hub.hub.state.registry.get("acme-1").is_none());
    // The agent keeps trying with its certificate: refused every time.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(hub.hub.state.registry.get("acme-1").is_none());
    let (_, csr) = otter_pki::csr::generate("acme-1", "a2").unwrap();
    let enroll = LinkServiceClient::new(channel.clone())
        .register(otter_proto::link::v1::RegisterRequest {
            cluster: Some("acme-1".into()),
            csr: Some(csr.into_bytes()),
            agent_id: Some("a2".into()),
            agent_version: Some("v0.1.0".into()),
            join_token: Some(stale),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(enroll.code(), tonic::Code::Unauthenticated, "{enroll:?}");
    manifest(&gil, "acme-1")
        .await
        .expect("the name is free again");

    // An operator cannot take a tenant over: revoking its admin does not
    // let it name another (nor itself).
    let (_, text) = admin(&hub, &root, http::Method::GET, "/admin/v1/tokens", None).await;
    let listed: Value = serde_json::from_str(&text).unwrap();
    let gil_id = listed["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "gil")
        .unwrap()["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let path = format!("/admin/v1/tokens/{gil_id}");
    let (status, _) = admin(&hub, &root, http::Method::DELETE, &path, None).await;
    assert_eq!(status, 200);
    let body = json!({"name": "opal2", "tenant": "globex", "role": "admin"});
    let (status, text) = admin(
        &hub,
        &root,
        http::Method::POST,
        "/admin/v1/tokens",
        Some(body),
    )
    .await;
    assert_eq!(status, 403, "{text}");

    hub.hub.shutdown().await;
}

/// Every registration, tunnel admission, forwarded call, kubectl request
/// and admin action is one audit line in an owner-only file; a tenant's
/// admin reads its tenant's lines only, an operator any.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn audit_lines_for_every_path_read_per_tenant() {
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let log = dir.path().join("audit.log");
    let target = otter_hub::audit::Target::File {
        path: log.clone(),
        max_bytes: 1 << 20,
    };
    let hub = TestHub::start_with(dir, None, |c| c.audit_log = Some(target)).await;
    let root = hub.admin_token.clone();
    let channel = hub.channel().await;
    let (ann, gil) = acme_and_globex(&hub, &root).await;
    let mel = mint(&hub, &ann, json!({"name": "mel"})).await;
    let join = hub.hub.mint_join_token_in("acme-1", "acme").unwrap();
    let _agent = start_agent(&hub, "acme-1", "a1", &join, TransportKind::H2);
    wait_connected(&channel, &ann, 1).await;
    assert_eq!(
        grpc_get(&channel, &mel, "acme-1").await,
        Ok("otter:mel".to_owned())
    );
    let (code, _) = grpc_get(&channel, &mel, "no-such-cluster")
        .await
        .unwrap_err();
    assert_eq!(code, tonic::Code::NotFound);
    kube_get(&hub, &mel, "acme-1").await;

    // Anyone may call Register: a refused one, naming acme's cluster, is
    // not written into acme's view.
    let (_, csr) = otter_pki::csr::generate("acme-1", "forged").unwrap();
    let refused = LinkServiceClient::new(channel.clone())
        .register(otter_proto::link::v1::RegisterRequest {
            cluster: Some("acme-1".into()),
            csr: Some(csr.into_bytes()),
            agent_id: Some("forged".into()),
            agent_version: Some("v0.1.0".into()),
            join_token: Some("otj_0123456789abcdef_nope".into()),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unauthenticated);

    // The writer is asynchronous: wait for the kubectl line.
    let read = |token: String, query: &'static str| {
        let hub = &hub;
        async move {
            let (status, text) = admin(
                hub,
                &token,
                http::Method::GET,
                &format!("/admin/v1/audit{query}"),
                None,
            )
            .await;
            let v: Value = serde_json::from_str(&text).unwrap_or(json!({"raw": text}));
            (status, v["events"].as_array().cloned().unwrap_or_default())
        }
    };
    otter_e2e::double::wait_until(
        async || {
            read(ann.clone(), "")
                .await
                .1
                .iter()
                .any(|e| e["kind"] == "kube")
        },
        "the kubectl request's audit line",
    )
    .await;
    let (status, lines) = read(ann.clone(), "?since=600").await;
    assert_eq!(status, 200);
    assert!(lines.iter().all(|e| e["tenant"] == "acme"), "{lines:?}");
    let has = |kind: &str, pred: &dyn Fn(&Value) -> bool| {
        lines.iter().any(|e| e["kind"] == kind && pred(e))
    };
    assert!(has("register", &|e| e["action"] == "enroll"
        && e["cluster"] == "acme-1"
        && e["code"] == "registered"));
    assert!(has("tunnel", &|e| e["code"] == "admitted"
        && e["cluster"] == "acme-1"));
    assert!(has("call", &|e| e["user"] == "otter:mel"
        && e["action"] == "/otterscale.resource.v1.ResourceService/Get"
        && e["code"] == "Ok"
        && e["remote"]
            .as_str()
            .is_some_and(|r| r.starts_with("127.0.0.1:"))));
    assert!(has("kube", &|e| e["user"] == "otter:mel"
        && e["action"] == "GET /api/v1/namespaces"
        && e["code"].as_str().is_some()));
    assert!(has("admin", &|e| e["user"] == "otter:ann"
        && e["action"] == "POST /admin/v1/tokens"
        && e["code"] == "200"));
    assert!(
        !lines.iter().any(|e| e["user"] == "agent:forged"),
        "{lines:?}"
    );
    // No line leaks another tenant's, or a refused name's.
    assert!(!lines.iter().any(|e| e["cluster"] == "no-such-cluster"));
    // Another tenant's admin sees none of it, and may not ask.
    let (status, theirs) = read(gil.clone(), "").await;
    assert_eq!(status, 200);
    assert!(theirs.iter().all(|e| e["tenant"] == "globex"), "{theirs:?}");
    assert!(!theirs.iter().any(|e| e["cluster"] == "acme-1"));
    let (status, _) = read(gil.clone(), "?tenant=acme").await;
    assert_eq!(status, 403);
    let (status, _) = read(mel.clone(), "").await;
    assert_eq!(status, 403, "members do not read the audit log");
    // The operator reads everything, the refused call included.
    let (status, all) = read(root.clone(), "").await;
    assert_eq!(status, 200);
    assert!(
        all.iter()
            .any(|e| e["cluster"] == "no-such-cluster" && e["code"] == "NotFound")
    );
    assert!(all.iter().any(|e| e["user"] == "agent:forged"
        && e["code"] == "unauthenticated"
        && e["tenant"].is_null()));
    // However far back one asks, the answer is bounded, not an error.
    let (status, _) = read(root.clone(), "?since=99999999999999").await;
    assert_eq!(status, 200);
    let mode =
        std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&log).unwrap().permissions());
    assert_eq!(mode & 0o777, 0o600);
    // No token reaches the file.
    let text = std::fs::read_to_string(&log).unwrap();
    for secret in [&ann, &gil, &mel, &root] {
        assert!(!text.contains(secret.as_str()));
    }
    hub.hub.shutdown().await;
}
