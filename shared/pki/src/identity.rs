//! Names and the identity an agent certificate carries.

use crate::{PkiError, Result};

/// URI SAN prefix of agent certificates. The trust domain is fixed: only our
/// own CA issues these, and the hub checks the chain before it reads them.
pub const SPIFFE_PREFIX: &str = "spiffe://otterscale-link/cluster/";

/// URI SAN scheme of hub replica certificates: `otter-replica:<name>`.
/// Agent certificates never carry it (the hub writes their SANs).
pub const REPLICA_URI_PREFIX: &str = "otter-replica:";

/// Checks a replica name: a DNS label, like a cluster name.
pub fn validate_replica_name(name: &str) -> Result<()> {
    validate_cluster_name(name).map_err(|_| PkiError::InvalidName {
        what: "replica name",
        why: format!("{name:?} is not a lowercase DNS label (a-z, 0-9, -; at most 63)"),
    })
}

/// The replica a verified certificate names, if it is a replica's: one
/// replica URI SAN and no agent URI.
pub fn replica_of_der(der: &[u8]) -> Result<String> {
    use x509_parser::prelude::*;
    let (_, cert) = X509Certificate::from_der(der)
        .map_err(|e| PkiError::Encoding(format!("certificate: {e}")))?;
    let mut replica = None;
    if let Ok(Some(san)) = cert.subject_alternative_name() {
        for name in &san.value.general_names {
            if let GeneralName::URI(uri) = name {
                if uri.starts_with(SPIFFE_PREFIX) {
                    return Err(PkiError::NoIdentity("an agent's certificate".into()));
                }
                if let Some(r) = uri.strip_prefix(REPLICA_URI_PREFIX) {
                    if replica.is_some() {
                        return Err(PkiError::NoIdentity("more than one replica URI".into()));
                    }
                    validate_replica_name(r)?;
                    replica = Some(r.to_owned());
                }
            }
        }
    }
    replica.ok_or_else(|| PkiError::NoIdentity("no replica URI SAN".into()))
}

/// Longest agent id accepted (it ends up in a certificate and in logs).
pub const MAX_AGENT_ID_LEN: usize = 128;

/// Checks a cluster name: a DNS label (RFC 1123), as Kubernetes names are.
pub fn validate_cluster_name(name: &str) -> Result<()> {
    let bad = |why: &str| PkiError::InvalidName {
        what: "cluster name",
        why: why.to_owned(),
    };
    if name.is_empty() {
        return Err(bad("it is empty"));
    }
    if name.len() > 63 {
        return Err(bad(&format!(
            "{} characters, at most 63 allowed",
            name.len()
        )));
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
    {
        return Err(bad(&format!("{name:?} may hold only a-z, 0-9 and '-'")));
    }
    if name.starts_with('-') || name.ends_with('-') {
        return Err(bad(&format!(
            "{name:?} must start and end with a letter or digit"
        )));
    }
    Ok(())
}

/// Checks an agent id: 1–128 characters of `[A-Za-z0-9._-]`, so it is safe
/// in a URI, a header and a log line.
pub fn validate_agent_id(id: &str) -> Result<()> {
    let bad = |why: String| PkiError::InvalidName {
        what: "agent id",
        why,
    };
    if id.is_empty() || id.len() > MAX_AGENT_ID_LEN {
        return Err(bad(format!("must be 1 to {MAX_AGENT_ID_LEN} characters")));
    }
    if !id
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
    {
        return Err(bad(format!(
            "{id:?} may hold only A-Z, a-z, 0-9, '.', '_' and '-'"
        )));
    }
    Ok(())
}

/// Who a tunnel belongs to, as the hub's CA wrote it into the certificate.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct AgentIdentity {
    pub cluster: String,
    pub agent_id: String,
}

impl AgentIdentity {
    /// Validates both parts.
    pub fn new(cluster: &str, agent_id: &str) -> Result<Self> {
        validate_cluster_name(cluster)?;
        validate_agent_id(agent_id)?;
        Ok(Self {
            cluster: cluster.to_owned(),
            agent_id: agent_id.to_owned(),
        })
    }

    /// The URI SAN for this identity.
    pub fn to_uri(&self) -> String {
        format!("{SPIFFE_PREFIX}{}/agent/{}", self.cluster, self.agent_id)
    }

    /// Parses a URI SAN written by [`AgentIdentity::to_uri`].
    pub fn from_uri(uri: &str) -> Result<Self> {
        let rest = uri
            .strip_prefix(SPIFFE_PREFIX)
            .ok_or_else(|| PkiError::NoIdentity(format!("URI {uri:?} is not ours")))?;
        let (cluster, agent) = rest
            .split_once("/agent/")
            .ok_or_else(|| PkiError::NoIdentity(format!("URI {uri:?} names no agent")))?;
        Self::new(cluster, agent)
    }
}

/// What the hub needs from a verified client certificate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerCertificate {
    pub identity: AgentIdentity,
    /// Serial number, lower-case hex.
    pub serial: String,
    /// Start of validity, Unix seconds: the issuer's time at signing less
    /// [`crate::ca::CLOCK_SKEW`].
    pub not_before: i64,
    /// End of validity, Unix seconds.
    pub not_after: i64,
}

impl PeerCertificate {
    /// Reads identity, serial and expiry from a DER certificate. The caller
    /// must already have verified the chain (rustls does, for mTLS peers).
    pub fn from_der(der: &[u8]) -> Result<Self> {
        use x509_parser::prelude::*;
        let (_, cert) = X509Certificate::from_der(der)
            .map_err(|e| PkiError::Encoding(format!("certificate: {e}")))?;
        let mut identity = None;
        if let Ok(Some(san)) = cert.subject_alternative_name() {
            for name in &san.value.general_names {
                if let GeneralName::URI(uri) = name
                    && uri.starts_with(SPIFFE_PREFIX)
                {
                    if identity.is_some() {
                        return Err(PkiError::NoIdentity("more than one agent URI".into()));
                    }
                    identity = Some(AgentIdentity::from_uri(uri)?);
                }
            }
        }
        let identity = identity.ok_or_else(|| PkiError::NoIdentity("no agent URI SAN".into()))?;
        Ok(Self {
            identity,
            serial: hex::encode(cert.raw_serial()),
            not_before: cert.validity().not_before.timestamp(),
            not_after: cert.validity().not_after.timestamp(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_names_follow_dns_label_rules() {
        for ok in ["a", "edge-1", "0abc", &"x".repeat(63)] {
            validate_cluster_name(ok).unwrap();
        }
        for bad in [
            "",
            "-a",
            "a-",
            "Edge",
            "a_b",
            "a.b",
            &"x".repeat(64),
            "a/b",
            "é",
        ] {
            assert!(validate_cluster_name(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn identity_round_trips_and_rejects_injection() {
        let id = AgentIdentity::new("edge-1", "agent-7").unwrap();
        assert_eq!(AgentIdentity::from_uri(&id.to_uri()).unwrap(), id);
        assert!(
            AgentIdentity::from_uri("spiffe://otterscale-link/cluster/a/agent/b/agent/c").is_err()
        );
        assert!(AgentIdentity::from_uri("spiffe://other/cluster/a/agent/b").is_err());
        assert!(AgentIdentity::new("edge-1", "a b").is_err());
    }
}

#[cfg(test)]
mod replica_tests {
    use super::*;

    #[test]
    fn replica_certificates_name_their_replica_and_agent_ones_none() {
        let ca = crate::CertificateAuthority::generate("test CA").unwrap();
        let (pem, _) = ca
            .issue_replica_cert(
                "hub-b",
                &["localhost".into()],
                std::time::Duration::from_secs(60),
            )
            .unwrap();
        let der = crate::tls::parse_certs(&pem).unwrap().remove(0);
        assert_eq!(replica_of_der(&der).unwrap(), "hub-b");
        let (_, csr) = crate::csr::generate("edge-1", "a1").unwrap();
        let agent = ca
            .sign_agent_csr(
                &csr,
                &AgentIdentity::new("edge-1", "a1").unwrap(),
                std::time::Duration::from_secs(60),
            )
            .unwrap();
        let der = crate::tls::parse_certs(&agent.pem).unwrap().remove(0);
        assert!(replica_of_der(&der).is_err());
        assert!(
            ca.issue_replica_cert("Not/A/Name", &[], std::time::Duration::from_secs(60))
                .is_err()
        );
    }
}
