//! OpenID Connect bearer tokens: discovery and JWKS fetched from the issuer
//! and cached (refreshed on a timer and when an unknown key id shows up, so
//! key rotation needs no restart), RS256/ES256 signatures, `exp`, `nbf`,
//! `iss` and `aud` checked with a bounded clock skew.
//!
//! Identity, as OtterScale maps it: the user is the subject (or the
//! configured claim); groups are `system:authenticated` plus `oidc:<g>` for
//! every entry of the groups claim and every client role of the audience.

use std::{
    collections::HashMap,
    sync::Arc,
    time::{Duration, Instant},
};

use http_body_util::{BodyExt, Empty};
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use jsonwebtoken::{Algorithm, DecodingKey, Validation, jwk::JwkSet};
use otter_tunnel::Caller;
use tokio::sync::RwLock;
use tonic::Status;
use url::Url;

/// Largest discovery or JWKS document read.
const MAX_DOCUMENT: usize = 1024 * 1024;
/// An unknown key id triggers at most one refresh per this long.
const MIN_REFRESH_GAP: Duration = Duration::from_secs(10);

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
    /// Clock skew allowed on `exp` and `nbf`.
    pub leeway: Duration,
    /// How often the JWKS is refetched.
    pub jwks_refresh: Duration,
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
            leeway: Duration::from_secs(60),
            jwks_refresh: Duration::from_secs(600),
        }
    }
}

struct Keys {
    fetched: Instant,
    by_kid: HashMap<String, (DecodingKey, Algorithm)>,
}

type HttpsClient = Client<
    hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector>,
    Empty<bytes::Bytes>,
>;

/// Verifies bearer tokens of one issuer.
pub struct OidcVerifier {
    config: OidcConfig,
    client: HttpsClient,
    keys: RwLock<Option<Keys>>,
    last_refresh: std::sync::Mutex<Option<Instant>>,
}

impl std::fmt::Debug for OidcVerifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OidcVerifier")
            .field("issuer", &self.config.issuer.as_str())
            .finish()
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
            config,
            client,
            keys: RwLock::new(None),
            last_refresh: std::sync::Mutex::new(None),
        }))
    }

    async fn get_json(&self, url: &str) -> Result<serde_json::Value, String> {
        let uri: http::Uri = url.parse().map_err(|e| format!("{url}: {e}"))?;
        let resp = tokio::time::timeout(Duration::from_secs(10), self.client.get(uri))
            .await
            .map_err(|_| format!("{url}: timed out"))?
            .map_err(|e| format!("{url}: {e}"))?;
        if !resp.status().is_success() {
            return Err(format!("{url}: HTTP {}", resp.status()));
        }
        let body = http_body_util::Limited::new(resp.into_body(), MAX_DOCUMENT)
            .collect()
            .await
            .map_err(|e| format!("{url}: {e}"))?
            .to_bytes();
        serde_json::from_slice(&body).map_err(|e| format!("{url}: not JSON: {e}"))
    }

    /// Fetches discovery and the JWKS.
    async fn refresh(&self) -> Result<(), String> {
        let discovery_url = format!(
            "{}/.well-known/openid-configuration",
            self.config.issuer.as_str().trim_end_matches('/')
        );
        let discovery = self.get_json(&discovery_url).await?;
        let issuer = discovery["issuer"].as_str().unwrap_or_default();
        if issuer.trim_end_matches('/') != self.config.issuer.as_str().trim_end_matches('/') {
            return Err(format!(
                "discovery names issuer {issuer:?}, not {}",
                self.config.issuer
            ));
        }
        let jwks_uri = discovery["jwks_uri"]
            .as_str()
            .ok_or("discovery has no jwks_uri")?;
        let set: JwkSet = serde_json::from_value(self.get_json(jwks_uri).await?)
            .map_err(|e| format!("JWKS: {e}"))?;
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
        *self.keys.write().await = Some(Keys {
            fetched: Instant::now(),
            by_kid,
        });
        Ok(())
    }

    async fn key(&self, kid: &str) -> Result<(DecodingKey, Algorithm), Status> {
        {
            let keys = self.keys.read().await;
            if let Some(k) = keys.as_ref()
                && k.fetched.elapsed() < self.config.jwks_refresh
                && let Some(found) = k.by_kid.get(kid)
            {
                return Ok(found.clone());
            }
        }
        let may_refresh = {
            let mut last = self.last_refresh.lock().unwrap_or_else(|p| p.into_inner());
            let ok = last.is_none_or(|t| t.elapsed() >= MIN_REFRESH_GAP)
                || self.keys.try_read().map(|k| k.is_none()).unwrap_or(false);
            if ok {
                *last = Some(Instant::now());
            }
            ok
        };
        if may_refresh && let Err(e) = self.refresh().await {
            tracing::warn!(error = %e, "OIDC key refresh failed");
            return Err(Status::unavailable(format!(
                "cannot fetch the identity provider's keys: {e}"
            )));
        }
        let keys = self.keys.read().await;
        keys.as_ref()
            .and_then(|k| k.by_kid.get(kid).cloned())
            .ok_or_else(|| {
                Status::unauthenticated(format!(
                    "token signed with unknown key id {kid:?}; log in again"
                ))
            })
    }

    /// The caller a bearer token names, if the token is valid.
    pub async fn verify(&self, token: &str) -> Result<Caller, Status> {
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

    fn identity(&self, claims: &serde_json::Value) -> Result<Caller, Status> {
        let user = claims[&self.config.user_claim]
            .as_str()
            .filter(|u| !u.is_empty())
            .ok_or_else(|| {
                Status::unauthenticated(format!("token has no {} claim", self.config.user_claim))
            })?;
        let mut groups = vec!["system:authenticated".to_owned()];
        let mut add = |g: &str| {
            let g = format!("oidc:{g}");
            if !groups.contains(&g) {
                groups.push(g);
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
        Ok(Caller {
            user: user.to_owned(),
            groups,
            ..Default::default()
        })
    }
}
