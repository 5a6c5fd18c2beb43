"""Fixtures for the Python client suite; the Rust test python_client.rs starts kube-sim
and passes its kubeconfig and the forwarded port through the environment."""

import os

import pytest
from kubernetes import client, config


@pytest.fixture(scope="session")
def api_client():
    path = os.environ.get("KUBESIM_KUBECONFIG")
    if not path:
        pytest.skip("KUBESIM_KUBECONFIG not set: run through `cargo test -p kube-sim --test python_client`")
    cfg = client.Configuration()
    config.load_kube_config(config_file=path, client_configuration=cfg)
    return client.ApiClient(cfg)


@pytest.fixture(scope="session")
def core(api_client):
    return client.CoreV1Api(api_client)


@pytest.fixture(scope="session")
def forwarded_port():
    return int(os.environ["KUBESIM_FORWARDED_PORT"])
