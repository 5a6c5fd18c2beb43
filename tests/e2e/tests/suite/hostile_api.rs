//! Hostile callers of the hub's API port: Register abuse (forged, replayed
//! and misdirected join tokens, CSRs that claim another identity, are
//! oversized or badly signed) and resource bounds (oversized gRPC, gRPC-Web
//! and Connect messages, oversized manifest requests), each refused with
//! the right code, the size limits enforced before a body is buffered, and
//! the hub serving normally afterwards.

use std::{sync::Arc, time::Duration};

use bytes::Bytes;
use futures::StreamExt;
use http_body_util::BodyExt;
use otter_e2e::{
    TestHub,
    double::{WAIT, field, get, start_agent, wait_connected},
    with_token,
};
use otter_proto::{
    link::v1::{GetAgentManifestRequest, RegisterRequest, link_service_client::LinkServiceClient},
    resource::v1::resource_service_client::ResourceServiceClient,
};
use otter_tunnel::TransportKind;
use rcgen::{CertificateParams, DnType, KeyPair, SanType};
use tonic::Code;

fn register(cluster: &str, agent: &str, token: &str, csr: &[u8]) -> RegisterRequest {
    RegisterRequest {
        cluster: Some(cluster.into()),
        csr: Some(csr.to_vec()),
        agent_id: Some(agent.into()),
        agent_version: Some("v0.1.0".into()),
        rancher_project_id: None,
        join_token: Some(token.into()),
    }
}

/// A P-256 CSR with the given common name and SANs.
fn csr_with(common_name: &str, sans: Vec<SanType>) -> (KeyPair, rcgen::CertificateSigningRequest) {
    let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
    let mut params = CertificateParams::default();
    params.distinguished_name = rcgen::DistinguishedName::new();
    params
        .distinguished_name
        .push(DnType::CommonName, common_name);
    params.subject_alt_names = sans;
    let csr = params.serialize_request(&key).unwrap();
    (key, csr)
}

fn pem(label: &str, der: &[u8]) -> String {
    use base64::Engine;
    let b64 = base64::engine::general_purpose::STANDARD.encode(der);
    let lines: Vec<&str> = b64
        .as_bytes()
        .chunks(64)
        .map(|l| std::str::from_utf8(l).unwrap())
        .collect();
    format!(
        "-----BEGIN {label}-----\n{}\n-----END {label}-----\n",
        lines.join("\n")
    )
}

async fn expect_code(
    link: &mut LinkServiceClient<tonic::transport::Channel>,
    req: RegisterRequest,
    code: Code,
    says: &str,
) {
    let e = link.register(req).await.unwrap_err();
    assert_eq!(e.code(), code, "{e:?}");
    assert!(
        e.message().contains(says),
        "{says:?} not in {:?}",
        e.message()
    );
}

/// Register refuses what the earlier suite does not cover: a forged secret
/// for a real token id, a token replayed after it expired, CSRs naming
/// another cluster in the subject or the agent URI, a CSR over the size
/// limit, a message over the hub's own limit, a broken signature and key
/// types the hub does not sign (P-384, a huge RSA key). The hub still registers afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn register_refuses_abuse_with_the_right_codes() {
    let hub = TestHub::start().await;
    let mut link =
        LinkServiceClient::new(hub.channel().await).max_encoding_message_size(16 * 1024 * 1024);
    let (_key, csr) = otter_pki::csr::generate("edge-1", "a1").unwrap();
    let csr = csr.as_bytes();

    // A real token's id with another secret.
    let token = hub.hub.mint_join_token("edge-1").unwrap();
    let mut forged = token.clone();
    let last = forged.pop().unwrap();
    forged.push(if last == 'A' { 'B' } else { 'A' });
    expect_code(
        &mut link,
        register("edge-1", "a1", &forged, csr),
        Code::Unauthenticated,
        "join token",
    )
    .await;

    // Used while valid, then replayed after expiry (on a cluster of its
    // own: edge-1 stays unenrolled for the CSR checks below).
    let short = otter_hub::tokens::mint_join_token(
        &*hub.hub.state.store,
        "edge-e",
        "default",
        Duration::from_secs(2),
    )
    .unwrap();
    let (_key_e, csr_e) = otter_pki::csr::generate("edge-e", "a1").unwrap();
    link.register(register("edge-e", "a1", &short, csr_e.as_bytes()))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(2500)).await;
    expect_code(
        &mut link,
        register("edge-e", "a1", &short, csr_e.as_bytes()),
        Code::Unauthenticated,
        "expired",
    )
    .await;

    // A token for another cluster.
    let token_b = hub.hub.mint_join_token("edge-b").unwrap();
    expect_code(
        &mut link,
        register("edge-1", "a1", &token_b, csr),
        Code::PermissionDenied,
        "edge-b",
    )
    .await;

    // CSRs naming another cluster: in the common name, in the agent URI.
    let (_k, injected_cn) = csr_with("edge-b/a1", vec![]);
    expect_code(
        &mut link,
        register(
            "edge-1",
            "a1",
            &token,
            injected_cn.pem().unwrap().as_bytes(),
        ),
        Code::PermissionDenied,
        "edge-b/a1",
    )
    .await;
    let (_k, injected_san) = csr_with(
        "edge-1/a1",
        vec![SanType::URI(
            "spiffe://otterscale-link/cluster/edge-b/agent/a1"
                .try_into()
                .unwrap(),
        )],
    );
    expect_code(
        &mut link,
        register(
            "edge-1",
            "a1",
            &token,
            injected_san.pem().unwrap().as_bytes(),
        ),
        Code::PermissionDenied,
        "cluster/edge-b",
    )
    .await;

    // Oversized: a CSR over its limit, and a message over the hub's limit
    // for its own services (refused from the length prefix).
    let mut huge = String::from_utf8(csr.to_vec()).unwrap();
    huge.push_str(&"A".repeat(otter_pki::ca::MAX_CSR_PEM_LEN));
    expect_code(
        &mut link,
        register("edge-1", "a1", &token, huge.as_bytes()),
        Code::ResourceExhausted,
        "over the limit",
    )
    .await;
    let enormous = vec![b'A'; otter_hub::server::MAX_OWN_MESSAGE + 1];
    expect_code(
        &mut link,
        register("edge-1", "a1", &token, &enormous),
        Code::ResourceExhausted,
        "over the limit",
    )
    .await;

    // A broken signature, and a P-384 key.
    let (_k, good) = csr_with("edge-1/a1", vec![]);
    let mut der = good.der().to_vec();
    let end = der.len() - 1;
    der[end] ^= 0x01;
    expect_code(
        &mut link,
        register(
            "edge-1",
            "a1",
            &token,
            pem("CERTIFICATE REQUEST", &der).as_bytes(),
        ),
        Code::InvalidArgument,
        "malformed CSR",
    )
    .await;
    let p384 = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P384_SHA384).unwrap();
    let mut params = CertificateParams::default();
    params.distinguished_name = rcgen::DistinguishedName::new();
    params
        .distinguished_name
        .push(DnType::CommonName, "edge-1/a1");
    let other_key = params.serialize_request(&p384).unwrap().pem().unwrap();
    expect_code(
        &mut link,
        register("edge-1", "a1", &token, other_key.as_bytes()),
        Code::InvalidArgument,
        "key type",
    )
    .await;

    // A huge key: an RSA-8192 CSR (made once with openssl; the hub signs
    // only P-256 and Ed25519 keys).
    let rsa = include_str!("../fixtures/rsa8192.csr");
    expect_code(
        &mut link,
        register("edge-1", "a1", &token, rsa.as_bytes()),
        Code::InvalidArgument,
        "key type",
    )
    .await;

    // Through all of it the hub kept serving: the right request works.
    let ok = link
        .register(register("edge-1", "a1", &token, csr))
        .await
        .unwrap()
        .into_inner();
    assert!(ok.certificate.is_some());
    hub.hub.shutdown().await;
}

/// A request whose body starts with `first` and then stays open: the
/// answer (head and body) must come while the client still holds the body,
/// which shows the hub decided without buffering it.
async fn answer_with_body_open(
    hub: &TestHub,
    req: http::request::Builder,
    first: Vec<Bytes>,
) -> (http::StatusCode, http::HeaderMap, Bytes) {
    otter_pki::tls::install_default_provider();
    let tls = otter_pki::tls::client_config(hub.hub.ca_pem(), None, &[b"h2"]).unwrap();
    let tcp = tokio::net::TcpStream::connect(hub.hub.api_addr)
        .await
        .unwrap();
    let tls = tokio_rustls::TlsConnector::from(Arc::new(tls))
        .connect("localhost".try_into().unwrap(), tcp)
        .await
        .unwrap();
    let (mut send, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tls),
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(first.len().max(1));
    for chunk in first {
        tx.send(chunk).await.unwrap();
    }
    let body = http_body_util::StreamBody::new(
        tokio_stream::wrappers::ReceiverStream::new(rx)
            .map(|b| Ok::<_, std::convert::Infallible>(hyper::body::Frame::data(b))),
    );
    let answer = async {
        let resp = send.send_request(req.body(body).unwrap()).await.unwrap();
        let (parts, body) = resp.into_parts();
        let collected = body.collect().await.unwrap();
        let mut headers = parts.headers;
        if let Some(t) = collected.trailers() {
            headers.extend(t.clone());
        }
        (parts.status, headers, collected.to_bytes())
    };
    let out = tokio::time::timeout(WAIT, answer)
        .await
        .expect("the hub answered before the request body ended");
    drop(tx);
    out
}

fn request(hub: &TestHub, path: &str, content_type: &str) -> http::request::Builder {
    http::Request::post(format!(
        "https://localhost:{}{path}",
        hub.hub.api_addr.port()
    ))
    .header("content-type", content_type)
    .header("authorization", format!("Bearer {}", hub.admin_token))
}

/// A 5-byte message prefix declaring `len` bytes, and a little of them.
fn declared(flags: u8, len: u32) -> Vec<Bytes> {
    let mut prefix = vec![flags];
    prefix.extend_from_slice(&len.to_be_bytes());
    vec![Bytes::from(prefix), Bytes::from(vec![0x0a; 1024])]
}

/// Oversized requests on every protocol of the API port are refused from
/// their declared length (gRPC, gRPC-Web, Connect streaming) or as soon as
/// the limit is crossed (Connect unary), with the code each protocol uses
/// for it, while the body is still open; oversized manifest requests are
/// refused too; and the same agent answers normal calls afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_requests_are_refused_before_buffering() {
    const LIMIT: usize = 64 * 1024;
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let hub = TestHub::start_with(dir, None, |c| c.max_request_message = LIMIT).await;
    let token = hub.hub.mint_join_token("edge-1").unwrap();
    let agent = start_agent(&hub, "edge-1", "a1", &token, TransportKind::Quic);
    let channel = hub.channel().await;
    wait_connected(&channel, &hub.admin_token, 1).await;
    let get_path = "/otterscale.resource.v1.ResourceService/Get";
    let watch_path = "/otterscale.resource.v1.ResourceService/Watch";

    // gRPC through a real client: a message one byte over.
    let mut client = ResourceServiceClient::new(channel.clone());
    let big = get("edge-1", &"x".repeat(LIMIT));
    let e = client
        .get(with_token(big, &hub.admin_token))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    assert!(e.message().contains("over the limit"), "{e:?}");

    // gRPC declaring 1 GiB, body left open.
    let (status, headers, _) = answer_with_body_open(
        &hub,
        request(&hub, get_path, "application/grpc").header("te", "trailers"),
        declared(0, 1 << 30),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(headers["grpc-status"], "8", "{headers:?}");

    // gRPC-Web, the same.
    let (_, headers, body) = answer_with_body_open(
        &hub,
        request(&hub, get_path, "application/grpc-web+proto"),
        declared(0, 1 << 30),
    )
    .await;
    let trailers = String::from_utf8_lossy(&body).into_owned();
    let status = headers
        .get("grpc-status")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_else(|| trailers.clone());
    assert!(
        status == "8" || trailers.contains("grpc-status:8"),
        "{headers:?} {trailers:?}"
    );

    // Connect streaming: an envelope declaring 1 GiB.
    let (status, _, body) = answer_with_body_open(
        &hub,
        request(&hub, watch_path, "application/connect+json"),
        declared(0, 1 << 30),
    )
    .await;
    assert_eq!(status, 200);
    let end = String::from_utf8_lossy(&body).into_owned();
    assert!(end.contains("resource_exhausted"), "{end}");

    // Connect unary JSON: a body growing past the limit.
    let chunks = (0..8).map(|_| Bytes::from(vec![b' '; LIMIT / 4])).collect();
    let (status, headers, body) =
        answer_with_body_open(&hub, request(&hub, get_path, "application/json"), chunks).await;
    assert_eq!(status, http::StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(headers["content-type"], "application/json");
    let err: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(err["code"], "resource_exhausted", "{err}");

    // Manifests: too many users, too long a name, a URL token past its limit.
    let mut links = LinkServiceClient::new(channel.clone());
    let many = GetAgentManifestRequest {
        cluster: Some("edge-2".into()),
        extra_users: (0..=otter_hub::manifest::MAX_EXTRA_USERS)
            .map(|i| format!("user-{i}"))
            .collect(),
        rancher_project_id: None,
        labels: Default::default(),
    };
    let e = links
        .get_agent_manifest(with_token(many, &hub.admin_token))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    let long = GetAgentManifestRequest {
        cluster: Some("edge-2".into()),
        extra_users: vec!["u".repeat(100_000)],
        rancher_project_id: None,
        labels: Default::default(),
    };
    let e = links
        .get_agent_manifest(with_token(long, &hub.admin_token))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    // Labels: too many, too long in all, or not Kubernetes label syntax
    // (they travel in the manifest URL).
    for labels in [
        (0..=otter_hub::fleet::MAX_LABELS)
            .map(|i| (format!("k{i}"), String::new()))
            .collect(),
        (0..30).map(|i| (format!("k{i}"), "v".repeat(63))).collect(),
        [("bad key".to_owned(), String::new())].into(),
        [("k".to_owned(), "x".repeat(64))].into(),
    ] {
        let e = links
            .get_agent_manifest(with_token(
                GetAgentManifestRequest {
                    cluster: Some("edge-2".into()),
                    labels,
                    ..Default::default()
                },
                &hub.admin_token,
            ))
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    }
    let too_long = "A".repeat(otter_hub::manifest::MAX_TOKEN_LEN + 1);
    let (status, _, body) = otter_e2e::http_call(
        hub.hub.api_addr,
        hub.hub.ca_pem(),
        false,
        http::Request::get(format!("/link/manifest/{too_long}.{too_long}"))
            .header("host", "localhost")
            .body(http_body_util::Full::new(Bytes::new()))
            .unwrap(),
    )
    .await;
    assert_eq!(status, 401);
    assert!(String::from_utf8_lossy(&body).contains("malformed"));

    // Normal calls still work, on the same tunnel.
    let r = client
        .get(with_token(get("edge-1", "after"), &hub.admin_token))
        .await
        .unwrap();
    assert_eq!(field(r.get_ref(), "agent"), "a1");
    assert_eq!(agent.agent.status().connects, 1);
    agent.agent.shutdown().await;
    hub.hub.shutdown().await;
}

/// A message under the hub's limit but over the agent's is refused by the
/// agent with the code gRPC prescribes for it, ResourceExhausted (its gRPC
/// library would say OutOfRange), and the tunnel carries on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_over_the_agents_limit_is_resource_exhausted() {
    let hub = TestHub::start().await;
    let token = hub.hub.mint_join_token("edge-1").unwrap();
    let agent = start_agent(&hub, "edge-1", "a1", &token, TransportKind::H2);
    let channel = hub.channel().await;
    wait_connected(&channel, &hub.admin_token, 1).await;
    let mut client = ResourceServiceClient::new(channel);
    // The test agent keeps gRPC's default limit of 4 MiB; the hub's is 16.
    let big = get("edge-1", &"x".repeat(5 * 1024 * 1024));
    let e = client
        .get(with_token(big, &hub.admin_token))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    assert!(e.message().contains("too large"), "{e:?}");
    let r = client
        .get(with_token(get("edge-1", "after"), &hub.admin_token))
        .await
        .unwrap();
    assert_eq!(field(r.get_ref(), "agent"), "a1");
    agent.agent.shutdown().await;
    hub.hub.shutdown().await;
}
