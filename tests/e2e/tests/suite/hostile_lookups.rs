//! Anonymous callers against a hub replica on etcd. A bearer token names
//! the key its record is kept under, and a replica asks etcd for keys its
//! copy lacks (a token minted elsewhere a moment ago must work at once),
//! so a flood of made-up tokens would be a flood of etcd requests. The
//! replica asks in one transaction at a time for every lookup waiting,
//! with a bounded queue behind it, and refuses the rest at once. Checked
//! through the real binary, with etcd behind a relay the test can hold.

use std::time::Duration;

use futures::StreamExt;
use otter_e2e::{
    Relay, client_channel,
    double::get,
    etcd::{Etcd, ReplicaProcs, replica_procs, store_key},
    with_token,
};
use otter_proto::{
    link::v1::{ListLinksRequest, link_service_client::LinkServiceClient},
    resource::v1::resource_service_client::ResourceServiceClient,
};
use tonic::{Code, transport::Channel};

/// A well-formed API token that no one minted.
fn made_up() -> String {
    format!("ots_{:016x}_{}", rand::random::<u64>(), "s".repeat(43))
}

/// How long one caller waits at most: two store bounds (a lookup queued
/// behind one that waits out the bound waits out its own) and margin.
const PATIENCE: Duration = Duration::from_secs(30);

/// `n` Gets with made-up tokens, `at_once` at a time across `channels`;
/// the status of each (none may succeed or go unanswered).
async fn flood(channels: Vec<Channel>, n: usize, at_once: usize) -> Vec<tonic::Status> {
    futures::stream::iter(0..n)
        .map(|i| {
            let mut c = ResourceServiceClient::new(channels[i % channels.len()].clone());
            async move {
                let answer = tokio::time::timeout(
                    PATIENCE,
                    c.get(with_token(get("edge-1", "web"), &made_up())),
                )
                .await
                .expect("every caller is answered, none left hanging");
                answer.expect_err("a made-up token is refused")
            }
        })
        .buffer_unordered(at_once)
        .collect()
        .await
}

async fn list_links(channel: &Channel, token: &str) -> Result<(), tonic::Status> {
    LinkServiceClient::new(channel.clone())
        .list_links(with_token(ListLinksRequest {}, token))
        .await
        .map(drop)
}

/// An API token of tenant `default` written straight into the store, as
/// another replica would: this replica learns of it by watch or lookup.
fn mint_elsewhere(store: &str, key: &std::path::Path) -> String {
    let opts = otter_hub::etcd::EtcdOptions::from_url(store).expect("store URL");
    let store = otter_hub::sealed::SealedStore::new(
        otter_hub::etcd::EtcdStore::connect(&opts).expect("store"),
        &otter_hub::sealed::read_key(key).expect("store key"),
    )
    .expect("sealed store");
    let spec = otter_hub::tokens::TokenSpec::member("dee", &[], "default");
    otter_hub::tokens::mint_api_token(&store, &spec)
        .expect("minted")
        .0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn made_up_tokens_cost_etcd_one_request_per_round_trip() {
    const N: usize = 400;
    let Some(etcd) = Etcd::start() else { return };
    let relay = Relay::start().await;
    relay.set_target(std::net::SocketAddr::from((
        [127, 0, 0, 1],
        etcd.client_port,
    )));
    let dir = tempfile::tempdir().unwrap();
    let key = store_key(dir.path());
    let via_relay = format!("etcd://{}", relay.addr);
    let ReplicaProcs {
        procs: _procs,
        ports,
        token: admin,
        ca,
    } = replica_procs(dir.path(), &via_relay, &key, 1, &[]).await;
    let api = std::net::SocketAddr::from(([127, 0, 0, 1], ports[0].0));
    let mut channels = Vec::new();
    for _ in 0..8 {
        channels.push(client_channel(api, &ca, None).await);
    }
    list_links(&channels[0], &admin)
        .await
        .expect("the replica serves its admin");

    // etcd answering: every made-up token is refused as such, and a token
    // minted elsewhere during the flood works here at once.
    let before = etcd.kv_requests();
    let attack = tokio::spawn(flood(channels.clone(), N, 64));
    let (url, k) = (etcd.url(), key.clone());
    let minted = tokio::task::spawn_blocking(move || mint_elsewhere(&url, &k))
        .await
        .unwrap();
    list_links(&channels[1], &minted)
        .await
        .expect("a token minted elsewhere works at once, flood or not");
    let refused = attack.await.unwrap();
    let wrong: Vec<_> = refused
        .iter()
        .filter(|s| s.code() != Code::Unauthenticated)
        .collect();
    assert!(
        wrong.is_empty(),
        "made-up tokens refused otherwise: {wrong:?}"
    );
    let answering = etcd.kv_requests() - before;
    println!("etcd answering: {N} made-up tokens cost {answering} etcd requests");

    // etcd held (no answer): lookups beyond the batch and its queue are
    // refused at once; the others wait out the store's bound; the hub goes
    // on serving what its copy knows.
    let before = etcd.kv_requests();
    relay.hold(true);
    let attack = tokio::spawn(flood(channels.clone(), N, N));
    tokio::time::sleep(Duration::from_millis(300)).await;
    list_links(&channels[2], &admin)
        .await
        .expect("known tokens work while lookups wait");
    assert!(
        !attack.is_finished(),
        "the admin's call was answered while made-up tokens still waited on etcd"
    );
    let refused = attack.await.unwrap();
    relay.hold(false);
    let busy = refused
        .iter()
        .filter(|s| s.code() == Code::Unavailable && s.message().contains("too many unknown"))
        .count();
    let waited = refused
        .iter()
        .filter(|s| s.code() == Code::Unavailable && s.message().contains("etcd"))
        .count();
    println!("etcd held: {busy} of {N} refused at once, {waited} waited out the bound");
    assert_eq!(
        busy + waited,
        N,
        "each made-up token refused as busy or unavailable: {:?}",
        refused.iter().find(|s| s.code() != Code::Unavailable)
    );
    assert!(
        busy >= N / 2,
        "only {busy} of {N} lookups were refused at once: the rest waited on etcd"
    );

    // etcd back: refused as unknown again, and what the hold cost etcd is
    // counted once the relay has let the held requests through.
    // Each try costs etcd a lookup of its own, not counted against the flood.
    let tries = std::sync::atomic::AtomicU64::new(0);
    otter_e2e::double::wait_until(
        async || {
            tries.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            flood(channels.clone(), 1, 1).await[0].code() == Code::Unauthenticated
                && list_links(&channels[3], &admin).await.is_ok()
        },
        "made-up tokens refused as unknown once etcd answers",
    )
    .await;
    let held = (etcd.kv_requests() - before).saturating_sub(tries.into_inner());
    println!("etcd held: {N} made-up tokens cost {held} etcd requests");
    assert!(
        held <= 10,
        "{held} etcd requests for {N} lookups while etcd was held: one per lookup?"
    );
}
