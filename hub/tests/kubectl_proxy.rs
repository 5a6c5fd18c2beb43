//! Plain kubectl through the hub: `otter kubeconfig` writes the context,
//! kubectl 1.33 talks to `/clusters/edge-1/…` on the hub, the request rides
//! a tunnel stream to the agent, and the agent sends it to the cluster's
//! apiserver (the test server) impersonating the caller, so the cluster's
//! RBAC decides.

use std::{path::PathBuf, time::Duration};

use otter_e2e::{
    TestHub,
    double::{WAIT, wait_connected},
    kubectl_133, run_bounded, run_for, tool_missing,
};

fn otter() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_otter"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_through_the_hub() {
    let Some(kubectl) = kubectl_133() else {
        tool_missing("kubectl 1.33");
        return;
    };
    // The member cluster: hub admins may do anything, bob only read pods.
    let cfg = kube_sim::SimConfig::default_with_admin()
        .allow("group:otterscale:admins", &["*"], &["*"], &["*"])
        .allow(
            "user:bob",
            &["get", "list", "watch"],
            &["pods"],
            &["default"],
        )
        .pod("default", "web-0", &["web"]);
    let sim = kube_sim::KubeSim::start(cfg).await.unwrap();
    let hub = TestHub::start().await;
    let join = hub.hub.mint_join_token("edge-1").unwrap();

    // The agent talks to its apiserver with its own (impersonating) identity.
    let kubeconfig =
        kube::config::Kubeconfig::from_yaml(&sim.kubeconfig_yaml(kube_sim::ADMIN_TOKEN)).unwrap();
    let kcfg = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .unwrap();
    let proxy = otter_agent::kube_proxy::KubeProxy::new(kube::Client::try_from(kcfg).unwrap());
    let mut config = otter_agent::AgentConfig::new(hub.api_url(), "edge-1", "a1", hub.hub.ca_pem());
    config.join_token = otter_agent::config::Secret(join);
    let agent = otter_agent::Agent::start_with_proxy(
        config,
        tonic::service::Routes::default(),
        Some(proxy),
    )
    .unwrap();
    agent
        .wait_for(WAIT, |s| s.connected.is_some())
        .await
        .expect("agent connects");
    wait_connected(&hub.channel().await, &hub.admin_token, 1).await;

    let dir = tempfile::tempdir().unwrap();
    let data = hub.data_dir();
    let kube_path = dir.path().join("kubeconfig");
    let bob = hub.hub.mint_api_token("bob", &["devs".into()]).unwrap();
    let (url, tok, ca) = (
        hub.api_url().to_string(),
        data.join("admin-token"),
        data.join("ca.crt"),
    );
    let sim_handle = &sim;
    let (d, kp) = (dir.path().to_owned(), kube_path.clone());
    let otter_cmd = move |args: &[&str]| {
        let mut cmd = std::process::Command::new(otter());
        cmd.args(args).env("OTTER_CONFIG", d.join("otter.toml"));
        run_bounded(&mut cmd, Duration::from_secs(60))
    };
    let k = move |args: &[&str]| {
        let mut cmd = std::process::Command::new(&kubectl);
        cmd.arg("--kubeconfig").arg(&kp).args(args);
        cmd
    };

    let outputs = tokio::task::block_in_place(|| {
        let (code, _, err) = otter_cmd(&[
            "login",
            "--hub",
            &url,
            "--token-file",
            tok.to_str().unwrap(),
            "--ca-file",
            ca.to_str().unwrap(),
        ]);
        assert_eq!(code, 0, "{err}");
        let (code, out, err) = otter_cmd(&[
            "kubeconfig",
            "--cluster",
            "edge-1",
            "--kubeconfig",
            kube_path.to_str().unwrap(),
        ]);
        assert_eq!(code, 0, "{err}");
        assert!(out.contains("otter-edge-1"), "{out}");

        let run = |args: &[&str]| run_bounded(&mut k(args), Duration::from_secs(60));
        // Discovery (aggregated), list.
        let (code, out, err) = run(&["get", "pods", "-A"]);
        assert_eq!(code, 0, "{err}");
        assert!(out.contains("web-0"), "{out}");
        // Server-side apply, patch, delete.
        let cm = r#"{"apiVersion":"v1","kind":"ConfigMap","metadata":{"name":"cm1","namespace":"default"},"data":{"k":"v1"}}"#;
        let cm_file = dir.path().join("cm.json");
        std::fs::write(&cm_file, cm).unwrap();
        let (code, out, err) = run(&["apply", "--server-side", "-f", cm_file.to_str().unwrap()]);
        assert_eq!(code, 0, "{err}");
        assert!(out.contains("configmap/cm1 serverside-applied"), "{out}");
        let (code, out, err) = run(&[
            "patch",
            "configmap",
            "cm1",
            "--type",
            "merge",
            "-p",
            r#"{"data":{"k":"v2"}}"#,
        ]);
        assert_eq!(code, 0, "{err}");
        assert!(out.contains("configmap/cm1 patched"), "{out}");
        let (code, out, _) = run(&["get", "configmap", "cm1", "-o", "jsonpath={.data.k}"]);
        assert_eq!((code, out.as_str()), (0, "v2"));
        // Workloads: create, scale, rollout restart.
        let (code, _, err) = run(&["create", "deployment", "web", "--image=nginx"]);
        assert_eq!(code, 0, "{err}");
        let (code, out, err) = run(&["scale", "deployment", "web", "--replicas=3"]);
        assert_eq!(code, 0, "{err}");
        assert!(out.contains("deployment.apps/web scaled"), "{out}");
        let (code, out, err) = run(&["rollout", "restart", "deployment", "web"]);
        assert_eq!(code, 0, "{err}");
        assert!(out.contains("restarted"), "{out}");
        let (code, out, _) = run(&["delete", "configmap", "cm1"]);
        assert_eq!(code, 0);
        assert!(out.contains("deleted"), "{out}");

        // Who the cluster sees: the hub's verified caller, impersonated.
        let (code, out, err) = run(&["auth", "whoami"]);
        assert_eq!(code, 0, "{err}");
        assert!(
            out.contains("admin") && out.contains("otterscale:admins"),
            "{out}"
        );

        // Watch and follow, for a bounded time, while things happen.
        let watcher = std::thread::spawn({
            let mut cmd = k(&["get", "pods", "-w"]);
            move || run_for(&mut cmd, Duration::from_secs(4))
        });
        std::thread::sleep(Duration::from_millis(1500));
        let pod = r#"{"apiVersion":"v1","kind":"Pod","metadata":{"name":"late","namespace":"default"},"spec":{"containers":[{"name":"c","image":"x"}]}}"#;
        let pod_file = dir.path().join("pod.json");
        std::fs::write(&pod_file, pod).unwrap();
        let (code, _, err) = run(&["create", "-f", pod_file.to_str().unwrap()]);
        assert_eq!(code, 0, "{err}");
        let (watched, _) = watcher.join().unwrap();
        assert!(
            watched.contains("web-0") && watched.contains("late"),
            "get -w saw: {watched}"
        );
        let follower = std::thread::spawn({
            let mut cmd = k(&["logs", "-f", "web-0"]);
            move || run_for(&mut cmd, Duration::from_secs(3))
        });
        std::thread::sleep(Duration::from_millis(1000));
        sim_handle.append_log("default", "web-0", "web", "hello through the hub");
        let (logs, _) = follower.join().unwrap();
        assert!(
            logs.contains("hello through the hub"),
            "logs -f saw: {logs:?}"
        );

        // A forbidden action fails the usual way, with the cluster's message.
        let (code, _, err) = run(&["--token", &bob, "get", "secrets"]);
        assert_ne!(code, 0);
        assert!(
            err.contains("Forbidden")
                && err.contains("User \"bob\" cannot list resource \"secrets\""),
            "{err}"
        );
        let (code, out, _) = run(&["--token", &bob, "get", "pods"]);
        assert_eq!(code, 0);
        assert!(out.contains("web-0"));
        // A client cannot pick its identity: kubectl's --as is dropped at the hub.
        let (code, out, _) = run(&["--token", &bob, "auth", "whoami", "--as", "admin"]);
        assert!(
            code != 0 || !out.contains("otterscale:admins"),
            "impersonation headers passed through: {out}"
        );
        // The same through the exec credential plugin (`otter token get`).
        let exec_kube = dir.path().join("kubeconfig-exec");
        let (code, _, err) = otter_cmd(&[
            "kubeconfig",
            "--cluster",
            "edge-1",
            "--exec-plugin",
            "--kubeconfig",
            exec_kube.to_str().unwrap(),
        ]);
        assert_eq!(code, 0, "{err}");
        let text = std::fs::read_to_string(&exec_kube).unwrap();
        assert!(
            text.contains("exec:") && !text.contains("ots_"),
            "no token stored with the plugin: {text}"
        );
        let mut with_plugin = std::process::Command::new(kubectl_133().unwrap());
        with_plugin
            .arg("--kubeconfig")
            .arg(&exec_kube)
            .args(["get", "pods"]);
        let (code, out, err) = run_bounded(&mut with_plugin, Duration::from_secs(60));
        assert_eq!(code, 0, "{err}");
        assert!(out.contains("web-0"), "{out}");

        // A bad token is refused at the hub.
        let (code, _, err) = run(&["--token", "ots_0000000000000000_bad", "get", "pods"]);
        assert_ne!(code, 0);
        assert!(
            err.contains("Unauthorized") || err.contains("logged in"),
            "{err}"
        );
        watched
    });
    assert!(!outputs.is_empty());
    agent.shutdown().await;
    sim.shutdown().await;
    hub.hub.shutdown().await;
}
