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

/// A server certificate chain and its key, checked to belong together.
fn certified(cert_pem: &str, key_pem: &str) -> Result<Arc<CertifiedKey>> {
    let key = provider()
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
    Ok(Arc::new(cert))
}

fn material(cert_pem: &str, key_pem: &str, trusted_pem: &str) -> Result<Material> {
    let provider = provider();
    let cert = certified(cert_pem, key_pem)?;
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
        *self
            .current
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = next;
        Ok(())
    }

    /// Verifies a client certificate (DER) as a handshake would now: it
    /// chains to a trusted CA and is valid at this moment. A resumed TLS
    /// session skips that check, so the hub makes it again on admission.
    pub fn verify_client(&self, end_entity: &[u8]) -> Result<()> {
        self.now()
            .required
            .verify_client_cert(&CertificateDer::from(end_entity), &[], UnixTime::now())
            .map(|_| ())
            .map_err(PkiError::Tls)
    }

    fn now(&self) -> Arc<Material> {
        self.current
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
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

impl LiveTls {
    /// Like [`LiveTls::server_config`], presenting `cert` (a certificate
    /// from files, see [`FileCert`]) instead of this material's, while
    /// client certificates are still verified with what this trusts.
    pub fn server_config_presenting(
        self: &Arc<Self>,
        auth: ClientAuth,
        alpn: &[&[u8]],
        cert: Arc<FileCert>,
    ) -> Result<ServerConfig> {
        let mut config = self.server_config(auth, alpn)?;
        config.cert_resolver = cert;
        Ok(config)
    }
}

/// A server certificate kept in files (one a public CA issued, or
/// cert-manager's Secret mounted into the pod), presented instead of one
/// from the hub CA, and read again when the files change: cert-manager
/// renews by rewriting them.
pub struct FileCert {
    cert_path: std::path::PathBuf,
    key_path: std::path::PathBuf,
    current: RwLock<(Arc<CertifiedKey>, Stamp)>,
}

/// What the files looked like when read: a change in either is a rewrite.
type Stamp = [Option<(std::time::SystemTime, u64)>; 2];

fn stamp(paths: [&std::path::Path; 2]) -> Stamp {
    paths.map(|p| {
        let m = std::fs::metadata(p).ok()?;
        Some((m.modified().ok()?, m.len()))
    })
}

impl std::fmt::Debug for FileCert {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileCert")
            .field("cert", &self.cert_path)
            .finish()
    }
}

impl FileCert {
    /// Reads the chain and its key; both must be there and belong together.
    pub fn load(cert_path: &std::path::Path, key_path: &std::path::Path) -> Result<Arc<FileCert>> {
        let (cert, stamp) = Self::read(cert_path, key_path)?;
        Ok(Arc::new(FileCert {
            cert_path: cert_path.to_owned(),
            key_path: key_path.to_owned(),
            current: RwLock::new((cert, stamp)),
        }))
    }

    fn read(
        cert_path: &std::path::Path,
        key_path: &std::path::Path,
    ) -> Result<(Arc<CertifiedKey>, Stamp)> {
        let before = stamp([cert_path, key_path]);
        let read = |p: &std::path::Path| {
            std::fs::read_to_string(p)
                .map_err(|e| PkiError::Encoding(format!("{}: {e}", p.display())))
        };
        let cert = certified(&read(cert_path)?, &read(key_path)?)
            .map_err(|e| PkiError::Encoding(format!("{}: {e}", cert_path.display())))?;
        Ok((cert, before))
    }

    /// Reads the files again if they changed since last read: whether the
    /// certificate changed. Files caught half-written (a key that does not
    /// match the certificate yet) leave the current one, and are read
    /// again next time.
    pub fn reload_if_changed(&self) -> Result<bool> {
        let now = stamp([&self.cert_path, &self.key_path]);
        if self
            .current
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .1
            == now
        {
            return Ok(false);
        }
        let (cert, stamp) = Self::read(&self.cert_path, &self.key_path)?;
        *self
            .current
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = (cert, stamp);
        Ok(true)
    }

    /// The certificates of the chain as read (leaf first).
    pub fn chain(&self) -> Vec<CertificateDer<'static>> {
        self.current
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .0
            .cert
            .clone()
    }
}

impl ResolvesServerCert for FileCert {
    fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(
            self.current
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0
                .clone(),
        )
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

    /// A certificate kept in files: read again only when they change, and
    /// a half-written pair (a key of another certificate) keeps the one
    /// shown until the next good read.
    #[test]
    fn a_file_certificate_follows_its_files_and_survives_a_half_write() {
        let ca = CertificateAuthority::generate("files").unwrap();
        let dir = tempfile::tempdir().unwrap();
        let (cert_path, key_path) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
        let write = |(cert, key): &(String, String)| {
            std::fs::write(&cert_path, cert).unwrap();
            std::fs::write(&key_path, key).unwrap();
        };
        let first = ca.issue_server_cert(&["a.example".into()]).unwrap();
        write(&first);
        let file = FileCert::load(&cert_path, &key_path).unwrap();
        let shown = |f: &FileCert| f.chain()[0].to_vec();
        let der = |pem: &str| parse_certs(pem).unwrap()[0].to_vec();
        assert_eq!(shown(&file), der(&first.0));
        assert!(!file.reload_if_changed().unwrap(), "nothing changed");
        // The new certificate written before its key: refused, the old one
        // stays.
        let second = ca.issue_server_cert(&["a.example".into()]).unwrap();
        std::fs::write(&cert_path, format!("{}\n", second.0)).unwrap();
        assert!(file.reload_if_changed().is_err());
        assert_eq!(shown(&file), der(&first.0));
        std::fs::write(&key_path, &second.1).unwrap();
        assert!(file.reload_if_changed().unwrap());
        assert_eq!(shown(&file), der(&second.0));
    }
}
