"""compat.ssh_socket: Nagle off (and the owed ACK asked for) on the socket of a host's pyinfra SSH
connection; hosts without a TCP socket of their own are left alone."""

from __future__ import annotations

import ast
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest

from compat.ssh_socket import send_at_once, ssh_socket

REPO = Path(__file__).resolve().parents[2]


def _host(sock):
    transport = SimpleNamespace(sock=sock)
    client = SimpleNamespace(get_transport=lambda: transport)
    return SimpleNamespace(connector=SimpleNamespace(client=client))


@pytest.fixture
def tcp_pair():
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    peer, _ = server.accept()
    yield client
    for s in (client, peer, server):
        s.close()


def test_nagle_is_turned_off_on_the_hosts_ssh_socket(tcp_pair):
    assert tcp_pair.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 0, "the kernel's default: Nagle on"
    assert send_at_once(_host(tcp_pair)) is True
    assert tcp_pair.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0


def test_hosts_without_a_tcp_socket_of_their_own_are_left_alone():
    a, b = socket.socketpair()  # a proxy command's pipe stands in for it: AF_UNIX
    try:
        assert ssh_socket(_host(a)) is None and send_at_once(_host(a)) is False
    finally:
        a.close()
        b.close()
    assert send_at_once(SimpleNamespace(connector=SimpleNamespace())) is False  # @local: no client
    assert send_at_once(_host(None)) is False  # not connected
    proxy = SimpleNamespace(setsockopt=lambda *a: None)  # paramiko's ProxyCommand: no TCP socket
    assert send_at_once(_host(proxy)) is False


def test_deploy_py_sets_it_before_the_lock_keeper_opens_its_channel():
    calls = [node.func for node in ast.walk(ast.parse((REPO / "deploy.py").read_text()))
             if isinstance(node, ast.Call)]
    names = [f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else "" for f in calls]
    assert "send_at_once" in names and names.index("send_at_once") < names.index("begin")
