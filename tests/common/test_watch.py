"""The side channel's pieces that need no second rank (common/watch.py); the whole protocol
runs with real ranks in tests/parallel/test_failures.py and tests/slurm/test_real_hosts.py."""

from __future__ import annotations

import json
import socket

import pytest

from hpc_horovod.common import watch


def test_hello_leaves_the_next_message_on_the_connection():
    """A rank may write its next message right behind its hello: rank 0 reads the hello alone
    and the watch thread still gets the rest."""
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(b'{"token": "t", "rank": 3}\n{"fail": "out of memory"}\n')
        assert json.loads(watch._hello(ours)) == {"token": "t", "rank": 3}
        assert ours.recv(4096) == b'{"fail": "out of memory"}\n'


def test_hello_stops_at_end_of_file_and_at_its_limit():
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(b"no newline")
        theirs.shutdown(socket.SHUT_WR)
        assert watch._hello(ours) == b"no newline"
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(b"x" * 100)
        assert watch._hello(ours, limit=10) == b"x" * 10


def test_host_addresses_put_loopback_last_and_check_the_interface():
    addresses = watch.host_addresses()
    assert addresses and all(a.count(".") == 3 for a in addresses)
    assert [a.startswith("127.") for a in addresses] == sorted(
        a.startswith("127.") for a in addresses)
    assert watch.host_addresses("lo") == ["127.0.0.1"]
    with pytest.raises(RuntimeError, match="HOROVOD_GLOO_IFACE=nosuch0"):
        watch.host_addresses("nosuch0")
