//! `otter` when it cannot reach the hub: a refused port, a name that does
//! not resolve, a certificate from an unknown CA, one for another name, an
//! expired one, and an address that never answers each get their own line
//! with the fix, where all used to read "transport error".

use std::{net::SocketAddr, time::Duration};

use otter_e2e::run_bounded;

use crate::otter;

/// A TLS server on loopback presenting `cert`.
async fn tls_server((cert, key): (String, String)) -> SocketAddr {
    otter_e2e::tls_server(&cert, &key, b"h2").await
}

/// What `otter links` says against `url` (trusting `ca_file` when given).
async fn said(dir: &std::path::Path, url: &str, ca_file: Option<&std::path::Path>) -> String {
    let mut cmd = std::process::Command::new(otter());
    cmd.env("OTTER_CONFIG", dir.join("otter.toml"))
        .args(["links", "--hub", url, "--token", "t"]);
    if let Some(ca) = ca_file {
        cmd.arg("--ca-file").arg(ca);
    }
    let (code, out, err) =
        tokio::task::spawn_blocking(move || run_bounded(&mut cmd, Duration::from_secs(60)))
            .await
            .unwrap();
    assert_ne!(code, 0, "{out}{err}");
    err.trim().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_way_of_not_reaching_the_hub_says_its_cause_and_fix() {
    otter_pki::tls::install_default_provider();
    let dir = tempfile::tempdir().unwrap();
    let ca = otter_pki::CertificateAuthority::generate("a test CA").unwrap();
    let ca_file = dir.path().join("ca.crt");
    std::fs::write(&ca_file, ca.cert_pem()).unwrap();
    let ours = ca.issue_server_cert(&["localhost".into()]).unwrap();
    let other_name = ca.issue_server_cert(&["other.example".into()]).unwrap();
    let expiring = ca
        .issue_replica_cert("r", &["localhost".into()], Duration::from_secs(1))
        .unwrap();

    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let known = tls_server(ours).await;
    let misnamed = tls_server(other_name).await;
    let expired = tls_server(expiring).await;
    // Accepts, then never says a word.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent_port = silent.local_addr().unwrap().port();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((tcp, _)) = silent.accept().await {
            held.push(tcp);
        }
    });
    tokio::time::sleep(Duration::from_secs(2)).await;

    let url = |port: u16| format!("https://localhost:{port}");
    let cases: [(&str, String, Option<&std::path::Path>, &[&str]); 6] = [
        (
            "refused",
            url(closed),
            None,
            &["connection refused", "is the hub running"],
        ),
        (
            "no such name",
            "https://no-such-hub.invalid:8443".into(),
            None,
            &["does not resolve", "no-such-hub.invalid"],
        ),
        (
            "unknown CA",
            url(known.port()),
            None,
            &["not from a CA trusted here", "--ca-file"],
        ),
        (
            "another name",
            url(misnamed.port()),
            Some(&ca_file),
            &["for another name", "--external-url"],
        ),
        (
            "expired",
            url(expired.port()),
            Some(&ca_file),
            &["has expired", "clock"],
        ),
        (
            "silent",
            url(silent_port),
            Some(&ca_file),
            &["no answer", "firewall"],
        ),
    ];
    for (what, url, ca, expect) in cases {
        let err = said(dir.path(), &url, ca).await;
        eprintln!("{what}: {err}");
        for e in expect {
            assert!(err.contains(e), "{what}: {e:?} not in {err:?}");
        }
        assert!(!err.contains("transport error"), "{what}: {err}");
    }
}
