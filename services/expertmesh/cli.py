"""The ``expertmesh`` command line.

Every command exits 0 on success, 1 when a check it runs fails (e.g. ``verify``
finds a difference), and 2 with one line on stderr when its input is wrong.
"""

from __future__ import annotations

import argparse
import os
import sys

# Before torch loads its OpenMP runtime, which reads this once: idle OpenMP threads then sleep
# rather than spin. A router spends most of a step waiting for expert groups, and embedded (CPU)
# they compute on the same cores; threads spinning meanwhile take those cores from them (measured:
# 5x slower dispatch on 2 cores). Set OMP_WAIT_POLICY to override.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from expertmesh.errors import ExpertMeshError  # noqa: E402
from expertmesh.telemetry.logs import configure_logging

#: long-running processes: structured logs, one line per request at info
SERVER_COMMANDS = {"up", "orchestrator", "group"}


def _build_parser() -> argparse.ArgumentParser:
    from expertmesh import stats_cli, verify
    from expertmesh.bench import add_commands as add_bench_commands
    from expertmesh.expert_group import serve_cli as group_cli
    from expertmesh.observability import heatmap_cli, probe_cli
    from expertmesh.serving import generate_cli, up

    parser = argparse.ArgumentParser(prog="expertmesh", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log at debug level")
    parser.add_argument(
        "--log-format",
        choices=["json", "text"],
        default=os.environ.get("EXPERTMESH_LOG_FORMAT"),
        help="default: json for the servers (up, orchestrator, group), text otherwise",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    bench = commands.add_parser("bench", help="benchmarks: print a table and write JSON")
    bench_commands = bench.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")

    up.add_command(commands)
    group_cli.add_command(commands)
    generate_cli.add_command(commands)
    verify.add_command(commands)
    stats_cli.add_command(commands)
    probe_cli.add_command(commands)
    heatmap_cli.add_command(commands)
    add_bench_commands(bench_commands)
    try:
        from expertmesh.orchestrator.cli import add_commands as add_orchestrator_commands
    except ImportError:  # the control plane is optional for a data-plane-only install
        pass
    else:
        add_orchestrator_commands(commands, bench_commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    server = args.command in SERVER_COMMANDS
    configure_logging(args.log_format or ("json" if server else "text"), args.verbose, server)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        return int(args.run(args) or 0)
    except (ExpertMeshError, OSError) as err:  # bad input, or the machine refused (a taken port, say)
        print(f"expertmesh {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
