//! FleetService: labels on links and one List or Get over every cluster a
//! selector picks, through the hub's API port with real agents. One
//! cluster's Kubernetes API sits behind a relay the test freezes (a cluster
//! that never answers), one cluster is offline, and callers of another
//! tenant and plain members ask too.

use std::{collections::BTreeMap, time::Duration};

use otter_e2e::{
    kube::{KubeEnv, configmap, kube_agent, kube_agent_with, sim_config, within},
    with_token,
};
use otter_proto::{
    fleet::v1::{
        FanOut, GetResourcesRequest, LabelLinkRequest, ListResourcesRequest, ListResourcesResponse,
        fleet_service_client::FleetServiceClient, get_resources_response, list_resources_response,
    },
    link::v1::{LinkState, ListLinksRequest, link_service_client::LinkServiceClient},
};
use otter_tunnel::TransportKind;
use tonic::{Code, transport::Channel};

fn fan_out(selector: &str, timeout_millis: Option<u32>) -> Option<FanOut> {
    Some(FanOut {
        link_selector: Some(selector.to_owned()),
        timeout_millis,
    })
}

fn configmaps(selector: &str, timeout_millis: Option<u32>) -> ListResourcesRequest {
    ListResourcesRequest {
        fan_out: fan_out(selector, timeout_millis),
        version: Some("v1".into()),
        resource: Some("configmaps".into()),
        namespace: Some("default".into()),
        ..Default::default()
    }
}

/// Every answer of a fan-out List, in the order they came.
async fn list(
    channel: &Channel,
    token: &str,
    req: ListResourcesRequest,
) -> Result<Vec<ListResourcesResponse>, tonic::Status> {
    let mut stream = FleetServiceClient::new(channel.clone())
        .list_resources(with_token(req, token))
        .await?
        .into_inner();
    let mut answers = Vec::new();
    while let Some(m) = stream.message().await? {
        answers.push(m);
    }
    Ok(answers)
}

/// `cluster → item names` for the answers that listed, `cluster → code`
/// for those that failed.
fn outcomes(
    answers: &[ListResourcesResponse],
) -> (BTreeMap<String, Vec<String>>, BTreeMap<String, String>) {
    let mut listed = BTreeMap::new();
    let mut failed = BTreeMap::new();
    for a in answers {
        match &a.result {
            Some(list_resources_response::Result::List(l)) => {
                let names = l
                    .items
                    .iter()
                    .map(|i| {
                        let o = otter_proto::json::struct_to_json(i.object.as_ref().unwrap());
                        o["metadata"]["name"]
                            .as_str()
                            .unwrap_or_default()
                            .to_owned()
                    })
                    .collect();
                listed.insert(a.cluster().to_owned(), names);
            }
            Some(list_resources_response::Result::Error(e)) => {
                failed.insert(a.cluster().to_owned(), e.code().to_owned());
            }
            None => panic!("an answer without a result: {a:?}"),
        }
    }
    (listed, failed)
}

async fn label(
    channel: &Channel,
    token: &str,
    cluster: &str,
    set: &[(&str, &str)],
    remove: &[&str],
) -> Result<BTreeMap<String, String>, tonic::Status> {
    let resp = FleetServiceClient::new(channel.clone())
        .label_link(with_token(
            LabelLinkRequest {
                cluster: Some(cluster.to_owned()),
                labels: set
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect(),
                remove: remove.iter().map(|k| (*k).to_owned()).collect(),
            },
            token,
        ))
        .await?;
    Ok(resp.into_inner().labels.into_iter().collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_list_over_the_clusters_a_selector_picks_answers_per_cluster() {
    let env = KubeEnv::start(sim_config()).await;
    let admin = env.admin_token().to_owned();
    for name in ["cm-a", "cm-b"] {
        env.sim.create_object(configmap(name)).unwrap();
    }
    // edge-2 reaches its Kubernetes API through a relay the test freezes.
    let relay = otter_e2e::Relay::start().await;
    relay.set_target(env.sim.addr());
    let via_relay = env.sim.kubeconfig_yaml(kube_sim::ADMIN_TOKEN).replace(
        &env.sim.url(),
        &format!("https://127.0.0.1:{}", relay.addr.port()),
    );
    let token = env.hub.hub.mint_join_token("edge-2").unwrap();
    let slow = kube_agent_with(
        &env.hub,
        &via_relay,
        "edge-2",
        &token,
        &[TransportKind::H2],
        |_| {},
    )
    .await;
    // edge-3 registers, then goes away: an offline link.
    let token = env.hub.hub.mint_join_token("edge-3").unwrap();
    let gone = kube_agent(
        &env.hub,
        &env.sim,
        "edge-3",
        &token,
        TransportKind::H2,
        |_| {},
    )
    .await;
    gone.shutdown().await;
    let links = LinkServiceClient::new(env.channel.clone());
    otter_e2e::double::wait_until(
        async || {
            let l = links
                .clone()
                .list_links(with_token(ListLinksRequest {}, &admin))
                .await
                .unwrap()
                .into_inner()
                .links;
            l.iter()
                .any(|l| l.cluster() == "edge-3" && l.state == Some(LinkState::Offline as i32))
        },
        "edge-3 offline",
    )
    .await;

    // Labels: set, changed, removed; shown by ListLinks.
    let ch = &env.channel;
    for cluster in ["edge-1", "edge-2", "edge-3"] {
        label(ch, &admin, cluster, &[("env", "prod")], &[])
            .await
            .unwrap();
    }
    let got = label(ch, &admin, "edge-1", &[("region", "eu"), ("tmp", "x")], &[])
        .await
        .unwrap();
    assert_eq!(got.len(), 3);
    let got = label(ch, &admin, "edge-1", &[], &["tmp"]).await.unwrap();
    assert_eq!(
        got,
        BTreeMap::from([
            ("env".to_owned(), "prod".to_owned()),
            ("region".to_owned(), "eu".to_owned())
        ])
    );
    let edge1 = otter_e2e::double::link_of(ch, &admin, "edge-1").await;
    assert_eq!(edge1.labels.get("region").map(String::as_str), Some("eu"));
    assert!(!edge1.labels.contains_key("tmp"));

    // Every cluster answers, each on its own: the listed objects, the
    // offline one's `unavailable`; the frozen one's deadline ends its wait
    // only, and its answer comes after the others.
    relay.freeze(true);
    // One caller has at most 4 fan-outs open: while the frozen cluster
    // holds 4 open, a fifth is refused; other callers are not held up.
    let busy = env.token_for("fanny", &[]);
    let mut held = Vec::new();
    for _ in 0..otter_hub::fleet::MAX_FAN_OUTS_PER_CALLER {
        held.push(
            FleetServiceClient::new(ch.clone())
                .list_resources(with_token(configmaps("env=prod", Some(5000)), &busy))
                .await
                .expect("a fan-out"),
        );
    }
    let fifth = FleetServiceClient::new(ch.clone())
        .list_resources(with_token(configmaps("env=prod", Some(5000)), &busy))
        .await
        .expect_err("a fifth fan-out at once");
    assert_eq!(fifth.code(), Code::ResourceExhausted, "{fifth:?}");
    let answers = within(
        "fan-out with a frozen cluster",
        list(ch, &admin, configmaps("env=prod", Some(1500))),
    )
    .await
    .unwrap();
    let (listed, failed) = outcomes(&answers);
    assert_eq!(
        listed,
        BTreeMap::from([(
            "edge-1".to_owned(),
            vec!["cm-a".to_owned(), "cm-b".to_owned()]
        )])
    );
    assert_eq!(
        failed,
        BTreeMap::from([
            ("edge-2".to_owned(), "deadline_exceeded".to_owned()),
            ("edge-3".to_owned(), "unavailable".to_owned()),
        ])
    );
    assert_eq!(
        answers.last().unwrap().cluster(),
        "edge-2",
        "the frozen cluster answered last: {answers:?}"
    );
    let at = |c: &str| {
        answers
            .iter()
            .find(|a| a.cluster() == c)
            .unwrap()
            .elapsed_millis()
    };
    assert!(at("edge-2") >= 1500, "edge-2 waited for its deadline");
    assert!(at("edge-1") < at("edge-2") && at("edge-3") < at("edge-2"));

    // Once its path works again, it answers like the others.
    relay.freeze(false);
    // The places come back when their calls end: none is kept.
    drop(held);
    otter_e2e::double::wait_until(
        async || list(ch, &busy, configmaps("env=prod", None)).await.is_ok(),
        "a fan-out of the caller whose calls ended",
    )
    .await;
    otter_e2e::double::wait_until(
        async || env.hub.hub.state.fan_outs.is_empty(),
        "every fan-out's place freed",
    )
    .await;
    let answers = within(
        "fan-out, all well",
        list(ch, &admin, configmaps("env=prod", None)),
    )
    .await
    .unwrap();
    let (listed, failed) = outcomes(&answers);
    assert_eq!(listed.keys().collect::<Vec<_>>(), ["edge-1", "edge-2"]);
    assert_eq!(listed["edge-2"], ["cm-a", "cm-b"]);
    assert_eq!(failed.keys().collect::<Vec<_>>(), ["edge-3"]);

    // Selectors pick as kubectl's do.
    for (selector, want) in [
        ("region=eu", vec!["edge-1"]),
        ("env=prod,!region", vec!["edge-2", "edge-3"]),
        ("region in (us,eu)", vec!["edge-1"]),
        ("env notin (prod)", vec![]),
        ("", vec!["edge-1", "edge-2", "edge-3"]),
    ] {
        let answers = list(ch, &admin, configmaps(selector, None)).await.unwrap();
        let mut clusters: Vec<&str> = answers.iter().map(|a| a.cluster()).collect();
        clusters.sort();
        assert_eq!(clusters, want, "{selector:?}");
    }

    // A Get of one object, on each cluster.
    let mut stream = FleetServiceClient::new(ch.clone())
        .get_resources(with_token(
            GetResourcesRequest {
                fan_out: fan_out("env=prod", None),
                version: Some("v1".into()),
                resource: Some("configmaps".into()),
                namespace: Some("default".into()),
                name: Some("cm-b".into()),
                ..Default::default()
            },
            &admin,
        ))
        .await
        .unwrap()
        .into_inner();
    let mut found = BTreeMap::new();
    while let Some(m) = stream.message().await.unwrap() {
        let what = match m.result {
            Some(get_resources_response::Result::Resource(r)) => {
                let o = otter_proto::json::struct_to_json(r.object.as_ref().unwrap());
                o["metadata"]["name"].as_str().unwrap().to_owned()
            }
            Some(get_resources_response::Result::Error(e)) => e.code().to_owned(),
            None => panic!("no result"),
        };
        found.insert(m.cluster.unwrap(), what);
    }
    assert_eq!(found["edge-1"], "cm-b");
    assert_eq!(found["edge-2"], "cm-b");
    assert_eq!(found["edge-3"], "unavailable");

    // Bad input is refused before any cluster is asked.
    for bad in ["env in prod", "env=prod,", "Env/x=1"] {
        let e = list(ch, &admin, configmaps(bad, None)).await.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{bad}: {e:?}");
    }
    for (set, remove) in [
        (vec![("-bad", "x")], vec![]),
        (vec![("ok", "a/b")], vec![]),
        (vec![("env", "dev")], vec!["env"]),
    ] {
        let e = label(ch, &admin, "edge-1", &set, &remove)
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{set:?} {remove:?}: {e:?}");
    }
    let many: Vec<(String, String)> = (0..40).map(|i| (format!("k{i}"), "v".into())).collect();
    let many: Vec<(&str, &str)> = many.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let e = label(ch, &admin, "edge-1", &many, &[]).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);

    // A member of the tenant lists with its own rights (the test server
    // grants it nothing: each cluster says so) and may not label.
    let member = env.token_for("mia", &[]);
    let answers = list(ch, &member, configmaps("env=prod", None))
        .await
        .unwrap();
    let (listed, failed) = outcomes(&answers);
    assert!(listed.is_empty(), "{listed:?}");
    assert_eq!(failed["edge-1"], "permission_denied");
    assert_eq!(failed["edge-2"], "permission_denied");
    let e = label(ch, &member, "edge-1", &[("env", "dev")], &[])
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied);

    // Another tenant's admin sees no cluster of this one, by any selector,
    // and cannot tell a cluster of it from one that does not exist.
    env.hub.hub.create_tenant("globex").unwrap();
    let mut spec = otter_hub::tokens::TokenSpec {
        user: "gus".into(),
        ..Default::default()
    };
    spec.tenants
        .insert("globex".into(), otter_hub::tenancy::Role::Admin);
    let outsider = env.hub.hub.mint_token(&spec).unwrap();
    for selector in ["", "env=prod", "!nothing"] {
        let answers = list(ch, &outsider, configmaps(selector, None))
            .await
            .unwrap();
        assert!(answers.is_empty(), "{selector:?}: {answers:?}");
    }
    let theirs = label(ch, &outsider, "edge-1", &[("env", "dev")], &[])
        .await
        .unwrap_err();
    let nobody = label(ch, &outsider, "edge-9", &[("env", "dev")], &[])
        .await
        .unwrap_err();
    assert_eq!(theirs.code(), Code::NotFound);
    assert_eq!(
        theirs.message().replace("edge-1", "X"),
        nobody.message().replace("edge-9", "X")
    );
    // Its labels stayed as they were.
    let edge1 = otter_e2e::double::link_of(ch, &admin, "edge-1").await;
    assert_eq!(edge1.labels.get("env").map(String::as_str), Some("prod"));

    tokio::time::timeout(Duration::from_secs(10), slow.shutdown())
        .await
        .ok();
    env.shutdown().await;
}
