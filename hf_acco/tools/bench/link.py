"""Real, rate-limited links between ranks: one network namespace per rank, tbf on every link's ends.

    with Link() as link:              # needs root and iproute2 (ip, tc); Link.unavailable() says why not
        link.shape(200)               # Mbit/s each way; None: unshaped
        argv = link.wrap(rank, ["python", ...])   # runs in rank's namespace
    # namespaces (and with them the veths, the bridge and their qdiscs) are gone, also after Ctrl-C or an error

Two ranks (``Link()``): a veth pair between the two namespaces. N ranks (``Link(world_size=N)``, and
``bridge=True`` at any size): a switch, as on a cluster: a Linux bridge in a namespace of its own, and for each
rank a veth pair from the rank's namespace to a port of the bridge. Every rank's link is shaped each way: tbf on
the rank's end (what it sends) and on the bridge's end (what it receives), so a rank's NIC has the stated rate
and the bridge itself is not a bottleneck (it forwards in memory). Set-up: ``ip netns add`` per rank and the
bridge, ``ip link add ... type bridge``, ``ip link add ... type veth peer ...``, ``ip link set ... master br0``.
Tear-down: deleting the namespaces (``ip netns del``) deletes the veths, the bridge and the qdiscs with them, at
exit, on SIGTERM, on an error during set-up; namespaces of a killed run are deleted by the next one.

Nodes (``Link(world_size=N, nodes=n)``): a two-level network, as between machines. The ranks of each node are
on a bridge of their own (a namespace per node, unshaped veths: the fast network inside a machine), and every
node's bridge is joined to a core bridge by one veth, the node's uplink: ``shape`` then shapes the uplinks (each
way: tbf on the node's end, what the node sends, and on the core's end, what it receives), so every byte
between two nodes crosses two shaped uplinks and a node's ranks share its uplink's rate, as they share a
machine's NICs. Ranks ``r`` of node ``r // (N // n)``, as launchers number them.

``Link(loopback=True)`` puts every rank in one namespace on its loopback: unshaped, but its byte counters see
only the benchmark's traffic. Only the addresses inside the namespaces it creates are used.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

SUBNET = "10.213.7"  # inside our own namespaces only: never visible to the host's routing
# Jumbo frames, as on cluster networks. With 1500-byte frames the kernel's per-packet work for the emulated link
# (TCP, veth, tbf, which splits GSO packets) ran on the same 2 cores as the ranks' compute and slowed a step with
# two background rounds by a quarter; 9000 bytes cut the packet count 6x.
MTU = 9000


def unavailable() -> str | None:
    """Why namespaces cannot be made here (``None`` when they can)."""
    if os.geteuid() != 0:
        return "network namespaces and tc need root (run as root, or in a container with CAP_NET_ADMIN)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found: install iproute2 (Debian/Ubuntu: apt-get install iproute2)"
    return None


def tbf_args(mbit: float) -> list[str]:
    """tc arguments of a token bucket at ``mbit`` Mbit/s: a bucket of 4 ms of traffic (at least 64 KiB, so a
    GSO super-packet is split, not dropped) and a queue of 200 ms."""
    rate_bytes = mbit * 1e6 / 8
    burst = max(64 * 1024, int(rate_bytes * 0.004))
    return ["tbf", "rate", f"{mbit:.3f}mbit", "burst", str(burst), "latency", "200ms"]


def _run(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")


class Link:
    """Ranks in their own namespaces joined by a veth pair (2 ranks) or a bridge (MTU 9000), or one namespace's
    loopback."""

    def __init__(
        self,
        loopback: bool = False,
        prefix: str | None = None,
        world_size: int = 2,
        bridge: bool | None = None,
        nodes: int = 1,
    ) -> None:
        if world_size < 2:
            raise ValueError(f"a link joins at least 2 ranks, got world_size={world_size}")
        if nodes < 1 or world_size % nodes or (nodes > 1 and loopback):
            raise ValueError(f"nodes must divide world_size ({world_size}) and need namespaces, got nodes={nodes}")
        self.loopback, self.world_size, self.nodes = loopback, world_size, nodes
        self.bridge = not loopback and ((world_size > 2 or nodes > 1) if bridge is None else bridge)
        if not loopback and not self.bridge and (world_size != 2 or nodes > 1):
            raise ValueError("a veth pair joins 2 ranks: use bridge=True for more")
        self.prefix = prefix or f"hfacco{os.getpid()}"
        tag = f"hfa{os.getpid() % 100000}"
        ranks = range(world_size)
        self.namespaces = [f"{self.prefix}lo"] if loopback else [f"{self.prefix}r{r}" for r in ranks]
        self.devices = ["lo"] if loopback else [f"{tag}v{r}" for r in ranks]
        self.bridge_namespace = f"{self.prefix}br"  # the switch (between nodes: the core); used with ``bridge`` only
        self.ports = [f"{tag}b{r}" for r in ranks] if self.bridge else []  # the bridge's end of each rank's veth
        # two levels: a bridge per node, its uplink (node's end, core's end) to the core bridge
        self.node_namespaces = [f"{self.prefix}n{i}" for i in range(nodes)] if nodes > 1 else []
        self.uplinks = [(f"{tag}u{i}", f"{tag}c{i}") for i in range(nodes)] if nodes > 1 else []
        self.mbit: float | None = None
        self._up = False
        self._restore: tuple = (None, None)

    # addresses and devices as the ranks see them
    def master_addr(self) -> str:
        return "127.0.0.1" if self.loopback else f"{SUBNET}.1"

    def device(self, rank: int) -> str:
        return self.devices[0 if self.loopback else rank]

    def namespace(self, rank: int) -> str:
        return self.namespaces[0 if self.loopback else rank]

    def node(self, rank: int) -> int:
        return rank // (self.world_size // self.nodes)

    def _switch(self, rank: int) -> str:
        """The namespace of the bridge a rank's veth ends on: its node's, or the only one."""
        return self.node_namespaces[self.node(rank)] if self.nodes > 1 else self.bridge_namespace

    def wrap(self, rank: int, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespace(rank), *argv]

    def __enter__(self) -> Link:
        why = unavailable()
        if why is not None:
            raise RuntimeError(why)
        remove_stale()
        atexit.register(self.close)
        previous = signal.getsignal(signal.SIGTERM)

        def on_term(signum, frame):  # SIGTERM: clean up like Ctrl-C does
            self.close()
            if callable(previous):
                previous(signum, frame)
            raise SystemExit(128 + signum)

        signal.signal(signal.SIGTERM, on_term)
        self._restore = (previous, on_term)
        self._up = True
        try:
            for ns in self._all_namespaces():
                _run("ip", "netns", "add", ns)
                _run("ip", "-n", ns, "link", "set", "lo", "up")
            if self.bridge:
                for br in [self.bridge_namespace, *self.node_namespaces]:
                    _run("ip", "-n", br, "link", "add", "br0", "mtu", str(MTU), "type", "bridge")
                    _run("ip", "-n", br, "link", "set", "br0", "up")
                for rank, (ns, dev, port) in enumerate(zip(self.namespaces, self.devices, self.ports)):
                    br = self._switch(rank)
                    _run("ip", "link", "add", dev, "netns", ns, "type", "veth", "peer", "name", port, "netns", br)
                    _run("ip", "-n", br, "link", "set", port, "mtu", str(MTU), "master", "br0", "up")
                for node_ns, (up, core_end) in zip(self.node_namespaces, self.uplinks):
                    core = self.bridge_namespace
                    _run(
                        "ip",
                        "link",
                        "add",
                        up,
                        "netns",
                        node_ns,
                        "type",
                        "veth",
                        "peer",
                        "name",
                        core_end,
                        "netns",
                        core,
                    )
                    _run("ip", "-n", node_ns, "link", "set", up, "mtu", str(MTU), "master", "br0", "up")
                    _run("ip", "-n", core, "link", "set", core_end, "mtu", str(MTU), "master", "br0", "up")
            elif not self.loopback:
                a, b = self.devices
                _run("ip", "link", "add", a, "netns", self.namespaces[0], "type", "veth", "peer", "name", b,
                     "netns", self.namespaces[1])  # fmt: skip
            if not self.loopback:
                for rank, (ns, dev) in enumerate(zip(self.namespaces, self.devices)):
                    _run("ip", "-n", ns, "addr", "add", f"{SUBNET}.{rank + 1}/24", "dev", dev)
                    _run("ip", "-n", ns, "link", "set", dev, "mtu", str(MTU), "up")
        except BaseException:
            self.close()
            raise
        return self

    def shape(self, mbit: float | None) -> None:
        """Limit every rank's link (with nodes: every node's uplink) to ``mbit`` Mbit/s each way (tbf on both ends
        of each veth); ``None`` removes the limit."""
        if self.loopback:
            if mbit is not None:
                raise ValueError("the loopback link is not shaped")
            return
        if self.nodes > 1:
            ends = [(ns, up) for ns, (up, _) in zip(self.node_namespaces, self.uplinks)]
            ends += [(self.bridge_namespace, core_end) for _, core_end in self.uplinks]
        else:
            ends = list(zip(self.namespaces, self.devices)) + [(self.bridge_namespace, p) for p in self.ports]
        for ns, dev in ends:
            if mbit is None:
                subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], capture_output=True)
            else:
                _run("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", *tbf_args(mbit))
        self.mbit = mbit

    def close(self) -> None:
        if not self._up:
            return
        self._up = False
        # deleting a namespace deletes its devices (veth ends, the bridge) and their qdiscs
        for ns in self._all_namespaces():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        atexit.unregister(self.close)  # a run with several links (one per world size) keeps no stale hooks
        previous, ours = self._restore
        if signal.getsignal(signal.SIGTERM) is ours:
            with contextlib.suppress(ValueError, TypeError):  # not the main thread, or not set from Python
                signal.signal(signal.SIGTERM, previous)

    def __exit__(self, *exc) -> None:
        self.close()

    def _all_namespaces(self) -> list[str]:
        return self.namespaces + ([self.bridge_namespace] if self.bridge else []) + self.node_namespaces


def remove_stale() -> list[str]:
    """Delete namespaces left by a benchmark that was killed (SIGKILL skips clean-up): ``hfacco<pid>...`` whose
    process is gone."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    removed = []
    for name in listed:
        match = re.fullmatch(r"hfacco(\d+)(r\d+|n\d+|lo|br)", name)
        if match and not Path(f"/proc/{match.group(1)}").exists():
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            removed.append(name)
    return removed


def tx_bytes(device: str) -> int:
    """Bytes sent on ``device`` in the caller's network namespace (/proc/net/dev follows the namespace)."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, fields = line.partition(":")
        if name.strip() == device:
            return int(fields.split()[8])
    raise RuntimeError(f"no interface {device!r} in /proc/net/dev")


class Traffic:
    """Bytes a rank sent on its link device (both ranks' when they share one loopback: halved); with nodes, also
    its share of what left its node through the node's uplink (``across``: the uplink's count over the node's
    ranks, read in the node's namespace)."""

    def __init__(
        self, device: str | None, shared: bool, world_size: int, uplink: list[str] | None = None, nodes: int = 1
    ) -> None:
        self.device, self.divide = device, (world_size if shared else 1)
        self.uplink, self.per_node = uplink, world_size // max(nodes, 1)

    def read(self) -> float | None:
        return None if self.device is None else tx_bytes(self.device) / self.divide

    def across(self) -> float | None:
        if self.uplink is None:
            return None
        namespace, device = self.uplink
        text = subprocess.run(["ip", "netns", "exec", namespace, "cat", "/proc/net/dev"], capture_output=True,
                              text=True, check=True).stdout  # fmt: skip
        for line in text.splitlines():
            name, _, fields = line.partition(":")
            if name.strip() == device:
                return int(fields.split()[8]) / self.per_node
        raise RuntimeError(f"no interface {device!r} in namespace {namespace}")
