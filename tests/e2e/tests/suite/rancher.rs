//! `LinkService.ListRancherProjects` against a Rancher management cluster:
//! the Kubernetes API test server with Rancher's Project CRD
//! (`projects.management.cattle.io`, v3) and projects of two clusters, and
//! the project id an agent registers with shown by ListLinks.

use std::sync::Arc;

use kube_sim::{ADMIN_TOKEN, KubeSim, SimConfig};
use otter_e2e::{
    TestHub,
    double::{start_agent_with, wait_connected},
    with_token,
};
use otter_proto::link::v1::{
    ListLinksRequest, ListRancherProjectsRequest, link_service_client::LinkServiceClient,
};
use otter_tunnel::TransportKind;
use serde_json::json;

fn project_crd() -> serde_json::Value {
    json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "projects.management.cattle.io"},
        "spec": {
            "group": "management.cattle.io",
            "scope": "Namespaced",
            "names": {"plural": "projects", "singular": "project", "kind": "Project", "listKind": "ProjectList"},
            "versions": [{
                "name": "v3", "served": true, "storage": true,
                "schema": {"openAPIV3Schema": {
                    "type": "object",
                    "properties": {
                        "spec": {"type": "object", "properties": {
                            "clusterName": {"type": "string"},
                            "displayName": {"type": "string"},
                            "description": {"type": "string"}
                        }},
                        "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}
                    }
                }}
            }]
        }
    })
}

fn project(cluster: &str, name: &str, display: &str) -> serde_json::Value {
    json!({
        "apiVersion": "management.cattle.io/v3",
        "kind": "Project",
        "metadata": {"name": name, "namespace": cluster},
        "spec": {"clusterName": cluster, "displayName": display},
    })
}

/// A management cluster with projects of two downstream clusters; a user
/// `nobody` may not read them.
async fn management_cluster() -> KubeSim {
    let sim = KubeSim::start(SimConfig::default_with_admin().user("nobody-token", "nobody", &[]))
        .await
        .expect("kube-sim starts");
    sim.create_object(project_crd()).expect("Project CRD");
    for cluster in ["c-m-4x7k2", "local"] {
        sim.create_object(
            json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": cluster}}),
        )
        .expect("namespace");
    }
    for (cluster, name, display) in [
        ("c-m-4x7k2", "p-9zq8w", "Payments"),
        ("local", "p-system", "System"),
        ("c-m-4x7k2", "p-2abcd", "Default"),
    ] {
        sim.create_object(project(cluster, name, display))
            .expect("project");
    }
    sim
}

async fn hub_for(sim: &KubeSim, token: &str) -> TestHub {
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let kubeconfig = dir.path().join("rancher.kubeconfig");
    std::fs::write(&kubeconfig, sim.kubeconfig_yaml(token)).unwrap();
    TestHub::start_with(dir, None, move |c| c.rancher_kubeconfig = Some(kubeconfig)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rancher_projects_are_listed_and_links_keep_their_project() {
    let sim = management_cluster().await;
    let hub = hub_for(&sim, ADMIN_TOKEN).await;
    let mut links = LinkServiceClient::new(hub.channel().await);

    let projects = links
        .list_rancher_projects(with_token(ListRancherProjectsRequest {}, &hub.admin_token))
        .await
        .expect("ListRancherProjects")
        .into_inner()
        .projects;
    let got: Vec<(String, String)> = projects
        .into_iter()
        .map(|p| (p.id.unwrap_or_default(), p.display_name.unwrap_or_default()))
        .collect();
    assert_eq!(
        got,
        [
            ("c-m-4x7k2:p-2abcd".to_owned(), "Default".to_owned()),
            ("c-m-4x7k2:p-9zq8w".to_owned(), "Payments".to_owned()),
            ("local:p-system".to_owned(), "System".to_owned()),
        ]
    );

    let anonymous = links
        .list_rancher_projects(ListRancherProjectsRequest {})
        .await
        .unwrap_err();
    assert_eq!(anonymous.code(), tonic::Code::Unauthenticated);

    // An agent filed under one of those projects keeps it on its link.
    let join = hub.hub.mint_join_token("edge-1").unwrap();
    let _agent = start_agent_with(&hub, "edge-1", "a1", &join, TransportKind::H2, |c| {
        c.rancher_project_id = "c-m-4x7k2:p-9zq8w".into();
    });
    wait_connected(&hub.channel().await, &hub.admin_token, 1).await;
    let listed = links
        .list_links(with_token(ListLinksRequest {}, &hub.admin_token))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        listed.links[0].rancher_project_id.as_deref(),
        Some("c-m-4x7k2:p-9zq8w")
    );
    hub.hub.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rancher_projects_without_a_management_cluster_or_its_permission() {
    let hub = TestHub::start().await;
    let mut links = LinkServiceClient::new(hub.channel().await);
    let err = links
        .list_rancher_projects(with_token(ListRancherProjectsRequest {}, &hub.admin_token))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition);
    assert!(
        err.message()
            .contains("no Rancher management cluster configured"),
        "{err:?}"
    );
    hub.hub.shutdown().await;

    // The management cluster refuses the hub's credentials.
    let sim = management_cluster().await;
    let hub = hub_for(&sim, "nobody-token").await;
    let mut links = LinkServiceClient::new(hub.channel().await);
    let err = links
        .list_rancher_projects(with_token(ListRancherProjectsRequest {}, &hub.admin_token))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::PermissionDenied, "{err:?}");
    hub.hub.shutdown().await;
}
