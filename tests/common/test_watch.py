"""The side channel's pieces that need no second rank (common/watch.py); the whole protocol
runs with real ranks in tests/parallel/test_failures.py and tests/slurm/test_real_hosts.py."""

from __future__ import annotations

import json
import os
import resource
import selectors
import socket
import threading
import time

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


def test_rank_0_takes_a_thousand_connects_at_once():
    """At ``init`` every rank connects to rank 0 at the same moment: the listener's backlog
    and rank 0's accept loop take the connects of a thousand ranks, all started together,
    each within the time a rank gives it (``DIAL_S``)."""
    n = 1000
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = 2 * n + 64  # both ends of every connection are in this process
    if soft != resource.RLIM_INFINITY and soft < needed:
        if hard != resource.RLIM_INFINITY and hard < needed:
            pytest.skip(f"needs {needed} open files, the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
    listener, token, _ = watch.listen(n + 1)
    port = listener.getsockname()[1]
    clients, failures = [], []

    def dial() -> None:
        selector = selectors.DefaultSelector()
        for rank in range(1, n + 1):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setblocking(False)
            sock.connect_ex(("127.0.0.1", port))
            clients.append(sock)
            selector.register(sock, selectors.EVENT_WRITE, rank)
        deadline = time.monotonic() + watch.DIAL_S
        while selector.get_map() and time.monotonic() < deadline:
            for key, _ in selector.select(deadline - time.monotonic()):
                selector.unregister(key.fileobj)
                error = key.fileobj.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if error:
                    failures.append(f"rank {key.data}: {os.strerror(error)}")
                    continue
                key.fileobj.setblocking(True)
                watch._send(key.fileobj, {"token": token, "rank": key.data})
        failures.extend(f"rank {key.data}: not connected within {watch.DIAL_S:g} s"
                        for key in selector.get_map().values())
        selector.close()

    thread = threading.Thread(target=dial)
    thread.start()
    peers = {}
    try:
        peers = watch.accept_ranks(listener, token, n + 1)
    finally:
        thread.join()
        for sock in [listener, *clients, *peers]:
            sock.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert not failures, failures[:5]
    assert sorted(peers.values()) == list(range(1, n + 1))
