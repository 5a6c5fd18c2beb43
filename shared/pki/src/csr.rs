//! The agent's side of enrolment: a fresh key pair and a CSR for it.

use rcgen::{CertificateParams, DistinguishedName, DnType, KeyPair, PKCS_ECDSA_P256_SHA256};

use crate::{AgentIdentity, Result};

/// Makes an ECDSA P-256 key and a CSR naming the agent. The hub ignores the
/// names in the CSR and writes its own; they are there for a person reading
/// it. Returns (key PEM, CSR PEM).
pub fn generate(cluster: &str, agent_id: &str) -> Result<(String, String)> {
    let identity = AgentIdentity::new(cluster, agent_id)?;
    let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256)?;
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(
        DnType::CommonName,
        format!("{}/{}", identity.cluster, identity.agent_id),
    );
    params.distinguished_name = dn;
    let csr = params.serialize_request(&key)?;
    Ok((key.serialize_pem(), csr.pem()?))
}
