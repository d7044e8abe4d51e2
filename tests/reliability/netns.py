"""A small network of Linux network namespaces for fault tests: one namespace per "host", veth links between
them, each link cut (``ip link set ... down``) and restored at will. Everything lives in 10.231.0.0/16 inside the
namespaces this module made, and ``Network.close`` removes them, whatever happened.

A link is cut by downing the far end only: the near side keeps its route, so its packets are silently lost (no
"network unreachable" to fail fast on), which is what a real partition looks like to it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def namespaces_unavailable() -> str | None:
    """Why namespaces cannot be made here (not root, no ``ip``, a kernel that forbids them), or None."""
    if sys.platform != "linux" or os.geteuid() != 0:
        return "network namespaces need Linux and root"
    probe = f"dsr-probe-{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except (OSError, subprocess.CalledProcessError) as exc:
        return f"the kernel or the tools forbid network namespaces here: {exc}"
    _ip("netns", "del", probe)
    return None


@dataclass
class Link:
    a: str  # namespace ("" = the test's own)
    b: str
    a_dev: str
    b_dev: str
    a_addr: str
    b_addr: str


@dataclass
class Network:
    prefix: str  # unique per run, so parallel runs never meet
    namespaces: list[str] = field(default_factory=list)
    links: dict[tuple[str, str], Link] = field(default_factory=dict)
    subnet: int = 0

    def host(self, name: str) -> str:
        ns = f"{self.prefix}-{name}"
        _ip("netns", "add", ns)
        self.namespaces.append(ns)
        _ip("-n", ns, "link", "set", "lo", "up")
        return ns

    def link(self, a: str, b: str) -> Link:
        """A veth pair between namespaces ``a`` and ``b`` ("" = ours) with its own /24 in 10.231.0.0/16."""
        self.subnet += 1
        tag = f"{os.getpid() % 100000}{self.subnet}"
        link = Link(a, b, f"va{tag}", f"vb{tag}", f"10.231.{self.subnet}.1", f"10.231.{self.subnet}.2")
        command = ["link", "add", link.a_dev] + (["netns", a] if a else []) + ["type", "veth", "peer", "name",
                                                                                 link.b_dev, "netns", b]
        _ip(*command)
        for ns, dev, addr in ((a, link.a_dev, link.a_addr), (b, link.b_dev, link.b_addr)):
            prefix = ["-n", ns] if ns else []
            _ip(*prefix, "addr", "add", f"{addr}/24", "dev", dev)
            _ip(*prefix, "link", "set", dev, "up")
        self.links[(a, b)] = link
        return link

    def set_link(self, a: str, b: str, up: bool, *, side: str) -> None:
        """Down (or up) the end of the a-b link that is in namespace ``side``."""
        link = self.links[(a, b)]
        dev = link.a_dev if side == link.a else link.b_dev
        _ip(*(["-n", side] if side else []), "link", "set", dev, "up" if up else "down")

    def close(self) -> None:
        for ns in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30, check=False)
        self.namespaces.clear()
