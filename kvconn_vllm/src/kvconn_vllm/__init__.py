"""kvconn as a vLLM v1 KV connector (push-mode prefill/decode disaggregation).

Load it with ``kv_transfer_config={"kv_connector": "KvconnConnector",
"kv_connector_module_path": "kvconn_vllm", "kv_role": ..., "kv_connector_extra_config":
{"backend": "loopback"}}``. ``KvconnConnector`` is imported on first use
(it needs vLLM); the settings and params modules do not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

#: This distribution's version: the one source its metadata (pyproject.toml) reads.
__version__ = "0.1.0"

if TYPE_CHECKING:
    from kvconn_vllm.connector import KvconnConnector

__all__ = ["KvconnConnector"]


def __getattr__(name: str) -> Any:
    if name == "KvconnConnector":
        from kvconn_vllm.connector import KvconnConnector

        return KvconnConnector
    raise AttributeError(f"module 'kvconn_vllm' has no attribute {name!r}")
