"""kvconn as an SGLang disaggregation transfer backend.

Installing this distribution is all a user does: SGLang's plugin loader runs
:func:`kvconn_sglang.plugin.register`, after which
``--disaggregation-transfer-backend kvconn`` resolves to the classes in
:mod:`kvconn_sglang.conn`.
"""

BACKEND_NAME = "kvconn"

__all__ = ["BACKEND_NAME"]
