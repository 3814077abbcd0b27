"""Where a decode rank finds a prefill instance's kvconn ranks: SGLang's own
bootstrap server, which every request already names (``bootstrap_host`` and
``bootstrap_port``, chosen by SGLang's router).

Each prefill rank registers its kvconn control address there as its
``rank_ip`` / ``rank_port`` (the same ``PUT /route`` SGLang's own backends
make, so SGLang's ``CommonKVBootstrapServer`` and the Rust server's registry
both serve it). Decode reads the instance's topology (``GET /route`` with
every rank -1) and each rank's address, once per instance and DP group, and
names those addresses per request (kvconn's per-request routing).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

log = logging.getLogger(__name__)

#: How long one HTTP call to a bootstrap server may take.
HTTP_TIMEOUT_S = 5.0


class RoutingError(LookupError):
    """A bootstrap server did not say where a prefill instance's kvconn ranks are."""


def _get(bootstrap_addr: str, dp: int, cp: int, tp: int, pp: int) -> Any:
    import requests

    url = (
        f"http://{bootstrap_addr}/route?prefill_dp_rank={dp}&prefill_cp_rank={cp}"
        f"&target_tp_rank={tp}&target_pp_rank={pp}"
    )
    try:
        response = requests.get(url, timeout=HTTP_TIMEOUT_S)
    except requests.RequestException as exc:
        raise RoutingError(f"bootstrap server {bootstrap_addr} unreachable: {exc}") from None
    if response.status_code != 200:
        raise RoutingError(
            f"bootstrap server {bootstrap_addr} answered {response.status_code}: {response.text.strip()}"
        )
    return response.json()


def server_info(bootstrap_addr: str) -> dict[str, Any]:
    """The prefill instance's topology as its bootstrap server states it
    (SGLang's ``PrefillServerInfo`` fields); RoutingError until every rank
    registered."""
    info = _get(bootstrap_addr, -1, -1, -1, -1)
    if not isinstance(info, dict):
        raise RoutingError(f"bootstrap server {bootstrap_addr}: malformed server info {info!r}")
    return info


def rank_addresses(bootstrap_addr: str, tp_size: int, dp_rank: int) -> tuple[str, ...]:
    """The kvconn control addresses of the instance's attention-TP ranks of
    DP group ``dp_rank``, in rank order."""
    addresses = []
    for tp_rank in range(tp_size):
        row = _get(bootstrap_addr, dp_rank, 0, tp_rank, 0)
        try:
            addresses.append(f"tcp://{row['rank_ip']}:{int(row['rank_port'])}")
        except (KeyError, TypeError, ValueError):
            raise RoutingError(
                f"bootstrap server {bootstrap_addr}: malformed rank {tp_rank} entry {row!r}"
            ) from None
    return tuple(addresses)


def register(url: str, payload: Mapping[str, Any], attempts: int = 8, first_delay_s: float = 0.25) -> None:
    """``PUT`` a prefill rank's row to a bootstrap server, retried while the
    server is starting (SGLang starts it in another process)."""
    import requests

    delay = first_delay_s
    for attempt in range(1, attempts + 1):
        try:
            response = requests.put(url, json=dict(payload), timeout=HTTP_TIMEOUT_S)
            if response.status_code == 200:
                return
            problem = f"{response.status_code}: {response.text.strip()}"
        except requests.RequestException as exc:
            problem = str(exc)
        if attempt == attempts:
            raise RoutingError(f"registering with bootstrap server {url} failed: {problem}")
        log.debug("bootstrap registration attempt %d failed (%s); retrying", attempt, problem)
        time.sleep(delay)
        delay = min(delay * 2, 5.0)


__all__ = ["RoutingError", "rank_addresses", "register", "server_info"]
