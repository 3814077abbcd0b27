"""kvconn.runtime.drain_signal in a child process: SIGTERM drains (on a
thread), then the process ends by the signal as it would have."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent(
    """
    import os, signal, sys, threading, time
    from kvconn.protocol.drain import DrainReport
    from kvconn.runtime.drain_signal import drain_on_signal

    class Endpoint:
        def drain(self, grace_s, timeout_s=None):
            # not the main thread: the engine keeps stepping meanwhile
            assert threading.current_thread() is not threading.main_thread()
            time.sleep(0.2)
            sys.stdout.write(f"drained {grace_s}\\n")  # one write: the two threads' do not mix
            sys.stdout.flush()
            return DrainReport(True, 0.2)

    drain_on_signal([Endpoint(), Endpoint()], 2.5)
    os.kill(os.getpid(), signal.SIGTERM)
    for _ in range(300):  # the engine's loop, until the signal ends it
        time.sleep(0.01)
    print("not ended", flush=True)
    """
)


def test_sigterm_drains_every_endpoint_then_ends_the_process_by_the_signal() -> None:
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60)
    assert done.stdout.split("\n")[:2] == ["drained 2.5", "drained 2.5"], done.stderr
    assert "not ended" not in done.stdout
    assert done.returncode == -signal.SIGTERM
