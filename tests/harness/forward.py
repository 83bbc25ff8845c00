"""`python -m tests.harness.forward NETNS PORT...`: host 127.0.0.1:PORT -> NETNS's 127.0.0.1:PORT.

With real nodes the whole control plane runs inside the harness's network namespace (the nodes
must reach the API server and the API server its kubelets, on node addresses that exist only
there). This process lets the host's tests, kubectl and helm reach the components on the same
loopback ports as without real nodes: it listens on the host's loopback first, then moves itself
into the namespace (setns), so that every connection it opens afterwards is made in there.
Sockets keep the namespace they were made in.
"""

from __future__ import annotations

import ctypes
import os
import selectors
import socket
import sys
import threading

CLONE_NEWNET = 0x40000000


def setns(path: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


def _pipe(client: socket.socket, port: int) -> None:
    try:
        upstream = socket.create_connection(("127.0.0.1", port), timeout=10)
    except OSError:
        client.close()  # not up yet: the caller sees a closed connection and retries
        return
    upstream.settimeout(None)
    pairs = {client: upstream, upstream: client}
    selector = selectors.DefaultSelector()
    for sock in pairs:
        selector.register(sock, selectors.EVENT_READ)
    try:
        while True:
            for key, _ in selector.select():
                data = key.fileobj.recv(65536)
                if not data:
                    return
                pairs[key.fileobj].sendall(data)
    except OSError:
        return
    finally:
        for sock in pairs:
            sock.close()


def _serve(listener: socket.socket, port: int) -> None:
    while True:
        client, _ = listener.accept()
        threading.Thread(target=_pipe, args=(client, port), daemon=True).start()


def main(argv: list[str]) -> int:
    netns, ports = argv[0], [int(p) for p in argv[1:]]
    listeners = []
    for port in ports:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen(128)
        listeners.append(listener)
    # From here on, new sockets (and the threads that make them) live in the namespace.
    setns(netns)
    for listener, port in zip(listeners, ports):
        threading.Thread(target=_serve, args=(listener, port), daemon=True).start()
    print(f"forwarding 127.0.0.1:{ports} into {netns}", flush=True)
    threading.Event().wait()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
