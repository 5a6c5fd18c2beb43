//! gRPC-Web: gRPC's framing in an HTTP/1.1-friendly body, trailers sent as
//! a last frame (flag 0x80), and the `-text` variant in base64.

use base64::Engine;
use bytes::{Bytes, BytesMut};
use http::{HeaderMap, HeaderValue, header};
use http_body_util::{BodyExt, StreamBody};

use super::{
    BoxError, data_frame, err_frame, frames, pass_headers, status_frame, status_of, transcode,
};
use crate::{forward::HttpBody, methods::MethodInfo, server::GrpcHandler};

const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;

/// Serves one gRPC-Web call through the gRPC handlers. `json` carries the
/// method and the request size limit when the messages are JSON
/// (`application/grpc-web+json`).
pub async fn call(
    inner: GrpcHandler,
    text: bool,
    json: Option<(&MethodInfo, usize)>,
    req: http::Request<crate::limits::RequestBody>,
) -> http::Response<HttpBody> {
    let (parts, body) = req.into_parts();
    let body: HttpBody = if text {
        let s = futures::stream::unfold(
            (body, TextDecoder::default(), false),
            |(mut body, mut decoder, done)| async move {
                if done {
                    return None;
                }
                loop {
                    match body.frame().await {
                        Some(Ok(frame)) => {
                            let Ok(data) = frame.into_data() else {
                                continue;
                            };
                            match decoder.push(&data) {
                                Ok(None) => continue,
                                Ok(Some(d)) => {
                                    return Some((data_frame(d), (body, decoder, false)));
                                }
                                Err(e) => {
                                    let status = tonic::Status::invalid_argument(e.to_string());
                                    return Some((status_frame(status), (body, decoder, true)));
                                }
                            }
                        }
                        Some(Err(e)) => return Some((err_frame(e), (body, decoder, true))),
                        None => {
                            return decoder.finish().err().map(|e| {
                                let status = tonic::Status::invalid_argument(e.to_string());
                                (status_frame(status), (body, decoder, true))
                            });
                        }
                    }
                }
            },
        );
        StreamBody::new(s).boxed_unsync()
    } else {
        body.map_err(|e| -> BoxError { Box::new(e) }).boxed_unsync()
    };
    let owner = super::owner_of(&parts.extensions);
    let mut grpc = http::Request::from_parts(parts, body);
    *grpc.method_mut() = http::Method::POST;
    let grpc = match json {
        Some((method, max)) => transcode::json_request(grpc, method.input.clone(), max),
        None => {
            *grpc.headers_mut() = pass_headers(grpc.headers());
            grpc
        }
    };

    let resp = inner.call(grpc).await;
    let resp = match json {
        Some((method, _)) => transcode::json_response(resp, method.output.clone(), owner),
        None => resp,
    };
    let (mut rparts, rbody) = resp.into_parts();
    let encode = move |b: Bytes| if text { Bytes::from(B64.encode(&b)) } else { b };
    let trailers_only = status_of(&rparts.headers).map(|_| rparts.headers.clone());
    let s = futures::stream::unfold(
        (rbody, trailers_only, false),
        move |(mut body, trailers_only, done)| async move {
            if done {
                return None;
            }
            if let Some(headers) = trailers_only {
                return Some((
                    data_frame(encode(trailer_frame(&headers))),
                    (body, None, true),
                ));
            }
            match body.frame().await {
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => Some((data_frame(encode(data)), (body, None, false))),
                    Err(frame) => {
                        let trailers = frame.into_trailers().unwrap_or_default();
                        Some((
                            data_frame(encode(trailer_frame(&trailers))),
                            (body, None, true),
                        ))
                    }
                },
                Some(Err(e)) => {
                    let status = tonic::Status::unavailable(format!("response stream broke: {e}"));
                    let mut t = HeaderMap::new();
                    let _ = status.add_header(&mut t);
                    Some((data_frame(encode(trailer_frame(&t))), (body, None, true)))
                }
                None => None,
            }
        },
    );
    let content_type = content_type(text, json.is_some());
    rparts
        .headers
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    rparts.headers.remove(header::CONTENT_LENGTH);
    http::Response::from_parts(rparts, StreamBody::new(s).boxed_unsync())
}

/// The content type of a gRPC-Web answer.
pub fn content_type(text: bool, json: bool) -> &'static str {
    match (text, json) {
        (false, false) => "application/grpc-web+proto",
        (true, false) => "application/grpc-web-text+proto",
        (false, true) => "application/grpc-web+json",
        (true, true) => "application/grpc-web-text+json",
    }
}

/// Decodes a `grpc-web-text` request body, sans IO: base64 in whole
/// 4-character groups across chunk borders, whitespace ignored. Each message
/// may be encoded (and padded) on its own, so a padded group ends a segment
/// and decoding starts afresh after it. Public so the fuzz targets drive the
/// same code the hub runs.
#[derive(Debug, Default)]
pub struct TextDecoder {
    pending: BytesMut,
}

impl TextDecoder {
    /// Takes the next chunk of the body; returns the bytes of the whole
    /// groups seen so far, if any.
    pub fn push(&mut self, data: &[u8]) -> Result<Option<Bytes>, TextBodyError> {
        self.pending
            .extend(data.iter().filter(|b| !b.is_ascii_whitespace()));
        let whole = self.pending.len() / 4 * 4;
        if whole == 0 {
            return Ok(None);
        }
        let chunk = self.pending.split_to(whole);
        let mut out = Vec::with_capacity(whole / 4 * 3);
        let mut start = 0;
        for group in (0..whole).step_by(4) {
            let end = group + 4;
            if chunk[group..end].contains(&b'=') || end == whole {
                B64.decode_vec(&chunk[start..end], &mut out)
                    .map_err(TextBodyError::NotBase64)?;
                start = end;
            }
        }
        Ok(Some(out.into()))
    }

    /// Checks the body did not end inside a group.
    pub fn finish(&self) -> Result<(), TextBodyError> {
        if self.pending.is_empty() {
            Ok(())
        } else {
            Err(TextBodyError::Truncated)
        }
    }
}

/// Why a grpc-web-text body cannot be read (answered `InvalidArgument`).
#[derive(Debug, thiserror::Error)]
pub enum TextBodyError {
    #[error("grpc-web-text body is not base64: {0}")]
    NotBase64(#[source] base64::DecodeError),
    #[error("grpc-web-text body ends mid base64 group")]
    Truncated,
}

/// Trailers as gRPC-Web's last frame: `name: value\r\n` lines.
fn trailer_frame(trailers: &HeaderMap) -> Bytes {
    let mut text = Vec::new();
    for (name, value) in trailers {
        let n = name.as_str();
        if n == "content-type" || n == "date" || n == "content-length" {
            continue;
        }
        text.extend_from_slice(n.as_bytes());
        text.extend_from_slice(b": ");
        text.extend_from_slice(value.as_bytes());
        text.extend_from_slice(b"\r\n");
    }
    frames::encode(frames::FLAG_TRAILERS, &text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_decoder_joins_chunks_and_separately_padded_messages() {
        let mut d = TextDecoder::default();
        let a = B64.encode(b"ab");
        let b = B64.encode(b"cdef");
        let text = format!("{a}\n{b}");
        let (first, second) = text.as_bytes().split_at(3);
        assert_eq!(d.push(first).unwrap(), None);
        assert_eq!(
            d.push(second).unwrap().unwrap(),
            Bytes::from_static(b"abcdef")
        );
        d.finish().unwrap();
        assert_eq!(d.push(b"QQ").unwrap(), None);
        assert!(d.finish().is_err());
        assert!(TextDecoder::default().push(b"!!!!").is_err());
    }
}
