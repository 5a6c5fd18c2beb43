//! The hub's own Watch resume: a relay in front of the hub's tunnel port
//! stops carrying bytes for longer than the keepalive timeout while objects
//! are created, then carries them again. The caller's stream (a plain
//! Watch, no client-side resume) stays open throughout and gets every
//! object once, in order; the hub counts the resume.

use std::time::Duration;

use otter_e2e::{
    double::event_name,
    kube::{KubeEnv, configmap, kube_agent_with, sim_config, within},
    with_token,
};
use otter_proto::resource::v1::watch_event::Type;
use otter_tunnel::TransportKind;

/// Reads `watch` until an ADDED event of `want` came, noting the names of
/// the ADDED events in `seen`.
async fn until_added(
    watch: &mut tonic::Streaming<otter_proto::resource::v1::WatchEvent>,
    want: &str,
    seen: &mut Vec<String>,
) {
    within(want, async {
        while !seen.iter().any(|n| n == want) {
            let ev = watch
                .message()
                .await
                .unwrap_or_else(|e| panic!("the watch failed: {e:?}; saw {seen:?}"))
                .unwrap_or_else(|| panic!("the watch ended; saw {seen:?}"));
            if ev.r#type == Some(Type::Added as i32) {
                seen.push(event_name(&ev));
            }
        }
    })
    .await;
}

/// A List of the ConfigMaps, then a Watch from the version it ended at.
async fn watch_after_list(
    env: &KubeEnv,
    token: &str,
) -> tonic::Streaming<otter_proto::resource::v1::WatchEvent> {
    let list = env
        .resources()
        .list(with_token(env.list_configmaps(), token))
        .await
        .unwrap()
        .into_inner();
    env.resources()
        .watch(with_token(
            env.watch_configmaps(list.resource_version),
            token,
        ))
        .await
        .unwrap()
        .into_inner()
}

async fn held_across_a_dead_tunnel(transport: TransportKind) {
    let (relay, env) = KubeEnv::behind_relay(transport, sim_config(), |_| {}).await;
    let token = env.admin_token().to_owned();
    env.sim.create_object(configmap("cm-before")).unwrap();
    let mut watch = watch_after_list(&env, &token).await;
    let mut seen = Vec::new();
    let mut until_seen =
        async |want: &str, seen: &mut Vec<String>| until_added(&mut watch, want, seen).await;
    for i in 0..2 {
        let n = format!("cm-live-{i}");
        env.sim.create_object(configmap(&n)).unwrap();
        until_seen(&n, &mut seen).await;
    }

    env.cut(&relay, |sim| {
        for i in 0..4 {
            sim.create_object(configmap(&format!("cm-cut-{i}")))
                .unwrap();
        }
    })
    .await;
    relay.freeze(false);
    until_seen("cm-cut-3", &mut seen).await;
    env.sim.create_object(configmap("cm-after")).unwrap();
    until_seen("cm-after", &mut seen).await;

    let expected: Vec<String> = ["cm-live-0", "cm-live-1"]
        .into_iter()
        .map(str::to_owned)
        .chain((0..4).map(|i| format!("cm-cut-{i}")))
        .chain(["cm-after".to_owned()])
        .collect();
    let resumes = env.hub.hub.state.metrics.streams_resumed.get();
    eprintln!(
        "{transport}: {} events on one stream, {resumes} resume(s) by the hub",
        seen.len()
    );
    assert_eq!(seen, expected, "lost or repeated events");
    assert!(resumes >= 1, "the tunnel died but the hub resumed nothing");
    drop(watch);
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_hub_holds_a_watch_across_a_dead_tunnel_over_quic() {
    held_across_a_dead_tunnel(TransportKind::Quic).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_hub_holds_a_watch_across_a_dead_tunnel_over_h2() {
    held_across_a_dead_tunnel(TransportKind::H2).await;
}

/// A transport switch forced by the path: the agent's QUIC tunnel dies
/// when the relay goes silent, and when the path comes back UDP no longer
/// passes, so the agent comes back over TLS + HTTP/2. The Watch and a
/// followed log through the hub go on over the new transport, every change
/// and every line once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_goes_on_across_a_switch_from_quic_to_h2() {
    use otter_proto::runtime::v1::PodLogRequest;
    let relay = otter_e2e::Relay::start().await;
    let port = relay.addr.port();
    let sim = kube_sim::KubeSim::start(sim_config().pod("default", "web", &["app"]))
        .await
        .unwrap();
    let dir = std::sync::Arc::new(tempfile::tempdir().unwrap());
    let hub = otter_e2e::TestHub::start_with(dir, None, |c| {
        c.tunnel_urls = ["quic", "h2"]
            .iter()
            .map(|t| url::Url::parse(&format!("{t}://localhost:{port}")).unwrap())
            .collect();
    })
    .await;
    relay.set_target(hub.hub.tunnel_addr);
    let token = hub.hub.mint_join_token("edge-1").unwrap();
    let agent = kube_agent_with(
        &hub,
        &sim.kubeconfig_yaml(kube_sim::ADMIN_TOKEN),
        "edge-1",
        &token,
        &[TransportKind::Quic, TransportKind::H2],
        |_| {},
    )
    .await;
    let channel = hub.channel().await;
    let env = KubeEnv {
        hub,
        sim,
        agent,
        channel,
        cluster: "edge-1".into(),
    };
    let admin = env.admin_token().to_owned();
    let transport = async || {
        otter_e2e::double::link_of(&env.channel, &admin, "edge-1")
            .await
            .transport
            .unwrap_or_default()
    };
    assert_eq!(transport().await, "quic");
    let mut watch = env
        .resources()
        .watch(with_token(env.watch_configmaps(None), &admin))
        .await
        .unwrap()
        .into_inner();
    let mut seen = Vec::new();
    let mut until_seen =
        async |want: &str, seen: &mut Vec<String>| until_added(&mut watch, want, seen).await;
    let mut log = env
        .runtime()
        .pod_log(with_token(
            PodLogRequest {
                cluster: Some(env.cluster.clone()),
                namespace: Some("default".into()),
                name: Some("web".into()),
                follow: Some(true),
                ..Default::default()
            },
            &admin,
        ))
        .await
        .expect("log")
        .into_inner();
    let mut text = String::new();
    let mut until_line = async |want: &str, text: &mut String| {
        within(want, async {
            while !text.lines().any(|l| l == want) {
                let chunk = log
                    .message()
                    .await
                    .unwrap_or_else(|e| panic!("the log failed: {e:?}; got {text:?}"))
                    .unwrap_or_else(|| panic!("the log ended; got {text:?}"));
                text.push_str(&String::from_utf8_lossy(&chunk.data.unwrap_or_default()));
            }
        })
        .await;
    };
    env.sim.create_object(configmap("cm-quic")).unwrap();
    env.sim.append_log("default", "web", "app", "cm-quic");
    until_seen("cm-quic", &mut seen).await;
    until_line("cm-quic", &mut text).await;
    env.cut(&relay, |sim| {
        sim.create_object(configmap("cm-cut")).unwrap();
        sim.append_log("default", "web", "app", "cm-cut");
    })
    .await;
    relay.block_udp(true);
    relay.freeze(false);
    env.agent
        .wait_for(Duration::from_secs(60), |s| s.connected.is_some())
        .await
        .expect("the agent comes back");
    until_seen("cm-cut", &mut seen).await;
    until_line("cm-cut", &mut text).await;
    env.sim.create_object(configmap("cm-h2")).unwrap();
    env.sim.append_log("default", "web", "app", "cm-h2");
    until_seen("cm-h2", &mut seen).await;
    until_line("cm-h2", &mut text).await;
    assert_eq!(transport().await, "h2", "the agent switched transports");
    assert_eq!(
        seen,
        ["cm-quic", "cm-cut", "cm-h2"],
        "lost or repeated events"
    );
    let lines: Vec<&str> = text.lines().filter(|l| l.starts_with("cm-")).collect();
    assert_eq!(
        lines,
        ["cm-quic", "cm-cut", "cm-h2"],
        "lost or repeated lines"
    );
    // The Watch and the log, each opened again once at least.
    assert!(env.hub.hub.state.metrics.streams_resumed.get() >= 2);
    drop((watch, log));
    env.shutdown().await;
}

/// A Watch whose resourceVersion the cluster compacted away while the
/// tunnel was down: resuming it gets the apiserver's 410, which reaches the
/// caller as an ERROR event (telling it to list again) and ends the stream,
/// instead of the stream going on with changes missing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_whose_version_expired_meanwhile_tells_the_caller_to_list_again() {
    let (relay, env) = KubeEnv::behind_relay(TransportKind::H2, sim_config(), |_| {}).await;
    let admin = env.admin_token().to_owned();
    env.sim.create_object(configmap("cm-before")).unwrap();
    let mut watch = watch_after_list(&env, &admin).await;
    env.cut(&relay, |sim| {
        sim.create_object(configmap("cm-cut")).unwrap();
        sim.compact();
    })
    .await;
    relay.freeze(false);
    let mut events = Vec::new();
    let ended = within("the resumed watch", async {
        loop {
            match watch.message().await {
                Ok(Some(ev)) => events.push(ev),
                Ok(None) => break None,
                Err(e) => break Some(e),
            }
        }
    })
    .await;
    let errors: Vec<_> = events
        .iter()
        .filter(|e| e.r#type == Some(Type::Error as i32))
        .collect();
    assert_eq!(errors.len(), 1, "{events:?}");
    let status = otter_proto::json::struct_to_json(
        errors[0]
            .resource
            .as_ref()
            .unwrap()
            .object
            .as_ref()
            .unwrap(),
    );
    assert_eq!(status["code"], 410, "{status}");
    assert_eq!(status["kind"], "Status", "{status}");
    assert!(
        ended.is_none(),
        "the stream ends after the ERROR event: {ended:?}"
    );
    assert!(
        !events
            .iter()
            .any(|e| e.r#type == Some(Type::Added as i32) && event_name(e) == "cm-cut"),
        "a change past the compaction was passed on as if nothing was missed"
    );
    env.shutdown().await;
}

/// A Watch waiting for its cluster's tunnel holds no rights of its own:
/// a token revoked meanwhile ends it `Unauthenticated`, and a link deleted
/// meanwhile ends it `NotFound` when the hub tries again, both long before
/// the grace would run out; neither is opened again on the new tunnel.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_watch_keeps_to_its_callers_rights() {
    for case in ["revoked", "deleted"] {
        let (relay, env) = KubeEnv::behind_relay(
            TransportKind::H2,
            sim_config().allow("user:otter:mel", &["*"], &["*"], &["*"]),
            |c| c.recheck_tokens_every = Duration::from_millis(200),
        )
        .await;
        let (api, pem) = (env.hub.hub.api_addr, env.hub.hub.ca_pem().to_owned());
        let admin = env.admin_token().to_owned();
        let (mel, mel_id) = otter_e2e::mint_via_admin(
            api,
            &pem,
            &admin,
            serde_json::json!({"name": "mel", "tenant": "default", "role": "member"}),
        )
        .await;
        let mut watch = env
            .resources()
            .watch(with_token(env.watch_configmaps(None), &mel))
            .await
            .expect("mel may watch")
            .into_inner();
        env.cut(&relay, |_| {}).await;
        let (want, waited) = match case {
            "revoked" => {
                otter_e2e::revoke_via_admin(api, &pem, &admin, &mel_id).await;
                (tonic::Code::Unauthenticated, std::time::Instant::now())
            }
            _ => {
                let path = format!("/admin/v1/links/{}", env.cluster);
                let (status, text) =
                    otter_e2e::admin_call(api, &pem, &admin, http::Method::DELETE, &path, None)
                        .await;
                assert_eq!(status, 200, "{text}");
                (tonic::Code::NotFound, std::time::Instant::now())
            }
        };
        relay.freeze(false);
        let ended = otter_e2e::end_of_stream("the waiting watch", &mut watch).await;
        eprintln!(
            "{case} while the tunnel was down: the watch ended {:?} after {:?}",
            ended.code(),
            waited.elapsed()
        );
        assert_eq!(ended.code(), want, "{case}: {ended:?}");
        assert_eq!(
            env.hub.hub.state.metrics.streams_resumed.get(),
            0,
            "{case}: the watch was opened again"
        );
        env.shutdown().await;
    }
}

/// `PodLog` with `follow` through the hub across the same dead tunnel: the
/// hub opens it again from the time of the last line it passed on (it asks
/// the cluster for timestamps and takes them off again when the caller did
/// not ask for them), skipping what it passed before: every line once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_followed_log_goes_on_across_a_dead_tunnel() {
    use otter_proto::runtime::v1::PodLogRequest;
    for stamped in [false, true] {
        let (relay, env) = KubeEnv::behind_relay(
            TransportKind::H2,
            sim_config().pod("default", "web", &["app"]),
            |_| {},
        )
        .await;
        let token = env.admin_token().to_owned();
        for i in 0..3 {
            env.sim
                .append_log("default", "web", "app", &format!("before-{i}"));
        }
        let mut log = env
            .runtime()
            .pod_log(with_token(
                PodLogRequest {
                    cluster: Some(env.cluster.clone()),
                    namespace: Some("default".into()),
                    name: Some("web".into()),
                    follow: Some(true),
                    timestamps: Some(stamped),
                    ..Default::default()
                },
                &token,
            ))
            .await
            .expect("log")
            .into_inner();
        let mut text = String::new();
        let mut until_line = async |want: &str, text: &mut String| {
            let deadline = tokio::time::Instant::now() + otter_e2e::double::WAIT;
            while !text.lines().any(|l| l.ends_with(want)) {
                let chunk = tokio::time::timeout_at(deadline, log.message())
                    .await
                    .unwrap_or_else(|_| panic!("no {want} in time; got {text:?}"))
                    .unwrap_or_else(|e| panic!("the log failed: {e:?}; got {text:?}"))
                    .unwrap_or_else(|| panic!("the log ended; got {text:?}"));
                text.push_str(&String::from_utf8_lossy(&chunk.data.unwrap_or_default()));
            }
        };
        until_line("before-2", &mut text).await;
        env.cut(&relay, |sim| {
            for i in 0..4 {
                sim.append_log("default", "web", "app", &format!("cut-{i}"));
            }
        })
        .await;
        relay.freeze(false);
        until_line("cut-3", &mut text).await;
        env.sim.append_log("default", "web", "app", "after");
        until_line("after", &mut text).await;

        let lines: Vec<&str> = text
            .lines()
            .map(|l| match stamped {
                true => {
                    let (at, rest) = l.split_once(' ').expect("a timestamp");
                    assert!(at.ends_with('Z') && at.contains('T'), "{l:?}");
                    rest
                }
                false => l,
            })
            .filter(|l| !l.starts_with("container "))
            .collect();
        let expected: Vec<String> = (0..3)
            .map(|i| format!("before-{i}"))
            .chain((0..4).map(|i| format!("cut-{i}")))
            .chain(["after".to_owned()])
            .collect();
        eprintln!(
            "timestamps {stamped}: {} lines on one stream, {} resume(s)",
            lines.len(),
            env.hub.hub.state.metrics.streams_resumed.get()
        );
        assert_eq!(lines, expected, "lost or repeated lines");
        assert!(!stamped || text.lines().all(|l| l.contains(' ')));
        assert!(env.hub.hub.state.metrics.streams_resumed.get() >= 1);
        drop(log);
        env.shutdown().await;
    }
}
