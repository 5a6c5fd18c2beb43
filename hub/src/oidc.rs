//! OpenID Connect bearer tokens: discovery and JWKS fetched from the issuer
//! and cached (refetched when the cache is older than `jwks_refresh` and when
//! an unknown key id shows up, so key rotation needs no restart), RS256/ES256
//! signatures, `exp`, `nbf`, `iss` and `aud` checked with a bounded clock
//! skew.
//!
//! Anyone can reach the API port with a JWT naming a made-up key id, so
//! fetching keys is guarded: one fetch at a time that every waiting token
//! shares, an unknown key id refetches at most once per
//! `unknown_kid_refetch`, and a failed fetch backs off (1 s doubling to
//! 60 s). A caller sees Unauthenticated for a bad token and Unavailable when
//! the issuer's keys cannot be fetched.
//!
//! Identity, as OtterScale maps it: the user is the subject (or the
//! configured claim); groups are `system:authenticated` plus `oidc:<g>` for
//! every entry of the groups claim and every client role of the audience.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, MutexGuard},
    time::{Duration, Instant},
};

use crate::auth::Principal;
use http_body_util::{BodyExt, Empty};
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use jsonwebtoken::{Algorithm, DecodingKey, Validation, jwk::JwkSet};
use tonic::Status;
use url::Url;

/// Largest discovery or JWKS document read.
const MAX_DOCUMENT: usize = 1024 * 1024;
/// Default least time between two fetches caused by unknown key ids. Each
/// made-up key id would otherwise cost the issuer a fetch; half a minute
/// bounds that to two a minute, while a token of a key published just after
/// our last fetch waits at most this long (a key published earlier is
/// picked up at once).
pub const UNKNOWN_KID_REFETCH: Duration = Duration::from_secs(30);
/// Wait after the first failed fetch; doubles with every further failure.
const BACKOFF_BASE: Duration = Duration::from_secs(1);
/// Longest wait between fetches while the issuer fails, so that it is
/// noticed within a minute when it comes back.
const BACKOFF_CAP: Duration = Duration::from_secs(60);
/// Bound on each HTTP request to the issuer.
const FETCH_TIMEOUT: Duration = Duration::from_secs(10);

/// Settings of the identity provider.
#[derive(Debug, Clone)]
pub struct OidcConfig {
    pub issuer: Url,
    pub audience: String,
    /// Claim naming the user.
    pub user_claim: String,
    /// Claim holding the groups list.
    pub groups_claim: String,
    /// Client whose `resource_access.<client>.roles` become groups; the
    /// audience when unset.
    pub roles_client: Option<String>,
    /// Extra CA (PEM) to trust for the issuer, beside the public roots.
    pub ca_pem: Option<String>,
    /// A groups-claim value `<prefix><tenant>:<role>` makes the user a
    /// member (`member`) or an admin (`admin`) of that tenant; such values
    /// are not passed on as groups.
    pub tenant_group_prefix: String,
    /// The groups-claim value that makes a user a hub operator.
    pub operator_group: String,
    /// Put before the user claim in the name clusters see, like
    /// kube-apiserver's `--oidc-username-prefix`: no identity provider
    /// user can be a hub user or a built-in one.
    pub username_prefix: String,
    /// Clock skew allowed on `exp` and `nbf`.
    pub leeway: Duration,
    /// How often the JWKS is refetched.
    pub jwks_refresh: Duration,
    /// Least time since the last fetch before an unknown key id refetches
    /// ([`UNKNOWN_KID_REFETCH`] unless a test needs it shorter).
    pub unknown_kid_refetch: Duration,
}

impl OidcConfig {
    pub fn new(issuer: Url, audience: &str) -> Self {
        Self {
            issuer,
            audience: audience.to_owned(),
            user_claim: "sub".into(),
            groups_claim: "groups".into(),
            roles_client: None,
            ca_pem: None,
            tenant_group_prefix: "otterscale:tenant:".into(),
            operator_group: crate::tokens::ADMIN_GROUP.into(),
            username_prefix: "oidc:".into(),
            leeway: Duration::from_secs(60),
            jwks_refresh: Duration::from_secs(600),
            unknown_kid_refetch: UNKNOWN_KID_REFETCH,
        }
    }
}

/// A key set as fetched.
struct Keys {
    fetched: Instant,
    by_kid: HashMap<String, (DecodingKey, Algorithm)>,
}

/// What the verifier knows of the issuer's keys. Decisions about fetching
/// are made here, with the time passed in, so tests need no issuer.
#[derive(Default)]
struct KeyState {
    /// The last key set fetched; kept when later fetches fail.
    keys: Option<Keys>,
    /// Fetch attempts finished so far. A token that waited for the fetch
    /// lock tells from a change that someone else fetched meanwhile, and
    /// takes their outcome instead of fetching again.
    attempts: u64,
    /// Failed attempts since the last success.
    failures: u32,
    /// No fetch before this, after a failure.
    retry_at: Option<Instant>,
    /// Why the last attempt failed, for the callers refused meanwhile.
    last_error: Option<String>,
}

/// What to do for one token's key id.
enum Plan {
    Use(DecodingKey, Algorithm),
    Fetch,
    Refuse(Status),
}

impl KeyState {
    /// With `may_fetch` false (the token already waited for a fetch) the
    /// answer is never [`Plan::Fetch`].
    fn plan(&self, kid: &str, now: Instant, config: &OidcConfig, may_fetch: bool) -> Plan {
        let backing_off = self.retry_at.is_some_and(|t| now < t);
        let may_fetch = may_fetch && !backing_off;
        let Some(keys) = &self.keys else {
            return if may_fetch {
                Plan::Fetch
            } else {
                Plan::Refuse(self.unavailable(now))
            };
        };
        let age = now.saturating_duration_since(keys.fetched);
        match keys.by_kid.get(kid) {
            Some((key, alg)) if age < config.jwks_refresh || !may_fetch => {
                // Past `jwks_refresh` with the issuer failing, the keys we
                // have still verify: an issuer outage should not lock out
                // every user whose key has not changed.
                Plan::Use(key.clone(), *alg)
            }
            Some(_) => Plan::Fetch,
            None if age < config.unknown_kid_refetch || (!may_fetch && self.failures == 0) => {
                Plan::Refuse(Status::unauthenticated(format!(
                    "token signed with unknown key id {kid:?}; log in again"
                )))
            }
            None if may_fetch => Plan::Fetch,
            // The key may be one the issuer has just published: we cannot
            // tell while it does not answer.
            None => Plan::Refuse(self.unavailable(now)),
        }
    }

    fn unavailable(&self, now: Instant) -> Status {
        let why = self.last_error.as_deref().unwrap_or("no answer yet");
        let retry = self
            .retry_at
            .map(|t| t.saturating_duration_since(now).as_secs().max(1))
            .unwrap_or(1);
        Status::unavailable(format!(
            "cannot fetch the identity provider's keys ({why}); retrying in {retry}s"
        ))
    }

    /// Takes in the outcome of one fetch attempt.
    fn record(&mut self, outcome: Result<Keys, FetchError>, now: Instant) {
        self.attempts += 1;
        match outcome {
            Ok(keys) => {
                self.keys = Some(keys);
                self.failures = 0;
                self.retry_at = None;
                self.last_error = None;
            }
            Err(e) => {
                let wait = BACKOFF_BASE
                    .saturating_mul(1u32 << self.failures.min(16))
                    .min(BACKOFF_CAP);
                self.failures = self.failures.saturating_add(1);
                self.retry_at = Some(now + wait);
                self.last_error = Some(e.to_string());
            }
        }
    }
}

/// Why the identity provider's keys could not be fetched (said to callers
/// refused meanwhile, so it names the URL and never a token).
#[derive(Debug, thiserror::Error)]
enum FetchError {
    #[error("{url}: {source}")]
    Url {
        url: String,
        #[source]
        source: http::uri::InvalidUri,
    },
    #[error("{0}: timed out")]
    Timeout(String),
    #[error("{url}: {source}")]
    Request {
        url: String,
        #[source]
        source: hyper_util::client::legacy::Error,
    },
    #[error("{url}: HTTP {status}")]
    Status {
        url: String,
        status: http::StatusCode,
    },
    #[error("{url}: {source}")]
    Body {
        url: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("{url}: not JSON: {source}")]
    NotJson {
        url: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("discovery names issuer {found:?}, not {expected}")]
    WrongIssuer { found: String, expected: String },
    #[error("discovery has no jwks_uri")]
    NoJwksUri,
    #[error("JWKS: {0}")]
    Jwks(#[source] serde_json::Error),
}

type HttpsClient = Client<
    hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector>,
    Empty<bytes::Bytes>,
>;

/// The issuer and what we know of it: the part of the verifier a fetch task
/// holds, so that a fetch outlives the request that started it.
struct Source {
    issuer: Url,
    client: HttpsClient,
    state: Mutex<KeyState>,
    /// Held for the whole of a fetch, so there is one at a time.
    fetching: Arc<tokio::sync::Mutex<()>>,
}

/// Verifies bearer tokens of one issuer.
pub struct OidcVerifier {
    config: OidcConfig,
    source: Arc<Source>,
    /// The fetch in flight, if any, stopped when the verifier goes.
    fetch_task: Mutex<Option<tokio::task::AbortHandle>>,
}

impl std::fmt::Debug for OidcVerifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OidcVerifier")
            .field("issuer", &self.config.issuer.as_str())
            .finish()
    }
}

impl Drop for OidcVerifier {
    fn drop(&mut self) {
        if let Some(task) = lock(&self.fetch_task).take() {
            task.abort();
        }
    }
}

/// Nothing panics while holding these locks, but a poisoned one is still
/// consistent: each update is a single assignment.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Source {
    async fn get_json(&self, url: &str) -> Result<serde_json::Value, FetchError> {
        let at = || url.to_owned();
        let uri: http::Uri = url
            .parse()
            .map_err(|source| FetchError::Url { url: at(), source })?;
        let resp = tokio::time::timeout(FETCH_TIMEOUT, self.client.get(uri))
            .await
            .map_err(|_| FetchError::Timeout(at()))?
            .map_err(|source| FetchError::Request { url: at(), source })?;
        if !resp.status().is_success() {
            return Err(FetchError::Status {
                url: at(),
                status: resp.status(),
            });
        }
        let body = tokio::time::timeout(
            FETCH_TIMEOUT,
            http_body_util::Limited::new(resp.into_body(), MAX_DOCUMENT).collect(),
        )
        .await
        .map_err(|_| FetchError::Timeout(at()))?
        .map_err(|source| FetchError::Body { url: at(), source })?
        .to_bytes();
        serde_json::from_slice(&body).map_err(|source| FetchError::NotJson { url: at(), source })
    }

    /// Fetches discovery and the JWKS.
    async fn fetch(&self) -> Result<Keys, FetchError> {
        let discovery_url = format!(
            "{}/.well-known/openid-configuration",
            self.issuer.as_str().trim_end_matches('/')
        );
        let discovery = self.get_json(&discovery_url).await?;
        let issuer = discovery["issuer"].as_str().unwrap_or_default();
        if issuer.trim_end_matches('/') != self.issuer.as_str().trim_end_matches('/') {
            return Err(FetchError::WrongIssuer {
                found: issuer.to_owned(),
                expected: self.issuer.to_string(),
            });
        }
        let jwks_uri = discovery["jwks_uri"]
            .as_str()
            .ok_or(FetchError::NoJwksUri)?;
        let set: JwkSet =
            serde_json::from_value(self.get_json(jwks_uri).await?).map_err(FetchError::Jwks)?;
        let mut by_kid = HashMap::new();
        for jwk in &set.keys {
            let Some(kid) = jwk.common.key_id.clone() else {
                continue;
            };
            let alg = match &jwk.algorithm {
                jsonwebtoken::jwk::AlgorithmParameters::RSA(_) => Algorithm::RS256,
                jsonwebtoken::jwk::AlgorithmParameters::EllipticCurve(_) => Algorithm::ES256,
                _ => continue,
            };
            if let Ok(key) = DecodingKey::from_jwk(jwk) {
                by_kid.insert(kid, (key, alg));
            }
        }
        Ok(Keys {
            fetched: Instant::now(),
            by_kid,
        })
    }
}

impl OidcVerifier {
    pub fn new(config: OidcConfig) -> crate::Result<Arc<Self>> {
        if config.issuer.scheme() != "https" {
            return Err(crate::HubError::Config(format!(
                "OIDC issuer {} must be https",
                config.issuer
            )));
        }
        let tls = otter_pki::tls::public_client_config(config.ca_pem.as_deref(), &[])
            .map_err(|e| crate::HubError::Config(format!("OIDC CA: {e}")))?;
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_only()
            .enable_http1()
            .build();
        let client = Client::builder(TokioExecutor::new()).build(https);
        Ok(Arc::new(Self {
            source: Arc::new(Source {
                issuer: config.issuer.clone(),
                client,
                state: Mutex::new(KeyState::default()),
                fetching: Arc::new(tokio::sync::Mutex::new(())),
            }),
            config,
            fetch_task: Mutex::new(None),
        }))
    }

    /// The key a token's `kid` names, fetching the issuer's keys if needed
    /// and allowed.
    async fn key(&self, kid: &str) -> Result<(DecodingKey, Algorithm), Status> {
        let decide = |may_fetch| {
            let state = lock(&self.source.state);
            let plan = state.plan(kid, Instant::now(), &self.config, may_fetch);
            (plan, state.attempts)
        };
        let seen = match decide(true) {
            (Plan::Use(key, alg), _) => return Ok((key, alg)),
            (Plan::Refuse(status), _) => return Err(status),
            (Plan::Fetch, seen) => seen,
        };
        let guard = self.source.fetching.clone().lock_owned().await;
        if lock(&self.source.state).attempts == seen {
            // Ours to fetch. In a task of its own, so that a caller who
            // gives up does not cancel the fetch the others wait for.
            let source = self.source.clone();
            let task = tokio::spawn(async move {
                let outcome = source.fetch().await;
                if let Err(e) = &outcome {
                    tracing::warn!(issuer = %source.issuer, error = %e, "OIDC key fetch failed");
                }
                lock(&source.state).record(outcome, Instant::now());
                drop(guard);
            });
            *lock(&self.fetch_task) = Some(task.abort_handle());
            // An error here means the task was aborted (the verifier is
            // going) or panicked; either way the state says what to do.
            let _ = task.await;
        } else {
            // Someone fetched while we waited: their outcome is ours.
            drop(guard);
        }
        match decide(false) {
            (Plan::Use(key, alg), _) => Ok((key, alg)),
            (Plan::Refuse(status), _) => Err(status),
            // Not returned without `may_fetch`; refusing keeps it that way
            // should `plan` change.
            (Plan::Fetch, _) => Err(lock(&self.source.state).unavailable(Instant::now())),
        }
    }

    /// The caller a bearer token names, if the token is valid.
    pub async fn verify(&self, token: &str) -> Result<Principal, Status> {
        let header = jsonwebtoken::decode_header(token)
            .map_err(|e| Status::unauthenticated(format!("malformed token: {e}")))?;
        if !matches!(header.alg, Algorithm::RS256 | Algorithm::ES256) {
            return Err(Status::unauthenticated(format!(
                "token algorithm {:?} is not accepted (RS256 or ES256)",
                header.alg
            )));
        }
        let kid = header
            .kid
            .ok_or_else(|| Status::unauthenticated("token has no key id"))?;
        let (key, alg) = self.key(&kid).await?;
        if alg != header.alg {
            return Err(Status::unauthenticated(
                "token algorithm does not match its key",
            ));
        }
        let mut validation = Validation::new(alg);
        validation.set_audience(&[&self.config.audience]);
        validation.set_issuer(&[
            self.config.issuer.as_str().trim_end_matches('/'),
            self.config.issuer.as_str(),
        ]);
        validation.leeway = self.config.leeway.as_secs();
        validation.validate_nbf = true;
        validation.set_required_spec_claims(&["exp", "iss", "aud"]);
        let data = jsonwebtoken::decode::<serde_json::Value>(token, &key, &validation)
            .map_err(|e| Status::unauthenticated(format!("token rejected: {e}; log in again")))?;
        self.identity(&data.claims)
    }

    fn identity(&self, claims: &serde_json::Value) -> Result<Principal, Status> {
        let user = claims[&self.config.user_claim]
            .as_str()
            .filter(|u| !u.is_empty())
            .ok_or_else(|| {
                Status::unauthenticated(format!("token has no {} claim", self.config.user_claim))
            })?;
        let mut principal = Principal {
            user: user.to_owned(),
            cluster_user: format!("{}{user}", self.config.username_prefix),
            ..Default::default()
        };
        let mut add = |g: &str| {
            if g == self.config.operator_group {
                principal.operator = true;
            }
            if let Some(membership) = g.strip_prefix(&self.config.tenant_group_prefix) {
                // `<tenant>:<role>`; anything else there is ignored, not
                // passed on as a group.
                if let Some((tenant, role)) = membership.rsplit_once(':')
                    && crate::tenancy::validate_tenant_name(tenant).is_ok()
                    && let Ok(role) = role.parse::<crate::tenancy::Role>()
                {
                    let held = principal.tenants.entry(tenant.to_owned()).or_insert(role);
                    *held = (*held).max(role);
                }
                return;
            }
            let g = format!("oidc:{g}");
            if !principal.groups.contains(&g) {
                principal.groups.push(g);
            }
        };
        if let Some(list) = claims[&self.config.groups_claim].as_array() {
            list.iter().filter_map(|g| g.as_str()).for_each(&mut add);
        }
        let client = self
            .config
            .roles_client
            .as_deref()
            .unwrap_or(&self.config.audience);
        if let Some(roles) = claims["resource_access"][client]["roles"].as_array() {
            roles.iter().filter_map(|r| r.as_str()).for_each(&mut add);
        }
        Ok(principal)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> OidcConfig {
        OidcConfig::new("https://issuer.example".parse().unwrap(), "otter")
    }

    fn keys(fetched: Instant, kids: &[&str]) -> Keys {
        let key = (DecodingKey::from_secret(b"test").unwrap(), Algorithm::ES256);
        Keys {
            fetched,
            by_kid: kids.iter().map(|k| (k.to_string(), key.clone())).collect(),
        }
    }

    /// A plan as `use`, `fetch` or the refusal's code.
    fn what(state: &KeyState, kid: &str, now: Instant, may_fetch: bool) -> String {
        match state.plan(kid, now, &config(), may_fetch) {
            Plan::Use(..) => "use".into(),
            Plan::Fetch => "fetch".into(),
            Plan::Refuse(s) => format!("{:?}", s.code()),
        }
    }

    #[test]
    fn oidc_failed_fetches_back_off_doubling_to_the_cap() {
        let t0 = Instant::now();
        let mut state = KeyState::default();
        assert_eq!(what(&state, "a", t0, true), "fetch");
        let mut now = t0;
        let mut waits = vec![];
        for _ in 0..9 {
            state.record(
                Err(FetchError::Status {
                    url: "https://idp".into(),
                    status: http::StatusCode::SERVICE_UNAVAILABLE,
                }),
                now,
            );
            let retry_at = state.retry_at.unwrap();
            waits.push((retry_at - now).as_secs());
            // Until then every token is refused at once, saying why.
            let just_before = retry_at - Duration::from_millis(1);
            assert_eq!(what(&state, "a", just_before, true), "Unavailable");
            let Plan::Refuse(s) = state.plan("a", now, &config(), true) else {
                panic!("not refused");
            };
            assert!(s.message().contains("identity provider"), "{s:?}");
            assert!(s.message().contains("HTTP 503"), "{s:?}");
            assert_eq!(what(&state, "a", retry_at, true), "fetch");
            assert_eq!(what(&state, "a", retry_at, false), "Unavailable");
            now = retry_at;
        }
        assert_eq!(waits, [1, 2, 4, 8, 16, 32, 60, 60, 60]);
        assert_eq!(state.attempts, 9);

        // One success and the next failure starts from the bottom again.
        state.record(Ok(keys(now, &["a"])), now);
        assert_eq!(what(&state, "a", now, true), "use");
        state.record(Err(FetchError::Timeout("https://idp".into())), now);
        assert_eq!(state.retry_at, Some(now + BACKOFF_BASE));
    }

    #[test]
    fn oidc_unknown_kid_refetches_at_most_once_per_gap() {
        let t0 = Instant::now();
        let mut state = KeyState::default();
        state.record(Ok(keys(t0, &["a"])), t0);
        assert_eq!(what(&state, "a", t0, true), "use");
        let gap = config().unknown_kid_refetch;
        assert_eq!(gap, UNKNOWN_KID_REFETCH);
        let almost = t0 + gap - Duration::from_millis(1);
        assert_eq!(what(&state, "made-up", almost, true), "Unauthenticated");
        assert_eq!(what(&state, "made-up", t0 + gap, true), "fetch");
        // A token that waited for someone else's fetch does not fetch again.
        assert_eq!(what(&state, "made-up", t0 + gap, false), "Unauthenticated");
        // The issuer is down when the gap is over: unknown ids are refused
        // as Unavailable (the key may be new), known ones still verify.
        let t1 = t0 + gap;
        state.record(Err(FetchError::NoJwksUri), t1);
        assert_eq!(what(&state, "made-up", t1, true), "Unavailable");
        assert_eq!(what(&state, "a", t1, true), "use");
    }

    #[test]
    fn oidc_known_key_outlives_a_failing_issuer() {
        let t0 = Instant::now();
        let mut state = KeyState::default();
        state.record(Ok(keys(t0, &["a"])), t0);
        let stale = t0 + config().jwks_refresh;
        assert_eq!(what(&state, "a", stale, true), "fetch");
        state.record(
            Err(FetchError::Status {
                url: "https://idp".into(),
                status: http::StatusCode::INTERNAL_SERVER_ERROR,
            }),
            stale,
        );
        assert_eq!(what(&state, "a", stale, true), "use");
        assert_eq!(what(&state, "a", stale, false), "use");
        assert_eq!(
            what(&state, "a", stale + BACKOFF_BASE, true),
            "fetch",
            "retried once the back-off is over"
        );
        state.record(Ok(keys(stale, &["b"])), stale + BACKOFF_BASE);
        assert_eq!(
            what(&state, "a", stale + BACKOFF_BASE, true),
            "Unauthenticated"
        );
        assert_eq!(what(&state, "b", stale + BACKOFF_BASE, true), "use");
    }
}
