//! An admitted agent that cuts its answers into one-byte frames, through a
//! hub process: a Watch event and a Get answer of 3 MiB each, every byte a
//! DATA chunk of its own on the tunnel. Both reach the caller whole, and
//! the hub's peak memory grows by about what it was sent, not by what a
//! frame per byte costs (a handle, and the tunnel buffer it pins, for each
//! byte of a Watch event held until whole: 307 MiB for the 3 MiB event
//! before the hub gathered small chunks and copied small frames).
//!
//! And an admitted agent that answers every call and never ends its side of
//! the stream: the hub lets each stream go 2 s after its answer, and such an
//! agent can use up only its own tunnel's stream slots.

use std::{
    pin::Pin,
    sync::{Arc, Mutex},
    task::{Context, Poll, ready},
};

use futures::StreamExt;
use otter_e2e::{
    dial_tunnel,
    double::{Canned, get, watch},
    fleet::{Fleet, metric},
    grpc_framed,
    kube::{sim_config, within},
    procs::peak_growth_mib,
    tunnel_alpn, with_token,
};
use otter_proto::{
    link::v1::{RegisterRequest, link_service_client::LinkServiceClient},
    resource::v1::{
        Resource, WatchEvent, resource_service_client::ResourceServiceClient, watch_event,
    },
};
use otter_tunnel::{PathCounts, TransportKind, TunnelStream, frame::Limits};
use prost::Message;
use prost_types::{Struct, Value, value::Kind};
use tokio::{io::AsyncWrite, sync::oneshot};
use tonic::service::Routes;

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
    let routes = Routes::new(crumbs);

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

/// A stream's sending half whose end never goes out, as a compromised
/// agent's that answers and never sends its FIN (QUIC) or END_STREAM
/// (HTTP/2): the end is swallowed and the half kept open, since a QUIC
/// send stream dropped unended finishes itself.
struct NoEnd {
    send: Option<Box<dyn AsyncWrite + Send + Unpin>>,
    kept: Arc<Mutex<Vec<Box<dyn AsyncWrite + Send + Unpin>>>>,
}

impl NoEnd {
    fn keep(&mut self) {
        if let Some(send) = self.send.take() {
            self.kept.lock().unwrap().push(send);
        }
    }
}

impl AsyncWrite for NoEnd {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        match self.send.as_mut() {
            Some(send) => Pin::new(send).poll_write(cx, buf),
            None => Poll::Ready(Err(std::io::ErrorKind::BrokenPipe.into())),
        }
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.send.as_mut() {
            Some(send) => Pin::new(send).poll_flush(cx),
            None => Poll::Ready(Ok(())),
        }
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        ready!(self.as_mut().poll_flush(cx))?;
        self.keep();
        Poll::Ready(Ok(()))
    }
}

impl Drop for NoEnd {
    fn drop(&mut self) {
        self.keep();
    }
}

/// Calls within the stream slots a tunnel gives the hub (1,024), nine in
/// ten of them to the agent that never ends its answers ...
const WITHIN_THE_SLOTS: usize = 1_000;
/// ... and as many again past them.
const PAST_THE_SLOTS: usize = 300;

/// A compromised agent, dialled by hand with its cluster's genuine
/// certificate, answers every call whole (head, message, trailers) and
/// never ends its side of the stream. The hub takes the trailers as the
/// answer's end and frees the call's place there, and lets each stream go
/// 2 s later (QUIC: a STOP_SENDING; HTTP/2: a reset). Over HTTP/2 the
/// reset closes the stream at both ends, and calls go on past the agent's
/// 1,024 stream slots. Over QUIC the agent gives the hub a slot back only
/// when it closes a stream itself, which it never does: its calls fail as
/// unavailable once its slots are gone, a neighbour cluster's calls
/// answered throughout.
async fn an_agent_that_never_ends_its_answers(transport: TransportKind) {
    let sim = kube_sim::KubeSim::start(sim_config()).await.expect("sim");
    let fleet = Fleet::start_hub_only(&sim, &["quic", "quic"]).await;
    let answer = Resource {
        object: Some(Struct {
            fields: [(
                "name".to_owned(),
                Value {
                    kind: Some(Kind::StringValue("answered".into())),
                },
            )]
            .into(),
        }),
    };
    let canned = Canned {
        watch: grpc_framed(b""),
        get: grpc_framed(&answer.encode_to_vec()),
        cut: usize::MAX,
    };
    let neighbour = fleet
        .own_agent(1, TransportKind::Quic, Routes::new(canned.clone()))
        .await;

    // edge-0's genuine certificate, enrolled on its join token.
    let channel = fleet.channel().await;
    let token = std::fs::read_to_string(fleet.dir.path().join("token-0")).expect("token");
    let (key, csr) = otter_pki::csr::generate("edge-0", "agent-0").expect("CSR");
    let cert = LinkServiceClient::new(channel.clone())
        .register(RegisterRequest {
            cluster: Some("edge-0".into()),
            csr: Some(csr.into_bytes()),
            agent_id: Some("agent-0".into()),
            agent_version: Some("v0.1.0".into()),
            rancher_project_id: None,
            join_token: Some(token),
        })
        .await
        .expect("enrolled")
        .into_inner()
        .certificate
        .expect("a certificate");
    let cert = String::from_utf8(cert).expect("PEM");
    let alpn = tunnel_alpn(transport);
    let tls =
        otter_pki::tls::client_config(&fleet.ca_pem, Some((&cert, &key)), &[alpn]).expect("TLS");
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], fleet.tunnel));
    let mut acceptor = dial_tunnel(addr, transport, tls).await.expect("dialled");
    // Serves every stream the hub opens, and answers the test's asks for
    // the tunnel's counts.
    let kept = Arc::new(Mutex::new(Vec::new()));
    let (ask, mut asked) = tokio::sync::mpsc::channel::<oneshot::Sender<PathCounts>>(1);
    let served = {
        let (kept, routes) = (kept.clone(), Routes::new(canned));
        tokio::spawn(async move {
            loop {
                let stream = tokio::select! {
                    next = acceptor.accept() => match next {
                        Ok(Some(stream)) => stream,
                        _ => return,
                    },
                    Some(reply) = asked.recv() => {
                        let _ = reply.send(acceptor.packets().unwrap_or_default());
                        continue;
                    }
                };
                let TunnelStream { send, recv, .. } = stream;
                let send = NoEnd {
                    send: Some(send),
                    kept: kept.clone(),
                };
                tokio::spawn(otter_tunnel::http::serve(
                    TunnelStream::new(send, recv),
                    routes.clone(),
                    Limits::default(),
                ));
            }
        })
    };
    let counts = async || {
        let (reply, counts) = oneshot::channel();
        ask.send(reply).await.expect("the agent serves");
        counts.await.expect("counts")
    };
    fleet.all_connected(&channel).await;

    let t = &fleet.admin_token;
    let client = ResourceServiceClient::new(channel.clone());
    let calls = |n: usize, at_once: usize| {
        futures::stream::iter(0..n)
            .map(|i| {
                let mut client = client.clone();
                // Every tenth call goes to the neighbour.
                let cluster = if i % 10 == 9 { "edge-1" } else { "edge-0" };
                async move {
                    let got = within("a call", client.get(with_token(get(cluster, "x"), t)))
                        .await
                        .map(tonic::Response::into_inner);
                    (cluster, got)
                }
            })
            .buffer_unordered(at_once)
            .collect::<Vec<_>>()
    };

    let started = std::time::Instant::now();
    for (cluster, got) in calls(WITHIN_THE_SLOTS, 32).await {
        assert_eq!(got.expect(cluster), answer, "{cluster}: the canned answer");
    }
    let answered = WITHIN_THE_SLOTS - WITHIN_THE_SLOTS / 10;
    let unended = kept.lock().unwrap().len();
    eprintln!(
        "{transport}: {WITHIN_THE_SLOTS} calls answered in {:.1} s; {unended} of the agent's streams left unended",
        started.elapsed().as_secs_f64()
    );
    // The hub may have asked the agent something of its own too.
    assert!(unended >= answered, "{unended} streams left unended");
    assert_eq!(
        metric(&fleet.hub_metrics().await, "otter_hub_calls_in_flight"),
        0.0
    );
    if transport == TransportKind::Quic {
        // The hub stops reading each stream (a STOP_SENDING) 2 s after its
        // trailers: the agent's count of resets and stops received grows by
        // one per stream, on top of what the exchanges themselves took.
        let before = counts().await.resets_received;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
        loop {
            let stopped = counts().await.resets_received - before;
            if stopped >= answered as u64 {
                eprintln!(
                    "{transport}: {stopped} streams let go by the hub {:.1} s after the first call",
                    started.elapsed().as_secs_f64()
                );
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the hub let {stopped} of {answered} streams go"
            );
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    }

    // Past the slots, at once.
    let (mut refused, mut past) = (0, 0);
    for (cluster, got) in calls(PAST_THE_SLOTS, PAST_THE_SLOTS).await {
        match (cluster, transport, got) {
            (_, _, Ok(got)) => {
                assert_eq!(got, answer, "{cluster}: the canned answer");
                past += usize::from(cluster == "edge-0");
            }
            ("edge-0", TransportKind::Quic, Err(status)) => {
                assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
                refused += 1;
            }
            (cluster, _, Err(status)) => panic!("{cluster}: {status:?}"),
        }
    }
    eprintln!("{transport}: past the slots, {past} answered by the agent, {refused} unavailable");
    match transport {
        TransportKind::Quic => assert!(
            refused > 0 && unended + past <= 1_024,
            "{past} answered and {refused} refused past {unended} unended streams"
        ),
        _ => assert_eq!(past, PAST_THE_SLOTS - PAST_THE_SLOTS / 10),
    }
    assert_eq!(
        metric(&fleet.hub_metrics().await, "otter_hub_calls_in_flight"),
        0.0
    );
    served.abort();
    neighbour.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quic_agent_that_never_sends_its_fin_starves_only_its_own_tunnel() {
    an_agent_that_never_ends_its_answers(TransportKind::Quic).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_h2_agent_that_never_ends_its_streams_holds_none_for_long() {
    an_agent_that_never_ends_its_answers(TransportKind::H2).await;
}
