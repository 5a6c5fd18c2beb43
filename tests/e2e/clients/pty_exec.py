"""Drives an interactive exec (`otter exec -it …`, `kubectl exec -it …`)
through a real pseudo-terminal, as a person at a terminal would: waits for
the shell's prompt, asks `tty` what it runs on, types a command, resizes the
window, exits with a code.

argv: the whole command to run in the terminal (it must start a shell in
the pod). Prints one JSON line:
{"output": ..., "code": ..., "prompt": bool, "tty": ...}.
"""

import json
import os
import pty
import select
import struct
import sys
import termios
import fcntl
import time

command = sys.argv[1:]


def read_until(fd, needle, limit=20.0):
    needles = needle if isinstance(needle, tuple) else (needle,)
    buf = b""
    end = time.time() + limit
    while not any(n in buf for n in needles) and time.time() < end:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(fd, 4096)
            except OSError:
                break
            if not chunk:
                break
            buf += chunk
    return buf


pid, fd = pty.fork()
if pid == 0:
    os.execv(command[0], command)

# Start at 24x80, as a terminal would.
fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
# An interactive shell on a terminal shows its prompt.
out = read_until(fd, (b"$ ", b"# "), limit=15.0)
prompt = out.rstrip().endswith((b"$", b"#"))
os.write(fd, b"tty\n")
seen = read_until(fd, b"/dev/")
seen += read_until(fd, b"\n", limit=2.0)
tty = seen.decode(errors="replace").split("tty", 1)[-1].strip().splitlines()
tty = tty[0].strip() if tty else ""
out += seen
os.write(fd, b"echo hi-from-the-pty\n")
out += read_until(fd, b"hi-from-the-pty")
# A window change: the kernel signals SIGWINCH, the client sends a resize.
fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 132, 0, 0))
time.sleep(1.0)
os.write(fd, b"exit 3\n")
out += read_until(fd, b"\x00", limit=5.0)
_, status = os.waitpid(pid, 0)
code = os.waitstatus_to_exitcode(status)
print(
    json.dumps(
        {
            "output": out.decode(errors="replace"),
            "code": code,
            "prompt": prompt,
            "tty": tty,
        }
    )
)
