//! The hub's API port for every kind of client: Connect (JSON and binary,
//! unary, GET, streaming), gRPC-Web (binary and text), CORS, feature
//! gating, metrics and health. Requests are plain HTTP here, byte for byte
//! what a browser sends; the client libraries of those ecosystems are run
//! against the same hub in `real_clients.rs`.

use std::{sync::Arc, time::Duration};

use base64::Engine;
use bytes::Bytes;
use http_body_util::Full;
use otter_e2e::{TestHub, double::start_agent, double::wait_connected, http_call};
use otter_proto::link::v1::{ListLinksRequest, ListLinksResponse};
use otter_tunnel::TransportKind;
use prost::Message;
use serde_json::Value;

async fn hub_with_agent(
    tweak: impl FnOnce(&mut otter_hub::HubConfig),
) -> (TestHub, otter_e2e::double::TestAgent) {
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let hub = TestHub::start_with(dir, None, tweak).await;
    let token = hub.hub.mint_join_token("edge-1").unwrap();
    let agent = start_agent(&hub, "edge-1", "a1", &token, TransportKind::H2);
    wait_connected(&hub.channel().await, &hub.admin_token, 1).await;
    (hub, agent)
}

fn post(
    path: &str,
    content_type: &str,
    token: Option<&str>,
    body: impl Into<Bytes>,
) -> http::Request<Full<Bytes>> {
    let mut b = http::Request::post(path)
        .header("content-type", content_type)
        .header("connect-protocol-version", "1");
    if let Some(t) = token {
        b = b.header("authorization", format!("Bearer {t}"));
    }
    b.body(Full::new(body.into())).unwrap()
}

async fn call(
    hub: &TestHub,
    http2: bool,
    req: http::Request<Full<Bytes>>,
) -> (http::StatusCode, http::HeaderMap, Bytes) {
    http_call(hub.hub.api_addr, hub.hub.ca_pem(), http2, req).await
}

fn json_of(b: &Bytes) -> Value {
    serde_json::from_slice(b)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(b)))
}

/// Splits an enveloped body into (flags, payload) pairs.
fn envelopes(mut b: &[u8]) -> Vec<(u8, Vec<u8>)> {
    let mut out = Vec::new();
    while b.len() >= 5 {
        let len = u32::from_be_bytes([b[1], b[2], b[3], b[4]]) as usize;
        out.push((b[0], b[5..5 + len].to_vec()));
        b = &b[5 + len..];
    }
    assert!(b.is_empty(), "trailing bytes after envelopes");
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_unary_json_and_binary_over_http1_and_http2() {
    let (hub, agent) = hub_with_agent(|_| {}).await;
    let t = hub.admin_token.clone();
    for http2 in [false, true] {
        // JSON, canonical mapping: lowerCamelCase, enum names, RFC 3339 times.
        let (status, headers, body) = call(
            &hub,
            http2,
            post(
                "/otterscale.link.v1.LinkService/ListLinks",
                "application/json",
                Some(&t),
                "{}",
            ),
        )
        .await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
        assert_eq!(headers["content-type"], "application/json");
        let v = json_of(&body);
        let link = &v["links"][0];
        assert_eq!(link["cluster"], "edge-1");
        assert_eq!(link["state"], "LINK_STATE_CONNECTED");
        assert_eq!(link["agentId"], "a1");
        assert!(link["lastSeen"].as_str().unwrap().ends_with('Z'), "{link}");

        // A forwarded call: the Struct arrives as a plain JSON object.
        let (status, _, body) = call(
            &hub,
            http2,
            post(
                "/otterscale.resource.v1.ResourceService/Get",
                "application/json",
                Some(&t),
                r#"{"cluster":"edge-1","name":"web"}"#,
            ),
        )
        .await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
        let v = json_of(&body);
        assert_eq!(v["object"]["cluster"], "edge-1");
        assert_eq!(v["object"]["name"], "web");
        assert_eq!(v["object"]["user"], "otter:admin");

        // Binary.
        let (status, headers, body) = call(
            &hub,
            http2,
            post(
                "/otterscale.link.v1.LinkService/ListLinks",
                "application/proto",
                Some(&t),
                ListLinksRequest {}.encode_to_vec(),
            ),
        )
        .await;
        assert_eq!(status, 200);
        assert_eq!(headers["content-type"], "application/proto");
        let links = ListLinksResponse::decode(body).unwrap();
        assert_eq!(links.links[0].cluster.as_deref(), Some("edge-1"));
    }

    // Errors: Connect error JSON with the matching HTTP status.
    let cases = [
        (
            None,
            "/otterscale.link.v1.LinkService/ListLinks",
            "{}",
            401,
            "unauthenticated",
        ),
        (
            Some(t.as_str()),
            "/otterscale.resource.v1.ResourceService/Get",
            r#"{"cluster":"nowhere"}"#,
            404,
            "not_found",
        ),
        (
            Some(t.as_str()),
            "/otterscale.resource.v1.ResourceService/Get",
            r#"{"cluster": 7"#,
            400,
            "invalid_argument",
        ),
        (
            Some(t.as_str()),
            "/otterscale.resource.v1.ResourceService/Get",
            r#"{"nonsense":1}"#,
            400,
            "invalid_argument",
        ),
        (
            Some(t.as_str()),
            "/otterscale.link.v1.LinkService/ListRancherProjects",
            "{}",
            400,
            "failed_precondition",
        ),
    ];
    for (token, path, body, code, name) in cases {
        let (status, headers, b) =
            call(&hub, false, post(path, "application/json", token, body)).await;
        assert_eq!(
            status.as_u16(),
            code,
            "{path} {body}: {}",
            String::from_utf8_lossy(&b)
        );
        assert_eq!(headers["content-type"], "application/json");
        let v = json_of(&b);
        assert_eq!(v["code"], name);
        assert!(!v["message"].as_str().unwrap().is_empty());
    }

    // gzip request body; gzip response when accepted and large enough.
    let mut enc = flate2_encode(br#"{"cluster":"edge-1","name":"zipped"}"#);
    let req = http::Request::post("/otterscale.resource.v1.ResourceService/Get")
        .header("content-type", "application/json")
        .header("content-encoding", "gzip")
        .header("authorization", format!("Bearer {t}"))
        .body(Full::new(Bytes::from(std::mem::take(&mut enc))))
        .unwrap();
    let (status, _, body) = call(&hub, true, req).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(json_of(&body)["object"]["name"], "zipped");

    // A large call both ways (over the size from which the hub rewrites
    // messages on its background threads): the request's JSON, the answer
    // turned into JSON and gzipped there, the same bytes as a small one's.
    let long = "n".repeat(40_000);
    let req = http::Request::post("/otterscale.resource.v1.ResourceService/Get")
        .header("content-type", "application/json")
        .header("accept-encoding", "gzip")
        .header("authorization", format!("Bearer {t}"))
        .body(Full::new(Bytes::from(format!(
            r#"{{"cluster":"edge-1","name":"{long}"}}"#
        ))))
        .unwrap();
    let (status, headers, body) = call(&hub, true, req).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(headers["content-encoding"], "gzip");
    assert!(body.len() < 4_000, "compressed: {} bytes", body.len());
    let v = json_of(&otter_hub::protocol::gunzip(&body, 1 << 20).unwrap());
    assert_eq!(v["object"]["name"], long.as_str());
    assert_eq!(v["object"]["user"], "otter:admin");
    // The same in protobuf: only the gzip is the hub's work here.
    let req = http::Request::post("/otterscale.resource.v1.ResourceService/Get")
        .header("content-type", "application/proto")
        .header("accept-encoding", "gzip")
        .header("authorization", format!("Bearer {t}"))
        .body(Full::new(Bytes::from(
            otter_e2e::double::get("edge-1", &long).encode_to_vec(),
        )))
        .unwrap();
    let (status, headers, body) = call(&hub, true, req).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(headers["content-encoding"], "gzip");
    let answer = otter_hub::protocol::gunzip(&body, 1 << 20).unwrap();
    let answer = otter_proto::resource::v1::Resource::decode(answer).unwrap();
    assert_eq!(otter_e2e::double::field(&answer, "name"), long);

    // GET only for methods without side effects.
    let q = url_encode(r#"{}"#);
    let req = http::Request::get(format!(
        "/otterscale.link.v1.LinkService/ListLinks?connect=v1&encoding=json&message={q}"
    ))
    .header("authorization", format!("Bearer {t}"))
    .body(Full::new(Bytes::new()))
    .unwrap();
    let (status, headers, _) = call(&hub, false, req).await;
    assert_eq!(status, 405);
    assert_eq!(headers["allow"], "POST");

    // Unknown media type and unknown path.
    let (status, _, _) = call(
        &hub,
        false,
        post(
            "/otterscale.link.v1.LinkService/ListLinks",
            "text/plain",
            Some(&t),
            "{}",
        ),
    )
    .await;
    assert_eq!(status, 415);
    let (status, _, _) = call(
        &hub,
        false,
        post("/nope.Service/Method", "application/json", Some(&t), "{}"),
    )
    .await;
    assert_eq!(status, 404);
    agent.agent.shutdown().await;
    hub.hub.shutdown().await;
}

fn flate2_encode(data: &[u8]) -> Vec<u8> {
    // The hub's own gzip is tested by decoding here with an independent
    // implementation: Python's, in real_clients.rs. This side only needs a
    // valid gzip stream, made with the hub's dependency.
    let out = otter_hub::protocol::gzip(data);
    out.to_vec()
}

fn url_encode(s: &str) -> String {
    url::form_urlencoded::byte_serialize(s.as_bytes()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_streaming_and_grpc_web() {
    let (hub, agent) = hub_with_agent(|_| {}).await;
    let t = hub.admin_token.clone();

    // Connect server-streaming with JSON envelopes; the call is cut short by
    // a timeout so the stream ends with an end-of-stream message.
    let mut body = vec![0u8];
    let msg = br#"{"cluster":"edge-1"}"#;
    body.extend_from_slice(&(msg.len() as u32).to_be_bytes());
    body.extend_from_slice(msg);
    let mut req = post(
        "/otterscale.resource.v1.ResourceService/Watch",
        "application/connect+json",
        Some(&t),
        body.clone(),
    );
    req.headers_mut()
        .insert("connect-timeout-ms", "1500".parse().unwrap());
    let (status, headers, b) = call(&hub, true, req).await;
    assert_eq!(status, 200);
    assert_eq!(headers["content-type"], "application/connect+json");
    let env = envelopes(&b);
    assert!(env.len() >= 4, "three events and the end: {env:?}");
    for (i, (flags, payload)) in env[..3].iter().enumerate() {
        assert_eq!(*flags, 0);
        let v: Value = serde_json::from_slice(payload).unwrap();
        assert_eq!(v["type"], "TYPE_ADDED");
        assert_eq!(v["resourceVersion"], i.to_string());
        assert_eq!(v["resource"]["object"]["cluster"], "edge-1");
    }
    let (flags, end) = env.last().unwrap();
    assert_eq!(*flags, 2, "last envelope is the end-of-stream message");
    let end: Value = serde_json::from_slice(end).unwrap();
    assert_eq!(end["error"]["code"], "deadline_exceeded", "{end}");

    // Large events (16 KiB each, rewritten on the hub's background
    // threads) come in their order, each whole.
    let mut req = post(
        "/otterscale.resource.v1.ResourceService/Watch",
        "application/connect+json",
        Some(&t),
        frame(br#"{"cluster":"edge-1","resource":"bulk-small"}"#),
    );
    req.headers_mut()
        .insert("connect-timeout-ms", "400".parse().unwrap());
    let (status, _, b) = call(&hub, true, req).await;
    assert_eq!(status, 200);
    let env = envelopes(&b);
    assert!(
        env.len() >= 3,
        "two events and the end: {} envelopes",
        env.len()
    );
    let (last, events) = env.split_last().unwrap();
    for (i, (flags, payload)) in events.iter().enumerate() {
        assert_eq!(*flags, 0);
        let v: Value = serde_json::from_slice(payload).unwrap();
        assert_eq!(v["resourceVersion"], i.to_string());
        assert_eq!(
            v["resource"]["object"]["payload"].as_str().map(str::len),
            Some(16 * 1024)
        );
    }
    assert_eq!(last.0, 2, "last envelope is the end-of-stream message");

    // Errors before any message still come as an end-of-stream message.
    let mut body = vec![0u8];
    let msg = br#"{"cluster":"nowhere"}"#;
    body.extend_from_slice(&(msg.len() as u32).to_be_bytes());
    body.extend_from_slice(msg);
    let (status, _, b) = call(
        &hub,
        false,
        post(
            "/otterscale.resource.v1.ResourceService/Watch",
            "application/connect+json",
            Some(&t),
            body,
        ),
    )
    .await;
    assert_eq!(status, 200);
    let env = envelopes(&b);
    assert_eq!(env.len(), 1);
    assert_eq!(env[0].0, 2);
    assert_eq!(
        serde_json::from_slice::<Value>(&env[0].1).unwrap()["error"]["code"],
        "not_found"
    );

    // gRPC-Web, binary and text, over HTTP/1.1.
    let request = otter_hub::protocol::frames::encode(0, &ListLinksRequest {}.encode_to_vec());
    for text in [false, true] {
        let (ct, body) = if text {
            (
                "application/grpc-web-text",
                Bytes::from(base64::engine::general_purpose::STANDARD.encode(&request)),
            )
        } else {
            ("application/grpc-web+proto", request.clone())
        };
        let mut req = post(
            "/otterscale.link.v1.LinkService/ListLinks",
            ct,
            Some(&t),
            body,
        );
        req.headers_mut().insert("x-grpc-web", "1".parse().unwrap());
        let (status, headers, b) = call(&hub, false, req).await;
        assert_eq!(status, 200);
        let raw = if text {
            Bytes::from(decode_b64_chunks(&b))
        } else {
            b
        };
        assert!(
            headers["content-type"]
                .to_str()
                .unwrap()
                .starts_with(if text {
                    "application/grpc-web-text"
                } else {
                    "application/grpc-web"
                })
        );
        let env = envelopes(&raw);
        assert_eq!(env.len(), 2, "message and trailers");
        let links = ListLinksResponse::decode(env[0].1.as_slice()).unwrap();
        assert_eq!(links.links[0].cluster.as_deref(), Some("edge-1"));
        assert_eq!(env[1].0, 0x80);
        assert!(String::from_utf8_lossy(&env[1].1).contains("grpc-status: 0"));
    }
    agent.agent.shutdown().await;
    hub.hub.shutdown().await;
}

/// gRPC-Web text bodies are base64 chunks, each padded on its own.
fn decode_b64_chunks(b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut start = 0;
    for i in 0..b.len() {
        let end_of_chunk = b[i] == b'=' && (i + 1 == b.len() || b[i + 1] != b'=');
        if end_of_chunk || i + 1 == b.len() {
            out.extend(
                base64::engine::general_purpose::STANDARD
                    .decode(&b[start..=i])
                    .unwrap(),
            );
            start = i + 1;
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cors_feature_gating_metrics_and_health() {
    let (hub, agent) = hub_with_agent(|c| {
        c.cors_origins = vec!["https://dash.example".into()];
        c.disabled_features = vec!["runtime-enabled".into()];
        c.metrics_listen = Some("127.0.0.1:0".parse().unwrap());
        c.health_listen = Some("127.0.0.1:0".parse().unwrap());
    })
    .await;
    let t = hub.admin_token.clone();

    // CORS preflight from an allowed origin, and from another.
    for (origin, allowed) in [
        ("https://dash.example", true),
        ("https://evil.example", false),
    ] {
        let req = http::Request::builder()
            .method("OPTIONS")
            .uri("/otterscale.link.v1.LinkService/ListLinks")
            .header("origin", origin)
            .header("access-control-request-method", "POST")
            .header(
                "access-control-request-headers",
                "content-type,connect-protocol-version,authorization",
            )
            .body(Full::new(Bytes::new()))
            .unwrap();
        let (status, headers, _) = call(&hub, false, req).await;
        assert_eq!(status, 204);
        assert_eq!(
            headers.get("access-control-allow-origin").is_some(),
            allowed,
            "{origin}"
        );
        if allowed {
            let allow = headers["access-control-allow-headers"].to_str().unwrap();
            for h in ["content-type", "connect-protocol-version", "authorization"] {
                assert!(allow.contains(h), "{allow}");
            }
        }
    }
    let mut req = post(
        "/otterscale.link.v1.LinkService/ListLinks",
        "application/json",
        Some(&t),
        "{}",
    );
    req.headers_mut()
        .insert("origin", "https://dash.example".parse().unwrap());
    let (_, headers, _) = call(&hub, false, req).await;
    assert_eq!(
        headers["access-control-allow-origin"],
        "https://dash.example"
    );
    assert!(
        headers["access-control-expose-headers"]
            .to_str()
            .unwrap()
            .contains("grpc-status")
    );

    // Feature gating: runtime is off, resource and link stay on.
    let (status, _, b) = call(
        &hub,
        false,
        post(
            "/otterscale.runtime.v1.RuntimeService/Scale",
            "application/json",
            Some(&t),
            r#"{"cluster":"edge-1"}"#,
        ),
    )
    .await;
    assert_eq!(status, 501);
    assert_eq!(
        json_of(&b)["message"],
        "feature runtime-enabled is disabled"
    );
    let mut rt = otter_proto::runtime::v1::runtime_service_client::RuntimeServiceClient::new(
        hub.channel().await,
    );
    let e = rt
        .scale(otter_e2e::with_token(
            otter_proto::runtime::v1::ScaleRequest::default(),
            &t,
        ))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unimplemented);
    let (status, _, _) = call(
        &hub,
        false,
        post(
            "/otterscale.resource.v1.ResourceService/Get",
            "application/json",
            Some(&t),
            r#"{"cluster":"edge-1"}"#,
        ),
    )
    .await;
    assert_eq!(status, 200);

    // Health: SERVING (the store is writable, listeners are up).
    let mut health = tonic_health::pb::health_client::HealthClient::new(hub.channel().await);
    let mut serving = false;
    for _ in 0..50 {
        let r = health
            .check(tonic_health::pb::HealthCheckRequest {
                service: String::new(),
            })
            .await
            .unwrap();
        if r.get_ref().status
            == tonic_health::pb::health_check_response::ServingStatus::Serving as i32
        {
            serving = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(serving, "health reports SERVING");
    // The switched-off feature's service says so; the others serve.
    use tonic_health::pb::health_check_response::ServingStatus;
    for (service, want) in [
        (
            "otterscale.runtime.v1.RuntimeService",
            ServingStatus::NotServing,
        ),
        (
            "otterscale.resource.v1.ResourceService",
            ServingStatus::Serving,
        ),
        ("otterscale.link.v1.LinkService", ServingStatus::Serving),
        ("otterlink.fleet.v1.FleetService", ServingStatus::Serving),
    ] {
        let r = health
            .check(tonic_health::pb::HealthCheckRequest {
                service: service.into(),
            })
            .await
            .unwrap();
        assert_eq!(r.get_ref().status, want as i32, "{service}");
    }
    // Reflection lists what this hub serves, not the switched-off service.
    assert_eq!(
        reflected_services(hub.channel().await).await,
        [
            "grpc.health.v1.Health",
            "otterlink.fleet.v1.FleetService",
            "otterscale.link.v1.LinkService",
            "otterscale.resource.v1.ResourceService",
        ]
    );
    // Authentication comes before the feature gate: an anonymous caller
    // learns nothing about which features are on.
    let (status, _, b) = call(
        &hub,
        false,
        post(
            "/otterscale.runtime.v1.RuntimeService/Scale",
            "application/json",
            None,
            r#"{"cluster":"edge-1"}"#,
        ),
    )
    .await;
    assert_eq!(status, 401);
    assert_eq!(json_of(&b)["code"], "unauthenticated");

    // Probes on the API port, without a token.
    for path in ["/healthz", "/livez", "/readyz"] {
        let req = http::Request::get(path)
            .body(Full::new(Bytes::new()))
            .unwrap();
        let (status, _, b) = call(&hub, false, req).await;
        assert_eq!((status.as_u16(), &b[..]), (200, &b"ok\n"[..]), "{path}");
    }

    // Metrics: text format that parses, with the calls made above.
    let req = http::Request::get("/metrics")
        .body(Full::new(Bytes::new()))
        .unwrap();
    let (status, _, _) = call(&hub, false, req).await;
    assert_eq!(status, 401, "metrics need a token");
    let req = http::Request::get("/metrics")
        .header("authorization", format!("Bearer {t}"))
        .body(Full::new(Bytes::new()))
        .unwrap();
    let (status, headers, b) = call(&hub, false, req).await;
    assert_eq!(status, 200);
    assert!(
        headers["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/plain; version=0.0.4")
    );
    let text = String::from_utf8(b.to_vec()).unwrap();
    let samples = parse_prometheus(&text);
    let get_ok = samples
        .iter()
        .find(|(name, labels, _)| {
            name == "otter_hub_requests_total"
                && labels.contains("method=\"/otterscale.resource.v1.ResourceService/Get\"")
                && labels.contains("code=\"Ok\"")
        })
        .expect("Get counted");
    assert!(get_ok.2 >= 1.0);
    assert!(
        samples.iter().any(|(n, l, v)| n == "otter_hub_tunnels"
            && l.contains("transport=\"h2\"")
            && *v == 1.0),
        "{text}"
    );
    assert!(
        samples
            .iter()
            .any(|(n, l, v)| n == "otter_hub_registers_total"
                && l.contains("registered")
                && *v >= 1.0)
    );
    assert!(
        samples
            .iter()
            .any(|(n, _, v)| n == "otter_hub_tunnel_bytes_total" && *v > 0.0)
    );
    assert!(
        samples
            .iter()
            .any(|(n, _, _)| n == "otter_hub_request_duration_seconds_bucket")
    );
    ops_ports(&hub).await;
    agent.agent.shutdown().await;
    hub.hub.shutdown().await;
}

/// The ops ports, as a kubelet and a stock Prometheus use them: plaintext,
/// no token, each serving its own paths only.
async fn ops_ports(hub: &TestHub) {
    let port = |metrics: bool| {
        hub.hub
            .ops_addrs
            .iter()
            .find(|(_, roles)| roles.metrics == metrics && roles.health != metrics)
            .map(|(addr, _)| *addr)
            .expect("ops port")
    };
    let (metrics, health) = (port(true), port(false));
    assert_ne!(metrics, health);
    if let Some(curl) = otter_e2e::tools::curl() {
        let get = |addr: std::net::SocketAddr, path: &str| {
            let mut cmd = tokio::process::Command::new(&curl);
            cmd.args(["-sS", "-w", "\n%{http_code}"])
                .arg(format!("http://{addr}{path}"));
            let path = path.to_owned();
            async move {
                let out = otter_e2e::tools::run_bounded(&mut cmd, Duration::from_secs(20)).await;
                assert!(out.status.success(), "curl {path}: {out:?}");
                let text = String::from_utf8(out.stdout).unwrap();
                let (body, code) = text.rsplit_once('\n').unwrap();
                (code.parse::<u16>().unwrap(), body.to_owned())
            }
        };
        for path in ["/healthz", "/livez", "/readyz"] {
            assert_eq!(get(health, path).await, (200, "ok\n".into()), "{path}");
            assert_eq!(
                get(metrics, path).await.0,
                404,
                "{path} on the metrics port"
            );
        }
        assert_eq!(get(health, "/metrics").await.0, 404);
        let (code, text) = get(metrics, "/metrics").await;
        assert_eq!(code, 200);
        let samples = parse_prometheus(&text);
        assert!(
            samples
                .iter()
                .any(|(n, _, v)| n == "otter_hub_requests_total" && *v >= 1.0),
            "{text}"
        );
    }
    // Anyone in the cluster's network can reach these ports: eight silent
    // connections from one source take that source's share, a ninth from
    // it is closed at once, a probe from another source is answered, and
    // the silent ones are closed after 5 s.
    let mut silent = Vec::new();
    for _ in 0..8 {
        silent.push(tokio::net::TcpStream::connect(health).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let closed_at_once = |mut tcp: tokio::net::TcpStream| async move {
        use tokio::io::AsyncReadExt;
        let mut b = [0u8; 1];
        matches!(
            tokio::time::timeout(Duration::from_secs(10), tcp.read(&mut b)).await,
            Ok(Ok(0) | Err(_))
        )
    };
    let ninth = tokio::net::TcpStream::connect(health).await.unwrap();
    let started = std::time::Instant::now();
    assert!(
        closed_at_once(ninth).await,
        "a ninth silent connection from one source is closed"
    );
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "closed at once, not after the silence bound"
    );
    let other = tokio::net::TcpSocket::new_v4().unwrap();
    other.bind("127.0.0.2:0".parse().unwrap()).unwrap();
    let other = other.connect(health).await.unwrap();
    {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut other = other;
        other
            .write_all(b"GET /livez HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut answer = Vec::new();
        tokio::time::timeout(Duration::from_secs(5), other.read_to_end(&mut answer))
            .await
            .unwrap()
            .unwrap();
        assert!(
            answer.starts_with(b"HTTP/1.1 200"),
            "{}",
            String::from_utf8_lossy(&answer)
        );
    }
    for tcp in silent {
        assert!(
            closed_at_once(tcp).await,
            "a silent connection is closed after 5 s"
        );
    }

    // The kubelet's `grpc:` probe: gRPC health over h2c.
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{health}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = tonic_health::pb::health_client::HealthClient::new(channel);
    // A health request is a service name: anything much bigger is refused
    // from its length prefix (the port takes no token).
    let e = client
        .check(tonic_health::pb::HealthCheckRequest {
            service: "x".repeat(4096),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e:?}");
    use tonic_health::pb::health_check_response::ServingStatus;
    for (service, want) in [
        ("", ServingStatus::Serving),
        (
            "otterscale.runtime.v1.RuntimeService",
            ServingStatus::NotServing,
        ),
    ] {
        let r = client
            .check(tonic_health::pb::HealthCheckRequest {
                service: service.into(),
            })
            .await
            .unwrap();
        assert_eq!(r.get_ref().status, want as i32, "{service:?}");
    }
}

/// The services a reflection client lists.
async fn reflected_services(channel: tonic::transport::Channel) -> Vec<String> {
    use tonic_reflection::pb::v1::{
        ServerReflectionRequest, server_reflection_client::ServerReflectionClient,
        server_reflection_request::MessageRequest, server_reflection_response::MessageResponse,
    };
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut answers = ServerReflectionClient::new(channel)
        .server_reflection_info(futures::stream::iter([request]))
        .await
        .unwrap()
        .into_inner();
    let answer = answers.message().await.unwrap().expect("one answer");
    let Some(MessageResponse::ListServicesResponse(list)) = answer.message_response else {
        panic!("not a service list: {answer:?}");
    };
    let mut names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    names.sort();
    names
}

/// Parses the Prometheus text format strictly enough to catch a broken
/// exposition: every sample line is `name{labels} value`, every metric has
/// TYPE and HELP lines, the document ends with `# EOF` or plain lines.
fn parse_prometheus(text: &str) -> Vec<(String, String, f64)> {
    let mut typed = std::collections::HashSet::new();
    let mut samples = Vec::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            typed.insert(rest.split_whitespace().next().unwrap().to_owned());
            continue;
        }
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        let (series, value) = line
            .rsplit_once(' ')
            .unwrap_or_else(|| panic!("bad sample line {line:?}"));
        let value: f64 = value
            .parse()
            .unwrap_or_else(|_| panic!("bad value in {line:?}"));
        let (name, labels) = match series.split_once('{') {
            Some((n, l)) => {
                assert!(l.ends_with('}'), "bad labels in {line:?}");
                (n.to_owned(), l.to_owned())
            }
            None => (series.to_owned(), String::new()),
        };
        assert!(
            name.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':'),
            "bad name {name}"
        );
        let base = ["_total", "_bucket", "_sum", "_count", "_created"]
            .iter()
            .find_map(|s| name.strip_suffix(s))
            .unwrap_or(&name);
        assert!(
            typed.contains(base) || typed.contains(&name),
            "{name} has no TYPE line"
        );
        samples.push((name, labels, value));
    }
    samples
}

/// gRPC with a codec other than protobuf and JSON is refused as the gRPC
/// specification asks (HTTP 415), with a gRPC status naming the fix; a POST
/// of no protocol at all gets a Connect error, as `openapi/openapi.yaml`
/// describes every answer but 200 (schemathesis found it plain text).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsupported_content_types_are_refused_with_415() {
    let (hub, _agent) = hub_with_agent(|_| {}).await;
    let t = hub.admin_token.clone();
    for ct in [None, Some("text/plain"), Some("application/xml")] {
        let mut req = http::Request::post("/otterscale.link.v1.LinkService/ListLinks")
            .header("authorization", format!("Bearer {t}"));
        if let Some(ct) = ct {
            req = req.header("content-type", ct);
        }
        let req = req.body(Full::new(Bytes::from_static(b"{}"))).unwrap();
        let (status, headers, body) = call(&hub, false, req).await;
        assert_eq!(status, 415, "{ct:?}");
        assert_eq!(headers["content-type"], "application/json", "{ct:?}");
        assert!(
            headers["accept-post"]
                .to_str()
                .unwrap()
                .contains("application/connect+json"),
            "{ct:?}"
        );
        let err = json_of(&body);
        assert_eq!(err["code"], "unimplemented", "{ct:?}: {err}");
        assert!(
            err["message"]
                .as_str()
                .unwrap()
                .contains("application/json"),
            "{err}"
        );
    }
    for ct in ["application/grpc+cbor", "application/grpc-web+cbor"] {
        let req = http::Request::post("/otterscale.link.v1.LinkService/ListLinks")
            .header("content-type", ct)
            .header("te", "trailers")
            .header("authorization", format!("Bearer {t}"))
            .body(Full::new(Bytes::from_static(b"\0\0\0\0\x02{}")))
            .unwrap();
        let (status, headers, _) = call(&hub, true, req).await;
        assert_eq!(status, 415, "{ct}");
        assert_eq!(headers["grpc-status"], "12", "{ct}: {headers:?}");
        let message = headers["grpc-message"].to_str().unwrap();
        assert!(message.contains("+proto"), "{ct}: {message}");
    }
    // The protobuf codec, named or not, is served.
    for ct in ["application/grpc", "application/grpc+proto"] {
        let body = frame(&ListLinksRequest {}.encode_to_vec());
        let req = http::Request::post("/otterscale.link.v1.LinkService/ListLinks")
            .header("content-type", ct)
            .header("te", "trailers")
            .header("authorization", format!("Bearer {t}"))
            .body(Full::new(Bytes::from(body)))
            .unwrap();
        let (status, headers, body) = call(&hub, true, req).await;
        assert_eq!(status, 200, "{ct}");
        assert_eq!(headers["grpc-status"], "0", "{ct}: {headers:?}");
        let (_, payload) = envelopes(&body).remove(0);
        let links = ListLinksResponse::decode(payload.as_slice()).unwrap();
        assert_eq!(links.links[0].cluster.as_deref(), Some("edge-1"), "{ct}");
    }
}

/// The JSON codec of gRPC and gRPC-Web: the hub's own service and a call
/// forwarded to a cluster, unary and server-streaming, errors as trailers,
/// a request that is not the method's JSON refused as InvalidArgument.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_and_grpc_web_with_the_json_codec() {
    let (hub, agent) = hub_with_agent(|_| {}).await;
    let t = hub.admin_token.clone();
    // Messages as bytes (the hostile ones need not be text), with a
    // bearer token or none.
    let grpc_call =
        |path: &str, ct: &str, messages: &[&[u8]], timeout: Option<&str>, token: Option<&str>| {
            let mut body = Vec::new();
            for m in messages {
                body.extend(frame(m));
            }
            let mut req = http::Request::post(path)
                .header("content-type", ct)
                .header("te", "trailers");
            if let Some(token) = token {
                req = req.header("authorization", format!("Bearer {token}"));
            }
            if ct.starts_with("application/grpc-web") {
                req = req.header("x-grpc-web", "1");
            }
            if let Some(timeout) = timeout {
                req = req.header("grpc-timeout", timeout);
            }
            req.body(Full::new(Bytes::from(body))).unwrap()
        };
    let grpc = |path: &str, ct: &str, messages: &[&str], timeout: Option<&str>| {
        let messages: Vec<&[u8]> = messages.iter().map(|m| m.as_bytes()).collect();
        grpc_call(path, ct, &messages, timeout, Some(&t))
    };
    let grpc_raw = |path: &str, ct: &str, messages: &[&[u8]], token: Option<&str>| {
        grpc_call(path, ct, messages, None, token)
    };
    // gRPC-Web ends with a trailers frame; gRPC sends HTTP trailers (the
    // helper merges them into the headers).
    let split = |ct: &str, headers: &http::HeaderMap, body: &Bytes| {
        let mut env = envelopes(body);
        let status = if ct.starts_with("application/grpc-web") {
            let (flags, trailers) = env.pop().expect("trailers frame");
            assert_eq!(flags, 0x80);
            let text = String::from_utf8(trailers).unwrap();
            text.lines()
                .find_map(|l| l.strip_prefix("grpc-status: "))
                .expect("grpc-status trailer")
                .to_owned()
        } else {
            headers["grpc-status"].to_str().unwrap().to_owned()
        };
        let messages: Vec<Value> = env
            .iter()
            .map(|(flags, m)| {
                assert_eq!(*flags, 0);
                serde_json::from_slice(m).unwrap()
            })
            .collect();
        (status, messages)
    };
    for (ct, http2) in [
        ("application/grpc+json", true),
        ("application/grpc-web+json", false),
        ("application/grpc-web+json", true),
    ] {
        // The hub's own service.
        let req = grpc(
            "/otterscale.link.v1.LinkService/ListLinks",
            ct,
            &["{}"],
            None,
        );
        let (status, headers, body) = call(&hub, http2, req).await;
        assert_eq!(status, 200, "{ct}");
        assert_eq!(headers["content-type"], ct);
        let (code, messages) = split(ct, &headers, &body);
        assert_eq!(code, "0", "{ct}");
        assert_eq!(messages[0]["links"][0]["cluster"], "edge-1", "{ct}");
        assert_eq!(messages[0]["links"][0]["state"], "LINK_STATE_CONNECTED");

        // Forwarded to the cluster, unary.
        let req = grpc(
            "/otterscale.resource.v1.ResourceService/Get",
            ct,
            &[
                r#"{"cluster":"edge-1","version":"v1","resource":"pods","namespace":"default","name":"web"}"#,
            ],
            None,
        );
        let (_, headers, body) = call(&hub, http2, req).await;
        let (code, messages) = split(ct, &headers, &body);
        assert_eq!(code, "0", "{ct}");
        assert_eq!(messages.len(), 1);
        assert_eq!(messages[0]["object"]["name"], "web", "{ct}");
        assert_eq!(messages[0]["object"]["user"], "otter:admin", "{ct}");

        // A large call both ways: the request's JSON and the answer's
        // rewritten on the hub's background threads.
        let long = "n".repeat(40_000);
        let get =
            format!(r#"{{"cluster":"edge-1","version":"v1","resource":"pods","name":"{long}"}}"#);
        let req = grpc(
            "/otterscale.resource.v1.ResourceService/Get",
            ct,
            &[&get],
            None,
        );
        let (_, headers, body) = call(&hub, http2, req).await;
        let (code, messages) = split(ct, &headers, &body);
        assert_eq!(code, "0", "{ct}");
        assert_eq!(messages[0]["object"]["name"], long.as_str(), "{ct}");

        // Forwarded, server-streaming: three events, then the deadline.
        let req = grpc(
            "/otterscale.resource.v1.ResourceService/Watch",
            ct,
            &[r#"{"cluster":"edge-1","version":"v1","resource":"pods"}"#],
            Some("1500m"),
        );
        let (_, headers, body) = call(&hub, http2, req).await;
        let (code, messages) = split(ct, &headers, &body);
        assert_eq!(code, "4", "{ct}: deadline exceeded");
        assert!(messages.len() >= 3, "{ct}: {messages:?}");
        for (i, m) in messages[..3].iter().enumerate() {
            assert_eq!(m["type"], "TYPE_ADDED");
            assert_eq!(m["resourceVersion"], i.to_string());
        }

        // Errors: an unknown cluster, a request that is not the method's
        // JSON (a field of another message).
        let req = grpc(
            "/otterscale.resource.v1.ResourceService/Get",
            ct,
            &[r#"{"cluster":"nowhere","version":"v1","resource":"pods","name":"web"}"#],
            None,
        );
        let (_, headers, body) = call(&hub, http2, req).await;
        assert_eq!(split(ct, &headers, &body), ("5".into(), vec![]), "{ct}");
        let req = grpc(
            "/otterscale.resource.v1.ResourceService/Get",
            ct,
            &[r#"{"links":[]}"#],
            None,
        );
        let (_, headers, body) = call(&hub, http2, req).await;
        assert_eq!(split(ct, &headers, &body), ("3".into(), vec![]), "{ct}");

        // Hostile JSON: cut short, not UTF-8, nested far past any message.
        // Each is refused as the caller's mistake, before a tunnel is asked.
        let deep = format!(r#"{{"cluster":"edge-1","x":{}"#, "[".repeat(100_000));
        for bad in [
            &br#"{"cluster":"edge-1","version""#[..],
            &b"{\"cluster\":\"edge-\xff\xfe\"}"[..],
            deep.as_bytes(),
        ] {
            let req = grpc_raw(
                "/otterscale.resource.v1.ResourceService/Get",
                ct,
                &[bad],
                Some(&hub.admin_token),
            );
            let (status, headers, body) = call(&hub, http2, req).await;
            assert_eq!(status, 200, "{ct}");
            assert_eq!(split(ct, &headers, &body), ("3".into(), vec![]), "{ct}");
        }
        // Without a token: refused before the body is decoded at all.
        let req = grpc_raw(
            "/otterscale.resource.v1.ResourceService/Get",
            ct,
            &[deep.as_bytes()],
            None,
        );
        let (_, headers, body) = call(&hub, http2, req).await;
        // Refused from the headers: a trailers-only answer.
        assert_eq!(headers["grpc-status"], "16", "{ct}: {headers:?}");
        assert!(body.is_empty(), "{ct}: {body:?}");
    }
    // The tunnel was never troubled: the agent answers as before.
    let req = grpc(
        "/otterscale.resource.v1.ResourceService/Get",
        "application/grpc-web+json",
        &[r#"{"cluster":"edge-1","version":"v1","resource":"pods","name":"after"}"#],
        None,
    );
    let (_, headers, body) = call(&hub, true, req).await;
    let (code, messages) = split("application/grpc-web+json", &headers, &body);
    assert_eq!(code, "0");
    assert_eq!(messages[0]["object"]["name"], "after");
    assert_eq!(agent.agent.status().connects, 1);
    agent.agent.shutdown().await;
    hub.hub.shutdown().await;
}

fn frame(msg: &[u8]) -> Vec<u8> {
    let mut out = vec![0];
    out.extend_from_slice(&(msg.len() as u32).to_be_bytes());
    out.extend_from_slice(msg);
    out
}

/// Local development without TLS: `--api-plaintext` serves gRPC over h2c
/// (prior knowledge) and Connect over plain HTTP/1.1 on the API port.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plaintext_api_serves_h2c_and_http1() {
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let hub = TestHub::start_with(dir, None, |c| c.api_plaintext = true).await;
    let addr = hub.hub.api_addr;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let links = otter_proto::link::v1::link_service_client::LinkServiceClient::new(channel)
        .list_links(otter_e2e::with_token(ListLinksRequest {}, &hub.admin_token))
        .await
        .unwrap();
    assert!(links.get_ref().links.is_empty());

    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut send, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tcp))
        .await
        .unwrap();
    tokio::spawn(conn);
    let resp = send
        .send_request(post(
            "/otterscale.link.v1.LinkService/ListLinks",
            "application/json",
            Some(&hub.admin_token),
            "{}",
        ))
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    hub.hub.shutdown().await;
}

/// Over HTTP/1.1 a call the hub answers from its first message, before the
/// body's end has arrived (an unknown cluster), leaves the connection
/// usable: the rest of the body is read and thrown away, and the next call
/// on the same connection is answered. (Node's HTTP client sends a small
/// body chunked, the terminating chunk a moment after the data; a closed
/// connection showed there as `EPIPE` or `socket hang up` on the next call.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_answered_before_its_body_ended_keeps_the_connection() {
    use futures::SinkExt;
    use http_body_util::BodyExt;
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let hub = TestHub::start_with(dir, None, |c| c.api_plaintext = true).await;
    let tcp = tokio::net::TcpStream::connect(hub.hub.api_addr)
        .await
        .unwrap();
    let (mut send, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tcp))
        .await
        .unwrap();
    let conn = tokio::spawn(conn);
    let get = otter_proto::resource::v1::GetRequest {
        cluster: Some("no-such-cluster".into()),
        version: Some("v1".into()),
        resource: Some("pods".into()),
        name: Some("web".into()),
        ..Default::default()
    };
    for round in 0..3 {
        // A body of unknown length (sent chunked) whose end comes later.
        let (mut tx, rx) = futures::channel::mpsc::channel::<
            Result<hyper::body::Frame<Bytes>, std::convert::Infallible>,
        >(2);
        let body = http_body_util::StreamBody::new(rx);
        let req = http::Request::post("/otterscale.resource.v1.ResourceService/Get")
            .header("content-type", "application/grpc-web+proto")
            .header("x-grpc-web", "1")
            .header("authorization", format!("Bearer {}", hub.admin_token))
            .body(body)
            .unwrap();
        send.ready()
            .await
            .unwrap_or_else(|e| panic!("round {round}: {e}"));
        let pending = send.send_request(req);
        tx.send(Ok(hyper::body::Frame::data(Bytes::from(frame(
            &get.encode_to_vec(),
        )))))
        .await
        .unwrap();
        let resp = tokio::time::timeout(Duration::from_secs(20), pending)
            .await
            .unwrap_or_else(|_| panic!("round {round}: no answer"))
            .unwrap_or_else(|e| panic!("round {round}: {e}"));
        assert!(
            resp.headers().get("connection").is_none(),
            "round {round}: {:?}",
            resp.headers()
        );
        let in_head = resp
            .headers()
            .get("grpc-status")
            .map(|v| v.to_str().unwrap().to_owned());
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        // gRPC-Web sends its trailers in the head (trailers-only) or as the
        // body's last frame.
        let status = in_head.or_else(|| {
            let (flags, trailer) = envelopes(&body).pop()?;
            assert_eq!(flags & 0x80, 0x80, "round {round}");
            String::from_utf8(trailer)
                .ok()?
                .lines()
                .find_map(|l| l.strip_prefix("grpc-status:").map(|v| v.trim().to_owned()))
        });
        assert_eq!(status.as_deref(), Some("5"), "round {round}");
        // The body's end arrives only now.
        tokio::time::sleep(Duration::from_millis(100)).await;
        drop(tx);
    }
    // The same through the kubectl proxy: a create for a cluster the hub
    // does not know.
    for round in 0..2 {
        let (mut tx, rx) = futures::channel::mpsc::channel::<
            Result<hyper::body::Frame<Bytes>, std::convert::Infallible>,
        >(2);
        let req = http::Request::post("/clusters/no-such-cluster/api/v1/namespaces/default/pods")
            .header("content-type", "application/json")
            .header("authorization", format!("Bearer {}", hub.admin_token))
            .body(http_body_util::StreamBody::new(rx))
            .unwrap();
        send.ready()
            .await
            .unwrap_or_else(|e| panic!("kube round {round}: {e}"));
        let pending = send.send_request(req);
        tx.send(Ok(hyper::body::Frame::data(Bytes::from_static(
            br#"{"kind":"Pod"}"#,
        ))))
        .await
        .unwrap();
        let resp = tokio::time::timeout(Duration::from_secs(20), pending)
            .await
            .unwrap_or_else(|_| panic!("kube round {round}: no answer"))
            .unwrap_or_else(|e| panic!("kube round {round}: {e}"));
        assert_eq!(resp.status(), 404, "kube round {round}");
        assert!(
            resp.headers().get("connection").is_none(),
            "kube round {round}"
        );
        resp.into_body().collect().await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        drop(tx);
    }
    assert!(!conn.is_finished(), "the hub closed the connection");
    hub.hub.shutdown().await;
}
