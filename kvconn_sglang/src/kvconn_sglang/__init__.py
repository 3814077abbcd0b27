"""kvconn as an SGLang disaggregation transfer backend.

Installing this distribution is all a user does: SGLang's plugin loader runs
:func:`kvconn_sglang.plugin.register`, after which
``--disaggregation-transfer-backend kvconn`` resolves to the classes in
:mod:`kvconn_sglang.conn`.
"""

#: This distribution's version: the one source its metadata (pyproject.toml) reads.
__version__ = "0.1.0"

BACKEND_NAME = "kvconn"

__all__ = ["BACKEND_NAME"]
