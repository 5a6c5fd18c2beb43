"""The Python Kubernetes client through the hub's Kubernetes API proxy: the
kubeconfig `otter kubeconfig` wrote points at `<hub>/clusters/<cluster>`.
Exec (stdin, stdout, stderr, exit code) and port-forward travel as
WebSocket upgrades the hub relays byte for byte.

argv: kubeconfig, pod, container, forwarded port.
Prints one JSON line with what the client saw.
"""

import json
import sys
import time

from kubernetes import client, config
from kubernetes.stream import portforward, stream

kubeconfig, pod, container, port = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
api = config.new_client_from_config(config_file=kubeconfig)
core = client.CoreV1Api(api)
seen = {}

# Exec with stdin: `cat` echoes what we type until stdin closes.
resp = stream(core.connect_get_namespaced_pod_exec, pod, "default", container=container,
              command=["sh", "-c", "cat; echo done >&2; exit 4"],
              stderr=True, stdin=True, stdout=True, tty=False, _preload_content=False)
resp.write_stdin("typed through the hub\n")
out = ""
deadline = time.time() + 20
while "typed" not in out and time.time() < deadline:
    resp.update(timeout=1)
    if resp.peek_stdout():
        out += resp.read_stdout()
seen["exec_stdout"] = out
resp.close()

# A command's exit code and stderr, in one go.
resp = stream(core.connect_get_namespaced_pod_exec, pod, "default", container=container,
              command=["sh", "-c", "echo out; echo err >&2; exit 3"],
              stderr=True, stdin=False, stdout=True, tty=False, _preload_content=False)
resp.run_forever(timeout=20)
seen["exit_stdout"] = resp.read_stdout()
seen["exit_stderr"] = resp.read_stderr()
seen["exit_code"] = resp.returncode
resp.close()

# Port-forward to the pod's port, several round trips on one connection.
pf = portforward(core.connect_get_namespaced_pod_portforward, pod, "default", ports=str(port))
sock = pf.socket(port)
sock.settimeout(20)
replies = []
for word in (b"one", b"two", b"three"):
    sock.sendall(word)
    want = b"echo: " + word
    got = b""
    while len(got) < len(want):
        chunk = sock.recv(1024)
        if not chunk:
            break
        got += chunk
    replies.append(got.decode())
sock.close()
seen["forwarded"] = replies
seen["forward_error"] = pf.error(port)
print(json.dumps(seen))
