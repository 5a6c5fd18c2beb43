"""Calls a running hub with Python's grpcio and stubs that grpcio-tools
generates from proto/ at run time: LinkService.ListLinks (unary) and
ResourceService.Watch (server streaming, left after three events), plus a
call that fails with a code and one without credentials. Prints one JSON
object on stdout; the end-to-end test `real_clients.rs` asserts on it.

Usage: grpcio_client.py PROTO_DIR OUT_DIR
Environment: OTTER_HUB_TARGET (host:port), OTTER_TOKEN, OTTER_CA_FILE,
OTTER_CLUSTER.
"""

import importlib
import json
import os
import sys

import grpc
from grpc_tools import protoc

TIMEOUT = 15  # seconds, every call


def generate(proto_dir, out_dir):
    # The resource package is generated under another top-level name: as
    # "resource" it would collide with Python's own module of that name.
    args = [
        "protoc",
        f"-Iotter_resource={os.path.join(proto_dir, 'resource')}",
        f"-I{proto_dir}",
        f"-I{os.path.join(os.path.dirname(protoc.__file__), '_proto')}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        "feature.proto",
        "link/v1/link.proto",
        "otter_resource/v1/resource.proto",
    ]
    if protoc.main(args) != 0:
        raise SystemExit("grpc_tools.protoc failed")
    sys.path.insert(0, out_dir)


def code_of(call):
    try:
        call()
        return "OK"
    except grpc.RpcError as e:
        return {"code": e.code().name, "message": e.details()}


def main():
    proto_dir, out_dir = sys.argv[1], sys.argv[2]
    generate(proto_dir, out_dir)
    link_pb2 = importlib.import_module("link.v1.link_pb2")
    link_grpc = importlib.import_module("link.v1.link_pb2_grpc")
    resource_pb2 = importlib.import_module("otter_resource.v1.resource_pb2")
    resource_grpc = importlib.import_module("otter_resource.v1.resource_pb2_grpc")

    with open(os.environ["OTTER_CA_FILE"], "rb") as f:
        creds = grpc.ssl_channel_credentials(root_certificates=f.read())
    auth = (("authorization", f"Bearer {os.environ['OTTER_TOKEN']}"),)
    cluster = os.environ["OTTER_CLUSTER"]
    out = {}
    with grpc.secure_channel(os.environ["OTTER_HUB_TARGET"], creds) as channel:
        links = link_grpc.LinkServiceStub(channel)
        resources = resource_grpc.ResourceServiceStub(channel)

        listed = links.ListLinks(link_pb2.ListLinksRequest(), metadata=auth, timeout=TIMEOUT)
        out["links"] = [
            {
                "cluster": l.cluster,
                "state": link_pb2.LinkState.Name(l.state),
                "agent_id": l.agent_id,
            }
            for l in listed.links
        ]

        stream = resources.Watch(
            resource_pb2.WatchRequest(cluster=cluster, version="v1", resource="pods"),
            metadata=auth,
            timeout=TIMEOUT,
        )
        events = []
        for ev in stream:
            events.append(
                {
                    "type": resource_pb2.WatchEvent.Type.Name(ev.type),
                    "resource_version": ev.resource_version,
                    "payload": ev.resource.object["payload"],
                }
            )
            if len(events) == 3:
                stream.cancel()
                break
        out["watch"] = events
        out["watch_after_cancel"] = stream.code().name

        out["unknown_cluster"] = code_of(
            lambda: resources.Get(
                resource_pb2.GetRequest(
                    cluster="no-such-cluster", version="v1", resource="pods", name="web"
                ),
                metadata=auth,
                timeout=TIMEOUT,
            )
        )
        out["no_token"] = code_of(
            lambda: links.ListLinks(link_pb2.ListLinksRequest(), timeout=TIMEOUT)
        )
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
