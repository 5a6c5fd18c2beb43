//! kube-rs against kube-sim: the agent's own client library, scenario by scenario.

use crate::common;

use std::time::Duration;

use futures::{AsyncBufReadExt, StreamExt, TryStreamExt};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::authentication::v1::SelfSubjectReview;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{
    Api, AttachParams, DeleteParams, DynamicObject, ListParams, LogParams, Patch, PatchParams,
    PostParams, WatchEvent, WatchParams,
};
use kube::core::{ApiResource, GroupVersionKind};
use kube::discovery::{Discovery, Scope, verbs};
use kube::runtime::watcher;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const T: Duration = Duration::from_secs(10);

fn api_err(e: kube::Error) -> kube::core::Status {
    match e {
        kube::Error::Api(s) => *s,
        other => panic!("expected an API error, got {other:?}"),
    }
}

fn cm(name: &str, data: serde_json::Value) -> ConfigMap {
    serde_json::from_value(
        json!({"metadata": {"name": name, "labels": {"app": "demo"}}, "data": data}),
    )
    .unwrap()
}

#[tokio::test]
async fn discovery_legacy_and_aggregated() {
    let sim = common::start().await;
    let client = common::admin(&sim).await;
    let v = client.apiserver_version().await.unwrap();
    assert_eq!((v.major.as_str(), v.minor.as_str()), ("1", "33"));
    for aggregated in [false, true] {
        let d = Discovery::new(client.clone());
        let d = if aggregated {
            d.run_aggregated().await.unwrap()
        } else {
            d.run().await.unwrap()
        };
        let apps = d.get("apps").expect("apps group");
        let (ar, caps) = apps.recommended_kind("Deployment").expect("deployments");
        assert_eq!(ar.plural, "deployments");
        assert_eq!(caps.scope, Scope::Namespaced);
        assert!(caps.supports_operation(verbs::WATCH));
        assert!(
            caps.subresources
                .iter()
                .any(|(sr, _)| sr.plural == "deployments/scale" || sr.plural == "scale"),
            "{:?}",
            caps.subresources
        );
        let core = d.get("").expect("core group");
        let (pods, caps) = core.recommended_kind("Pod").expect("pods");
        assert_eq!(pods.version, "v1");
        assert!(
            caps.subresources
                .iter()
                .any(|(sr, _)| sr.plural.ends_with("exec")),
            "{:?}",
            caps.subresources
        );
        assert!(d.has_group("apiextensions.k8s.io"));
    }
    // Unknown paths are Status 404s.
    let req = http::Request::get("/apis/nope.example/v1")
        .body(Vec::new())
        .unwrap();
    let err = client.request::<serde_json::Value>(req).await.unwrap_err();
    assert_eq!(api_err(err).code, 404);
    sim.shutdown().await;
}

#[tokio::test]
async fn crud_selectors_paging_and_errors() {
    let sim = common::start().await;
    let client = common::admin(&sim).await;
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), "default");
    let pp = PostParams::default();
    let created = cms.create(&pp, &cm("a", json!({"k": "1"}))).await.unwrap();
    let rv1 = created.metadata.resource_version.clone().unwrap();
    assert!(created.metadata.uid.is_some() && created.metadata.creation_timestamp.is_some());
    let dup = api_err(cms.create(&pp, &cm("a", json!({}))).await.unwrap_err());
    assert_eq!((dup.code, dup.reason.as_str()), (409, "AlreadyExists"));
    for n in ["b", "c", "d"] {
        cms.create(&pp, &cm(n, json!({"n": n}))).await.unwrap();
    }
    let mut other = cm("x", json!({}));
    other.metadata.labels = Some([("app".to_string(), "other".to_string())].into());
    cms.create(&pp, &other).await.unwrap();

    // Label and field selectors.
    let demo = cms
        .list(&ListParams::default().labels("app=demo"))
        .await
        .unwrap();
    assert_eq!(demo.items.len(), 4);
    let notdemo = cms
        .list(&ListParams::default().labels("app!=demo"))
        .await
        .unwrap();
    assert_eq!(
        notdemo
            .items
            .iter()
            .map(|c| c.metadata.name.clone().unwrap())
            .collect::<Vec<_>>(),
        vec!["x"]
    );
    let byname = cms
        .list(&ListParams::default().fields("metadata.name=c"))
        .await
        .unwrap();
    assert_eq!(byname.items.len(), 1);

    // Paging with limit and continue.
    let page1 = cms
        .list(&ListParams::default().labels("app=demo").limit(3))
        .await
        .unwrap();
    assert_eq!(page1.items.len(), 3);
    let token = page1.metadata.continue_.clone().expect("continue token");
    assert_eq!(page1.metadata.remaining_item_count, Some(1));
    let page2 = cms
        .list(
            &ListParams::default()
                .labels("app=demo")
                .limit(3)
                .continue_token(&token),
        )
        .await
        .unwrap();
    assert_eq!(page2.items.len(), 1);
    assert_eq!(page2.items[0].metadata.name.as_deref(), Some("d"));
    sim.compact();
    let expired = api_err(
        cms.list(&ListParams::default().limit(3).continue_token(&token))
            .await
            .unwrap_err(),
    );
    assert_eq!((expired.code, expired.reason.as_str()), (410, "Expired"));

    // Replace with a stale resourceVersion: 409 Conflict.
    let mut fresh = cms.get("a").await.unwrap();
    fresh.data = Some([("k".to_string(), "2".to_string())].into());
    let replaced = cms.replace("a", &pp, &fresh).await.unwrap();
    assert_ne!(
        replaced.metadata.resource_version.as_deref(),
        Some(rv1.as_str())
    );
    let mut stale = fresh.clone();
    stale.metadata.resource_version = Some(rv1);
    let conflict = api_err(cms.replace("a", &pp, &stale).await.unwrap_err());
    assert_eq!((conflict.code, conflict.reason.as_str()), (409, "Conflict"));

    // Not found, delete returning a Status, and namespace checks.
    let nf = api_err(cms.get("nope").await.unwrap_err());
    assert_eq!((nf.code, nf.reason.as_str()), (404, "NotFound"));
    assert_eq!(nf.message, "configmaps \"nope\" not found");
    let del = cms.delete("b", &DeleteParams::default()).await.unwrap();
    assert!(del.is_right(), "configmap delete returns a Status");
    let in_missing_ns: Api<ConfigMap> = Api::namespaced(client.clone(), "missing");
    let ns_err = api_err(
        in_missing_ns
            .create(&pp, &cm("z", json!({})))
            .await
            .unwrap_err(),
    );
    assert_eq!(ns_err.code, 404);

    // generateName and secrets' stringData.
    let gen_cm: ConfigMap =
        serde_json::from_value(json!({"metadata": {"generateName": "gen-"}})).unwrap();
    let g = cms.create(&pp, &gen_cm).await.unwrap();
    assert!(g.metadata.name.unwrap().starts_with("gen-"));
    let secrets: Api<Secret> = Api::namespaced(client.clone(), "default");
    let s: Secret =
        serde_json::from_value(json!({"metadata": {"name": "s"}, "stringData": {"pw": "hunter2"}}))
            .unwrap();
    let s = secrets.create(&pp, &s).await.unwrap();
    assert_eq!(s.data.unwrap()["pw"].0, b"hunter2");

    // Metadata-only reads.
    let meta = cms.get_metadata("a").await.unwrap();
    assert_eq!(meta.metadata.name.as_deref(), Some("a"));
    let metas = cms.list_metadata(&ListParams::default()).await.unwrap();
    assert!(metas.items.len() >= 4);
    sim.shutdown().await;
}

#[tokio::test]
async fn pods_run_and_delete_with_grace() {
    let sim = common::start().await;
    let client = common::admin(&sim).await;
    let pods: Api<Pod> = Api::namespaced(client, "default");
    let p: Pod = serde_json::from_value(json!({"metadata": {"name": "web"}, "spec": {"containers": [{"name": "c", "image": "nginx"}]}})).unwrap();
    let created = pods.create(&PostParams::default(), &p).await.unwrap();
    let status = created.status.unwrap();
    assert_eq!(status.phase.as_deref(), Some("Running"));
    assert!(status.container_statuses.unwrap()[0].ready);
    let bad: Pod =
        serde_json::from_value(json!({"metadata": {"name": "bad"}, "spec": {"containers": []}}))
            .unwrap();
    let invalid = api_err(pods.create(&PostParams::default(), &bad).await.unwrap_err());
    assert_eq!((invalid.code, invalid.reason.as_str()), (422, "Invalid"));

    let deleted = pods
        .delete(
            "web",
            &DeleteParams {
                grace_period_seconds: Some(5),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    let terminating = deleted.left().expect("a pod delete returns the pod");
    assert!(terminating.metadata.deletion_timestamp.is_some());
    assert_eq!(terminating.metadata.deletion_grace_period_seconds, Some(5));
    tokio::time::timeout(T, async {
        while pods.get_opt("web").await.unwrap().is_some() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("pod goes away after its grace");
    // Grace 0 from the query deletes at once.
    let gone = pods
        .delete(
            "p1",
            &DeleteParams {
                grace_period_seconds: Some(0),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert!(gone.is_left());
    assert!(pods.get_opt("p1").await.unwrap().is_none());
    sim.shutdown().await;
}

#[tokio::test]
async fn patches_json_merge_strategic() {
    let sim = common::start().await;
    let client = common::admin(&sim).await;
    let deps: Api<Deployment> = Api::namespaced(client.clone(), "default");
    let d: Deployment = serde_json::from_value(json!({
        "metadata": {"name": "d1"},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "d1"}},
                 "template": {"metadata": {"labels": {"app": "d1"}}, "spec": {"containers": [{"name": "a", "image": "a:1"}, {"name": "b", "image": "b:1"}]}}}
    })).unwrap();
    let d = deps.create(&PostParams::default(), &d).await.unwrap();
    assert_eq!(d.metadata.generation, Some(1));
    let pp = PatchParams::default();
    let strategic = deps
        .patch("d1", &pp, &Patch::Strategic(json!({"spec": {"template": {"spec": {"containers": [{"name": "b", "image": "b:2"}]}}}})))
        .await
        .unwrap();
    let cs = strategic.spec.template.spec.unwrap().containers;
    assert_eq!(
        cs.iter()
            .map(|c| (c.name.as_str(), c.image.clone().unwrap()))
            .collect::<Vec<_>>(),
        vec![("a", "a:1".to_string()), ("b", "b:2".to_string())]
    );
    assert_eq!(strategic.metadata.generation, Some(2));
    let merged = deps
        .patch(
            "d1",
            &pp,
            &Patch::Merge(json!({"metadata": {"labels": {"tier": "web"}}})),
        )
        .await
        .unwrap();
    assert_eq!(merged.metadata.labels.unwrap()["tier"], "web");
    // JSON patch: kube-rs needs an extra feature for typed JSON patches, so send it raw.
    let json_patch = |body: serde_json::Value| {
        http::Request::patch("/apis/apps/v1/namespaces/default/deployments/d1")
            .header("content-type", "application/json-patch+json")
            .body(serde_json::to_vec(&body).unwrap())
            .unwrap()
    };
    let patched: Deployment = client
        .request(json_patch(
            json!([{"op": "replace", "path": "/spec/replicas", "value": 4}]),
        ))
        .await
        .unwrap();
    assert_eq!(patched.spec.replicas, Some(4));
    assert_eq!(patched.status.unwrap().ready_replicas, Some(4));
    let bad = api_err(
        client
            .request::<Deployment>(json_patch(
                json!([{"op": "test", "path": "/spec/replicas", "value": 9}]),
            ))
            .await
            .unwrap_err(),
    );
    assert_eq!(bad.code, 422);
    // kube-rs restart(): a merge patch with its own annotation.
    let restarted = deps.restart("d1").await.unwrap();
    assert!(
        restarted
            .spec
            .template
            .metadata
            .unwrap()
            .annotations
            .unwrap()
            .contains_key("kube.kubernetes.io/restartedAt")
    );
    sim.shutdown().await;
}

#[tokio::test]
async fn server_side_apply_conflicts_and_force() {
    let sim = common::start().await;
    let client = common::admin(&sim).await;
    let cms: Api<ConfigMap> = Api::namespaced(client, "default");
    let applied = cms
        .patch("ssa", &PatchParams::apply("alpha"), &Patch::Apply(json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "ssa"}, "data": {"k": "1", "a": "x"}})))
        .await
        .unwrap();
    let mf = applied.metadata.managed_fields.unwrap();
    assert_eq!(
        (mf[0].manager.as_deref(), mf[0].operation.as_deref()),
        (Some("alpha"), Some("Apply"))
    );
    let conflict = api_err(
        cms.patch("ssa", &PatchParams::apply("beta"), &Patch::Apply(json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "ssa"}, "data": {"k": "2"}})))
            .await
            .unwrap_err(),
    );
    assert_eq!((conflict.code, conflict.reason.as_str()), (409, "Conflict"));
    let causes = conflict.details.unwrap().causes;
    assert_eq!(causes[0].reason, "FieldManagerConflict");
    assert_eq!(causes[0].field, ".data.k");
    assert!(
        conflict.message.contains("conflict with \"alpha\""),
        "{}",
        conflict.message
    );
    let forced = cms
        .patch("ssa", &PatchParams::apply("beta").force(), &Patch::Apply(json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "ssa"}, "data": {"k": "2"}})))
        .await
        .unwrap();
    assert_eq!(forced.data.as_ref().unwrap()["k"], "2");
    let managers: Vec<String> = forced
        .metadata
        .managed_fields
        .unwrap()
        .iter()
        .filter_map(|m| m.manager.clone())
        .collect();
    assert!(managers.contains(&"alpha".to_string()) && managers.contains(&"beta".to_string()));
    // alpha drops "a": it is removed (nobody else owns it).
    let again = cms
        .patch("ssa", &PatchParams::apply("alpha"), &Patch::Apply(json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "ssa"}, "data": {}})))
        .await
        .unwrap();
    assert_eq!(
        again.data.unwrap().into_iter().collect::<Vec<_>>(),
        vec![("k".to_string(), "2".to_string())]
    );
    // Apply without a field manager is refused by the server.
    let req = http::Request::patch("/api/v1/namespaces/default/configmaps/ssa")
        .header("content-type", "application/apply-patch+yaml")
        .body(br#"{"apiVersion":"v1","kind":"ConfigMap","metadata":{"name":"ssa"}}"#.to_vec())
        .unwrap();
    let client2 = common::admin(&sim).await;
    let no_manager = api_err(client2.request::<ConfigMap>(req).await.unwrap_err());
    assert_eq!(no_manager.code, 400);
    sim.shutdown().await;
}

#[tokio::test]
async fn watch_bookmarks_initial_events_and_410() {
    let sim = common::start().await;
    let client = common::admin(&sim).await;
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), "default");
    cms.create(&PostParams::default(), &cm("w0", json!({})))
        .await
        .unwrap();
    let list = cms.list(&ListParams::default()).await.unwrap();
    let rv = list.metadata.resource_version.clone().unwrap();

    // From a resourceVersion: only later events, plus bookmarks.
    let mut stream = cms
        .watch(&WatchParams::default().timeout(5), &rv)
        .await
        .unwrap()
        .boxed();
    cms.create(&PostParams::default(), &cm("w1", json!({})))
        .await
        .unwrap();
    cms.delete("w0", &DeleteParams::default()).await.unwrap();
    let (mut added, mut deleted, mut bookmarks) = (Vec::new(), Vec::new(), 0);
    tokio::time::timeout(T, async {
        while let Some(ev) = stream.try_next().await.unwrap() {
            match ev {
                WatchEvent::Added(c) => added.push(c.metadata.name.unwrap()),
                WatchEvent::Deleted(c) => deleted.push(c.metadata.name.unwrap()),
                WatchEvent::Bookmark(_) => bookmarks += 1,
                other => panic!("unexpected {other:?}"),
            }
            if bookmarks > 0 && !deleted.is_empty() {
                break;
            }
        }
    })
    .await
    .expect("events within the timeout");
    assert_eq!(added, vec!["w1"]);
    assert_eq!(deleted, vec!["w0"]);

    // Too old a resourceVersion: an ERROR event with a 410.
    sim.compact();
    let mut old = cms
        .watch(&WatchParams::default(), &rv)
        .await
        .unwrap()
        .boxed();
    match tokio::time::timeout(T, old.try_next())
        .await
        .unwrap()
        .unwrap()
    {
        Some(WatchEvent::Error(s)) => assert_eq!((s.code, s.reason.as_str()), (410, "Expired")),
        other => panic!("expected a 410 ERROR event, got {other:?}"),
    }

    // Streaming list (sendInitialEvents) through the runtime watcher ends its initial batch.
    let cfg = watcher::Config::default().streaming_lists();
    let mut w = watcher(cms.clone(), cfg).boxed();
    let mut init_names = Vec::new();
    tokio::time::timeout(T, async {
        while let Some(ev) = w.try_next().await.unwrap() {
            match ev {
                watcher::Event::InitApply(c) => init_names.push(c.metadata.name.unwrap()),
                watcher::Event::InitDone => break,
                _ => {}
            }
        }
    })
    .await
    .expect("InitDone");
    assert_eq!(init_names, vec!["w1"]);

    // timeoutSeconds ends the stream.
    let started = std::time::Instant::now();
    let mut short = cms
        .watch(&WatchParams::default().timeout(1), "0")
        .await
        .unwrap()
        .boxed();
    tokio::time::timeout(T, async {
        while short.try_next().await.unwrap().is_some() {}
    })
    .await
    .expect("watch ended");
    assert!(started.elapsed() < Duration::from_secs(5));
    sim.shutdown().await;
}

#[tokio::test]
async fn logs_with_options_and_follow() {
    let sim = common::start().await;
    let client = common::admin(&sim).await;
    let pods: Api<Pod> = Api::namespaced(client, "default");
    for i in 1..=5 {
        sim.append_log("default", "p1", "c1", &format!("line {i}"));
    }
    let all = pods.logs("p1", &LogParams::default()).await.unwrap();
    assert!(all.starts_with("container c1 started\nline 1\n"), "{all}");
    let tail = pods
        .logs(
            "p1",
            &LogParams {
                tail_lines: Some(2),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(tail, "line 4\nline 5\n");
    let limited = pods
        .logs(
            "p1",
            &LogParams {
                limit_bytes: Some(8),
                tail_lines: Some(1),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(limited, "line 5\n");
    let ts = pods
        .logs(
            "p1",
            &LogParams {
                timestamps: true,
                tail_lines: Some(1),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    let (stamp, rest) = ts.split_once(' ').unwrap();
    assert!(stamp.ends_with('Z') && stamp.contains('T'), "{ts}");
    assert_eq!(rest, "line 5\n");
    let since = pods
        .logs(
            "p1",
            &LogParams {
                since_seconds: Some(3600),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert!(since.contains("line 3"));
    let two = api_err(pods.logs("two", &LogParams::default()).await.unwrap_err());
    assert_eq!(two.code, 400);
    assert!(
        two.message.contains("a container name must be specified"),
        "{}",
        two.message
    );
    let prev = api_err(
        pods.logs(
            "p1",
            &LogParams {
                previous: true,
                ..Default::default()
            },
        )
        .await
        .unwrap_err(),
    );
    assert_eq!(prev.code, 400);

    let mut lines = pods
        .log_stream(
            "p1",
            &LogParams {
                follow: true,
                tail_lines: Some(1),
                ..Default::default()
            },
        )
        .await
        .unwrap()
        .lines();
    assert_eq!(
        tokio::time::timeout(T, lines.try_next())
            .await
            .unwrap()
            .unwrap()
            .as_deref(),
        Some("line 5")
    );
    sim.append_log("default", "p1", "c1", "live!");
    assert_eq!(
        tokio::time::timeout(T, lines.try_next())
            .await
            .unwrap()
            .unwrap()
            .as_deref(),
        Some("live!")
    );
    sim.shutdown().await;
}

async fn exec_checks(sim: &kube_sim::KubeSim) {
    let client = common::admin(sim).await;
    let pods: Api<Pod> = Api::namespaced(client, "default");
    let mut p = pods
        .exec(
            "p1",
            ["sh", "-c", "echo out; echo err >&2; exit 3"],
            &AttachParams::default().stderr(true),
        )
        .await
        .unwrap();
    let mut out = String::new();
    p.stdout().unwrap().read_to_string(&mut out).await.unwrap();
    let mut err = String::new();
    p.stderr().unwrap().read_to_string(&mut err).await.unwrap();
    let status = tokio::time::timeout(T, p.take_status().unwrap())
        .await
        .unwrap()
        .unwrap();
    assert_eq!((out.as_str(), err.as_str()), ("out\n", "err\n"));
    assert_eq!(status.status.as_deref(), Some("Failure"));
    assert_eq!(status.reason.as_deref(), Some("NonZeroExitCode"));
    assert_eq!(
        status.details.unwrap().causes.unwrap()[0]
            .message
            .as_deref(),
        Some("3")
    );
    p.join().await.unwrap();

    // stdin through to the process.
    let mut p = pods
        .exec(
            "p1",
            ["cat"],
            &AttachParams::default().stdin(true).stderr(false),
        )
        .await
        .unwrap();
    let mut stdin = p.stdin().unwrap();
    stdin.write_all(b"hello through cat\n").await.unwrap();
    let mut stdout = p.stdout().unwrap();
    let mut buf = vec![0u8; 64];
    let n = tokio::time::timeout(T, stdout.read(&mut buf))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(&buf[..n], b"hello through cat\n");
    // v4 has no way to close stdin: end the session from the client side.
    drop(stdin);
    p.abort();

    // Environment tells which pod and container the command "runs in".
    let mut p = pods
        .exec(
            "two",
            ["sh", "-c", "echo $KUBE_SIM_POD/$KUBE_SIM_CONTAINER"],
            &AttachParams::default().container("b").stderr(false),
        )
        .await
        .unwrap();
    let mut out = String::new();
    p.stdout().unwrap().read_to_string(&mut out).await.unwrap();
    assert_eq!(out, "two/b\n");
    let status = p.take_status().unwrap().await.unwrap();
    assert_eq!(status.status.as_deref(), Some("Success"));
}

#[tokio::test]
async fn exec_v5() {
    let sim = common::start().await;
    exec_checks(&sim).await;
    // A v5 session: stdin closed by the client lets cat exit 0.
    let client = common::admin(&sim).await;
    let pods: Api<Pod> = Api::namespaced(client, "default");
    let mut p = pods
        .exec(
            "p1",
            ["cat"],
            &AttachParams::default().stdin(true).stderr(false),
        )
        .await
        .unwrap();
    let mut stdin = p.stdin().unwrap();
    stdin.write_all(b"bye\n").await.unwrap();
    stdin.shutdown().await.unwrap();
    drop(stdin);
    let mut out = String::new();
    p.stdout().unwrap().read_to_string(&mut out).await.unwrap();
    assert_eq!(out, "bye\n");
    let status = tokio::time::timeout(T, p.take_status().unwrap())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(status.status.as_deref(), Some("Success"));
    sim.shutdown().await;
}

#[tokio::test]
async fn exec_v4() {
    let sim = kube_sim::KubeSim::start(common::config().exec_v4_only(true))
        .await
        .unwrap();
    exec_checks(&sim).await;
    sim.shutdown().await;
}

#[tokio::test]
async fn attach_and_resize() {
    let sim = common::start().await;
    let client = common::admin(&sim).await;
    let pods: Api<Pod> = Api::namespaced(client, "default");
    let mut p = pods
        .attach("p1", &AttachParams::interactive_tty())
        .await
        .unwrap();
    let mut size = p.terminal_size().unwrap();
    use futures::SinkExt;
    size.send(kube::api::TerminalSize {
        width: 100,
        height: 40,
    })
    .await
    .unwrap();
    let mut stdin = p.stdin().unwrap();
    stdin.write_all(b"typed\n").await.unwrap();
    let mut stdout = p.stdout().unwrap();
    let mut buf = vec![0u8; 64];
    let n = tokio::time::timeout(T, stdout.read(&mut buf))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(&buf[..n], b"typed\n");
    tokio::time::timeout(T, async {
        while !sim.resizes().contains(&("p1".into(), "c1".into(), 100, 40)) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("resize recorded");
    p.abort();
    sim.shutdown().await;
}

#[tokio::test]
async fn port_forward_to_a_real_listener() {
    let sim = common::start().await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let target = listener.local_addr().unwrap();
    let echo = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        let mut buf = vec![0u8; 1024];
        let n = s.read(&mut buf).await.unwrap();
        s.write_all(b"echo: ").await.unwrap();
        s.write_all(&buf[..n]).await.unwrap();
    });
    sim.add_pod_port("default", "p1", 8080, target);
    let client = common::admin(&sim).await;
    let pods: Api<Pod> = Api::namespaced(client, "default");
    let mut pf = pods.portforward("p1", &[8080, 9999]).await.unwrap();
    let mut stream = pf.take_stream(8080).unwrap();
    stream.write_all(b"ping").await.unwrap();
    let mut got = Vec::new();
    tokio::time::timeout(T, async {
        let mut buf = vec![0u8; 64];
        while got.len() < 10 {
            let n = stream.read(&mut buf).await.unwrap();
            if n == 0 {
                break;
            }
            got.extend_from_slice(&buf[..n]);
        }
    })
    .await
    .unwrap();
    assert_eq!(got, b"echo: ping");
    // Port 9999 has no listener: its error channel says so.
    let err = tokio::time::timeout(T, pf.take_error(9999).unwrap())
        .await
        .unwrap();
    assert!(
        err.unwrap_or_default()
            .contains("error forwarding port 9999")
    );
    pf.abort();
    echo.await.unwrap();
    sim.shutdown().await;
}

#[tokio::test]
async fn scale_status_and_generic_subresources() {
    let sim = common::start().await;
    let client = common::admin(&sim).await;
    let deps: Api<Deployment> = Api::namespaced(client.clone(), "default");
    let d: Deployment = serde_json::from_value(json!({
        "metadata": {"name": "s1"},
        "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "s1"}},
                 "template": {"metadata": {"labels": {"app": "s1"}}, "spec": {"containers": [{"name": "a", "image": "a"}]}}}
    })).unwrap();
    deps.create(&PostParams::default(), &d).await.unwrap();
    let scale = deps.get_scale("s1").await.unwrap();
    assert_eq!(scale.spec.unwrap().replicas, Some(2));
    assert_eq!(scale.status.unwrap().selector.as_deref(), Some("app=s1"));
    let scaled = deps
        .patch_scale(
            "s1",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"replicas": 5}})),
        )
        .await
        .unwrap();
    assert_eq!(scaled.spec.unwrap().replicas, Some(5));
    assert_eq!(deps.get("s1").await.unwrap().spec.replicas, Some(5));
    let mut sc = deps.get_scale("s1").await.unwrap();
    sc.spec.as_mut().unwrap().replicas = Some(1);
    let replaced = deps
        .replace_scale("s1", &PostParams::default(), &sc)
        .await
        .unwrap();
    assert_eq!(replaced.status.unwrap().replicas, 1);

    // /status changes only status.
    let st = deps
        .patch_status(
            "s1",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"observedGeneration": 42}, "spec": {"replicas": 9}})),
        )
        .await
        .unwrap();
    assert_eq!(st.status.unwrap().observed_generation, Some(42));
    assert_eq!(st.spec.replicas, Some(1));

    // Generic subresource calls are answered and recorded.
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let binding = json!({"apiVersion": "v1", "kind": "Binding", "metadata": {"name": "p1"}, "target": {"kind": "Node", "name": "n2"}});
    let reply: serde_json::Value = pods
        .create_subresource("binding", "p1", &PostParams::default(), &binding)
        .await
        .unwrap();
    assert_eq!(reply["target"]["name"], "n2");
    let calls = sim.subresource_calls();
    assert_eq!(calls.len(), 1);
    assert!(calls[0].path.ends_with("/pods/p1/binding"));
    // Eviction deletes the pod.
    pods.evict("p1", &Default::default()).await.unwrap();
    tokio::time::timeout(T, async {
        while pods.get_opt("p1").await.unwrap().is_some() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .unwrap();
    sim.shutdown().await;
}

#[tokio::test]
async fn impersonation_rbac_and_whoami() {
    let sim = common::start().await;
    let whoami = |c: kube::Client| async move {
        let api: Api<SelfSubjectReview> = Api::all(c);
        api.create(&PostParams::default(), &SelfSubjectReview::default())
            .await
    };
    let bob = common::client_for(&sim, common::BOB_TOKEN, None).await;
    let me = whoami(bob.clone())
        .await
        .unwrap()
        .status
        .unwrap()
        .user_info
        .unwrap();
    assert_eq!(me.username.as_deref(), Some("bob"));

    // bob may read pods in default, not elsewhere, and no secrets.
    let pods: Api<Pod> = Api::namespaced(bob.clone(), "default");
    assert_eq!(
        pods.list(&ListParams::default()).await.unwrap().items.len(),
        2
    );
    let secrets: Api<Secret> = Api::namespaced(bob.clone(), "default");
    let denied = api_err(secrets.list(&ListParams::default()).await.unwrap_err());
    assert_eq!((denied.code, denied.reason.as_str()), (403, "Forbidden"));
    assert_eq!(
        denied.message,
        "secrets is forbidden: User \"bob\" cannot list resource \"secrets\" in API group \"\" in the namespace \"default\""
    );
    let exec_denied = match pods.exec("p1", ["true"], &AttachParams::default()).await {
        Err(e) => api_err(e),
        Ok(_) => panic!("exec must be denied"),
    };
    assert_eq!(exec_denied.code, 403);

    // bob impersonates jane (allowed): jane's rules apply.
    let as_jane =
        common::client_for(&sim, common::BOB_TOKEN, Some(("jane", vec!["devs".into()]))).await;
    let info = whoami(as_jane.clone())
        .await
        .unwrap()
        .status
        .unwrap()
        .user_info
        .unwrap();
    assert_eq!(info.username.as_deref(), Some("jane"));
    assert_eq!(
        info.groups.unwrap(),
        vec!["devs".to_string(), "system:authenticated".to_string()]
    );
    let cms: Api<ConfigMap> = Api::namespaced(as_jane.clone(), "default");
    cms.list(&ListParams::default()).await.unwrap();
    let jane_pods: Api<Pod> = Api::namespaced(as_jane, "kube-system");
    assert_eq!(
        api_err(jane_pods.list(&ListParams::default()).await.unwrap_err()).code,
        403
    );

    // eve may not impersonate anyone.
    let eve_as_jane = common::client_for(&sim, common::EVE_TOKEN, Some(("jane", vec![]))).await;
    let cms: Api<ConfigMap> = Api::namespaced(eve_as_jane, "default");
    let no = api_err(cms.list(&ListParams::default()).await.unwrap_err());
    assert_eq!((no.code, no.reason.as_str()), (403, "Forbidden"));
    assert_eq!(
        no.message,
        "users \"jane\" is forbidden: User \"eve\" cannot impersonate resource \"users\" in API group \"\" at the cluster scope"
    );

    // A wrong token is 401.
    let nobody = common::client_for(&sim, "wrong-token", None).await;
    let cms: Api<ConfigMap> = Api::namespaced(nobody, "default");
    assert_eq!(
        api_err(cms.list(&ListParams::default()).await.unwrap_err()).code,
        401
    );
    sim.shutdown().await;
}

#[tokio::test]
async fn crds_serve_validated_custom_resources() {
    let sim = common::start().await;
    let client = common::admin(&sim).await;
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let crd: CustomResourceDefinition = serde_json::from_value(json!({
        "metadata": {"name": "widgets.example.com"},
        "spec": {
            "group": "example.com",
            "scope": "Namespaced",
            "names": {"plural": "widgets", "singular": "widget", "kind": "Widget", "shortNames": ["wg"]},
            "versions": [{
                "name": "v1", "served": true, "storage": true,
                "subresources": {"status": {}, "scale": {"specReplicasPath": ".spec.size", "statusReplicasPath": ".status.size"}},
                "schema": {"openAPIV3Schema": {
                    "type": "object",
                    "properties": {
                        "spec": {"type": "object", "required": ["size"], "properties": {
                            "size": {"type": "integer", "minimum": 1, "maximum": 10},
                            "color": {"type": "string", "enum": ["red", "blue"]},
                            "name": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 8}
                        }},
                        "status": {"type": "object", "properties": {"size": {"type": "integer"}}}
                    }
                }}
            }]
        }
    })).unwrap();
    let created = crds.create(&PostParams::default(), &crd).await.unwrap();
    let conds = created.status.unwrap().conditions.unwrap();
    assert!(
        conds
            .iter()
            .any(|c| c.type_ == "Established" && c.status == "True")
    );

    let d = Discovery::new(client.clone())
        .run_aggregated()
        .await
        .unwrap();
    let (ar, _) = d
        .resolve_gvk(&GroupVersionKind::gvk("example.com", "v1", "Widget"))
        .expect("served after create");
    let widgets: Api<DynamicObject> = Api::namespaced_with(client.clone(), "default", &ar);
    let w: DynamicObject = serde_json::from_value(json!({"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w1"}, "spec": {"size": 3, "color": "red", "extra": true}})).unwrap();
    let w = widgets.create(&PostParams::default(), &w).await.unwrap();
    assert_eq!(
        w.data["spec"],
        json!({"size": 3, "color": "red"}),
        "unknown fields are pruned"
    );

    let bad: DynamicObject = serde_json::from_value(json!({"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w2"}, "spec": {"size": 11, "color": "green"}})).unwrap();
    let invalid = api_err(
        widgets
            .create(&PostParams::default(), &bad)
            .await
            .unwrap_err(),
    );
    assert_eq!((invalid.code, invalid.reason.as_str()), (422, "Invalid"));
    assert!(
        invalid.message.contains(
            "spec.color: Unsupported value: \"green\": supported values: \"red\", \"blue\""
        ),
        "{}",
        invalid.message
    );
    let causes = invalid.details.unwrap().causes;
    assert!(causes.iter().any(|c| c.field == "spec.size"));

    let smp = api_err(
        widgets
            .patch(
                "w1",
                &PatchParams::default(),
                &Patch::Strategic(json!({"spec": {"size": 2}})),
            )
            .await
            .unwrap_err(),
    );
    assert_eq!(smp.code, 415);
    let merged = widgets
        .patch(
            "w1",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"size": 4}})),
        )
        .await
        .unwrap();
    assert_eq!(merged.data["spec"]["size"], 4);
    // Updates are validated too.
    let too_big = api_err(
        widgets
            .patch(
                "w1",
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"size": 99, "name": "UPPER"}})),
            )
            .await
            .unwrap_err(),
    );
    assert_eq!(too_big.code, 422);
    assert!(
        too_big.message.contains(
            "spec.size: Invalid value: 99: spec.size in body should be less than or equal to 10"
        ),
        "{}",
        too_big.message
    );
    assert!(
        too_big.message.contains(
            "spec.name: Invalid value: \"UPPER\": spec.name in body should match '^[a-z]+$'"
        ),
        "{}",
        too_big.message
    );
    assert_eq!(widgets.get("w1").await.unwrap().data["spec"]["size"], 4);
    let applied = widgets
        .patch("w3", &PatchParams::apply("mgr"), &Patch::Apply(json!({"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w3"}, "spec": {"size": 1}})))
        .await
        .unwrap();
    assert_eq!(applied.data["spec"]["size"], 1);

    // The CRD's scale subresource maps to .spec.size.
    let ar_scale = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("example.com", "v1", "Widget"),
        "widgets",
    );
    let w_api: Api<DynamicObject> = Api::namespaced_with(client.clone(), "default", &ar_scale);
    let sc = w_api
        .patch_scale(
            "w1",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"replicas": 7}})),
        )
        .await
        .unwrap();
    assert_eq!(sc.spec.unwrap().replicas, Some(7));
    assert_eq!(w_api.get("w1").await.unwrap().data["spec"]["size"], 7);

    // Deleting the CRD stops serving its resources.
    crds.delete("widgets.example.com", &DeleteParams::default())
        .await
        .unwrap();
    assert_eq!(api_err(w_api.get("w1").await.unwrap_err()).code, 404);
    sim.shutdown().await;
}

#[tokio::test]
async fn selector_watches_see_objects_enter_and_leave() {
    let sim = common::start().await;
    let client = common::admin(&sim).await;
    let cms: Api<ConfigMap> = Api::namespaced(client, "default");
    let created = cms
        .create(&PostParams::default(), &cm("sel", json!({})))
        .await
        .unwrap();
    assert!(
        created.metadata.generation.is_none(),
        "configmaps carry no generation"
    );
    let rv = created.metadata.resource_version.unwrap();
    let mut stream = cms
        .watch(
            &WatchParams::default()
                .labels("tier=gold")
                .timeout(5)
                .disable_bookmarks(),
            &rv,
        )
        .await
        .unwrap()
        .boxed();
    let pp = PatchParams::default();
    cms.patch(
        "sel",
        &pp,
        &Patch::Merge(json!({"metadata": {"labels": {"tier": "gold"}}})),
    )
    .await
    .unwrap();
    cms.patch("sel", &pp, &Patch::Merge(json!({"data": {"x": "1"}})))
        .await
        .unwrap();
    cms.patch(
        "sel",
        &pp,
        &Patch::Merge(json!({"metadata": {"labels": {"tier": null}}})),
    )
    .await
    .unwrap();
    let mut kinds = Vec::new();
    tokio::time::timeout(T, async {
        while kinds.len() < 3 {
            match stream.try_next().await.unwrap().expect("stream open") {
                WatchEvent::Added(_) => kinds.push("ADDED"),
                WatchEvent::Modified(_) => kinds.push("MODIFIED"),
                WatchEvent::Deleted(_) => kinds.push("DELETED"),
                other => panic!("unexpected {other:?}"),
            }
        }
    })
    .await
    .unwrap();
    assert_eq!(kinds, ["ADDED", "MODIFIED", "DELETED"]);
    // A write that changes nothing keeps the resourceVersion.
    let before = cms.get("sel").await.unwrap();
    let after = cms
        .replace("sel", &PostParams::default(), &before)
        .await
        .unwrap();
    assert_eq!(
        before.metadata.resource_version,
        after.metadata.resource_version
    );
    sim.shutdown().await;
}
