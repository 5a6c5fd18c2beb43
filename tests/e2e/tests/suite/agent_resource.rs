//! ResourceService end to end: a client calls the hub, the hub forwards
//! through the tunnel, the agent runs the call with kube-rs against the
//! Kubernetes API test server as the caller.

use std::{collections::HashMap, time::Duration};

use futures::StreamExt;
use otter_e2e::{
    kube::{KubeEnv, sim_config, within},
    with_token,
};
use otter_proto::resource::v1::{self as pb, Resource, watch_event::Type};
use prost_types::value::Kind;
use tonic::Code;

fn obj(r: &Resource) -> serde_json::Value {
    struct_json(r.object.clone().expect("object"))
}

fn struct_json(s: prost_types::Struct) -> serde_json::Value {
    fn val(v: prost_types::Value) -> serde_json::Value {
        match v.kind {
            None | Some(Kind::NullValue(_)) => serde_json::Value::Null,
            Some(Kind::BoolValue(b)) => b.into(),
            Some(Kind::NumberValue(n)) => serde_json::json!(n),
            Some(Kind::StringValue(s)) => s.into(),
            Some(Kind::ListValue(l)) => l.values.into_iter().map(val).collect(),
            Some(Kind::StructValue(s)) => struct_json(s),
        }
    }
    serde_json::Value::Object(s.fields.into_iter().map(|(k, v)| (k, val(v))).collect())
}

fn core(resource: &str) -> (Option<String>, Option<String>, Option<String>) {
    (
        Some(String::new()),
        Some("v1".into()),
        Some(resource.into()),
    )
}

fn get(cluster: &str, resource: &str, ns: &str, name: &str) -> pb::GetRequest {
    let (group, version, resource) = core(resource);
    pb::GetRequest {
        cluster: Some(cluster.into()),
        group,
        version,
        resource,
        namespace: Some(ns.into()),
        name: Some(name.into()),
    }
}

fn create(cluster: &str, resource: &str, ns: &str, manifest: &str) -> pb::CreateRequest {
    let (group, version, resource) = core(resource);
    pb::CreateRequest {
        cluster: Some(cluster.into()),
        group,
        version,
        resource,
        namespace: Some(ns.into()),
        manifest: Some(manifest.as_bytes().to_vec()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn discovery_and_schema() {
    let env = KubeEnv::start(sim_config()).await;
    let t = env.admin_token().to_owned();
    let c = env.cluster.clone();
    let mut res = env.resources();

    let d = within(
        "discovery",
        res.discovery(with_token(
            pb::DiscoveryRequest {
                cluster: Some(c.clone()),
            },
            &t,
        )),
    )
    .await
    .unwrap()
    .into_inner();
    let find = |d: &pb::DiscoveryResponse, g: &str, r: &str| {
        d.api_resources
            .iter()
            .find(|a| a.group.as_deref() == Some(g) && a.resource.as_deref() == Some(r))
            .cloned()
    };
    let cm = find(&d, "", "configmaps").expect("configmaps discovered");
    assert_eq!(cm.kind.as_deref(), Some("ConfigMap"));
    assert_eq!(cm.namespaced, Some(true));
    assert!(cm.short_names.contains(&"cm".to_owned()), "{cm:?}");
    assert!(cm.verbs.contains(&"watch".to_owned()), "{cm:?}");
    let deploy = find(&d, "apps", "deployments").expect("deployments discovered");
    assert_eq!(deploy.version.as_deref(), Some("v1"));
    let crd = find(&d, "apiextensions.k8s.io", "customresourcedefinitions").unwrap();
    assert_eq!(crd.namespaced, Some(false));
    assert!(find(&d, "example.com", "widgets").is_none());

    // A CRD created through the agent shows up in discovery at once.
    let crd_manifest = r#"
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: widgets.example.com
spec:
  group: example.com
  scope: Namespaced
  names: {plural: widgets, singular: widget, kind: Widget, shortNames: [wd]}
  versions:
  - name: v1
    served: true
    storage: true
    schema:
      openAPIV3Schema:
        type: object
        properties:
          spec:
            type: object
            properties:
              size: {type: integer}
"#;
    let mut req = create(&c, "customresourcedefinitions", "", crd_manifest);
    req.group = Some("apiextensions.k8s.io".into());
    within("create CRD", res.create(with_token(req, &t)))
        .await
        .unwrap();
    let d = res
        .discovery(with_token(
            pb::DiscoveryRequest {
                cluster: Some(c.clone()),
            },
            &t,
        ))
        .await
        .unwrap()
        .into_inner();
    let w = find(&d, "example.com", "widgets").expect("widgets after the CRD");
    assert_eq!(w.short_names, vec!["wd".to_owned()]);
    let mut req = create(
        &c,
        "widgets",
        "default",
        "apiVersion: example.com/v1\nkind: Widget\nmetadata: {name: w1}\nspec: {size: 3}\n",
    );
    req.group = Some("example.com".into());
    let w1 = res.create(with_token(req, &t)).await.unwrap().into_inner();
    assert_eq!(obj(&w1)["spec"]["size"], 3.0);

    // A CRD made by someone else appears too (the agent watches CRDs).
    env.sim
        .create_object(serde_json::json!({
            "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
            "metadata": {"name": "gadgets.example.com"},
            "spec": {"group": "example.com", "scope": "Cluster",
                "names": {"plural": "gadgets", "singular": "gadget", "kind": "Gadget"},
                "versions": [{"name": "v1", "served": true, "storage": true,
                    "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}}}]}
        }))
        .expect("CRD");
    within("gadgets in discovery", async {
        loop {
            let d = res
                .discovery(with_token(
                    pb::DiscoveryRequest {
                        cluster: Some(c.clone()),
                    },
                    &t,
                ))
                .await
                .unwrap()
                .into_inner();
            if let Some(g) = find(&d, "example.com", "gadgets") {
                assert_eq!(g.namespaced, Some(false));
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;

    // Schema: the kind's schema with references resolved.
    let schema = |g: &str, k: &str| pb::SchemaRequest {
        cluster: Some(c.clone()),
        group: Some(g.into()),
        version: Some("v1".into()),
        kind: Some(k.into()),
    };
    let s = within(
        "schema",
        res.schema(with_token(schema("apps", "Deployment"), &t)),
    )
    .await
    .unwrap()
    .into_inner();
    let s = struct_json(s.schema.unwrap());
    let text = s.to_string();
    assert!(s.pointer("/properties/spec").is_some(), "{text:.400}");
    assert!(text.contains("replicas"), "spec resolved: {text:.400}");
    assert!(
        !text.contains("#/components/schemas/io.k8s.api.apps.v1.DeploymentSpec"),
        "{text:.400}"
    );
    let e = res
        .schema(with_token(schema("apps", "NoSuchKind"), &t))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
    assert!(e.message().contains("NoSuchKind"), "{e:?}");
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crud_list_describe_and_errors() {
    let env = KubeEnv::start(sim_config()).await;
    let t = env.admin_token().to_owned();
    let c = env.cluster.clone();
    let mut res = env.resources();

    // Create from YAML and JSON; what comes back is cleaned.
    for i in 0..3 {
        let m = format!(
            "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: cm{i}\n  labels: {{app: demo}}\n  annotations:\n    kubectl.kubernetes.io/last-applied-configuration: '{{}}'\ndata:\n  k: v{i}\n"
        );
        let r = within(
            "create",
            res.create(with_token(create(&c, "configmaps", "default", &m), &t)),
        )
        .await
        .unwrap()
        .into_inner();
        let o = obj(&r);
        assert_eq!(o["metadata"]["name"], format!("cm{i}"));
        assert!(o["metadata"].get("managedFields").is_none(), "{o}");
        assert!(o["metadata"].get("annotations").is_none(), "{o}");
    }
    // Manifests up to the apiserver's 3 MiB pass; larger ones are refused here.
    let big = |n: usize| {
        serde_json::json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "big"},
            "data": {"blob": "x".repeat(n)}})
        .to_string()
    };
    let r = res
        .create(with_token(
            create(&c, "configmaps", "default", &big(2 << 20)),
            &t,
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        obj(&r)["data"]["blob"].as_str().map(str::len),
        Some(2 << 20)
    );
    let e = res
        .create(with_token(
            create(&c, "configmaps", "default", &big(3 << 20)),
            &t,
        ))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    let json =
        r#"{"apiVersion":"v1","kind":"ConfigMap","metadata":{"name":"other"},"data":{"a":"b"}}"#;
    res.create(with_token(create(&c, "configmaps", "default", json), &t))
        .await
        .unwrap();
    let dup = res
        .create(with_token(create(&c, "configmaps", "default", json), &t))
        .await
        .unwrap_err();
    assert_eq!(dup.code(), Code::AlreadyExists, "{dup:?}");
    let bad = res
        .create(with_token(
            create(&c, "configmaps", "default", "metadata: [unclosed\n"),
            &t,
        ))
        .await
        .unwrap_err();
    assert_eq!(bad.code(), Code::InvalidArgument);
    assert!(bad.message().contains("YAML"), "{bad:?}");
    let two = res
        .create(with_token(
            create(&c, "configmaps", "default", "a: 1\n---\nb: 2\n"),
            &t,
        ))
        .await
        .unwrap_err();
    assert_eq!(two.code(), Code::InvalidArgument);

    // Get and List: selectors, paging, remaining count.
    let g = res
        .get(with_token(get(&c, "configmaps", "default", "cm1"), &t))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(obj(&g)["data"]["k"], "v1");
    assert_eq!(obj(&g)["kind"], "ConfigMap");
    let list = |label: &str, limit: i64, cont: Option<String>| pb::ListRequest {
        cluster: Some(c.clone()),
        group: Some(String::new()),
        version: Some("v1".into()),
        resource: Some("configmaps".into()),
        namespace: Some("default".into()),
        label_selector: Some(label.into()),
        limit: Some(limit),
        r#continue: cont,
        ..Default::default()
    };
    let page1 = res
        .list(with_token(list("app=demo", 2, None), &t))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(page1.items.len(), 2);
    assert_eq!(page1.remaining_item_count, Some(1));
    assert!(page1.resource_version.is_some());
    let token = page1
        .r#continue
        .clone()
        .filter(|s| !s.is_empty())
        .expect("continue");
    let page2 = res
        .list(with_token(list("app=demo", 2, Some(token)), &t))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(page2.items.len(), 1);
    assert_eq!(obj(&page2.items[0])["metadata"]["name"], "cm2");
    assert_eq!(obj(&page2.items[0])["kind"], "ConfigMap");
    let mut by_field = list("", 0, None);
    by_field.field_selector = Some("metadata.name=other".into());
    let one = res
        .list(with_token(by_field, &t))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(one.items.len(), 1);
    let mut everywhere = list("", 0, None);
    everywhere.namespace = None;
    assert!(
        res.list(with_token(everywhere, &t))
            .await
            .unwrap()
            .into_inner()
            .items
            .len()
            >= 4
    );

    // Update: full replacement, name must match, stale resourceVersion refused.
    let mut o = obj(&g);
    let rv = o["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .to_owned();
    o["data"]["k"] = "changed".into();
    let upd = |name: &str, o: &serde_json::Value| pb::UpdateRequest {
        cluster: Some(c.clone()),
        group: Some(String::new()),
        version: Some("v1".into()),
        resource: Some("configmaps".into()),
        namespace: Some("default".into()),
        name: Some(name.into()),
        manifest: Some(o.to_string().into_bytes()),
        field_manager: None,
    };
    let u = res
        .update(with_token(upd("cm1", &o), &t))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(obj(&u)["data"]["k"], "changed");
    assert_ne!(obj(&u)["metadata"]["resourceVersion"], rv.as_str());
    let stale = res
        .update(with_token(upd("cm1", &o), &t))
        .await
        .unwrap_err();
    assert_eq!(stale.code(), Code::Aborted, "{stale:?}");
    let mismatch = res
        .update(with_token(upd("cm2", &o), &t))
        .await
        .unwrap_err();
    assert_eq!(mismatch.code(), Code::InvalidArgument);
    assert!(mismatch.message().contains("cm1"), "{mismatch:?}");

    // Apply: server-side, field manager required, conflicts, force.
    let apply = |m: &str, mgr: Option<&str>, force: bool| pb::ApplyRequest {
        cluster: Some(c.clone()),
        group: Some(String::new()),
        version: Some("v1".into()),
        resource: Some("configmaps".into()),
        namespace: Some("default".into()),
        name: Some("applied".into()),
        manifest: Some(m.as_bytes().to_vec()),
        force: Some(force),
        field_manager: mgr.map(str::to_owned),
    };
    let m1 = "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: applied}\ndata: {k: one}\n";
    let m2 = "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: applied}\ndata: {k: two}\n";
    let a = res
        .apply(with_token(apply(m1, Some("alpha"), false), &t))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(obj(&a)["data"]["k"], "one");
    assert!(obj(&a)["metadata"].get("managedFields").is_none());
    let conflict = res
        .apply(with_token(apply(m2, Some("beta"), false), &t))
        .await
        .unwrap_err();
    assert_eq!(conflict.code(), Code::FailedPrecondition, "{conflict:?}");
    assert!(
        conflict.message().contains("alpha"),
        "names the other manager: {conflict:?}"
    );
    let forced = res
        .apply(with_token(apply(m2, Some("beta"), true), &t))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(obj(&forced)["data"]["k"], "two");
    let no_mgr = res
        .apply(with_token(apply(m2, None, false), &t))
        .await
        .unwrap_err();
    assert_eq!(no_mgr.code(), Code::InvalidArgument);

    // Describe: the object and the events that name it.
    let uid = obj(&g)["metadata"]["uid"].as_str().unwrap().to_owned();
    for (name, about) in [("ev1", uid.as_str()), ("ev2", "someone-else")] {
        let ev = serde_json::json!({
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": name, "namespace": "default"},
            "involvedObject": {"kind": "ConfigMap", "name": "cm1", "namespace": "default", "uid": about},
            "reason": "Tested", "message": format!("about {about}"), "type": "Normal"
        });
        env.sim.create_object(ev).expect("event");
    }
    let d = res
        .describe(with_token(
            pb::DescribeRequest {
                cluster: Some(c.clone()),
                group: Some(String::new()),
                version: Some("v1".into()),
                resource: Some("configmaps".into()),
                namespace: Some("default".into()),
                name: Some("cm1".into()),
            },
            &t,
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(obj(d.resource.as_ref().unwrap())["metadata"]["name"], "cm1");
    assert_eq!(d.events.len(), 1, "{:?}", d.events);
    assert_eq!(obj(&d.events[0])["reason"], "Tested");

    // Delete, with and without a grace period.
    let del = |name: &str, grace: Option<i64>| pb::DeleteRequest {
        cluster: Some(c.clone()),
        group: Some(String::new()),
        version: Some("v1".into()),
        resource: Some("configmaps".into()),
        namespace: Some("default".into()),
        name: Some(name.into()),
        grace_period_seconds: grace,
    };
    res.delete(with_token(del("cm0", Some(0)), &t))
        .await
        .unwrap();
    res.delete(with_token(del("cm2", None), &t)).await.unwrap();
    let gone = res
        .get(with_token(get(&c, "configmaps", "default", "cm0"), &t))
        .await
        .unwrap_err();
    assert_eq!(gone.code(), Code::NotFound);
    assert_eq!(
        res.delete(with_token(del("cm0", None), &t))
            .await
            .unwrap_err()
            .code(),
        Code::NotFound
    );
    assert_eq!(
        res.delete(with_token(del("x", Some(-1)), &t))
            .await
            .unwrap_err()
            .code(),
        Code::InvalidArgument
    );

    // Unknown types are NotFound with the name; verbs a type lacks are said so.
    let unknown = res
        .get(with_token(get(&c, "gizmos", "default", "a"), &t))
        .await
        .unwrap_err();
    assert_eq!(unknown.code(), Code::NotFound);
    assert!(unknown.message().contains("gizmos"), "{unknown:?}");
    let mut bad_group = get(&c, "pods", "default", "a");
    bad_group.group = Some("nope.example".into());
    let e = res.get(with_token(bad_group, &t)).await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    assert!(e.message().contains("nope.example"), "{e:?}");
    let mut reviews = list("", 0, None);
    reviews.group = Some("authentication.k8s.io".into());
    reviews.resource = Some("selfsubjectreviews".into());
    let e = res.list(with_token(reviews, &t)).await.unwrap_err();
    assert_eq!(e.code(), Code::Unimplemented, "{e:?}");
    assert!(e.message().contains("list"), "{e:?}");
    let traversal = res
        .get(with_token(
            get(&c, "configmaps", "default", "../secrets/x"),
            &t,
        ))
        .await
        .unwrap_err();
    assert_eq!(traversal.code(), Code::InvalidArgument);
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn impersonation_lets_rbac_decide() {
    let cfg = sim_config()
        .allow(
            "group:otter:default:devs",
            &["get", "list", "watch"],
            &["pods"],
            &["default"],
        )
        .pod("default", "web", &["app"])
        .pod("other", "hidden", &["app"]);
    let env = KubeEnv::start(cfg).await;
    let c = env.cluster.clone();
    let alice = env.token_for("alice", &["devs"]);
    let mallory = env.token_for("mallory", &[]);
    let mut res = env.resources();
    let pods = |ns: &str| pb::ListRequest {
        cluster: Some(c.clone()),
        group: Some(String::new()),
        version: Some("v1".into()),
        resource: Some("pods".into()),
        namespace: Some(ns.into()),
        ..Default::default()
    };
    let seen = res
        .list(with_token(pods("default"), &alice))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(seen.items.len(), 1);
    assert_eq!(obj(&seen.items[0])["metadata"]["name"], "web");
    let other_ns = res
        .list(with_token(pods("other"), &alice))
        .await
        .unwrap_err();
    assert_eq!(other_ns.code(), Code::PermissionDenied, "{other_ns:?}");
    assert!(other_ns.message().contains("alice"), "{other_ns:?}");
    let denied = res
        .get(with_token(get(&c, "pods", "default", "web"), &mallory))
        .await
        .unwrap_err();
    assert_eq!(denied.code(), Code::PermissionDenied, "{denied:?}");
    assert!(denied.message().contains("mallory"), "{denied:?}");
    let write = res
        .create(with_token(
            create(&c, "configmaps", "default", "metadata: {name: x}\n"),
            &alice,
        ))
        .await
        .unwrap_err();
    assert_eq!(write.code(), Code::PermissionDenied);
    // The same call as the admin works: it is the caller's identity that counts.
    res.get(with_token(
        get(&c, "pods", "other", "hidden"),
        env.admin_token(),
    ))
    .await
    .unwrap();
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_survives_upstream_timeouts_and_ends_on_410() {
    let env = KubeEnv::start_with(sim_config(), |s| {
        s.resource.upstream_watch_timeout = Duration::from_secs(1);
    })
    .await;
    let t = env.admin_token().to_owned();
    let c = env.cluster.clone();
    let mut res = env.resources();
    res.create(with_token(
        create(
            &c,
            "configmaps",
            "default",
            "metadata: {name: before, labels: {w: x}}\n",
        ),
        &t,
    ))
    .await
    .unwrap();
    let watch = |rv: Option<String>| pb::WatchRequest {
        cluster: Some(c.clone()),
        group: Some(String::new()),
        version: Some("v1".into()),
        resource: Some("configmaps".into()),
        namespace: Some("default".into()),
        label_selector: Some("w=x".into()),
        resource_version: rv,
        ..Default::default()
    };
    let mut stream = within("watch", res.watch(with_token(watch(None), &t)))
        .await
        .unwrap()
        .into_inner();
    // Existing objects first.
    let first = within("first event", stream.next()).await.unwrap().unwrap();
    assert_eq!(first.r#type, Some(Type::Added as i32));
    assert_eq!(
        obj(first.resource.as_ref().unwrap())["metadata"]["name"],
        "before"
    );

    // Changes spread over several upstream watches (each ends after 1 s).
    let writer = {
        let mut res = env.resources();
        let (c, t) = (c.clone(), t.clone());
        tokio::spawn(async move {
            for i in 0..12 {
                let m = format!("metadata: {{name: cm{i}, labels: {{w: x}}}}\n");
                res.create(with_token(create(&c, "configmaps", "default", &m), &t))
                    .await
                    .unwrap();
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
        })
    };
    let mut counts: HashMap<String, usize> = HashMap::new();
    let mut bookmarks = 0;
    let mut last_rv = String::new();
    within("all twelve events", async {
        while counts.len() < 12 {
            let ev = stream.next().await.expect("stream open").expect("event");
            match Type::try_from(ev.r#type.unwrap()).unwrap() {
                Type::Added => {
                    let name = obj(ev.resource.as_ref().unwrap())["metadata"]["name"]
                        .as_str()
                        .unwrap()
                        .to_owned();
                    *counts.entry(name).or_default() += 1;
                    last_rv = ev.resource_version.clone().unwrap();
                }
                Type::Bookmark => {
                    bookmarks += 1;
                    assert!(ev.resource_version.is_some());
                }
                other => panic!("unexpected {other:?}"),
            }
        }
    })
    .await;
    within("writer", writer).await.unwrap();
    // Nothing repeated: listen a little longer, past another upstream timeout.
    let extra = tokio::time::timeout(Duration::from_millis(1500), async {
        loop {
            let ev = stream.next().await.unwrap().unwrap();
            if ev.r#type != Some(Type::Bookmark as i32) {
                return ev;
            }
        }
    })
    .await;
    assert!(
        extra.is_err(),
        "unexpected event after the last one: {extra:?}"
    );
    assert!(counts.values().all(|n| *n == 1), "{counts:?}");
    assert!(counts.contains_key("cm0") && counts.contains_key("cm11"));
    assert!(bookmarks > 0, "bookmarks pass through");
    drop(stream);

    // Resuming from a resourceVersion sees only what came after it.
    let mut resumed = res
        .watch(with_token(watch(Some(last_rv.clone())), &t))
        .await
        .unwrap()
        .into_inner();
    res.delete(with_token(
        pb::DeleteRequest {
            cluster: Some(c.clone()),
            group: Some(String::new()),
            version: Some("v1".into()),
            resource: Some("configmaps".into()),
            namespace: Some("default".into()),
            name: Some("cm3".into()),
            grace_period_seconds: None,
        },
        &t,
    ))
    .await
    .unwrap();
    let ev = within("deleted", async {
        loop {
            let ev = resumed.next().await.unwrap().unwrap();
            if ev.r#type != Some(Type::Bookmark as i32) {
                return ev;
            }
        }
    })
    .await;
    assert_eq!(ev.r#type, Some(Type::Deleted as i32));
    assert_eq!(
        obj(ev.resource.as_ref().unwrap())["metadata"]["name"],
        "cm3"
    );
    drop(resumed);

    // A version the server no longer has: one ERROR event with the 410, then the end.
    env.sim.compact();
    let mut old = res
        .watch(with_token(watch(Some(last_rv)), &t))
        .await
        .unwrap()
        .into_inner();
    let ev = within("error event", old.next()).await.unwrap().unwrap();
    assert_eq!(ev.r#type, Some(Type::Error as i32));
    assert_eq!(obj(ev.resource.as_ref().unwrap())["code"], 410.0);
    assert!(within("end", old.next()).await.is_none());
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_grace_period_has_explicit_presence() {
    let cfg = sim_config()
        .pod("default", "now", &["app"])
        .pod("default", "later", &["app"])
        .pod_termination_delay(Duration::from_secs(5));
    let env = KubeEnv::start(cfg).await;
    let t = env.admin_token().to_owned();
    let c = env.cluster.clone();
    let mut res = env.resources();
    let del = |name: &str, grace: Option<i64>| pb::DeleteRequest {
        cluster: Some(c.clone()),
        group: Some(String::new()),
        version: Some("v1".into()),
        resource: Some("pods".into()),
        namespace: Some("default".into()),
        name: Some(name.into()),
        grace_period_seconds: grace,
    };
    // 0: gone at once.
    within(
        "delete now",
        res.delete(with_token(del("now", Some(0)), &t)),
    )
    .await
    .unwrap();
    assert!(env.sim.object("", "pods", "default", "now").is_none());
    // Absent: the pod's default grace period; it stays terminating for a while.
    within(
        "delete later",
        res.delete(with_token(del("later", None), &t)),
    )
    .await
    .unwrap();
    let p = res
        .get(with_token(get(&c, "pods", "default", "later"), &t))
        .await
        .unwrap()
        .into_inner();
    assert!(
        obj(&p)["metadata"]["deletionTimestamp"].is_string(),
        "{}",
        obj(&p)
    );
    env.shutdown().await;
}
