//! The hub's certificate authority.

use std::{net::IpAddr, time::Duration};

use rcgen::{
    BasicConstraints, CertificateParams, CertificateSigningRequestParams, DistinguishedName,
    DnType, DnValue, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose,
    PKCS_ECDSA_P256_SHA256, PKCS_ED25519, SanType, SerialNumber,
};
use time::OffsetDateTime;

use crate::{AgentIdentity, PkiError, Result};

/// Largest CSR (PEM) the hub will look at. A P-256 CSR is under 1 KiB; the
/// bound keeps a hostile request from making the parser work on megabytes.
pub const MAX_CSR_PEM_LEN: usize = 16 * 1024;

/// Certificates are dated this far back so a peer whose clock runs a little
/// behind still accepts them: an agent certificate's `not_before` plus this
/// is the hub's time when it was issued.
pub const CLOCK_SKEW: Duration = Duration::from_secs(5 * 60);

/// How long the CA itself is valid.
const CA_LIFETIME: Duration = Duration::from_secs(10 * 365 * 24 * 3600);

/// How long a hub server certificate is valid; the hub issues a fresh one at
/// every start, so this only has to outlast one run.
const SERVER_CERT_LIFETIME: Duration = Duration::from_secs(397 * 24 * 3600);

/// The hub CA: its certificate (shared with agents) and signing key (never
/// leaves the hub's store).
pub struct CertificateAuthority {
    cert_pem: String,
    key_pem: String,
    issuer: Issuer<'static, KeyPair>,
}

impl std::fmt::Debug for CertificateAuthority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The key stays out of logs.
        f.debug_struct("CertificateAuthority")
            .field("fingerprint", &self.fingerprint())
            .finish()
    }
}

/// A certificate the CA signed for an agent.
#[derive(Debug, Clone)]
pub struct IssuedCertificate {
    pub pem: String,
    /// Lower-case hex, as [`crate::identity::PeerCertificate`] reads it back.
    pub serial: String,
    /// Unix seconds.
    pub not_after: i64,
}

impl CertificateAuthority {
    /// Creates a new CA with an ECDSA P-256 key.
    pub fn generate(common_name: &str) -> Result<Self> {
        let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256)?;
        let mut params = CertificateParams::default();
        params.distinguished_name = dn(common_name, "OtterScale Link");
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let now = OffsetDateTime::now_utc();
        params.not_before = now - CLOCK_SKEW;
        params.not_after = now + CA_LIFETIME;
        params.serial_number = Some(random_serial());
        let cert = params.self_signed(&key)?;
        Self::from_pem(&cert.pem(), &key.serialize_pem())
    }

    /// Loads a CA from its certificate and PKCS#8 key.
    pub fn from_pem(cert_pem: &str, key_pem: &str) -> Result<Self> {
        let key = KeyPair::from_pem(key_pem)?;
        let issuer = Issuer::from_ca_cert_pem(cert_pem, key)?;
        Ok(Self {
            cert_pem: cert_pem.to_owned(),
            key_pem: key_pem.to_owned(),
            issuer,
        })
    }

    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// The signing key, PEM. Only for persisting it in the hub's store.
    pub fn key_pem(&self) -> &str {
        &self.key_pem
    }

    /// SHA-256 of the CA certificate (DER), lower-case hex: what a manifest
    /// pins so the agent can check the hub on first contact.
    pub fn fingerprint(&self) -> String {
        fingerprint_pem(&self.cert_pem).unwrap_or_default()
    }

    /// Signs an agent's CSR. Only the CSR's public key is used: subject,
    /// SANs, usages, validity and serial are what the hub decides. A CSR
    /// whose common name or agent URI names another cluster or agent is
    /// refused, though: it is asking for an identity it was not given.
    pub fn sign_agent_csr(
        &self,
        csr_pem: &str,
        identity: &AgentIdentity,
        lifetime: Duration,
    ) -> Result<IssuedCertificate> {
        if csr_pem.len() > MAX_CSR_PEM_LEN {
            return Err(PkiError::CsrTooLarge {
                len: csr_pem.len(),
                max: MAX_CSR_PEM_LEN,
            });
        }
        // from_pem checks the CSR's self-signature, so a CSR for a key the
        // agent does not hold is refused here.
        let csr = CertificateSigningRequestParams::from_pem(csr_pem)
            .map_err(|e| PkiError::MalformedCsr(e.to_string()))?;
        let alg = csr.public_key.algorithm();
        if alg != &PKCS_ECDSA_P256_SHA256 && alg != &PKCS_ED25519 {
            return Err(PkiError::KeyTypeNotAllowed(format!("{alg:?}")));
        }
        check_claimed_identity(&csr.params, identity)?;
        let mut params = CertificateParams::default();
        params.distinguished_name = dn(
            &format!("{}/{}", identity.cluster, identity.agent_id),
            "OtterScale Link agent",
        );
        params.subject_alt_names = vec![SanType::URI(
            identity
                .to_uri()
                .try_into()
                .map_err(|e: rcgen::Error| PkiError::Rcgen(e))?,
        )];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.use_authority_key_identifier_extension = true;
        let serial = random_serial();
        params.serial_number = Some(serial.clone());
        let now = OffsetDateTime::now_utc();
        params.not_before = now - CLOCK_SKEW;
        params.not_after = now + lifetime;
        let cert = params.signed_by(&csr.public_key, &self.issuer)?;
        Ok(IssuedCertificate {
            pem: cert.pem(),
            serial: hex::encode(serial.to_bytes()),
            not_after: params.not_after.unix_timestamp(),
        })
    }

    /// Issues a server certificate for the hub's listeners. `names` are DNS
    /// names or IP addresses. Returns (certificate PEM, key PEM).
    pub fn issue_server_cert(&self, names: &[String]) -> Result<(String, String)> {
        let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256)?;
        let mut params = CertificateParams::default();
        params.distinguished_name = dn(
            names.first().map_or("otter-hub", |n| n.as_str()),
            "OtterScale Link hub",
        );
        let mut sans = Vec::new();
        for name in names {
            match name.parse::<IpAddr>() {
                Ok(ip) => sans.push(SanType::IpAddress(ip)),
                Err(_) => sans.push(SanType::DnsName(name.clone().try_into()?)),
            }
        }
        params.subject_alt_names = sans;
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.use_authority_key_identifier_extension = true;
        params.serial_number = Some(random_serial());
        let now = OffsetDateTime::now_utc();
        params.not_before = now - CLOCK_SKEW;
        params.not_after = now + SERVER_CERT_LIFETIME;
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok((cert.pem(), key.serialize_pem()))
    }
}

impl CertificateAuthority {
    /// Issues the certificate a hub replica presents to its peers, and
    /// accepts from them: client and server use, the replica's name in a
    /// URI SAN of its own scheme ([`crate::identity::REPLICA_URI_PREFIX`]),
    /// which no agent certificate ever carries (the hub writes every SAN of
    /// those itself). Returns (certificate PEM, key PEM).
    pub fn issue_replica_cert(
        &self,
        replica: &str,
        names: &[String],
        lifetime: Duration,
    ) -> Result<(String, String)> {
        crate::identity::validate_replica_name(replica)?;
        let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256)?;
        let mut params = CertificateParams::default();
        params.distinguished_name = dn(replica, "OtterScale Link hub replica");
        let mut sans = vec![SanType::URI(
            format!("{}{replica}", crate::identity::REPLICA_URI_PREFIX)
                .try_into()
                .map_err(|e: rcgen::Error| PkiError::Rcgen(e))?,
        )];
        for name in names {
            match name.parse::<IpAddr>() {
                Ok(ip) => sans.push(SanType::IpAddress(ip)),
                Err(_) => sans.push(SanType::DnsName(name.clone().try_into()?)),
            }
        }
        params.subject_alt_names = sans;
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ClientAuth,
            ExtendedKeyUsagePurpose::ServerAuth,
        ];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.use_authority_key_identifier_extension = true;
        params.serial_number = Some(random_serial());
        let now = OffsetDateTime::now_utc();
        params.not_before = now - CLOCK_SKEW;
        params.not_after = now + lifetime;
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok((cert.pem(), key.serialize_pem()))
    }
}

/// The identity-bearing parts of a CSR (common name `<cluster>/<agent>`,
/// agent URI SANs) must, when present, name `identity`.
fn check_claimed_identity(params: &CertificateParams, identity: &AgentIdentity) -> Result<()> {
    let expected = format!("{}/{}", identity.cluster, identity.agent_id);
    let mismatch = |claimed: String| PkiError::CsrIdentityMismatch {
        claimed,
        expected: expected.clone(),
    };
    for (kind, value) in params.distinguished_name.iter() {
        if *kind != DnType::CommonName {
            continue;
        }
        let text = match value {
            DnValue::Utf8String(s) => s.clone(),
            DnValue::PrintableString(s) => s.as_str().to_owned(),
            DnValue::Ia5String(s) => s.as_str().to_owned(),
            other => format!("{other:?}"),
        };
        if text != expected {
            return Err(mismatch(text));
        }
    }
    let uri = identity.to_uri();
    for san in &params.subject_alt_names {
        if let SanType::URI(claimed) = san
            && claimed.as_str().starts_with(crate::identity::SPIFFE_PREFIX)
            && claimed.as_str() != uri
        {
            return Err(mismatch(claimed.as_str().to_owned()));
        }
    }
    Ok(())
}

/// SHA-256 fingerprint (lower-case hex) of the first certificate in a PEM.
pub fn fingerprint_pem(pem: &str) -> Result<String> {
    let der = crate::tls::parse_certs(pem)?
        .into_iter()
        .next()
        .ok_or_else(|| PkiError::Encoding("no certificate in PEM".into()))?;
    Ok(hex::encode(ring::digest::digest(
        &ring::digest::SHA256,
        der.as_ref(),
    )))
}

fn dn(common_name: &str, organization: &str) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, common_name);
    dn.push(DnType::OrganizationName, organization);
    dn
}

/// 16 random bytes with the top bit clear, so the DER integer is positive
/// and no longer than 20 bytes (RFC 5280).
fn random_serial() -> SerialNumber {
    let mut bytes: [u8; 16] = rand::random();
    bytes[0] &= 0x7f;
    bytes[0] |= 0x01; // no leading zero byte, so hex round-trips exactly
    SerialNumber::from_slice(&bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{csr, identity::PeerCertificate};

    #[test]
    fn signs_agent_csr_with_identity_and_overrides_everything_else() {
        let ca = CertificateAuthority::generate("test CA").unwrap();
        let reloaded = CertificateAuthority::from_pem(ca.cert_pem(), ca.key_pem()).unwrap();
        assert_eq!(ca.fingerprint(), reloaded.fingerprint());
        assert_eq!(ca.fingerprint().len(), 64);

        let (_key, csr_pem) = csr::generate("edge-1", "agent-1").unwrap();
        let id = AgentIdentity::new("edge-1", "agent-1").unwrap();
        let issued = reloaded
            .sign_agent_csr(&csr_pem, &id, Duration::from_secs(3600))
            .unwrap();
        let der = crate::tls::parse_certs(&issued.pem).unwrap().remove(0);
        let peer = PeerCertificate::from_der(der.as_ref()).unwrap();
        assert_eq!(peer.identity, id);
        assert_eq!(peer.serial, issued.serial);
        assert_eq!(peer.not_after, issued.not_after);
    }

    #[test]
    fn rejects_garbage_oversized_and_tampered_csrs() {
        let ca = CertificateAuthority::generate("test CA").unwrap();
        let id = AgentIdentity::new("edge-1", "a").unwrap();
        let life = Duration::from_secs(60);
        assert!(matches!(
            ca.sign_agent_csr("not a csr", &id, life),
            Err(PkiError::MalformedCsr(_))
        ));
        let huge = "A".repeat(MAX_CSR_PEM_LEN + 1);
        assert!(matches!(
            ca.sign_agent_csr(&huge, &id, life),
            Err(PkiError::CsrTooLarge { .. })
        ));

        // Flip one byte inside the signed body: the self-signature fails.
        let (_key, csr_pem) = csr::generate("edge-1", "a").unwrap();
        let lines: Vec<&str> = csr_pem.lines().collect();
        let mut body = lines[1].as_bytes().to_vec();
        body[40] = if body[40] == b'A' { b'B' } else { b'A' };
        let tampered = csr_pem.replacen(lines[1], std::str::from_utf8(&body).unwrap(), 1);
        assert!(matches!(
            ca.sign_agent_csr(&tampered, &id, life),
            Err(PkiError::MalformedCsr(_))
        ));
    }

    #[test]
    fn refuses_other_key_types() {
        let ca = CertificateAuthority::generate("test CA").unwrap();
        let id = AgentIdentity::new("edge-1", "a").unwrap();
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P384_SHA384).unwrap();
        let csr = CertificateParams::default()
            .serialize_request(&key)
            .unwrap()
            .pem()
            .unwrap();
        assert!(matches!(
            ca.sign_agent_csr(&csr, &id, Duration::from_secs(60)),
            Err(PkiError::KeyTypeNotAllowed(_))
        ));
    }
}
