"""A network namespace joined to this one by a veth pair, for partitions.

Addresses come from 10.213.7.0/24, a /30 per pair (pairs that exist at once
need different ``index`` values), used only on the pair. Needs root
and iproute2; :class:`NetnsUnavailable` says why when it cannot be built.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator

import attrs


class NetnsUnavailable(RuntimeError):
    """Why no namespace could be built here."""


@attrs.frozen
class VethPair:
    namespace: str  #: run the far side with ``ip netns exec NAMESPACE``
    host_link: str  #: this side's end: down is a partition, up heals it
    host_ip: str  #: this side's address
    far_ip: str  #: the namespace's address

    def cut(self) -> None:
        ip("link", "set", self.host_link, "down")

    def heal(self) -> None:
        ip("link", "set", self.host_link, "up")


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@contextlib.contextmanager
def veth_pair(index: int = 0) -> Iterator[VethPair]:
    """A namespace and a veth pair into it, both removed after."""
    if not 0 <= index < 64:
        raise ValueError(f"veth pair index {index} outside [0, 64)")
    host_ip, far_ip = f"10.213.7.{4 * index + 1}", f"10.213.7.{4 * index + 2}"
    if os.geteuid() != 0 or shutil.which("ip") is None:
        raise NetnsUnavailable("network namespaces need root and iproute2")
    tag = uuid.uuid4().hex[:6]
    ns, host_if, ns_if = f"kvconn-p-{tag}", f"kvd{tag}", f"kvp{tag}"
    try:
        ip("netns", "add", ns)
    except subprocess.CalledProcessError as exc:
        raise NetnsUnavailable(f"cannot create a network namespace here: {exc.stderr!r}") from exc
    try:
        ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        ip("link", "set", ns_if, "netns", ns)
        ip("addr", "add", f"{host_ip}/30", "dev", host_if)
        ip("link", "set", host_if, "up")
        ip("netns", "exec", ns, "ip", "addr", "add", f"{far_ip}/30", "dev", ns_if)
        ip("netns", "exec", ns, "ip", "link", "set", ns_if, "up")
        ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
        yield VethPair(ns, host_if, host_ip, far_ip)
    finally:
        subprocess.run(["ip", "link", "del", host_if], capture_output=True, timeout=10)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
