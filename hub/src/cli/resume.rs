//! A Watch that survives a lost tunnel or a restarted hub.
//!
//! The hub cannot keep a caller's Watch alive across a tunnel that died: the
//! agent that held the upstream watch is gone, and a new tunnel is a new
//! set of streams. So the hub ends the call with `Unavailable`, and the
//! resume lives here, in the client: the watch is opened again from the
//! last resourceVersion the caller was given (objects and bookmarks), so
//! the caller sees no gap and no repeat, for as long as the cluster still
//! has that version (when it does not, the agent answers with an ERROR
//! event, 410, and the caller must list again).
//!
//! Retries are paced (full jitter, doubling to a ceiling) and bounded in
//! time: a watch that cannot be reopened for `give_up_after` ends with the
//! last error.

use std::time::Duration;

use futures::StreamExt;
use otter_proto::resource::v1::{
    WatchEvent, WatchRequest, resource_service_client::ResourceServiceClient,
};
use tokio::time::Instant;
use tonic::{Status, Streaming, transport::Channel};

/// Pacing of the reopen attempts.
#[derive(Debug, Clone, Copy)]
pub struct Resume {
    /// Ceiling of the first delay; it doubles after each failed attempt.
    pub first_delay: Duration,
    pub max_delay: Duration,
    /// Failing without a break for this long ends the watch.
    pub give_up_after: Duration,
}

impl Default for Resume {
    fn default() -> Self {
        Self {
            first_delay: Duration::from_millis(250),
            max_delay: Duration::from_secs(5),
            give_up_after: Duration::from_secs(300),
        }
    }
}

/// What [`ResumingWatch::next`] yields.
#[derive(Debug)]
pub enum Watched {
    Event(WatchEvent),
    /// The stream broke with `after`; it is being opened again from `from`.
    Resuming {
        after: Status,
        from: Option<String>,
        attempt: u32,
    },
}

/// Whether a watch that ended with `s` can be opened again: the tunnel or
/// the hub went away (Unavailable from the hub, or the client's own
/// transport error when the connection to the hub broke).
pub fn is_resumable(s: &Status) -> bool {
    match s.code() {
        tonic::Code::Unavailable => true,
        tonic::Code::Unknown => {
            let m = s.message().to_ascii_lowercase();
            ["transport error", "h2 protocol error", "connection"]
                .iter()
                .any(|w| m.contains(w))
        }
        _ => false,
    }
}

/// A Watch opened again from the last resourceVersion when it breaks.
pub struct ResumingWatch<F> {
    client: ResourceServiceClient<Channel>,
    request: WatchRequest,
    authorize: F,
    policy: Resume,
    stream: Option<Streaming<WatchEvent>>,
    attempt: u32,
    failing_since: Option<Instant>,
    resumes: u32,
}

impl<F> std::fmt::Debug for ResumingWatch<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResumingWatch")
            .field("resource_version", &self.request.resource_version)
            .field("resumes", &self.resumes)
            .finish()
    }
}

impl<F> ResumingWatch<F>
where
    F: Fn(WatchRequest) -> tonic::Request<WatchRequest>,
{
    /// A watch for `request` (its `resource_version` is where it starts);
    /// `authorize` turns each attempt's message into a request with the
    /// caller's credentials.
    pub fn new(
        client: ResourceServiceClient<Channel>,
        request: WatchRequest,
        authorize: F,
        policy: Resume,
    ) -> Self {
        Self {
            client,
            request,
            authorize,
            policy,
            stream: None,
            attempt: 0,
            failing_since: None,
            resumes: 0,
        }
    }

    /// The resourceVersion the next reopen would start from.
    pub fn resource_version(&self) -> Option<&str> {
        self.request.resource_version.as_deref()
    }

    /// How many times the watch was opened again.
    pub fn resumes(&self) -> u32 {
        self.resumes
    }

    /// The next event; `Resuming` before each reopen attempt; None when the
    /// watch ended cleanly; an error that cannot be resumed (or that lasted
    /// longer than the policy allows) ends it.
    pub async fn next(&mut self) -> Option<Result<Watched, Status>> {
        loop {
            let Some(stream) = self.stream.as_mut() else {
                if self.attempt > 0 {
                    self.pause().await;
                }
                match self
                    .client
                    .watch((self.authorize)(self.request.clone()))
                    .await
                {
                    Ok(s) => {
                        if self.attempt > 0 {
                            self.resumes += 1;
                        }
                        self.stream = Some(s.into_inner());
                    }
                    Err(e) => {
                        if let Some(r) = self.broke(e) {
                            return Some(r);
                        }
                    }
                }
                continue;
            };
            match stream.next().await {
                Some(Ok(ev)) => {
                    // A stream that delivers has recovered.
                    self.attempt = 0;
                    self.failing_since = None;
                    if let Some(rv) = ev.resource_version.as_ref().filter(|v| !v.is_empty()) {
                        self.request.resource_version = Some(rv.clone());
                    }
                    return Some(Ok(Watched::Event(ev)));
                }
                Some(Err(e)) => {
                    self.stream = None;
                    if let Some(r) = self.broke(e) {
                        return Some(r);
                    }
                }
                None => return None,
            }
        }
    }

    /// Decides on a broken or refused attempt: `Resuming` to report, the
    /// error to end with, or None to try again at once (never: every retry
    /// is reported first).
    fn broke(&mut self, e: Status) -> Option<Result<Watched, Status>> {
        let since = *self.failing_since.get_or_insert_with(Instant::now);
        if !is_resumable(&e) || since.elapsed() >= self.policy.give_up_after {
            return Some(Err(e));
        }
        self.attempt += 1;
        Some(Ok(Watched::Resuming {
            after: e,
            from: self.request.resource_version.clone(),
            attempt: self.attempt,
        }))
    }

    /// Waits before the next attempt: full jitter below a doubling ceiling,
    /// and never less than a floor, so a hub that refuses at once is not
    /// hammered.
    async fn pause(&self) {
        let shift = self.attempt.saturating_sub(1).min(16);
        let ceiling = self
            .policy
            .first_delay
            .saturating_mul(1 << shift)
            .min(self.policy.max_delay);
        let delay = ceiling
            .mul_f64(rand::random::<f64>())
            .max(Duration::from_millis(50));
        tokio::time::sleep(delay).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_lost_connections_are_resumed() {
        assert!(is_resumable(&Status::unavailable(
            "tunnel to cluster edge-1 lost"
        )));
        assert!(is_resumable(&Status::unknown(
            "h2 protocol error: error reading a body from connection"
        )));
        assert!(is_resumable(&Status::unknown("transport error")));
        assert!(!is_resumable(&Status::unknown(
            "command terminated with exit code 3"
        )));
        assert!(!is_resumable(&Status::permission_denied("forbidden")));
        assert!(!is_resumable(&Status::not_found("no such cluster")));
    }
}
