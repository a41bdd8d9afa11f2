"""Who is still there: one TCP connection from every rank to rank 0, beside MPI.

MPI tells nothing when a peer process dies: the survivors' collectives wait, and only the
launcher may end them (``mpirun`` does, ``srun`` only with ``--kill-on-bad-exit``, which is not
SLURM's default). A process that ends, however it ends, has its sockets closed by its kernel,
so a connection per rank turns a death into an end-of-file at once, with no timeout to tune and
no risk of taking a slow rank (a long checkpoint, a rank that holds the GIL) for a dead one:
its connection stays open while the process lives. A host that vanishes without closing
anything is caught by TCP keep-alive probes on the same connections.

The same connections carry a failing rank's last words (why it stops) to every other rank
without a collective, which a rank that fails in the middle of one could not run.

Protocol, one line of JSON per message: a rank sends ``{"fail": reason}`` when it stops on an
error of its own, ``{"bye": true}`` when it shuts down normally; rank 0 relays every failure to
every other rank as ``{"fail": reason, "rank": r}``, each of which answers ``{"ack": r}`` once
its engine knows, and rank 0 then tells the failing rank ``{"acked": true}``: a failing rank
waits for that (``TELL_S`` at most) before it exits, since its launcher may end the others
the moment it does. Rank 0 announces lost ranks as ``{"lost": [ranks]}``. A connection that
ends without ``bye`` is a lost rank.

The same connections carry a census of the ranks, which names the late ones whenever a rank
gives up waiting: a negotiation past ``HOROVOD_PEER_TIMEOUT_SECONDS`` (``census``, called by
the wait: the error it raises then names them), or a blocking data call past its deadline
(``common.whereabouts``: the peer timeout plus an allowance for the bytes), which this thread
notices while the engine's thread is blocked in MPI. A rank asks rank 0 ``{"census": answer,
"fatal": bool}``, ``answer`` being where it is (``{"phase", "what", "for_s"}``); rank 0 asks
every other rank ``{"where": true}``, and each one's watch thread answers ``{"here": answer}``
from its engine's whereabouts. After ``CENSUS_S``, or once all answered, rank 0 sends the
census's one line to the ranks that asked, ``{"census_of": text, "frozen": ranks}``: the ranks
that did not answer are frozen (stopped, or blocked outside Python). Rank 0 and the askers
keep them in ``PeerWatch.frozen`` (rank 0 itself, for an asker it does not answer): a process
that exits on the error cancels its srun step (``basics.Runtime.ends_step``), which srun would
otherwise hold for the frozen ones until the time limit. A census for a data call is fatal: a
blocked MPI call never comes back, so rank 0 sends ``{"stuck": text}`` to every rank, and each
one stops as for a lost rank (rank 0 prints the job's one-line summary, every process exits
non-zero). A rank that hears nothing from rank 0 within ``CENSUS_S + HUB_S`` says so, rank 0
being the hub, and stops the same way when its census was fatal.

The listener is rank 0's; the others learn its addresses (every IPv4 address of its host, or
only ``HOROVOD_GLOO_IFACE``'s when set, Horovod's variable for the interface of its side
channel) and a random token through one MPI broadcast at ``init``.

Rank 0 holds one connection per other rank, 1,023 in a job of 1,024, beside Open MPI's own
files: more than the soft limit of open files (``ulimit -n``) that many clusters keep at 1,024,
under a hard limit of 4,096 or more. So ``init`` counts the files rank 0 has open and, when
the connections would not fit with ``SPARE_FDS`` to spare, raises its soft limit
(:func:`make_room`), saying so in one line, since the limit is the whole process's: to the old
limit plus the connections, within the hard limit, so that Open MPI and the script keep the
room they had. A hard limit too low fails ``init`` on every rank, naming ``ulimit -n`` and the
numbers. One direct connection per rank stays, rather than a tree through each node's first
rank, which would hold fewer: through a tree every loss, failure and census would be relayed,
and a frozen first rank would hide its whole node. The listener's backlog is the job's size
(the kernel caps it at ``net.core.somaxconn``, 4,096 on current kernels) and rank 0 takes each
connection's first line as it accepts it: a thousand ranks connecting at once all get in
(tests/common/test_watch.py), and TCP resends a connect that a full backlog dropped, within
the ``DIAL_S`` a rank gives each address.
"""

from __future__ import annotations

import collections
import fcntl
import json
import os
import resource
import secrets
import selectors
import socket
import struct
import threading
import time
import weakref
from collections.abc import Callable

from .log import log
from .whereabouts import Whereabouts, census_text, rank_list

#: how long ``init`` waits for every rank to connect to rank 0
CONNECT_S = 60.0
#: how long a rank tries each of rank 0's addresses (TCP resends a connect's first packet
#: after 1 s and 3 s, should a full backlog drop it)
DIAL_S = 5.0
#: how long a failing rank waits for the others to acknowledge its last words
TELL_S = 5.0
#: after the first lost connection, how long rank 0 gathers others before announcing them
#: (a host's ranks end together, and one message should name them all)
GATHER_LOST_S = 0.3
#: how long a census waits for the ranks' answers; a rank that has not answered by then is
#: frozen (its watch thread needs only the GIL for a moment to answer)
CENSUS_S = 2.0
#: how much longer a rank that asked for a census waits for rank 0's result
HUB_S = 2.0
#: how often the watch thread looks whether the engine's data call is past its deadline
TICK_S = 0.5
#: TCP keep-alive for a host that vanishes without closing its connections: idle seconds
#: before probing, seconds between probes, unanswered probes before the connection is dead
KEEPALIVE = (4, 2, 3)
#: files rank 0 keeps free beside its connections: what Open MPI and the script open later
SPARE_FDS = 64
_SIOCGIFADDR = 0x8915


def host_addresses(iface: str | None = None) -> list[str]:
    """This host's IPv4 addresses (only ``iface``'s when given), loopback last."""
    names = [iface] if iface else [name for _, name in socket.if_nameindex()]
    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for name in names:
            try:
                packed = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR,
                                     struct.pack("256s", name[:15].encode()))
            except OSError:
                continue
            found.append(socket.inet_ntoa(packed[20:24]))
    if iface and not found:
        raise RuntimeError(f"HOROVOD_GLOO_IFACE={iface}: this host has no IPv4 address on "
                           "that interface")
    return sorted(found, key=lambda a: a.startswith("127."))


#: the watches of this process: a child it forks (a data loader's worker) closes its copies of
#: their connections at once, else the connection would outlive this process in the child and
#: its death would go unnoticed
_LIVE: weakref.WeakSet = weakref.WeakSet()


def _close_in_child() -> None:
    for watch in list(_LIVE):
        for sock in [watch._hub, *watch._peers, *watch._wake]:
            if sock is not None:
                sock.close()


os.register_at_fork(after_in_child=_close_in_child)


def _keepalive(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle, interval, count = KEEPALIVE
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, interval)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, count)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _send(sock: socket.socket, message: dict) -> None:
    sock.sendall(json.dumps(message).encode() + b"\n")


def make_room(connections: int) -> None:
    """Rank 0: make sure its ``connections`` to the other ranks, its listener and its
    selector fit under this process's limit of open files (``RLIMIT_NOFILE``, ``ulimit -n``)
    with ``SPARE_FDS`` left over, counting the files open now (Open MPI's among them). When
    they do not fit, the soft limit is raised (said in one line on stderr: the change is the
    whole process's) to leave the process the room it had before on top of them, as far as
    the hard limit allows; when even the hard limit is too low, OSError gives the numbers."""
    need = connections + 2
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    infinite = resource.RLIM_INFINITY
    try:
        open_now = len(os.listdir("/proc/self/fd")) - 1  # less the listing's own
    except OSError:  # no /proc (not Linux): the limit is left as it is
        return
    required = open_now + need + SPARE_FDS
    if soft == infinite or required <= soft:
        return
    if hard != infinite and required > hard:
        raise OSError(
            f"{required} open files needed ({connections} connections to the other ranks "
            f"and 2 more, {open_now} open already, {SPARE_FDS} to spare) but the hard limit "
            f"is {hard}: raise `ulimit -n` (soft {soft}, hard {hard}) where the job starts, "
            "or ask the cluster's administrators for a higher hard limit")
    raised = max(required, soft + need)
    raised = raised if hard == infinite else min(hard, raised)
    resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
    log.warning("raised its soft limit of open files (ulimit -n) from %s to %s (hard limit "
                "%s) for its %s connections to the other ranks", soft, raised,
                "unlimited" if hard == infinite else hard, connections)


def listen(size: int) -> tuple[socket.socket, str, list[str]]:
    """Rank 0's listener for the ``size - 1`` other ranks, its token and its addresses."""
    iface = os.environ.get("HOROVOD_GLOO_IFACE") or None
    addresses = host_addresses(iface)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("0.0.0.0" if not iface else addresses[0], 0))
    listener.listen(min(size, 4096))
    return listener, secrets.token_hex(16), addresses


def accept_ranks(listener: socket.socket, token: str, size: int) -> dict[socket.socket, int]:
    """Rank 0: the connection of each of the other ``size - 1`` ranks (connection -> rank),
    within ``CONNECT_S``; a connection without ``token`` is not one of ours and is closed."""
    peers: dict[socket.socket, int] = {}
    deadline = time.monotonic() + CONNECT_S
    while len(peers) < size - 1:
        left = deadline - time.monotonic()
        if left <= 0:
            for conn in peers:
                conn.close()
            missing = sorted(set(range(1, size)) - set(peers.values()))
            raise TimeoutError(f"rank(s) {rank_list(missing)} did not connect within "
                               f"{CONNECT_S:g} s")
        listener.settimeout(left)
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue  # the deadline: the loop says who is missing
        conn.settimeout(left)
        try:
            message = json.loads(_hello(conn))
        except (OSError, ValueError):
            message = {}
        if message.get("token") != token:  # not one of ours
            conn.close()
            continue
        conn.settimeout(None)
        _keepalive(conn)
        peers[conn] = int(message["rank"])
    return peers


class PeerWatch:
    """This rank's end of the side channel (see the module's docstring).

    ``on_failure(text, culprit, lost, first)`` runs on the watch's thread when a peer failed
    (``lost`` False: ``text`` says why), was lost or a data call is stuck (``lost`` True: the
    process must end); ``culprit`` is the line rank 0 prints for the whole job, ``first``
    whether this is the first report. ``whereabouts``: this rank's engine's
    (``common.whereabouts``), which the census reports and whose data calls are bounded.
    """

    def __init__(self, comm, on_failure: Callable[[str, str, bool, bool], None],
                 whereabouts: Whereabouts | None = None):
        """Collective over ``comm`` (an mpi4py communicator): connects every rank to rank 0."""
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.hosts: list[str] = comm.allgather(socket.gethostname())
        self._on_failure = on_failure
        self._whereabouts = whereabouts
        self._overdue = None  # the start of the data call a census was asked for
        self._census: dict | None = None  # rank 0: the census under way
        self._asking: dict | None = None  # the others: the census asked of rank 0
        self._requests: collections.deque = collections.deque()  # other threads' censuses
        self._wake = socket.socketpair()  # other threads wake the watch thread with a byte
        self._closing = False
        self._reported = False
        #: the ranks a census this rank took part in found frozen: they hold a job whose
        #: launcher waits for every process (``basics``: the srun step is then cancelled)
        self.frozen: set[int] = set()
        self._lock = threading.Lock()  # one writer at a time on each connection
        self._peers: dict[socket.socket, int] = {}  # rank 0: connection -> rank
        self._acks: dict[int, set[int]] = {}  # rank 0: failed rank -> ranks yet to ack
        self._acked = threading.Event()  # this rank's failure is known everywhere
        self._hub: socket.socket | None = None  # the others: the connection to rank 0
        error = None
        if self.rank == 0:
            listener = None
            try:
                make_room(self.size - 1)
                listener, token, addresses = listen(self.size)
            except Exception as exc:  # noqa: BLE001 - every rank must learn it: below
                error = f"rank 0: {exc}"
            comm.bcast(None if listener is None
                       else (addresses, listener.getsockname()[1], token), root=0)
            if listener is not None:
                try:
                    self._peers = accept_ranks(listener, token, self.size)
                except Exception as exc:  # noqa: BLE001 - every rank must learn it: below
                    error = f"rank 0: {exc}"
                finally:
                    listener.close()
        else:
            hub = comm.bcast(None, root=0)
            try:
                if hub is not None:  # else rank 0 could not listen, and says why
                    self._connect(*hub)
            except Exception as exc:  # noqa: BLE001 - every rank must learn it: below
                error = f"rank {self.rank}: {exc}"
        errors = [e for e in comm.allgather(error) if e]
        if errors:
            self.close()
            for sock in self._wake:
                sock.close()
            raise RuntimeError("the ranks could not open their connections to rank 0 (used to "
                               "tell a lost rank at once): " + "; ".join(errors[:4]))
        _LIVE.add(self)
        self._thread = threading.Thread(target=self._run, name="hpc_horovod-watch",
                                        daemon=True)
        self._thread.start()

    # -- set-up ------------------------------------------------------------------------------
    def _connect(self, addresses: list[str], port: int, token: str) -> None:
        if self.hosts[self.rank] == self.hosts[0]:
            addresses = ["127.0.0.1"] + addresses
        failures = []
        for address in addresses:
            try:
                sock = socket.create_connection((address, port), timeout=DIAL_S)
            except OSError as exc:
                failures.append(f"{address}:{port}: {exc}")
                continue
            sock.settimeout(None)
            _keepalive(sock)
            _send(sock, {"token": token, "rank": self.rank})
            self._hub = sock
            return
        raise ConnectionError(f"cannot reach rank 0 on {self.hosts[0]} ("
                              + "; ".join(failures) + "): set HOROVOD_GLOO_IFACE to the "
                              "interface the hosts reach each other on")

    # -- messages ----------------------------------------------------------------------------
    def tell(self, reason: str) -> None:
        """This rank stops on an error of its own: every other rank learns ``reason``; returns
        once they all acknowledged it (``TELL_S`` at most)."""
        if self.rank == 0:
            self._relay(0, reason)
        elif self._hub is not None:
            self._write(self._hub, {"fail": reason})
        self._acked.wait(TELL_S)

    def census(self) -> str:
        """One line naming the ranks that do not answer and where the others are (see the
        module's docstring); from any thread but the watch's, within ``CENSUS_S + HUB_S``."""
        if not self._thread.is_alive():
            return "the side channel to rank 0 is closed: no census of the ranks"
        box: list[str] = []
        done = threading.Event()
        self._requests.append(lambda text: (box.append(text), done.set()))
        try:
            self._wake[1].send(b"x")
        except OSError:
            pass
        done.wait(CENSUS_S + HUB_S + 1.0)
        return box[0] if box else "the census of the ranks did not complete"

    def close(self) -> None:
        """A normal end: the peers will not take this rank's departure for a loss."""
        self._closing = True
        for sock in ([self._hub] if self._hub is not None else list(self._peers)):
            self._write(sock, {"bye": True})
            try:
                sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def _write(self, sock: socket.socket, message: dict) -> None:
        with self._lock:
            try:
                _send(sock, message)
            except OSError:  # that peer is gone already: its end-of-file says so
                pass

    def _broadcast(self, message: dict, skip: int | None = None,
                   only: int | None = None) -> None:
        for sock, rank in list(self._peers.items()):
            if rank != skip and (only is None or rank == only):
                self._write(sock, message)

    # -- the thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        socks = [self._hub] if self._hub is not None else list(self._peers)
        buffers = {}
        for sock in socks:
            selector.register(sock, selectors.EVENT_READ)
            buffers[sock] = b""
        selector.register(self._wake[0], selectors.EVENT_READ)
        departed: set[socket.socket] = set()  # said bye
        lost: list[int] = []
        lost_since = None
        while buffers or lost_since is not None:  # the last peer lost: still announce it
            ends = [time.monotonic() + TICK_S]
            if lost_since is not None:
                ends.append(lost_since + GATHER_LOST_S)
            for pending in (self._census, self._asking):
                if pending is not None:
                    ends.append(pending["until"])
            for key, _ in selector.select(max(0.0, min(ends) - time.monotonic())):
                sock = key.fileobj
                if sock is self._wake[0]:
                    sock.recv(4096)
                    while self._requests:
                        self._ask(self._requests.popleft(), fatal=False)
                    continue
                try:
                    data = sock.recv(65536)
                except OSError:
                    data = b""
                if not data:
                    selector.unregister(sock)
                    del buffers[sock]
                    if sock not in departed and not self._closing:
                        lost.append(self._peers.get(sock, 0))
                        lost_since = lost_since or time.monotonic()
                    continue
                buffers[sock] += data
                *lines, buffers[sock] = buffers[sock].split(b"\n")
                for line in lines:
                    message = json.loads(line)
                    if message.get("bye"):
                        departed.add(sock)
                    elif "fail" in message:
                        self._failed(message.get("rank", self._peers.get(sock)),
                                     message["fail"])
                    elif "ack" in message:
                        self._ack(message["ack"], self._peers[sock])
                    elif message.get("acked"):
                        self._acked.set()
                    elif "lost" in message:
                        self._lost(message["lost"])
                    else:
                        self._on_census_message(message, self._peers.get(sock))
            self._tick()
            if lost_since is not None and time.monotonic() >= lost_since + GATHER_LOST_S:
                ranks, lost, lost_since = sorted(lost), [], None
                if self.rank == 0:
                    self._broadcast({"lost": ranks})
                    for failed in list(self._acks):
                        for rank in ranks:
                            self._ack(failed, rank)
                self._lost(ranks)
        selector.close()
        for sock in self._wake:
            sock.close()

    # -- the census ----------------------------------------------------------------------------
    def _answer(self) -> dict:
        """Where this rank is, as a census answer."""
        if self._whereabouts is None:
            return {"phase": "idle", "what": "idle (no engine)", "for_s": 0.0}
        return self._whereabouts.answer()

    def _ask(self, callback: Callable[[str], None] | None, fatal: bool) -> None:
        """Start a census, or join the one under way; ``callback(text)`` gets its line."""
        now = time.monotonic()
        if self.rank == 0:
            census = self._census
            if census is None:
                census = self._census = {"until": now + CENSUS_S, "answers": {},
                                         "askers": set(), "callbacks": [], "fatal": False}
                self._broadcast({"where": True})
            census["answers"][0] = self._answer()
            census["fatal"] |= fatal
        else:
            asking = self._asking
            if asking is None or (fatal and not asking["fatal"]):
                self._write(self._hub, {"census": self._answer(), "fatal": fatal})
            if asking is None:
                asking = self._asking = {"until": now + CENSUS_S + HUB_S, "callbacks": [],
                                         "fatal": False}
            asking["fatal"] |= fatal
            census = asking
        if callback is not None:
            census["callbacks"].append(callback)

    def _on_census_message(self, message: dict, sender: int | None) -> None:
        if "where" in message:
            self._write(self._hub, {"here": self._answer()})
        elif "here" in message:
            if self._census is not None:
                self._census["answers"][sender] = message["here"]
        elif "census" in message:
            self._ask(None, bool(message.get("fatal")))
            self._census["answers"][sender] = message["census"]
            self._census["askers"].add(sender)
        elif "census_of" in message:
            self.frozen.update(message["frozen"])
            self._answered(message["census_of"])
        elif "stuck" in message:
            self._answered(message["stuck"])
            self._stuck(message["stuck"])

    def _answered(self, text: str) -> None:
        """The census this rank asked rank 0 for is in."""
        asking, self._asking = self._asking, None
        for callback in asking["callbacks"] if asking is not None else ():
            callback(text)

    def _tick(self) -> None:
        """The timers: this rank's data call past its deadline, a census that is complete, or
        rank 0 silent."""
        now = time.monotonic()
        if self._whereabouts is not None:
            since = self._whereabouts.overdue(now)
            if since is not None and since != self._overdue:
                self._overdue = since
                self._ask(None, fatal=True)
        census = self._census
        if census is not None and (len(census["answers"]) == self.size
                                   or now >= census["until"]):
            self._census = None
            text = census_text(self.size, census["answers"], CENSUS_S)
            silent = [r for r in range(self.size) if r not in census["answers"]]
            self.frozen.update(silent)
            for rank in census["askers"]:
                self._broadcast({"census_of": text, "frozen": silent}, only=rank)
            for callback in census["callbacks"]:
                callback(text)
            if census["fatal"]:
                self._broadcast({"stuck": text})
                self._stuck(text)
        asking = self._asking
        if asking is not None and now >= asking["until"]:
            answer = self._answer()
            text = (f"rank 0 did not answer within {CENSUS_S + HUB_S:g} s (it is the hub of "
                    "the census: stopped, or blocked outside Python); this rank "
                    f"({self.rank}) {answer['what']}"
                    + ("" if answer["phase"] == "idle" else f" for {answer['for_s']:.0f} s"))
            self.frozen.add(0)
            self._answered(text)
            if asking["fatal"]:
                self._stuck(text)

    def _stuck(self, text: str) -> None:
        """A data call is stuck somewhere: it never comes back, and the job must end."""
        self._report(f"A collective did not complete: {text}.",
                     f"a collective did not complete: {text}", lost=True)

    def _failed(self, rank: int, reason: str) -> None:
        self._report(f"Rank {rank} stopped first, with: {reason}",
                     f"rank {rank} failed first: {reason}", lost=False)
        if self.rank == 0:
            self._relay(rank, reason)
        else:
            self._write(self._hub, {"ack": rank})

    def _relay(self, rank: int, reason: str) -> None:
        """Rank 0: ``rank``'s failure to every other rank, and wait for their acks."""
        self._acks[rank] = {r for r in self._peers.values() if r != rank}
        self._broadcast({"fail": reason, "rank": rank}, skip=rank)
        self._ack(rank, 0)

    def _ack(self, failed: int, rank: int) -> None:
        waiting = self._acks.get(failed)
        if waiting is None:
            return
        waiting.discard(rank)
        if not waiting and self._acks.pop(failed, None) is not None:
            if failed == 0:
                self._acked.set()
            else:
                self._broadcast({"acked": True}, skip=None, only=failed)

    def _lost(self, ranks: list[int]) -> None:
        hosts = sorted({self.hosts[r] for r in ranks})
        where = (f"on host {hosts[0]}" if len(hosts) == 1
                 else "on hosts " + ", ".join(hosts))
        text = (f"rank(s) {rank_list(ranks)} {where} ended without a word (killed, out of memory, "
                "or their node failed)")
        self._report(f"Lost {text}.", f"lost {text}", lost=True)

    def _report(self, text: str, culprit: str, lost: bool) -> None:
        if self._closing:
            return
        first = not self._reported
        self._reported = True
        self._on_failure(text, culprit, lost, first)


def _hello(conn: socket.socket, limit: int = 4096) -> bytes:
    """The first line on a new connection, read a byte at a time: what follows it is the
    watch thread's to read, not a buffer's that would be dropped with it."""
    line = b""
    while not line.endswith(b"\n") and len(line) < limit:
        byte = conn.recv(1)
        if not byte:
            break
        line += byte
    return line
