//! An admitted agent whose answers are built to make a browser's JSON
//! costly for the hub, through a hub process. The hub writes JSON for a
//! dashboard that asks in Connect JSON, from whatever protobuf the
//! cluster's agent sent (up to 64 MiB), and that hub serves every tenant:
//!
//! - 16 MiB of empty list elements followed by a field sent twice: bytes
//!   no encoder writes, which the hub used to decode into a tree of
//!   dynamic values (a hundred bytes and more per two-byte element) before
//!   writing them out (851 MiB of peak memory, and no answer within 20 s).
//!   It is refused, the hub's peak memory growing by the answer and the
//!   JSON written up to the repeated field.
//! - A 24 MiB string of control characters, six bytes of JSON each: the
//!   JSON would be 144 MiB. It is refused as too large, and the same
//!   answer still reaches a gRPC caller whole.
//! - A Watch event of the first kind (4 MiB: a streamed message is bounded
//!   at 16 MiB) read as a Connect stream: the stream ends with the refusal.
//!
//! The same list with its elements as encoders write them (4 MiB) is
//! answered in JSON: the refusals are for the peer's shapes, not the size.
//! And a caller's JSON request of more values than any stored object holds
//! is refused before it is decoded into such a tree.

use bytes::Bytes;
use http_body_util::Full;
use otter_e2e::{
    double::{Canned, get},
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

/// A Connect unary Get of `cluster` in JSON.
fn get_json(fleet: &Fleet, cluster: &str) -> http::Request<Full<Bytes>> {
    connect_json(
        fleet,
        "/otterscale.resource.v1.ResourceService/Get",
        format!(r#"{{"cluster":"{cluster}","name":"x"}}"#),
    )
}

/// A Connect unary call of `path` with a JSON `body`, as the admin.
fn connect_json(fleet: &Fleet, path: &str, body: String) -> http::Request<Full<Bytes>> {
    http::Request::post(path)
        .header("content-type", "application/json")
        .header("authorization", format!("Bearer {}", fleet.admin_token))
        .body(Full::new(Bytes::from(body)))
        .unwrap()
}

/// Makes `req` and checks that the hub refused it with `status` and the
/// Connect `code`, its message holding `why`, while its peak memory grew
/// less than [`MAX_GROWTH_MIB`].
async fn refused(
    fleet: &Fleet,
    what: &str,
    req: http::Request<Full<Bytes>>,
    (status, code, why): (u16, &str, &str),
) {
    let hub = fleet.hub.as_ref().expect("hub").pid();
    let call = otter_e2e::http_call(fleet.api_addr(), &fleet.ca_pem, true, req);
    let ((got, _, body), growth) = peak_growth_mib(hub, within(what, call)).await;
    eprintln!("{what}: hub peak memory +{growth:.1} MiB");
    let (got_code, message) = connect_error(&body);
    assert_eq!(
        (got.as_u16(), got_code.as_str()),
        (status, code),
        "{what}: {message}"
    );
    assert!(message.contains(why), "{what}: {message}");
    assert!(
        growth < MAX_GROWTH_MIB,
        "{what}: the hub's peak memory grew {growth:.1} MiB"
    );
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
    let unusual = |n: usize| {
        let mut r = resource("list", &field(6, &[0x0a, 0x00].repeat(n)));
        r.extend_from_slice(&[0x0a, 0x00]);
        r
    };
    // edge-1: 24 MiB of control characters in one string.
    let controls = vec![0x01; 24 << 20];
    let escapes = resource("data", &field(3, &controls));
    // edge-2: 1 Mi nulls as encoders write them (`null_value: 0`).
    let nulls = [0x0a, 0x02, 0x08, 0x00].repeat(1 << 20);
    let usual = resource("list", &field(6, &nulls));

    // Watches get an event (`resource`, 2) of the same kind, within the
    // 16 MiB a streamed message may have.
    let event = |object: &[u8]| grpc_framed(&field(2, object));
    let answers = [
        (unusual(8 << 20), event(&unusual(2 << 20))),
        (escapes, event(b"")),
        (usual, event(b"")),
    ];
    let mut agents = Vec::new();
    for (i, (get, watch)) in answers.iter().enumerate() {
        // Every call answered with one message in one DATA frame.
        let canned = Canned {
            watch: watch.clone(),
            get: grpc_framed(get),
            cut: usize::MAX,
        };
        let routes = tonic::service::Routes::new(canned);
        agents.push(fleet.own_agent(i, TransportKind::Quic, routes).await);
    }
    let channel = fleet.channel().await;
    fleet.all_connected(&channel).await;
    refused(
        &fleet,
        "the 16 MiB answer not encoded as usual",
        get_json(&fleet, "edge-0"),
        (500, "internal", "not encoded as usual"),
    )
    .await;
    refused(
        &fleet,
        "the 24 MiB string of control characters",
        get_json(&fleet, "edge-1"),
        (429, "resource_exhausted", "in protobuf"),
    )
    .await;
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

    // An event not encoded as usual (4 MiB), read as a Connect stream in
    // JSON: the stream ends with the refusal.
    let watch = br#"{"cluster":"edge-0"}"#;
    let mut body = vec![0u8];
    body.extend_from_slice(&(watch.len() as u32).to_be_bytes());
    body.extend_from_slice(watch);
    let req = http::Request::post("/otterscale.resource.v1.ResourceService/Watch")
        .header("content-type", "application/connect+json")
        .header("authorization", format!("Bearer {}", fleet.admin_token))
        .body(Full::new(Bytes::from(body)))
        .unwrap();
    let hub = fleet.hub.as_ref().expect("hub").pid();
    let call = otter_e2e::http_call(fleet.api_addr(), &fleet.ca_pem, true, req);
    let ((status, _, body), growth) = peak_growth_mib(hub, within("the Watch", call)).await;
    eprintln!("the Watch event not encoded as usual: hub peak memory +{growth:.1} MiB");
    assert_eq!(status, 200);
    // One envelope: the end of the stream (flag 2) with the error.
    assert!(
        body.len() > 5 && body[0] == 2,
        "{:?}",
        &body[..body.len().min(64)]
    );
    let end: serde_json::Value = serde_json::from_slice(&body[5..]).unwrap();
    assert_eq!(end["error"]["code"], "internal", "{end}");
    assert!(
        growth < MAX_GROWTH_MIB,
        "the hub's peak memory grew {growth:.1} MiB"
    );

    // As encoders write it, a list of the same kind is answered in JSON,
    // over the size up to which unusual bytes are still decoded.
    let call = otter_e2e::http_call(
        fleet.api_addr(),
        &fleet.ca_pem,
        true,
        get_json(&fleet, "edge-2"),
    );
    let (status, _, body) = within("the usual Get", call).await;
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
    refused(
        &fleet,
        "600,000 JSON values",
        connect_json(
            &fleet,
            "/otterlink.fleet.v1.FleetService/LabelLink",
            format!(r#"{{"cluster":"edge-2","remove":[{remove}]}}"#),
        ),
        (429, "resource_exhausted", "JSON values"),
    )
    .await;

    for agent in agents {
        agent.shutdown().await;
    }
}
