"""Hosts on one machine, for tests and the bench: each a network namespace
whose processes each get a private PID and mount namespace (their own
``/proc`` view and a tmpfs ``/dev/shm``), all joined by veth pairs through a
bridge that lives in a namespace of its own.

A *sealed* fabric (``make(..., sealed=True)``, what the conformance suite
makes) shares nothing else a transport could use to reach another host:
each process started on a host also gets its own ``/tmp``, ``/var/tmp``,
``/run`` (empty tmpfs: only the software this process runs from, where it
lies under one of them, is bound in read-only), its host's hostname (a UTS
namespace) and its host's boot id (``/proc/sys/kernel/random/boot_id``),
and ``/etc/hosts`` naming its host. Only the network joins the hosts;
:meth:`Host.traffic` counts what crossed each host's link.

Nothing is added to the caller's network namespace: the bridge, the links
and the addresses (one /24 drawn from 10.64.0.0/10 per run) exist only in
the namespaces made here. Names carry this process's pid and a random tag,
so two runs at once never clash, and a run that died without cleaning up
is swept by the next one (its pid is gone). Everything is torn down on a
normal exit, on an exception, on SIGINT and on SIGTERM.

A partition is a host's bridge port set down (a pulled cable: the host
keeps its address and routes, its packets go nowhere), healed by setting it
up. A slow host sends through a tc token bucket (``Host.slow``). A lost host is its port down first, then every process in its network
namespace killed with SIGKILL by pid, so no FIN or RST reaches anyone (pid 1
of a PID namespace ignores SIGTERM from outside).

Needs root, iproute2 and util-linux ``unshare``; :class:`HostsUnavailable`
says why not in one line.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import ipaddress
import json
import os
import random
import re
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import types
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import zmq

#: Every namespace this module makes starts with it: ``kvh-<pid>-<tag>-<role>``.
PREFIX = "kvh-"
#: Each host's interface, the same name in every host (UCX_NET_DEVICES).
IFACE = "kvnet0"
_NAME = re.compile(rf"^{PREFIX}(\d+)-([0-9a-f]+)-")


class HostsUnavailable(RuntimeError):
    """Why no hosts can be made here (one line)."""


def ip(*args: str) -> str:
    # In a session of its own: a Ctrl-C at the terminal goes to the caller's
    # process group, and an `ip netns del` killed by it left a namespace behind.
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10, start_new_session=True)
    if done.returncode != 0:
        raise subprocess.CalledProcessError(done.returncode, ["ip", *args], done.stdout, done.stderr)
    return done.stdout


def unavailable() -> str:
    """Why hosts cannot be made here, or "" if they can."""
    if os.geteuid() != 0:
        return "hosts (network, PID and mount namespaces) need root"
    for tool in ("ip", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"hosts need `{tool}` on PATH"
    return ""


_CLONE_NEWNET = 0x40000000


def _setns(fd: int) -> None:
    """setns(2) into the network namespace ``fd`` (the calling thread only)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


_CLONE_NEWNS = 0x00020000
_CLONE_NEWUTS = 0x04000000
_MS_BIND = 4096
_MS_REC = 0x4000
_MS_SLAVE = 1 << 19
_MNT_DETACH = 2


def _libc_call(name: str, *args: Any) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if getattr(libc, name)(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}: {os.strerror(err)}")


def _mount(source: bytes, target: bytes, fstype: bytes | None, flags: int) -> None:
    _libc_call("mount", source, target, fstype, ctypes.c_ulong(flags), None)


def _netns_inode(name: str) -> int:
    return os.stat(f"/run/netns/{name}").st_ino


def processes_in(netns: str) -> list[int]:
    """Processes (not the caller) whose network namespace is ``netns``."""
    try:
        inode = _netns_inode(netns)
    except OSError:
        return []
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            if os.stat(f"/proc/{entry}/ns/net").st_ino == inode:
                found.append(int(entry))
        except OSError:
            continue
    return found


def kill_all_in(netns: str, timeout: float = 5.0) -> None:
    """SIGKILL every process in ``netns`` by pid, and wait until none is left."""
    deadline = time.monotonic() + timeout
    while True:
        pids = processes_in(netns)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {pids} in {netns} survived SIGKILL")
        time.sleep(0.01)


def _delete(netns: str) -> None:
    with contextlib.suppress(Exception):
        kill_all_in(netns)
    subprocess.run(["ip", "netns", "del", netns], capture_output=True, timeout=10, start_new_session=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> list[str]:
    """Delete namespaces a dead run of this module left behind (its pid is gone)."""
    try:
        listed = ip("netns", "list")
    except (OSError, subprocess.SubprocessError):
        return []
    swept = []
    for line in listed.splitlines():
        name = line.split()[0] if line.split() else ""
        m = _NAME.match(name)
        if m and not _alive(int(m.group(1))):
            _delete(name)
            swept.append(name)
    return swept


def _descendants(root: int) -> list[int]:
    """``root``'s descendants, parents before children."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
            ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop(0)
        for child in sorted(children.get(pid, [])):
            out.append(child)
            todo.append(child)
    return out


def tcp_ends_of(pid: int) -> set[tuple[str, int]]:
    """The (address, port) of every TCP socket process ``pid`` holds, read
    in its own network (``/proc/PID/net``): what the other end of each of
    its connections sees as the remote end."""
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(int(target[8:-1]))
    ends = set()
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if int(fields[9]) in inodes:
                ends.add(_endpoint(fields[1]))
    return ends


def _endpoint(field: str) -> tuple[str, int]:
    hex_ip, hex_port = field.split(":")
    if len(hex_ip) == 8:
        raw = struct.pack("<I", int(hex_ip, 16))
        return str(ipaddress.IPv4Address(raw)), int(hex_port, 16)
    raw = b"".join(struct.pack("<I", int(hex_ip[i : i + 8], 16)) for i in range(0, 32, 8))
    ip6 = ipaddress.IPv6Address(raw)
    return str(ip6.ipv4_mapped or ip6), int(hex_port, 16)


@attrs.frozen
class TcpQueue:
    """One TCP socket of a host towards an address, as its kernel holds it."""

    local: tuple[str, int]
    remote: tuple[str, int]
    state: int  #: /proc/net/tcp's state (1 ESTABLISHED, 4 FIN_WAIT1, ...)
    unsent: int  #: bytes queued to send, not yet acknowledged (tx_queue)
    #: Whether a process still holds it (0 inode: closed, the kernel's alone).
    owned: bool


def tcp_queues_to(host: Host, address: str) -> list[TcpQueue]:
    """``host``'s TCP sockets whose remote end is ``address`` (read in its
    network namespace): what its kernel will still send there, whether or
    not a process still holds the socket."""
    out = subprocess.run(
        ["ip", "netns", "exec", host.netns, "cat", "/proc/net/tcp", "/proc/net/tcp6"],
        capture_output=True,
        text=True,
        timeout=10,
    ).stdout
    found = []
    for line in out.splitlines():
        fields = line.split()
        if len(fields) < 10 or fields[0] == "sl":
            continue
        remote = _endpoint(fields[2])
        if remote[0] != address:
            continue
        tx, _ = fields[4].split(":")
        found.append(
            TcpQueue(_endpoint(fields[1]), remote, int(fields[3], 16), int(tx, 16), fields[9] != "0")
        )
    return found


def ns_pid(pid: int) -> list[int]:
    """``pid`` in each PID namespace it is in, outermost first (``NSpid``)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("NSpid:"):
                return [int(x) for x in line.split()[1:]]
    return [pid]


#: What a sealed host's processes get fresh and empty (tmpfs), in this order.
PRIVATE = ("/dev/shm", "/tmp", "/var/tmp", "/run")


def _kept_paths() -> list[str]:
    """The folders under :data:`PRIVATE` that a process started from this
    one runs from (its interpreter, its ``sys.path`` and ``PYTHONPATH``, its
    working directory): a sealed host binds them in read-only, as another
    machine would have the same software installed."""
    candidates = [
        sys.prefix,
        sys.base_prefix,
        sys.exec_prefix,
        os.path.dirname(os.path.realpath(sys.executable)),
    ]
    candidates += [p for p in sys.path if p]
    candidates += [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    with contextlib.suppress(OSError):
        candidates.append(os.getcwd())
    found: set[str] = set()
    for path in candidates:
        real = os.path.realpath(path)
        if not os.path.isdir(real):
            continue
        for root in PRIVATE:
            if real == root or real.startswith(root + "/"):
                found.add(real)
    # Only the outermost of nested folders.
    return sorted(p for p in found if not any(p != q and p.startswith(q + "/") for q in found))


def _sealing_script(host: Host) -> str:
    """The shell (pid 1 of the command's PID namespace) that seals its mount
    and UTS namespaces, then runs the command (``"$0" "$@"``)."""
    keep = _kept_paths()
    lines = ["set -e", "mount -t tmpfs kvh-shm /dev/shm", "mkdir /dev/shm/.kvh-keep"]
    # Bound aside first: the tmpfs mounted over a folder hides what it kept.
    for i, path in enumerate(keep):
        lines.append(
            f"mkdir /dev/shm/.kvh-keep/{i} && mount --bind -o ro {shlex.quote(path)} /dev/shm/.kvh-keep/{i}"
        )
    for root in PRIVATE[1:]:
        lines.append(f"mount -t tmpfs kvh-{root.strip('/').replace('/', '-')} {root}")
    for i, path in enumerate(keep):
        lines.append(
            f"mkdir -p {shlex.quote(path)} && mount --move /dev/shm/.kvh-keep/{i} {shlex.quote(path)}"
        )
    lines.append("rmdir /dev/shm/.kvh-keep/* 2>/dev/null || true; rmdir /dev/shm/.kvh-keep")
    hosts_file = f"127.0.0.1 localhost\n{host.ip} {host.hostname}\n"
    lines += [
        f"echo {shlex.quote(host.hostname)} > /proc/sys/kernel/hostname",
        f"echo {shlex.quote(host.boot_id)} > /run/kvh-boot_id",
        "mount --bind -o ro /run/kvh-boot_id /proc/sys/kernel/random/boot_id",
        f"printf {shlex.quote(hosts_file)} > /run/kvh-hosts",
        "mount --bind -o ro /run/kvh-hosts /etc/hosts",
        # The working directory again, through the new mounts (the old one
        # would still reach this machine's folder).
        f"cd {shlex.quote(os.getcwd())} 2>/dev/null || cd /",
        "set +e",
        '"$0" "$@"',
    ]
    return "\n".join(lines)


@attrs.define(eq=False)
class Host:
    """One host: run a command in it with :meth:`prefix` or :meth:`popen`."""

    name: str  #: its role in the fabric ("decode", "prefill0", ...)
    netns: str  #: its network namespace (``ip netns exec NETNS``)
    ip: str  #: its address, on :attr:`iface`
    iface: str  #: its interface (the same name on every host)
    port: str  #: its veth end on the bridge, in the switch namespace
    fabric: Fabric = attrs.field(repr=False)
    #: Its hostname and boot id (what its processes see, in a sealed fabric).
    hostname: str = ""
    boot_id: str = attrs.Factory(lambda: str(uuid.uuid4()))

    def prefix(self, isolated: bool = True) -> list[str]:
        """A command prefix that runs in this host. ``isolated``: in a PID and
        mount namespace of its own (its own ``/proc``, a tmpfs ``/dev/shm``;
        in a sealed fabric also its own ``/tmp``, ``/var/tmp``, ``/run``,
        hostname and boot id: see the module); the command runs as pid 2
        under a shell that is pid 1, so that it can stop itself and take
        signals as any process does (pid 1 ignores what it has no handler
        for). ``isolated=False``: the network only."""
        base = ["ip", "netns", "exec", self.netns]
        if not isolated:
            return base
        unshare = ["unshare", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc"]
        if self.fabric is not None and self.fabric.sealed:
            return [*base, *unshare, "--uts", "sh", "-c", _sealing_script(self)]
        return [*base, *unshare, "sh", "-c", 'mount -t tmpfs kvh-shm /dev/shm && "$0" "$@"']

    def traffic(self) -> tuple[int, int]:
        """Bytes (received, sent) on this host's interface so far: what
        crossed its link, whatever the processes on it did."""
        out = ip("-j", "-s", "-n", self.netns, "link", "show", "dev", self.iface)
        stats = json.loads(out)[0]["stats64"]
        return int(stats["rx"]["bytes"]), int(stats["tx"]["bytes"])

    def popen(self, argv: Sequence[str], isolated: bool = True, **kwargs: Any) -> subprocess.Popen[Any]:
        return subprocess.Popen([*self.prefix(isolated), *argv], **kwargs)

    def run(self, argv: Sequence[str], isolated: bool = True, timeout: float = 30) -> str:
        done = subprocess.run(
            [*self.prefix(isolated), *argv], capture_output=True, text=True, timeout=timeout, check=True
        )
        return done.stdout

    def processes(self) -> list[int]:
        return processes_in(self.netns)

    def cut(self) -> None:
        """Partition this host from every other one."""
        ip("-n", self.fabric.switch, "link", "set", self.port, "down")

    def heal(self) -> None:
        ip("-n", self.fabric.switch, "link", "set", self.port, "up")

    def slow(self, rate: str = "2mbit") -> None:
        """Limit what this host sends to ``rate`` (a tc token bucket on its
        interface; tc's units, e.g. "2mbit"): a write from it then takes long
        enough to be cut, frozen or aborted mid-way. :meth:`unslow` undoes it."""
        if shutil.which("tc") is None:
            raise HostsUnavailable("slowing a host needs `tc` (iproute2) on PATH")
        qdisc = ["qdisc", "replace", "dev", self.iface, "root", "tbf", "rate", rate]
        _tc(self.netns, *qdisc, "burst", "16kb", "latency", "2s")

    def unslow(self) -> None:
        _tc(self.netns, "qdisc", "del", "dev", self.iface, "root")

    def lose(self) -> None:
        """The host is gone: its link down first, then all its processes killed."""
        self.cut()
        kill_all_in(self.netns)

    @contextlib.contextmanager
    def entered(self) -> Iterator[None]:
        """Run the calling thread in this host's network namespace (threads it
        starts meanwhile stay there); its PID and mount namespaces stay the
        caller's. Sockets made meanwhile belong to the host's network, and
        so does pyzmq's ``Context.instance()`` made meanwhile: libzmq opens a
        connection on its I/O threads, which must be in the host's network
        too (the instance of before is back afterwards). One thread at a time."""
        with _entered_lock:
            here = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
            there = os.open(f"/run/netns/{self.netns}", os.O_RDONLY)
            saved = zmq.Context._instance
            try:
                _setns(there)
                zmq.Context._instance = None
                try:
                    yield
                finally:
                    zmq.Context._instance = saved
                    _setns(here)
            finally:
                os.close(here)
                os.close(there)

    def enter_for_good(self) -> None:
        """Make the calling process this host for the rest of its life: its
        network, a mount namespace of its own with this network's ``/sys``
        (where UCX looks for interfaces) and a tmpfs ``/dev/shm``. Call it
        before the process starts any thread (a mount namespace cannot be
        left by one thread alone), so that every thread it starts is here.
        Its PID namespace stays the caller's (a test process still sees and
        signals the processes it started)."""
        if threading.active_count() > 1:
            raise RuntimeError("enter_for_good: the process already runs other threads")
        there = os.open(f"/run/netns/{self.netns}", os.O_RDONLY)
        try:
            _setns(there)
        finally:
            os.close(there)
        _libc_call("unshare", _CLONE_NEWNS)
        _mount(b"none", b"/", None, _MS_REC | _MS_SLAVE)
        _libc_call("umount2", b"/sys", _MNT_DETACH)
        _mount(self.netns.encode(), b"/sys", b"sysfs", 0)
        _mount(b"kvh-shm", b"/dev/shm", b"tmpfs", 0)
        if self.fabric is not None and self.fabric.sealed:
            # Its hostname and boot id; /tmp and /run stay this machine's (it
            # runs `ip netns` for the other hosts).
            _libc_call("unshare", _CLONE_NEWUTS)
            with open("/proc/sys/kernel/hostname", "w") as f:
                f.write(self.hostname)
            with open("/dev/shm/.kvh-boot_id", "w") as f:
                f.write(self.boot_id + "\n")
            _mount(b"/dev/shm/.kvh-boot_id", b"/proc/sys/kernel/random/boot_id", None, _MS_BIND)
            os.unlink("/dev/shm/.kvh-boot_id")

    def main_pid(self, proc: subprocess.Popen[Any], timeout: float = 10.0) -> int:
        """The pid (as this process sees it) of the command that ``proc``
        started with the isolated :meth:`prefix`: the child of its PID
        namespace's pid 1 (the shell) that runs ``proc``'s command."""
        argv = proc.args if isinstance(proc.args, list) else []
        command = str(argv[len(self.prefix())]) if len(argv) > len(self.prefix()) else ""
        deadline = time.monotonic() + timeout
        while True:
            for pid in _descendants(proc.pid):
                with contextlib.suppress(OSError, ValueError):
                    nested = ns_pid(pid)
                    if len(nested) > 1 and nested[-1] != 1 and _cmdline(pid)[:1] == [command]:
                        return pid
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: the command of pid {proc.pid} did not start in its host")
            time.sleep(0.005)


def _tc(netns: str, *args: str) -> None:
    done = subprocess.run(
        ["ip", "netns", "exec", netns, "tc", *args], capture_output=True, text=True, timeout=10
    )
    if done.returncode != 0:
        raise subprocess.CalledProcessError(done.returncode, ["tc", *args], done.stdout, done.stderr)


def _cmdline(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]


@attrs.define(eq=False)
class Fabric:
    """Hosts on one bridge; :meth:`close` (or leaving :func:`hosts`) removes all."""

    tag: str
    switch: str  #: the namespace holding the bridge
    subnet: str  #: e.g. "10.77.3" (hosts are .1, .2, ...)
    #: Its hosts share nothing but the network (see the module).
    sealed: bool = False
    hosts: dict[str, Host] = attrs.Factory(dict)
    _made: list[str] = attrs.Factory(list)
    _closed: bool = False

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def namespaces(self) -> list[str]:
        return list(self._made)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        _live.discard(self)
        for name in reversed(self._made):
            _delete(name)


_live: set[Fabric] = set()
_entered_lock = threading.Lock()
_handlers_lock = threading.Lock()
_previous: dict[int, Any] = {}


#: Held while a signal's handler tears the hosts down.
_tearing_down = threading.Lock()


def _on_signal(signum: int, frame: types.FrameType | None) -> None:
    # A second signal runs this handler again inside the first, at any line
    # of its teardown: it would cut the teardown short (namespaces left
    # behind). The first one decides what follows; later ones are ignored.
    if not _tearing_down.acquire(blocking=False):
        return
    try:
        for fabric in list(_live):
            fabric.close()
    finally:
        _tearing_down.release()
    previous = _previous.get(signum)
    if callable(previous):
        previous(signum, frame)
        return
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    # SIGTERM's own default: die of it, now that nothing is left behind.
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _install_handlers() -> None:
    """Tear down on SIGINT and SIGTERM too (only the main thread may set them;
    elsewhere the next run's :func:`sweep_stale` removes what is left)."""
    if threading.current_thread() is not threading.main_thread():
        return
    with _handlers_lock:
        for sig in (signal.SIGINT, signal.SIGTERM):
            current = signal.getsignal(sig)
            if current is _on_signal:
                continue
            _previous[sig] = current if current not in (signal.SIG_DFL, signal.SIG_IGN, None) else None
            signal.signal(sig, _on_signal)


@atexit.register
def _close_all() -> None:
    for fabric in list(_live):
        fabric.close()


def _pick_subnet(rng: random.Random) -> str:
    return f"10.{rng.randrange(64, 128)}.{rng.randrange(0, 256)}"


def make(names: Sequence[str] = ("decode", "prefill0", "prefill1"), sealed: bool = False) -> Fabric:
    """Make the hosts ``names`` (at least two) on one bridge; close the
    returned :class:`Fabric` when done (or use :func:`hosts`). ``sealed``:
    they share nothing but the network (see the module)."""
    why = unavailable()
    if why:
        raise HostsUnavailable(why)
    if len(names) < 2 or len(set(names)) != len(names) or len(names) > 250:
        raise ValueError(f"hosts wants 2 to 250 distinct names, got {list(names)}")
    sweep_stale()
    tag = uuid.uuid4().hex[:6]
    rng = random.Random(uuid.uuid4().int)
    fabric = Fabric(tag, f"{PREFIX}{os.getpid()}-{tag}-sw", _pick_subnet(rng), sealed)
    _install_handlers()
    _live.add(fabric)
    try:
        try:
            ip("netns", "add", fabric.switch)
        except subprocess.CalledProcessError as exc:
            raise HostsUnavailable(f"cannot create a network namespace here: {exc.stderr.strip()}") from None
        fabric._made.append(fabric.switch)
        sw = ["-n", fabric.switch]
        ip(*sw, "link", "add", "br0", "type", "bridge")
        ip(*sw, "link", "set", "br0", "up")
        for i, name in enumerate(names):
            netns = f"{PREFIX}{os.getpid()}-{tag}-h{i}"
            ip("netns", "add", netns)
            fabric._made.append(netns)
            port = f"p{i}"
            ip(
                "link",
                "add",
                IFACE,
                "netns",
                netns,
                "type",
                "veth",
                "peer",
                "name",
                port,
                "netns",
                fabric.switch,
            )
            ip(*sw, "link", "set", port, "master", "br0")
            ip(*sw, "link", "set", port, "up")
            address = f"{fabric.subnet}.{i + 1}"
            ip("-n", netns, "addr", "add", f"{address}/24", "dev", IFACE)
            ip("-n", netns, "link", "set", IFACE, "up")
            ip("-n", netns, "link", "set", "lo", "up")
            fabric.hosts[name] = Host(name, netns, address, IFACE, port, fabric, f"kvh-{tag}-{name}")
    except BaseException:
        fabric.close()
        raise
    return fabric


@contextlib.contextmanager
def hosts(
    names: Sequence[str] = ("decode", "prefill0", "prefill1"), sealed: bool = False
) -> Iterator[Fabric]:
    """:func:`make`, removed after."""
    fabric = make(names, sealed)
    try:
        yield fabric
    finally:
        fabric.close()


def skip_unless_available(skip: Callable[[str], Any]) -> None:
    """Call ``skip`` (e.g. ``pytest.skip``) with the one-line reason hosts cannot be made here."""
    why = unavailable()
    if why:
        skip(why)


def round_trip_s(a: Host, b: Host, rounds: int = 200, timeout_s: float = 10.0) -> float:
    """The median TCP round trip of one byte from ``a`` to ``b`` over their
    link (what a control message pays at least, crossing hosts), measured
    with sockets made in each host's network from this process. OSError
    when ``b`` cannot be reached within ``timeout_s``."""
    with b.entered():
        server = socket.create_server((b.ip, 0))
    server.settimeout(timeout_s)

    def echo() -> None:
        with contextlib.suppress(OSError):
            conn, _ = server.accept()
            with conn:
                while data := conn.recv(1):
                    conn.sendall(data)

    thread = threading.Thread(target=echo, daemon=True, name="kvh-echo")
    times = []
    with server:
        thread.start()
        with a.entered():
            client = socket.create_connection((b.ip, server.getsockname()[1]), timeout=timeout_s)
        with client:
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for _ in range(rounds):
                t0 = time.perf_counter()
                client.sendall(b"x")
                client.recv(1)
                times.append(time.perf_counter() - t0)
    thread.join(timeout=timeout_s)
    return sorted(times)[len(times) // 2]
