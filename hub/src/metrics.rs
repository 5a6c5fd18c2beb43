//! Prometheus metrics of the hub, in the text exposition format at
//! `/metrics`: requests by method and code, latency until the response
//! starts, live tunnels by transport, calls in flight, bytes through
//! tunnels, and registration outcomes.

use std::{
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicI64, AtomicU64},
    },
    task::{Context, Poll, ready},
    time::Instant,
};

use bytes::Bytes;
use http_body::{Body, Frame};
use prometheus_client::{
    encoding::{EncodeLabelSet, text::encode},
    metrics::{counter::Counter, family::Family, gauge::Gauge, histogram::Histogram},
    registry::Registry,
};

use crate::forward::HttpBody;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MethodCode {
    pub method: String,
    pub code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MethodLabel {
    pub method: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TransportLabel {
    pub transport: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DirectionLabel {
    pub direction: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabel {
    pub outcome: String,
}

/// Every metric of the hub.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    pub requests: Family<MethodCode, Counter>,
    pub latency: Family<MethodLabel, Histogram>,
    pub tunnels: Family<TransportLabel, Gauge<i64, AtomicI64>>,
    pub calls_in_flight: Gauge<i64, AtomicI64>,
    pub tunnel_bytes: Family<DirectionLabel, Counter<u64, AtomicU64>>,
    /// The two series of `tunnel_bytes`, held so that counting a frame
    /// looks nothing up (a bulk stream counts thousands a second).
    pub bytes_to_agent: Counter<u64, AtomicU64>,
    pub bytes_from_agent: Counter<u64, AtomicU64>,
    pub registers: Family<OutcomeLabel, Counter>,
    pub admissions_in_progress: Gauge<i64, AtomicI64>,
    pub admissions_peak: Gauge<i64, AtomicI64>,
    pub admissions_max: Gauge<i64, AtomicI64>,
    pub tunnel_refusals: Gauge<i64, AtomicI64>,
    /// The tunnel port's handshakes not yet verified (see
    /// `otter_tunnel::handshakes`): pending now, dropped for a newcomer and
    /// refused for their source's share since the hub started.
    pub handshakes_pending: Gauge<i64, AtomicI64>,
    pub handshakes_evicted: Gauge<i64, AtomicI64>,
    pub handshakes_refused: Gauge<i64, AtomicI64>,
    /// The same of the API port (where agents Register), and its
    /// connections open now and closed at once for being over a cap.
    pub api_handshakes_pending: Gauge<i64, AtomicI64>,
    pub api_handshakes_evicted: Gauge<i64, AtomicI64>,
    pub api_handshakes_refused: Gauge<i64, AtomicI64>,
    pub api_connections_open: Gauge<i64, AtomicI64>,
    pub api_connections_refused: Gauge<i64, AtomicI64>,
    pub registrations_peak: Gauge<i64, AtomicI64>,
    pub registration_refusals: Gauge<i64, AtomicI64>,
    /// kubectl exec / attach / port-forward connections relayed right now.
    pub kube_upgraded: Gauge<i64, AtomicI64>,
    /// Audit lines dropped because the writer fell behind.
    pub audit_dropped: Counter<u64, AtomicU64>,
    /// Watches and followed logs opened again on a cluster's next tunnel.
    pub streams_resumed: Counter<u64, AtomicU64>,
    /// Datagrams the kernel dropped at the QUIC tunnel socket for want of
    /// buffer room (read from the kernel at each scrape).
    pub quic_socket_drops: Gauge<i64, AtomicI64>,
    /// The QUIC tunnel socket's port, once bound (0: none).
    quic_port: std::sync::atomic::AtomicU16,
    /// TLS session tickets the tunnel port's listeners opened (sessions
    /// resumed), per listener.
    pub tls_tickets_accepted: Family<ListenerLabel, Gauge<i64, AtomicI64>>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ListenerLabel {
    pub listener: String,
}

fn latency_histogram() -> Histogram {
    // 100 µs … ~3 min, doubling.
    Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(
        0.0001, 2.0, 21,
    ))
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("otter_hub");
        let requests = Family::<MethodCode, Counter>::default();
        let latency = Family::<MethodLabel, Histogram>::new_with_constructor(
            latency_histogram as fn() -> Histogram,
        );
        let tunnels = Family::<TransportLabel, Gauge<i64, AtomicI64>>::default();
        let calls_in_flight = Gauge::<i64, AtomicI64>::default();
        let tunnel_bytes = Family::<DirectionLabel, Counter<u64, AtomicU64>>::default();
        let direction = |d: &str| {
            tunnel_bytes
                .get_or_create(&DirectionLabel {
                    direction: d.to_owned(),
                })
                .clone()
        };
        let (bytes_to_agent, bytes_from_agent) = (direction("to_agent"), direction("from_agent"));
        let registers = Family::<OutcomeLabel, Counter>::default();
        registry.register("requests", "RPCs by method and gRPC code", requests.clone());
        registry.register(
            "request_duration_seconds",
            "Time until the response starts, by method",
            latency.clone(),
        );
        registry.register(
            "tunnels",
            "Live agent tunnels by transport",
            tunnels.clone(),
        );
        registry.register(
            "calls_in_flight",
            "Calls forwarded over tunnels right now",
            calls_in_flight.clone(),
        );
        registry.register(
            "tunnel_bytes",
            "Bytes of forwarded calls, by direction",
            tunnel_bytes.clone(),
        );
        registry.register("registers", "Register outcomes", registers.clone());
        let admissions_in_progress = Gauge::<i64, AtomicI64>::default();
        let admissions_peak = Gauge::<i64, AtomicI64>::default();
        let admissions_max = Gauge::<i64, AtomicI64>::default();
        let tunnel_refusals = Gauge::<i64, AtomicI64>::default();
        let quic_socket_drops = Gauge::<i64, AtomicI64>::default();
        registry.register(
            "quic_socket_drops",
            "Datagrams the kernel dropped at the QUIC tunnel socket for want of buffer room since the hub started (agents' first packets in a reconnect storm: raise net.core.rmem_max)",
            quic_socket_drops.clone(),
        );
        registry.register(
            "tunnel_admissions_in_progress",
            "Tunnels being set up right now",
            admissions_in_progress.clone(),
        );
        registry.register(
            "tunnel_admissions_peak",
            "The most tunnels set up at once since the hub started",
            admissions_peak.clone(),
        );
        registry.register(
            "tunnel_admissions_max",
            "Tunnels the hub sets up at once at most (configured)",
            admissions_max.clone(),
        );
        registry.register(
            "tunnel_refusals",
            "Tunnels told to come back later since the hub started",
            tunnel_refusals.clone(),
        );
        let handshakes_pending = Gauge::<i64, AtomicI64>::default();
        let handshakes_evicted = Gauge::<i64, AtomicI64>::default();
        let handshakes_refused = Gauge::<i64, AtomicI64>::default();
        registry.register(
            "tunnel_handshakes_pending",
            "Connections to the tunnel port whose TLS or QUIC handshake has not yet verified a client certificate",
            handshakes_pending.clone(),
        );
        registry.register(
            "tunnel_handshakes_evicted",
            "Handshakes dropped for a newer connection since the hub started, every place being taken (stalled or slow peers)",
            handshakes_evicted.clone(),
        );
        registry.register(
            "tunnel_handshakes_refused",
            "Connections refused at once since the hub started for their source holding more than its share of the pending handshakes",
            handshakes_refused.clone(),
        );
        let gauge = |registry: &mut Registry, name: &str, help: &str| {
            let g = Gauge::<i64, AtomicI64>::default();
            registry.register(name, help, g.clone());
            g
        };
        let api_handshakes_pending = gauge(
            &mut registry,
            "api_handshakes_pending",
            "Connections to the API port that have not yet sent a whole request head",
        );
        let api_handshakes_evicted = gauge(
            &mut registry,
            "api_handshakes_evicted",
            "API connections dropped before their first request for a newer connection since the hub started, every place being taken (stalled or slow peers)",
        );
        let api_handshakes_refused = gauge(
            &mut registry,
            "api_handshakes_refused",
            "API connections refused at once since the hub started for their source holding more than its share of the pending ones",
        );
        let api_connections_open = gauge(
            &mut registry,
            "api_connections_open",
            "Connections to the API port open now",
        );
        let api_connections_refused = gauge(
            &mut registry,
            "api_connections_refused",
            "API connections closed at once since the hub started for being over the total or their source's cap",
        );
        let registrations_peak = Gauge::<i64, AtomicI64>::default();
        let registration_refusals = Gauge::<i64, AtomicI64>::default();
        registry.register(
            "registrations_peak",
            "The most Register calls served at once since the hub started",
            registrations_peak.clone(),
        );
        registry.register(
            "registration_refusals",
            "Register calls told to come back later since the hub started",
            registration_refusals.clone(),
        );
        let kube_upgraded = Gauge::<i64, AtomicI64>::default();
        registry.register(
            "kube_upgraded_connections",
            "Upgraded connections (exec, attach, port-forward) of the Kubernetes API proxy",
            kube_upgraded.clone(),
        );
        let audit_dropped = Counter::<u64, AtomicU64>::default();
        registry.register(
            "audit_dropped",
            "Audit lines dropped because the audit writer fell behind",
            audit_dropped.clone(),
        );
        let streams_resumed = Counter::<u64, AtomicU64>::default();
        registry.register(
            "streams_resumed",
            "Watches and followed logs opened again on a cluster's next tunnel after theirs dropped",
            streams_resumed.clone(),
        );
        let tls_tickets_accepted = Family::<ListenerLabel, Gauge<i64, AtomicI64>>::default();
        registry.register(
            "tls_tickets_accepted",
            "TLS session tickets the tunnel port opened (sessions resumed instead of full handshakes), per listener",
            tls_tickets_accepted.clone(),
        );
        Self {
            registry,
            requests,
            latency,
            tunnels,
            calls_in_flight,
            tunnel_bytes,
            bytes_to_agent,
            bytes_from_agent,
            registers,
            admissions_in_progress,
            quic_socket_drops,
            quic_port: Default::default(),
            admissions_peak,
            admissions_max,
            tunnel_refusals,
            handshakes_pending,
            handshakes_evicted,
            handshakes_refused,
            api_handshakes_pending,
            api_handshakes_evicted,
            api_handshakes_refused,
            api_connections_open,
            api_connections_refused,
            registrations_peak,
            registration_refusals,
            kube_upgraded,
            audit_dropped,
            streams_resumed,
            tls_tickets_accepted,
        }
    }
}

impl Metrics {
    /// The text exposition of every metric.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = encode(&mut out, &self.registry);
        out
    }

    /// Copies the counts of the tunnel and Register gates in, before a render.
    pub fn pacers(
        &self,
        tunnels: &otter_tunnel::pace::Pacer,
        registrations: &otter_tunnel::pace::Pacer,
    ) {
        let n = |v: usize| i64::try_from(v).unwrap_or(i64::MAX);
        let m = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        self.admissions_in_progress.set(n(tunnels.in_progress()));
        self.admissions_peak.set(n(tunnels.peak()));
        self.admissions_max.set(n(tunnels.max()));
        self.tunnel_refusals.set(m(tunnels.refused()));
        let handshakes = tunnels.handshakes();
        self.handshakes_pending.set(n(handshakes.pending()));
        self.handshakes_evicted.set(m(handshakes.evicted()));
        self.handshakes_refused.set(m(handshakes.refused()));
        self.registrations_peak.set(n(registrations.peak()));
        self.registration_refusals.set(m(registrations.refused()));
    }

    /// Copies the API port's counts in, before a render.
    pub fn api_port(
        &self,
        pending: &otter_tunnel::handshakes::Handshakes,
        connections: &crate::limits::ApiConnections,
    ) {
        let n = |v: usize| i64::try_from(v).unwrap_or(i64::MAX);
        let m = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        self.api_handshakes_pending.set(n(pending.pending()));
        self.api_handshakes_evicted.set(m(pending.evicted()));
        self.api_handshakes_refused.set(m(pending.refused()));
        self.api_connections_open.set(n(connections.open()));
        self.api_connections_refused.set(m(connections.refused()));
    }

    /// Names the QUIC tunnel socket's port, whose drops [`Self::quic_socket`]
    /// reads.
    pub fn watch_quic_socket(&self, port: u16) {
        self.quic_port
            .store(port, std::sync::atomic::Ordering::Relaxed);
    }

    /// Reads the QUIC tunnel socket's drops from the kernel, before a render.
    pub fn quic_socket(&self) {
        let port = self.quic_port.load(std::sync::atomic::Ordering::Relaxed);
        if port == 0 {
            return;
        }
        if let Some(drops) = otter_tunnel::quic::kernel_drops(port) {
            self.quic_socket_drops
                .set(i64::try_from(drops).unwrap_or(i64::MAX));
        }
    }

    /// Copies the ticket counts of the tunnel port in, before a render.
    pub fn tickets(&self, tickets: &crate::tickets::Tickets) {
        for (listener, keys) in [("tunnel-tcp", &tickets.tcp), ("tunnel-quic", &tickets.quic)] {
            self.tls_tickets_accepted
                .get_or_create(&ListenerLabel {
                    listener: listener.to_owned(),
                })
                .set(i64::try_from(keys.accepted()).unwrap_or(i64::MAX));
        }
    }

    pub fn register_outcome(&self, outcome: &str) {
        self.registers
            .get_or_create(&OutcomeLabel {
                outcome: outcome.to_owned(),
            })
            .inc();
    }

    /// Counts a finished call.
    pub fn request_done(&self, method: &str, code: tonic::Code) {
        self.requests
            .get_or_create(&MethodCode {
                method: method.to_owned(),
                code: format!("{code:?}"),
            })
            .inc();
    }
}

/// Wraps a gRPC response body to record the call's code when its status
/// arrives (headers for trailers-only responses, otherwise trailers), and
/// the latency until the response started.
pub fn observe(
    metrics: Arc<Metrics>,
    method: String,
    started: Instant,
    resp: http::Response<HttpBody>,
) -> http::Response<HttpBody> {
    metrics
        .latency
        .get_or_create(&MethodLabel {
            method: method.clone(),
        })
        .observe(started.elapsed().as_secs_f64());
    if let Some(status) = tonic::Status::from_header_map(resp.headers()) {
        metrics.request_done(&method, status.code());
        return resp;
    }
    resp.map(|inner| {
        http_body_util::BodyExt::boxed_unsync(Observed {
            inner,
            metrics,
            method,
            done: false,
        })
    })
}

struct Observed {
    inner: HttpBody,
    metrics: Arc<Metrics>,
    method: String,
    done: bool,
}

impl Drop for Observed {
    fn drop(&mut self) {
        if !self.done {
            // The caller went away before the status.
            self.metrics
                .request_done(&self.method, tonic::Code::Cancelled);
        }
    }
}

impl Body for Observed {
    type Data = Bytes;
    type Error = crate::protocol::BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let frame = ready!(Pin::new(&mut self.inner).poll_frame(cx));
        match &frame {
            Some(Ok(f)) if f.is_trailers() => {
                let code = f
                    .trailers_ref()
                    .and_then(tonic::Status::from_header_map)
                    .map_or(tonic::Code::Unknown, |s| s.code());
                self.done = true;
                self.metrics.request_done(&self.method, code);
            }
            Some(Err(_)) | None if !self.done => {
                self.done = true;
                self.metrics
                    .request_done(&self.method, tonic::Code::Unavailable);
            }
            _ => {}
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }
}
