//! The Rancher management cluster: its projects, for
//! `LinkService.ListRancherProjects`.
//!
//! Rancher keeps each downstream cluster's projects
//! (`management.cattle.io/v3` `Project`) in the namespace named after the
//! cluster's id on the management cluster, so a project's id is
//! `<cluster-id>:<project-name>`, the form agents send as
//! `rancher_project_id` when they register.

use std::{path::Path, time::Duration};

use kube::{
    Api, Client,
    api::{ApiResource, DynamicObject, GroupVersionKind, ListParams},
    config::{KubeConfigOptions, Kubeconfig},
};
use otter_proto::link::v1::RancherProject;
use tonic::Status;

use crate::{HubError, Result};

/// Bound of one listing (all pages).
const LIST_TIMEOUT: Duration = Duration::from_secs(20);
/// Projects per page.
const PAGE: u32 = 500;

/// A client of the management cluster.
#[derive(Clone)]
pub struct Rancher {
    client: Client,
}

impl std::fmt::Debug for Rancher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Rancher")
    }
}

fn project_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("management.cattle.io", "v3", "Project"),
        "projects",
    )
}

impl Rancher {
    /// A client from a kubeconfig file (its current context).
    pub async fn from_kubeconfig(path: &Path) -> Result<Rancher> {
        let config_error =
            |e: &dyn std::fmt::Display| HubError::Config(format!("{}: {e}", path.display()));
        let kubeconfig = Kubeconfig::read_from(path).map_err(|e| config_error(&e))?;
        let config =
            kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
                .await
                .map_err(|e| config_error(&e))?;
        let client = Client::try_from(config).map_err(|e| config_error(&e))?;
        Ok(Rancher { client })
    }

    /// Every project of every cluster, sorted by id.
    pub async fn list_projects(&self) -> std::result::Result<Vec<RancherProject>, Status> {
        let api: Api<DynamicObject> = Api::all_with(self.client.clone(), &project_resource());
        let listing = async {
            let mut projects = Vec::new();
            let mut params = ListParams::default().limit(PAGE);
            loop {
                let page = api.list(&params).await.map_err(status_of)?;
                projects.extend(page.items.iter().filter_map(project));
                match page.metadata.continue_.filter(|c| !c.is_empty()) {
                    Some(next) => params = params.continue_token(&next),
                    None => break,
                }
            }
            Ok::<_, Status>(projects)
        };
        let mut projects = tokio::time::timeout(LIST_TIMEOUT, listing)
            .await
            .map_err(|_| {
                Status::unavailable("the Rancher management cluster did not answer in time")
            })??;
        projects.sort_by(|a, b| a.id.cmp(&b.id));
        Ok(projects)
    }
}

/// A project as the API shows it; `None` when it names no cluster.
fn project(obj: &DynamicObject) -> Option<RancherProject> {
    let name = obj.metadata.name.as_deref()?;
    let spec = &obj.data["spec"];
    let cluster = obj
        .metadata
        .namespace
        .as_deref()
        .filter(|n| !n.is_empty())
        .or_else(|| spec["clusterName"].as_str().filter(|c| !c.is_empty()))?;
    let display_name = spec["displayName"]
        .as_str()
        .filter(|d| !d.is_empty())
        .unwrap_or(name);
    Some(RancherProject {
        id: Some(format!("{cluster}:{name}")),
        display_name: Some(display_name.to_owned()),
    })
}

fn status_of(e: kube::Error) -> Status {
    match &e {
        kube::Error::Api(s) if s.code == 401 || s.code == 403 => Status::permission_denied(
            format!("the Rancher management cluster refused to list projects: {e}"),
        ),
        kube::Error::Api(s) if s.code == 404 => Status::failed_precondition(format!(
            "the configured cluster serves no management.cattle.io/v3 projects (is it Rancher's management cluster?): {e}"
        )),
        _ => Status::unavailable(format!("Rancher management cluster: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(v: serde_json::Value) -> DynamicObject {
        serde_json::from_value(v).expect("object")
    }

    #[test]
    fn project_id_from_namespace_or_cluster_name() {
        let p = project(&obj(serde_json::json!({
            "apiVersion": "management.cattle.io/v3", "kind": "Project",
            "metadata": {"name": "p-x1", "namespace": "c-m-1"},
            "spec": {"displayName": "Default", "clusterName": "ignored"},
        })))
        .expect("project");
        assert_eq!(p.id.as_deref(), Some("c-m-1:p-x1"));
        assert_eq!(p.display_name.as_deref(), Some("Default"));

        let p = project(&obj(serde_json::json!({
            "apiVersion": "management.cattle.io/v3", "kind": "Project",
            "metadata": {"name": "p-x2"},
            "spec": {"clusterName": "local"},
        })))
        .expect("project");
        assert_eq!(p.id.as_deref(), Some("local:p-x2"));
        assert_eq!(p.display_name.as_deref(), Some("p-x2"));

        assert!(
            project(&obj(serde_json::json!({
                "apiVersion": "management.cattle.io/v3", "kind": "Project",
                "metadata": {"name": "p-x3"}, "spec": {},
            })))
            .is_none()
        );
    }
}
