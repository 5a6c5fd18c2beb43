//! PKI of OtterScale Link: the hub's certificate authority, agent
//! certificates bound to one cluster, and the rustls configurations that the
//! hub and the agent build on them.
//!
//! # Layout
//! - [`identity`] — cluster-name rules and the agent identity carried in a
//!   certificate's URI SAN (`spiffe://otterscale-link/cluster/<c>/agent/<a>`).
//! - [`ca`] — create or load the CA, sign agent CSRs (everything the CSR
//!   proposes is overwritten), issue the hub's server certificate.
//! - [`csr`] — the agent side: a fresh key and a CSR.
//! - [`tls`] — rustls server and client configs (mTLS), one crypto provider.
//!
//! The hub learns which cluster a tunnel belongs to from the certificate it
//! signed, never from anything the agent claims on the wire.

pub mod ca;
pub mod csr;
pub mod identity;
pub mod live;
pub mod tickets;
pub mod tls;

pub use ca::{CertificateAuthority, IssuedCertificate};
pub use identity::{AgentIdentity, validate_cluster_name};

/// Everything that can go wrong in this crate.
#[derive(Debug, thiserror::Error)]
pub enum PkiError {
    /// The CSR could not be parsed or its self-signature does not verify.
    #[error("malformed CSR: {0}")]
    MalformedCsr(String),
    /// The CSR is larger than any CSR of an allowed key type can be.
    #[error("CSR of {len} bytes is over the limit of {max}")]
    CsrTooLarge { len: usize, max: usize },
    /// The CSR names an identity other than the one being registered.
    #[error("CSR names {claimed:?}, but this registration is for {expected:?}")]
    CsrIdentityMismatch { claimed: String, expected: String },
    /// The CSR's key is of a type the hub does not sign.
    #[error("CSR key type not allowed: {0} (use ECDSA P-256 or Ed25519)")]
    KeyTypeNotAllowed(String),
    /// A cluster name or agent id does not fit the rules.
    #[error("invalid {what}: {why}")]
    InvalidName { what: &'static str, why: String },
    /// A certificate does not carry an agent identity we issued.
    #[error("certificate carries no agent identity: {0}")]
    NoIdentity(String),
    /// PEM or DER that does not hold what it should.
    #[error("bad PEM or DER: {0}")]
    Encoding(String),
    /// Certificate generation or signing failed.
    #[error("certificate generation: {0}")]
    Rcgen(#[from] rcgen::Error),
    /// rustls refused a configuration.
    #[error("TLS configuration: {0}")]
    Tls(#[from] rustls::Error),
    /// Building a client-certificate verifier failed.
    #[error("client verifier: {0}")]
    Verifier(#[from] rustls::server::VerifierBuilderError),
}

/// Result alias for this crate.
pub type Result<T, E = PkiError> = std::result::Result<T, E>;
