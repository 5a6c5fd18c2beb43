//! OpenID Connect bearer tokens end to end: an identity provider on loopback
//! (HTTPS with its own test CA, discovery and a JWKS with an EC P-256 and an
//! RSA key), tokens signed by `jsonwebtoken`, and calls through the hub to a
//! test-double agent that answers with the identity it was given.

use std::{
    convert::Infallible,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
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
use tokio::net::TcpListener;

const AUDIENCE: &str = "otter";
/// A fixed RSA key pair for these tests only (see `fixtures/README.md`).
const RSA_KEY_PEM: &str = include_str!("../fixtures/oidc-test-rsa-key.pem");
const RSA_PUBLIC_JWK: &str = include_str!("../fixtures/oidc-test-rsa-public.jwk.json");

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

/// An identity provider on loopback: discovery and a JWKS over HTTPS.
struct TestIssuer {
    url: String,
    ca_pem: String,
    jwks: Arc<Mutex<Value>>,
    jwks_fetches: Arc<AtomicUsize>,
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
        let (base, set, fetches) = (url.clone(), jwks.clone(), jwks_fetches.clone());
        let task = tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let (acceptor, base, set, fetches) =
                    (acceptor.clone(), base.clone(), set.clone(), fetches.clone());
                tokio::spawn(async move {
                    let Ok(tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let service = hyper::service::service_fn(move |req: http::Request<_>| {
                        let body = match req.uri().path() {
                            "/.well-known/openid-configuration" => Some(json!({
                                "issuer": base,
                                "jwks_uri": format!("{base}/keys"),
                                "id_token_signing_alg_values_supported": ["RS256", "ES256"],
                            })),
                            "/keys" => {
                                fetches.fetch_add(1, Ordering::SeqCst);
                                Some(set.lock().unwrap().clone())
                            }
                            _ => None,
                        };
                        let resp = match body {
                            Some(v) => http::Response::builder()
                                .header("content-type", "application/json")
                                .body(Full::new(Bytes::from(v.to_string()))),
                            None => http::Response::builder()
                                .status(404)
                                .body(Full::new(Bytes::new())),
                        };
                        async move { Ok::<_, Infallible>(resp.unwrap()) }
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
            task,
        };
        issuer.serve_keys(keys);
        issuer
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
            "groups": ["devs"],
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
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let (url, ca) = (issuer.url.clone(), issuer.ca_pem.clone());
    let hub = TestHub::start_with(dir, None, move |c| {
        let mut oidc = OidcConfig::new(url.parse().unwrap(), AUDIENCE);
        oidc.ca_pem = Some(ca);
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
    let groups = "system:authenticated,oidc:devs,oidc:viewer";

    for (key, sub) in [(&ec, "alice"), (&rsa, "bob")] {
        let seen = identity_seen(&hub, &sign(key, &issuer.claims(sub)))
            .await
            .unwrap_or_else(|s| panic!("{:?} token refused: {s:?}", key.alg));
        assert_eq!(seen, (sub.to_owned(), groups.to_owned()), "{:?}", key.alg);
    }

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
    let (hub, agent) = hub_trusting(&issuer).await;
    let groups = "system:authenticated,oidc:devs,oidc:viewer".to_owned();

    let seen = identity_seen(&hub, &sign(&old, &issuer.claims("alice")))
        .await
        .unwrap();
    assert_eq!(seen, ("alice".to_owned(), groups.clone()));
    let fetched = issuer.jwks_fetches.load(Ordering::SeqCst);
    assert_eq!(fetched, 1, "the first token fetches the key set once");

    // The issuer rotates: only the new key is published now. The hub
    // refetches when it sees the new key id (at most once per 10 s), so a
    // client retrying gets through within that.
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
    assert_eq!(seen, ("carol".to_owned(), groups));
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
