"""The ``pdserve`` command line.

    pdserve bench engine [...]     offline engine benchmark (loadtests/bench_engine.py)
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="run a benchmark from loadtests/")
    bench.add_argument("which", choices=["engine"])
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        from loadtests import bench_engine
        bench_engine.main(rest)


if __name__ == "__main__":
    main()
