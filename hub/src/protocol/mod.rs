//! The protocols of the API port, turned into gRPC for one set of handlers.
//!
//! Browsers speak Connect (JSON or binary, unary and server-streaming) and
//! gRPC-Web; scripts speak gRPC. Every request is rewritten into a gRPC
//! request for the same handlers (the tonic services and the forwarder), and
//! the gRPC response is rewritten back. JSON uses the canonical proto3 JSON
//! mapping through `prost-reflect` and the descriptor set.
//!
//! # Layout
//! - [`frames`] — length-prefixed envelopes, sans IO.
//! - [`connect`] — Connect unary (POST and GET) and streaming.
//! - [`grpc_web`] — gRPC-Web, binary and text.
//! - [`transcode`] — message by message rewriting: JSON ↔ protobuf, gzip.
//! - `json` — protobuf to JSON straight from the wire, for the usual shapes.
//! - this file — detection, status mapping, JSON and gzip helpers.

pub mod connect;
pub mod frames;
pub mod grpc_web;
mod json;
pub mod transcode;

use std::{io::Read, sync::Arc};

use base64::Engine;
use bytes::Bytes;
use http::HeaderMap;
use prost::Message;
use prost_reflect::{DynamicMessage, MessageDescriptor, SerializeOptions};
use tonic::{Code, Status};

/// Boxed error of bodies (the tunnel crate's, so bodies pass between the
/// layers without conversion).
pub use otter_tunnel::BoxError;

/// A data frame of a rewritten body. Streams of the protocol layer build
/// their items only through this and [`err_frame`], which pins the error to
/// the `'static` boxed error (left to inference inside closures, the
/// compiler picks a shorter object lifetime and the futures stop being Send).
pub fn data_frame(data: Bytes) -> Result<http_body::Frame<Bytes>, BoxError> {
    Ok(http_body::Frame::data(data))
}

/// An error of a rewritten body; see [`data_frame`].
pub fn err_frame(e: impl std::fmt::Display) -> Result<http_body::Frame<Bytes>, BoxError> {
    Err(e.to_string().into())
}

/// An error of a rewritten request body that says which gRPC status the
/// caller gets: the forwarder and tonic both look for a [`Status`] in a
/// body error, where a bare message would end the call as cancelled.
pub fn status_frame(status: Status) -> Result<http_body::Frame<Bytes>, BoxError> {
    Err(Box::new(status))
}

/// How a request is framed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// gRPC; `json` for the JSON codec (`application/grpc+json`).
    Grpc {
        json: bool,
    },
    GrpcWeb {
        text: bool,
        json: bool,
    },
    ConnectUnary {
        json: bool,
    },
    ConnectStream {
        json: bool,
    },
    ConnectGet,
}

/// Why a request's content type is refused (answered HTTP 415).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unsupported {
    /// gRPC or gRPC-Web with a codec other than protobuf and JSON: the
    /// answer carries a gRPC status too, so gRPC clients can show why.
    GrpcCodec { web: bool, subtype: String },
    /// None of our protocols (or no content type at all).
    ContentType,
}

impl Unsupported {
    /// Text of the refusal.
    pub fn message(&self) -> String {
        match self {
            Unsupported::GrpcCodec { web, subtype } => {
                let base = if *web { "application/grpc-web" } else { "application/grpc" };
                format!("the {subtype:?} codec is not supported: use {base}+proto or {base}+json")
            }
            Unsupported::ContentType => "use gRPC (application/grpc[+json]), gRPC-Web (application/grpc-web[-text]) or Connect (application/json, application/proto, application/connect+json, application/connect+proto)".into(),
        }
    }
}

/// The protocol of a request, from its method and content type; an error
/// when it is none of ours (answered 415, as the gRPC and Connect
/// specifications ask for unsupported content types).
pub fn detect(method: &http::Method, headers: &HeaderMap) -> Result<Protocol, Unsupported> {
    if method == http::Method::GET {
        return Ok(Protocol::ConnectGet);
    }
    let ct = headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .ok_or(Unsupported::ContentType)?;
    let ct = ct
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    Ok(match ct.as_str() {
        "application/grpc" | "application/grpc+proto" => Protocol::Grpc { json: false },
        "application/grpc+json" => Protocol::Grpc { json: true },
        "application/grpc-web" | "application/grpc-web+proto" => Protocol::GrpcWeb {
            text: false,
            json: false,
        },
        "application/grpc-web+json" => Protocol::GrpcWeb {
            text: false,
            json: true,
        },
        "application/grpc-web-text" | "application/grpc-web-text+proto" => Protocol::GrpcWeb {
            text: true,
            json: false,
        },
        "application/grpc-web-text+json" => Protocol::GrpcWeb {
            text: true,
            json: true,
        },
        "application/json" => Protocol::ConnectUnary { json: true },
        "application/proto" => Protocol::ConnectUnary { json: false },
        "application/connect+json" => Protocol::ConnectStream { json: true },
        "application/connect+proto" => Protocol::ConnectStream { json: false },
        other => {
            // `application/grpc+<codec>` and the gRPC-Web forms of it.
            for (prefix, web) in [
                ("application/grpc-web-text+", true),
                ("application/grpc-web+", true),
                ("application/grpc+", false),
            ] {
                if let Some(subtype) = other.strip_prefix(prefix) {
                    return Err(Unsupported::GrpcCodec {
                        web,
                        subtype: subtype.to_owned(),
                    });
                }
            }
            return Err(Unsupported::ContentType);
        }
    })
}

/// The content types a POST may have (`Accept-Post` of a 415 answer).
pub const ACCEPT_POST: &str = "application/grpc, application/grpc+proto, application/grpc+json, application/grpc-web, application/grpc-web+proto, application/grpc-web+json, application/grpc-web-text, application/grpc-web-text+proto, application/grpc-web-text+json, application/json, application/proto, application/connect+json, application/connect+proto";

/// The 415 answer to a refused content type. gRPC clients get the reason
/// as a gRPC status (Unimplemented) in the headers, other clients a Connect
/// error (unimplemented) and the accepted types in `Accept-Post`.
pub fn unsupported_response(why: &Unsupported) -> http::Response<crate::forward::HttpBody> {
    let message = why.message();
    let mut resp = match why {
        Unsupported::GrpcCodec { web, .. } => {
            let mut resp: http::Response<crate::forward::HttpBody> =
                Status::unimplemented(message).into_http();
            if *web {
                resp.headers_mut().insert(
                    http::header::CONTENT_TYPE,
                    http::HeaderValue::from_static("application/grpc-web+proto"),
                );
            }
            resp
        }
        // A Connect error, as the API description promises for every
        // answer other than 200 on these paths.
        Unsupported::ContentType => {
            let mut resp = connect::unary_error(&Status::unimplemented(message), None);
            resp.headers_mut()
                .insert("accept-post", http::HeaderValue::from_static(ACCEPT_POST));
            resp
        }
    };
    *resp.status_mut() = http::StatusCode::UNSUPPORTED_MEDIA_TYPE;
    resp
}

/// Connect's name for a gRPC code.
pub fn code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "ok",
        Code::Cancelled => "canceled",
        Code::Unknown => "unknown",
        Code::InvalidArgument => "invalid_argument",
        Code::DeadlineExceeded => "deadline_exceeded",
        Code::NotFound => "not_found",
        Code::AlreadyExists => "already_exists",
        Code::PermissionDenied => "permission_denied",
        Code::ResourceExhausted => "resource_exhausted",
        Code::FailedPrecondition => "failed_precondition",
        Code::Aborted => "aborted",
        Code::OutOfRange => "out_of_range",
        Code::Unimplemented => "unimplemented",
        Code::Internal => "internal",
        Code::Unavailable => "unavailable",
        Code::DataLoss => "data_loss",
        Code::Unauthenticated => "unauthenticated",
    }
}

/// The HTTP status Connect gives a gRPC code.
pub fn http_status(code: Code) -> http::StatusCode {
    use http::StatusCode as S;
    match code {
        Code::Ok => S::OK,
        Code::Cancelled => S::from_u16(499).unwrap_or(S::BAD_REQUEST),
        Code::InvalidArgument | Code::FailedPrecondition | Code::OutOfRange => S::BAD_REQUEST,
        Code::DeadlineExceeded => S::GATEWAY_TIMEOUT,
        Code::NotFound => S::NOT_FOUND,
        Code::AlreadyExists | Code::Aborted => S::CONFLICT,
        Code::PermissionDenied => S::FORBIDDEN,
        Code::ResourceExhausted => S::TOO_MANY_REQUESTS,
        Code::Unimplemented => S::NOT_IMPLEMENTED,
        Code::Unavailable => S::SERVICE_UNAVAILABLE,
        Code::Unauthenticated => S::UNAUTHORIZED,
        Code::Unknown | Code::Internal | Code::DataLoss => S::INTERNAL_SERVER_ERROR,
    }
}

/// `google.rpc.Status`, to read the details of an error.
#[derive(Clone, PartialEq, prost::Message)]
struct RpcStatus {
    #[prost(int32, tag = "1")]
    code: i32,
    #[prost(string, tag = "2")]
    message: String,
    #[prost(message, repeated, tag = "3")]
    details: Vec<prost_types::Any>,
}

/// The Connect error JSON of a status.
pub fn error_json(status: &Status) -> serde_json::Value {
    let mut err =
        serde_json::json!({ "code": code_name(status.code()), "message": status.message() });
    if !status.details().is_empty()
        && let Ok(rpc) = RpcStatus::decode(status.details())
        && !rpc.details.is_empty()
    {
        let b64 = base64::engine::general_purpose::STANDARD_NO_PAD;
        err["details"] = rpc
            .details
            .iter()
            .map(|a| {
                serde_json::json!({
                    "type": a.type_url.rsplit('/').next().unwrap_or(&a.type_url),
                    "value": b64.encode(&a.value),
                })
            })
            .collect();
    }
    err
}

/// The most JSON values (objects, lists, scalars) a request may hold. It
/// is decoded into a `DynamicMessage`, a hundred bytes and more per value
/// against five of JSON (`null,`), so a 16 MiB request of empty values
/// would take several hundred MiB of the hub. Kubernetes stores objects of
/// at most 1.5 MiB, about 300,000 values at the densest.
pub const MAX_JSON_VALUES: usize = 512 * 1024;

/// An upper bound of the values in `json`: the separators and openings
/// outside strings, plus one.
fn json_values(json: &[u8]) -> usize {
    let (mut n, mut in_string, mut escaped) = (1, false, false);
    for &b in json {
        if in_string {
            match b {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
        } else {
            match b {
                b'"' => in_string = true,
                b',' | b'[' | b'{' | b':' => n += 1,
                _ => {}
            }
        }
    }
    n
}

/// Decodes JSON (canonical proto3 mapping) into the binary message.
pub fn json_to_proto(desc: &MessageDescriptor, json: &[u8]) -> Result<Vec<u8>, Status> {
    let json = if json.iter().all(u8::is_ascii_whitespace) {
        b"{}".as_slice()
    } else {
        json
    };
    let values = json_values(json);
    if values > MAX_JSON_VALUES {
        return Err(Status::resource_exhausted(format!(
            "request of about {values} JSON values; at most {MAX_JSON_VALUES} are taken (send it in protobuf)"
        )));
    }
    let mut de = serde_json::Deserializer::from_slice(json);
    let msg = DynamicMessage::deserialize(desc.clone(), &mut de)
        .and_then(|m| de.end().map(|()| m))
        .map_err(|e| {
            Status::invalid_argument(format!(
                "request is not a valid {} in JSON: {e}",
                desc.full_name()
            ))
        })?;
    Ok(msg.encode_to_vec())
}

/// The longest JSON the hub writes for one message: twice the largest
/// answer it forwards in protobuf, room for a listing's usual growth
/// (quoted keys and numbers, escaped quotes in annotations). A peer's
/// bytes can make six times their length in JSON (control characters in
/// a string); past this the caller is told to ask in protobuf.
pub const MAX_JSON_MESSAGE: usize = 2 * connect::MAX_UNARY_RESPONSE;

/// The largest message written as JSON through a `DynamicMessage`, for
/// bytes not as encoders write them. That tree costs a hundred bytes and
/// more per value (two bytes on the wire: an empty element of a list), so
/// a peer's 64 MiB of such values would take gigabytes of the hub; our
/// agents' answers, however large, go the direct way.
pub const MAX_GENERAL_JSON: usize = 1024 * 1024;

/// Encodes a binary message as JSON (canonical proto3 mapping): straight
/// from the wire where the bytes are as encoders write them, else through
/// a `DynamicMessage` (up to [`MAX_GENERAL_JSON`] bytes). JSON over
/// [`MAX_JSON_MESSAGE`] is refused as `ResourceExhausted`.
pub fn proto_to_json(desc: &MessageDescriptor, bytes: &[u8]) -> Result<Vec<u8>, Status> {
    match json::write(desc, bytes, MAX_JSON_MESSAGE) {
        Ok(json) => Ok(json),
        Err(json::TooLarge) => Err(Status::resource_exhausted(format!(
            "the {} is over {} MiB in JSON; ask for it in protobuf",
            desc.name(),
            MAX_JSON_MESSAGE >> 20
        ))),
        Err(json::Unusual) if bytes.len() > MAX_GENERAL_JSON => Err(Status::internal(format!(
            "the {} of {} bytes is not encoded as usual, and over {} MiB such a message is passed on in protobuf only",
            desc.name(),
            bytes.len(),
            MAX_GENERAL_JSON >> 20
        ))),
        Err(json::Unusual) => general_proto_to_json(desc, bytes),
    }
}

/// [`proto_to_json`] through a `DynamicMessage`, for every shape (public
/// for the fuzz harness, which holds the two to the same answers).
pub fn general_proto_to_json(desc: &MessageDescriptor, bytes: &[u8]) -> Result<Vec<u8>, Status> {
    let msg = DynamicMessage::decode(desc.clone(), bytes).map_err(|e| {
        Status::internal(format!("response is not a valid {}: {e}", desc.full_name()))
    })?;
    let mut out = Vec::with_capacity(bytes.len() * 2);
    let mut ser = serde_json::Serializer::new(&mut out);
    msg.serialize_with_options(&mut ser, &SerializeOptions::new())
        .map_err(|e| Status::internal(format!("JSON encoding: {e}")))?;
    Ok(out)
}

/// Messages from this size on are rewritten (JSON, gzip) on a
/// [background](crate::background) thread: turning 320 KiB of protobuf
/// (a listing of 2,000 links) into JSON and gzipping it takes about 5 ms
/// of CPU (30 ms through a `DynamicMessage`), which on a worker holds up
/// every call queued behind it. Below it the hand-off
/// (two thread wake-ups) would cost a good share of the work.
const BACKGROUND_MIN: usize = 16 * 1024;

/// Whose a call's rewrites are, for the background threads' turns: the
/// verified caller's, or `""` for a call anyone may make.
pub fn owner_of(extensions: &http::Extensions) -> Arc<str> {
    extensions
        .get::<crate::auth::Verified>()
        .map_or_else(|| Arc::from(""), |v| Arc::from(v.0.cluster_user.as_str()))
}

/// Does `work` on a message of `len` bytes: here when it is small, on a
/// background thread (in `owner`'s turn) when it is large.
pub async fn rewrite<T: Send + 'static>(
    owner: &str,
    len: usize,
    work: impl FnOnce() -> Result<T, Status> + Send + 'static,
) -> Result<T, Status> {
    if len < BACKGROUND_MIN {
        return work();
    }
    crate::background::run(owner, work)
        .await
        .unwrap_or_else(|_| Err(Status::internal("rewriting a message failed")))
}

/// Inflates gzip, refusing output over `max` bytes.
pub fn gunzip(data: &[u8], max: usize) -> Result<Bytes, Status> {
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(data)
        .take(max as u64 + 1)
        .read_to_end(&mut out)
        .map_err(|e| Status::invalid_argument(format!("gzip: {e}")))?;
    if out.len() > max {
        return Err(Status::resource_exhausted(format!(
            "decompressed message is over the limit of {max} bytes"
        )));
    }
    Ok(out.into())
}

/// Deflates with gzip.
pub fn gzip(data: &[u8]) -> Bytes {
    use std::io::Write;
    let mut enc = flate2::write::GzEncoder::new(
        Vec::with_capacity(data.len() / 2),
        flate2::Compression::fast(),
    );
    let _ = enc.write_all(data);
    enc.finish().unwrap_or_default().into()
}

/// Whether a comma-separated `*-encoding` header accepts gzip.
pub fn accepts_gzip(value: Option<&http::HeaderValue>) -> bool {
    value
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.split(',').any(|e| e.trim().eq_ignore_ascii_case("gzip")))
}

/// Headers a protocol-rewritten request keeps: everything but the framing
/// of the outer protocol.
pub fn pass_headers(from: &HeaderMap) -> HeaderMap {
    let mut out = HeaderMap::with_capacity(from.len());
    for (name, value) in from {
        let n = name.as_str();
        if n.starts_with("connect-")
            || n.starts_with("content-")
            || matches!(
                n,
                "accept-encoding"
                    | "grpc-accept-encoding"
                    | "grpc-encoding"
                    | "te"
                    | "x-grpc-web"
                    | "host"
                    | "connection"
            )
        {
            continue;
        }
        out.append(name.clone(), value.clone());
    }
    out.insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/grpc"),
    );
    out.insert(http::header::TE, http::HeaderValue::from_static("trailers"));
    out
}

/// The gRPC status carried in `headers` (trailers, or headers of a
/// trailers-only response).
pub fn status_of(headers: &HeaderMap) -> Option<Status> {
    Status::from_header_map(headers)
}

/// `connect-timeout-ms` as a gRPC timeout header value.
pub fn grpc_timeout_from_connect(headers: &HeaderMap) -> Option<http::HeaderValue> {
    let ms: u64 = headers
        .get("connect-timeout-ms")?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()?;
    // gRPC allows at most 8 digits.
    let ms = ms.min(99_999_999);
    http::HeaderValue::from_str(&format!("{ms}m")).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ct(value: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_str(value).expect("header value"),
        );
        h
    }

    /// A large message is rewritten on a background thread, a small one
    /// where it is; a rewrite that panics fails its call.
    #[tokio::test]
    async fn large_messages_are_rewritten_off_the_workers() {
        let thread = || Ok(std::thread::current().name().map(str::to_owned));
        let here = std::thread::current().name().map(str::to_owned);
        assert_eq!(rewrite("", BACKGROUND_MIN - 1, thread).await.unwrap(), here);
        assert_eq!(
            rewrite("", BACKGROUND_MIN, thread)
                .await
                .unwrap()
                .as_deref(),
            Some("hub-background")
        );
        let failed = rewrite("", BACKGROUND_MIN, || -> Result<(), Status> {
            panic!("bad")
        })
        .await
        .unwrap_err();
        assert_eq!(failed.code(), Code::Internal);
    }

    /// JSON over its limit is `ResourceExhausted`; bytes no encoder writes
    /// go through the general decoder up to its limit, and are refused
    /// over it, while usual bytes of any size are written.
    #[test]
    fn json_is_bounded_and_the_general_path_kept_small() {
        use prost_types::{Value, value::Kind as V};
        let pool = prost_reflect::DescriptorPool::decode(otter_proto::FILE_DESCRIPTOR_SET).unwrap();
        let value = pool.get_message_by_name("google.protobuf.Value").unwrap();
        let encoded = |kind| Value { kind: Some(kind) }.encode_to_vec();

        let controls = encoded(V::StringValue("\u{1}".repeat(MAX_JSON_MESSAGE / 6 + 1)));
        let e = proto_to_json(&value, &controls).unwrap_err();
        assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
        assert!(e.message().contains("in protobuf"), "{e:?}");

        // A list of nulls, then the same list again: the general decoder
        // joins the two, the direct writer leaves them to it.
        let list = |n: usize| {
            // `list_value` (6) of `n` empty values, written out rather than
            // built as `n` messages first.
            let mut out = vec![6 << 3 | 2];
            prost::encoding::encode_varint(2 * n as u64, &mut out);
            out.extend([0x0a, 0x00].repeat(n));
            out
        };
        let twice = |n| [list(n), list(n)].concat();
        let small = MAX_GENERAL_JSON / 8;
        let json = proto_to_json(&value, &twice(small)).unwrap();
        assert_eq!(json, general_proto_to_json(&value, &twice(small)).unwrap());
        assert_eq!(json.len(), 2 * 5 * small + 1);
        let large = MAX_GENERAL_JSON / 2;
        let e = proto_to_json(&value, &twice(large)).unwrap_err();
        assert_eq!(e.code(), Code::Internal, "{e:?}");
        assert!(e.message().contains("not encoded as usual"), "{e:?}");
        assert!(proto_to_json(&value, &list(4 * MAX_GENERAL_JSON)).is_ok());
    }

    /// A JSON request of more values than a stored object holds is refused
    /// before it is decoded; the count skips what strings hold.
    #[test]
    fn json_requests_are_bounded_in_values() {
        let pool = prost_reflect::DescriptorPool::decode(otter_proto::FILE_DESCRIPTOR_SET).unwrap();
        let value = pool.get_message_by_name("google.protobuf.Value").unwrap();
        let list = |n: usize| format!("[{}null]", "null,".repeat(n - 1));
        assert_eq!(json_values(list(1000).as_bytes()), 1001);
        assert_eq!(json_values(br#"{"a,[{:":"\",[{"}"#), 3);
        assert!(json_to_proto(&value, list(MAX_JSON_VALUES - 1).as_bytes()).is_ok());
        let e = json_to_proto(&value, list(MAX_JSON_VALUES).as_bytes()).unwrap_err();
        assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
        // However many commas a string holds, it is one value.
        let text = format!(r#""{}""#, ",".repeat(MAX_JSON_VALUES));
        assert!(json_to_proto(&value, text.as_bytes()).is_ok());
    }

    #[test]
    fn detects_our_protocols() {
        let post = http::Method::POST;
        let grpc = |json| Ok(Protocol::Grpc { json });
        let web = |text, json| Ok(Protocol::GrpcWeb { text, json });
        assert_eq!(detect(&post, &ct("application/grpc")), grpc(false));
        assert_eq!(detect(&post, &ct("application/grpc+proto")), grpc(false));
        assert_eq!(detect(&post, &ct("application/grpc+json")), grpc(true));
        assert_eq!(
            detect(&post, &ct("application/grpc-web-text+proto")),
            web(true, false)
        );
        assert_eq!(
            detect(&post, &ct("application/grpc-web+json")),
            web(false, true)
        );
        assert_eq!(
            detect(&post, &ct("application/grpc-web-text+json")),
            web(true, true)
        );
        assert_eq!(
            detect(&post, &ct("application/json; charset=utf-8")),
            Ok(Protocol::ConnectUnary { json: true })
        );
        assert_eq!(
            detect(&http::Method::GET, &HeaderMap::new()),
            Ok(Protocol::ConnectGet)
        );
    }

    #[test]
    fn refuses_other_grpc_codecs_with_a_grpc_status() {
        let post = http::Method::POST;
        let why = detect(&post, &ct("application/grpc+cbor")).unwrap_err();
        assert_eq!(
            why,
            Unsupported::GrpcCodec {
                web: false,
                subtype: "cbor".into()
            }
        );
        let resp = unsupported_response(&why);
        assert_eq!(resp.status(), http::StatusCode::UNSUPPORTED_MEDIA_TYPE);
        assert_eq!(resp.headers()["grpc-status"], "12");
        assert!(
            resp.headers()["grpc-message"]
                .to_str()
                .unwrap()
                .contains("application/grpc+proto")
        );
        assert_eq!(
            detect(&post, &ct("application/grpc-web+cbor")),
            Err(Unsupported::GrpcCodec {
                web: true,
                subtype: "cbor".into()
            })
        );
        assert_eq!(
            detect(&post, &ct("text/plain")),
            Err(Unsupported::ContentType)
        );
        let resp = unsupported_response(&Unsupported::ContentType);
        assert_eq!(resp.status(), http::StatusCode::UNSUPPORTED_MEDIA_TYPE);
        assert_eq!(resp.headers()["content-type"], "application/json");
        assert!(
            resp.headers()["accept-post"]
                .to_str()
                .unwrap()
                .contains("application/json")
        );
        assert_eq!(
            detect(&post, &HeaderMap::new()),
            Err(Unsupported::ContentType)
        );
    }
}
