"""kvconn as a vLLM v1 KV connector (push-mode prefill/decode disaggregation).

Load it with ``kv_transfer_config={"kv_connector": "KvconnConnector",
"kv_connector_module_path": "kvconn_vllm", "kv_role": ..., "kv_connector_extra_config":
{"backend": "loopback"}}``. Importing this package imports vLLM.
"""

from kvconn_vllm.connector import KvconnConnector

__all__ = ["KvconnConnector"]
