//! Server TLS the hub can change while serving: the certificate it presents
//! and the CAs client certificates must chain to. A CA rotation swaps both
//! without closing a listener or a tunnel; handshakes after the swap see
//! the new material, connections already up keep theirs.

use std::sync::{Arc, RwLock};

use rustls::{
    DigitallySignedStruct, DistinguishedName, ServerConfig, SignatureScheme,
    client::danger::HandshakeSignatureValid,
    pki_types::{CertificateDer, UnixTime},
    server::{
        ClientHello, ResolvesServerCert, WebPkiClientVerifier,
        danger::{ClientCertVerified, ClientCertVerifier},
    },
    sign::CertifiedKey,
};

use crate::{
    PkiError, Result,
    tls::{ClientAuth, parse_certs, parse_key, provider},
};

struct Material {
    cert: Arc<CertifiedKey>,
    required: Arc<dyn ClientCertVerifier>,
    optional: Arc<dyn ClientCertVerifier>,
}

/// The swappable part of the hub's server TLS.
pub struct LiveTls {
    current: RwLock<Arc<Material>>,
}

impl std::fmt::Debug for LiveTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LiveTls")
    }
}

fn material(cert_pem: &str, key_pem: &str, trusted_pem: &str) -> Result<Material> {
    let provider = provider();
    let key = provider
        .key_provider
        .load_private_key(parse_key(key_pem)?)
        .map_err(|e| PkiError::Encoding(format!("server key: {e}")))?;
    let chain = parse_certs(cert_pem)?;
    if chain.is_empty() {
        return Err(PkiError::Encoding("no server certificate in PEM".into()));
    }
    let cert = CertifiedKey::new(chain, key);
    cert.keys_match()
        .map_err(|e| PkiError::Encoding(format!("server key and certificate: {e}")))?;
    let cert = Arc::new(cert);
    let mut roots = rustls::RootCertStore::empty();
    for c in parse_certs(trusted_pem)? {
        roots.add(c)?;
    }
    if roots.is_empty() {
        return Err(PkiError::Encoding("no CA certificate to trust".into()));
    }
    let roots = Arc::new(roots);
    let required =
        WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone()).build()?;
    let optional = WebPkiClientVerifier::builder_with_provider(roots, provider)
        .allow_unauthenticated()
        .build()?;
    Ok(Material {
        cert,
        required,
        optional,
    })
}

impl LiveTls {
    /// Presents `cert_pem` (with `key_pem`) and accepts client certificates
    /// from any CA in `trusted_pem`.
    pub fn new(cert_pem: &str, key_pem: &str, trusted_pem: &str) -> Result<Arc<LiveTls>> {
        Ok(Arc::new(LiveTls {
            current: RwLock::new(Arc::new(material(cert_pem, key_pem, trusted_pem)?)),
        }))
    }

    /// Swaps everything at once; a bad input leaves the old material.
    pub fn update(&self, cert_pem: &str, key_pem: &str, trusted_pem: &str) -> Result<()> {
        let next = Arc::new(material(cert_pem, key_pem, trusted_pem)?);
        *self.current.write().expect("live TLS lock") = next;
        Ok(())
    }

    fn now(&self) -> Arc<Material> {
        self.current.read().expect("live TLS lock").clone()
    }

    /// A server config drawing on this material, asking for client
    /// certificates as `auth` says.
    pub fn server_config(
        self: &Arc<Self>,
        auth: ClientAuth,
        alpn: &[&[u8]],
    ) -> Result<ServerConfig> {
        let builder = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()?;
        let builder = match auth {
            ClientAuth::None => builder.with_no_client_auth(),
            ClientAuth::Optional | ClientAuth::Required => {
                builder.with_client_cert_verifier(Arc::new(LiveVerifier {
                    live: self.clone(),
                    optional: auth == ClientAuth::Optional,
                }))
            }
        };
        let mut config = builder.with_cert_resolver(self.clone());
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        Ok(config)
    }
}

impl ResolvesServerCert for LiveTls {
    fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.now().cert.clone())
    }
}

/// Verifies client certificates with whatever [`LiveTls`] trusts now.
#[derive(Debug)]
struct LiveVerifier {
    live: Arc<LiveTls>,
    optional: bool,
}

impl LiveVerifier {
    fn inner(&self) -> Arc<dyn ClientCertVerifier> {
        let m = self.live.now();
        if self.optional {
            m.optional.clone()
        } else {
            m.required.clone()
        }
    }
}

impl ClientCertVerifier for LiveVerifier {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        !self.optional
    }

    // Hints are optional; our clients hold a single certificate each.
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> std::result::Result<ClientCertVerified, rustls::Error> {
        self.inner()
            .verify_client_cert(end_entity, intermediates, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        self.inner().verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        self.inner().verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner().supported_verify_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CertificateAuthority;

    #[test]
    fn swaps_the_certificate_and_the_trusted_cas() {
        let (a, b) = (
            CertificateAuthority::generate("a").unwrap(),
            CertificateAuthority::generate("b").unwrap(),
        );
        let (cert, key) = a.issue_server_cert(&["localhost".into()]).unwrap();
        let live = LiveTls::new(&cert, &key, a.cert_pem()).unwrap();
        let first = live.now().cert.clone();
        let (cert_b, key_b) = b.issue_server_cert(&["localhost".into()]).unwrap();
        let both = format!("{}{}", b.cert_pem(), a.cert_pem());
        live.update(&cert_b, &key_b, &both).unwrap();
        assert!(!Arc::ptr_eq(&first, &live.now().cert));
        // Bad material is refused and the current one stays.
        assert!(live.update("junk", &key_b, &both).is_err());
        assert!(live.update(&cert_b, &key_b, "").is_err());
        assert!(
            live.update(&cert_b, &key, &both).is_err(),
            "key of another cert"
        );
        assert_eq!(
            live.now().cert.cert[0].as_ref(),
            parse_certs(&cert_b).unwrap()[0].as_ref()
        );
    }
}
