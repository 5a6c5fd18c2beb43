//! Identity isolation, end to end against the Kubernetes API test server:
//! identity a client claims in headers (`Impersonate-*`, a second
//! `Authorization`, look-alike headers) is dropped at the hub on the gRPC,
//! Connect and kubectl paths, so the apiserver sees the verified caller;
//! one user cannot drive another's port-forward; and the agent's health
//! listener serves no RPCs.

use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use otter_e2e::{
    http_call,
    kube::{KubeEnv, sim_config, within},
    with_token,
};
use otter_proto::{resource::v1 as res, runtime::v1 as pb};
use tonic::Code;

/// Headers a client might send to pass for someone else.
const CLAIMS: [(&str, &str); 6] = [
    ("impersonate-user", "admin"),
    ("impersonate-group", "system:masters"),
    ("impersonate-uid", "0"),
    ("impersonate-extra-scopes", "everything"),
    ("x-otter-user", "admin"),
    ("x-remote-user", "admin"),
];

fn claiming<T>(msg: T, token: &str, admin_token: &str) -> tonic::Request<T> {
    let mut req = with_token(msg, token);
    for (name, value) in CLAIMS {
        req.metadata_mut().append(name, value.parse().unwrap());
    }
    // A second credential after the caller's own: the hub must not pick it.
    req.metadata_mut().append(
        "authorization",
        format!("Bearer {admin_token}").parse().unwrap(),
    );
    req
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claimed_identity_headers_are_dropped_on_every_path() {
    let cfg = sim_config()
        .allow(
            "group:otter:default:devs",
            &["get", "list"],
            &["pods"],
            &["default"],
        )
        .pod("default", "web", &["app"]);
    let env = KubeEnv::start(cfg).await;
    let c = env.cluster.clone();
    let alice = env.token_for("alice", &["devs"]);
    let secret = res::GetRequest {
        cluster: Some(c.clone()),
        group: Some(String::new()),
        version: Some("v1".into()),
        resource: Some("secrets".into()),
        namespace: Some("default".into()),
        name: Some("s".into()),
    };

    // gRPC: alice may read pods, not secrets, whatever the headers say.
    let mut resources = env.resources();
    resources
        .get(claiming(
            res::GetRequest {
                resource: Some("pods".into()),
                name: Some("web".into()),
                ..secret.clone()
            },
            &alice,
            env.admin_token(),
        ))
        .await
        .unwrap();
    let e = resources
        .get(claiming(secret.clone(), &alice, env.admin_token()))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    assert!(e.message().contains("User \"otter:alice\""), "{e:?}");

    // Connect (JSON over HTTP/1.1), the same headers.
    let mut req = http::Request::post("/otterscale.resource.v1.ResourceService/Get")
        .header("host", "localhost")
        .header("content-type", "application/json")
        .header("authorization", format!("Bearer {alice}"))
        .header("authorization", format!("Bearer {}", env.admin_token()));
    for (name, value) in CLAIMS {
        req = req.header(name, value);
    }
    let body = r#"{"cluster":"edge-1","group":"","version":"v1","resource":"secrets","namespace":"default","name":"s"}"#;
    let (status, _, body) = http_call(
        env.hub.hub.api_addr,
        env.hub.hub.ca_pem(),
        false,
        req.body(http_body_util::Full::new(Bytes::from(body)))
            .unwrap(),
    )
    .await;
    assert_eq!(status, 403, "{}", String::from_utf8_lossy(&body));
    let err: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(err["code"], "permission_denied");
    assert!(
        err["message"]
            .as_str()
            .unwrap()
            .contains("User \"otter:alice\""),
        "{err}"
    );

    // kubectl's path: the apiserver's own answer to "who am I".
    let mut req =
        http::Request::post("/clusters/edge-1/apis/authentication.k8s.io/v1/selfsubjectreviews")
            .header("host", "localhost")
            .header("content-type", "application/json")
            .header("authorization", format!("Bearer {alice}"))
            .header("authorization", format!("Bearer {}", env.admin_token()));
    for (name, value) in CLAIMS {
        req = req.header(name, value);
    }
    let review = r#"{"apiVersion":"authentication.k8s.io/v1","kind":"SelfSubjectReview"}"#;
    let (status, _, body) = http_call(
        env.hub.hub.api_addr,
        env.hub.hub.ca_pem(),
        true,
        req.body(http_body_util::Full::new(Bytes::from(review)))
            .unwrap(),
    )
    .await;
    assert_eq!(status, 201, "{:?}", String::from_utf8_lossy(&body));
    let review: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let info = &review["status"]["userInfo"];
    assert_eq!(info["username"], "otter:alice", "{review}");
    let groups: Vec<&str> = info["groups"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|g| g.as_str())
        .collect();
    assert!(groups.contains(&"otter:default:devs"), "{groups:?}");
    assert!(!groups.contains(&"system:masters"), "{groups:?}");
    assert!(info["uid"].as_str().is_none_or(|u| u != "0"), "{info}");
    assert!(info["extra"].get("scopes").is_none(), "{info}");
    env.shutdown().await;
}

/// A TCP echo server on loopback.
async fn echo_server() -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut sock, _)) = listener.accept().await {
            tokio::spawn(async move {
                let (mut r, mut w) = sock.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
            });
        }
    });
    addr
}

/// Bob can neither write into Alice's port-forward (not even claiming to
/// be her in headers) nor close or resize it; Alice's stream carries only
/// her own bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_port_forward_belongs_to_its_opener() {
    let cfg = sim_config().pod("default", "web", &["app"]).allow(
        "group:otter:default:devs",
        &["*"],
        &["pods", "pods/portforward"],
        &["default"],
    );
    let env = KubeEnv::start(cfg).await;
    env.sim
        .add_pod_port("default", "web", 8080, echo_server().await);
    let alice = env.token_for("alice", &["devs"]);
    let bob = env.token_for("bob", &["devs"]);
    let mut rt = env.runtime();
    let mut s = rt
        .port_forward(with_token(
            pb::PortForwardRequest {
                cluster: Some(env.cluster.clone()),
                namespace: Some("default".into()),
                name: Some("web".into()),
                port: Some(8080),
            },
            &alice,
        ))
        .await
        .unwrap()
        .into_inner();
    let id = within("session id", s.next())
        .await
        .unwrap()
        .unwrap()
        .session_id
        .unwrap();
    let write = |data: &[u8]| pb::WritePortForwardRequest {
        session_id: Some(id.clone()),
        data: Some(data.to_vec()),
    };

    let e = rt
        .write_port_forward(with_token(write(b"bob was here"), &bob))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    let mut as_alice = with_token(write(b"bob again"), &bob);
    as_alice
        .metadata_mut()
        .insert("impersonate-user", "alice".parse().unwrap());
    as_alice
        .metadata_mut()
        .insert("x-otter-user", "alice".parse().unwrap());
    let e = rt.write_port_forward(as_alice).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    let e = rt
        .resize_tty(with_token(
            pb::ResizeTtyRequest {
                session_id: Some(id.clone()),
                rows: Some(1),
                cols: Some(1),
            },
            &bob,
        ))
        .await
        .unwrap_err();
    assert!(
        matches!(e.code(), Code::PermissionDenied | Code::NotFound),
        "{e:?}"
    );

    // Alice's own bytes come back, and nothing of Bob's ever did. Her
    // write claims a place on an upload path the hub never opened: were the
    // claim to reach the agent, it would hold the bytes for a write 6 that
    // never comes (30 s) and then fail them.
    let mut placed = with_token(write(b"alice"), &alice);
    placed.metadata_mut().insert(
        otter_tunnel::frame::UPLOAD_ORDER_HEADER,
        "ffff/7".parse().unwrap(),
    );
    within(
        "a write with a claimed upload place",
        rt.write_port_forward(placed),
    )
    .await
    .unwrap();
    let mut back = Vec::new();
    within("echo", async {
        while back.len() < 5 {
            back.extend(s.next().await.unwrap().unwrap().data.unwrap_or_default());
        }
    })
    .await;
    assert_eq!(back, b"alice");
    let more = tokio::time::timeout(Duration::from_millis(300), s.next()).await;
    assert!(more.is_err(), "unexpected data: {more:?}");
    drop(s);
    env.shutdown().await;
}

/// The agent takes identity only from the hub's tunnel: its health
/// listener answers the probes and nothing else, whatever is sent to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_health_listener_serves_no_rpcs() {
    let env = KubeEnv::start(sim_config().pod("default", "web", &["app"])).await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    env.agent.serve_health(listener);

    let plain = |req: http::Request<http_body_util::Full<Bytes>>| async move {
        use http_body_util::BodyExt;
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (mut send, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tcp))
                .await
                .unwrap();
        tokio::spawn(conn);
        let resp = send.send_request(req).await.unwrap();
        let status = resp.status();
        (status, resp.into_body().collect().await.unwrap().to_bytes())
    };
    let (status, body) = plain(
        http::Request::get("/healthz")
            .header("host", "agent")
            .body(Default::default())
            .unwrap(),
    )
    .await;
    assert_eq!((status.as_u16(), &body[..]), (200, &b"ok"[..]));

    // A gRPC request as HTTP/1.1, with every identity header there is.
    let mut req = http::Request::post("/otterscale.resource.v1.ResourceService/Get")
        .header("host", "agent")
        .header("content-type", "application/grpc")
        .header("te", "trailers");
    for (name, value) in CLAIMS {
        req = req.header(name, value);
    }
    let (status, _) = plain(
        req.body(http_body_util::Full::new(Bytes::from_static(&[
            0, 0, 0, 0, 0,
        ])))
        .unwrap(),
    )
    .await;
    assert_eq!(status, 404);

    // And as gRPC proper (HTTP/2 without TLS): no such service there.
    let result = async {
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect_timeout(Duration::from_secs(5))
            .connect()
            .await
            .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
        otter_proto::resource::v1::resource_service_client::ResourceServiceClient::new(channel)
            .get(with_token(
                res::GetRequest {
                    cluster: Some(env.cluster.clone()),
                    ..Default::default()
                },
                env.admin_token(),
            ))
            .await
    };
    let e = within("gRPC to the health port", result).await.unwrap_err();
    assert_ne!(e.code(), Code::Ok);
    assert_ne!(e.code(), Code::PermissionDenied, "reached a service: {e:?}");
    assert_ne!(e.code(), Code::NotFound, "reached a service: {e:?}");
    env.shutdown().await;
}

/// A hub that is compromised sends the agent a stream head naming whom it
/// likes. The agent's ceiling, from the manifest the customer applied
/// (here tenant `default`'s), refuses every identity outside it, on the
/// gRPC services and on the kubectl proxy, before the apiserver hears of
/// it; the identities the hub does send pass.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_refuses_identities_outside_its_ceiling() {
    use http_body_util::BodyExt;
    use prost::Message;
    let env = KubeEnv::start(sim_config().pod("default", "web", &["app"])).await;
    let hub = &env.hub.hub;
    let insider = otter_hub::auth::Principal {
        tenants: [("default".to_owned(), otter_hub::tenancy::Role::Admin)].into(),
        ..Default::default()
    };
    let who = |user: &str, groups: &[&str]| otter_tunnel::Caller {
        user: user.into(),
        groups: groups.iter().map(|g| g.to_string()).collect(),
        ..Default::default()
    };
    let get = res::GetRequest {
        cluster: Some(env.cluster.clone()),
        group: Some(String::new()),
        version: Some("v1".into()),
        resource: Some("pods".into()),
        namespace: Some("default".into()),
        name: Some("web".into()),
    };
    let mut framed = vec![0u8];
    framed.extend_from_slice(&(get.encoded_len() as u32).to_be_bytes());
    framed.extend_from_slice(&get.encode_to_vec());
    // (gRPC status, kubectl proxy HTTP status) the agent answers `caller`.
    let cluster = env.cluster.clone();
    let ask = |caller: otter_tunnel::Caller| {
        let (framed, insider, cluster) = (framed.clone(), insider.clone(), cluster.clone());
        async move {
            let call = hub
                .state
                .registry
                .open_call(
                    &insider,
                    &cluster,
                    &*hub.state.store,
                    &hub.state.config.replica,
                )
                .await
                .unwrap();
            let req = http::Request::post("/otterscale.resource.v1.ResourceService/Get")
                .header("content-type", "application/grpc")
                .header("te", "trailers")
                .body(http_body_util::Full::new(Bytes::from(framed)))
                .unwrap();
            let resp = otter_tunnel::http::forward(
                call.stream,
                "",
                Some(caller.clone()),
                req,
                Default::default(),
                None,
            )
            .await
            .unwrap();
            let in_head = resp.headers().get("grpc-status").cloned();
            let body = resp.into_body().collect().await.unwrap();
            let grpc = in_head
                .or_else(|| body.trailers().and_then(|t| t.get("grpc-status").cloned()))
                .map(|v| v.to_str().unwrap().to_owned())
                .unwrap_or_default();
            let call = hub
                .state
                .registry
                .open_call(
                    &insider,
                    &cluster,
                    &*hub.state.store,
                    &hub.state.config.replica,
                )
                .await
                .unwrap();
            let req = http::Request::get("/api/v1/namespaces/default/pods/web")
                .body(http_body_util::Full::new(Bytes::new()))
                .unwrap();
            let resp = otter_tunnel::http::forward(
                call.stream,
                otter_tunnel::frame::TARGET_KUBE,
                Some(caller),
                req,
                Default::default(),
                None,
            )
            .await
            .unwrap();
            (grpc, resp.status().as_u16())
        }
    };
    let ok = (Code::Ok as i32).to_string();
    let denied = (Code::PermissionDenied as i32).to_string();
    // What the hub sends for the first-start admin passes.
    assert_eq!(
        ask(who(
            "otter:admin",
            &["otter:default:members", "otter:default:admins"]
        ))
        .await,
        (ok, 200)
    );
    for (user, groups) in [
        ("otter:admin", &["system:masters"][..]),
        ("system:admin", &[][..]),
        ("system:serviceaccount:kube-system:default", &[][..]),
        ("admin", &["otter:default:admins"][..]),
        ("otter:admin", &["otter:other:admins"][..]),
        ("otter:admin", &["cluster-admins"][..]),
    ] {
        assert_eq!(
            ask(who(user, groups)).await,
            (denied.clone(), 403),
            "{user} {groups:?}"
        );
    }
    env.shutdown().await;
}
