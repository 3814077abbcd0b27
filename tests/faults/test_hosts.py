"""The hosts harness (kvconn.testing.hosts): hosts that reach each other only
through the bridge, a partition that blocks traffic, a host loss that kills
every process in it, names unique per run, and nothing left behind after an
exception, SIGINT, SIGTERM or a SIGKILLed run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import pytest

from kvconn.testing import hosts
from kvconn.testing.hosts import Fabric, Host

pytestmark = pytest.mark.skipif(bool(hosts.unavailable()), reason=hosts.unavailable() or "n/a")

#: A TCP echo of one line, bound to the host's address; prints its port.
SERVER = textwrap.dedent(
    """
    import socket, sys
    s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen(8)
    print(s.getsockname()[1], flush=True)
    while True:
        c, _ = s.accept(); c.sendall(c.recv(64)); c.close()
    """
)
CLIENT = textwrap.dedent(
    """
    import socket, sys
    try:
        c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3]))
        c.sendall(b"ping"); print(c.recv(64).decode())
    except OSError as exc:
        print(type(exc).__name__)
    """
)


def namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


@pytest.fixture
def fabric() -> Iterator[Fabric]:
    with hosts.hosts(("decode", "prefill0", "prefill1")) as made:
        yield made


def serve(host: Host) -> tuple[subprocess.Popen[str], int]:
    proc = host.popen([sys.executable, "-c", SERVER, host.ip], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def reach(src: Host, dst: Host, port: int, timeout: float = 2.0) -> str:
    return src.run([sys.executable, "-c", CLIENT, dst.ip, str(port), str(timeout)]).strip()


def test_three_hosts_reach_each_other_through_the_bridge(fabric: Fabric) -> None:
    servers = {name: serve(h) for name, h in fabric.hosts.items()}
    try:
        for src in fabric.hosts.values():
            for name, dst in fabric.hosts.items():
                if dst is not src:
                    assert reach(src, dst, servers[name][1]) == "ping", (src.name, name)
        # The addresses exist in the hosts only: this process's network has none of them.
        mine = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, check=True).stdout
        assert not any(h.ip in mine for h in fabric.hosts.values())
    finally:
        for proc, _ in servers.values():
            proc.kill()


def test_a_process_in_a_host_sees_its_own_proc_and_shm(fabric: Fabric) -> None:
    probe = (
        "import os, json; print(json.dumps([os.getpid(), [p for p in os.listdir('/proc') if p.isdigit()]]))"
    )
    open("/dev/shm/kvh-test-marker", "w").close()
    try:
        pid, pids = json.loads(fabric["prefill0"].run([sys.executable, "-c", probe]))
        shm = fabric["prefill0"].run(["ls", "-A", "/dev/shm"]).split()
    finally:
        os.unlink("/dev/shm/kvh-test-marker")
    assert pid < 10 and len(pids) < 10  # its shell (pid 1), itself, nothing of this host
    assert shm == []  # not this machine's /dev/shm


def test_partition_blocks_traffic_and_heal_restores_it(fabric: Fabric) -> None:
    proc, port = serve(fabric["decode"])
    try:
        fabric["prefill0"].cut()
        assert reach(fabric["prefill0"], fabric["decode"], port, 1.0) in ("TimeoutError", "timeout")
        assert reach(fabric["prefill1"], fabric["decode"], port) == "ping"  # the others are not cut
        fabric["prefill0"].heal()
        assert reach(fabric["prefill0"], fabric["decode"], port) == "ping"
    finally:
        proc.kill()


#: Sends 256 KiB to a host's sink and prints the seconds until the sink had them all.
SEND = textwrap.dedent(
    """
    import socket, sys, time
    c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
    t0 = time.monotonic(); c.sendall(bytes(256 << 10)); c.shutdown(socket.SHUT_WR)
    c.recv(1); print(time.monotonic() - t0)
    """
)
SINK = textwrap.dedent(
    """
    import socket, sys
    s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen(8)
    print(s.getsockname()[1], flush=True)
    while True:
        c, _ = s.accept()
        while c.recv(1 << 16): pass
        c.sendall(b"k"); c.close()
    """
)


def test_a_slow_host_sends_at_its_rate_until_unslowed(fabric: Fabric) -> None:
    sink = fabric["decode"].popen(
        [sys.executable, "-c", SINK, fabric["decode"].ip], stdout=subprocess.PIPE, text=True
    )
    try:
        assert sink.stdout is not None
        port = sink.stdout.readline().strip()
        sender = fabric["prefill0"]
        sender.slow("2mbit")  # 256 KiB at 250 KB/s: about 1 s
        slow = float(sender.run([sys.executable, "-c", SEND, fabric["decode"].ip, port]))
        sender.unslow()
        fast = float(sender.run([sys.executable, "-c", SEND, fabric["decode"].ip, port]))
        assert slow > 0.7, slow
        assert fast < slow / 3, (fast, slow)
    finally:
        sink.kill()


def test_host_loss_kills_every_process_in_it(fabric: Fabric) -> None:
    lost = fabric["prefill1"]
    tree = lost.popen(["sh", "-c", "sleep 60 & sleep 60 & wait"])
    server, port = serve(fabric["prefill0"])
    try:
        main = lost.main_pid(tree)
        deadline = time.monotonic() + 5
        while len(lost.processes()) < 5 and time.monotonic() < deadline:  # ip/unshare, sh, sh, 2 sleeps
            time.sleep(0.01)
        assert main in lost.processes() and len(lost.processes()) >= 5
        # Pid 1 of the host's PID namespace ignores SIGTERM from outside:
        # what `lose` must not rely on.
        lost.lose()
        assert lost.processes() == []
        assert tree.wait(5) == -signal.SIGKILL
        # The link went down first, and stays down: the host is unreachable.
        assert reach(fabric["prefill0"], lost, 9, 1.0) in ("TimeoutError", "timeout")
        assert reach(fabric["decode"], fabric["prefill0"], port) == "ping"
    finally:
        server.kill()


def test_round_trip_crosses_the_link(fabric: Fabric) -> None:
    rtt = hosts.round_trip_s(fabric["decode"], fabric["prefill0"], rounds=50)
    assert 0 < rtt < 0.5
    fabric["prefill0"].cut()  # no route across a cut link: the connect gives up
    try:
        with pytest.raises(OSError):
            hosts.round_trip_s(fabric["decode"], fabric["prefill0"], rounds=1, timeout_s=1.0)
    finally:
        fabric["prefill0"].heal()


def test_two_fabrics_at_once_never_clash() -> None:
    with hosts.hosts(("a", "b")) as one, hosts.hosts(("a", "b")) as two:
        assert not set(one.namespaces()) & set(two.namespaces())
        servers = [serve(f["a"]) for f in (one, two)]
        try:
            for f, (_, port) in zip((one, two), servers, strict=True):
                assert reach(f["b"], f["a"], port) == "ping"
        finally:
            for proc, _ in servers:
                proc.kill()
    assert not (set(one.namespaces()) | set(two.namespaces())) & namespaces()


def test_an_exception_tears_everything_down() -> None:
    with pytest.raises(RuntimeError, match="boom"), hosts.hosts(("a", "b")) as made:
        made_names = made.namespaces()
        made["a"].popen(["sleep", "60"])
        raise RuntimeError("boom")
    assert not set(made_names) & namespaces()


MAKER = textwrap.dedent(
    """
    import json, sys, time
    from kvconn.testing import hosts
    fabric = hosts.make(("decode", "prefill0", "prefill1"))
    proc = fabric["prefill0"].popen(["sleep", "60"])
    print(json.dumps({"names": fabric.namespaces(), "pid": fabric["prefill0"].main_pid(proc)}), flush=True)
    time.sleep(60)
    """
)


def _maker() -> tuple[subprocess.Popen[str], dict[str, object]]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen([sys.executable, "-c", MAKER], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    made: dict[str, object] = json.loads(proc.stdout.readline())
    return proc, made


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signalled_run_tears_everything_down(sig: signal.Signals) -> None:
    proc, made = _maker()
    names = set(made["names"])  # type: ignore[arg-type]
    assert names <= namespaces()
    proc.send_signal(sig)
    proc.wait(20)
    assert not names & namespaces()
    assert not os.path.exists(f"/proc/{made['pid']}")


def test_a_killed_run_is_swept_by_the_next() -> None:
    proc, made = _maker()
    names = set(made["names"])  # type: ignore[arg-type]
    proc.kill()  # no handler runs: the namespaces stay, with the sleep in one
    proc.wait(10)
    assert names <= namespaces()
    assert set(hosts.sweep_stale()) >= names
    assert not names & namespaces()
    assert not os.path.exists(f"/proc/{made['pid']}")


def test_without_root_it_says_why_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    why = hosts.unavailable()
    assert why and "root" in why and "\n" not in why
    with pytest.raises(hosts.HostsUnavailable, match="root"):
        hosts.make()


#: What a process sees of its host: files it leaves under the folders a
#: sealed host gives it, and what it finds there of the other host's.
LOOK = textwrap.dedent(
    """
    import json, os, socket, sys
    mark = sys.argv[1]
    for folder in ("/tmp", "/var/tmp", "/run", "/dev/shm"):
        with open(os.path.join(folder, "kvh-mark-" + mark), "w") as f:
            f.write(mark)
    seen = sorted(
        name for folder in ("/tmp", "/var/tmp", "/run", "/dev/shm")
        for name in os.listdir(folder) if name.startswith("kvh-mark-")
    )
    boot = open("/proc/sys/kernel/random/boot_id").read().strip()
    print(json.dumps({"host": socket.gethostname(), "boot": boot, "seen": seen,
                      "me": socket.gethostbyname(socket.gethostname())}))
    """
)


def test_sealed_hosts_share_nothing_but_the_network() -> None:
    """Two processes on two sealed hosts, and a second on the first: each
    sees only its own files under /tmp, /var/tmp, /run and /dev/shm (none
    of this machine's: they are not there after), its host's hostname,
    address and boot id, never this machine's; the bytes one sends the
    other are counted on both links."""
    with hosts.hosts(("a", "b"), sealed=True) as fabric:
        looks = {
            (name, mark): json.loads(fabric[name].run([sys.executable, "-c", LOOK, mark]))
            for name, mark in (("a", "1"), ("b", "2"), ("a", "3"))
        }
        for (name, mark), look in looks.items():
            assert look["seen"] == [f"kvh-mark-{mark}"] * 4, look  # not the other host's, nor its own earlier
            assert look["host"] == fabric[name].hostname and look["me"] == fabric[name].ip, look
            assert look["boot"] == fabric[name].boot_id, look
        assert looks[("a", "1")]["boot"] == looks[("a", "3")]["boot"] != looks[("b", "2")]["boot"]
        with open("/proc/sys/kernel/random/boot_id") as f:
            assert f.read().strip() not in {look["boot"] for look in looks.values()}
        assert not [
            p
            for p in ("/tmp", "/var/tmp", "/run", "/dev/shm")
            for n in os.listdir(p)
            if n.startswith("kvh-mark-")
        ]
        # Bytes that cross from b to a, counted on each link.
        a_rx, _ = fabric["a"].traffic()
        _, b_tx = fabric["b"].traffic()
        sink = textwrap.dedent(
            """
            import socket, sys
            s = socket.create_server((sys.argv[1], 0)); print(s.getsockname()[1], flush=True)
            c, _ = s.accept(); n = 0
            while data := c.recv(1 << 16):
                n += len(data)
            print(n, flush=True)
            """
        )
        server = fabric["a"].popen(
            [sys.executable, "-c", sink, fabric["a"].ip], stdout=subprocess.PIPE, text=True
        )
        try:
            assert server.stdout is not None
            port = server.stdout.readline().strip()
            send = f"import socket; socket.create_connection(({fabric['a'].ip!r}, {port})).sendall(bytes(1 << 20))"
            fabric["b"].run([sys.executable, "-c", send])
            assert server.stdout.readline().strip() == str(1 << 20)
        finally:
            server.kill()
            server.wait()
        assert fabric["a"].traffic()[0] - a_rx >= 1 << 20
        assert fabric["b"].traffic()[1] - b_tx >= 1 << 20
