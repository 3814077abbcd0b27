"""``kvconn-vllm-faults``: any vLLM KV connector through the same faults and
the same work as kvconn, on real engines, in one run (:mod:`.cli`).

Modules: :mod:`.connectors` (what each connector under test runs with),
:mod:`.engine` (an engine process and its hooks), :mod:`.watch` (its KV
blocks watched), :mod:`.pairs`, :mod:`.scenarios` (the faults),
:mod:`.happy` (the happy path), :mod:`.report`. Importing this package does
not import vLLM; the engine processes do.
"""
