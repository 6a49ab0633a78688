"""A real, rate-limited link between two ranks: one network namespace per rank, a veth pair, tbf on both ends.

    with Link() as link:              # needs root and iproute2 (ip, tc); Link.unavailable() says why not
        link.shape(200)               # Mbit/s each way; None: unshaped
        argv = link.wrap(rank, ["python", ...])   # runs in rank's namespace
    # namespaces (and with them the veth pair and its qdiscs) are gone, also after Ctrl-C or an error

``Link(loopback=True)`` puts both ranks in one namespace on its loopback: unshaped, but its byte counters see
only the benchmark's traffic. Only the addresses inside the namespaces it creates are used.
"""

from __future__ import annotations

import atexit
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
    """Two ranks joined by a veth pair (MTU 9000) in their own namespaces (or one namespace's loopback)."""

    def __init__(self, loopback: bool = False, prefix: str | None = None) -> None:
        self.loopback = loopback
        self.prefix = prefix or f"hfacco{os.getpid()}"
        self.namespaces = [f"{self.prefix}lo"] if loopback else [f"{self.prefix}r0", f"{self.prefix}r1"]
        self.devices = ["lo"] if loopback else [f"hfa{os.getpid() % 100000}v0", f"hfa{os.getpid() % 100000}v1"]
        self.mbit: float | None = None
        self._up = False

    # addresses and devices as the ranks see them
    def master_addr(self) -> str:
        return "127.0.0.1" if self.loopback else f"{SUBNET}.1"

    def device(self, rank: int) -> str:
        return self.devices[0 if self.loopback else rank]

    def namespace(self, rank: int) -> str:
        return self.namespaces[0 if self.loopback else rank]

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
        self._up = True
        try:
            for ns in self.namespaces:
                _run("ip", "netns", "add", ns)
                _run("ip", "-n", ns, "link", "set", "lo", "up")
            if not self.loopback:
                a, b = self.devices
                _run("ip", "link", "add", a, "netns", self.namespaces[0], "type", "veth", "peer", "name", b,
                     "netns", self.namespaces[1])  # fmt: skip
                for rank, (ns, dev) in enumerate(zip(self.namespaces, self.devices)):
                    _run("ip", "-n", ns, "addr", "add", f"{SUBNET}.{rank + 1}/24", "dev", dev)
                    _run("ip", "-n", ns, "link", "set", dev, "mtu", str(MTU), "up")
        except BaseException:
            self.close()
            raise
        return self

    def shape(self, mbit: float | None) -> None:
        """Limit each direction to ``mbit`` Mbit/s (tbf on both veth ends); ``None`` removes the limit."""
        if self.loopback:
            if mbit is not None:
                raise ValueError("the loopback link is not shaped")
            return
        for ns, dev in zip(self.namespaces, self.devices):
            if mbit is None:
                subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], capture_output=True)
            else:
                _run("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", *tbf_args(mbit))
        self.mbit = mbit

    def close(self) -> None:
        if not self._up:
            return
        self._up = False
        for ns in self.namespaces:  # deleting a namespace deletes its end of the veth pair and the qdisc
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def __exit__(self, *exc) -> None:
        self.close()


def remove_stale() -> list[str]:
    """Delete namespaces left by a benchmark that was killed (SIGKILL skips clean-up): ``hfacco<pid>...`` whose
    process is gone."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    removed = []
    for name in listed:
        match = re.fullmatch(r"hfacco(\d+)(r0|r1|lo)", name)
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
