"""Hosts for the test cluster: one network namespace per host, with its own hostname, address,
``/etc/hosts`` and ``/dev/shm``, joined by a private bridge in this (the root) namespace.

A host is held by a ``sleep`` process started with ``unshare --net --uts --mount``: its
namespaces are the host's, and every process of the host (``slurmd``, and through it each job
step and task) is started inside them with ``nsenter --target HOLDER --net --uts --mount``. So
``hostname`` inside says ``h1``, Open MPI's shared-memory transport works between the ranks of
one host and its TCP transport between hosts, and the root namespace (where the test, its SLURM
clients, ``slurmctld`` and ``munged`` run) reaches each host at its address on the bridge.

The file system is shared, as on a cluster with a shared file system: only ``/etc/hosts`` (the
hosts' names) and ``/dev/shm`` (node-local memory) are the host's own.

``Network.stop()`` ends every process inside the hosts' namespaces (they are this network's by
construction), which frees the namespaces, then deletes the links. The bridge's name and subnet
are drawn at random among those free, so that several test sessions may run side by side.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

TOOLS = ("ip", "unshare", "nsenter", "mount")


class NamespaceError(RuntimeError):
    """The namespaces or links could not be created (no privilege, no kernel support)."""


def missing_tools() -> list[str]:
    return [name for name in TOOLS
            if shutil.which(name) is None and shutil.which(name, path="/usr/sbin:/sbin") is None]


def _ip(*args: str, error: type[Exception] = RuntimeError) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise error(f"ip {' '.join(args)}: {proc.stderr.strip()}")


def _ns_id(pid: int) -> tuple[int, int] | None:
    try:
        st = os.stat(f"/proc/{pid}/ns/net")
    except OSError:
        return None
    return st.st_dev, st.st_ino


@dataclass
class Host:
    """One host: its name (also its hostname), its address, and the process holding its
    namespaces."""

    name: str
    address: str
    holder: subprocess.Popen | None = None
    netns: tuple[int, int] | None = None

    def enter(self) -> list[str]:
        """The command prefix that runs a command on this host."""
        return ["nsenter", f"--target={self.holder.pid}", "--net", "--uts", "--mount", "--"]

    def processes(self) -> list[int]:
        """Every process inside this host's network namespace."""
        if self.netns is None:
            return []
        return [int(p) for p in os.listdir("/proc")
                if p.isdigit() and _ns_id(int(p)) == self.netns]


@dataclass
class Network:
    """A bridge with an address in the root namespace, and one host namespace per name."""

    names: tuple[str, ...]
    root: Path
    tag: str = field(default_factory=lambda: _free_tag())
    subnet: str = ""
    hosts: dict[str, Host] = field(default_factory=dict)
    links: list[str] = field(default_factory=list)

    @property
    def bridge(self) -> str:
        return f"hvb{self.tag}"

    @property
    def gateway(self) -> str:
        """The root namespace's address on the bridge (slurmctld's, and the clients')."""
        return f"{self.subnet}.1"

    def start(self, root_hostname: str) -> None:
        """Create the bridge and the hosts; on failure, remove what was created and raise."""
        try:
            self._start(root_hostname)
        except BaseException:
            self.stop()
            raise

    def _start(self, root_hostname: str) -> None:
        self.subnet = _free_subnet()
        _ip("link", "add", self.bridge, "type", "bridge", error=NamespaceError)
        self.links.append(self.bridge)
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        self.hosts = {name: Host(name, f"{self.subnet}.{11 + i}")
                      for i, name in enumerate(self.names)}
        hosts_file = self.root / "etc-hosts"
        hosts_file.write_text(
            "127.0.0.1 localhost\n" + f"{self.gateway} {root_hostname}\n"
            + "".join(f"{h.address} {h.name}\n" for h in self.hosts.values()))
        for i, host in enumerate(self.hosts.values()):
            self._start_host(host, f"hvv{self.tag}{i}", hosts_file)

    def _start_host(self, host: Host, link: str, hosts_file: Path) -> None:
        host.holder = subprocess.Popen(
            ["unshare", "--net", "--uts", "--mount", "--propagation", "private",
             "sh", "-c", "echo ready; exec sleep infinity"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        ready = host.holder.stdout.readline()
        if ready.strip() != "ready":
            raise NamespaceError(f"unshare --net --uts --mount failed: "
                                 f"{host.holder.stderr.read().strip()}")
        host.netns = _ns_id(host.holder.pid)
        if host.netns == _ns_id(os.getpid()):
            raise NamespaceError("unshare did not create a network namespace")
        _ip("link", "add", link, "type", "veth", "peer", "name", "eth0",
            "netns", f"/proc/{host.holder.pid}/ns/net", error=NamespaceError)
        self.links.append(link)
        _ip("link", "set", link, "master", self.bridge, "up")
        setup = (f"hostname {host.name} && ip link set lo up && "
                 f"ip addr add {host.address}/24 dev eth0 && ip link set eth0 up && "
                 f"mount --bind {hosts_file} /etc/hosts && "
                 "mount -t tmpfs -o mode=1777 tmpfs /dev/shm")
        proc = subprocess.run([*host.enter(), "sh", "-c", setup], capture_output=True,
                              text=True, timeout=30)
        if proc.returncode != 0:
            raise RuntimeError(f"setting up host {host.name}: {proc.stderr.strip()}")

    def stop(self) -> None:
        """End every process on the hosts (their namespaces go with them), delete the links."""
        for host in self.hosts.values():
            for pid in host.processes():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if host.holder is not None:
                host.holder.kill()
                host.holder.wait(timeout=30)
        deadline = time.monotonic() + 10
        while any(h.processes() for h in self.hosts.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        for link in reversed(self.links):
            subprocess.run(["ip", "link", "del", link], capture_output=True, timeout=30)
        self.links.clear()


def _free_tag() -> str:
    """Five hex digits that name no link of this namespace yet (links are named hvb<tag>,
    hvv<tag><i>)."""
    for _ in range(100):
        tag = f"{random.randrange(16 ** 5):05x}"
        if not any(tag in name for name in os.listdir("/sys/class/net")):
            return tag
    raise NamespaceError("no free name for the bridge")


def _free_subnet() -> str:
    """A 10.x.y.0/24 that no address or route of this namespace uses yet."""
    used = subprocess.run(["ip", "-4", "-o", "route", "show", "table", "all"],
                          capture_output=True, text=True, timeout=30).stdout
    used += subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True,
                           timeout=30).stdout
    for _ in range(100):
        subnet = f"10.{random.randint(128, 254)}.{random.randint(0, 255)}"
        if f"{subnet}." not in used:
            return subnet
    raise RuntimeError("no free 10.x.y.0/24 subnet")
