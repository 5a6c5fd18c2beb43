//! A Watch through the hub outlives its tunnel. When the cluster's tunnel
//! drops (the agent restarts, the network is cut, the agent moves to
//! another transport or replica), the caller's stream stays open: the hub
//! opens the Watch again on the cluster's next tunnel from the last
//! resourceVersion it passed on, so the caller sees every change once. If
//! that version has expired, the agent's ERROR event (410) tells the caller
//! to list again, as a direct Watch would. The wait is bounded by
//! `watch_resume_grace`; after it the call ends `Unavailable` as before.
//!
//! Only whole messages are passed on, so a message cut by the drop is
//! never half-delivered; it comes again from the resumed Watch.

use std::{
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll, ready},
    time::Duration,
};

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use otter_proto::resource::v1::WatchRequest;
use prost::Message;
use tonic::{Code, Status};

use crate::{
    auth::Principal,
    forward::{HttpBody, Sent},
    server::HubState,
};

/// The method whose calls are resumed.
pub const WATCH: &str = "/otterscale.resource.v1.ResourceService/Watch";

/// Trailer of a call that ended because its tunnel was lost (value: the
/// cluster): how a replica that passed a Watch to the one holding the
/// tunnel tells that loss from the cluster's own answer.
pub const TUNNEL_LOST: &str = "otter-tunnel-lost";

/// Largest watch event held while the rest of it arrives (an object in
/// etcd is at most 1.5 MiB; its JSON in a Struct is larger).
const MAX_EVENT: usize = 16 * 1024 * 1024;

/// First and longest pause between tries to open the Watch again.
const FIRST_RETRY: Duration = Duration::from_millis(100);
const MAX_RETRY: Duration = Duration::from_secs(2);

/// The one field of a watch event the hub reads.
#[derive(Clone, PartialEq, prost::Message)]
struct EventVersion {
    #[prost(string, optional, tag = "3")]
    resource_version: Option<String>,
}

/// What opening the Watch again takes.
struct Reopen {
    state: Arc<HubState>,
    caller: Principal,
    cluster: String,
    parts: http::request::Parts,
    request: WatchRequest,
}

/// The answer to a Watch whose first attempt answered `resp`, resumed on
/// the cluster's next tunnel whenever this one drops. `first` is the
/// request's first gRPC message as the caller sent it.
pub fn watch(
    state: &Arc<HubState>,
    caller: Principal,
    cluster: String,
    parts: http::request::Parts,
    first: &Bytes,
    resp: http::Response<HttpBody>,
) -> http::Response<HttpBody> {
    // A refusal before any event (trailers only) is the call's answer.
    if resp.headers().contains_key("grpc-status") {
        return resp;
    }
    let len = first
        .get(1..5)
        .map_or(0, |b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize);
    let Some(Ok(request)) = first.get(5..5 + len).map(WatchRequest::decode) else {
        return resp;
    };
    let reopen = Arc::new(Reopen {
        state: state.clone(),
        caller,
        cluster,
        parts,
        request,
    });
    resp.map(|inner| {
        ResumingWatch {
            inner,
            reopen,
            pending: BytesMut::new(),
            version: None,
            reopening: None,
            done: false,
        }
        .boxed_unsync()
    })
}

impl Reopen {
    /// Opens the Watch again from `version` (or as first asked), trying
    /// until the grace window closes.
    async fn open(self: Arc<Self>, version: Option<String>) -> Result<HttpBody, Status> {
        let grace = self.state.config.watch_resume_grace;
        let deadline = tokio::time::Instant::now() + grace;
        let mut pause = FIRST_RETRY;
        loop {
            let failed = match self.once(version.clone()).await {
                Ok(body) => {
                    self.state.metrics.watch_resumes.inc();
                    tracing::info!(cluster = %self.cluster, resource_version = ?version, "watch resumed on the cluster's new tunnel");
                    return Ok(body);
                }
                Err(s) if matches!(s.code(), Code::Unavailable | Code::ResourceExhausted) => s,
                Err(s) => return Err(s),
            };
            if tokio::time::Instant::now() + pause >= deadline {
                return Err(Status::unavailable(format!(
                    "tunnel to cluster {} lost and not back within {} s: {}",
                    self.cluster,
                    grace.as_secs(),
                    failed.message()
                )));
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(MAX_RETRY);
        }
    }

    /// One try: the answer's body, or why there is none.
    async fn once(&self, version: Option<String>) -> Result<HttpBody, Status> {
        let mut request = self.request.clone();
        if version.is_some() {
            request.resource_version = version;
        }
        let encoded = request.encode_to_vec();
        let mut message = BytesMut::with_capacity(5 + encoded.len());
        message.extend_from_slice(&[0]);
        message.extend_from_slice(&(encoded.len() as u32).to_be_bytes());
        message.extend_from_slice(&encoded);
        let empty = http_body_util::Empty::new()
            .map_err(|never| match never {})
            .boxed_unsync();
        let sent = crate::forward::send(
            &self.state,
            &self.caller,
            &self.cluster,
            self.parts.clone(),
            message.freeze(),
            empty,
        )
        .await?;
        let resp = match sent {
            Sent::Tunnel { resp, .. } => resp.map(|b| b.map_err(Into::into).boxed_unsync()),
            Sent::Peer(resp) => resp,
        };
        match Status::from_header_map(resp.headers()) {
            Some(status) => Err(status),
            None => Ok(resp.into_body()),
        }
    }
}

type Opening = Pin<Box<dyn Future<Output = Result<HttpBody, Status>> + Send>>;

struct ResumingWatch {
    inner: HttpBody,
    reopen: Arc<Reopen>,
    /// Bytes of messages not yet whole.
    pending: BytesMut,
    /// The resourceVersion of the last event passed on.
    version: Option<String>,
    reopening: Option<Opening>,
    /// The call's status was passed on.
    done: bool,
}

impl ResumingWatch {
    /// Takes the whole messages at the front of `pending`, noting the last
    /// event's resourceVersion.
    fn whole_messages(&mut self) -> Result<Option<Bytes>, Status> {
        let mut at = 0;
        while let Some(head) = self.pending.get(at..at + 5) {
            let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
            if len > MAX_EVENT {
                return Err(Status::resource_exhausted(format!(
                    "watch event of {len} bytes is over the limit of {MAX_EVENT}"
                )));
            }
            let Some(message) = self.pending.get(at + 5..at + 5 + len) else {
                break;
            };
            if head[0] == 0
                && let Ok(EventVersion {
                    resource_version: Some(v),
                }) = EventVersion::decode(message)
            {
                self.version = Some(v);
            }
            at += 5 + len;
        }
        Ok((at > 0).then(|| self.pending.split_to(at).freeze()))
    }

    /// The tunnel is gone: what was half-received is dropped, and the Watch
    /// is opened again from the last event passed on.
    fn lost(&mut self, why: &dyn std::fmt::Display) {
        tracing::info!(cluster = %self.reopen.cluster, resource_version = ?self.version, reason = %why, "watch lost its tunnel; resuming");
        self.pending.clear();
        // The dead attempt's body holds its call slot and place in the
        // in-flight gauge: let them go while the cluster is away.
        self.inner = http_body_util::Empty::new()
            .map_err(|never| match never {})
            .boxed_unsync();
        self.reopening = Some(Box::pin(self.reopen.clone().open(self.version.clone())));
    }
}

impl Body for ResumingWatch {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        loop {
            if self.done {
                return Poll::Ready(None);
            }
            if let Some(opening) = &mut self.reopening {
                let opened = ready!(opening.as_mut().poll(cx));
                self.reopening = None;
                match opened {
                    Ok(body) => self.inner = body,
                    Err(status) => {
                        let mut trailers = http::HeaderMap::new();
                        let _ = status.add_header(&mut trailers);
                        self.done = true;
                        return Poll::Ready(Some(Ok(Frame::trailers(trailers))));
                    }
                }
            }
            match ready!(Pin::new(&mut self.inner).poll_frame(cx)) {
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => {
                        self.pending.extend_from_slice(&data);
                        match self.whole_messages() {
                            Ok(Some(messages)) => {
                                return Poll::Ready(Some(Ok(Frame::data(messages))));
                            }
                            Ok(None) => {}
                            Err(status) => return Poll::Ready(Some(Err(Box::new(status)))),
                        }
                    }
                    Err(frame) => {
                        // The replica holding the tunnel lost it.
                        if frame
                            .trailers_ref()
                            .is_some_and(|t| t.contains_key(TUNNEL_LOST))
                        {
                            self.lost(&"the replica holding the tunnel lost it");
                            continue;
                        }
                        self.done = true;
                        return Poll::Ready(Some(Ok(frame)));
                    }
                },
                Some(Err(e)) => self.lost(&e),
                None => self.lost(&"the stream ended without a status"),
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done
    }
}
