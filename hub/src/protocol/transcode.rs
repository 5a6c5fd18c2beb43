//! Message by message rewriting of enveloped bodies.
//!
//! The request side serves Connect streaming and the JSON codec of gRPC and
//! gRPC-Web alike: envelopes in (maybe gzipped, maybe JSON), gRPC frames of
//! protobuf out, one message at a time, so a stream is never buffered whole.
//! The response side is the JSON codec's: gRPC frames of protobuf in, the
//! same frames with JSON payloads out, trailers passed as they are (gRPC
//! sends them as HTTP trailers, the gRPC-Web layer turns them into its last
//! frame).
//!
//! The handlers and the agents only speak protobuf, so `application/grpc+json`
//! and `application/grpc-web+json` are served by transcoding on the hub with
//! the descriptors every Connect JSON call already uses.

use std::sync::Arc;

use bytes::Bytes;
use http::header;
use http_body_util::{BodyExt, StreamBody};
use prost_reflect::MessageDescriptor;
use tonic::Status;

use super::{
    data_frame, err_frame,
    frames::{self, FLAG_COMPRESSED, FLAG_END_STREAM, Parser},
    gunzip, json_to_proto, proto_to_json, rewrite, status_frame,
};
use crate::forward::HttpBody;

/// How a request's messages are written.
#[derive(Debug, Clone, Copy)]
pub struct RequestCodec {
    /// Payloads are JSON (else protobuf).
    pub json: bool,
    /// The request named gzip as its message encoding, so compressed
    /// envelopes are gzip; without it a compressed envelope is refused.
    pub gzip: bool,
    /// The header that names the encoding, for the refusal's text.
    pub encoding_header: &'static str,
    /// Connect's end-of-stream envelope ends the request (it carries no
    /// message).
    pub end_stream_envelope: bool,
    /// Largest message, compressed or not.
    pub max: usize,
}

/// Rewrites a body of enveloped request messages into gRPC frames of
/// uncompressed protobuf. A message that cannot be read ends the body with
/// the [`Status`] the caller gets.
pub fn requests(
    body: HttpBody,
    input: MessageDescriptor,
    codec: RequestCodec,
    owner: Arc<str>,
) -> HttpBody {
    let s = futures::stream::unfold(
        (body, Parser::new(codec.max), false),
        move |(mut body, mut parser, done)| {
            let (input, owner) = (input.clone(), owner.clone());
            async move {
                if done {
                    return None;
                }
                loop {
                    match parser.next_envelope() {
                        Err(e) => {
                            let status = Status::resource_exhausted(format!(
                                "request message of {} bytes is over the limit of {}",
                                e.len, e.max
                            ));
                            return Some((status_frame(status), (body, parser, true)));
                        }
                        Ok(Some(env))
                            if codec.end_stream_envelope && env.flags & FLAG_END_STREAM != 0 =>
                        {
                            continue;
                        }
                        Ok(Some(env)) => {
                            let input = input.clone();
                            let message = rewrite(&owner, env.payload.len(), move || {
                                request_message(&input, codec, env)
                            });
                            return Some(match message.await {
                                Ok(frame) => (data_frame(frame), (body, parser, false)),
                                Err(s) => (status_frame(s), (body, parser, true)),
                            });
                        }
                        Ok(None) => {}
                    }
                    match body.frame().await {
                        Some(Ok(frame)) => {
                            if let Ok(data) = frame.into_data() {
                                parser.push(&data);
                            }
                        }
                        Some(Err(e)) => return Some((err_frame(e), (body, parser, true))),
                        None if parser.remaining() > 0 => {
                            return Some((
                                status_frame(Status::invalid_argument(
                                    "request ended inside a message",
                                )),
                                (body, parser, true),
                            ));
                        }
                        None => return None,
                    }
                }
            }
        },
    );
    StreamBody::new(s).boxed_unsync()
}

/// One request envelope as a gRPC frame of protobuf.
fn request_message(
    input: &MessageDescriptor,
    codec: RequestCodec,
    env: frames::Envelope,
) -> Result<Bytes, Status> {
    let payload = if env.flags & FLAG_COMPRESSED != 0 {
        if !codec.gzip {
            return Err(Status::unimplemented(format!(
                "a compressed message needs {}: gzip (the only encoding accepted)",
                codec.encoding_header
            )));
        }
        gunzip(&env.payload, codec.max)?
    } else {
        env.payload
    };
    if !codec.json {
        return Ok(frames::encode(0, &payload));
    }
    // JSON can be smaller than its protobuf (a list of zeros as packed
    // doubles): the limit holds for what goes on, too.
    let proto = json_to_proto(input, &payload)?;
    if proto.len() > codec.max {
        return Err(Status::resource_exhausted(format!(
            "request message of {} bytes is over the limit of {}",
            proto.len(),
            codec.max
        )));
    }
    Ok(frames::encode(0, &proto))
}

/// Rewrites a gRPC response body's protobuf messages into JSON, leaving
/// trailers as they are. A message that cannot be rewritten ends the body
/// with trailers carrying the status, as a handler's error would.
pub fn json_responses(
    body: HttpBody,
    output: MessageDescriptor,
    gzip: bool,
    owner: Arc<str>,
) -> HttpBody {
    let s = futures::stream::unfold(
        (body, Parser::new(super::connect::MAX_UNARY_RESPONSE), false),
        move |(mut body, mut parser, done)| {
            let (output, owner) = (output.clone(), owner.clone());
            async move {
                if done {
                    return None;
                }
                let ended = |status: Status| Ok(crate::forward::status_trailers(&status));
                loop {
                    match parser.next_envelope() {
                        Err(e) => {
                            let status = Status::resource_exhausted(format!(
                                "response message of {} bytes is over the limit",
                                e.len
                            ));
                            return Some((ended(status), (body, parser, true)));
                        }
                        Ok(Some(env)) => {
                            if env.flags & FLAG_COMPRESSED != 0 && !gzip {
                                let status = Status::internal(
                                    "the handler compressed a message with an encoding other than gzip",
                                );
                                return Some((ended(status), (body, parser, true)));
                            }
                            let output = output.clone();
                            let json = rewrite(&owner, env.payload.len(), move || {
                                if env.flags & FLAG_COMPRESSED != 0 {
                                    gunzip(&env.payload, super::connect::MAX_UNARY_RESPONSE)
                                        .and_then(|p| proto_to_json(&output, &p))
                                } else {
                                    proto_to_json(&output, &env.payload)
                                }
                            });
                            return Some(match json.await {
                                Ok(json) => {
                                    (data_frame(frames::encode(0, &json)), (body, parser, false))
                                }
                                Err(status) => (ended(status), (body, parser, true)),
                            });
                        }
                        Ok(None) => {}
                    }
                    match body.frame().await {
                        Some(Ok(frame)) => match frame.into_data() {
                            Ok(data) => parser.push(&data),
                            Err(_) if parser.remaining() > 0 => {
                                let status = Status::internal("response ended inside a message");
                                return Some((ended(status), (body, parser, true)));
                            }
                            Err(frame) => return Some((Ok(frame), (body, parser, true))),
                        },
                        Some(Err(e)) => return Some((err_frame(e), (body, parser, true))),
                        None if parser.remaining() > 0 => {
                            let status = Status::internal("response ended inside a message");
                            return Some((ended(status), (body, parser, true)));
                        }
                        None => return None,
                    }
                }
            }
        },
    );
    StreamBody::new(s).boxed_unsync()
}

/// The gRPC request a JSON-codec call becomes: the same headers as a
/// binary call (gRPC's own, gRPC-Web's already rewritten), its messages in
/// protobuf.
pub fn json_request(
    req: http::Request<HttpBody>,
    input: MessageDescriptor,
    max: usize,
) -> http::Request<HttpBody> {
    let (mut parts, body) = req.into_parts();
    let codec = RequestCodec {
        json: true,
        gzip: super::accepts_gzip(parts.headers.get("grpc-encoding")),
        encoding_header: "grpc-encoding",
        end_stream_envelope: false,
        max,
    };
    parts.headers = super::pass_headers(&parts.headers);
    let owner = super::owner_of(&parts.extensions);
    http::Request::from_parts(parts, requests(body, input, codec, owner))
}

/// The response of a JSON-codec call: the handler's answer with its
/// messages in JSON (the caller sets the content type its protocol says),
/// rewritten in `owner`'s turn.
pub fn json_response(
    resp: http::Response<HttpBody>,
    output: MessageDescriptor,
    owner: Arc<str>,
) -> http::Response<HttpBody> {
    let (mut parts, body) = resp.into_parts();
    parts.headers.remove(header::CONTENT_LENGTH);
    // The messages leave uncompressed whatever the handler did.
    let gzip = super::accepts_gzip(parts.headers.get("grpc-encoding"));
    parts.headers.remove("grpc-encoding");
    http::Response::from_parts(parts, json_responses(body, output, gzip, owner))
}
