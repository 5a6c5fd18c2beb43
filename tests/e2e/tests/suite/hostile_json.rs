//! An admitted agent whose answers are built to make a browser's JSON
//! costly for the hub, through a hub process. The hub writes JSON for a
//! dashboard that asks in Connect JSON, from whatever protobuf the
//! cluster's agent sent (up to 64 MiB), and that hub serves every tenant:
//!
//! - 16 MiB of empty list elements followed by a field sent twice: bytes
//!   no encoder writes, which the hub used to decode into a tree of
//!   dynamic values (a hundred bytes and more per two-byte element) before
//!   writing them out. It is refused, and the hub's peak memory grows by
//!   about the answer, not by gigabytes.
//! - A 24 MiB string of control characters, six bytes of JSON each: the
//!   JSON would be 144 MiB. It is refused as too large, and the same
//!   answer still reaches a gRPC caller whole.
//!
//! The same list with its elements as encoders write them (4 MiB) is
//! answered in JSON: the refusals are for the peer's shapes, not the size.
//! And a caller's JSON request of more values than any stored object holds
//! is refused before it is decoded into such a tree.

use std::{
    convert::Infallible,
    future::{Ready, ready},
    task::{Context, Poll},
};

use bytes::Bytes;
use http_body_util::{Full, StreamBody};
use hyper::body::Frame;
use otter_e2e::{
    double::get,
    fleet::Fleet,
    grpc_framed,
    kube::{sim_config, within},
    procs::peak_growth_mib,
    with_token,
};
use otter_proto::resource::v1::resource_service_client::ResourceServiceClient;
use otter_tunnel::TransportKind;

/// Peak hub memory growth allowed while a refused answer passes: the
/// answer as received, gathered whole, and the caller's buffers. The
/// dynamic tree of 8 Mi elements alone would be several hundred MiB.
const MAX_GROWTH_MIB: f64 = 96.0;

/// A protobuf field `number` of wire type LEN holding `body`.
fn field(number: u8, body: &[u8]) -> Vec<u8> {
    let mut out = vec![number << 3 | 2];
    let mut len = body.len();
    while len >= 0x80 {
        out.push((len as u8 & 0x7f) | 0x80);
        len >>= 7;
    }
    out.push(len as u8);
    out.extend_from_slice(body);
    out
}

/// A `Resource` whose object is `{key: value}`, `value` a
/// `google.protobuf.Value`'s bytes.
fn resource(key: &str, value: &[u8]) -> Vec<u8> {
    let entry = [field(1, key.as_bytes()), field(2, value)].concat();
    field(1, &field(1, &entry))
}

/// The agent's ResourceService, replaced: every call is answered with the
/// same message in one DATA frame, then an OK status.
#[derive(Clone)]
struct Answer(Bytes);

impl tonic::server::NamedService for Answer {
    const NAME: &'static str = "otterscale.resource.v1.ResourceService";
}

impl tower::Service<http::Request<tonic::body::Body>> for Answer {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = Ready<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: http::Request<tonic::body::Body>) -> Self::Future {
        let mut status = http::HeaderMap::new();
        status.insert("grpc-status", http::HeaderValue::from_static("0"));
        let frames = [
            Ok::<_, Infallible>(Frame::data(self.0.clone())),
            Ok(Frame::trailers(status)),
        ];
        let body = tonic::body::Body::new(StreamBody::new(futures::stream::iter(frames)));
        ready(Ok(http::Response::builder()
            .header("content-type", "application/grpc")
            .body(body)
            .expect("response")))
    }
}

/// A Connect unary Get of `cluster` in JSON: (status, body).
async fn get_json(fleet: &Fleet, cluster: &str) -> (http::StatusCode, Bytes) {
    let req = http::Request::post("/otterscale.resource.v1.ResourceService/Get")
        .header("content-type", "application/json")
        .header("authorization", format!("Bearer {}", fleet.admin_token))
        .body(Full::new(Bytes::from(format!(
            r#"{{"cluster":"{cluster}","name":"x"}}"#
        ))))
        .unwrap();
    let (status, _, body) = otter_e2e::http_call(fleet.api_addr(), &fleet.ca_pem, true, req).await;
    (status, body)
}

/// The Connect error's code and message.
fn connect_error(body: &[u8]) -> (String, String) {
    let v: serde_json::Value = serde_json::from_slice(body).unwrap_or_else(|e| {
        panic!(
            "not a Connect error ({e}): {}",
            String::from_utf8_lossy(body)
        )
    });
    (
        v["code"].as_str().unwrap_or_default().to_owned(),
        v["message"].as_str().unwrap_or_default().to_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_built_to_blow_up_as_json_are_refused_within_bounded_hub_memory() {
    let sim = kube_sim::KubeSim::start(sim_config()).await.expect("sim");
    let fleet = Fleet::start_hub_only(&sim, &["quic", "quic", "quic"]).await;

    // edge-0: 8 Mi empty elements of a list, then the object again (a
    // field twice: the general decoder merges, no encoder writes it).
    let empties = [0x0a, 0x00].repeat(8 << 20);
    let mut unusual = resource("list", &field(6, &empties));
    unusual.extend_from_slice(&[0x0a, 0x00]);
    // edge-1: 24 MiB of control characters in one string.
    let controls = vec![0x01; 24 << 20];
    let escapes = resource("data", &field(3, &controls));
    // edge-2: 1 Mi nulls as encoders write them (`null_value: 0`).
    let nulls = [0x0a, 0x02, 0x08, 0x00].repeat(1 << 20);
    let usual = resource("list", &field(6, &nulls));

    let mut agents = Vec::new();
    for (i, answer) in [&unusual, &escapes, &usual].into_iter().enumerate() {
        let routes = tonic::service::Routes::new(Answer(grpc_framed(answer)));
        agents.push(fleet.own_agent(i, TransportKind::Quic, routes).await);
    }
    let channel = fleet.channel().await;
    fleet.all_connected(&channel).await;
    let hub = fleet.hub.as_ref().expect("hub").pid();

    let ((status, body), growth) =
        peak_growth_mib(hub, within("the unusual Get", get_json(&fleet, "edge-0"))).await;
    eprintln!(
        "unusual answer of {} bytes: hub peak memory +{growth:.1} MiB",
        unusual.len()
    );
    let (code, message) = connect_error(&body);
    assert_eq!(
        (status.as_u16(), code.as_str()),
        (500, "internal"),
        "{message}"
    );
    assert!(message.contains("not encoded as usual"), "{message}");
    assert!(
        growth < MAX_GROWTH_MIB,
        "the hub's peak memory grew {growth:.1} MiB refusing {} bytes",
        unusual.len()
    );

    let ((status, body), growth) =
        peak_growth_mib(hub, within("the escapes Get", get_json(&fleet, "edge-1"))).await;
    eprintln!(
        "control characters, {} bytes: hub peak memory +{growth:.1} MiB",
        escapes.len()
    );
    let (code, message) = connect_error(&body);
    assert_eq!(
        (status.as_u16(), code.as_str()),
        (429, "resource_exhausted"),
        "{message}"
    );
    assert!(message.contains("in protobuf"), "{message}");
    // In protobuf the same answer passes whole.
    let got = within(
        "the escapes Get in gRPC",
        ResourceServiceClient::new(channel.clone())
            .max_decoding_message_size(64 << 20)
            .get(with_token(get("edge-1", "x"), &fleet.admin_token)),
    )
    .await
    .expect("the answer in protobuf");
    assert_eq!(
        otter_e2e::double::field(&got.into_inner(), "data").len(),
        controls.len()
    );

    // As encoders write it, a list of the same kind is answered in JSON,
    // over the size up to which unusual bytes are still decoded.
    let (status, body) = within("the usual Get", get_json(&fleet, "edge-2")).await;
    assert_eq!(
        status,
        200,
        "{}",
        String::from_utf8_lossy(&body[..body.len().min(300)])
    );
    let n = 1 << 20;
    let expected = format!(r#"{{"object":{{"list":[{}null]}}}}"#, "null,".repeat(n - 1));
    assert!(body == expected.as_bytes(), "{} bytes of JSON", body.len());

    // A request of more JSON values than any stored object holds (empty
    // strings to remove as labels, three bytes each) is refused before it
    // is decoded.
    let remove = vec![r#""""#; 600_000].join(",");
    let req = http::Request::post("/otterlink.fleet.v1.FleetService/LabelLink")
        .header("content-type", "application/json")
        .header("authorization", format!("Bearer {}", fleet.admin_token))
        .body(Full::new(Bytes::from(format!(
            r#"{{"cluster":"edge-2","remove":[{remove}]}}"#
        ))))
        .unwrap();
    let ((status, _, body), growth) = peak_growth_mib(
        hub,
        otter_e2e::http_call(fleet.api_addr(), &fleet.ca_pem, true, req),
    )
    .await;
    eprintln!("600,000 JSON values: hub peak memory +{growth:.1} MiB");
    let (code, message) = connect_error(&body);
    assert_eq!(
        (status.as_u16(), code.as_str()),
        (429, "resource_exhausted"),
        "{message}"
    );

    for agent in agents {
        agent.shutdown().await;
    }
}
