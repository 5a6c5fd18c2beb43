//! An admitted agent that cuts its answers into one-byte frames, through a
//! hub process: a Watch event and a Get answer of 3 MiB each, every byte a
//! DATA chunk of its own on the tunnel. Both reach the caller whole, and
//! the hub's peak memory grows by about what it was sent, not by what a
//! frame per byte costs (a handle, and the tunnel buffer it pins, for each
//! byte of a Watch event held until whole: 307 MiB for the 3 MiB event
//! before the hub gathered small chunks and copied small frames).

use futures::StreamExt;
use otter_e2e::{
    double::{Canned, get, watch},
    fleet::Fleet,
    grpc_framed,
    kube::{sim_config, within},
    procs::peak_growth_mib,
    with_token,
};
use otter_proto::resource::v1::{
    Resource, WatchEvent, resource_service_client::ResourceServiceClient, watch_event,
};
use otter_tunnel::TransportKind;
use prost::Message;
use prost_types::{Struct, Value, value::Kind};

/// Bytes of the string each answer carries.
const SIZE: usize = 3 * 1024 * 1024;
/// Peak hub memory growth allowed while one answer passes: the 3 MiB sent,
/// a copy on the way out, and the caller connection's buffers. A handle
/// per held byte alone would be 3 MiB × 32 bytes = 96 MiB.
const MAX_GROWTH_MIB: f64 = 24.0;

/// An object whose `data` is `SIZE` bytes of a pattern that shows any byte
/// lost, doubled or moved.
fn object(name: &str) -> Struct {
    let data: String = (0..SIZE)
        .map(|i| char::from(b'a' + (i % 23) as u8))
        .collect();
    let text = |s: String| Value {
        kind: Some(Kind::StringValue(s)),
    };
    Struct {
        fields: [
            ("name".to_owned(), text(name.to_owned())),
            ("data".to_owned(), text(data)),
        ]
        .into(),
    }
}

fn string_field(object: &Struct, key: &str) -> String {
    match object.fields.get(key).and_then(|v| v.kind.as_ref()) {
        Some(Kind::StringValue(s)) => s.clone(),
        other => panic!("field {key}: {other:?}"),
    }
}

/// Runs `call`; fails the test when the hub's peak memory meanwhile grew
/// by [`MAX_GROWTH_MIB`] or more.
async fn peak_growth<T>(hub: u32, what: &str, call: impl Future<Output = T>) -> T {
    let (out, growth) = peak_growth_mib(hub, call).await;
    eprintln!("{what}: hub peak memory +{growth:.1} MiB");
    assert!(
        growth < MAX_GROWTH_MIB,
        "the hub's peak memory grew {growth:.1} MiB passing {what}'s {SIZE} bytes in one-byte frames"
    );
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_cut_into_one_byte_frames_pass_whole_within_bounded_hub_memory() {
    let sim = kube_sim::KubeSim::start(sim_config()).await.expect("sim");
    let fleet = Fleet::start_hub_only(&sim, &["quic"]).await;
    let event = WatchEvent {
        r#type: Some(watch_event::Type::Added as i32),
        resource: Some(Resource {
            object: Some(object("watched")),
        }),
        resource_version: Some("7".into()),
    };
    let answer = Resource {
        object: Some(object("got")),
    };
    // The agent's ResourceService, replaced: every call answered with one
    // message, a DATA frame per byte, then an OK status.
    let crumbs = Canned {
        watch: grpc_framed(&event.encode_to_vec()),
        get: grpc_framed(&answer.encode_to_vec()),
        cut: 1,
    };
    let routes = tonic::service::Routes::new(crumbs);

    let agent = fleet.own_agent(0, TransportKind::Quic, routes).await;
    let channel = fleet.channel().await;
    fleet.all_connected(&channel).await;

    let t = &fleet.admin_token;
    let mut client =
        ResourceServiceClient::new(channel.clone()).max_decoding_message_size(64 << 20);
    let hub_pid = fleet.hub.as_ref().expect("hub").pid();

    peak_growth(hub_pid, "the Watch", async {
        let mut events = within("the watch", client.watch(with_token(watch("edge-0"), t)))
            .await
            .unwrap()
            .into_inner();
        let got = within("the event", events.next())
            .await
            .expect("an event")
            .expect("the event whole");
        assert_eq!(got, event, "the event as the agent sent it");
        assert!(within("the watch's end", events.next()).await.is_none());
    })
    .await;

    let got = peak_growth(hub_pid, "the Get", async {
        within("the get", client.get(with_token(get("edge-0", "x"), t)))
            .await
            .unwrap()
            .into_inner()
    })
    .await;
    let object = got.object.expect("an object");
    assert_eq!(string_field(&object, "name"), "got");
    assert_eq!(
        string_field(&object, "data"),
        string_field(answer.object.as_ref().unwrap(), "data")
    );
    agent.shutdown().await;
}
