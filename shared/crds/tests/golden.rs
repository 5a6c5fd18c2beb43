//! The checked-in `manifests/crds.yaml` is exactly what the Rust types generate.

mod common;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;

#[test]
fn checked_in_crds_yaml_matches_the_types() {
    let path = common::repo_root().join("manifests/crds.yaml");
    let checked_in = std::fs::read_to_string(&path).unwrap_or_default();
    let generated = otter_crds::crds_yaml();
    if checked_in != generated {
        let line = checked_in
            .lines()
            .zip(generated.lines())
            .position(|(a, b)| a != b)
            .unwrap_or_else(|| checked_in.lines().count().min(generated.lines().count()))
            + 1;
        panic!(
            "manifests/crds.yaml is out of date (first difference at line {line}); \
             run `make manifests` and commit the result"
        );
    }
}

#[test]
fn crds_yaml_reads_back_as_the_same_crds() {
    let docs: Vec<CustomResourceDefinition> =
        serde_saphyr::from_multiple(&otter_crds::crds_yaml()).expect("parse crds.yaml");
    let expected = otter_crds::all_crds();
    assert_eq!(docs.len(), 8);
    assert_eq!(docs, expected);
}

#[test]
fn crds_are_sorted_and_cover_every_kind() {
    let names: Vec<String> = otter_crds::all_crds()
        .into_iter()
        .map(|crd| crd.metadata.name.unwrap_or_default())
        .collect();
    assert_eq!(
        names,
        [
            "applications.workload.otterscale.io",
            "clusters.fleet.otterscale.io",
            "machines.fleet.otterscale.io",
            "modelartifacts.model.otterscale.io",
            "modelservices.model.otterscale.io",
            "modules.module.otterscale.io",
            "moduletemplates.module.otterscale.io",
            "workspaces.tenant.otterscale.io",
        ]
    );
    assert_eq!(
        otter_crds::crds_yaml(),
        otter_crds::crds_yaml(),
        "output is deterministic"
    );
}
