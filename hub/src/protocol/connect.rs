//! Connect: unary over POST (and GET for side-effect-free methods) with the
//! bare message as the body, and streaming with enveloped messages and an
//! end-of-stream message carrying the error and trailers.

use std::time::Duration;

use base64::Engine;
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode, header};
use http_body_util::{BodyExt, Full, StreamBody};
use tonic::{Code, Status};

use super::{
    BoxError, accepts_gzip, data_frame, error_json,
    frames::{self, FLAG_COMPRESSED, FLAG_END_STREAM, Parser},
    grpc_timeout_from_connect, gunzip, gzip, json_to_proto, pass_headers, proto_to_json, rewrite,
    status_of,
    transcode::{self, RequestCodec},
};
use crate::{forward::HttpBody, methods::MethodInfo, server::GrpcHandler};

/// Responses smaller than this are not worth compressing.
const COMPRESS_MIN: usize = 1024;

/// Largest unary response the hub buffers to re-encode it.
pub const MAX_UNARY_RESPONSE: usize = 64 * 1024 * 1024;

fn content_type(json: bool, streaming: bool) -> HeaderValue {
    HeaderValue::from_static(match (json, streaming) {
        (true, false) => "application/json",
        (false, false) => "application/proto",
        (true, true) => "application/connect+json",
        (false, true) => "application/connect+proto",
    })
}

/// A Connect unary error response.
pub fn unary_error(status: &Status, extra: Option<&HeaderMap>) -> http::Response<HttpBody> {
    let body = serde_json::to_vec(&error_json(status)).unwrap_or_default();
    let mut resp = http::Response::new(
        Full::new(Bytes::from(body))
            .map_err(|e| match e {})
            .boxed_unsync(),
    );
    *resp.status_mut() = super::http_status(status.code());
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    if let Some(extra) = extra {
        copy_metadata(extra, resp.headers_mut(), "");
    }
    resp
}

/// Copies custom metadata (not gRPC's own headers) with a name prefix.
fn copy_metadata(from: &HeaderMap, to: &mut HeaderMap, prefix: &str) {
    for (name, value) in from {
        let n = name.as_str();
        if n.starts_with("grpc-")
            || n == "content-type"
            || n == "content-length"
            || n == "date"
            || n == "te"
        {
            continue;
        }
        if let Ok(name) = http::HeaderName::from_bytes(format!("{prefix}{n}").as_bytes()) {
            to.append(name, value.clone());
        }
    }
}

/// The request message of a Connect GET (`?message=…&encoding=…&base64=1&compression=gzip`):
/// the message bytes, whether they are JSON, whether they are gzipped.
/// Public so the fuzz targets feed it the same queries the hub parses.
pub fn get_message(uri: &http::Uri) -> Result<(Vec<u8>, bool, bool), Status> {
    let query = uri.query().unwrap_or("");
    let mut message = None;
    let (mut json, mut b64, mut gz) = (true, false, false);
    for (k, v) in url::form_urlencoded::parse(query.as_bytes()) {
        match k.as_ref() {
            "message" => message = Some(v.into_owned()),
            "encoding" => match v.as_ref() {
                "json" => json = true,
                "proto" => json = false,
                other => {
                    return Err(Status::invalid_argument(format!(
                        "encoding {other:?} is not supported (json or proto)"
                    )));
                }
            },
            "base64" => b64 = v == "1",
            "compression" => match v.as_ref() {
                "gzip" => gz = true,
                "identity" | "" => {}
                other => {
                    return Err(Status::unimplemented(format!(
                        "compression {other:?} is not supported (gzip)"
                    )));
                }
            },
            _ => {}
        }
    }
    let message =
        message.ok_or_else(|| Status::invalid_argument("GET needs a message query parameter"))?;
    let bytes = if b64 {
        let trimmed = message.trim_end_matches('=');
        base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(trimmed)
            .map_err(|e| Status::invalid_argument(format!("message is not base64url: {e}")))?
    } else {
        message.into_bytes()
    };
    Ok((bytes, json, gz))
}

/// Connect unary (POST or GET).
pub async fn unary(
    inner: GrpcHandler,
    method: MethodInfo,
    json: bool,
    req: http::Request<crate::limits::RequestBody>,
    max_request: usize,
) -> http::Response<HttpBody> {
    match unary_inner(inner, method, json, req, max_request).await {
        Ok(resp) | Err(resp) => resp,
    }
}

async fn unary_inner(
    inner: GrpcHandler,
    method: MethodInfo,
    json_post: bool,
    req: http::Request<crate::limits::RequestBody>,
    max_request: usize,
) -> Result<http::Response<HttpBody>, http::Response<HttpBody>> {
    let err = |s: Status| unary_error(&s, None);
    let (parts, body) = req.into_parts();
    let owner = super::owner_of(&parts.extensions);
    if method.server_streaming || method.client_streaming {
        return Err(err(Status::unimplemented(format!(
            "{} is a streaming method: use the application/connect+json or +proto content type",
            method.path
        ))));
    }
    let (raw, json, gzipped) = if parts.method == http::Method::GET {
        if !method.no_side_effects {
            let mut resp = err(Status::unimplemented(format!(
                "{} has side effects: call it with POST",
                method.path
            )));
            *resp.status_mut() = StatusCode::METHOD_NOT_ALLOWED;
            resp.headers_mut()
                .insert(header::ALLOW, HeaderValue::from_static("POST"));
            return Err(resp);
        }
        let (bytes, json, gz) = get_message(&parts.uri).map_err(err)?;
        (Bytes::from(bytes), json, gz)
    } else {
        let (bytes, _) = collect(body, max_request).await.map_err(|e| match e {
            CollectError::TooLarge => {
                let mut r = err(Status::resource_exhausted(format!(
                    "request body is over the limit of {max_request} bytes"
                )));
                *r.status_mut() = StatusCode::PAYLOAD_TOO_LARGE;
                r
            }
            CollectError::Body(e) => err(Status::cancelled(format!("reading request: {e}"))),
        })?;
        let gz = match parts
            .headers
            .get(header::CONTENT_ENCODING)
            .and_then(|v| v.to_str().ok())
        {
            None | Some("identity") => false,
            Some("gzip") => true,
            Some(other) => {
                return Err(err(Status::unimplemented(format!(
                    "content-encoding {other} is not supported (gzip)"
                ))));
            }
        };
        (bytes, json_post, gz)
    };
    let raw = if gzipped {
        gunzip(&raw, max_request).map_err(err)?
    } else {
        raw
    };
    let message = if json {
        let input = method.input.clone();
        rewrite(&owner, raw.len(), move || json_to_proto(&input, &raw))
            .await
            .map_err(err)?
    } else {
        raw.to_vec()
    };

    let mut grpc = http::Request::new(
        Full::new(frames::encode(0, &message))
            .map_err(|e| match e {})
            .boxed_unsync(),
    );
    *grpc.method_mut() = http::Method::POST;
    *grpc.uri_mut() = http::Uri::try_from(method.path.as_str())
        .map_err(|e| err(Status::internal(e.to_string())))?;
    *grpc.headers_mut() = pass_headers(&parts.headers);
    let deadline = grpc_timeout_from_connect(&parts.headers);
    if let Some(t) = &deadline {
        grpc.headers_mut().insert("grpc-timeout", t.clone());
    }
    *grpc.extensions_mut() = parts.extensions;

    let call = inner.call(grpc);
    let resp = match deadline_of(&parts.headers) {
        Some(d) => tokio::time::timeout(d, call)
            .await
            .map_err(|_| err(Status::deadline_exceeded("the call's deadline passed")))?,
        None => call.await,
    };
    let (rparts, rbody) = resp.into_parts();
    if let Some(status) = status_of(&rparts.headers).filter(|s| s.code() != Code::Ok) {
        return Err(unary_error(&status, Some(&rparts.headers)));
    }
    let (collected, trailers) = collect(rbody, MAX_UNARY_RESPONSE)
        .await
        .map_err(|e| match e {
            CollectError::TooLarge => err(Status::resource_exhausted(
                "response is over the hub's limit for unary calls",
            )),
            CollectError::Body(e) => err(Status::unavailable(format!("reading response: {e}"))),
        })?;
    let trailers = trailers.unwrap_or_default();
    let status = status_of(&trailers)
        .or_else(|| status_of(&rparts.headers))
        .unwrap_or_else(|| Status::internal("the handler sent no gRPC status"));
    if status.code() != Code::Ok {
        let mut meta = rparts.headers.clone();
        meta.extend(trailers);
        return Err(unary_error(&status, Some(&meta)));
    }
    let mut parser = Parser::new(MAX_UNARY_RESPONSE);
    parser.push(&collected);
    let envelope = parser
        .next_envelope()
        .map_err(|_| err(Status::resource_exhausted("response is too large")))?
        .ok_or_else(|| err(Status::internal("the handler sent no response message")))?;
    if envelope.flags & FLAG_COMPRESSED != 0 {
        return Err(err(Status::internal(
            "the handler sent a compressed message",
        )));
    }
    let gz = accepts_gzip(parts.headers.get(header::ACCEPT_ENCODING));
    let compress = move |body: Bytes| {
        if gz && body.len() >= COMPRESS_MIN {
            (gzip(&body), true)
        } else {
            (body, false)
        }
    };
    let (output, payload) = (method.output.clone(), envelope.payload);
    let (body, compressed) = rewrite(&owner, work_size(json, gz, &payload), move || {
        let body = if json {
            Bytes::from(proto_to_json(&output, &payload)?)
        } else {
            payload
        };
        Ok(compress(body))
    })
    .await
    .map_err(err)?;

    let mut out = http::Response::builder().status(StatusCode::OK);
    let headers = out.headers_mut().expect("fresh builder");
    headers.insert(header::CONTENT_TYPE, content_type(json, false));
    copy_metadata(&rparts.headers, headers, "");
    copy_metadata(&trailers, headers, "trailer-");
    if compressed {
        headers.insert(header::CONTENT_ENCODING, HeaderValue::from_static("gzip"));
    }
    Ok(out
        .body(Full::new(body).map_err(|e| match e {}).boxed_unsync())
        .expect("valid response"))
}

fn deadline_of(headers: &HeaderMap) -> Option<Duration> {
    let ms: u64 = headers
        .get("connect-timeout-ms")?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()?;
    Some(Duration::from_millis(ms))
}

/// Connect streaming: envelopes in, envelopes out, errors in the
/// end-of-stream message (the HTTP status is 200 once the stream starts).
pub async fn streaming(
    inner: GrpcHandler,
    method: MethodInfo,
    json: bool,
    req: http::Request<crate::limits::RequestBody>,
    max_message: usize,
) -> http::Response<HttpBody> {
    let (parts, body) = req.into_parts();
    let request_gzip = match parts
        .headers
        .get("connect-content-encoding")
        .and_then(|v| v.to_str().ok())
    {
        None | Some("identity") => false,
        Some("gzip") => true,
        Some(other) => {
            return end_stream_only(
                json,
                &Status::unimplemented(format!(
                    "connect-content-encoding {other} is not supported (gzip)"
                )),
                &HeaderMap::new(),
            );
        }
    };
    let response_gzip = accepts_gzip(parts.headers.get("connect-accept-encoding"));

    // Request: Connect envelopes → gRPC frames, one message at a time.
    let codec = RequestCodec {
        json,
        gzip: request_gzip,
        encoding_header: "connect-content-encoding",
        end_stream_envelope: true,
        max: max_message,
    };
    let body = body.map_err(|e| -> BoxError { Box::new(e) }).boxed_unsync();
    let owner = super::owner_of(&parts.extensions);
    let requests = transcode::requests(body, method.input.clone(), codec, owner.clone());
    let mut grpc = http::Request::new(requests);
    *grpc.method_mut() = http::Method::POST;
    *grpc.uri_mut() = match http::Uri::try_from(method.path.as_str()) {
        Ok(u) => u,
        Err(e) => {
            return end_stream_only(json, &Status::internal(e.to_string()), &HeaderMap::new());
        }
    };
    *grpc.headers_mut() = pass_headers(&parts.headers);
    if let Some(t) = grpc_timeout_from_connect(&parts.headers) {
        grpc.headers_mut().insert("grpc-timeout", t);
    }
    *grpc.extensions_mut() = parts.extensions;

    let resp = inner.call(grpc).await;
    let (rparts, rbody) = resp.into_parts();
    if let Some(status) = status_of(&rparts.headers) {
        // Trailers-only: the call ended before any message.
        return end_stream_only(json, &status, &rparts.headers);
    }

    // Response: gRPC frames → Connect envelopes, trailers → end-of-stream.
    let output = method.output.clone();
    let responses = futures::stream::unfold(
        (rbody, Parser::new(MAX_UNARY_RESPONSE), false),
        move |(mut body, mut parser, done)| {
            let (output, owner) = (output.clone(), owner.clone());
            async move {
                if done {
                    return None;
                }
                loop {
                    match parser.next_envelope() {
                        Err(e) => {
                            let end = end_message(
                                &Status::resource_exhausted(format!(
                                    "response message of {} bytes is over the limit",
                                    e.len
                                )),
                                &HeaderMap::new(),
                            );
                            return Some((data_frame(end), (body, parser, true)));
                        }
                        Ok(Some(env)) => {
                            let (output, payload) = (output.clone(), env.payload);
                            let frame = rewrite(
                                &owner,
                                work_size(json, response_gzip, &payload),
                                move || {
                                    let payload = if json {
                                        Bytes::from(proto_to_json(&output, &payload)?)
                                    } else {
                                        payload
                                    };
                                    Ok(if response_gzip && payload.len() >= COMPRESS_MIN {
                                        frames::encode(FLAG_COMPRESSED, &gzip(&payload))
                                    } else {
                                        frames::encode(0, &payload)
                                    })
                                },
                            );
                            return Some(match frame.await {
                                Ok(frame) => (data_frame(frame), (body, parser, false)),
                                Err(s) => (
                                    data_frame(end_message(&s, &HeaderMap::new())),
                                    (body, parser, true),
                                ),
                            });
                        }
                        Ok(None) => {}
                    }
                    match body.frame().await {
                        Some(Ok(frame)) => match frame.into_data() {
                            Ok(data) => parser.push(&data),
                            Err(frame) => {
                                let trailers = frame.into_trailers().unwrap_or_default();
                                let status = status_of(&trailers)
                                    .unwrap_or_else(|| Status::new(Code::Ok, ""));
                                return Some((
                                    data_frame(end_message(&status, &trailers)),
                                    (body, parser, true),
                                ));
                            }
                        },
                        Some(Err(e)) => {
                            let status = Status::unavailable(format!("response stream broke: {e}"));
                            return Some((
                                data_frame(end_message(&status, &HeaderMap::new())),
                                (body, parser, true),
                            ));
                        }
                        None => {
                            let status =
                                Status::internal("the handler ended the stream without a status");
                            return Some((
                                data_frame(end_message(&status, &HeaderMap::new())),
                                (body, parser, true),
                            ));
                        }
                    }
                }
            }
        },
    );
    let mut out = http::Response::new(StreamBody::new(responses).boxed_unsync());
    out.headers_mut()
        .insert(header::CONTENT_TYPE, content_type(json, true));
    if response_gzip {
        out.headers_mut()
            .insert("connect-content-encoding", HeaderValue::from_static("gzip"));
    }
    copy_metadata(&rparts.headers, out.headers_mut(), "");
    out
}

/// The size of the work an answer's message needs, for [`rewrite`]: its
/// length when it is turned into JSON or may be gzipped, none when it is
/// only framed (a copy, never worth a thread's hand-off).
fn work_size(json: bool, gzip: bool, payload: &[u8]) -> usize {
    if json || gzip { payload.len() } else { 0 }
}

/// The end-of-stream envelope: `{"error": …, "metadata": …}`.
fn end_message(status: &Status, trailers: &HeaderMap) -> Bytes {
    let mut end = serde_json::Map::new();
    if status.code() != Code::Ok {
        end.insert("error".into(), error_json(status));
    }
    let mut meta = serde_json::Map::new();
    for (name, value) in trailers {
        let n = name.as_str();
        if n.starts_with("grpc-") || n == "content-type" {
            continue;
        }
        let entry = meta
            .entry(n.to_owned())
            .or_insert_with(|| serde_json::Value::Array(Vec::new()));
        if let (serde_json::Value::Array(list), Ok(v)) = (entry, value.to_str()) {
            list.push(v.into());
        }
    }
    if !meta.is_empty() {
        end.insert("metadata".into(), meta.into());
    }
    frames::encode(
        FLAG_END_STREAM,
        &serde_json::to_vec(&end).unwrap_or_default(),
    )
}

/// A streaming response that is only the end-of-stream message.
pub fn end_stream_only(
    json: bool,
    status: &Status,
    headers: &HeaderMap,
) -> http::Response<HttpBody> {
    let mut resp = http::Response::new(
        Full::new(end_message(status, headers))
            .map_err(|e| match e {})
            .boxed_unsync(),
    );
    resp.headers_mut()
        .insert(header::CONTENT_TYPE, content_type(json, true));
    resp
}

/// Why a body could not be collected.
enum CollectError {
    TooLarge,
    Body(String),
}

/// Reads a whole body (at most `max` bytes) and its trailers.
async fn collect<B>(mut body: B, max: usize) -> Result<(Bytes, Option<HeaderMap>), CollectError>
where
    B: http_body::Body<Data = Bytes> + Unpin,
    B::Error: std::fmt::Display,
{
    let mut data = bytes::BytesMut::new();
    let mut trailers = None;
    while let Some(frame) = crate::limits::next_frame(&mut body)
        .await
        .map_err(|s| CollectError::Body(s.message().to_owned()))?
    {
        match frame
            .map_err(|e| CollectError::Body(e.to_string()))?
            .into_data()
        {
            Ok(chunk) => {
                if data.len() + chunk.len() > max {
                    return Err(CollectError::TooLarge);
                }
                data.extend_from_slice(&chunk);
            }
            Err(frame) => {
                if let Ok(t) = frame.into_trailers() {
                    trailers.get_or_insert_with(HeaderMap::new).extend(t);
                }
            }
        }
    }
    Ok((data.freeze(), trailers))
}
