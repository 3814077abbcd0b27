"""Real-process harness shared by kvconn's tests, the bench and the
conformance suite: self-driving prefill rank processes and page patterns."""
