"""A TCP port for a server that another process binds later (torch.distributed's rendezvous store,
a test's child server).

Asking the kernel for port 0 and closing the socket races: until the real server binds, the port
is back in the ephemeral range (``ip_local_port_range``, 32768-60999 by default), where every
outgoing connection on the host — Ray's, gloo's, a kubelet's — draws its source port. CI lost a
run to exactly that (EADDRINUSE in the gloo store). A port drawn at random below that range is
never handed out by the kernel, so only another caller of this function could take it.
"""

from __future__ import annotations

import random
import socket

# Above Ray's worker ports (10002-19999 by default) and the well-known ports we serve (8080, 8265,
# 9400); below Kubernetes' NodePort range (30000-32767) and the kernel's default ephemeral range.
PORT_RANGE = range(20000, 30000)


def unclaimed_port(host: str = "127.0.0.1", attempts: int = 200) -> int:
    """A port in ``PORT_RANGE`` that ``host`` can bind now."""
    for port in random.sample(PORT_RANGE, attempts):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise OSError(f"no free TCP port on {host!r} in {PORT_RANGE.start}-{PORT_RANGE.stop - 1} after {attempts} tries")
