"""Adasum of device tensors over several nodes is Horovod's GPU Adasum: the node's ranks average
with NCCL, and Adasum combines the nodes' averages only. Stand-ins for the device arrays and
the backends (no GPU here); tests/gpu/device_paths_worker.py runs it on GPUs."""

from __future__ import annotations

import types

import numpy as np

from hpc_horovod.common import collectives
from hpc_horovod.common.request import Request
from hpc_horovod.common.types import Adasum, Signature, Sum


class DeviceArray(np.ndarray):
    """Stands in for a cupy array: host memory with cupy's ``get``."""

    def get(self):
        return np.asarray(self)


XP = types.SimpleNamespace(zeros=lambda n, dtype: np.zeros(n, dtype).view(DeviceArray),
                           asarray=lambda a: np.asarray(a).view(DeviceArray))


class Node:
    """The node's NCCL backend: two ranks, the other one holding ``peer``."""

    size = 2

    def __init__(self, peer):
        self.peer = peer

    def allreduce(self, buf, op):
        assert op == Sum
        buf += self.peer


class Cross:
    """The cross-node MPI backend: two nodes, the other one's average ``other``."""

    size = 2

    def __init__(self, other):
        self.other = other

    def allgatherv(self, send, recv, counts):
        recv[:counts[0]] = send
        recv[counts[0]:] = self.other


class Set:
    """The set's backend: its node levels, and no gather over all ranks."""

    size = 4

    def __init__(self, levels):
        self.levels = levels

    def node_levels(self):
        return self.levels

    def allgatherv(self, send, recv, counts):
        raise AssertionError("Adasum over every rank: the node levels were not used")


def adasum(a, b):
    dot = a @ b
    return (1 - dot / (2 * (a @ a))) * a + (1 - dot / (2 * (b @ b))) * b


def test_gpu_adasum_averages_inside_the_node_and_combines_the_nodes(monkeypatch):
    monkeypatch.setattr(collectives, "array_module", lambda sig: XP)
    rng = np.random.default_rng(7)
    mine, peer, other = (rng.standard_normal(33) for _ in range(3))
    sig = Signature("allreduce", np.dtype(np.float64), (33,), Adasum, -1, 1.0, 1.0, True)
    req = Request("grad", mine.view(DeviceArray), sig, 0, None)
    collectives.adasum_one(Set((Node(peer), Cross(other))), sig, req)
    np.testing.assert_allclose(np.asarray(req.result), adasum((mine + peer) / 2, other),
                               rtol=1e-12)


def test_a_joined_rank_contributes_zeros_to_its_node(monkeypatch):
    monkeypatch.setattr(collectives, "array_module", lambda sig: XP)
    rng = np.random.default_rng(8)
    peer, other = rng.standard_normal(5), rng.standard_normal(5)
    sig = Signature("allreduce", np.dtype(np.float64), (5,), Adasum, -1, 1.0, 1.0, True)
    collectives.adasum_one(Set((Node(peer), Cross(other))), sig, None)  # no error, no result
