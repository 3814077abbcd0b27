"""Does the page owner's own teardown stop a late RDMA write? (docs/multi-host.md, "RDMA")

Over TCP every byte that lands in decode's pages is copied there by decode's
own process, so destroying decode's NIXL agent or Mooncake engine stops every
late byte (measured; kvconn's owner fence). With RDMA the writer's NIC writes
into registered memory without decode's CPU: what should stop it is the
memory region's remote key, invalid once the region is deregistered. This
driver measures that, per backend, with the owner and the writer in separate
processes and the owner's buffer kept allocated (so a late write is seen):

* ``baseline``: a 1 MiB write lands (the path works at all);
* ``deregister``: the owner deregisters its memory (agent / engine kept),
  the writer writes again with the old metadata: does the write fail at the
  writer, and do 0 bytes change?
* ``destroy``: the owner destroys its agent / engine (memory kept): the same;
* ``frozen_fence``: the writer posts 64 MiB and is SIGSTOPped 5 ms later, the
  owner destroys its agent / engine, the writer is resumed: bytes changed
  over the watch window (the owner fence's own check).

    python scripts/gpu/rdma_fence.py --transport rdma --device mlx5_0 [--json OUT]
    python scripts/gpu/rdma_fence.py --transport tcp      # the same over tcp, any host

Without an RDMA device ``--transport rdma`` refuses in one line (exit 3).
scripts/gpu/rdma_fence.sh wraps it (soft-RoCE where asked, a time limit).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MiB = 1 << 20
SMALL = 1 * MiB
BIG = 64 * MiB
CANARY = 0xA5
NO_RDMA = 3  #: exit code: no RDMA device here


def rdma_devices(sysfs: str = "/sys/class/infiniband") -> list[str]:
    try:
        return sorted(os.listdir(sysfs))
    except OSError:
        return []


def options_for(backend: str, transport: str, device: str, iface: str, host: str) -> dict[str, str]:
    """The kvconn backend options that put one endpoint on ``transport``."""
    if backend == "nixl":
        if transport == "tcp":
            return {"ucx_tls": "tcp", "net_devices": iface or "lo"}
        # UCX's verbs transports; rc needs the device's port ("mlx5_0:1").
        return {"ucx_tls": "rc,ud,self,sm", "net_devices": f"{device}:1" if ":" not in device else device}
    return {"protocol": transport, "host": host, **({"device": device} if transport == "rdma" else {})}


# -- the owner: decode's side -------------------------------------------------
class Owner:
    """A buffer registered with its own agent / engine; the buffer outlives
    every deregistration and teardown, so a late write is found."""

    def __init__(self, backend: str, options: dict[str, str], nbytes: int) -> None:
        self.backend, self.options, self.nbytes = backend, options, nbytes
        self.endpoint: Any = None
        self.reg: Any = None
        self.mem: Any
        if backend == "nixl":
            from kvconn_nixl._nixl import Options, open_memory

            self.opts = Options.parse(options)
            self.mem = open_memory(nbytes, self.opts)
        else:
            from kvconn_mooncake._memory import MemoryOptions, open_space

            self.mem = open_space(nbytes, MemoryOptions.parse(options))
        self.metadata = self.open()

    def open(self) -> bytes:
        if self.backend == "nixl":
            from kvconn_nixl._nixl import RegionInfo, make_agent, register

            self.endpoint = make_agent("rdma-owner", self.opts, progress_thread=True)
            self.reg = register(self.endpoint, self.mem, self.opts)
            return RegionInfo(
                self.endpoint.name, self.endpoint.get_agent_metadata(), self.mem.ranges(), "DRAM", 0
            ).encode()
        from kvconn_mooncake._engine import engine_settings, new_engine, pack_metadata, session_id
        from kvconn_mooncake._memory import register_space

        host, protocol, device = engine_settings(self.options)
        self.endpoint = new_engine(host, protocol, device)
        register_space(self.endpoint, self.mem)
        self.reg = True
        return pack_metadata(session_id(self.endpoint, host), self.mem.addr, self.nbytes, protocol)

    def deregister(self) -> None:
        if self.reg is None:
            return
        if self.backend == "nixl":
            self.endpoint.deregister_memory(self.reg)
        else:
            from kvconn_mooncake._memory import unregister_space

            unregister_space(self.endpoint, self.mem)
        self.reg = None

    def destroy(self) -> None:
        """The owner fence's teardown: the whole agent / engine."""
        try:
            self.deregister()
        except Exception as exc:  # the teardown deregisters anyway
            print(f"rdma_fence owner: deregister before destroy: {exc}", file=sys.stderr)
        self.endpoint = None
        gc.collect()

    def canary(self) -> None:
        self.mem.array()[:] = CANARY

    def changed(self) -> int:
        arr = self.mem.array()
        return int((arr != CANARY).sum())


def serve_owner(args: dict[str, Any]) -> None:
    from kvconn.testing.child import emit

    owner = Owner(args["backend"], dict(args["options"]), int(args["nbytes"]))
    owner.canary()
    emit({"event": "ready", "metadata": owner.metadata.hex()})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        t0 = time.monotonic()
        if op == "canary":
            owner.canary()
        elif op == "deregister":
            owner.deregister()
        elif op == "destroy":
            owner.destroy()
        elif op == "watch":  # bytes off the canary, now and until the window ends
            deadline = t0 + float(cmd["seconds"])
            first = owner.changed()
            last = first
            while time.monotonic() < deadline:
                time.sleep(0.05)
                last = owner.changed()
            emit({"event": "watched", "at_start": first, "at_end": last})
            continue
        emit({"event": "done", "op": op, "seconds": time.monotonic() - t0, "changed": owner.changed()})


# -- the writer: a prefill rank's side ----------------------------------------
def serve_writer(args: dict[str, Any]) -> None:
    from kvconn.testing.child import emit

    backend, options = args["backend"], dict(args["options"])
    if backend == "nixl":
        from kvconn_nixl.raw import RawWriter
    else:
        from kvconn_mooncake.raw import RawWriter  # type: ignore[assignment]
    writer = RawWriter(BIG, options)
    writer.array()[:] = 0x5A
    emit({"event": "ready"})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "connect":
            writer.connect("owner", bytes.fromhex(cmd["metadata"]))
            emit({"event": "connected"})
        elif cmd["op"] == "write":
            nbytes = int(cmd["nbytes"])

            def post(n: int = nbytes) -> None:
                t0 = time.monotonic()
                emit({"event": "posting", "nbytes": n})
                try:
                    writer.transfer("owner", [(0, 0, n)])
                    outcome = "ok"
                except Exception as exc:
                    outcome = f"{type(exc).__name__}: {exc}"
                emit({"event": "written", "outcome": outcome, "seconds": time.monotonic() - t0})

            # A thread: the parent may freeze this process mid-write.
            threading.Thread(target=post, daemon=True).start()


# -- the parent -----------------------------------------------------------------
def child(role: str, args: dict[str, Any]) -> Any:
    from kvconn.testing.child import Child

    env = {"PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "NIXL_LOG_LEVEL": "WARN"}
    return Child("rdma_fence", {"role": role, **args}, env=env)


def command(c: Any, op: str, timeout: float = 60, **extra: Any) -> dict[str, Any]:
    c.send_line(json.dumps({"op": op, **extra}))
    answer: dict[str, Any] = c.expect(timeout, f"{op}", event="watched" if op == "watch" else "done")
    return answer


def write(w: Any, nbytes: int, timeout: float) -> dict[str, Any]:
    w.send_line(json.dumps({"op": "write", "nbytes": nbytes}))
    result: dict[str, Any] = w.expect(timeout, "the write", event="written")
    return result


def experiment(name: str, backend: str, options: dict[str, str], watch_s: float) -> dict[str, Any]:
    """One experiment, a fresh owner and writer."""
    owner = child("owner", {"backend": backend, "options": options, "nbytes": BIG})
    writer = child("writer", {"backend": backend, "options": options})
    out: dict[str, Any] = {"experiment": name, "backend": backend, "options": options}
    try:
        metadata = owner.expect(120, "owner start", event="ready")["metadata"]
        writer.expect(120, "writer start", event="ready")
        writer.send_line(json.dumps({"op": "connect", "metadata": metadata}))
        writer.expect(60, "writer connect", event="connected")
        first = write(writer, SMALL, 60)
        out["baseline"] = {
            "outcome": first["outcome"],
            "landed": command(owner, "watch", seconds=0)["at_end"],
        }
        command(owner, "canary")
        if name == "baseline":
            return out
        if name in ("deregister", "destroy"):
            out["teardown_s"] = command(owner, name)["seconds"]
            late = write(writer, SMALL, 120)
            watched = command(owner, "watch", timeout=watch_s + 60, seconds=watch_s)
            out.update(late_write=late["outcome"], late_write_s=late["seconds"], late_bytes=watched["at_end"])
            return out
        # frozen_fence: 64 MiB posted, the writer frozen 5 ms in, the owner's teardown, the writer resumed
        writer.send_line(json.dumps({"op": "write", "nbytes": BIG}))
        writer.expect(30, "the big write posts", event="posting")
        time.sleep(0.005)
        writer.signal(signal.SIGSTOP)
        done = command(owner, "destroy")
        before = done["changed"]
        writer.signal(signal.SIGCONT)
        watched = command(owner, "watch", timeout=watch_s + 60, seconds=watch_s)
        late = writer.expect(watch_s + 120, "the resumed writer's write", event="written")
        out.update(
            teardown_s=done["seconds"],
            landed_before_teardown=before,
            late_bytes=watched["at_end"] - before,
            resumed_write=late["outcome"],
        )
        return out
    except AssertionError as exc:
        out["error"] = str(exc)
        return out
    finally:
        writer.close()
        owner.close()


def verdict(rec: dict[str, Any]) -> str:
    if "error" in rec:
        return f"no verdict: {rec['error']}"
    if rec["baseline"]["outcome"] != "ok" or rec["baseline"]["landed"] != SMALL:
        return f"no verdict: the baseline write did not land ({rec['baseline']})"
    if rec["experiment"] == "baseline":
        return "the path works"
    if rec["experiment"] == "frozen_fence" and rec["landed_before_teardown"] >= BIG:
        return "no verdict: the whole write had landed before the teardown (not caught mid-write)"
    if rec["late_bytes"]:
        return f"NOT FENCED: {rec['late_bytes']} bytes landed after the teardown"
    if rec["experiment"] == "frozen_fence":
        return f"fenced: 0 late bytes (resumed writer: {rec['resumed_write']})"
    failed = rec["late_write"] != "ok"
    return (
        "fenced: the late write failed at the writer, 0 bytes" if failed else "0 bytes, but the writer saw ok"
    )


def main(argv: list[str] | None = None) -> int:
    if len(sys.argv) == 2 and sys.argv[1].startswith("{"):  # a child of this script
        from kvconn.testing.child import load_args

        args = load_args(sys.argv[1])
        (serve_owner if args["role"] == "owner" else serve_writer)(args)
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--transport", choices=("rdma", "tcp"), default="rdma")
    p.add_argument("--backends", default="nixl,mooncake")
    p.add_argument("--device", default="", help="RDMA device (default: the first in /sys/class/infiniband)")
    p.add_argument("--iface", default="", help="tcp: nixl's net_devices (default lo)")
    p.add_argument("--host", default="127.0.0.1", help="mooncake's host address")
    p.add_argument("--watch-s", type=float, default=3.0)
    p.add_argument("--experiments", default="baseline,deregister,destroy,frozen_fence")
    p.add_argument("--json", default="")
    a = p.parse_args(argv)
    if a.transport == "rdma":
        devices = rdma_devices()
        if not devices:
            print(
                "rdma_fence: no RDMA device here (/sys/class/infiniband is empty or missing); "
                "nothing measured. On a host with an RDMA NIC load its driver, or try soft-RoCE: "
                "modprobe rdma_rxe && rdma link add rxe0 type rxe netdev IFACE "
                "(scripts/gpu/rdma_fence.sh --rxe IFACE does that).",
                file=sys.stderr,
            )
            return NO_RDMA
        a.device = a.device or devices[0]
        if a.device not in devices:
            print(
                f"rdma_fence: no RDMA device {a.device!r} (this host has {', '.join(devices)})",
                file=sys.stderr,
            )
            return NO_RDMA
    if a.transport == "rdma":
        os.environ["UCX_MODULES"] = "all"  # kvconn-nixl's default leaves UCX's ib module out
    records = []
    for backend in [b.strip() for b in a.backends.split(",") if b.strip()]:
        options = options_for(backend, a.transport, a.device, a.iface, a.host)
        for name in [e.strip() for e in a.experiments.split(",") if e.strip()]:
            t0 = time.monotonic()
            rec = experiment(name, backend, options, a.watch_s)
            rec["verdict"], rec["seconds"] = verdict(rec), round(time.monotonic() - t0, 1)
            records.append(rec)
            print(f"{backend:9} {a.transport:5} {name:13} {rec['verdict']}", flush=True)
            print("   " + json.dumps(rec), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"transport": a.transport, "records": records}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
