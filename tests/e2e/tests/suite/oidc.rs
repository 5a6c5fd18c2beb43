//! OpenID Connect bearer tokens end to end: an identity provider on loopback
//! (HTTPS with its own test CA, discovery and a JWKS with an EC P-256 and an
//! RSA key), tokens signed by `jsonwebtoken`, and calls through the hub to a
//! test-double agent that answers with the identity it was given; and
//! what a flood of tokens with made-up key ids costs the issuer while it is
//! slow or down.

use std::{
    convert::Infallible,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use base64::{Engine, engine::general_purpose::URL_SAFE_NO_PAD as B64};
use bytes::Bytes;
use http_body_util::Full;
use hyper_util::rt::TokioIo;
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use otter_e2e::{
    TestHub,
    double::{self, TestAgent, field, start_agent, wait_connected},
    with_token,
};
use otter_hub::oidc::OidcConfig;
use otter_proto::resource::v1::resource_service_client::ResourceServiceClient;
use otter_tunnel::TransportKind;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, PKCS_ECDSA_P256_SHA256,
};
use serde_json::{Value, json};
use tokio::{net::TcpListener, task::JoinSet};

const AUDIENCE: &str = "otter";
/// A fixed RSA key pair for these tests only (see `fixtures/README.md`).
const RSA_KEY_PEM: &str = include_str!("../../fixtures/oidc-test-rsa-key.pem");
const RSA_PUBLIC_JWK: &str = include_str!("../../fixtures/oidc-test-rsa-public.jwk.json");

/// A signing key of the test issuer, with its JWK.
struct SigningKey {
    kid: String,
    alg: Algorithm,
    key: EncodingKey,
    jwk: Value,
}

fn ec_key(kid: &str) -> SigningKey {
    let pair = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).unwrap();
    // Uncompressed point: 0x04 || x || y.
    let raw = pair.public_key_raw();
    assert_eq!((raw.len(), raw[0]), (65, 4));
    SigningKey {
        kid: kid.into(),
        alg: Algorithm::ES256,
        key: EncodingKey::from_ec_pem(pair.serialize_pem().as_bytes()).unwrap(),
        jwk: json!({
            "kty": "EC", "crv": "P-256", "use": "sig", "alg": "ES256", "kid": kid,
            "x": B64.encode(&raw[1..33]), "y": B64.encode(&raw[33..]),
        }),
    }
}

fn rsa_key(kid: &str) -> SigningKey {
    let mut jwk: Value = serde_json::from_str(RSA_PUBLIC_JWK).unwrap();
    jwk["kid"] = json!(kid);
    jwk["alg"] = json!("RS256");
    jwk["use"] = json!("sig");
    SigningKey {
        kid: kid.into(),
        alg: Algorithm::RS256,
        key: EncodingKey::from_rsa_pem(RSA_KEY_PEM.as_bytes()).unwrap(),
        jwk,
    }
}

fn now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

/// An identity provider on loopback: discovery and a JWKS over HTTPS,
/// counting the requests for each, and able to answer slowly or not at all.
struct TestIssuer {
    url: String,
    ca_pem: String,
    jwks: Arc<Mutex<Value>>,
    jwks_fetches: Arc<AtomicUsize>,
    /// Every fetch of the hub starts with discovery, so this counts
    /// attempts, the failed ones too.
    discovery_fetches: Arc<AtomicUsize>,
    /// How long each answer waits.
    delay: Arc<Mutex<Duration>>,
    /// Answers 503 to everything while set.
    down: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for TestIssuer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl TestIssuer {
    async fn start(keys: &[&SigningKey]) -> TestIssuer {
        otter_pki::tls::install_default_provider();
        let ca_key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).unwrap();
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "test identity provider CA");
        let ca_cert = ca_params.self_signed(&ca_key).unwrap();
        let issuer = Issuer::new(ca_params, ca_key);
        let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).unwrap();
        let cert = CertificateParams::new(vec!["localhost".to_owned()])
            .unwrap()
            .signed_by(&key, &issuer)
            .unwrap();
        let tls = rustls::ServerConfig::builder_with_provider(otter_pki::tls::provider())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(
                vec![cert.der().clone()],
                rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
            )
            .unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(tls));

        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!(
            "https://localhost:{}",
            listener.local_addr().unwrap().port()
        );
        let jwks = Arc::new(Mutex::new(Value::Null));
        let jwks_fetches = Arc::new(AtomicUsize::new(0));
        let discovery_fetches = Arc::new(AtomicUsize::new(0));
        let delay = Arc::new(Mutex::new(Duration::ZERO));
        let down = Arc::new(AtomicBool::new(false));
        let served = (
            url.clone(),
            jwks.clone(),
            jwks_fetches.clone(),
            discovery_fetches.clone(),
            delay.clone(),
            down.clone(),
        );
        let task = tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let (acceptor, served) = (acceptor.clone(), served.clone());
                tokio::spawn(async move {
                    let Ok(tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let service = hyper::service::service_fn(move |req: http::Request<_>| {
                        let (base, set, fetches, discoveries, delay, down) = &served;
                        let body = match req.uri().path() {
                            "/.well-known/openid-configuration" => {
                                discoveries.fetch_add(1, Ordering::SeqCst);
                                Some(json!({
                                    "issuer": base,
                                    "jwks_uri": format!("{base}/keys"),
                                    "id_token_signing_alg_values_supported": ["RS256", "ES256"],
                                }))
                            }
                            "/keys" => {
                                fetches.fetch_add(1, Ordering::SeqCst);
                                Some(set.lock().unwrap().clone())
                            }
                            _ => None,
                        };
                        let resp = match body {
                            _ if down.load(Ordering::SeqCst) => http::Response::builder()
                                .status(503)
                                .body(Full::new(Bytes::new())),
                            Some(v) => http::Response::builder()
                                .header("content-type", "application/json")
                                .body(Full::new(Bytes::from(v.to_string()))),
                            None => http::Response::builder()
                                .status(404)
                                .body(Full::new(Bytes::new())),
                        };
                        let delay = *delay.lock().unwrap();
                        async move {
                            tokio::time::sleep(delay).await;
                            Ok::<_, Infallible>(resp.unwrap())
                        }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(tls), service)
                        .await;
                });
            }
        });
        let issuer = TestIssuer {
            url,
            ca_pem: ca_cert.pem(),
            jwks,
            jwks_fetches,
            discovery_fetches,
            delay,
            down,
            task,
        };
        issuer.serve_keys(keys);
        issuer
    }

    /// Key set and discovery requests so far.
    fn fetches(&self) -> (usize, usize) {
        (
            self.jwks_fetches.load(Ordering::SeqCst),
            self.discovery_fetches.load(Ordering::SeqCst),
        )
    }

    /// Replaces the published key set.
    fn serve_keys(&self, keys: &[&SigningKey]) {
        *self.jwks.lock().unwrap() =
            json!({ "keys": keys.iter().map(|k| k.jwk.clone()).collect::<Vec<_>>() });
    }

    fn claims(&self, sub: &str) -> Value {
        let t = now();
        json!({
            "iss": self.url, "aud": AUDIENCE, "sub": sub,
            "iat": t, "nbf": t - 5, "exp": t + 300,
            // A member of tenant `default`, by the documented mapping.
            "groups": ["devs", "otterscale:tenant:default:member"],
            "resource_access": { AUDIENCE: { "roles": ["viewer"] }, "other-client": { "roles": ["owner"] } },
        })
    }
}

fn sign(key: &SigningKey, claims: &Value) -> String {
    let mut header = Header::new(key.alg);
    header.kid = Some(key.kid.clone());
    jsonwebtoken::encode(&header, claims, &key.key).unwrap()
}

async fn hub_trusting(issuer: &TestIssuer) -> (TestHub, TestAgent) {
    hub_trusting_with(issuer, |_| {}).await
}

async fn hub_trusting_with(
    issuer: &TestIssuer,
    tweak: impl FnOnce(&mut OidcConfig),
) -> (TestHub, TestAgent) {
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let (url, ca) = (issuer.url.clone(), issuer.ca_pem.clone());
    let hub = TestHub::start_with(dir, None, move |c| {
        let mut oidc = OidcConfig::new(url.parse().unwrap(), AUDIENCE);
        oidc.ca_pem = Some(ca);
        tweak(&mut oidc);
        c.oidc = Some(oidc);
    })
    .await;
    let join = hub.hub.mint_join_token("edge-1").unwrap();
    let agent = start_agent(&hub, "edge-1", "a1", &join, TransportKind::H2);
    wait_connected(&hub.channel().await, &hub.admin_token, 1).await;
    (hub, agent)
}

/// A Get through the hub with `token`: the identity the agent saw (user,
/// groups), or the status.
async fn identity_seen(hub: &TestHub, token: &str) -> Result<(String, String), tonic::Status> {
    let mut client = ResourceServiceClient::new(hub.channel().await);
    let resp = tokio::time::timeout(
        double::WAIT,
        client.get(with_token(double::get("edge-1", "web"), token)),
    )
    .await
    .expect("call bounded")?
    .into_inner();
    Ok((field(&resp, "user"), field(&resp, "groups")))
}

/// `n` concurrent Gets through the hub, each with a token of its own
/// made-up key id: the codes they got, in no particular order.
async fn burst_of_unknown_kids(hub: &TestHub, issuer: &TestIssuer, n: usize) -> Vec<tonic::Code> {
    let client = ResourceServiceClient::new(hub.channel().await);
    let signer = ec_key("unused");
    let run = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let mut calls = JoinSet::new();
    for i in 0..n {
        let mut header = Header::new(Algorithm::ES256);
        header.kid = Some(format!("made-up-{run:x}-{i}"));
        let token = jsonwebtoken::encode(&header, &issuer.claims("mallory"), &signer.key).unwrap();
        let mut client = client.clone();
        calls.spawn(async move {
            let call = client.get(with_token(double::get("edge-1", "web"), &token));
            match tokio::time::timeout(double::WAIT, call).await {
                Ok(Ok(_)) => panic!("a token of a made-up key id was accepted"),
                Ok(Err(s)) => s.code(),
                Err(_) => panic!("a call with a made-up key id hung"),
            }
        });
    }
    calls.join_all().await
}

async fn rejected(hub: &TestHub, token: &str, case: &str) -> String {
    match identity_seen(hub, token).await {
        Ok(seen) => panic!("{case}: accepted as {seen:?}"),
        Err(s) => {
            assert_eq!(s.code(), tonic::Code::Unauthenticated, "{case}: {s:?}");
            s.message().to_owned()
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oidc_tokens_es256_rs256_and_rejections() {
    let (ec, rsa) = (ec_key("ec-1"), rsa_key("rsa-1"));
    let issuer = TestIssuer::start(&[&ec, &rsa]).await;
    let (hub, agent) = hub_trusting(&issuer).await;
    let groups = "system:authenticated,otter:default:oidc:devs,otter:default:oidc:viewer,otter:default:members";

    for (key, sub) in [(&ec, "alice"), (&rsa, "bob")] {
        let seen = identity_seen(&hub, &sign(key, &issuer.claims(sub)))
            .await
            .unwrap_or_else(|s| panic!("{:?} token refused: {s:?}", key.alg));
        assert_eq!(
            seen,
            (format!("oidc:{sub}"), groups.to_owned()),
            "{:?}",
            key.alg
        );
    }
    // Membership comes from the groups claim: none, and the cluster is as
    // absent; `…:admin`, and the tenant's admins group is sent; a value
    // naming a Kubernetes group reaches the cluster only namespaced.
    let mut outsider = issuer.claims("dora");
    outsider["groups"] = json!(["devs", "system:masters"]);
    let refused = identity_seen(&hub, &sign(&ec, &outsider))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::NotFound, "{refused:?}");
    let mut admin = issuer.claims("erin");
    admin["groups"] = json!(["system:masters", "otterscale:tenant:default:admin"]);
    let seen = identity_seen(&hub, &sign(&ec, &admin)).await.unwrap();
    assert_eq!(
        seen,
        (
            "oidc:erin".to_owned(),
            "system:authenticated,otter:default:oidc:system:masters,otter:default:oidc:viewer,otter:default:members,otter:default:admins"
                .to_owned()
        )
    );

    let mut expired = issuer.claims("alice");
    expired["exp"] = json!(now() - 3600);
    expired["iat"] = json!(now() - 7200);
    expired["nbf"] = json!(now() - 7200);
    let msg = rejected(&hub, &sign(&ec, &expired), "expired").await;
    assert!(msg.contains("xpired"), "{msg}");

    let mut other_aud = issuer.claims("alice");
    other_aud["aud"] = json!("someone-else");
    let msg = rejected(&hub, &sign(&rsa, &other_aud), "wrong audience").await;
    assert!(msg.to_lowercase().contains("audience"), "{msg}");

    let mut other_iss = issuer.claims("alice");
    other_iss["iss"] = json!("https://issuer.invalid");
    let msg = rejected(&hub, &sign(&ec, &other_iss), "wrong issuer").await;
    assert!(msg.to_lowercase().contains("issuer"), "{msg}");

    let stranger = ec_key("not-published");
    let msg = rejected(
        &hub,
        &sign(&stranger, &issuer.claims("mallory")),
        "unknown key id",
    )
    .await;
    assert!(msg.contains("not-published"), "{msg}");

    // Tampered: another subject in the payload, the signature of the original.
    for key in [&ec, &rsa] {
        let token = sign(key, &issuer.claims("alice"));
        let parts: Vec<&str> = token.split('.').collect();
        let mut payload: Value = serde_json::from_slice(&B64.decode(parts[1]).unwrap()).unwrap();
        payload["sub"] = json!("admin");
        let forged = format!(
            "{}.{}.{}",
            parts[0],
            B64.encode(payload.to_string()),
            parts[2]
        );
        let msg = rejected(&hub, &forged, "tampered").await;
        assert!(msg.to_lowercase().contains("signature"), "{msg}");
    }

    // A token of one algorithm presented with the other key's id.
    let mut header = Header::new(Algorithm::ES256);
    header.kid = Some("rsa-1".into());
    let mixed = jsonwebtoken::encode(&header, &issuer.claims("alice"), &ec.key).unwrap();
    rejected(&hub, &mixed, "algorithm of another key").await;

    drop(agent);
    hub.hub.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oidc_key_rotation_needs_no_restart() {
    let (old, new) = (ec_key("2026-old"), ec_key("2026-new"));
    let issuer = TestIssuer::start(&[&old]).await;
    // A short gap between refetches for an unknown key id, so the test need
    // not wait out the default.
    let (hub, agent) =
        hub_trusting_with(&issuer, |c| c.unknown_kid_refetch = Duration::from_secs(2)).await;
    let groups = "system:authenticated,otter:default:oidc:devs,otter:default:oidc:viewer,otter:default:members".to_owned();

    let seen = identity_seen(&hub, &sign(&old, &issuer.claims("alice")))
        .await
        .unwrap();
    assert_eq!(seen, ("oidc:alice".to_owned(), groups.clone()));
    let fetched = issuer.jwks_fetches.load(Ordering::SeqCst);
    assert_eq!(fetched, 1, "the first token fetches the key set once");

    // The issuer rotates: only the new key is published now. The hub
    // refetches when it sees the new key id (at most once per gap), so a
    // client retrying gets through soon after.
    issuer.serve_keys(&[&new]);
    let token = sign(&new, &issuer.claims("carol"));
    let started = tokio::time::Instant::now();
    let seen = loop {
        match identity_seen(&hub, &token).await {
            Ok(seen) => break seen,
            Err(s) => {
                assert_eq!(s.code(), tonic::Code::Unauthenticated, "{s:?}");
                assert!(
                    started.elapsed() < Duration::from_secs(25),
                    "the new key was not picked up: {s:?}"
                );
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    };
    assert_eq!(seen, ("oidc:carol".to_owned(), groups));
    assert!(issuer.jwks_fetches.load(Ordering::SeqCst) > fetched);

    // The retired key is gone with the refresh.
    rejected(
        &hub,
        &sign(&old, &issuer.claims("alice")),
        "token of the retired key",
    )
    .await;
    drop(agent);
    hub.hub.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oidc_unknown_kid_burst_on_a_slow_issuer_fetches_once() {
    let key = ec_key("real");
    let issuer = TestIssuer::start(&[&key]).await;
    let (hub, agent) = hub_trusting(&issuer).await;
    // Cold cache, and the issuer takes seconds to answer: the whole burst
    // arrives before its first answer, so every call needs the key set.
    *issuer.delay.lock().unwrap() = Duration::from_secs(3);
    let codes = burst_of_unknown_kids(&hub, &issuer, 200).await;
    let (jwks, discovery) = issuer.fetches();
    eprintln!("slow issuer, burst of 200: {jwks} JWKS and {discovery} discovery fetches");
    assert!(
        jwks <= 3 && discovery <= 3,
        "{jwks} JWKS, {discovery} discovery fetches"
    );
    assert!(
        codes
            .iter()
            .all(|c| matches!(c, tonic::Code::Unauthenticated | tonic::Code::Unavailable)),
        "{codes:?}"
    );

    // Keys are cached now: a second burst costs the issuer nothing (the next
    // refetch for an unknown key id is half a minute away), and a real
    // token still works.
    *issuer.delay.lock().unwrap() = Duration::ZERO;
    let codes = burst_of_unknown_kids(&hub, &issuer, 200).await;
    assert!(
        codes.iter().all(|c| *c == tonic::Code::Unauthenticated),
        "{codes:?}"
    );
    let seen = identity_seen(&hub, &sign(&key, &issuer.claims("alice")))
        .await
        .unwrap();
    assert_eq!(seen.0, "oidc:alice");
    let (jwks_after, discovery_after) = issuer.fetches();
    eprintln!("after a warm burst and a real token: {jwks_after} JWKS fetches");
    assert!(
        jwks_after <= 3 && discovery_after <= 3,
        "{jwks_after} JWKS fetches"
    );
    drop(agent);
    hub.hub.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oidc_burst_while_the_issuer_is_down_is_backed_off() {
    let key = ec_key("real");
    let issuer = TestIssuer::start(&[&key]).await;
    issuer.down.store(true, Ordering::SeqCst);
    let (hub, agent) = hub_trusting(&issuer).await;
    let codes = burst_of_unknown_kids(&hub, &issuer, 200).await;
    let (_, attempts) = issuer.fetches();
    eprintln!("issuer down, burst of 200: {attempts} fetch attempts");
    // Every call ends within WAIT (20 s) of the burst; retries 1, 2, 4, 8 s
    // apart fit at most 5 attempts in that.
    assert!((1..=5).contains(&attempts), "{attempts} fetch attempts");
    assert!(
        codes.iter().all(|c| *c == tonic::Code::Unavailable),
        "{codes:?}"
    );
    match identity_seen(&hub, &sign(&key, &issuer.claims("alice"))).await {
        Err(s) => {
            assert_eq!(s.code(), tonic::Code::Unavailable, "{s:?}");
            assert!(s.message().contains("identity provider"), "{s:?}");
        }
        Ok(seen) => panic!("accepted as {seen:?} with no keys"),
    }

    // The issuer comes back: a real token gets through once the current
    // back-off ends (well under its 60 s cap here).
    issuer.down.store(false, Ordering::SeqCst);
    let token = sign(&key, &issuer.claims("alice"));
    let started = tokio::time::Instant::now();
    let seen = loop {
        match identity_seen(&hub, &token).await {
            Ok(seen) => break seen,
            Err(s) => {
                assert_eq!(s.code(), tonic::Code::Unavailable, "{s:?}");
                assert!(
                    started.elapsed() < Duration::from_secs(90),
                    "never recovered: {s:?}"
                );
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        }
    };
    assert_eq!(seen.0, "oidc:alice");
    let (_, total) = issuer.fetches();
    eprintln!("after recovery: {total} fetch attempts in all");
    // One attempt that succeeds, and perhaps one more for the lone token
    // above if its back-off had just ended.
    assert!(total <= attempts + 2, "{total} attempts in all");
    drop(agent);
    hub.hub.shutdown().await;
}
