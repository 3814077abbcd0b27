"""A child for test_testing_helpers: reports its argument's events, then one
``line`` event per line read on stdin, until stdin closes."""

from __future__ import annotations

import sys

from kvconn.testing.child import emit, load_args


def main() -> None:
    args = load_args(sys.argv[1])
    for event in args["events"]:
        emit(dict(event))
    print("not json: skipped by the parent", flush=True)
    for line in sys.stdin:
        emit({"event": "line", "text": line.strip(), "size": len(args.get("pad", ""))})


if __name__ == "__main__":
    main()
