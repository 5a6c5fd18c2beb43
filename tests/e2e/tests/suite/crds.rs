//! The OtterScale CRDs on a Kubernetes API (the test server), with real
//! kubectl: every CRD is accepted, a sample of each kind is created, read
//! back and validated against its schema, and objects breaking the schema
//! (a wrong enum, a missing required field, a pattern violation) are refused.

use std::{path::Path, time::Duration};

use otter_e2e::{kubectl_133, run_bounded, tool_missing};
use serde_json::Value;

fn root() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
}

struct Kubectl {
    bin: std::path::PathBuf,
    kubeconfig: std::path::PathBuf,
}

impl Kubectl {
    /// Runs kubectl with `stdin` (if any); (exit code, stdout + stderr).
    fn run(&self, args: &[&str], stdin: Option<&str>) -> (i32, String) {
        let mut cmd = std::process::Command::new(&self.bin);
        cmd.arg("--kubeconfig").arg(&self.kubeconfig).args(args);
        let (code, out, err) = match stdin {
            None => run_bounded(&mut cmd, Duration::from_secs(60)),
            Some(text) => {
                let dir = tempfile::tempdir().unwrap();
                let file = dir.path().join("object.json");
                std::fs::write(&file, text).unwrap();
                let args: Vec<String> = args
                    .iter()
                    .map(|a| {
                        if *a == "-" {
                            file.display().to_string()
                        } else {
                            a.to_string()
                        }
                    })
                    .collect();
                let mut cmd = std::process::Command::new(&self.bin);
                cmd.arg("--kubeconfig").arg(&self.kubeconfig).args(&args);
                run_bounded(&mut cmd, Duration::from_secs(60))
            }
        };
        (code, format!("{out}{err}"))
    }
}

/// The kinds of the CRDs: (plural.group, kind, namespaced).
fn crds() -> Vec<(String, String, bool, Value)> {
    let text = std::fs::read_to_string(root().join("manifests/crds.yaml")).unwrap();
    text.split("\n---")
        .filter(|d| !d.trim().trim_start_matches("---").trim().is_empty())
        .map(|d| {
            let v: Value = serde_saphyr::from_str(d.trim_start_matches("---")).unwrap();
            let name = v["metadata"]["name"].as_str().unwrap().to_owned();
            let kind = v["spec"]["names"]["kind"].as_str().unwrap().to_owned();
            let namespaced = v["spec"]["scope"] == "Namespaced";
            let schema = v["spec"]["versions"][0]["schema"]["openAPIV3Schema"].clone();
            (name, kind, namespaced, schema)
        })
        .collect()
}

/// Kinds of schema violation this test makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Break {
    Enum,
    Required,
    Pattern,
}

/// Walks `schema` and `obj` together and breaks the first field of each
/// kind it can: returns mutated copies.
fn breakages(schema: &Value, obj: &Value) -> Vec<(Break, String, Value)> {
    let mut out = Vec::new();
    fn walk(
        schema: &Value,
        obj: &Value,
        path: &mut Vec<String>,
        root: &Value,
        out: &mut Vec<(Break, String, Value)>,
    ) {
        let Some(props) = schema["properties"].as_object() else {
            return;
        };
        let Some(fields) = obj.as_object() else {
            return;
        };
        for req in schema["required"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
        {
            if fields.contains_key(req)
                && !path.is_empty()
                && !out.iter().any(|(b, _, _)| *b == Break::Required)
            {
                let mut copy = root.clone();
                let mut at = &mut copy;
                for p in path.iter() {
                    at = &mut at[p.as_str()];
                }
                at.as_object_mut().unwrap().remove(req);
                out.push((Break::Required, format!("{}.{req}", path.join(".")), copy));
            }
        }
        for (name, sub) in props {
            let Some(value) = fields.get(name) else {
                continue;
            };
            path.push(name.clone());
            let set = |v: Value| {
                let mut copy = root.clone();
                let mut at = &mut copy;
                for p in path.iter() {
                    at = &mut at[p.as_str()];
                }
                *at = v;
                copy
            };
            if sub["enum"].is_array()
                && value.is_string()
                && !out.iter().any(|(b, _, _)| *b == Break::Enum)
            {
                out.push((
                    Break::Enum,
                    path.join("."),
                    set(Value::from("NotAnAllowedValue")),
                ));
            }
            if sub["pattern"].is_string()
                && value.is_string()
                && !out.iter().any(|(b, _, _)| *b == Break::Pattern)
            {
                out.push((
                    Break::Pattern,
                    path.join("."),
                    set(Value::from("!! not matching ~~")),
                ));
            }
            if value.is_object() {
                walk(sub, value, path, root, out);
            }
            path.pop();
        }
    }
    walk(schema, obj, &mut Vec::new(), obj, &mut out);
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crds_and_samples_on_the_test_server_with_kubectl() {
    let Some(bin) = kubectl_133() else {
        tool_missing("kubectl 1.33");
        return;
    };
    let sim = kube_sim::KubeSim::start(kube_sim::SimConfig::default_with_admin())
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(&kubeconfig, sim.kubeconfig_yaml(kube_sim::ADMIN_TOKEN)).unwrap();
    let k = Kubectl { bin, kubeconfig };
    let crds_file = root().join("manifests/crds.yaml").display().to_string();

    let result = tokio::task::spawn_blocking(move || {
        // Every CRD is accepted (server-side: the schemas are too large for
        // the last-applied annotation).
        let (code, out) = k.run(&["apply", "--server-side", "-f", &crds_file], None);
        assert_eq!(code, 0, "{out}");
        let crds = crds();
        assert_eq!(crds.len(), 8);
        for (name, ..) in &crds {
            assert!(
                out.contains(&format!(
                    "customresourcedefinition.apiextensions.k8s.io/{name} serverside-applied"
                )),
                "{out}"
            );
        }

        // A sample of each kind: created, read back, listed.
        let mut broken_kinds = std::collections::HashSet::new();
        for entry in std::fs::read_dir(root().join("manifests/samples")).unwrap() {
            let path = entry.unwrap().path();
            let sample: Value =
                serde_saphyr::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
            let kind = sample["kind"].as_str().unwrap();
            let (plural, _, namespaced, schema) = crds
                .iter()
                .find(|(_, k, ..)| k == kind)
                .expect("a CRD for every sample")
                .clone();
            let name = sample["metadata"]["name"].as_str().unwrap();
            let ns = sample["metadata"]["namespace"]
                .as_str()
                .unwrap_or("default")
                .to_owned();
            if namespaced {
                let _ = k.run(&["create", "namespace", &ns], None);
            }
            let ns_args: Vec<&str> = if namespaced {
                vec!["-n", ns.as_str()]
            } else {
                vec![]
            };
            let mut args = vec!["apply", "--server-side", "-f", "-"];
            args.extend(&ns_args);
            let (code, out) = k.run(&args, Some(&sample.to_string()));
            assert_eq!(code, 0, "{kind} sample refused: {out}");
            let mut get = vec!["get", plural.as_str(), name, "-o", "json"];
            get.extend(&ns_args);
            let (code, out) = k.run(&get, None);
            assert_eq!(code, 0, "{out}");
            let back: Value = serde_json::from_str(&out).unwrap();
            assert_eq!(back["kind"], kind);
            assert!(
                back["spec"].as_object().is_some_and(|o| !o.is_empty()),
                "{kind} spec read back: {out}"
            );
            for (key, value) in sample["spec"].as_object().unwrap() {
                assert!(
                    back["spec"].get(key).is_some(),
                    "{kind}: spec.{key} lost (sent {value})"
                );
            }

            // Broken copies are refused with 422 naming the field.
            for (what, field, broken) in breakages(&schema, &sample) {
                let mut broken = broken;
                broken["metadata"]["name"] = Value::from(format!("{name}-broken"));
                let mut args = vec!["apply", "--server-side", "-f", "-"];
                args.extend(&ns_args);
                let (code, out) = k.run(&args, Some(&broken.to_string()));
                assert_ne!(
                    code, 0,
                    "{kind} with a {what:?} violation at {field} was accepted"
                );
                assert!(
                    out.contains("Invalid")
                        || out.contains("invalid")
                        || out.contains("Required")
                        || out.contains("Unsupported"),
                    "{out}"
                );
                broken_kinds.insert(what);
            }
        }
        for what in [Break::Enum, Break::Required, Break::Pattern] {
            assert!(
                broken_kinds.contains(&what),
                "no sample exercised a {what:?} violation"
            );
        }

        // What the issue names: get clusters, explain workspace.spec.
        let (code, out) = k.run(&["get", "clusters.fleet.otterscale.io"], None);
        assert_eq!(code, 0, "{out}");
        assert!(out.contains("NAME"), "{out}");
        let (code, out) = k.run(&["explain", "workspace.spec"], None);
        assert_eq!(code, 0, "{out}");
        assert!(
            out.contains("KIND:") && out.contains("Workspace") && out.contains("FIELDS"),
            "{out}"
        );
    })
    .await;
    sim.shutdown().await;
    result.unwrap();
}
