"""The ``gramcoord`` command line."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from gramcoord.launch.config import ClusterConfig, ConfigError, load_config
from gramcoord.launch.summary_table import command_started


def _add_config_args(p: argparse.ArgumentParser, *, positional: bool) -> None:
    if positional:
        p.add_argument("config", help="cluster YAML, e.g. configs/local.yaml")
    p.add_argument(
        "--workload",
        help="JSONL workload, relative to the working directory (default: the config's "
        "workload.path, relative to the config file)",
    )
    p.add_argument(
        "--out",
        help="output directory (default: the config's output.dir, from the working directory)",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. grammar.compile_timeout_s=5",
    )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gramcoord", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run a workload through the configured cluster")
    _add_config_args(run, positional=True)
    run.add_argument(
        "--resume",
        metavar="DIR",
        help="continue the run in DIR: keep the requests its journal finished (same workload "
        "and config, checked by fingerprint), run the rest, write one outputs.jsonl",
    )
    verify = sub.add_parser(
        "verify", help="run the topology and the one-process reference, and compare them"
    )
    _add_config_args(verify, positional=True)

    check = sub.add_parser("check", help="compile a workload's specs on one process")
    check.add_argument(
        "workload",
        nargs="?",
        help="JSONL workload (default: the config's); with --instances, a schemas file "
        "(default: the dev data's schemas-dev.jsonl)",
    )
    check.add_argument(
        "--instances",
        action="store_true",
        help="walk every test instance of every schema through the grammar we would use, "
        "and report per schema: exact, under- or over-constrained, end-checked, refused",
    )
    check.add_argument(
        "--labels",
        help="with --instances: raw xgrammar's verdicts to print beside ours (default: "
        "schemas-dev.xgrammar-labels.jsonl beside the schemas, when present)",
    )
    check.add_argument("--config", help="cluster YAML (default: built-in defaults)")
    check.add_argument(
        "--out", help="per-record JSONL output, native log beside it (default: stdout)"
    )
    check.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. grammar.compile_timeout_s=5",
    )

    cfg = sub.add_parser(
        "config", help="print the resolved config as JSON, or every field with --reference"
    )
    cfg.add_argument("config", nargs="?", help="cluster YAML (default: built-in defaults)")
    cfg.add_argument(
        "--reference",
        action="store_true",
        help="every field, its default and meaning: the Markdown of docs/configuration.md",
    )
    cfg.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value before printing it",
    )

    # Anything after NAME that is not --out (e.g. --repeat 5, or --quick for
    # `all`) is passed on to the benchmark, --help included, so
    # `gramcoord bench NAME --help` shows that benchmark's own options.
    bench = sub.add_parser(
        "bench",
        help="run benchmark NAME (benchmarks/NAME.py or NAME_bench.py), or all, and write bench.json",
        add_help=False,
    )
    bench.add_argument("name", nargs="?", help="a benchmark, or 'all'")
    bench.add_argument("--out", default="bench-out", help="directory for bench.json")
    bench.add_argument("-h", "--help", action="store_true", help="this help, or NAME's")
    bench.set_defaults(bench_help=bench.format_help)
    return p


def _load(args) -> ClusterConfig:
    path = getattr(args, "config", None)
    return load_config(path, args.overrides)


def _workload(args, config: ClusterConfig) -> str:
    """--workload from the working directory, else the config's (already absolute)."""
    return str(Path(args.workload).resolve()) if args.workload else config.workload.path


def _workload_problem(config: ClusterConfig, workload: str) -> str | None:
    """A missing workload file, or records of the wrong shape: the run fails (exit 2)."""
    from gramcoord.launch.workload import WorkloadError, load_workload

    for what, path in (("workload", workload), ("workload.mix_path", config.workload.mix_path)):
        if not path:
            continue
        if not Path(path).is_file():
            return f"{what} {path} not found"
        try:
            load_workload(path)
        except WorkloadError as exc:
            return f"bad {what}: {exc}"
        except (OSError, EOFError) as exc:
            return f"{what} {path}: cannot read it: {exc}"
    return None


def main(argv: list[str] | None = None) -> int:
    # A run's headline time counts from here: start-up included.
    command_started()
    args, extra = _parser().parse_known_args(argv)
    if extra and args.command != "bench":
        _parser().error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.command == "config" and args.reference:
        from gramcoord.launch.config_doc import page

        sys.stdout.write(page())
        return 0
    if args.command in ("run", "verify", "check", "config"):
        try:
            config = _load(args)
        except ConfigError as exc:
            print(f"gramcoord: config error: {exc}", file=sys.stderr)
            return 2
    if args.command == "config":
        import msgspec

        print(msgspec.json.format(msgspec.json.encode(config), indent=2).decode())
        return 0
    if args.command == "check" and args.instances:
        from gramcoord.launch.instances import main_instances

        return main_instances(config, args.workload, args.labels, args.out)
    if args.command in ("run", "verify", "check"):
        workload = _workload(args, config)
        problem = _workload_problem(config, workload)
        if problem:
            print(f"gramcoord: {problem}", file=sys.stderr)
            return 2
    if args.command in ("run", "verify"):
        from rich.console import Console

        from gramcoord.launch.run import main_run, main_verify

        if args.command == "run" and args.resume:
            if args.out and Path(args.out) != Path(args.resume):
                print("gramcoord: --resume DIR writes into DIR; drop --out", file=sys.stderr)
                return 2
            return main_run(config, workload, Path(args.resume), Console(), resume=True)
        out_dir = Path(args.out or config.output.dir)
        fn = main_run if args.command == "run" else main_verify
        return fn(config, workload, out_dir, Console())
    if args.command == "check":
        from gramcoord.launch.check import main_check

        return main_check(config, workload, args.out)
    if args.command == "bench":
        rest = [a for a in extra if a != "--"] + (["--help"] if args.help else [])
        if args.name is None:
            from gramcoord.benchmarks._contract import available

            print(args.bench_help() + f"\nbenchmarks: {', '.join(available())}, all")
            return 0 if args.help else 2
        if args.name == "all":
            from gramcoord.benchmarks._all import bench_all

            return bench_all(rest, Path(args.out))
        from gramcoord.benchmarks._contract import run_bench

        run_bench(args.name, rest, Path(args.out))
        return 0
    raise AssertionError(args.command)


if __name__ == "__main__":
    from gramcoord.rank_worker.grammars.native_exit import exiting

    # With a compile still in flight the process leaves with this status.
    sys.exit(exiting(main()))
