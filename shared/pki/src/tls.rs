//! rustls configurations for the hub's listeners and the agent's dials.
//!
//! One crypto provider (ring) everywhere: with two compiled in, rustls
//! cannot pick a process default and libraries that call
//! `ClientConfig::builder()` panic.

use std::sync::Arc;

use rustls::{
    ClientConfig, RootCertStore, ServerConfig,
    crypto::CryptoProvider,
    pki_types::{CertificateDer, PrivateKeyDer},
    server::WebPkiClientVerifier,
};

use crate::{PkiError, Result};

/// The provider every config here is built with.
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Installs ring as the process-wide default provider. Binaries call this
/// once at start-up; a second call is harmless.
pub fn install_default_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// Every certificate in a PEM string.
pub fn parse_certs(pem: &str) -> Result<Vec<CertificateDer<'static>>> {
    rustls_pemfile::certs(&mut pem.as_bytes())
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| PkiError::Encoding(format!("certificate PEM: {e}")))
}

/// The first private key in a PEM string.
pub fn parse_key(pem: &str) -> Result<PrivateKeyDer<'static>> {
    rustls_pemfile::private_key(&mut pem.as_bytes())
        .map_err(|e| PkiError::Encoding(format!("key PEM: {e}")))?
        .ok_or_else(|| PkiError::Encoding("no private key in PEM".into()))
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
    let mut config = builder.with_single_cert(parse_certs(cert_pem)?, parse_key(key_pem)?)?;
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
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots(ca_pem)?);
    let mut config = match client {
        Some((cert, key)) => builder.with_client_auth_cert(parse_certs(cert)?, parse_key(key)?)?,
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(config)
}
