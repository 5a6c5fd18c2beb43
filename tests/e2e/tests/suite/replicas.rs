//! Hub replicas on one etcd (a real etcd on loopback). Started together on
//! an empty store they agree on one CA, one set of secrets and one first
//! admin token; each sees the tenants, tokens and links the other wrote;
//! the writes that must not race (a join token spent once, a cluster name
//! claimed once, a compare-and-swap) are decided once across replicas; and
//! a token revoked on one replica ends the streams it opened on another.

use std::{sync::Arc, time::Duration};

use futures::StreamExt;
use otter_e2e::{
    TestHub, admin_call,
    double::{WAIT, start_agent, wait_until},
    etcd::Etcd,
    mint_via_admin, with_token,
};
use otter_hub::store::{Store, StoreExt, Swap};
use otter_proto::{
    fleet::v1::{
        FanOut, LabelLinkRequest, ListResourcesRequest, fleet_service_client::FleetServiceClient,
        list_resources_response,
    },
    link::v1::{
        GetAgentManifestRequest, ListLinksRequest, RegisterRequest,
        link_service_client::LinkServiceClient,
    },
    resource::v1::{WatchRequest, resource_service_client::ResourceServiceClient},
};
use otter_tunnel::TransportKind;
use serde_json::json;
use tonic::Code;

fn etcd_options(etcd: &Etcd) -> otter_hub::etcd::EtcdOptions {
    otter_hub::etcd::EtcdOptions::from_url(&etcd.url()).expect("store URL")
}

/// Replicas `a` and `b` started at once on the empty store (with peer
/// ports when `peers`), and the first admin token.
async fn two_replicas(etcd: &Etcd, peers: bool) -> (TestHub, TestHub, String) {
    let (hubs, root) = otter_e2e::etcd::start_replicas(etcd, 2, peers).await;
    let mut hubs = hubs.into_iter();
    let (a, b) = (hubs.next().unwrap(), hubs.next().unwrap());
    (a, b, root)
}

/// [`two_replicas`] with peers, once a names b's tunnel URLs to its agents
/// (the `:port/` they end with is the last item). b is live once a reads
/// its record from the store: only then do a's Register answer and tunnel
/// name b's URLs (in a loaded run, a had not yet read it when the agent
/// came; a tells its agents when it does, but a test of what follows
/// starts from a known list).
async fn two_replicas_a_knows_b(etcd: &Etcd) -> (TestHub, TestHub, String, String) {
    let (a, b, root) = two_replicas(etcd, true).await;
    let b_port = format!(":{}/", b.hub.tunnel_addr.port());
    wait_until(
        async || {
            otter_hub::peers::tunnel_urls_for_agents(&a.hub.state)
                .iter()
                .any(|u| u.as_str().ends_with(&b_port))
        },
        "a to know b's tunnel URLs",
    )
    .await;
    (a, b, root, b_port)
}

/// An HTTP/2 agent enrolled through a, given b's API URL too and a short
/// backoff, once connected through a and told b's tunnel URLs (`b_port`,
/// from [`two_replicas_a_knows_b`]); with its status then.
async fn agent_on_a_knowing_b(
    a: &TestHub,
    b: &TestHub,
    b_port: &str,
    cluster: &str,
    agent_id: &str,
) -> (otter_e2e::double::TestAgent, otter_agent::AgentStatus) {
    let token = a.hub.mint_join_token(cluster).unwrap();
    let agent = otter_e2e::double::start_agent_at(
        a.api_url(),
        a.hub.ca_pem(),
        cluster,
        agent_id,
        &token,
        TransportKind::H2,
        |c| {
            c.more_hub_urls = vec![b.api_url()];
            c.backoff_cap = Duration::from_secs(2);
        },
    );
    let status = agent
        .agent
        .wait_for(WAIT, |s| {
            s.connected.is_some()
                && s.advertised_urls
                    .iter()
                    .any(|u| u.as_str().ends_with(b_port))
        })
        .await
        .expect("connected through a, and told b's tunnel URLs");
    (agent, status)
}

/// Two stores on one etcd racing: compare-and-swap increments all count,
/// and first-use secrets come out the same everywhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stores_on_one_etcd_decide_races_once() {
    let Some(etcd) = Etcd::start() else { return };
    let options = etcd_options(&etcd);
    let stores: Vec<Arc<otter_hub::etcd::EtcdStore>> = (0..2)
        .map(|_| Arc::new(otter_hub::etcd::EtcdStore::connect(&options).expect("store")))
        .collect();
    let per_thread = 25;
    let threads: Vec<_> = (0..4)
        .map(|i| {
            let store = stores[i % 2].clone();
            std::thread::spawn(move || {
                let secret = otter_hub::store::secret(&*store, "race-secret").unwrap();
                let mut lost = 0;
                for _ in 0..per_thread {
                    loop {
                        let old = store.get_raw("meta", "counter").unwrap();
                        let n: u64 = old
                            .as_deref()
                            .map_or(0, |v| std::str::from_utf8(v).unwrap().parse().unwrap());
                        let new = (n + 1).to_string();
                        if store
                            .compare_and_swap_raw(
                                "meta",
                                "counter",
                                old.as_deref(),
                                Some(new.as_bytes()),
                            )
                            .unwrap()
                        {
                            break;
                        }
                        lost += 1;
                    }
                }
                (secret, lost)
            })
        })
        .collect();
    let results: Vec<(Vec<u8>, u32)> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    let lost: u32 = results.iter().map(|r| r.1).sum();
    eprintln!("4 threads on 2 replicas' stores: {lost} compare-and-swaps lost and retried");
    assert!(results.iter().all(|r| r.0 == results[0].0), "one secret");
    // Every increment counted once, as both stores read it.
    for store in &stores {
        wait_until(
            async || {
                store.get_raw("meta", "counter").unwrap().as_deref()
                    == Some((4 * per_thread).to_string().as_bytes())
            },
            "the counter in both copies",
        )
        .await;
    }
    // Deleted on one, gone on the other; a put on one, read on the other.
    stores[0].delete("meta", "counter").unwrap();
    stores[0].put("links", "x", &json!({"n": 1})).unwrap();
    wait_until(
        async || {
            stores[1].get_raw("meta", "counter").unwrap().is_none()
                && stores[1].scan::<serde_json::Value>("links").unwrap() == vec![json!({"n": 1})]
        },
        "the other copy to follow",
    )
    .await;
    assert!(stores[1].writable());

    // Tunnel records are taken by transaction under each replica's lease:
    // two replicas that both take a cluster's absent record at once are
    // decided once.
    let winners = race(&stores, |store, i, c| {
        let mine = format!("replica-{i}");
        store
            .compare_and_swap_leased("tunnels", &format!("edge-{c}"), None, mine.as_bytes())
            .unwrap()
    });
    for (c, winner) in winners.iter().enumerate() {
        let held = stores[1].get_raw("tunnels", &format!("edge-{c}")).unwrap();
        assert_eq!(held, Some(format!("replica-{winner}").into_bytes()));
    }

    // Several keys in one transaction (how an enrollment spends its token,
    // claims the name and writes the link): one racer's writes land, all
    // of them, and none of the other's; a key only checked is not written.
    stores[0].put_raw("meta", "gate", b"open").unwrap();
    wait_until(
        async || stores[1].get_raw("meta", "gate").unwrap().is_some(),
        "the gate in the other copy",
    )
    .await;
    let winners = race(&stores, |store, i, c| {
        store
            .compare_and_swap_all(&multi_swaps(i, c, b"open"))
            .unwrap()
    });
    for (c, winner) in winners.iter().enumerate() {
        let mine = Some(format!("replica-{winner}").into_bytes());
        for tree in ["cluster_tenants", "links"] {
            assert_eq!(
                stores[1].get_raw(tree, &format!("multi-{c}")).unwrap(),
                mine
            );
        }
    }
    stores[0].put_raw("meta", "gate", b"shut").unwrap();
    assert!(
        !stores[0]
            .compare_and_swap_all(&multi_swaps(0, 99, b"open"))
            .unwrap()
    );
    assert_eq!(stores[0].get_raw("links", "multi-99").unwrap(), None);
    assert!(
        stores[0]
            .compare_and_swap_all(&multi_swaps(0, 99, b"shut"))
            .unwrap()
    );
    assert_eq!(
        stores[0].get_raw("meta", "gate").unwrap().as_deref(),
        Some(&b"shut"[..])
    );
}

/// Racer `i`'s writes of round `c` on two keys, checking `meta/gate`
/// holds `gate`.
fn multi_swaps(i: usize, c: usize, gate: &[u8]) -> Vec<Swap> {
    let mine = Some(format!("replica-{i}").into_bytes());
    let absent = |tree: &str| Swap::new(tree, &format!("multi-{c}"), None, mine.clone());
    let gate = Some(gate.to_vec());
    vec![
        absent("cluster_tenants"),
        absent("links"),
        Swap::new("meta", "gate", gate.clone(), gate),
    ]
}

/// Both stores make `attempt` (racer, round) at the same moment, 20 rounds:
/// exactly one wins each. The winner of each round.
fn race(
    stores: &[Arc<otter_hub::etcd::EtcdStore>],
    attempt: fn(&otter_hub::etcd::EtcdStore, usize, usize) -> bool,
) -> Vec<usize> {
    let barrier = Arc::new(std::sync::Barrier::new(2));
    let racers: Vec<_> = (0..2)
        .map(|i| {
            let (store, barrier) = (stores[i].clone(), barrier.clone());
            std::thread::spawn(move || {
                (0..20)
                    .map(|c| {
                        barrier.wait();
                        let won = attempt(&store, i, c);
                        barrier.wait();
                        won
                    })
                    .collect::<Vec<bool>>()
            })
        })
        .collect();
    let won: Vec<Vec<bool>> = racers.into_iter().map(|t| t.join().unwrap()).collect();
    won[0]
        .iter()
        .zip(&won[1])
        .enumerate()
        .map(|(c, (first, second))| {
            assert!(first ^ second, "round {c}: {first} and {second}");
            usize::from(*second)
        })
        .collect()
}

/// Registers racing with one join token through both replicas: exactly
/// one agent enrolls; every other is told the token is used, and both
/// replicas read the winner's link and the name's claim.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registers_racing_with_one_token_on_two_replicas_enroll_one_agent() {
    let Some(etcd) = Etcd::start() else { return };
    let (a, b, _root) = two_replicas(&etcd, false).await;
    let token = a.hub.mint_join_token("edge-1").unwrap();
    let hubs = [&a, &b];
    let results = futures::future::join_all((0..8).map(|i| {
        let (hub, agent, token) = (hubs[i % 2], format!("agent-{i}"), token.clone());
        async move { otter_e2e::register(hub, "edge-1", &agent, &token).await }
    }))
    .await;
    let won: Vec<usize> = (0..8).filter(|i| results[*i].is_ok()).collect();
    assert_eq!(won.len(), 1, "{results:?}");
    for refused in results.iter().filter_map(|r| r.as_ref().err()) {
        assert_eq!(refused.code(), Code::Unauthenticated, "{refused:?}");
        assert!(refused.message().contains("already used"), "{refused:?}");
    }
    let winner = format!("agent-{}", won[0]);
    for hub in hubs {
        let store = &hub.hub.state.store;
        wait_until(
            async || {
                store
                    .get::<otter_hub::link_service::LinkRecord>("links", "edge-1")
                    .unwrap()
                    .is_some_and(|l| l.agent_id == winner)
            },
            "the winner's link on both replicas",
        )
        .await;
        assert_eq!(
            otter_hub::tenancy::tenant_of(&**store, "edge-1")
                .unwrap()
                .as_deref(),
            Some("default")
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_share_tenants_tokens_and_links_on_etcd() {
    let Some(etcd) = Etcd::start() else { return };
    let (a, b, root) = two_replicas(&etcd, false).await;
    let (ca, cb) = (a.channel().await, b.channel().await);
    for ch in [&ca, &cb] {
        LinkServiceClient::new(ch.clone())
            .list_links(with_token(ListLinksRequest {}, &root))
            .await
            .expect("the first admin token works on both");
    }

    // Tenants and tokens made on a serve on b.
    for name in ["acme", "globex"] {
        let (status, text) = admin_call(
            a.hub.api_addr,
            a.hub.ca_pem(),
            &root,
            http::Method::POST,
            "/admin/v1/tenants",
            Some(json!({ "name": name })),
        )
        .await;
        assert_eq!(status, 200, "{text}");
    }
    let (addr_a, pem) = (a.hub.api_addr, a.hub.ca_pem().to_owned());
    let (ann, _) = mint_via_admin(
        addr_a,
        &pem,
        &root,
        json!({"name": "ann", "tenant": "acme", "role": "admin"}),
    )
    .await;
    let (gil, _) = mint_via_admin(
        addr_a,
        &pem,
        &root,
        json!({"name": "gil", "tenant": "globex", "role": "admin"}),
    )
    .await;
    let (mel, mel_id) = mint_via_admin(addr_a, &pem, &ann, json!({"name": "mel"})).await;
    wait_until(
        async || {
            LinkServiceClient::new(cb.clone())
                .list_links(with_token(ListLinksRequest {}, &gil))
                .await
                .is_ok()
        },
        "a token minted on a to work on b",
    )
    .await;

    // A cluster name asked for by two tenants on two replicas at once goes
    // to one of them.
    for i in 0..5 {
        let cluster = format!("contested-{i}");
        let ask = |ch: &tonic::transport::Channel, token: &str| {
            let mut client = LinkServiceClient::new(ch.clone());
            let req = with_token(
                GetAgentManifestRequest {
                    cluster: Some(cluster.clone()),
                    ..Default::default()
                },
                token,
            );
            async move { client.get_agent_manifest(req).await }
        };
        let (x, y) = tokio::join!(ask(&ca, &ann), ask(&cb, &gil));
        let codes = [
            x.as_ref().map_or_else(|s| s.code(), |_| Code::Ok),
            y.as_ref().map_or_else(|s| s.code(), |_| Code::Ok),
        ];
        assert!(
            codes.contains(&Code::Ok) && codes.contains(&Code::AlreadyExists),
            "{cluster}: {codes:?}"
        );
    }

    // A join token is spent once, whichever replicas it is sent to.
    for i in 0..5 {
        let cluster = format!("raced-{i}");
        let join = a.hub.mint_join_token_in(&cluster, "acme").unwrap();
        let (x, y) = tokio::join!(
            otter_e2e::register(&a, &cluster, "one", &join),
            otter_e2e::register(&b, &cluster, "two", &join)
        );
        assert!(x.is_ok() != y.is_ok(), "{cluster}: {x:?} / {y:?}");
    }

    // An agent enrolled and tunnelled through b is a link a lists.
    let join = a.hub.mint_join_token_in("edge-b", "acme").unwrap();
    let agent = start_agent(&b, "edge-b", "agent-b", &join, TransportKind::H2);
    otter_e2e::double::wait_connected(&cb, &ann, 1).await;
    let listed = LinkServiceClient::new(ca.clone())
        .list_links(with_token(ListLinksRequest {}, &ann))
        .await
        .unwrap()
        .into_inner()
        .links;
    assert!(
        listed
            .iter()
            .any(|l| l.cluster.as_deref() == Some("edge-b")),
        "{listed:?}"
    );

    // mel's Watch through b ends when ann revokes mel's token on a.
    let mut watch = ResourceServiceClient::new(cb.clone())
        .watch(with_token(
            WatchRequest {
                cluster: Some("edge-b".into()),
                version: Some("v1".into()),
                resource: Some("pods".into()),
                ..Default::default()
            },
            &mel,
        ))
        .await
        .expect("watch")
        .into_inner();
    assert!(matches!(watch.next().await, Some(Ok(_))));
    let revoked = std::time::Instant::now();
    otter_e2e::revoke_via_admin(addr_a, &pem, &ann, &mel_id).await;
    let ended =
        otter_e2e::end_of_stream("the Watch on b after the revocation on a", &mut watch).await;
    assert_eq!(ended.code(), Code::Unauthenticated, "{ended:?}");
    eprintln!(
        "a Watch on replica b ended {:?} after its token was revoked on a",
        revoked.elapsed()
    );
    drop(agent);
    a.hub.shutdown().await;
    b.hub.shutdown().await;
}

/// A replica starts on a store larger than one answer of etcd's client
/// takes (4 MiB): it reads the store in pages. A replica of a hub with
/// 10,000 clusters (11 MB of keys) could not start before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_starts_on_a_store_larger_than_one_answer() {
    let Some(etcd) = Etcd::start() else { return };
    let (hubs, root) = otter_e2e::etcd::start_replicas(&etcd, 1, false).await;
    let a = hubs.into_iter().next().unwrap();
    // Six values of 1 MiB (etcd takes up to 1.5 MiB in one request), in a
    // tree the hub does not read otherwise, each with its own bytes.
    let value = |i: u8| vec![b'a' + i; 1 << 20];
    for i in 0..6 {
        a.hub
            .state
            .store
            .put_raw("ballast", &format!("k{i}"), &value(i))
            .unwrap();
    }
    let b = otter_e2e::etcd::add_replica(&etcd.url(), &a, 1, false).await;
    for i in 0..6 {
        assert_eq!(
            b.hub
                .state
                .store
                .get_raw("ballast", &format!("k{i}"))
                .unwrap(),
            Some(value(i)),
            "key {i} read by the new replica"
        );
    }
    // And what the hub keeps itself: the first admin token serves on b.
    LinkServiceClient::new(b.channel().await)
        .list_links(with_token(ListLinksRequest {}, &root))
        .await
        .expect("the admin token works on the new replica");
}

/// `otter hub --store etcd://…` as a process: refused without a key to
/// seal the store's secrets, serving with one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_hub_process_runs_on_etcd_and_only_sealed() {
    use otter_e2e::procs::{Proc, Role, free_port, read_when_whole, whole_pem};
    let Some(etcd) = Etcd::start() else { return };
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("hub");
    let key = otter_e2e::etcd::store_key(dir.path());
    let (api, tunnel) = (free_port(), free_port());
    let args = |sealed: bool| -> Vec<String> {
        let mut a: Vec<String> = [
            "hub",
            "--data-dir",
            &data.display().to_string(),
            "--store",
            &etcd.url(),
            "--listen",
            &format!("127.0.0.1:{api}"),
            "--tunnel-listen",
            &format!("127.0.0.1:{tunnel}"),
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
        if sealed {
            a.extend(["--store-key-file".to_owned(), key.display().to_string()]);
        }
        a
    };
    let mut open = Proc::start("hub-unsealed", Role::Otter, &args(false), dir.path(), None);
    let code = open.wait(WAIT);
    assert!(matches!(code, Some(c) if c != 0), "{code:?}");
    assert!(
        open.stderr().contains("needs --store-key-file"),
        "{}",
        open.stderr()
    );

    let hub = Proc::start("hub-etcd", Role::Otter, &args(true), dir.path(), None);
    // Its files are written before it listens.
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], api));
    wait_until(
        async || tokio::net::TcpStream::connect(addr).await.is_ok(),
        "the hub process to listen",
    )
    .await;
    // Its files are written once its ports are bound.
    let token = read_when_whole(&data.join("admin-token"), WAIT, |t| t.ends_with('\n'))
        .expect("the admin token");
    let ca = read_when_whole(&data.join("ca.crt"), WAIT, whole_pem).expect("the CA bundle");
    let channel = otter_e2e::client_channel(addr, &ca, None).await;
    LinkServiceClient::new(channel.clone())
        .list_links(with_token(ListLinksRequest {}, token.trim()))
        .await
        .expect("the hub on etcd answers");
    // A refused registration is in the hub's log with its reason.
    let (_, csr) = otter_pki::csr::generate("edge-r", "a1").unwrap();
    let refused = LinkServiceClient::new(channel)
        .register(RegisterRequest {
            cluster: Some("edge-r".into()),
            csr: Some(csr.into_bytes()),
            agent_id: Some("a1".into()),
            agent_version: Some("v0.1.0".into()),
            join_token: Some("not-a-token".into()),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::Unauthenticated, "{refused:?}");
    wait_until(
        async || {
            let log = hub.stderr();
            log.lines().any(|l| {
                l.contains("registration refused")
                    && l.contains("edge-r")
                    && l.contains(refused.message())
            })
        },
        "the refusal in the hub's log",
    )
    .await;
}

/// An agent tunnelled to replica b, called through replica a: a sends the
/// call to b over the peer port (after its own authorization), streams
/// come back whole, another tenant still sees nothing, a revocation on a
/// ends the stream, and once b is gone a says the cluster is offline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_reaches_a_cluster_through_any_replica() {
    let Some(etcd) = Etcd::start() else { return };
    let (a, b, root) = two_replicas(&etcd, true).await;
    let join = a.hub.mint_join_token_in("edge-b", "default").unwrap();
    let agent = start_agent(&b, "edge-b", "agent-b", &join, TransportKind::H2);
    let ca = a.channel().await;
    // a lists the link as connected, on b's tunnel.
    wait_until(
        async || {
            LinkServiceClient::new(ca.clone())
                .list_links(with_token(ListLinksRequest {}, &root))
                .await
                .is_ok_and(|r| {
                    r.get_ref().links.iter().any(|l| {
                        l.cluster.as_deref() == Some("edge-b")
                            && l.state == Some(otter_proto::link::v1::LinkState::Connected as i32)
                            && l.transport.as_deref() == Some("h2")
                    })
                })
        },
        "replica a to list edge-b as connected",
    )
    .await;
    // A Get and a Watch through a.
    let mut res = ResourceServiceClient::new(ca.clone());
    let got = res
        .get(with_token(otter_e2e::double::get("edge-b", "web"), &root))
        .await
        .expect("a Get through replica a");
    assert_eq!(
        otter_e2e::double::field(got.get_ref(), "user"),
        "otter:admin"
    );
    // Many calls on the one peer connection: h2's guard against floods of
    // empty DATA frames closed it after about 100 before the relay dropped
    // them.
    for i in 0..300 {
        res.get(with_token(otter_e2e::double::get("edge-b", "web"), &root))
            .await
            .unwrap_or_else(|e| panic!("call {i} through replica a: {e:?}"));
    }
    // A fan-out through a reaches the cluster whose tunnel b holds, and a
    // label set through a selects it.
    let mut fleet = FleetServiceClient::new(ca.clone());
    fleet
        .label_link(with_token(
            LabelLinkRequest {
                cluster: Some("edge-b".into()),
                labels: [("site".to_owned(), "b".to_owned())].into(),
                remove: vec![],
            },
            &root,
        ))
        .await
        .expect("label through a");
    let mut answers = fleet
        .list_resources(with_token(
            ListResourcesRequest {
                fan_out: Some(FanOut {
                    link_selector: Some("site=b".into()),
                    timeout_millis: None,
                }),
                version: Some("v1".into()),
                resource: Some("pods".into()),
                ..Default::default()
            },
            &root,
        ))
        .await
        .expect("fan-out through a")
        .into_inner();
    let answer = answers.next().await.expect("one answer").expect("answer");
    assert!(answers.next().await.is_none());
    assert_eq!(answer.cluster(), "edge-b");
    match answer.result {
        Some(list_resources_response::Result::List(l)) => assert_eq!(l.items.len(), 2),
        other => panic!("edge-b through b: {other:?}"),
    }
    let watch_req = || WatchRequest {
        cluster: Some("edge-b".into()),
        version: Some("v1".into()),
        resource: Some("pods".into()),
        ..Default::default()
    };
    let mut watch = res
        .watch(with_token(watch_req(), &root))
        .await
        .expect("watch")
        .into_inner();
    for i in 0..3 {
        let event = tokio::time::timeout(WAIT, watch.next())
            .await
            .expect("event");
        assert!(matches!(event, Some(Ok(_))), "event {i}: {event:?}");
    }
    drop(watch);

    // Another tenant's admin, through a: as absent as before.
    let (status, text) = admin_call(
        a.hub.api_addr,
        a.hub.ca_pem(),
        &root,
        http::Method::POST,
        "/admin/v1/tenants",
        Some(json!({"name": "globex"})),
    )
    .await;
    assert_eq!(status, 200, "{text}");
    let (gil, _) = mint_via_admin(
        a.hub.api_addr,
        a.hub.ca_pem(),
        &root,
        json!({"name": "gil", "tenant": "globex", "role": "admin"}),
    )
    .await;
    let refused = |cluster: &'static str| {
        let mut res = res.clone();
        let gil = gil.clone();
        async move {
            let s = res
                .get(with_token(otter_e2e::double::get(cluster, "web"), &gil))
                .await
                .unwrap_err();
            (s.code(), s.message().replace(cluster, "<c>"))
        }
    };
    let foreign = refused("edge-b").await;
    assert_eq!(foreign.0, Code::NotFound, "{foreign:?}");
    assert_eq!(foreign, refused("no-such").await);
    // A caller naming itself someone else in the peers' header, on the
    // API port, is still who its token says.
    let claim = {
        use base64::Engine;
        let admin = otter_hub::auth::Principal {
            user: "admin".into(),
            cluster_user: "otter:admin".into(),
            tenants: [("default".to_owned(), otter_hub::tenancy::Role::Admin)].into(),
            ..Default::default()
        };
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(serde_json::to_vec(&admin).unwrap())
    };
    let mut req = with_token(otter_e2e::double::get("edge-b", "web"), &gil);
    req.metadata_mut()
        .insert(otter_hub::peers::PRINCIPAL_HEADER, claim.parse().unwrap());
    let forged = res.clone().get(req).await.unwrap_err();
    assert_eq!(forged.code(), Code::NotFound, "{forged:?}");

    // A member's Watch through a, sent to b, ends when a revokes the token.
    let (status, text) = admin_call(
        a.hub.api_addr,
        a.hub.ca_pem(),
        &root,
        http::Method::POST,
        "/admin/v1/tokens",
        Some(json!({"name": "mel"})),
    )
    .await;
    assert_eq!(status, 200, "{text}");
    let minted: serde_json::Value = serde_json::from_str(&text).unwrap();
    let (mel, mel_id) = (
        minted["token"].as_str().unwrap().to_owned(),
        minted["id"].as_str().unwrap().to_owned(),
    );
    let mut watch = res
        .watch(with_token(watch_req(), &mel))
        .await
        .expect("mel's watch")
        .into_inner();
    assert!(matches!(watch.next().await, Some(Ok(_))));
    otter_e2e::revoke_via_admin(a.hub.api_addr, a.hub.ca_pem(), &root, &mel_id).await;
    let ended =
        otter_e2e::end_of_stream("a forwarded Watch after its token's revocation", &mut watch)
            .await;
    assert_eq!(ended.code(), Code::Unauthenticated, "{ended:?}");

    // The kubectl proxy through a answers what b answers itself.
    let kube = |hub: &TestHub| {
        let (addr, pem, root) = (hub.hub.api_addr, hub.hub.ca_pem().to_owned(), root.clone());
        async move {
            admin_call(
                addr,
                &pem,
                &root,
                http::Method::GET,
                "/clusters/edge-b/api/v1/namespaces",
                None,
            )
            .await
        }
    };
    let (through_a, at_b) = (kube(&a).await, kube(&b).await);
    assert_eq!(through_a, at_b);
    assert!(!through_a.1.contains("replica"), "{through_a:?}");
    eprintln!("kubectl proxy through a and at b: {}", through_a.0);

    // The agent and b stop: b's record goes with it, and a says the
    // cluster is offline. (An agent left running would come back through
    // a at once: b's goodbye sends it to the next replica.)
    agent.agent.shutdown().await;
    b.hub.shutdown().await;
    wait_until(
        async || {
            res.get(with_token(otter_e2e::double::get("edge-b", "web"), &root))
                .await
                .is_err_and(|s| s.code() == Code::Unavailable && s.message().contains("offline"))
        },
        "replica a to call edge-b offline",
    )
    .await;
    a.hub.shutdown().await;
}

/// kubectl 1.33 through replica a to a real agent tunnelled to replica b:
/// a list, an exec with stdin (an upgraded connection relayed a → b →
/// agent) and its exit code.
/// A replica relaying a tenant's calls to the replica holding the tunnel
/// counts them against the tenant's bound too: its own bound refuses
/// whatever room the other has, and a place comes back when its call ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relaying_replica_counts_the_tenants_calls_too() {
    let Some(etcd) = Etcd::start() else { return };
    let (hubs, root) = otter_e2e::etcd::start_replicas_tuned(&etcd.url(), 2, true, |i, c| {
        c.max_calls_per_tenant = if i == 0 { 1 } else { 8 };
    })
    .await;
    let (a, b) = (&hubs[0], &hubs[1]);
    let join = a.hub.mint_join_token_in("edge-b", "default").unwrap();
    let _agent = start_agent(b, "edge-b", "agent-b", &join, TransportKind::H2);
    let (ca, cb) = (a.channel().await, b.channel().await);
    async fn get(ch: &tonic::transport::Channel, token: &str) -> Result<(), tonic::Status> {
        let req = with_token(otter_e2e::double::get("edge-b", "web"), token);
        ResourceServiceClient::new(ch.clone())
            .get(req)
            .await
            .map(drop)
    }
    wait_until(
        async || get(&ca, &root).await.is_ok(),
        "a Get through replica a",
    )
    .await;
    let mut watch = ResourceServiceClient::new(ca.clone())
        .watch(with_token(otter_e2e::double::watch("edge-b"), &root))
        .await
        .expect("a Watch through replica a")
        .into_inner();
    watch.next().await.expect("an event").expect("an event");
    let refused = get(&ca, &root)
        .await
        .expect_err("a's bound of one is taken");
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
    assert!(
        refused.message().contains("tenant has 1 calls"),
        "{refused:?}"
    );
    get(&cb, &root)
        .await
        .expect("b, holding the tunnel, has room");
    drop(watch);
    wait_until(
        async || get(&ca, &root).await.is_ok(),
        "a's place to come back",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_reaches_a_cluster_through_any_replica() {
    let Some(etcd) = Etcd::start() else { return };
    let Some(kubectl) = otter_e2e::kubectl_133() else {
        otter_e2e::tool_missing("kubectl 1.33");
        return;
    };
    let (a, b, root) = two_replicas(&etcd, true).await;
    let sim =
        kube_sim::KubeSim::start(otter_e2e::kube::sim_config().pod("default", "web", &["app"]))
            .await
            .expect("kube-sim");
    let join = a.hub.mint_join_token_in("edge-b", "default").unwrap();
    let agent =
        otter_e2e::kube::kube_agent(&b, &sim, "edge-b", &join, TransportKind::H2, |_| {}).await;
    let ca = a.channel().await;
    wait_until(
        async || {
            LinkServiceClient::new(ca.clone())
                .list_links(with_token(ListLinksRequest {}, &root))
                .await
                .is_ok_and(|r| {
                    r.get_ref().links.iter().any(|l| {
                        l.cluster.as_deref() == Some("edge-b")
                            && l.state == Some(otter_proto::link::v1::LinkState::Connected as i32)
                    })
                })
        },
        "replica a to list edge-b as connected",
    )
    .await;
    let tools = tempfile::tempdir().unwrap();
    let ca_file = tools.path().join("hub-ca.pem");
    std::fs::write(&ca_file, a.hub.ca_pem()).unwrap();
    let config = tools.path().join("kubeconfig");
    std::fs::write(
        &config,
        format!(
            "apiVersion: v1\nkind: Config\ncurrent-context: c\n\
             clusters: [{{name: c, cluster: {{server: \"https://localhost:{}/clusters/edge-b\", certificate-authority: {}}}}}]\n\
             users: [{{name: u, user: {{token: {root}}}}}]\n\
             contexts: [{{name: c, context: {{cluster: c, user: u}}}}]\n",
            a.hub.api_addr.port(),
            ca_file.display()
        ),
    )
    .unwrap();
    let k = |args: &[&str], input: Option<&[u8]>| {
        let mut cmd = std::process::Command::new(&kubectl);
        cmd.arg("--kubeconfig").arg(&config).args(args);
        tokio::task::block_in_place(|| {
            otter_e2e::run_bounded_with_input(
                &mut cmd,
                input.map(<[u8]>::to_vec),
                Duration::from_secs(60),
            )
        })
    };
    let (code, out, err) = k(&["get", "pods"], None);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("web"), "{out}");
    let (code, out, err) = k(
        &["exec", "-i", "web", "-c", "app", "--", "cat"],
        Some(b"through two replicas\n"),
    );
    assert_eq!((code, out.as_str()), (0, "through two replicas\n"), "{err}");
    let (code, _, err) = k(
        &["exec", "web", "-c", "app", "--", "sh", "-c", "exit 3"],
        None,
    );
    assert_eq!(code, 3, "{err}");

    // The link deleted through a: b closes the tunnel it holds.
    let deleted = std::time::Instant::now();
    let (status, text) = admin_call(
        a.hub.api_addr,
        a.hub.ca_pem(),
        &root,
        http::Method::DELETE,
        "/admin/v1/links/edge-b",
        None,
    )
    .await;
    assert_eq!(status, 200, "{text}");
    agent
        .wait_for(WAIT, |s| s.connected.is_none())
        .await
        .expect("replica b to close the deleted link's tunnel");
    eprintln!(
        "replica b closed the tunnel {:?} after its link was deleted on a",
        deleted.elapsed()
    );
    let (code, _, err) = k(&["get", "pods"], None);
    assert_ne!(code, 0);
    assert!(
        err.contains("NotFound") || err.contains("not found"),
        "{err}"
    );
    a.hub.shutdown().await;
    b.hub.shutdown().await;
}

/// One request on a replica's peer port as `client` (certificate, key),
/// claiming to relay `principal`: the HTTP status, or why none came.
async fn peer_request(
    peer_url: &url::Url,
    ca_pem: &str,
    client: Option<(&str, &str)>,
    principal: &otter_hub::auth::Principal,
) -> Result<u16, String> {
    use base64::Engine;
    let tls = otter_pki::tls::client_config(ca_pem, client, &[b"h2"]).map_err(|e| e.to_string())?;
    let port = peer_url.port().unwrap();
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .map_err(|e| e.to_string())?;
    let tls = tokio_rustls::TlsConnector::from(Arc::new(tls))
        .connect("localhost".try_into().unwrap(), tcp)
        .await
        .map_err(|e| format!("handshake: {e}"))?;
    let (mut send, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tls),
    )
    .await
    .map_err(|e| format!("h2: {e}"))?;
    tokio::spawn(conn);
    let claim = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .encode(serde_json::to_vec(principal).unwrap());
    let req = http::Request::get("https://localhost/clusters/no-such/api/v1/namespaces")
        .header(otter_hub::peers::PRINCIPAL_HEADER, claim)
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .unwrap();
    let answer = tokio::time::timeout(WAIT, send.send_request(req))
        .await
        .map_err(|_| "no answer".to_owned())?
        .map_err(|e| format!("request: {e}"))?;
    Ok(answer.status().as_u16())
}

/// The peer port believes only replica certificates from the hub CA: no
/// certificate, an agent's certificate (same CA) and a replica certificate
/// of another CA get no answer; a replica's own does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_peer_port_takes_replica_certificates_only() {
    let Some(etcd) = Etcd::start() else { return };
    let (a, b, _) = two_replicas(&etcd, true).await;
    let peer_url = a.hub.state.config.peer_url.clone().expect("peer URL");
    let pem = a.hub.ca_pem().to_owned();
    let forged = otter_hub::auth::Principal {
        user: "mallory".into(),
        cluster_user: "otter:mallory".into(),
        operator: true,
        tenants: [("default".to_owned(), otter_hub::tenancy::Role::Admin)].into(),
        ..Default::default()
    };
    let set = a.hub.state.authority.current();
    let active = &set.active;
    let (agent_key, csr) = otter_pki::csr::generate("edge-x", "x").unwrap();
    let agent_cert = active
        .sign_agent_csr(
            &csr,
            &otter_pki::AgentIdentity::new("edge-x", "x").unwrap(),
            Duration::from_secs(3600),
        )
        .unwrap()
        .pem;
    let other_ca = otter_pki::CertificateAuthority::generate("another CA").unwrap();
    let (stranger_cert, stranger_key) = other_ca
        .issue_replica_cert("c", &[], Duration::from_secs(3600))
        .unwrap();
    let (replica_cert, replica_key) = active
        .issue_replica_cert("c", &[], Duration::from_secs(3600))
        .unwrap();
    let cases: [(&str, Option<(&str, &str)>); 3] = [
        ("no certificate", None),
        ("an agent's certificate", Some((&agent_cert, &agent_key))),
        (
            "another CA's replica certificate",
            Some((&stranger_cert, &stranger_key)),
        ),
    ];
    for (what, client) in cases {
        let got = peer_request(&peer_url, &pem, client, &forged).await;
        assert!(got.is_err(), "{what}: answered {got:?}");
        eprintln!("{what}: {}", got.unwrap_err());
    }
    // The control: a replica's certificate is answered (the cluster does
    // not exist, which the kubectl proxy says with 404).
    let got = peer_request(
        &peer_url,
        &pem,
        Some((&replica_cert, &replica_key)),
        &forged,
    )
    .await;
    assert_eq!(got, Ok(404));
    a.hub.shutdown().await;
    b.hub.shutdown().await;
}

/// Replicas as processes behind a load balancer (a relay on loopback for
/// the API port and one for the tunnel port, as one address). The replica
/// holding a cluster's tunnel is killed with SIGKILL: calls through the
/// other one get `Unavailable` naming the cluster, each at once, and once
/// the balancer sends the agent to the survivor it takes the cluster over
/// and calls work again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_replica_hands_its_clusters_to_another() {
    let Some(etcd) = Etcd::start() else { return };
    let dir = tempfile::tempdir().unwrap();
    let key = otter_e2e::etcd::store_key(dir.path());
    let (lb_api, lb_tunnel) = (
        otter_e2e::Relay::start().await,
        otter_e2e::Relay::start().await,
    );
    let otter_e2e::etcd::ReplicaProcs {
        mut procs,
        ports,
        token,
        ca,
    } = otter_e2e::etcd::replica_procs(
        dir.path(),
        &etcd.url(),
        &key,
        2,
        &[
            "--external-url".into(),
            format!("https://localhost:{}", lb_api.addr.port()),
            "--tunnel-url".into(),
            format!("h2://localhost:{}", lb_tunnel.addr.port()),
            "--keepalive-secs".into(),
            "1".into(),
        ],
    )
    .await;
    let api = |i: usize| std::net::SocketAddr::from(([127, 0, 0, 1], ports[i].0));
    // The balancer sends everything to r1 first.
    lb_api.set_target(api(1));
    lb_tunnel.set_target(std::net::SocketAddr::from(([127, 0, 0, 1], ports[1].1)));
    let join = otter_e2e::etcd::join_token_on(&etcd.url(), &key, "edge-k");
    let lb_url: url::Url = format!("https://localhost:{}", lb_api.addr.port())
        .parse()
        .unwrap();
    let agent = otter_e2e::double::start_agent_at(
        lb_url,
        &ca,
        "edge-k",
        "agent-k",
        &join,
        TransportKind::H2,
        |_| {},
    );
    let via_r0 = otter_e2e::client_channel(api(0), &ca, None).await;
    let get = || {
        let mut res = ResourceServiceClient::new(via_r0.clone());
        let token = token.clone();
        async move {
            tokio::time::timeout(
                Duration::from_secs(5),
                res.get(with_token(otter_e2e::double::get("edge-k", "web"), &token)),
            )
            .await
            .expect("a call answered within 5 s, never a hang")
        }
    };
    wait_until(
        async || get().await.is_ok(),
        "a call through r0 to r1's tunnel",
    )
    .await;
    let before = agent
        .agent
        .wait_for(WAIT, |s| s.connected.is_some())
        .await
        .unwrap();
    assert!(before.connected.is_some());
    // A Watch through r0, passed on to r1, which holds the tunnel.
    let mut watch = ResourceServiceClient::new(via_r0.clone())
        .watch(with_token(otter_e2e::double::watch("edge-k"), &token))
        .await
        .expect("watch")
        .into_inner();
    let mut payloads = Vec::new();
    let mut next_events = async |n: usize, payloads: &mut Vec<String>| {
        for _ in 0..n {
            let ev = tokio::time::timeout(WAIT, watch.next())
                .await
                .unwrap_or_else(|_| panic!("the watch went quiet after {payloads:?}"))
                .unwrap_or_else(|| panic!("the watch ended after {payloads:?}"))
                .unwrap_or_else(|e| panic!("the watch failed after {payloads:?}: {e:?}"));
            payloads.push(otter_e2e::double::field(
                ev.resource.as_ref().expect("object"),
                "payload",
            ));
        }
    };
    next_events(3, &mut payloads).await;

    procs[1].kill9();
    let killed = std::time::Instant::now();
    lb_api.set_target(api(0));
    lb_tunnel.set_target(std::net::SocketAddr::from(([127, 0, 0, 1], ports[0].1)));
    let mut refused = 0;
    let back = loop {
        match get().await {
            Ok(_) => break killed.elapsed(),
            Err(s) => {
                assert_eq!(s.code(), Code::Unavailable, "{s:?}");
                assert!(s.message().contains("edge-k"), "{s:?}");
                refused += 1;
            }
        }
        assert!(killed.elapsed() < WAIT, "edge-k never came back through r0");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    eprintln!(
        "r1 killed: {refused} calls answered Unavailable, calls through r0 worked again after {back:?}"
    );
    for _ in 0..20 {
        get().await.expect("calls after the take-over");
    }
    // The Watch went on through r0's own tunnel from its last event:
    // nothing lost, nothing repeated.
    next_events(3, &mut payloads).await;
    let expected: Vec<String> = (0..6).map(|i| format!("event-{i}")).collect();
    assert_eq!(
        payloads, expected,
        "lost or repeated events across the take-over"
    );
}

/// Without a load balancer in front: an agent given both replicas' API
/// URLs registers through the first, learns every live replica's tunnel
/// URLs (Register's answer lists them, and each tunnel tells them again),
/// and when its replica stops it is back through the other replica within
/// its backoff, with its certificate: no renewal, no new Register.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_fail_over_to_another_replica_without_a_load_balancer() {
    let Some(etcd) = Etcd::start() else { return };
    let (a, b, root, b_port) = two_replicas_a_knows_b(&etcd).await;
    let (agent, first) = agent_on_a_knowing_b(&a, &b, &b_port, "edge-1", "a1").await;
    assert!(
        a.hub.state.registry.get("edge-1").is_some(),
        "a holds the tunnel"
    );

    let stopped = std::time::Instant::now();
    a.hub.shutdown().await;
    let back = agent
        .agent
        .wait_for(WAIT, |s| {
            s.connected.is_some() && s.connects > first.connects
        })
        .await
        .expect("back through b");
    let took = stopped.elapsed();
    assert!(
        b.hub.state.registry.get("edge-1").is_some(),
        "b holds the tunnel"
    );
    assert_eq!((back.registrations, back.renewals), (1, 0), "{back:?}");
    // The replica said it was stopping: the first round after went to the
    // other one, not to the stopped replica's port.
    assert_eq!(back.dials, first.dials + 1, "{back:?}");
    let r = ResourceServiceClient::new(b.channel().await)
        .get(with_token(otter_e2e::double::get("edge-1", "after"), &root))
        .await
        .expect("a call through b");
    assert_eq!(otter_e2e::double::field(r.get_ref(), "name"), "after");
    eprintln!(
        "the agent's replica stopped: back through the other {took:?} later, no load balancer"
    );
    agent.agent.shutdown().await;
    b.hub.shutdown().await;
}

/// When a replica stops, its agents' new tunnels on the other are recorded
/// in the store (which replica holds each, under that replica's lease), a
/// batch of admissions to a transaction: every cluster's record names the
/// survivor and the very tunnel it holds, so calls through any replica
/// find it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tunnels_taken_over_together_are_all_recorded() {
    let Some(etcd) = Etcd::start() else { return };
    let (a, b, root, b_port) = two_replicas_a_knows_b(&etcd).await;
    let clusters: Vec<String> = (0..12).map(|i| format!("edge-t{i}")).collect();
    let mut agents = Vec::new();
    for c in &clusters {
        let agent_id = format!("agent-{c}");
        agents.push(agent_on_a_knowing_b(&a, &b, &b_port, c, &agent_id).await.0);
    }
    a.hub.shutdown().await;
    let state = &b.hub.state;
    let recorded = |cluster: &str| {
        let live = state.registry.get(cluster)?;
        let owner = otter_hub::peers::owner(&*state.store, cluster, "").ok()??;
        (owner.replica == state.config.replica && owner.tunnel == live.id).then_some(())
    };
    wait_until(
        async || clusters.iter().all(|c| recorded(c).is_some()),
        "every cluster recorded as b's, with the tunnel b holds",
    )
    .await;
    let mut resource = ResourceServiceClient::new(b.channel().await);
    for c in &clusters {
        resource
            .get(with_token(otter_e2e::double::get(c, "web"), &root))
            .await
            .expect("a call through b");
    }
    for agent in agents {
        agent.agent.shutdown().await;
    }
    b.hub.shutdown().await;
}

/// A stopping replica's goodbye sends its agents to the other live
/// replicas, over QUIC (in the close) and HTTP/2 (in the goodbye) alike:
/// an agent that knew of none (here, one given replica a's API URL only)
/// would have nowhere to turn, and one that knew of them only from its
/// last diagnosis could know replicas long gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopping_replica_sends_its_agents_to_the_others() {
    let Some(etcd) = Etcd::start() else { return };
    let (a, b, _root, _) = two_replicas_a_knows_b(&etcd).await;
    let b_port = b.hub.tunnel_addr.port();
    let mut agents = Vec::new();
    let mut ended = Vec::new();
    for kind in [TransportKind::Quic, TransportKind::H2] {
        let cluster = format!("edge-bye-{kind}");
        let token = a.hub.mint_join_token(&cluster).unwrap();
        let agent = otter_e2e::double::start_agent_at(
            a.api_url(),
            a.hub.ca_pem(),
            &cluster,
            "agent-0",
            &token,
            kind,
            |c| c.backoff_cap = Duration::from_secs(2),
        );
        agent
            .agent
            .wait_for(WAIT, |s| s.connected.is_some())
            .await
            .expect("connected through a");
        // The URLs the agent holds as its tunnel ends with a's goodbye.
        let mut status = agent.agent.status_watch();
        ended.push(tokio::spawn(async move {
            loop {
                {
                    let s = status.borrow_and_update();
                    let bye = s.last_tunnel_end.as_ref().map(|e| e.why.clone());
                    if s.connected.is_none() && bye.is_some() {
                        return (bye, s.advertised_urls.clone());
                    }
                }
                if status.changed().await.is_err() {
                    return (None, Vec::new());
                }
            }
        }));
        agents.push((cluster, agent));
    }
    a.hub.shutdown().await;
    for ((cluster, agent), ended) in agents.iter().zip(ended) {
        let (why, urls) = tokio::time::timeout(WAIT, ended)
            .await
            .expect("the tunnel ended")
            .unwrap();
        // The reason as it was, the URLs taken out of it.
        assert_eq!(why.as_deref(), Some(otter_tunnel::frame::BYE_STOPPING));
        assert!(
            !urls.is_empty() && urls.iter().all(|u| u.port() == Some(b_port)),
            "{cluster}: told b's URLs only, got {urls:?}"
        );
        agent
            .agent
            .wait_for(WAIT, |s| s.connected.is_some())
            .await
            .expect("connected through b");
        assert!(
            b.hub.state.registry.get(cluster).is_some(),
            "{cluster} on b"
        );
    }
    for (_, agent) in agents {
        agent.agent.shutdown().await;
    }
    b.hub.shutdown().await;
}

/// A replica stopping clears the records of the tunnels it held, many to
/// a transaction and off the runtime's workers: each was a transaction of
/// its own, made on the worker of the tunnel's task, and a replica holding
/// 10,000 tunnels took 29 s to stop, its goodbyes going out late.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopping_replica_clears_its_tunnels_records_together() {
    let Some(etcd) = Etcd::start() else { return };
    let (hubs, _root) = otter_e2e::etcd::start_replicas(&etcd, 1, true).await;
    let a = hubs.into_iter().next().unwrap();
    const TUNNELS: usize = 30;
    let clusters: Vec<String> = (0..TUNNELS).map(|i| format!("edge-s{i}")).collect();
    let mut agents = Vec::new();
    for c in &clusters {
        let token = a.hub.mint_join_token(c).unwrap();
        let agent = otter_e2e::double::start_agent_at(
            a.api_url(),
            a.hub.ca_pem(),
            c,
            &format!("agent-{c}"),
            &token,
            TransportKind::H2,
            |_| {},
        );
        agent
            .agent
            .wait_for(WAIT, |s| s.connected.is_some())
            .await
            .expect("connected");
        agents.push(agent);
    }
    let state = &a.hub.state;
    wait_until(
        async || {
            clusters.iter().all(|c| {
                otter_hub::peers::owner(&*state.store, c, "")
                    .ok()
                    .flatten()
                    .is_some_and(|o| o.replica == state.config.replica)
            })
        },
        "every tunnel recorded as a's",
    )
    .await;
    assert_eq!(
        etcd.keys_under("/otterscale-link/tunnels/"),
        Some(TUNNELS as u64)
    );
    // Nothing else is written meanwhile: the agents have nowhere to go.
    let before = etcd.revision().expect("etcd revision");
    a.hub.shutdown().await;
    let writes = etcd.revision().expect("etcd revision") - before;
    // The records in one transaction, the links' last-seen times in a few
    // (as the tunnels close), the replica's own record: over 30 when each
    // record was a transaction of its own.
    assert!(writes < (TUNNELS / 3) as i64, "{writes} writes to stop");
    assert_eq!(
        etcd.keys_under("/otterscale-link/tunnels/"),
        Some(0),
        "every tunnel's record cleared"
    );
    for agent in agents {
        agent.agent.shutdown().await;
    }
}

/// A replica that starts after an agent connected is named to that agent
/// as soon as the agent's replica reads its record (the store's watch), not
/// at some later diagnosis; one that stops is dropped again. Otherwise an
/// agent connected before a scale-up knows no replica to turn to when its
/// own stops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connected_agents_learn_of_replicas_that_come_and_go() {
    let Some(etcd) = Etcd::start() else { return };
    let (hubs, _root) = otter_e2e::etcd::start_replicas(&etcd, 1, false).await;
    let a = hubs.into_iter().next().expect("one replica");
    let token = a.hub.mint_join_token("edge-late").unwrap();
    let agent = otter_e2e::double::start_agent_at(
        a.api_url(),
        a.hub.ca_pem(),
        "edge-late",
        "a1",
        &token,
        TransportKind::Quic,
        |_| {},
    );
    let first = agent
        .agent
        .wait_for(WAIT, |s| {
            s.connected.is_some() && !s.advertised_urls.is_empty()
        })
        .await
        .expect("connected through a, and told its URLs");
    let a_only = first.advertised_urls.clone();

    let b = otter_e2e::etcd::add_replica(&etcd.url(), &a, 1, false).await;
    let b_port = format!(":{}/", b.hub.tunnel_addr.port());
    assert!(
        !a_only.iter().any(|u| u.as_str().ends_with(&b_port)),
        "{a_only:?}"
    );
    let started = std::time::Instant::now();
    let told = agent
        .agent
        .wait_for(WAIT, |s| {
            s.advertised_urls
                .iter()
                .any(|u| u.as_str().ends_with(&b_port))
        })
        .await
        .expect("the connected agent told of the new replica");
    eprintln!(
        "told of the new replica {:?} after it started: {}",
        started.elapsed(),
        told.advertised_urls
            .iter()
            .map(url::Url::as_str)
            .collect::<Vec<_>>()
            .join(" ")
    );
    assert!(
        a_only.iter().all(|u| told.advertised_urls.contains(u)),
        "a's own URLs first and still there: {:?}",
        told.advertised_urls
    );
    assert_eq!(told.connects, first.connects, "the same tunnel: {told:?}");

    b.hub.shutdown().await;
    let after = agent
        .agent
        .wait_for(WAIT, |s| {
            !s.advertised_urls
                .iter()
                .any(|u| u.as_str().ends_with(&b_port))
        })
        .await
        .expect("the stopped replica dropped from what the agent is told");
    assert_eq!(after.advertised_urls, a_only);
    agent.agent.shutdown().await;
    a.hub.shutdown().await;
}

/// A port-forward's upload through a replica that does not hold the
/// cluster's tunnel: the upload path on that replica sends its batches on
/// through the replica that does, several at once, each with its place on
/// the path, and every byte reaches the pod once, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_port_forward_upload_through_another_replica_keeps_its_order() {
    use otter_proto::runtime::v1::{
        PortForwardRequest, WritePortForwardRequest, runtime_service_client::RuntimeServiceClient,
    };
    let Some(etcd) = Etcd::start() else { return };
    let (a, b, root) = two_replicas(&etcd, true).await;
    let sim =
        kube_sim::KubeSim::start(otter_e2e::kube::sim_config().pod("default", "web", &["app"]))
            .await
            .expect("test server");
    sim.add_pod_port(
        "default",
        "web",
        8080,
        otter_e2e::procs::echo_server().await,
    );
    let join = b.hub.mint_join_token_in("edge-pf", "default").unwrap();
    let agent =
        otter_e2e::kube::kube_agent(&b, &sim, "edge-pf", &join, TransportKind::Quic, |_| {}).await;
    let ca = a.channel().await;
    wait_until(
        async || {
            otter_hub::peers::owner(&*a.hub.state.store, "edge-pf", "r0").is_ok_and(|o| o.is_some())
        },
        "replica a to see edge-pf's tunnel on b",
    )
    .await;
    let mut rt = RuntimeServiceClient::new(ca)
        .max_decoding_message_size(8 * 1024 * 1024)
        .max_encoding_message_size(8 * 1024 * 1024);
    let mut stream = rt
        .port_forward(with_token(
            PortForwardRequest {
                cluster: Some("edge-pf".into()),
                namespace: Some("default".into()),
                name: Some("web".into()),
                port: Some(8080),
            },
            &root,
        ))
        .await
        .expect("port-forward through a")
        .into_inner();
    let id = stream
        .next()
        .await
        .expect("a first message")
        .expect("a first message")
        .session_id
        .expect("session id first");
    // Pieces of many sizes, each telling its place, so that a batch out of
    // order shows.
    let mut expected = Vec::new();
    for i in 0..120usize {
        let mut piece = format!("<{i}>").into_bytes();
        piece.resize(piece.len() + (i * 7919) % 96_000, b'a' + (i % 26) as u8);
        rt.write_port_forward(with_token(
            WritePortForwardRequest {
                session_id: Some(id.clone()),
                data: Some(piece.clone()),
            },
            &root,
        ))
        .await
        .expect("a write through a");
        expected.extend_from_slice(&piece);
    }
    let mut back = Vec::new();
    tokio::time::timeout(WAIT, async {
        while back.len() < expected.len() {
            let m = stream
                .next()
                .await
                .expect("the stream goes on")
                .expect("data");
            back.extend(m.data.unwrap_or_default());
        }
    })
    .await
    .expect("every byte echoed");
    assert!(back == expected, "bytes arrived out of order or changed");
    eprintln!(
        "{} bytes in 120 writes through replica a reached the pod on b's tunnel in order",
        expected.len()
    );
    drop(stream);
    agent.shutdown().await;
    a.hub.shutdown().await;
    b.hub.shutdown().await;
}

/// A replica killed with SIGKILL on a host that stays up: the QUIC
/// agent's next datagram to the dead port comes back refused (ICMP port
/// unreachable, where a TCP connection would be reset), and the agent
/// dials the other replica at once, make before break, instead of waiting
/// until its path has been quiet for one and a half keepalives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quic_agent_leaves_a_killed_replica_when_its_port_refuses() {
    // Keepalives every 4 s: the refusal comes within one (the agent's
    // next ping), the quiet rule would act only after 6 s.
    let keepalive = ["--keepalive-secs".into(), "4".into()];
    let Some((etcd, _dir, key, procs)) = replicas_on_etcd(2, &keepalive).await else {
        return;
    };
    let otter_e2e::etcd::ReplicaProcs {
        mut procs,
        ports,
        token,
        ca,
    } = procs;
    let api = |i: usize| std::net::SocketAddr::from(([127, 0, 0, 1], ports[i].0));
    let api_url =
        |i: usize| -> url::Url { format!("https://localhost:{}", ports[i].0).parse().unwrap() };
    let join = otter_e2e::etcd::join_token_on(&etcd.url(), &key, "edge-q");
    let r0_tunnel = format!(":{}/", ports[0].1);
    let agent = otter_e2e::double::start_agent_at(
        api_url(1),
        &ca,
        "edge-q",
        "agent-q",
        &join,
        TransportKind::Quic,
        |c| {
            c.more_hub_urls = vec![api_url(0)];
            c.keepalive = otter_tunnel::Keepalive::every(Duration::from_secs(4));
        },
    );
    let before = agent
        .agent
        .wait_for(WAIT, |s| {
            s.connected == Some(TransportKind::Quic)
                && s.advertised_urls
                    .iter()
                    .any(|u| u.as_str().ends_with(&r0_tunnel))
        })
        .await
        .expect("connected through r1 over QUIC, and told r0's tunnel URLs");
    assert_eq!((before.refused_probes, before.quiet_probes), (0, 0));

    procs[1].kill9();
    let moved = agent
        .agent
        .wait_for(WAIT, |s| s.redials > before.redials)
        .await
        .expect("the agent moves to r0");
    assert_eq!(
        (moved.refused_probes, moved.quiet_probes),
        (1, 0),
        "the refusal, not the silence, sent the agent on: {moved:?}"
    );
    assert_eq!(moved.connected, Some(TransportKind::Quic));
    assert_eq!(
        moved.connects, before.connects,
        "moved make before break, without a reconnect: {moved:?}"
    );
    a_call_gets_through(api(0), &ca, &token, "edge-q").await;
    agent.agent.shutdown().await;
}

/// Waits until a Get for `cluster` through the replica whose API is at
/// `api` answers: the agent's new tunnel is there and recorded.
async fn a_call_gets_through(api: std::net::SocketAddr, ca: &str, token: &str, cluster: &str) {
    let channel = otter_e2e::client_channel(api, ca, None).await;
    wait_until(
        async || {
            ResourceServiceClient::new(channel.clone())
                .get(with_token(otter_e2e::double::get(cluster, "web"), token))
                .await
                .is_ok()
        },
        &format!("a call through {api} to {cluster}'s new tunnel"),
    )
    .await;
}

/// Replica processes on a new etcd ([`otter_e2e::etcd::replica_procs`]),
/// with the folder and store key they share; `None` without etcd.
async fn replicas_on_etcd(
    n: usize,
    extra: &[String],
) -> Option<(
    Etcd,
    tempfile::TempDir,
    std::path::PathBuf,
    otter_e2e::etcd::ReplicaProcs,
)> {
    let etcd = Etcd::start()?;
    let dir = tempfile::tempdir().unwrap();
    let key = otter_e2e::etcd::store_key(dir.path());
    let procs = otter_e2e::etcd::replica_procs(dir.path(), &etcd.url(), &key, n, extra).await;
    Some((etcd, dir, key, procs))
}

/// An agent whose replica went away before it heard of any other (it holds
/// that replica's tunnel URLs only, and its first `--hub-url` is that
/// replica's API) asks its other hub URLs whether the hub is up, and once
/// one answers, registers through it and takes the tunnel URLs served now.
/// Asking the first URL alone, the agent found the hub down and dialled
/// the dead replica's port for as long as its certificate lasted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_that_knew_one_replica_finds_another_through_its_other_hub_url() {
    let Some((etcd, dir, key, mut r0)) = replicas_on_etcd(1, &[]).await else {
        return;
    };
    let (r0_ports, ca) = (r0.ports[0], r0.ca.clone());
    let r1_ports = (
        otter_e2e::procs::free_port(),
        otter_e2e::procs::free_port(),
        otter_e2e::procs::free_port(),
    );
    let api_url = |port: u16| -> url::Url { format!("https://localhost:{port}").parse().unwrap() };
    let join = otter_e2e::etcd::join_token_on(&etcd.url(), &key, "edge-lost");
    let agent = otter_e2e::double::start_agent_at(
        api_url(r0_ports.0),
        &ca,
        "edge-lost",
        "agent-l",
        &join,
        TransportKind::H2,
        |c| {
            c.more_hub_urls = vec![api_url(r1_ports.0)];
            c.backoff_cap = Duration::from_secs(2);
        },
    );
    let before = agent
        .agent
        .wait_for(WAIT, |s| {
            s.connected.is_some() && !s.advertised_urls.is_empty()
        })
        .await
        .expect("connected through r0, and told its tunnel URLs");
    assert!(
        before
            .advertised_urls
            .iter()
            .all(|u| u.port() == Some(r0_ports.1)),
        "r0's URLs only: {:?}",
        before.advertised_urls
    );

    r0.procs[0].kill9();
    let started = std::time::Instant::now();
    let _r1 = otter_e2e::etcd::replica_proc("r1", dir.path(), &etcd.url(), &key, r1_ports, &[]);
    // Ten seconds of failed rounds before the agent asks (a hub that is
    // only restarting moves nothing), then a round to r1.
    let back = agent
        .agent
        .wait_for(Duration::from_secs(60), |s| {
            s.connected.is_some()
                && s.connects > before.connects
                && s.advertised_urls
                    .first()
                    .is_some_and(|u| u.port() == Some(r1_ports.1))
        })
        .await
        .expect("back through r1, found through its API URL, and told r1's URLs");
    eprintln!(
        "the agent's only replica killed: back through the other {:?} later",
        started.elapsed()
    );
    assert_eq!(back.registrations, before.registrations, "{back:?}");
    let r1_api = std::net::SocketAddr::from(([127, 0, 0, 1], r1_ports.0));
    a_call_gets_through(r1_api, &ca, &r0.token, "edge-lost").await;
    agent.agent.shutdown().await;
}
