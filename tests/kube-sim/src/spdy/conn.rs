//! The server side of one SPDY/3.1 connection, as the kubelet runs it: the client opens
//! every stream (odd ids, increasing), the server answers each with SYN_REPLY or
//! RST_STREAM, echoes the client's PINGs, and both sides half-close streams with FIN.
//!
//! Flow control: Kubernetes clients neither send WINDOW_UPDATE nor wait for one, so the
//! windows of SPDY/3.1 are not enforced in either direction; received WINDOW_UPDATE and
//! SETTINGS frames are validated and ignored, and backpressure comes from the transport.
//!
//! [`serve`] runs three parts side by side in the caller's task: a reader that decodes
//! frames and hands [`Event`]s to the session, a writer that encodes what the session sends
//! through its [`Handle`], and the session itself. A malformed or oversized frame ends the
//! connection with GOAWAY(PROTOCOL_ERROR); when the session ends, GOAWAY(OK) is sent, the
//! write side is shut down, and the client gets a moment to close its side.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;

use super::frame::{self, Frame, FrameError, HEAD_LEN, Head, goaway, rst};
use super::header::{Deflater, Headers, Inflater};

/// Streams that may be open at once; more are refused with REFUSED_STREAM.
pub const MAX_STREAMS: usize = 256;
/// Events the reader may queue ahead of the session (each at most one DATA payload).
const EVENT_QUEUE: usize = 16;
/// Frames the session may queue ahead of the writer.
const OUT_QUEUE: usize = 64;
/// Frames written in one batch before flushing.
const WRITE_BATCH: usize = 64;
/// How long closing may take: sending GOAWAY, then letting the client close first.
const CLOSE_WAIT: Duration = Duration::from_secs(5);
const DRAIN_WAIT: Duration = Duration::from_secs(2);

/// What the client did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// The client opened a stream: answer it with [`Handle::accept`] or [`Handle::refuse`].
    Open {
        id: u32,
        headers: Headers,
        fin: bool,
    },
    Data {
        id: u32,
        data: Bytes,
    },
    /// The client sends no more on this stream.
    Fin {
        id: u32,
    },
    /// The client reset the stream.
    Reset {
        id: u32,
    },
    /// The client sent GOAWAY: it opens no more streams.
    GoAway,
}

/// The session's inbox; `None` once the client is gone.
#[derive(Debug)]
pub struct Events {
    rx: mpsc::Receiver<Event>,
}

impl Events {
    pub async fn next(&mut self) -> Option<Event> {
        self.rx.recv().await
    }
}

#[derive(Debug, Default)]
struct StreamState {
    remote_done: bool,
    local_done: bool,
}

/// Streams the client opened that are not yet closed in both directions.
#[derive(Debug, Default)]
struct Table {
    streams: HashMap<u32, StreamState>,
    last_id: u32,
}

impl Table {
    fn settle(&mut self, id: u32) {
        if self
            .streams
            .get(&id)
            .is_some_and(|s| s.remote_done && s.local_done)
        {
            self.streams.remove(&id);
        }
    }
}

#[derive(Debug)]
enum Out {
    Frame(Frame),
    Close(u32),
}

/// What the session sends with. Each call returns `false` once the stream (or the whole
/// connection) can no longer carry it.
#[derive(Debug, Clone)]
pub struct Handle {
    tx: mpsc::Sender<Out>,
    table: Arc<Mutex<Table>>,
}

impl Handle {
    fn with<T>(&self, f: impl FnOnce(&mut Table) -> T) -> T {
        match self.table.lock() {
            Ok(mut t) => f(&mut t),
            Err(p) => f(&mut p.into_inner()),
        }
    }

    fn writable(&self, id: u32) -> bool {
        self.with(|t| t.streams.get(&id).is_some_and(|s| !s.local_done))
    }

    async fn out(&self, f: Frame) -> bool {
        self.tx.send(Out::Frame(f)).await.is_ok()
    }

    /// SYN_REPLY with no headers, as the kubelet answers.
    pub async fn accept(&self, id: u32) -> bool {
        self.writable(id)
            && self
                .out(Frame::SynReply {
                    stream: id,
                    fin: false,
                    headers: Headers::new(),
                })
                .await
    }

    /// RST_STREAM: the stream is gone in both directions.
    pub async fn refuse(&self, id: u32, status: u32) -> bool {
        let known = self.with(|t| t.streams.remove(&id).is_some());
        known && self.out(Frame::RstStream { stream: id, status }).await
    }

    /// Sends data on a stream (an empty slice sends nothing).
    pub async fn send(&self, id: u32, data: &[u8]) -> bool {
        if !self.writable(id) {
            return false;
        }
        if data.is_empty() {
            return true;
        }
        // Keep frames well below the 24-bit limit and the peer's likely buffer sizes.
        for chunk in data.chunks(64 * 1024) {
            let f = Frame::Data {
                stream: id,
                fin: false,
                data: Bytes::copy_from_slice(chunk),
            };
            if !self.out(f).await {
                return false;
            }
        }
        true
    }

    /// Half-closes the stream from this side (an empty DATA frame with FIN).
    pub async fn finish(&self, id: u32) -> bool {
        let was_open = self.with(|t| match t.streams.get_mut(&id) {
            Some(s) if !s.local_done => {
                s.local_done = true;
                t.settle(id);
                true
            }
            _ => false,
        });
        was_open
            && self
                .out(Frame::Data {
                    stream: id,
                    fin: true,
                    data: Bytes::new(),
                })
                .await
    }
}

/// Why the reader stopped.
#[derive(Debug)]
enum ReadEnd {
    /// The client closed the connection (or the transport failed).
    Closed,
    /// The client broke the protocol.
    Protocol(FrameError),
}

/// Runs a SPDY/3.1 server connection over `io` with `session` until the session returns
/// or the connection ends. Everything it starts lives inside the returned future.
pub async fn serve<T, F, Fut>(io: T, session: F)
where
    T: AsyncRead + AsyncWrite + Send + Unpin,
    F: FnOnce(Handle, Events) -> Fut,
    Fut: Future<Output = ()>,
{
    let (rd, wr) = tokio::io::split(io);
    let table = Arc::new(Mutex::new(Table::default()));
    let (out_tx, out_rx) = mpsc::channel::<Out>(OUT_QUEUE);
    let (ev_tx, ev_rx) = mpsc::channel::<Event>(EVENT_QUEUE);
    let handle = Handle {
        tx: out_tx.clone(),
        table: table.clone(),
    };
    let reader = read_loop(rd, ev_tx, out_tx.clone(), table.clone());
    let writer = write_loop(wr, out_rx, table.clone());
    tokio::pin!(reader, writer);
    let mut reader_done = false;
    let status = {
        let session = session(handle, Events { rx: ev_rx });
        tokio::pin!(session);
        loop {
            tokio::select! {
                r = &mut reader, if !reader_done => {
                    reader_done = true;
                    match r {
                        // The session sees its events end and finishes.
                        ReadEnd::Closed => {}
                        ReadEnd::Protocol(e) => {
                            tracing::debug!(error = %e, "spdy: closing a connection that broke the protocol");
                            break goaway::PROTOCOL_ERROR;
                        }
                    }
                }
                _ = &mut session => break goaway::OK,
                _ = &mut writer => return,
            }
        }
        // The session (and every process or socket it owns) is dropped here.
    };
    let closing = async {
        if out_tx.send(Out::Close(status)).await.is_ok() {
            drop(out_tx);
            (&mut writer).await;
        }
        // Read on (and answer pings) until the client closes, so that closing does not
        // turn into a reset that could discard what it has not read yet.
        if !reader_done && status == goaway::OK {
            let _ = tokio::time::timeout(DRAIN_WAIT, &mut reader).await;
        }
    };
    let _ = tokio::time::timeout(CLOSE_WAIT, closing).await;
}

/// Reads exactly `buf.len()` bytes; `Ok(false)` for a clean end before the first byte.
async fn read_full<R: AsyncRead + Unpin>(rd: &mut R, buf: &mut [u8]) -> std::io::Result<bool> {
    let mut got = 0;
    while got < buf.len() {
        let n = rd.read(&mut buf[got..]).await?;
        if n == 0 {
            if got == 0 {
                return Ok(false);
            }
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        got += n;
    }
    Ok(true)
}

/// Reads one frame: `None` at a clean end of the connection.
pub(crate) async fn read_frame<R: AsyncRead + Unpin>(
    rd: &mut R,
    z: &mut Inflater,
) -> Result<Option<Frame>, ReadError> {
    let mut head = [0u8; HEAD_LEN];
    if !read_full(rd, &mut head).await? {
        return Ok(None);
    }
    let head = Head::parse(head);
    head.check()?;
    let mut payload = BytesMut::zeroed(head.len());
    if !read_full(rd, &mut payload).await? && head.len() > 0 {
        return Err(ReadError::Io(std::io::ErrorKind::UnexpectedEof.into()));
    }
    Ok(Some(frame::decode(head, payload.freeze(), z)?))
}

#[derive(Debug, thiserror::Error)]
pub(crate) enum ReadError {
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Frame(#[from] FrameError),
}

fn lock(t: &Mutex<Table>) -> std::sync::MutexGuard<'_, Table> {
    match t.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

async fn read_loop<R: AsyncRead + Unpin>(
    mut rd: R,
    ev: mpsc::Sender<Event>,
    out: mpsc::Sender<Out>,
    table: Arc<Mutex<Table>>,
) -> ReadEnd {
    let mut z = Inflater::new();
    // Once the session is gone, events are dropped and reading only drains.
    let emit = |e: Event| {
        let ev = ev.clone();
        async move {
            let _ = ev.send(e).await;
        }
    };
    let send = |f: Frame| {
        let out = out.clone();
        async move {
            let _ = out.send(Out::Frame(f)).await;
        }
    };
    loop {
        let f = match read_frame(&mut rd, &mut z).await {
            Ok(Some(f)) => f,
            Ok(None) | Err(ReadError::Io(_)) => return ReadEnd::Closed,
            Err(ReadError::Frame(e)) => return ReadEnd::Protocol(e),
        };
        match f {
            Frame::SynStream {
                stream,
                associated,
                fin,
                unidirectional,
                headers,
                ..
            } => {
                let verdict = {
                    let mut t = lock(&table);
                    if stream % 2 == 0 || stream <= t.last_id {
                        Err(FrameError::Malformed(
                            "client stream id not odd and increasing",
                        ))
                    } else {
                        t.last_id = stream;
                        if associated != 0 || t.streams.len() >= MAX_STREAMS {
                            Ok(false)
                        } else {
                            t.streams.insert(
                                stream,
                                StreamState {
                                    remote_done: fin,
                                    local_done: unidirectional,
                                },
                            );
                            Ok(true)
                        }
                    }
                };
                match verdict {
                    Err(e) => return ReadEnd::Protocol(e),
                    Ok(false) => {
                        send(Frame::RstStream {
                            stream,
                            status: rst::REFUSED_STREAM,
                        })
                        .await
                    }
                    Ok(true) => {
                        emit(Event::Open {
                            id: stream,
                            headers,
                            fin,
                        })
                        .await;
                        if fin {
                            emit(Event::Fin { id: stream }).await;
                        }
                    }
                }
            }
            Frame::Data { stream, fin, data } => {
                enum Verdict {
                    Deliver,
                    Unknown,
                    Ignore,
                    AlreadyClosed,
                }
                let verdict = {
                    let mut t = lock(&table);
                    let last_id = t.last_id;
                    match t.streams.get_mut(&stream) {
                        Some(s) if s.remote_done => {
                            t.streams.remove(&stream);
                            Verdict::AlreadyClosed
                        }
                        Some(s) => {
                            if fin {
                                s.remote_done = true;
                                t.settle(stream);
                            }
                            Verdict::Deliver
                        }
                        // Data for a stream this side already closed or reset: drop it.
                        None if stream % 2 == 1 && stream <= last_id => Verdict::Ignore,
                        None => Verdict::Unknown,
                    }
                };
                match verdict {
                    Verdict::Deliver => {
                        if !data.is_empty() {
                            emit(Event::Data { id: stream, data }).await;
                        }
                        if fin {
                            emit(Event::Fin { id: stream }).await;
                        }
                    }
                    Verdict::AlreadyClosed => {
                        send(Frame::RstStream {
                            stream,
                            status: rst::STREAM_ALREADY_CLOSED,
                        })
                        .await;
                        emit(Event::Reset { id: stream }).await;
                    }
                    Verdict::Unknown => {
                        send(Frame::RstStream {
                            stream,
                            status: rst::INVALID_STREAM,
                        })
                        .await
                    }
                    Verdict::Ignore => {}
                }
            }
            Frame::RstStream { stream, .. } => {
                let known = lock(&table).streams.remove(&stream).is_some();
                if known {
                    emit(Event::Reset { id: stream }).await;
                }
            }
            Frame::Headers { stream, fin, .. } => {
                // Extra headers mean nothing to these protocols; a FIN still counts.
                let deliver_fin = {
                    let mut t = lock(&table);
                    match t.streams.get_mut(&stream) {
                        Some(s) if fin && !s.remote_done => {
                            s.remote_done = true;
                            t.settle(stream);
                            true
                        }
                        _ => false,
                    }
                };
                if deliver_fin {
                    emit(Event::Fin { id: stream }).await;
                }
            }
            Frame::SynReply { stream, .. } => {
                // This side never opens streams, so there is nothing to reply to.
                send(Frame::RstStream {
                    stream,
                    status: rst::PROTOCOL_ERROR,
                })
                .await
            }
            Frame::Ping { id } => {
                // Odd ids are the client's own pings: echo them. Even ones would answer
                // pings of ours, and this side sends none.
                if id % 2 == 1 {
                    send(Frame::Ping { id }).await;
                }
            }
            Frame::GoAway { .. } => emit(Event::GoAway).await,
            Frame::Settings { .. } | Frame::WindowUpdate { .. } | Frame::Unknown { .. } => {}
        }
    }
}

async fn write_loop<W: AsyncWrite + Unpin>(
    mut wr: W,
    mut rx: mpsc::Receiver<Out>,
    table: Arc<Mutex<Table>>,
) {
    let mut z = Deflater::new();
    let mut buf: Vec<u8> = Vec::with_capacity(64 * 1024);
    while let Some(first) = rx.recv().await {
        let mut batch = vec![first];
        while batch.len() < WRITE_BATCH {
            match rx.try_recv() {
                Ok(o) => batch.push(o),
                Err(_) => break,
            }
        }
        let mut closing = false;
        for o in batch {
            match o {
                Out::Frame(f) => frame::encode(&f, &mut z, &mut buf),
                Out::Close(status) => {
                    let last_good = match table.lock() {
                        Ok(t) => t.last_id,
                        Err(p) => p.into_inner().last_id,
                    };
                    frame::encode(&Frame::GoAway { last_good, status }, &mut z, &mut buf);
                    closing = true;
                    break;
                }
            }
        }
        if wr.write_all(&buf).await.is_err() || wr.flush().await.is_err() {
            return;
        }
        buf.clear();
        if closing {
            let _ = wr.shutdown().await;
            return;
        }
    }
}
