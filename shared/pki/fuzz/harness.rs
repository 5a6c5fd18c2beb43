//! What each fuzz target does with one input: plain functions over the
//! crate's public entry points, replayed by `tests/fuzz_regressions.rs`.
//! A harness panics only when an invariant breaks.

use std::{sync::OnceLock, time::Duration};

use base64::Engine;
use otter_pki::{
    AgentIdentity, CertificateAuthority, PkiError, identity::PeerCertificate,
    identity::SPIFFE_PREFIX,
};

/// One CA per process: making a key per input would drown the signal.
fn ca() -> &'static CertificateAuthority {
    static CA: OnceLock<CertificateAuthority> = OnceLock::new();
    CA.get_or_init(|| CertificateAuthority::generate("fuzz CA").expect("CA"))
}

/// `der` as a PEM block.
pub fn pem(label: &str, der: &[u8]) -> String {
    let b64 = base64::engine::general_purpose::STANDARD.encode(der);
    let mut out = format!("-----BEGIN {label}-----\n");
    for line in b64.as_bytes().chunks(64) {
        out.push_str(std::str::from_utf8(line).expect("base64 is ASCII"));
        out.push('\n');
    }
    out.push_str(&format!("-----END {label}-----\n"));
    out
}

/// CSR signing as Register does it. The first byte says whether the rest is
/// the PEM text itself or DER to wrap in PEM (which gets the fuzzer past the
/// PEM layer). Whatever the CSR says, a signed certificate must name exactly
/// the identity the hub asked for; refusals must be the kinds the hub
/// answers as InvalidArgument, PermissionDenied or ResourceExhausted, never
/// an internal error.
pub fn csr_sign(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let csr = if mode & 1 == 0 {
        String::from_utf8_lossy(rest).into_owned()
    } else {
        pem("CERTIFICATE REQUEST", rest)
    };
    let id = AgentIdentity::new("fuzz-cluster", "fuzz-agent").expect("identity");
    match ca().sign_agent_csr(&csr, &id, Duration::from_secs(3600)) {
        Ok(issued) => {
            let der = otter_pki::tls::parse_certs(&issued.pem)
                .expect("issued PEM parses")
                .remove(0);
            let peer = PeerCertificate::from_der(der.as_ref()).expect("issued certificate parses");
            assert_eq!(
                peer.identity, id,
                "the CSR changed who the certificate names"
            );
            assert_eq!(peer.serial, issued.serial);
        }
        Err(
            PkiError::MalformedCsr(_)
            | PkiError::KeyTypeNotAllowed(_)
            | PkiError::CsrTooLarge { .. }
            | PkiError::CsrIdentityMismatch { .. },
        ) => {}
        Err(other) => panic!("bad CSR answered with an internal error: {other}"),
    }
}

/// Reading the identity out of a client certificate (DER). Anything
/// accepted names a valid identity that round-trips through its URI.
pub fn peer_cert(data: &[u8]) {
    if let Ok(peer) = PeerCertificate::from_der(data) {
        let uri = peer.identity.to_uri();
        assert!(uri.starts_with(SPIFFE_PREFIX));
        assert_eq!(
            AgentIdentity::from_uri(&uri).expect("round trip"),
            peer.identity
        );
        assert!(!peer.serial.is_empty() || data.len() < 4096);
    }
}
