//! rustls configurations for the hub's listeners and the agent's dials.
//!
//! One crypto provider (ring) everywhere: with two compiled in, rustls
//! cannot pick a process default and libraries that call
//! `ClientConfig::builder()` panic.

use std::sync::Arc;

use rustls::{
    ClientConfig, RootCertStore, ServerConfig,
    crypto::CryptoProvider,
    pki_types::{
        CertificateDer, PrivateKeyDer,
        pem::{self, PemObject},
    },
    server::WebPkiClientVerifier,
};

use crate::{PkiError, Result};

/// The provider every config here is built with.
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(ring_provider())
}

/// Installs ring as the process-wide default provider. Binaries call this
/// once at start-up; a second call is harmless.
pub fn install_default_provider() {
    let _ = ring_provider().install_default();
}

/// ring with AES-128-GCM ahead of AES-256-GCM in each TLS version.
///
/// rustls lists AES-256-GCM with SHA-384 first, and a TLS 1.3 server
/// (ours included) takes the client's first choice, so every hop between
/// hub and agent used it. On the CPUs a hub runs on, SHA-256 has
/// instructions of its own (SHA-NI, which ring uses) and SHA-384 none:
/// each handshake's transcript and key schedule costs more with it, and
/// AES-256 takes 14 rounds per block to AES-128's 10 for every byte of a
/// tunnel. AES-128-GCM is TLS 1.3's mandatory suite, the one QUIC's first
/// packets always use, and what Go (kubectl) and browsers choose first;
/// both suites stay offered, so no peer loses anything.
fn ring_provider() -> CryptoProvider {
    let mut provider = rustls::crypto::ring::default_provider();
    provider.cipher_suites.sort_by_key(|suite| {
        let aes_128 = matches!(
            suite.suite(),
            rustls::CipherSuite::TLS13_AES_128_GCM_SHA256
                | rustls::CipherSuite::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256
                | rustls::CipherSuite::TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256
        );
        (suite.tls13().is_none(), !aes_128)
    });
    provider
}

/// Every certificate in a PEM string; none is not an error here, since
/// some callers accept an empty bundle. Sections of other kinds are skipped.
pub fn parse_certs(pem: &str) -> Result<Vec<CertificateDer<'static>>> {
    CertificateDer::pem_slice_iter(pem.as_bytes())
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| PkiError::Encoding(format!("certificate PEM: {e}")))
}

/// The first private key (PKCS#8, PKCS#1 or SEC1) in a PEM string.
pub fn parse_key(pem: &str) -> Result<PrivateKeyDer<'static>> {
    PrivateKeyDer::from_pem_slice(pem.as_bytes()).map_err(|e| match e {
        pem::Error::NoItemsFound => PkiError::Encoding("no private key in PEM".into()),
        e => PkiError::Encoding(format!("key PEM: {e}")),
    })
}

/// A certificate chain to present: an empty one would only fail later
/// inside rustls with a less helpful message.
fn chain(pem: &str) -> Result<Vec<CertificateDer<'static>>> {
    let certs = parse_certs(pem)?;
    if certs.is_empty() {
        return Err(PkiError::Encoding("no certificate in PEM".into()));
    }
    Ok(certs)
}

fn roots(ca_pem: &str) -> Result<RootCertStore> {
    let mut roots = RootCertStore::empty();
    for cert in parse_certs(ca_pem)? {
        roots.add(cert)?;
    }
    if roots.is_empty() {
        return Err(PkiError::Encoding("no CA certificate in PEM".into()));
    }
    Ok(roots)
}

/// Whether a listener asks for client certificates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientAuth {
    /// Users with bearer tokens: no client certificate.
    None,
    /// The API port: agents renewing present their certificate, everyone
    /// else comes without one.
    Optional,
    /// The tunnel port: only agents with a certificate from our CA.
    Required,
}

/// A client config for public servers (an OIDC issuer, a hub behind a
/// public certificate, an `https://` proxy): the web PKI roots, plus
/// `extra_ca_pem` when given (a private CA).
pub fn public_client_config(extra_ca_pem: Option<&str>, alpn: &[&[u8]]) -> Result<ClientConfig> {
    let mut roots = RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    if let Some(pem) = extra_ca_pem {
        let certs = parse_certs(pem)?;
        if certs.is_empty() {
            return Err(PkiError::Encoding("no CA certificate in PEM".into()));
        }
        for cert in certs {
            roots.add(cert)?;
        }
    }
    let mut config = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(config)
}

/// A server config presenting `cert_pem`/`key_pem`, verifying client
/// certificates against `ca_pem` as `auth` says.
pub fn server_config(
    cert_pem: &str,
    key_pem: &str,
    ca_pem: &str,
    auth: ClientAuth,
    alpn: &[&[u8]],
) -> Result<ServerConfig> {
    let builder =
        ServerConfig::builder_with_provider(provider()).with_safe_default_protocol_versions()?;
    let builder = match auth {
        ClientAuth::None => builder.with_no_client_auth(),
        ClientAuth::Optional | ClientAuth::Required => {
            let verifier =
                WebPkiClientVerifier::builder_with_provider(Arc::new(roots(ca_pem)?), provider());
            let verifier = if auth == ClientAuth::Optional {
                verifier.allow_unauthenticated().build()?
            } else {
                verifier.build()?
            };
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config = builder.with_single_cert(chain(cert_pem)?, parse_key(key_pem)?)?;
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(config)
}

/// A client config trusting only `ca_pem`, presenting `client` (certificate
/// PEM, key PEM) when given.
pub fn client_config(
    ca_pem: &str,
    client: Option<(&str, &str)>,
    alpn: &[&[u8]],
) -> Result<ClientConfig> {
    client_config_with(roots(ca_pem)?, client, alpn)
}

/// Trust for a hub's API whose certificate may come from elsewhere than
/// the hub CA: the hub CA bundle `ca_pem`, the CAs of `also_pem`, and,
/// with `public`, the public roots (as a browser would trust it).
pub fn api_client_config(
    ca_pem: &str,
    also_pem: Option<&str>,
    public: bool,
    client: Option<(&str, &str)>,
    alpn: &[&[u8]],
) -> Result<ClientConfig> {
    let mut roots = roots(ca_pem)?;
    if let Some(pem) = also_pem {
        for cert in parse_certs(pem)? {
            roots.add(cert)?;
        }
    }
    if public {
        roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    }
    client_config_with(roots, client, alpn)
}

fn client_config_with(
    roots: RootCertStore,
    client: Option<(&str, &str)>,
    alpn: &[&[u8]],
) -> Result<ClientConfig> {
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots);
    let mut config = match client {
        Some((cert, key)) => builder.with_client_auth_cert(chain(cert)?, parse_key(key)?)?,
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CertificateAuthority;

    fn message(e: PkiError) -> String {
        e.to_string()
    }

    #[test]
    fn parses_a_certificate_and_its_key() {
        let ca = CertificateAuthority::generate("test CA").unwrap();
        assert_eq!(parse_certs(ca.cert_pem()).unwrap().len(), 1);
        assert!(matches!(
            parse_key(ca.key_pem()).unwrap(),
            PrivateKeyDer::Pkcs8(_)
        ));
    }

    #[test]
    fn a_bundle_of_certificates_and_a_key_yields_every_certificate() {
        let ca = CertificateAuthority::generate("test CA").unwrap();
        let bundle = format!("{}{}{}", ca.cert_pem(), ca.key_pem(), ca.cert_pem());
        assert_eq!(parse_certs(&bundle).unwrap().len(), 2);
        assert!(parse_key(&bundle).is_ok());
    }

    #[test]
    fn no_certificate_is_empty_but_refused_as_a_chain() {
        let ca = CertificateAuthority::generate("test CA").unwrap();
        assert!(parse_certs(ca.key_pem()).unwrap().is_empty());
        assert!(parse_certs("").unwrap().is_empty());
        let err = message(chain(ca.key_pem()).unwrap_err());
        assert!(err.contains("no certificate in PEM"), "{err}");
        let err = message(
            client_config(ca.cert_pem(), Some((ca.key_pem(), ca.key_pem())), &[]).unwrap_err(),
        );
        assert!(err.contains("no certificate in PEM"), "{err}");
    }

    #[test]
    fn no_private_key_says_so() {
        let ca = CertificateAuthority::generate("test CA").unwrap();
        for pem in [ca.cert_pem(), "", "not PEM at all"] {
            let err = message(parse_key(pem).unwrap_err());
            assert!(err.contains("no private key in PEM"), "{err}");
        }
    }

    #[test]
    fn broken_pem_is_an_error_naming_what_was_parsed() {
        let broken = "-----BEGIN CERTIFICATE-----\n!!!not base64!!!\n-----END CERTIFICATE-----\n";
        let err = message(parse_certs(broken).unwrap_err());
        assert!(err.contains("certificate PEM"), "{err}");
        let unterminated = "-----BEGIN PRIVATE KEY-----\nAAAA\n";
        let err = message(parse_key(unterminated).unwrap_err());
        assert!(err.contains("key PEM"), "{err}");
    }

    #[test]
    fn an_empty_ca_bundle_is_refused() {
        let err = message(client_config("", None, &[]).unwrap_err());
        assert!(err.contains("no CA certificate in PEM"), "{err}");
    }

    /// Runs a handshake in memory; the suite both ends settled on.
    fn negotiate(client: ClientConfig, server: ServerConfig) -> rustls::CipherSuite {
        let name = "hub.test".try_into().unwrap();
        let mut client = rustls::ClientConnection::new(Arc::new(client), name).unwrap();
        let mut server = rustls::ServerConnection::new(Arc::new(server)).unwrap();
        while client.is_handshaking() || server.is_handshaking() {
            let mut bytes = Vec::new();
            while client.wants_write() {
                client.write_tls(&mut bytes).unwrap();
            }
            server.read_tls(&mut bytes.as_slice()).unwrap();
            server.process_new_packets().unwrap();
            bytes.clear();
            while server.wants_write() {
                server.write_tls(&mut bytes).unwrap();
            }
            client.read_tls(&mut bytes.as_slice()).unwrap();
            client.process_new_packets().unwrap();
        }
        let suite = client.negotiated_cipher_suite().unwrap().suite();
        assert_eq!(
            Some(suite),
            server.negotiated_cipher_suite().map(|s| s.suite())
        );
        suite
    }

    #[test]
    fn hub_and_agent_settle_on_aes_128_and_still_accept_aes_256() {
        let ca = CertificateAuthority::generate("test CA").unwrap();
        let (cert, key) = ca.issue_server_cert(&["hub.test".into()]).unwrap();
        let server = || server_config(&cert, &key, ca.cert_pem(), ClientAuth::None, &[]).unwrap();
        let ours = client_config(ca.cert_pem(), None, &[]).unwrap();
        assert_eq!(
            negotiate(ours, server()),
            rustls::CipherSuite::TLS13_AES_128_GCM_SHA256
        );
        let client = |provider: Arc<CryptoProvider>,
                      version: &'static rustls::SupportedProtocolVersion| {
            ClientConfig::builder_with_provider(provider)
                .with_protocol_versions(&[version])
                .unwrap()
                .with_root_certificates(roots(ca.cert_pem()).unwrap())
                .with_no_client_auth()
        };
        // A client that asks for AES-256 first (rustls' own order, OpenSSL's)
        // gets it: the server follows the client's choice.
        let theirs = Arc::new(rustls::crypto::ring::default_provider());
        assert_eq!(
            negotiate(client(theirs, &rustls::version::TLS13), server()),
            rustls::CipherSuite::TLS13_AES_256_GCM_SHA384
        );
        // TLS 1.2 peers, too, get AES-128 first.
        assert_eq!(
            negotiate(client(provider(), &rustls::version::TLS12), server()),
            rustls::CipherSuite::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256
        );
    }
}
