"""``kvconn bench``: an end-to-end abort-mid-transfer run that verifies every
byte and every released page, and measures release latency, throughput and
the runtime's per-chunk overhead, with ABORT_ACK and in the timeout-only
legacy mode."""
