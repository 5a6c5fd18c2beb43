//! The Connect endpoints as `openapi/openapi.yaml` describes them, checked
//! by schemathesis (property-based: requests generated from the schema, valid
//! and invalid) against a real hub with a test-double agent: no 5xx, status
//! codes and response bodies as the description says.
//!
//! Needs the venv (`scripts/setup.sh python`); without it the test prints
//! why and passes, unless `OTTER_REQUIRE_TOOLS=1` (set by `make test`).

use std::{sync::Arc, time::Duration};

use otter_e2e::{
    TestHub,
    double::{start_agent, wait_connected},
    tools::{self, run_bounded},
};
use otter_tunnel::TransportKind;
use tokio::process::Command;

/// Bound of the whole schemathesis run.
const RUN_LIMIT: Duration = Duration::from_secs(300);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schemathesis_finds_no_server_errors_or_schema_violations() {
    let Some(python) = tools::venv_python() else {
        return;
    };
    let schemathesis = python.with_file_name("schemathesis");
    let Some(schemathesis) = tools::tool(
        schemathesis,
        "schemathesis",
        "run `scripts/setup.sh python`",
    ) else {
        return;
    };
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let hub = TestHub::start_with(dir, None, |_| {}).await;
    let join = hub.hub.mint_join_token("edge-1").unwrap();
    let _agent = start_agent(&hub, "edge-1", "a1", &join, TransportKind::H2);
    wait_connected(&hub.channel().await, &hub.admin_token, 1).await;
    let work = tempfile::tempdir().unwrap();
    let ca = work.path().join("hub-ca.crt");
    std::fs::write(&ca, hub.hub.ca_pem()).unwrap();
    let report = work.path().join("report.json");

    let out = run_bounded(
        Command::new(&schemathesis)
            .current_dir(work.path())
            .arg("--config-file")
            .arg(tools::workspace_root().join("tests/e2e/clients/schemathesis.toml"))
            .arg("run")
            .arg(tools::workspace_root().join("openapi/openapi.yaml"))
            .args(["--url", hub.api_url().as_str().trim_end_matches('/')])
            .args(["-H", &format!("Authorization: Bearer {}", hub.admin_token)])
            .arg("--tls-verify")
            .arg(&ca)
            .args([
                "--checks",
                "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance",
                "--phases",
                "examples,coverage,fuzzing",
                "--max-examples",
                "15",
                "--seed",
                "20261129",
                // One worker: with two, one request once failed as a network
                // error under load (the connection closed under it; not a
                // 5xx). Not yet explained; see docs/architecture.md.
                "--workers",
                "1",
                "--request-timeout",
                "10",
                "--generation-database",
                "none",
                "--no-color",
                "--report",
                "json",
                "--report-json-path",
            ])
            .arg(&report),
        RUN_LIMIT,
    )
    .await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "schemathesis found problems ({}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    // It really ran: every described operation, many requests, and calls
    // that reached the agent through the hub.
    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&report).expect("schemathesis report"))
            .expect("report is JSON");
    let ops = &report["operations"];
    assert_eq!(ops["tested"], ops["total"], "{ops}");
    assert!(ops["total"].as_u64() >= Some(20), "{ops}");
    assert_eq!(report["failures"], serde_json::json!([]));
    assert_eq!(report["errors"], serde_json::json!([]));
    let cases = &report["test_cases"];
    assert!(cases["generated"].as_u64() > Some(200), "{cases}");
    assert_eq!(cases["unique_failures"], 0, "{cases}");
    for op in [
        "POST /otterscale.link.v1.LinkService/ListLinks",
        "POST /otterscale.resource.v1.ResourceService/Get",
        "POST /otterscale.resource.v1.ResourceService/Apply",
    ] {
        let accepted: u64 = ["coverage", "fuzzing"]
            .iter()
            .filter_map(|phase| report["valid_rates"][op][phase]["accepted"].as_u64())
            .sum();
        assert!(
            accepted > 0,
            "no request of {op} was accepted: {}",
            report["valid_rates"][op]
        );
    }
    hub.hub.shutdown().await;
}
