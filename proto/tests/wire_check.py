"""Independent half of the wire check: decodes what Rust encoded with code that
grpcio-tools generated from the same .proto files, and encodes it back.

Input (argv[1], JSON): {"cases": [{"name", "type", "hex", "json"}], "out_dir"}.
For each case it
  1. parses the Rust bytes with the Python class and renders the proto3 JSON
     mapping (field names as in the .proto),
  2. re-encodes the parsed message (round trip), and
  3. builds the message afresh from the expected JSON (independent encoder).
Output (stdout, JSON): {name: {"json": ..., "roundtrip_hex": ..., "from_json_hex": ...}}.
"""

import functools
import importlib.util
import json
import os
import sys
import types

from google.protobuf import json_format

# Generated files by path: "resource" would collide with Python's own module
# of that name if imported as a package.
FILES = {
    "otterscale.link.v1": "link/v1/link_pb2.py",
    "otterscale.resource.v1": "resource/v1/resource_pb2.py",
    "otterscale.runtime.v1": "runtime/v1/runtime_pb2.py",
    "otterlink.fleet.v1": "otterlink/fleet/v1/fleet_pb2.py",
}


@functools.lru_cache(maxsize=None)
def load(out_dir, package):
    if package == "google.protobuf":
        return importlib.import_module("google.protobuf.empty_pb2")
    if package.startswith("otterlink."):
        # Our own packages import upstream's files by path
        # ("from resource.v1 import resource_pb2"); the path-loaded modules
        # stand in for those packages, as Python's own `resource` is taken.
        for upstream, path in FILES.items():
            if upstream.startswith("otterscale."):
                parent = os.path.dirname(path).replace("/", ".")
                stem = os.path.basename(path)[: -len(".py")]
                holder = sys.modules.setdefault(parent, types.ModuleType(parent))
                setattr(holder, stem, load(out_dir, upstream))
    name = "otter_" + package.replace(".", "_")
    spec = importlib.util.spec_from_file_location(name, os.path.join(out_dir, FILES[package]))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def message_class(out_dir, full_name):
    package, _, name = full_name.rpartition(".")
    module = load(out_dir, package)
    cls = module
    for part in name.split("."):
        cls = getattr(cls, part)
    return cls


def main():
    spec = json.load(open(sys.argv[1]))
    sys.path.insert(0, spec["out_dir"])
    result = {}
    for case in spec["cases"]:
        cls = message_class(spec["out_dir"], case["type"])
        msg = cls()
        msg.ParseFromString(bytes.fromhex(case["hex"]))
        fresh = json_format.ParseDict(case["json"], cls())
        result[case["name"]] = {
            "json": json_format.MessageToDict(msg, preserving_proto_field_name=True),
            "roundtrip_hex": msg.SerializeToString(deterministic=True).hex(),
            "from_json_hex": fresh.SerializeToString(deterministic=True).hex(),
        }
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
