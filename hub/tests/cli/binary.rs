//! The `otter` binary end to end (here, in its own package, so the test can
//! find the built binary) against a hub on loopback: login, token
//! creation, agent manifests, links.

use std::time::Duration;

use otter_e2e::{
    TestHub,
    double::{start_agent, wait_connected},
    run_bounded,
};
use otter_tunnel::TransportKind;

use crate::otter;

/// Runs `otter` with its config file in `dir`.
fn run(dir: &std::path::Path, args: &[&str]) -> (i32, String, String) {
    let mut cmd = std::process::Command::new(otter());
    cmd.args(args)
        .env("OTTER_CONFIG", dir.join("otter.toml"))
        .env_remove("OTTER_HUB")
        .env_remove("OTTER_TOKEN");
    run_bounded(&mut cmd, Duration::from_secs(60))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn login_tokens_manifests_and_links() {
    let hub = TestHub::start().await;
    let token = hub.hub.mint_join_token("edge-1").unwrap();
    let agent = start_agent(&hub, "edge-1", "a1", &token, TransportKind::Quic);
    wait_connected(&hub.channel().await, &hub.admin_token, 1).await;
    let dir = tempfile::tempdir().unwrap();
    let hub_url = hub.api_url().to_string();
    let data = hub.data_dir();
    let (d, url, tok, ca) = (
        dir.path().to_owned(),
        hub_url.clone(),
        data.join("admin-token").display().to_string(),
        data.join("ca.crt").display().to_string(),
    );

    let out = tokio::task::spawn_blocking(move || {
        let mut results = Vec::new();
        // Without a login: one clear line, non-zero exit.
        let (code, _, err) = run(&d, &["links"]);
        assert_ne!(code, 0);
        assert!(err.contains("otter login"), "{err}");
        assert_eq!(err.trim().lines().count(), 1, "one line: {err}");

        // A wrong token is refused at login, nothing saved.
        let (code, _, err) = run(
            &d,
            &[
                "login",
                "--hub",
                &url,
                "--token",
                "ots_0000000000000000_nope",
                "--ca-file",
                &ca,
            ],
        );
        assert_ne!(code, 0, "{err}");
        assert!(!d.join("otter.toml").exists());

        let (code, out, err) = run(
            &d,
            &[
                "login",
                "--hub",
                &url,
                "--token-file",
                &tok,
                "--ca-file",
                &ca,
            ],
        );
        assert_eq!(code, 0, "{err}");
        assert!(out.contains("Logged in"), "{out}");
        let mode = std::fs::metadata(d.join("otter.toml"))
            .unwrap()
            .permissions();
        assert_eq!(
            std::os::unix::fs::PermissionsExt::mode(&mode) & 0o777,
            0o600
        );

        let (code, out, err) = run(&d, &["links"]);
        assert_eq!(code, 0, "{err}");
        let lines: Vec<&str> = out.lines().collect();
        assert!(
            lines[0].starts_with("CLUSTER") && lines[0].contains("TRANSPORT"),
            "{out}"
        );
        assert!(
            lines[1].starts_with("edge-1")
                && lines[1].contains("Connected")
                && lines[1].contains("quic"),
            "{out}"
        );
        let (code, out, _) = run(&d, &["links", "-o", "json"]);
        assert_eq!(code, 0);
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v[0]["cluster"], "edge-1");
        assert_eq!(v[0]["state"], "connected");
        assert_eq!(v[0]["tenant"], "default");
        let (_, out, _) = run(&d, &["links", "-o", "wide"]);
        assert!(out.contains("CERT EXPIRES") && out.contains("a1"), "{out}");
        let wide: Vec<&str> = out.lines().collect();
        assert!(
            wide[0].contains("TENANT") && wide[1].split_whitespace().any(|c| c == "default"),
            "{out}"
        );
        // Hub and agent share this machine's clock: a skew of milliseconds,
        // measured on the tunnel; renewals have not failed.
        assert!(
            wide[0].contains("SKEW") && wide[0].contains("RENEWAL"),
            "{out}"
        );
        // The report comes a moment after the tunnel is up.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let out = loop {
            let (_, out, _) = run(&d, &["links", "-o", "wide"]);
            // SKEW, RENEWAL and LABELS are the last columns.
            let skew_shown = out
                .lines()
                .nth(1)
                .and_then(|l| l.split_whitespace().rev().nth(2))
                .is_some_and(|c| c != "-");
            if skew_shown || std::time::Instant::now() > deadline {
                break out;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        };
        let wide: Vec<&str> = out.lines().collect();
        let cells: Vec<&str> = wide[1].split_whitespace().collect();
        let skew = cells[cells.len() - 3];
        assert!(
            skew.ends_with("ms") && skew[1..skew.len() - 2].parse::<u32>().is_ok(),
            "{out}"
        );
        assert_eq!(cells[cells.len() - 2], "ok", "{out}");
        assert_eq!(cells[cells.len() - 1], "<none>", "no labels: {out}");
        let (_, out, _) = run(&d, &["links", "-o", "json"]);
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        let diag = &v[0]["diagnosis"];
        assert!(
            diag["clockSkewMillis"].as_i64().unwrap().abs() < 1000,
            "{out}"
        );
        assert!(diag["reportedAt"].as_i64().is_some(), "{out}");

        // agent-manifest: only the URL by default (so $(…) works), YAML with -o yaml.
        let (code, out, err) = run(
            &d,
            &[
                "agent-manifest",
                "--cluster",
                "edge-2",
                "--extra-user",
                "carol",
            ],
        );
        assert_eq!(code, 0, "{err}");
        assert_eq!(out.lines().count(), 1);
        assert!(
            out.trim().starts_with(&format!("{}link/manifest/", url)),
            "{out}"
        );
        let (code, out, _) = run(&d, &["agent-manifest", "--cluster", "edge-2", "-o", "yaml"]);
        assert_eq!(code, 0);
        assert!(
            out.contains("kind: Deployment") && out.contains("value: edge-2"),
            "{out}"
        );
        let (code, _, err) = run(&d, &["agent-manifest", "--cluster", "Not_A_Name"]);
        assert_ne!(code, 0);
        assert!(err.contains("invalid"), "{err}");

        // token create (admin): the new token works, and it is no admin.
        let (code, out, err) = run(&d, &["token", "create", "dave", "--group", "devs"]);
        assert_eq!(code, 0, "{err}");
        let dave = out.trim().to_owned();
        assert!(dave.starts_with("ots_"), "{out}");
        let (code, _, err) = run(&d, &["links", "--token", &dave]);
        assert_eq!(code, 0, "{err}");
        let (code, _, err) = run(
            &d,
            &["agent-manifest", "--cluster", "edge-3", "--token", &dave],
        );
        assert_ne!(code, 0);
        assert!(err.contains("not an admin of any tenant"), "{err}");
        let (code, _, err) = run(&d, &["token", "create", "eve", "--token", &dave]);
        assert_ne!(code, 0);
        assert!(err.contains("not an admin of any tenant"), "{err}");
        results.push(dave);
        results
    })
    .await
    .unwrap();
    assert_eq!(out.len(), 1);
    agent.agent.shutdown().await;
    hub.hub.shutdown().await;
}

/// Runs `otter`, which must succeed; its output.
fn ok(dir: &std::path::Path, args: &[&str]) -> String {
    let (code, out, err) = run(dir, args);
    assert_eq!(code, 0, "otter {args:?}: {err}");
    out
}

/// Tenants through the CLI: an operator makes a tenant and names its
/// first admin; that admin mints a member, a manifest for its tenant, lists
/// and revokes tokens, and deletes its link; the member sees only its
/// tenant's links; nobody else sees the tenant's cluster.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_tokens_and_links_through_the_cli() {
    let hub = TestHub::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (d, url, tok, ca) = (
        dir.path().to_owned(),
        hub.api_url().to_string(),
        hub.data_dir().join("admin-token").display().to_string(),
        hub.data_dir().join("ca.crt").display().to_string(),
    );
    let (admin_token, member_token) = tokio::task::spawn_blocking({
        let d = d.clone();
        move || {
            let ok = |args: &[&str]| ok(&d, args);
            let login = |token_file: &str| {
                ok(&[
                    "login",
                    "--hub",
                    &url,
                    "--token-file",
                    token_file,
                    "--ca-file",
                    &ca,
                ]);
            };
            let save = |name: &str, token: &str| {
                let path = d.join(name);
                std::fs::write(&path, token).unwrap();
                path.display().to_string()
            };
            login(&tok);
            ok(&["tenant", "create", "acme"]);
            let (code, _, err) = run(&d, &["tenant", "create", "Not_A_Name"]);
            assert_ne!(code, 0);
            assert!(err.contains("lowercase"), "{err}");
            let list = ok(&["tenant", "list"]);
            assert!(list.contains("acme") && list.contains("default"), "{list}");
            let ann = ok(&[
                "token", "create", "ann", "--tenant", "acme", "--role", "admin",
            ]);
            let ann = ann.trim().to_owned();
            // A second admin is for ann to name, not the operator.
            let (code, _, err) = run(
                &d,
                &[
                    "token", "create", "x", "--tenant", "acme", "--role", "admin",
                ],
            );
            assert_ne!(code, 0);
            assert!(err.contains("first admin"), "{err}");

            login(&save("ann", &ann));
            let mel = ok(&["token", "create", "mel", "--group", "devs", "--ttl", "30d"]);
            let list = ok(&["token", "list"]);
            assert!(
                list.contains("acme:admin") && list.contains("acme:member"),
                "{list}"
            );
            assert!(list.contains("in 29d") || list.contains("in 30d"), "{list}");
            let url = ok(&["agent-manifest", "--cluster", "acme-1"]);
            assert!(url.contains("/link/manifest/"), "{url}");
            let (code, _, err) = run(
                &d,
                &[
                    "agent-manifest",
                    "--cluster",
                    "acme-1",
                    "--tenant",
                    "default",
                ],
            );
            assert_ne!(code, 0);
            assert!(err.contains("not an admin of tenant"), "{err}");
            (ann, mel.trim().to_owned())
        }
    })
    .await
    .unwrap();

    let join = hub.hub.mint_join_token_in("acme-1", "acme").unwrap();
    let agent = start_agent(&hub, "acme-1", "a1", &join, TransportKind::H2);
    wait_connected(&hub.channel().await, &admin_token, 1).await;
    let root = hub.admin_token.clone();
    tokio::task::spawn_blocking(move || {
        let ok = |args: &[&str]| ok(&d, args);
        let links = |token: &str| ok(&["links", "-o", "json", "--token", token]);
        let mel_sees: serde_json::Value = serde_json::from_str(&links(&member_token)).unwrap();
        assert_eq!(mel_sees.as_array().map(Vec::len), Some(1), "{mel_sees}");
        assert_eq!(mel_sees[0]["cluster"], "acme-1");
        assert!(mel_sees[0]["agentId"].is_null(), "{mel_sees}");
        // The operator holds no standing access.
        let root_sees: serde_json::Value = serde_json::from_str(&links(&root)).unwrap();
        assert_eq!(root_sees, serde_json::json!([]));
        let (code, _, err) = run(
            &d,
            &["get", "pods", "--cluster", "acme-1", "--token", &root],
        );
        assert_ne!(code, 0);
        assert!(err.contains("acme-1 is not registered"), "{err}");

        // Revoking mel's token; deleting the link.
        let listed = ok(&["token", "list", "-o", "json", "--token", &admin_token]);
        let listed: serde_json::Value = serde_json::from_str(&listed).unwrap();
        let id = listed
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["name"] == "mel")
            .unwrap()["id"]
            .as_str()
            .unwrap()
            .to_owned();
        ok(&["token", "revoke", &id, "--token", &admin_token]);
        let (code, _, err) = run(&d, &["links", "--token", &member_token]);
        assert_ne!(code, 0);
        assert!(err.contains("revoked"), "{err}");
        let out = ok(&["links", "delete", "acme-1", "--token", &admin_token]);
        assert!(out.contains("deleted"), "{out}");
        let left: serde_json::Value = serde_json::from_str(&links(&admin_token)).unwrap();
        assert_eq!(left, serde_json::json!([]));
        // An empty tenant can go.
        ok(&["tenant", "delete", "acme", "--token", &root]);
        // This hub keeps no audit log, and says how to get one.
        let (code, _, err) = run(&d, &["audit", "--since", "2h", "--token", &root]);
        assert_ne!(code, 0);
        assert!(err.contains("--audit-log"), "{err}");
    })
    .await
    .unwrap();
    agent.agent.shutdown().await;
    hub.hub.shutdown().await;
}

/// `make release` packages the binaries: one folder named with the
/// version, both binaries stripped (and still running, reporting that
/// version), and a SHA256SUMS that `sha256sum -c` accepts. Run here on the
/// binaries this test build made (the release build itself is the same
/// command with `--release`).
/// A `--tls-ca-file` that cannot be read, or holds no certificate, is
/// said at start with the file's name, before anything is bound (it used
/// to surface as an internal error at the first manifest).
#[test]
fn a_wrong_api_ca_file_is_said_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let ca = otter_pki::CertificateAuthority::generate("a public CA").unwrap();
    let (cert, key) = ca.issue_server_cert(&["localhost".to_owned()]).unwrap();
    let file = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        path.display().to_string()
    };
    let (cert, key) = (file("tls.crt", &cert), file("tls.key", &key));
    let not_pem = file("not-a-ca.crt", "hello");
    let missing = dir.path().join("missing-ca.crt").display().to_string();
    let data = dir.path().join("data").display().to_string();
    for (ca_file, says) in [(&missing, "cannot read"), (&not_pem, "no PEM certificate")] {
        let (code, _, err) = run(
            dir.path(),
            &[
                "hub",
                "--data-dir",
                &data,
                "--listen",
                "127.0.0.1:0",
                "--tunnel-listen",
                "127.0.0.1:0",
                "--tls-cert-file",
                &cert,
                "--tls-key-file",
                &key,
                "--tls-ca-file",
                ca_file,
            ],
        );
        assert_eq!(code, 64, "{err}");
        assert!(
            err.contains(ca_file.as_str()) && err.contains(says),
            "{err}"
        );
    }
}

#[test]
fn release_packages_both_binaries_with_their_checksums() {
    let bins = otter().parent().unwrap().to_owned();
    if !bins.join("otter-agent").exists() {
        otter_e2e::tool_missing(
            "the otter-agent binary of this build (cargo test --workspace builds it)",
        );
        return;
    }
    let out = tempfile::tempdir().unwrap();
    let script = otter_e2e::tools::workspace_root().join("scripts/release.sh");
    let (code, stdout, stderr) = otter_e2e::run_bounded(
        std::process::Command::new(script)
            .env("OTTER_RELEASE_BINS", &bins)
            .env("OTTER_RELEASE_DIR", out.path()),
        std::time::Duration::from_secs(120),
    );
    assert_eq!(code, 0, "{stdout}{stderr}");
    let folder = std::path::PathBuf::from(stdout.trim().lines().last().unwrap());
    let version = format!("v{}", env!("CARGO_PKG_VERSION"));
    assert!(
        folder
            .file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with(&format!("otterscale-link-{version}-")),
        "{folder:?}"
    );
    let (code, said, err) = otter_e2e::run_bounded(
        std::process::Command::new("sha256sum")
            .args(["-c", "SHA256SUMS"])
            .current_dir(&folder),
        std::time::Duration::from_secs(60),
    );
    assert_eq!(code, 0, "{said}{err}");
    assert_eq!(said.matches(": OK").count(), 2, "{said}");
    for b in ["otter", "otter-agent"] {
        let packed = std::fs::metadata(folder.join(b)).unwrap().len();
        let built = std::fs::metadata(bins.join(b)).unwrap().len();
        assert!(
            packed < built,
            "{b} not stripped: {packed} of {built} bytes"
        );
    }
    let (_, short, _) = otter_e2e::run_bounded(
        std::process::Command::new(folder.join("otter")).args(["version", "--short"]),
        std::time::Duration::from_secs(30),
    );
    assert_eq!(short.trim(), version);
    let (_, agent, _) = otter_e2e::run_bounded(
        std::process::Command::new(folder.join("otter-agent")).arg("--version"),
        std::time::Duration::from_secs(30),
    );
    assert_eq!(
        agent.trim(),
        format!("otter-agent {}", env!("CARGO_PKG_VERSION"))
    );
}
