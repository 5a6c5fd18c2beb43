//! What a fresh cluster holds: system namespaces, a node, the `kubernetes` service,
//! default service accounts, the configured pods and, for demos, a small workload.

use serde_json::{Map, Value, json};

use crate::State;
use crate::api::create_direct;
use crate::error::ApiError;
use crate::objects;
use crate::store::ObjKey;

/// Creates what every cluster has, the configured pods, and the demo workload if asked.
pub(crate) fn seed(state: &State) -> Result<(), crate::Error> {
    let fail = |e: ApiError| crate::Error::Config(format!("seeding failed: {e}"));
    for ns in ["default", "kube-system", "kube-public", "kube-node-lease"] {
        create_direct(
            state,
            json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}),
        )
        .map_err(fail)?;
    }
    create_direct(state, json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": objects::NODE_NAME, "labels": {"kubernetes.io/hostname": objects::NODE_NAME, "kubernetes.io/os": "linux"}}})).map_err(fail)?;
    create_direct(state, json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "kubernetes", "namespace": "default", "labels": {"component": "apiserver", "provider": "kubernetes"}}, "spec": {"ports": [{"name": "https", "port": 443, "targetPort": 6443}]}})).map_err(fail)?;
    for ns in ["default", "kube-system", "kube-public", "kube-node-lease"] {
        create_direct(state, json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default", "namespace": ns}})).map_err(fail)?;
    }
    let mut pods = state.cfg.pods.clone();
    if state.cfg.demo_objects {
        pods.push(crate::PodSeed {
            namespace: "default".into(),
            name: "web-0".into(),
            containers: vec!["web".into()],
            labels: vec![("app".into(), "web".into())],
        });
        pods.push(crate::PodSeed {
            namespace: "default".into(),
            name: "tools".into(),
            containers: vec!["shell".into(), "sidecar".into()],
            labels: vec![],
        });
        pods.push(crate::PodSeed {
            namespace: "kube-system".into(),
            name: "coredns-sim".into(),
            containers: vec!["coredns".into()],
            labels: vec![("k8s-app".into(), "kube-dns".into())],
        });
    }
    for p in pods {
        if state
            .store
            .get(&ObjKey::new("", "namespaces", "", &p.namespace))
            .is_none()
        {
            create_direct(
                state,
                json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": p.namespace}}),
            )
            .map_err(fail)?;
        }
        let containers: Vec<Value> = p
            .containers
            .iter()
            .map(|c| json!({"name": c, "image": format!("sim/{c}:latest")}))
            .collect();
        let labels: Map<String, Value> = p
            .labels
            .iter()
            .map(|(k, v)| (k.clone(), json!(v)))
            .collect();
        create_direct(state, json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": p.name, "namespace": p.namespace, "labels": labels}, "spec": {"containers": containers}})).map_err(fail)?;
    }
    if state.cfg.demo_objects {
        create_direct(state, json!({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "web", "namespace": "default", "labels": {"app": "web"}},
            "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "web"}},
                     "template": {"metadata": {"labels": {"app": "web"}}, "spec": {"containers": [{"name": "web", "image": "sim/web:latest"}]}}}
        })).map_err(fail)?;
        create_direct(state, json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "web-config", "namespace": "default"}, "data": {"greeting": "hello"}})).map_err(fail)?;
    }
    Ok(())
}
