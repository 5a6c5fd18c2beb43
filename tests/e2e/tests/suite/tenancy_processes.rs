//! Tenancy through the real binaries: the hub and two agents run as
//! processes (acme's cluster `edge-0` over QUIC, globex's `edge-1` over
//! HTTP/2), with real kubectl. Another tenant's cluster answers like an
//! absent one on every path, and a revoked or expired hub token ends the
//! streams and sessions it opened (a Watch, an exec, kubectl's watch and
//! exec), each with its audit lines, while other tokens' streams go on.

use std::{
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use futures::StreamExt;
use otter_e2e::{
    admin_call,
    double::{WAIT, get, wait_until},
    fleet::Fleet,
    kube::sim_config,
    mint_via_admin, with_token,
};
use otter_proto::{
    fleet::v1::{
        FanOut, LabelLinkRequest, ListResourcesRequest, fleet_service_client::FleetServiceClient,
        list_resources_response,
    },
    resource::v1::{WatchRequest, resource_service_client::ResourceServiceClient},
    runtime::v1::{self as pb, runtime_service_client::RuntimeServiceClient},
};
use serde_json::{Value, json};
use tonic::{Code, transport::Channel};

fn watch_req(cluster: &str) -> WatchRequest {
    WatchRequest {
        cluster: Some(cluster.into()),
        version: Some("v1".into()),
        resource: Some("pods".into()),
        namespace: Some("default".into()),
        ..Default::default()
    }
}

/// A Watch that has delivered its first event.
async fn open_watch(
    channel: &Channel,
    token: &str,
    cluster: &str,
) -> tonic::Streaming<otter_proto::resource::v1::WatchEvent> {
    try_watch(channel, token, cluster)
        .await
        .unwrap_or_else(|| panic!("a Watch of {cluster} with its first event"))
}

/// A Watch that has delivered its first event, or `None` when refused.
async fn try_watch(
    channel: &Channel,
    token: &str,
    cluster: &str,
) -> Option<tonic::Streaming<otter_proto::resource::v1::WatchEvent>> {
    let mut s = ResourceServiceClient::new(channel.clone())
        .watch(with_token(watch_req(cluster), token))
        .await
        .ok()?
        .into_inner();
    tokio::time::timeout(WAIT, s.next()).await.ok()??.ok()?;
    Some(s)
}

/// The code and message of a refused call, with the cluster's name taken
/// out.
fn status_of<T>(r: Result<T, tonic::Status>) -> (Code, String) {
    let s = r.map(|_| ()).unwrap_err();
    let message = s
        .message()
        .replace("edge-0", "<c>")
        .replace("no-such", "<c>");
    (s.code(), message)
}

/// kubectl 1.33 against the hub's proxy for `cluster`, as `token`.
fn kubectl(
    kubectl: &std::path::Path,
    dir: &std::path::Path,
    fleet: &Fleet,
    token: &str,
) -> Command {
    let ca = dir.join("hub-ca.pem");
    std::fs::write(&ca, &fleet.ca_pem).unwrap();
    let config = dir.join(format!("{}.kubeconfig", &token[..12]));
    std::fs::write(
        &config,
        format!(
            "apiVersion: v1\nkind: Config\ncurrent-context: c\n\
             clusters: [{{name: c, cluster: {{server: \"https://localhost:{}/clusters/edge-0\", certificate-authority: {}}}}}]\n\
             users: [{{name: u, user: {{token: {token}}}}}]\n\
             contexts: [{{name: c, context: {{cluster: c, user: u}}}}]\n",
            fleet.api,
            ca.display()
        ),
    )
    .unwrap();
    let mut cmd = Command::new(kubectl);
    cmd.arg("--kubeconfig").arg(&config);
    cmd
}

/// Waits (bounded) for a child to exit; its code.
fn exit_of(what: &str, child: &mut Child) -> i32 {
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status.code().unwrap_or(-1);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("{what} still running {WAIT:?} after its token was revoked");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The test server both tenants' members may use.
async fn sim_of_two_tenants() -> kube_sim::KubeSim {
    kube_sim::KubeSim::start(
        sim_config()
            .pod("default", "web", &["app"])
            .allow("group:otter:acme:members", &["*"], &["*"], &["*"])
            .allow("group:otter:globex:members", &["*"], &["*"], &["*"]),
    )
    .await
    .expect("kube-sim")
}

/// The tenants' first admins, named by the hub's operator: acme's ann and
/// globex's gil.
async fn first_admins(fleet: &Fleet) -> (String, String) {
    let (addr, ca, root) = (fleet.api_addr(), fleet.ca_pem.as_str(), &fleet.admin_token);
    let admin = |name: &str, tenant: &str| {
        let body = json!({"name": name, "tenant": tenant, "role": "admin"});
        async move { mint_via_admin(addr, ca, root, body).await.0 }
    };
    (admin("ann", "acme").await, admin("gil", "globex").await)
}

/// kubectl's list of `cluster`'s pods through the hub's proxy, as
/// `token`: the status and the body.
async fn list_pods(
    addr: std::net::SocketAddr,
    ca: &str,
    token: &str,
    cluster: &str,
) -> (u16, String) {
    admin_call(
        addr,
        ca,
        token,
        http::Method::GET,
        &format!("/clusters/{cluster}/api/v1/namespaces/default/pods"),
        None,
    )
    .await
}

/// A Get of the pod `web` on `cluster` as `token`.
fn get_web(token: &str, cluster: &str) -> tonic::Request<otter_proto::resource::v1::GetRequest> {
    let mut req = get(cluster, "web");
    req.namespace = Some("default".into());
    with_token(req, token)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_and_revocation_through_the_real_binaries() {
    let sim = sim_of_two_tenants().await;
    let logs = tempfile::tempdir().unwrap();
    let log = logs.path().join("audit.log").display().to_string();
    let fleet = Fleet::start_with(
        &sim,
        &["quic", "h2"],
        &["acme", "globex"],
        &["--audit-log", &log],
    )
    .await;
    let channel = fleet.channel().await;
    fleet.all_connected(&channel).await;
    let (addr, ca, root) = (fleet.api_addr(), fleet.ca_pem.as_str(), &fleet.admin_token);
    let mint = |by: String, body: Value| async move { mint_via_admin(addr, ca, &by, body).await };
    let (ann, gil) = first_admins(&fleet).await;
    let (mel, mel_id) = mint(ann.clone(), json!({"name": "mel"})).await;
    let (rex, _) = mint(ann.clone(), json!({"name": "rex"})).await;

    // Cross-tenant, against the hub process: gil's calls for acme's
    // cluster get what a call for an absent cluster gets.
    let mut res = ResourceServiceClient::new(channel.clone());
    let mut rt = RuntimeServiceClient::new(channel.clone());
    let get_as = get_web;
    let foreign = status_of(res.get(get_as(&gil, "edge-0")).await);
    let absent = status_of(res.get(get_as(&gil, "no-such")).await);
    assert_eq!(foreign.0, Code::NotFound, "{foreign:?}");
    assert_eq!(foreign, absent, "Get");
    let foreign = status_of(res.watch(with_token(watch_req("edge-0"), &gil)).await);
    let absent = status_of(res.watch(with_token(watch_req("no-such"), &gil)).await);
    assert_eq!(foreign, absent, "Watch");
    let exec = |cluster: &str| pb::ExecuteTtyRequest {
        cluster: Some(cluster.into()),
        namespace: Some("default".into()),
        name: Some("web".into()),
        command: vec!["cat".into()],
        tty: Some(false),
        ..Default::default()
    };
    let foreign = status_of(rt.execute_tty(with_token(exec("edge-0"), &gil)).await);
    let absent = status_of(rt.execute_tty(with_token(exec("no-such"), &gil)).await);
    assert_eq!(foreign, absent, "ExecuteTTY");
    let kube = |token: String, cluster: &'static str| async move {
        let (status, body) = list_pods(addr, ca, &token, cluster).await;
        (status, body.replace(cluster, "<c>"))
    };
    let foreign = kube(gil.clone(), "edge-0").await;
    assert_eq!(foreign.0, 404, "{foreign:?}");
    assert_eq!(foreign, kube(gil.clone(), "no-such").await, "kubectl proxy");
    assert_eq!(kube(mel.clone(), "edge-0").await.0, 200);
    assert_eq!(
        kube(gil.clone(), "edge-1").await.0,
        200,
        "gil's own cluster"
    );
    // Fan-out: a selector that matches every link reaches gil's own
    // cluster only, and acme's link cannot be labelled, or told from an
    // absent one, by gil; ann labels her own.
    let mut fleet_api = FleetServiceClient::new(channel.clone());
    let label = |token: &str, cluster: &str| {
        with_token(
            LabelLinkRequest {
                cluster: Some(cluster.to_owned()),
                labels: [("env".to_owned(), "prod".to_owned())].into(),
                remove: vec![],
            },
            token,
        )
    };
    let foreign = status_of(fleet_api.label_link(label(&gil, "edge-0")).await);
    let absent = status_of(fleet_api.label_link(label(&gil, "no-such")).await);
    assert_eq!(foreign.0, Code::NotFound, "{foreign:?}");
    assert_eq!(
        foreign.1.replace("edge-0", "<c>"),
        absent.1.replace("no-such", "<c>"),
        "LabelLink"
    );
    fleet_api
        .label_link(label(&ann, "edge-0"))
        .await
        .expect("ann labels edge-0");
    fleet_api
        .label_link(label(&gil, "edge-1"))
        .await
        .expect("gil labels edge-1");
    for (token, selector, want) in [
        (&gil, "", vec!["edge-1"]),
        (&gil, "env=prod", vec!["edge-1"]),
        (&gil, "!env", vec![]),
        (&ann, "env=prod", vec!["edge-0"]),
        (root, "", vec![]),
    ] {
        let mut stream = fleet_api
            .list_resources(with_token(
                ListResourcesRequest {
                    fan_out: Some(FanOut {
                        link_selector: Some(selector.into()),
                        timeout_millis: None,
                    }),
                    version: Some("v1".into()),
                    resource: Some("pods".into()),
                    ..Default::default()
                },
                token,
            ))
            .await
            .expect("fan-out")
            .into_inner();
        let mut reached = Vec::new();
        while let Some(m) = stream.next().await {
            let m = m.expect("answer");
            assert!(
                matches!(m.result, Some(list_resources_response::Result::List(_))),
                "{m:?}"
            );
            reached.push(m.cluster.unwrap());
        }
        assert_eq!(reached, want, "{selector:?}");
    }

    // mel opens a Watch and an exec; rex a Watch of its own.
    let mut mel_watch = open_watch(&channel, &mel, "edge-0").await;
    let mut rex_watch = open_watch(&channel, &rex, "edge-0").await;
    let mut mel_exec = rt
        .execute_tty(with_token(exec("edge-0"), &mel))
        .await
        .expect("exec")
        .into_inner();
    let session = mel_exec.next().await.unwrap().unwrap().session_id.unwrap();
    rt.write_tty(with_token(
        pb::WriteTtyRequest {
            session_id: Some(session.clone()),
            stdin: Some(b"hi\n".to_vec()),
        },
        &mel,
    ))
    .await
    .expect("write");
    // gil cannot type into mel's session even knowing its id.
    let write_as = |token: &str, id: &str| {
        with_token(
            pb::WriteTtyRequest {
                session_id: Some(id.to_owned()),
                stdin: Some(b"x".to_vec()),
            },
            token,
        )
    };
    let foreign = status_of(rt.write_tty(write_as(&gil, &session)).await);
    let absent_id = session.replace("edge-0", "no-such");
    let absent = status_of(rt.write_tty(write_as(&gil, &absent_id)).await);
    assert_eq!(foreign.0, Code::NotFound, "{foreign:?}");
    assert_eq!(foreign.0, absent.0, "WriteTTY");

    // The same through kubectl 1.33: a watch and an exec holding stdin.
    let tools = tempfile::tempdir().unwrap();
    let kubectl_children = match otter_e2e::kubectl_133() {
        None => {
            otter_e2e::tool_missing("kubectl 1.33");
            None
        }
        Some(bin) => {
            let watch = kubectl(&bin, tools.path(), &fleet, &mel)
                .args(["get", "pods", "--watch", "--request-timeout=0"])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap();
            let exec = kubectl(&bin, tools.path(), &fleet, &mel)
                .args(["exec", "-i", "web", "-c", "app", "--", "cat"])
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap();
            Some((watch, exec))
        }
    };
    let read_audit = |token: String, query: &'static str| async move {
        let (status, text) = admin_call(
            addr,
            ca,
            &token,
            http::Method::GET,
            &format!("/admin/v1/audit{query}"),
            None,
        )
        .await;
        let v: Value = serde_json::from_str(&text).unwrap_or(json!({ "raw": text }));
        (status, v["events"].as_array().cloned().unwrap_or_default())
    };
    if kubectl_children.is_some() {
        wait_until(
            async || {
                let (_, lines) = read_audit(ann.clone(), "").await;
                let kube = |pred: &dyn Fn(&Value) -> bool| {
                    lines.iter().any(|e| e["user"] == "otter:mel" && pred(e))
                };
                let exec = |e: &Value| e["action"].as_str().is_some_and(|a| a.ends_with("/exec"));
                kube(&|e| e["kind"] == "session" && e["phase"] == "open" && exec(e))
                    && kube(&|e| {
                        e["kind"] == "kube"
                            && e["action"] == "GET /api/v1/namespaces/default/pods"
                            && e["code"] == "200"
                    })
            },
            "kubectl's exec and watch through the hub",
        )
        .await;
        // The watch's answer head is logged before its body flows: give
        // kubectl a moment to be inside it.
        tokio::time::sleep(Duration::from_millis(300)).await;
    }

    // ann revokes mel's token: every stream mel opened ends, at once.
    let revoked = Instant::now();
    otter_e2e::revoke_via_admin(addr, ca, &ann, &mel_id).await;
    let ended = otter_e2e::end_of_stream("mel's Watch", &mut mel_watch).await;
    assert_eq!(ended.code(), Code::Unauthenticated, "{ended:?}");
    assert!(ended.message().contains("revoked"), "{ended:?}");
    let ended = otter_e2e::end_of_stream("mel's exec", &mut mel_exec).await;
    assert_eq!(ended.code(), Code::Unauthenticated, "{ended:?}");
    eprintln!(
        "gRPC streams ended {:?} after the revocation",
        revoked.elapsed()
    );
    if let Some((mut watch, mut exec)) = kubectl_children {
        let (w, e) = tokio::task::block_in_place(|| {
            (
                exit_of("kubectl get --watch", &mut watch),
                exit_of("kubectl exec", &mut exec),
            )
        });
        eprintln!(
            "kubectl's watch (exit {w}) and exec (exit {e}) ended {:?} after the revocation",
            revoked.elapsed()
        );
        assert_ne!(e, 0, "kubectl exec ends with an error");
    }
    // rex's Watch goes on, and rex's calls work.
    match tokio::time::timeout(Duration::from_millis(500), rex_watch.next()).await {
        Err(_) | Ok(Some(Ok(_))) => {}
        other => panic!("rex's Watch ended with mel's token: {other:?}"),
    }
    res.get(get_as(&rex, "edge-0"))
        .await
        .expect("rex still reaches edge-0");
    // The agent's exec session ended with its stream.
    wait_until(
        async || {
            otter_e2e::fleet::metric(
                &fleet.agent_metrics(0).await,
                "otter_agent_sessions{kind=\"exec\"}",
            ) == 0.0
        },
        "the agent's exec session to end",
    )
    .await;

    // An expiring token's Watch ends when the token does.
    let (brief, _) = mint(ann.clone(), json!({"name": "temp", "ttl_secs": 2})).await;
    let mut brief_watch = open_watch(&channel, &brief, "edge-0").await;
    let ended = otter_e2e::end_of_stream("the expiring token's Watch", &mut brief_watch).await;
    assert_eq!(ended.code(), Code::Unauthenticated, "{ended:?}");
    assert!(ended.message().contains("expired"), "{ended:?}");

    // The audit log says who opened what and why it ended.
    let closed = |lines: &[Value], user: &str, kind: &str, reason: &str| {
        lines.iter().any(|e| {
            e["user"] == user && e["kind"] == kind && e["reason"] == reason && e["tenant"] == "acme"
        })
    };
    wait_until(
        async || {
            let (_, lines) = read_audit(ann.clone(), "").await;
            closed(&lines, "otter:temp", "call", "expired")
        },
        "the expired Watch's audit line",
    )
    .await;
    let (_, lines) = read_audit(ann.clone(), "").await;
    let exec_method = "/otterscale.runtime.v1.RuntimeService/ExecuteTTY";
    let session_lines: Vec<&Value> = lines
        .iter()
        .filter(|e| {
            e["kind"] == "session" && e["action"] == exec_method && e["user"] == "otter:mel"
        })
        .collect();
    assert_eq!(session_lines.len(), 2, "open and close: {session_lines:?}");
    assert_eq!(session_lines[0]["phase"], "open");
    assert_eq!(session_lines[1]["phase"], "close");
    assert_eq!(session_lines[1]["code"], "Unauthenticated");
    assert_eq!(session_lines[1]["reason"], "revoked");
    assert!(
        closed(&lines, "otter:mel", "call", "revoked"),
        "the Watch: {lines:?}"
    );
    if otter_e2e::kubectl_133().is_some() {
        assert!(
            lines.iter().any(|e| e["user"] == "otter:mel"
                && e["kind"] == "session"
                && e["phase"] == "close"
                && e["reason"] == "revoked"
                && e["action"]
                    .as_str()
                    .is_some_and(|a| a.ends_with("/pods/web/exec"))),
            "kubectl exec's session: {lines:?}"
        );
    }
    // globex's admin reads none of it.
    let (status, theirs) = read_audit(gil.clone(), "").await;
    assert_eq!(status, 200);
    assert!(theirs.iter().all(|e| e["tenant"] == "globex"), "{theirs:?}");
}

/// One tenant's callers, on all its clusters together, hold at most
/// `--max-calls-per-tenant` calls at once through the hub process: the next
/// is refused at once (ResourceExhausted; kubectl gets 429) while another
/// tenant's calls go on, and every place comes back when its call ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_calls_are_bounded_across_its_clusters_and_others_go_on() {
    const BUDGET: usize = 4;
    let sim = sim_of_two_tenants().await;
    let budget = BUDGET.to_string();
    let fleet = Fleet::start_with(
        &sim,
        &["quic", "h2", "quic"],
        &["acme", "acme", "globex"],
        &["--max-calls-per-tenant", &budget],
    )
    .await;
    let channel = fleet.channel().await;
    fleet.all_connected(&channel).await;
    let (addr, ca) = (fleet.api_addr(), fleet.ca_pem.as_str());
    let (ann, gil) = first_admins(&fleet).await;
    let (mel, _) = mint_via_admin(addr, ca, &ann, json!({"name": "mel"})).await;
    let get_as = get_web;
    let res = ResourceServiceClient::new(channel.clone());
    let kube = |token: String, cluster: &'static str| async move {
        list_pods(addr, ca, &token, cluster).await
    };

    // Two callers of acme, two Watches on each of its clusters.
    let fill = async || {
        let mut held = Vec::new();
        for (token, cluster) in [(&ann, "edge-0"), (&ann, "edge-1"), (&mel, "edge-0")] {
            held.push(open_watch(&channel, token, cluster).await);
        }
        held.push(open_watch(&channel, &mel, "edge-1").await);
        assert_eq!(held.len(), BUDGET);
        held
    };
    let mut held = fill().await;
    for (token, cluster) in [(&ann, "edge-0"), (&mel, "edge-1")] {
        let (code, message) = status_of(res.clone().get(get_as(token, cluster)).await);
        assert_eq!(code, Code::ResourceExhausted, "{message}");
        assert!(message.contains("tenant has 4 calls"), "{message}");
    }
    let refused = status_of(
        res.clone()
            .watch(with_token(watch_req("edge-1"), &ann))
            .await,
    );
    assert_eq!(refused.0, Code::ResourceExhausted, "{refused:?}");
    let (status, body) = kube(mel.clone(), "edge-0").await;
    assert_eq!(status, 429, "{body}");
    assert!(body.contains("TooManyRequests"), "{body}");

    // globex is not held by acme's calls: its own four, a Get among them.
    let mut theirs = Vec::new();
    for _ in 0..BUDGET - 1 {
        theirs.push(open_watch(&channel, &gil, "edge-2").await);
    }
    res.clone()
        .get(get_as(&gil, "edge-2"))
        .await
        .expect("globex's Get beside acme's full budget");
    assert_eq!(kube(gil.clone(), "edge-2").await.0, 200);

    // A place comes back when a call ends.
    drop(held.pop());
    wait_until(
        async || res.clone().get(get_as(&ann, "edge-1")).await.is_ok(),
        "acme's place to come back",
    )
    .await;
    // All of them: acme holds exactly its budget again, no more.
    drop(held);
    let deadline = Instant::now() + WAIT;
    let mut again = Vec::new();
    while again.len() < BUDGET {
        match try_watch(&channel, &ann, "edge-0").await {
            Some(s) => again.push(s),
            None => {
                assert!(Instant::now() < deadline, "acme's places came back");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    let (code, _) = status_of(res.clone().get(get_as(&ann, "edge-0")).await);
    assert_eq!(code, Code::ResourceExhausted);
    drop((again, theirs));
}
