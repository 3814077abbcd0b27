"""The sans-I/O protocol: value messages, their wire form, and the two state
machines (prefill ledger, decode hold tracker). Nothing here does I/O, starts a
thread or reads a clock."""
