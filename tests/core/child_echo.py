"""A child for test_testing_helpers: reports its argument's events, then one
``line`` event per line read on stdin, until stdin closes; then its
``last``, if given. With ``die``, it fails at once, saying why on stderr."""

from __future__ import annotations

import sys

from kvconn.testing.child import emit, load_args


def main() -> None:
    args = load_args(sys.argv[1])
    if args.get("die"):  # a child that fails at start, its cause the last line on stderr
        print("noise\nValueError: the cause", file=sys.stderr, flush=True)
        raise SystemExit(3)
    for event in args["events"]:
        emit(dict(event))
    print("not json: skipped by the parent", flush=True)
    print("[1, 2]", flush=True)  # JSON, but no event
    for line in sys.stdin:
        emit({"event": "line", "text": line.strip(), "size": len(args.get("pad", ""))})
    if "last" in args:  # what it reports on its way out
        emit({"last": args["last"]})


if __name__ == "__main__":
    main()
