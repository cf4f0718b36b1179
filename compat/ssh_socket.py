"""Send a run's SSH requests to the host at once, instead of behind TCP's Nagle algorithm.

pyinfra (3.10, connectors/ssh.py) connects through paramiko (4.0, client.py), which leaves
the TCP socket as the kernel opens it: Nagle on. Every remote command pyinfra runs opens an SSH
channel and asks for an exec on it, small packets each, and a small packet that follows
another not yet acknowledged waits for that acknowledgement; the host's kernel delays its bare
acknowledgements (Linux: 40 ms, net/ipv4/tcp_output.c tcp_send_delayed_ack). Measured against
the kpro6 twin's sshd with paramiko: the second and every later channel of a connection opened in
40-47 ms with Nagle on, 0.3-0.6 ms with it off (and the same on a real network, where the delay
comes on top of the round trip). A no-change converge opens two (the run lock's keeper and the
probe), a converge with changes one per command.

`send_at_once(host)` turns Nagle off (TCP_NODELAY) on the host's SSH socket and, where the
kernel has it, asks for the acknowledgement it owes now (TCP_QUICKACK: Linux sends a pending
delayed ACK when it is set). deploy.py calls it first, per host. Hosts reached through a proxy
command or jump host (no TCP socket of ours), or a local connector, are left as they are.
"""

from __future__ import annotations

import socket
from typing import Any


def ssh_socket(host: Any) -> Any | None:
    """The TCP socket of `host`'s pyinfra SSH connection, or None (not SSH, not connected, or no
    TCP socket of its own)."""
    client = getattr(host.connector, "client", None)
    transport = client.get_transport() if client is not None else None
    sock = getattr(transport, "sock", None)
    if sock is None or not hasattr(sock, "setsockopt") or getattr(sock, "type", None) != socket.SOCK_STREAM:
        return None
    if getattr(sock, "family", None) not in (socket.AF_INET, socket.AF_INET6):
        return None
    return sock


def send_at_once(host: Any) -> bool:
    """TCP_NODELAY (and TCP_QUICKACK where there is one) on `host`'s SSH socket; True if set."""
    sock = ssh_socket(host)
    if sock is None:
        return False
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        quickack = getattr(socket, "TCP_QUICKACK", None)
        if quickack is not None:
            sock.setsockopt(socket.IPPROTO_TCP, quickack, 1)
    except OSError:
        return False
    return True
