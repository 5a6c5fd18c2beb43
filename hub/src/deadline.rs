//! gRPC deadlines, enforced at the front door for every protocol: a call
//! whose `grpc-timeout` (or Connect's `connect-timeout-ms`, turned into it)
//! passes ends with DeadlineExceeded, and whatever it was doing on the
//! agent is cancelled with it.

use std::{
    pin::Pin,
    task::{Context, Poll},
    time::Duration,
};

use bytes::Bytes;
use http_body::{Body, Frame};
use tokio::time::{Instant, Sleep};

use crate::forward::HttpBody;

/// Parses a `grpc-timeout` value: up to 8 digits and a unit (H, M, S, m, u, n).
pub fn parse_grpc_timeout(headers: &http::HeaderMap) -> Option<Duration> {
    let v = headers.get("grpc-timeout")?.to_str().ok()?;
    if v.len() < 2 || v.len() > 9 {
        return None;
    }
    let (digits, unit) = v.split_at(v.len() - 1);
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.saturating_mul(3600)),
        "M" => Duration::from_secs(n.saturating_mul(60)),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// Ends a response body with DeadlineExceeded once `deadline` passes.
pub fn limit(resp: http::Response<HttpBody>, deadline: Instant) -> http::Response<HttpBody> {
    resp.map(|inner| {
        http_body_util::BodyExt::boxed_unsync(DeadlineBody {
            inner: Some(inner),
            sleep: Box::pin(tokio::time::sleep_until(deadline)),
        })
    })
}

struct DeadlineBody {
    inner: Option<HttpBody>,
    sleep: Pin<Box<Sleep>>,
}

impl Body for DeadlineBody {
    type Data = Bytes;
    type Error = crate::protocol::BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let Some(inner) = self.inner.as_mut() else {
            return Poll::Ready(None);
        };
        if let Poll::Ready(frame) = Pin::new(inner).poll_frame(cx) {
            if frame.is_none() {
                self.inner = None;
            }
            return Poll::Ready(frame);
        }
        if self.sleep.as_mut().poll(cx).is_ready() {
            // Dropping the inner body cancels the call on the agent.
            self.inner = None;
            let status = tonic::Status::deadline_exceeded("the call's deadline passed");
            return Poll::Ready(Some(Ok(crate::forward::status_trailers(&status))));
        }
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        self.inner.as_ref().is_none_or(|b| b.is_end_stream())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_unit_and_refuses_junk() {
        let h = |v: &str| {
            let mut m = http::HeaderMap::new();
            m.insert("grpc-timeout", v.parse().unwrap());
            parse_grpc_timeout(&m)
        };
        assert_eq!(h("1500m"), Some(Duration::from_millis(1500)));
        assert_eq!(h("2S"), Some(Duration::from_secs(2)));
        assert_eq!(h("1H"), Some(Duration::from_secs(3600)));
        assert_eq!(h("10u"), Some(Duration::from_micros(10)));
        assert_eq!(h("5x"), None);
        assert_eq!(h("123456789S"), None);
        assert_eq!(h("S"), None);
    }
}
