//! Replays the fuzz seed corpus (`fuzz/seeds/<target>/`) and every input a
//! fuzzer ever crashed on (`tests/fuzz-regressions/<target>/`) through the
//! harness the fuzz targets call, under plain `cargo test`; and feeds it
//! hostile CSRs made fresh here (names injected into the subject and SANs,
//! other key types, a broken signature, oversized).
//!
//! The seed counts asserted here are exact (the files committed under
//! `fuzz/seeds/<target>/`), so a lost seed fails, and so does a missing
//! `tests/fuzz-regressions/`: the replay never passes by finding nothing.

#[path = "../../../tests/support/fuzz_replay.rs"]
mod fuzz_replay;
#[path = "../fuzz/harness.rs"]
mod harness;

use fuzz_replay::replay;

use std::path::Path;

use rcgen::{CertificateParams, DnType, KeyPair, SanType};

#[test]
fn csr_sign_corpus() {
    let n = replay("csr_sign", harness::csr_sign);
    assert_eq!(n.seeds, 8, "files in fuzz/seeds/csr_sign/: {n:?}");
}

#[test]
fn peer_cert_corpus() {
    let n = replay("peer_cert", harness::peer_cert);
    assert_eq!(n.seeds, 3, "files in fuzz/seeds/peer_cert/: {n:?}");
}

/// A CSR whose subject and SANs claim another cluster, as PEM and as DER.
fn injected_csr() -> (String, Vec<u8>) {
    let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
    let mut params = CertificateParams::default();
    params
        .distinguished_name
        .push(DnType::CommonName, "victim-cluster/agent-x");
    params.subject_alt_names = vec![
        SanType::URI(
            "spiffe://otterscale-link/cluster/victim-cluster/agent/x"
                .try_into()
                .unwrap(),
        ),
        SanType::DnsName("victim-cluster".try_into().unwrap()),
    ];
    let csr = params.serialize_request(&key).unwrap();
    (csr.pem().unwrap(), csr.der().to_vec())
}

#[test]
fn hostile_csrs_through_the_harness() {
    // The harness asserts the issued certificate names only the hub's identity.
    let (pem, der) = injected_csr();
    harness::csr_sign(&[&[0u8][..], pem.as_bytes()].concat());
    harness::csr_sign(&[&[1u8][..], &der].concat());
    // The same through the CA directly: refused, naming what it claimed.
    let ca = otter_pki::CertificateAuthority::generate("t").unwrap();
    let id = otter_pki::AgentIdentity::new("edge-1", "a1").unwrap();
    let life = std::time::Duration::from_secs(60);
    let e = ca.sign_agent_csr(&pem, &id, life).unwrap_err();
    assert!(
        matches!(&e, otter_pki::PkiError::CsrIdentityMismatch { claimed, .. } if claimed.contains("victim")),
        "{e}"
    );
    // Other SANs (DNS names) and the right common name: signed, and the
    // certificate carries only what the hub writes.
    let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
    let mut params = CertificateParams::default();
    params
        .distinguished_name
        .push(DnType::CommonName, "edge-1/a1");
    params.subject_alt_names = vec![SanType::DnsName("victim-cluster".try_into().unwrap())];
    let dns_only = params.serialize_request(&key).unwrap().pem().unwrap();
    let issued = ca.sign_agent_csr(&dns_only, &id, life).unwrap();
    let cert_der = otter_pki::tls::parse_certs(&issued.pem).unwrap().remove(0);
    let text = String::from_utf8_lossy(cert_der.as_ref()).into_owned();
    assert!(
        !text.contains("victim"),
        "a CSR name reached the certificate"
    );

    // A P-384 key, a flipped signature byte, an oversized CSR.
    let p384 = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P384_SHA384).unwrap();
    let other = CertificateParams::default()
        .serialize_request(&p384)
        .unwrap();
    harness::csr_sign(&[&[1u8][..], other.der()].concat());
    let mut bad_sig = der.clone();
    let last = bad_sig.len() - 1;
    bad_sig[last] ^= 0x01;
    assert!(matches!(
        ca.sign_agent_csr(&harness::pem("CERTIFICATE REQUEST", &bad_sig), &id, life),
        Err(otter_pki::PkiError::MalformedCsr(_))
    ));
    harness::csr_sign(&[&[1u8][..], &bad_sig].concat());
    harness::csr_sign(
        &[
            &[0u8][..],
            "A".repeat(otter_pki::ca::MAX_CSR_PEM_LEN + 1).as_bytes(),
        ]
        .concat(),
    );

    // Writes these as seeds when asked (the seed corpus is made this way).
    if let Ok(dir) = std::env::var("OTTER_WRITE_FUZZ_SEEDS") {
        let dir = Path::new(&dir);
        let w = |name: &str, data: &[u8]| std::fs::write(dir.join(name), data).unwrap();
        let (_key, valid) = otter_pki::csr::generate("fuzz-cluster", "fuzz-agent").unwrap();
        w(
            "csr_sign/valid_pem",
            &[&[0u8][..], valid.as_bytes()].concat(),
        );
        let valid_der =
            otter_pki::tls::parse_certs(&valid.replace("CERTIFICATE REQUEST", "CERTIFICATE"))
                .unwrap()
                .remove(0);
        w(
            "csr_sign/valid_der",
            &[&[1u8][..], valid_der.as_ref()].concat(),
        );
        w(
            "csr_sign/injected_pem",
            &[&[0u8][..], pem.as_bytes()].concat(),
        );
        w("csr_sign/injected_der", &[&[1u8][..], &der].concat());
        w("csr_sign/p384_der", &[&[1u8][..], other.der()].concat());
        w(
            "csr_sign/bad_signature_der",
            &[&[1u8][..], &bad_sig].concat(),
        );
        w(
            "csr_sign/not_pem",
            b"\0-----BEGIN CERTIFICATE REQUEST-----\nAAAA\n-----END CERTIFICATE REQUEST-----\n",
        );
        let agent = ca.sign_agent_csr(&dns_only, &id, life).unwrap();
        w(
            "peer_cert/agent",
            otter_pki::tls::parse_certs(&agent.pem).unwrap()[0].as_ref(),
        );
        w(
            "peer_cert/ca",
            otter_pki::tls::parse_certs(ca.cert_pem()).unwrap()[0].as_ref(),
        );
        let (server, _) = ca.issue_server_cert(&["localhost".into()]).unwrap();
        w(
            "peer_cert/server",
            otter_pki::tls::parse_certs(&server).unwrap()[0].as_ref(),
        );
    }
}
