//! The `otter` CLI over many clusters: `otter links label`, the LABELS
//! column of `otter links -o wide`, and `otter get --clusters SELECTOR`
//! (one table with a CLUSTER column, `-o json` for scripts, each failed
//! cluster on stderr and in the exit code).

use std::time::Duration;

use otter_e2e::{
    kube::{KubeEnv, kube_agent, sim_config},
    run_bounded,
};
use otter_tunnel::TransportKind;

use crate::otter;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_over_the_clusters_a_selector_picks() {
    let env = KubeEnv::start(sim_config().pod("default", "web-0", &["web"]).pod(
        "kube-system",
        "dns-0",
        &["dns"],
    ))
    .await;
    // Two more clusters on the same test server; edge-3 then goes offline.
    let mut agents = Vec::new();
    for cluster in ["edge-2", "edge-3"] {
        let token = env.hub.hub.mint_join_token(cluster).unwrap();
        agents.push(
            kube_agent(
                &env.hub,
                &env.sim,
                cluster,
                &token,
                TransportKind::H2,
                |_| {},
            )
            .await,
        );
    }
    agents.pop().unwrap().shutdown().await;

    let dir = tempfile::tempdir().unwrap();
    let data = env.hub.data_dir();
    let (d, url) = (dir.path().to_owned(), env.hub.api_url().to_string());
    tokio::task::block_in_place(|| {
        let run = |args: &[&str]| {
            let mut c = std::process::Command::new(otter());
            c.args(args).env("OTTER_CONFIG", d.join("otter.toml"));
            run_bounded(&mut c, Duration::from_secs(60))
        };
        let tok = data.join("admin-token").display().to_string();
        let ca = data.join("ca.crt").display().to_string();
        let (code, _, err) = run(&[
            "login",
            "--hub",
            &url,
            "--token-file",
            &tok,
            "--ca-file",
            &ca,
        ]);
        assert_eq!(code, 0, "{err}");

        let (code, out, err) = run(&["links", "label", "edge-1", "env=prod", "region=eu", "tmp=1"]);
        assert_eq!(code, 0, "{err}");
        assert!(out.contains("env=prod,region=eu,tmp=1"), "{out}");
        let (code, out, err) = run(&["links", "label", "edge-1", "tmp-"]);
        assert_eq!(code, 0, "{err}");
        assert!(
            out.contains("env=prod,region=eu") && !out.contains("tmp"),
            "{out}"
        );
        for cluster in ["edge-2", "edge-3"] {
            let (code, _, err) = run(&["links", "label", cluster, "env=prod"]);
            assert_eq!(code, 0, "{err}");
        }
        // Refused with kubectl's syntax in the message.
        let (code, _, err) = run(&["links", "label", "edge-1", "just-a-word"]);
        assert!(code != 0 && err.contains("key=value"), "{err}");
        let (code, _, err) = run(&["links", "label", "edge-1", "x.=1"]);
        assert!(code != 0 && err.contains("not valid"), "{err}");

        // One link, described: its labels one per line, no doctor run.
        let (code, out, err) = run(&["links", "describe", "edge-1"]);
        assert_eq!(code, 0, "{err}");
        let field = |name: &str| {
            out.lines()
                .find(|l| l.starts_with(&format!("{name}:")))
                .map(|l| l[name.len() + 1..].trim().to_owned())
                .unwrap_or_else(|| panic!("no {name} in\n{out}"))
        };
        assert_eq!(field("Name"), "edge-1");
        assert_eq!(field("State"), "Connected");
        assert_eq!(field("Transport"), "h2");
        assert_eq!(field("Labels"), "env=prod");
        assert!(out.contains("\n                 region=eu\n"), "{out}");
        assert!(field("Doctor").starts_with("<none>"), "{out}");
        assert!(
            out.contains("Diagnosis:\n  Proxy:           direct"),
            "{out}"
        );
        let (code, _, err) = run(&["links", "describe", "edge-9"]);
        assert!(code != 0 && err.contains("not registered"), "{err}");

        let (code, out, err) = run(&["links", "-o", "wide"]);
        assert_eq!(code, 0, "{err}");
        assert!(out.lines().next().unwrap().contains("LABELS"), "{out}");
        let row = out.lines().find(|l| l.starts_with("edge-1")).unwrap();
        assert!(row.ends_with("env=prod,region=eu"), "{row}");

        // One table over every prod cluster: each cluster's pods, the
        // offline one named on stderr and in the exit code.
        let (code, out, err) = run(&["get", "pods", "-A", "--clusters", "env=prod"]);
        assert_eq!(code, 1, "{out}\n{err}");
        let mut lines = out.lines();
        let header: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
        assert_eq!(&header[..3], ["CLUSTER", "NAMESPACE", "NAME"], "{out}");
        let rows: Vec<Vec<&str>> = lines.map(|l| l.split_whitespace().collect()).collect();
        let cells: Vec<(&str, &str, &str)> = rows.iter().map(|r| (r[0], r[1], r[2])).collect();
        assert_eq!(
            cells,
            [
                ("edge-1", "default", "web-0"),
                ("edge-1", "kube-system", "dns-0"),
                ("edge-2", "default", "web-0"),
                ("edge-2", "kube-system", "dns-0"),
            ],
            "{out}"
        );
        assert!(err.contains("cluster edge-3: unavailable"), "{err}");
        assert!(err.contains("1 of 3 clusters"), "{err}");

        // For scripts: one JSON document, a result per cluster.
        let (code, out, err) = run(&["get", "pods", "--clusters", "region=eu", "-o", "json"]);
        assert_eq!(code, 0, "{err}");
        let doc: serde_json::Value = serde_json::from_str(&out).unwrap();
        let clusters = doc["clusters"].as_array().unwrap();
        assert_eq!(clusters.len(), 1, "{doc}");
        assert_eq!(clusters[0]["cluster"], "edge-1");
        assert_eq!(clusters[0]["items"][0]["metadata"]["name"], "web-0");

        // One named object on each cluster.
        let (code, out, err) = run(&["get", "pod", "web-0", "--clusters", "env=prod,!region"]);
        assert_eq!(code, 1, "{err}");
        assert!(
            out.lines()
                .any(|l| l.starts_with("edge-2") && l.contains("web-0")),
            "{out}"
        );
        assert!(!out.contains("edge-1"), "{out}");

        // A selector kubectl would refuse is refused.
        let (code, _, err) = run(&["get", "pods", "--clusters", "env in prod"]);
        assert!(code != 0 && err.contains("selector"), "{err}");
        // No cluster matches: said so.
        let (code, _, err) = run(&["get", "pods", "--clusters", "env=nowhere"]);
        assert!(
            code != 0 && err.contains("no connected cluster matches"),
            "{err}"
        );

        // Enrollment labels: the manifest is made with them.
        let (code, _, err) = run(&[
            "agent-manifest",
            "--cluster",
            "edge-4",
            "--label",
            "env=staging",
            "-o",
            "yaml",
        ]);
        assert_eq!(code, 0, "{err}");
        let (code, _, err) = run(&["agent-manifest", "--cluster", "edge-5", "--label", "a=b/c"]);
        assert!(code != 0 && err.contains("not valid"), "{err}");
    });
    for agent in agents {
        agent.shutdown().await;
    }
    env.shutdown().await;
}
