"""The official Python `kubernetes` client against kube-sim."""

import time

import pytest
from kubernetes import client, watch
from kubernetes.client.rest import ApiException
from kubernetes.dynamic import DynamicClient
from kubernetes.stream import portforward, stream


def test_dynamic_discovery_and_list(api_client):
    dyn = DynamicClient(api_client)
    deployments = dyn.resources.get(api_version="apps/v1", kind="Deployment")
    assert deployments.namespaced and deployments.name == "deployments"
    pods = dyn.resources.get(api_version="v1", kind="Pod")
    names = sorted(p.metadata.name for p in pods.get(namespace="default").items)
    assert "p1" in names and "two" in names
    p1 = pods.get(name="p1", namespace="default")
    assert p1.status.phase == "Running"


def test_server_side_apply_conflict_and_force(api_client):
    dyn = DynamicClient(api_client)
    cms = dyn.resources.get(api_version="v1", kind="ConfigMap")
    body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "py-ssa"}, "data": {"k": "one"}}
    applied = cms.server_side_apply(body=body, namespace="default", field_manager="py-a")
    assert applied.data.k == "one"
    assert applied.metadata.managedFields[0].manager == "py-a"
    body["data"]["k"] = "two"
    with pytest.raises(ApiException) as err:
        cms.server_side_apply(body=body, namespace="default", field_manager="py-b")
    assert err.value.status == 409
    assert "conflict with \\\"py-a\\\"" in err.value.body or 'conflict with "py-a"' in err.value.body
    forced = cms.server_side_apply(body=body, namespace="default", field_manager="py-b", force_conflicts=True)
    assert forced.data.k == "two"


def test_watch_with_bookmarks(core):
    rv = core.list_namespaced_config_map("default").metadata.resource_version
    core.create_namespaced_config_map("default", client.V1ConfigMap(metadata=client.V1ObjectMeta(name="py-w")))
    w = watch.Watch()
    seen = []
    deadline = time.time() + 10
    for ev in w.stream(core.list_namespaced_config_map, "default", resource_version=rv,
                       allow_watch_bookmarks=True, timeout_seconds=5):
        seen.append((ev["type"], ev["object"].metadata.name if ev["type"] != "BOOKMARK" else None))
        if ("ADDED", "py-w") in seen and any(t == "BOOKMARK" for t, _ in seen):
            w.stop()
        if time.time() > deadline:
            w.stop()
    assert ("ADDED", "py-w") in seen, seen
    assert any(t == "BOOKMARK" for t, _ in seen), seen
    # The bookmark moved the watch's resourceVersion forward.
    assert int(w.resource_version) > int(rv)


def test_watch_too_old_is_410(core):
    # The fixture keeps a short event history, so resourceVersion 1 is long gone.
    w = watch.Watch()
    with pytest.raises(ApiException) as err:
        for _ in w.stream(core.list_namespaced_config_map, "default", resource_version="1", timeout_seconds=5):
            pass
    assert err.value.status == 410


def test_logs(core):
    logs = core.read_namespaced_pod_log("p1", "default", tail_lines=1)
    assert logs == "from rust\n"
    with pytest.raises(ApiException) as err:
        core.read_namespaced_pod_log("two", "default")
    assert err.value.status == 400


def test_exec_exit_code_and_output(core):
    resp = stream(core.connect_get_namespaced_pod_exec, "p1", "default",
                  command=["sh", "-c", "echo out; echo err >&2; exit 3"],
                  stderr=True, stdin=False, stdout=True, tty=False, _preload_content=False)
    resp.run_forever(timeout=10)
    assert resp.read_stdout() == "out\n"
    assert resp.read_stderr() == "err\n"
    assert resp.returncode == 3
    resp.close()


def test_exec_stdin(core):
    resp = stream(core.connect_get_namespaced_pod_exec, "p1", "default", command=["cat"],
                  stderr=True, stdin=True, stdout=True, tty=False, _preload_content=False)
    resp.write_stdin("typed\n")
    out = ""
    deadline = time.time() + 10
    while "typed" not in out and time.time() < deadline:
        resp.update(timeout=1)
        if resp.peek_stdout():
            out += resp.read_stdout()
    resp.close()
    assert out == "typed\n"


def test_exec_preloaded(core):
    out = stream(core.connect_get_namespaced_pod_exec, "two", "default", container="b",
                 command=["sh", "-c", "echo $KUBE_SIM_POD/$KUBE_SIM_CONTAINER"],
                 stderr=True, stdin=False, stdout=True, tty=False)
    assert out == "two/b\n"


def test_port_forward(core, forwarded_port):
    pf = portforward(core.connect_get_namespaced_pod_portforward, "p1", "default", ports=str(forwarded_port))
    sock = pf.socket(forwarded_port)
    sock.settimeout(10)
    sock.sendall(b"ping")
    got = b""
    while len(got) < len(b"echo: ping"):
        chunk = sock.recv(1024)
        if not chunk:
            break
        got += chunk
    sock.close()
    assert got == b"echo: ping"
    assert pf.error(forwarded_port) is None


def test_scale_with_strategic_patch_and_delete_grace_query(api_client, core):
    apps = client.AppsV1Api(api_client)
    dep = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "py-d"},
           "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "py"}},
                    "template": {"metadata": {"labels": {"app": "py"}},
                                 "spec": {"containers": [{"name": "c", "image": "c:1"}]}}}}
    apps.create_namespaced_deployment("default", dep)
    scale = apps.patch_namespaced_deployment_scale("py-d", "default", {"spec": {"replicas": 3}})
    assert scale.spec.replicas == 3
    assert apps.read_namespaced_deployment("py-d", "default").status.ready_replicas == 3
    core.create_namespaced_pod("default", {"metadata": {"name": "py-p"},
                                           "spec": {"containers": [{"name": "c", "image": "c"}]}})
    core.delete_namespaced_pod("py-p", "default", grace_period_seconds=0)
    with pytest.raises(ApiException) as err:
        core.read_namespaced_pod("py-p", "default")
    assert err.value.status == 404
