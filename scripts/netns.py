"""Simulated machines with slow links between them, for the benchmarks and tests: one Linux network
namespace per "host", each joined to a bridge in this namespace by a veth pair whose two ends are
rate-limited with `tc ... tbf` (so every byte between hosts, either way, crosses a limit; `netem`,
which could add latency, is not available on these kernels). Workers of one host share its
namespace and talk over its own address at loopback speed; the coordinator listens on the bridge.
Measured here: a 200 mbit limit gives 23.6 MB/s between two namespaces.

A namespace shares the machine's cores with every other one, so four workers on two "hosts" of a
2-core machine compete for the same two cores across hosts, which no real pair of machines does
(and which the coordinator's contention model, per host, cannot see). `cpus` gives each host CPUs
of its own: `prefix` then runs its programs under `taskset`, and a worker there counts only those
cores as its host's (`worker.calibrate` reads its CPU affinity). `split_cpus` divides this
process's CPUs between the hosts.

Needs root (CAP_NET_ADMIN) and the `ip` and `tc` tools: `available()` says whether they work here
(it tries). Names carry this process's id, so two runs do not collide, and `close()` (or leaving
the `with` block) deletes everything it made, namespaces, veths and the bridge, also on errors.

    with Hosts(["a", "b"], rate_mbit=200) as hosts:
        job = LocalJob(ref, dir, bind_host=hosts.bridge_address)
        job.add_worker("w1", "--host", "a", netns=hosts.prefix("a"), env_extra=hosts.env("a"))
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence

__all__ = ["Hosts", "NetnsError", "available", "split_cpus"]


class NetnsError(RuntimeError):
    """The namespaces cannot be made here (not root, no `ip`/`tc`, a kernel without veth or bridges)."""


def _run(*cmd: str) -> None:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise NetnsError(f"{' '.join(cmd)}: {out.stderr.strip() or out.stdout.strip()}")


def split_cpus(names: Sequence[str]) -> dict[str, tuple[int, ...]]:
    """This process's CPUs divided between `names` in order, as evenly as they go ({} when there are
    fewer CPUs than hosts: they share them)."""
    mine = sorted(os.sched_getaffinity(0))
    if len(mine) < len(names):
        return {}
    base, extra = divmod(len(mine), len(names))
    out, at = {}, 0
    for k, name in enumerate(names):
        n = base + (1 if k < extra else 0)
        out[name] = tuple(mine[at:at + n])
        at += n
    return out


def available() -> str:
    """'' where namespaces with rate-limited links can be made here, else why not."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "the ip and tc tools are not installed"
    if os.geteuid() != 0:
        return "making network namespaces needs root (CAP_NET_ADMIN)"
    try:
        with Hosts(["probe"], rate_mbit=100):
            return ""
    except NetnsError as e:
        return str(e)


class Hosts:
    """`names` as hosts: namespace, address and a rate-limited link to the bridge each."""

    def __init__(self, names: Sequence[str], *, rate_mbit: float, cpus: Mapping[str, Sequence[int]] | None = None) -> None:
        if not names or len(set(names)) != len(names) or len(names) > 200:
            raise ValueError(f"hosts must be 1-200 distinct names, got {list(names)}")
        if rate_mbit <= 0:
            raise ValueError(f"rate_mbit must be positive, got {rate_mbit}")
        if cpus is not None and (set(cpus) - set(names) or any(not c for c in cpus.values())):
            raise ValueError(f"cpus must give hosts among {list(names)} at least one CPU each, got {dict(cpus)}")
        self.names = list(names)
        self.rate_mbit = rate_mbit
        self.cpus = {h: tuple(c) for h, c in (cpus or {}).items()}
        tag = os.getpid() % 100000
        self._tag = f"at{tag}"  # (interface names are at most 15 characters)
        self._subnet = f"10.{100 + tag % 150}.{tag // 150 % 250}"
        self.bridge = f"{self._tag}br"
        self.bridge_address = f"{self._subnet}.254"
        self._made: list[tuple[str, str]] = []  # ("netns" | "link", name), in the order made

    def namespace(self, host: str) -> str:
        return f"{self._tag}-{self.names.index(host)}"

    def interface(self, host: str) -> str:
        """The host's end of its veth pair, inside its namespace (what gloo binds to)."""
        return f"{self._tag}h{self.names.index(host)}"

    def address(self, host: str) -> str:
        return f"{self._subnet}.{self.names.index(host) + 1}"

    def prefix(self, host: str) -> list[str]:
        """The command prefix that runs a program in the host's namespace (on its CPUs, where it has its own)."""
        pin = ["taskset", "-c", ",".join(map(str, self.cpus[host]))] if host in self.cpus else []
        return ["ip", "netns", "exec", self.namespace(host), *pin]

    def env(self, host: str) -> dict[str, str]:
        """What a worker on `host` needs in its environment: gloo on the host's interface."""
        return {"GLOO_SOCKET_IFNAME": self.interface(host)}

    def __enter__(self) -> Hosts:
        try:
            rate = f"{self.rate_mbit:g}mbit"
            _run("ip", "link", "add", "name", self.bridge, "type", "bridge")
            self._made.append(("link", self.bridge))
            _run("ip", "addr", "add", f"{self.bridge_address}/24", "dev", self.bridge)
            _run("ip", "link", "set", self.bridge, "up")
            for i, host in enumerate(self.names):
                ns, inside, outside = self.namespace(host), self.interface(host), f"{self._tag}b{i}"
                _run("ip", "netns", "add", ns)
                self._made.append(("netns", ns))
                _run("ip", "link", "add", inside, "type", "veth", "peer", "name", outside)
                self._made.append(("link", outside))  # (deleting one end deletes the pair)
                _run("ip", "link", "set", inside, "netns", ns)
                _run("ip", "link", "set", outside, "master", self.bridge)
                _run("ip", "link", "set", outside, "up")
                _run("ip", "-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", inside)
                _run("ip", "-n", ns, "link", "set", inside, "up")
                _run("ip", "-n", ns, "link", "set", "lo", "up")
                # both directions: what leaves the host, and what the bridge sends into it
                _run("tc", "-n", ns, "qdisc", "add", "dev", inside, "root", "tbf", "rate", rate, "burst", "256kb",
                     "latency", "50ms")
                _run("tc", "qdisc", "add", "dev", outside, "root", "tbf", "rate", rate, "burst", "256kb",
                     "latency", "50ms")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for kind, name in reversed(self._made):
            cmd = ["ip", "netns", "del", name] if kind == "netns" else ["ip", "link", "del", name]
            subprocess.run(cmd, capture_output=True, timeout=30)  # (gone already with its namespace: fine)
        self._made.clear()
