"""``kvconn bench --plot``: release latency after abort in each mode, the
deadlines that bound timeout-only release, and the fault table. Needs
matplotlib (``pip install 'kvconn-core[plot]'``)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape

from kvconn.bench.mode_result import KVCONN, LEGACY, ModeResult

#: The decode deadline a deployment runs with (the default of
#: ``Config.abort_timeout_s``): where a timeout-only engine frees pages.
DEPLOYMENT_DEADLINE_S = 30.0


def plot(
    path: str,
    results: dict[str, ModeResult],
    legacy_timeout: float,
    faults: list[dict[str, Any]],
    err: Console,
) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        err.print(escape("--plot needs matplotlib: pip install 'kvconn-core[plot]'; no plot written"))
        return
    fig = figure(results, legacy_timeout, faults)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    err.print(f"plot written to {escape(path)}")


def figure(results: dict[str, ModeResult], legacy_timeout: float, faults: list[dict[str, Any]]) -> Any:
    """Release latency after abort in each mode, the deadlines that bound
    timeout-only release (the bench's short one and a deployment's 30 s)
    and, when the fault phase ran, the pages each mode let a late write
    corrupt."""
    import matplotlib.pyplot as plt

    ran = [f for f in faults if not f.get("skipped") and not f.get("error")]
    fig, axes = plt.subplots(1, 2 if ran else 1, figsize=(12 if ran else 8, 4.5), squeeze=False)
    ax = axes[0][0]
    for mode, res in results.items():
        xs = sorted(res.latencies_ms)
        if not xs:
            continue
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        label = "kvconn (ABORT_ACK)" if mode == KVCONN else f"timeout-only ({legacy_timeout:g} s)"
        ax.step(xs, ys, where="post", label=f"{label}, n={len(xs)}")
    ax.axvline(
        legacy_timeout * 1e3, color="grey", linestyle=":", label=f"bench deadline ({legacy_timeout:g} s)"
    )
    ax.axvline(
        DEPLOYMENT_DEADLINE_S * 1e3,
        color="red",
        linestyle="--",
        label=f"deployment deadline ({DEPLOYMENT_DEADLINE_S:g} s): timeout-only frees pages here",
    )
    ax.set_xscale("log")
    ax.set_xlabel("abort -> release (ms, log)")
    ax.set_ylabel("fraction of aborted rooms")
    ax.set_title("release latency after abort")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    if ran:
        bx = axes[0][1]
        names = [f["fault"] for f in ran if f["mode"] == KVCONN]
        by = {(f["fault"], f["mode"]): f["corrupted"] for f in ran}
        at = range(len(names))
        for shift, mode, label in ((-0.2, LEGACY, "timeout-only"), (0.2, KVCONN, "kvconn")):
            heights = [by.get((n, mode), 0) for n in names]
            bars = bx.bar([x + shift for x in at], heights, width=0.4, label=label)
            bx.bar_label(bars)
        bx.set_xticks(list(at), names, rotation=15, fontsize="small")
        bx.set_ylabel("pages corrupted by a late write")
        bx.set_title("production faults: pages handed back, then written")
        bx.legend(fontsize="small")
    fig.suptitle("kvconn bench")
    fig.tight_layout()
    return fig
