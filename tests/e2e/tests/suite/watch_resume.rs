//! The client-side Watch resume (`otter_hub::cli::resume`, what `otter get
//! -w` uses) across a tunnel that dies without telling anyone: a relay in
//! front of the hub's tunnel port stops carrying bytes for longer than the
//! keepalive timeout while objects are created, then carries them again.
//! All in one process, so it runs where network namespaces cannot be made
//! (the process-and-namespace version is `net_cut.rs`).

use std::time::Duration;

use otter_e2e::{
    double::event_name,
    kube::{KubeEnv, configmap, sim_config, within},
    with_token,
};
use otter_hub::cli::resume::{Resume, ResumingWatch, Watched};
use otter_proto::resource::v1::watch_event;
use otter_tunnel::TransportKind;

async fn resumes_across_a_dead_tunnel(transport: TransportKind) {
    // The hub's own resume off: the client's is what is tested here (the
    // hub's is `hub_resume.rs`).
    let (relay, env) = KubeEnv::behind_relay(transport, sim_config(), |c| {
        c.watch_resume_grace = Duration::ZERO;
    })
    .await;
    let token = env.admin_token().to_owned();
    for i in 0..2 {
        env.sim
            .create_object(configmap(&format!("cm-before-{i}")))
            .unwrap();
    }
    let list = env
        .resources()
        .list(with_token(env.list_configmaps(), &token))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(list.items.len(), 2);
    let policy = Resume {
        first_delay: Duration::from_millis(100),
        max_delay: Duration::from_secs(1),
        give_up_after: Duration::from_secs(60),
    };
    let t = token.clone();
    let mut watch = ResumingWatch::new(
        env.resources(),
        env.watch_configmaps(list.resource_version.clone()),
        move |m| with_token(m, &t),
        policy,
    );
    // The watch runs on its own; names of ADDED events and resumes come out.
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Option<String>>();
    let watcher = tokio::spawn(async move {
        while let Some(next) = watch.next().await {
            match next {
                Ok(Watched::Event(ev)) => {
                    if ev.r#type == Some(watch_event::Type::Added as i32) {
                        let _ = tx.send(Some(event_name(&ev)));
                    }
                }
                Ok(Watched::Resuming { .. }) => {
                    let _ = tx.send(None);
                }
                Err(e) => panic!("the watch ended: {e:?}"),
            }
        }
    });
    let mut seen = Vec::new();
    let mut resumes = 0;
    let mut until_seen = async |want: &str, seen: &mut Vec<String>, resumes: &mut u32| {
        within(want, async {
            while !seen.iter().any(|n| n == want) {
                match rx.recv().await.expect("watch running") {
                    Some(n) => seen.push(n),
                    None => *resumes += 1,
                }
            }
        })
        .await;
    };
    for i in 0..3 {
        let n = format!("cm-live-{i}");
        env.sim.create_object(configmap(&n)).unwrap();
        until_seen(&n, &mut seen, &mut resumes).await;
    }

    env.cut(&relay, |sim| {
        for i in 0..4 {
            sim.create_object(configmap(&format!("cm-cut-{i}")))
                .unwrap();
        }
    })
    .await;
    relay.freeze(false);
    until_seen("cm-cut-3", &mut seen, &mut resumes).await;
    env.sim.create_object(configmap("cm-after-0")).unwrap();
    until_seen("cm-after-0", &mut seen, &mut resumes).await;
    watcher.abort();

    let expected: Vec<String> = (0..3)
        .map(|i| format!("cm-live-{i}"))
        .chain((0..4).map(|i| format!("cm-cut-{i}")))
        .chain(["cm-after-0".to_owned()])
        .collect();
    eprintln!(
        "{transport}: {} events after {resumes} resume attempt(s)",
        seen.len()
    );
    assert_eq!(seen, expected, "lost or repeated events");
    assert!(
        resumes >= 1,
        "the tunnel died but the watch was never resumed"
    );
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resuming_watch_misses_nothing_across_a_dead_tunnel_over_quic() {
    resumes_across_a_dead_tunnel(TransportKind::Quic).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resuming_watch_misses_nothing_across_a_dead_tunnel_over_h2() {
    resumes_across_a_dead_tunnel(TransportKind::H2).await;
}
