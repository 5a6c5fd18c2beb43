//! The transport and error shapes, checked with a bare HTTP client: HTTP/2 and HTTP/1.1
//! over TLS (ALPN), bearer authentication, Status bodies, size limits.

use crate::common;

use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use serde_json::Value;

async fn tls(
    sim: &kube_sim::KubeSim,
    alpn: &[&[u8]],
) -> tokio_rustls::client::TlsStream<tokio::net::TcpStream> {
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_slice(sim.ca_pem().as_bytes()).unwrap())
        .unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    cfg.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    let tcp = tokio::net::TcpStream::connect(sim.addr()).await.unwrap();
    tokio_rustls::TlsConnector::from(Arc::new(cfg))
        .connect(ServerName::try_from("127.0.0.1").unwrap(), tcp)
        .await
        .unwrap()
}

fn req(method: &str, path: &str, token: Option<&str>, body: Vec<u8>) -> http::Request<Full<Bytes>> {
    let mut b = http::Request::builder()
        .method(method)
        .uri(format!("https://127.0.0.1{path}"));
    if let Some(t) = token {
        b = b.header("authorization", format!("Bearer {t}"));
    }
    b.header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .unwrap()
}

async fn body_json(resp: http::Response<hyper::body::Incoming>) -> (u16, Value) {
    let code = resp.status().as_u16();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    (code, serde_json::from_slice(&bytes).unwrap_or(Value::Null))
}

#[tokio::test]
async fn http2_and_http1_with_status_errors() {
    let sim = common::start().await;
    let stream = tls(&sim, &[b"h2"]).await;
    assert_eq!(stream.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
    let (mut h2, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
            .await
            .unwrap();
    tokio::spawn(conn);
    let (code, v) = body_json(
        h2.send_request(req("GET", "/version", None, vec![]))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!((code, v["gitVersion"].as_str()), (200, Some("v1.33.0")));
    let (code, v) = body_json(
        h2.send_request(req("GET", "/api/v1/pods", None, vec![]))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(code, 401);
    assert_eq!(
        (v["kind"].as_str(), v["reason"].as_str(), v["code"].as_u64()),
        (Some("Status"), Some("Unauthorized"), Some(401))
    );
    let (code, v) = body_json(
        h2.send_request(req(
            "GET",
            "/api/v1/namespaces/default/pods/p1",
            Some(kube_sim::ADMIN_TOKEN),
            vec![],
        ))
        .await
        .unwrap(),
    )
    .await;
    assert_eq!(
        (code, v["status"]["phase"].as_str()),
        (200, Some("Running"))
    );

    // Bodies over the limit are refused with a Status, not read to the end.
    let big = vec![b' '; 4 * 1024 * 1024];
    let (code, v) = body_json(
        h2.send_request(req(
            "POST",
            "/api/v1/namespaces/default/configmaps",
            Some(kube_sim::ADMIN_TOKEN),
            big,
        ))
        .await
        .unwrap(),
    )
    .await;
    assert_eq!(
        (code, v["reason"].as_str()),
        (413, Some("RequestEntityTooLarge"))
    );

    let stream = tls(&sim, &[b"http/1.1"]).await;
    let (mut h1, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(conn);
    let bad_name = br#"{"metadata":{"name":"Not_Valid"}}"#.to_vec();
    let (code, v) = body_json(
        h1.send_request(req(
            "POST",
            "/api/v1/namespaces/default/configmaps",
            Some(kube_sim::ADMIN_TOKEN),
            bad_name,
        ))
        .await
        .unwrap(),
    )
    .await;
    assert_eq!((code, v["reason"].as_str()), (422, Some("Invalid")));
    assert_eq!(v["details"]["causes"][0]["field"], "metadata.name");
    let (code, v) = body_json(
        h1.send_request(req(
            "GET",
            "/apis/apps/v1/namespaces/default/deployments/nope",
            Some(kube_sim::ADMIN_TOKEN),
            vec![],
        ))
        .await
        .unwrap(),
    )
    .await;
    assert_eq!(
        (code, v["message"].as_str()),
        (404, Some("deployments.apps \"nope\" not found"))
    );
    assert_eq!(
        v["details"],
        serde_json::json!({"name": "nope", "group": "apps", "kind": "deployments"})
    );
    let (code, v) = body_json(
        h1.send_request(req(
            "PUT",
            "/api/v1/namespaces/default/pods",
            Some(kube_sim::ADMIN_TOKEN),
            vec![],
        ))
        .await
        .unwrap(),
    )
    .await;
    assert_eq!(
        (code, v["reason"].as_str()),
        (405, Some("MethodNotAllowed"))
    );
    // Extreme numbers from the client are answered, not fatal.
    let (code, _) = body_json(h1.send_request(req("GET", "/api/v1/namespaces/default/pods/p1/log?sinceSeconds=9223372036854775807&tailLines=-5&limitBytes=-1", Some(kube_sim::ADMIN_TOKEN), vec![])).await.unwrap()).await;
    assert_eq!(code, 200);
    let (code, v) = body_json(
        h1.send_request(req(
            "DELETE",
            "/api/v1/namespaces/default/pods/two?gracePeriodSeconds=9223372036854775807",
            Some(kube_sim::ADMIN_TOKEN),
            vec![],
        ))
        .await
        .unwrap(),
    )
    .await;
    assert_eq!(code, 200);
    assert!(v["metadata"]["deletionTimestamp"].is_string());
    let (code, v) = body_json(
        h1.send_request(req(
            "GET",
            "/api/v1/pods?limit=abc",
            Some(kube_sim::ADMIN_TOKEN),
            vec![],
        ))
        .await
        .unwrap(),
    )
    .await;
    assert_eq!((code, v["reason"].as_str()), (400, Some("BadRequest")));
    // Impersonating a group without a user is a 500, like the apiserver's filter.
    let mut r = req(
        "GET",
        "/api/v1/namespaces/default/pods",
        Some(kube_sim::ADMIN_TOKEN),
        vec![],
    );
    r.headers_mut()
        .insert("impersonate-group", http::HeaderValue::from_static("devs"));
    let (code, v) = body_json(h1.send_request(r).await.unwrap()).await;
    assert_eq!((code, v["reason"].as_str()), (500, Some("InternalError")));
    // Exec without any upgrade is told what is spoken here.
    let (code, v) = body_json(
        h1.send_request(req(
            "POST",
            "/api/v1/namespaces/default/pods/p1/exec?command=true&stdout=true",
            Some(kube_sim::ADMIN_TOKEN),
            vec![],
        ))
        .await
        .unwrap(),
    )
    .await;
    assert_eq!(code, 400);
    let msg = v["message"].as_str().unwrap();
    assert!(
        msg.contains("v5.channel.k8s.io") && msg.contains("SPDY/3.1"),
        "{msg}"
    );
    sim.shutdown().await;
}

#[tokio::test]
async fn refuses_non_loopback_and_stops_on_drop() {
    let cfg = common::config().listen("0.0.0.0:0".parse().unwrap());
    assert!(kube_sim::KubeSim::start(cfg).await.is_err());
    let sim = common::start().await;
    let addr = sim.addr();
    drop(sim);
    // The accept loop ends with the server; give the runtime a moment to run the cancellation.
    let mut refused = false;
    for _ in 0..50 {
        if tokio::net::TcpStream::connect(addr).await.is_err() {
            refused = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert!(refused, "listener still accepting after drop");
}

#[tokio::test]
async fn store_size_is_capped() {
    let sim = kube_sim::KubeSim::start(common::config().max_store_bytes(256 * 1024))
        .await
        .unwrap();
    let client = common::admin(&sim).await;
    let cms: kube::Api<k8s_openapi::api::core::v1::ConfigMap> =
        kube::Api::namespaced(client, "default");
    let mut refused = None;
    for i in 0..20 {
        let cm = serde_json::from_value(serde_json::json!({"metadata": {"name": format!("big-{i}")}, "data": {"x": "y".repeat(32 * 1024)}})).unwrap();
        if let Err(kube::Error::Api(s)) = cms.create(&Default::default(), &cm).await {
            refused = Some((i, s));
            break;
        }
    }
    let (i, status) = refused.expect("the cap stops writes");
    assert!(i > 2, "some writes fit first");
    assert_eq!(
        (status.code, status.message.as_str()),
        (500, "etcdserver: mvcc: database space exceeded")
    );
    // Deleting makes room again.
    cms.delete("big-0", &Default::default()).await.unwrap();
    let cm = serde_json::from_value(serde_json::json!({"metadata": {"name": "small"}})).unwrap();
    cms.create(&Default::default(), &cm).await.unwrap();
    sim.shutdown().await;
}
