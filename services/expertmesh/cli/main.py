"""The ``expertmesh`` command line.

Every command exits 0 on success, 1 when a check it runs fails (e.g. ``verify``
finds a difference), and 2 with one line on stderr when its input is wrong or
its target cannot be reached.

Command modules register themselves with ``add_command(commands)`` and keep
their heavy imports (torch, transformers, Ray) inside the function that runs
them, so building the parser (``--help``, completion) stays fast.
"""

# PYTHON_ARGCOMPLETE_OK
from __future__ import annotations

import argparse
import os
import sys
from importlib.metadata import PackageNotFoundError, version

from expertmesh.infra import openmp_wait

# Before torch loads its OpenMP runtime, which reads them once: how idle OpenMP threads wait, sleeping at once
# where expert groups in other processes compute on the same cores, spinning a while first where the groups
# compute in this process (infra/openmp_wait.py says why and what it measured). Set OMP_WAIT_POLICY or
# GOMP_SPINCOUNT to override.
openmp_wait.apply(sys.argv[1:], os.environ)

from expertmesh.contracts.errors import ExpertMeshError  # noqa: E402
from expertmesh.infra.console import set_quiet  # noqa: E402
from expertmesh.infra.telemetry.logs import configure_logging  # noqa: E402

#: long-running processes: structured logs, one line per request at info
SERVER_COMMANDS = {"up", "orchestrator", "group"}


class _ShowDefaults(argparse.HelpFormatter):
    """Appends an option's default to its help unless the help already says it (or there is none)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help = action.help or ""
        if action.option_strings and "default" not in help and action.default not in (None, False, argparse.SUPPRESS):
            help += " (default: %(default)s)"
        return help


class Parser(argparse.ArgumentParser):
    """Shows defaults in help, and reports a bad command line in one line (exit 2) instead of
    argparse's usage block; ``--help`` still shows the usage."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", _ShowDefaults)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _version() -> str:
    try:
        return version("expertmesh")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    from expertmesh.bench import add_commands as add_bench_commands
    from expertmesh.cli import classifier as classifier_cli
    from expertmesh.cli import (
        domain_moe as domain_moe_cli,
    )
    from expertmesh.cli import generate as generate_cli
    from expertmesh.cli import group as group_cli
    from expertmesh.cli import heatmap as heatmap_cli
    from expertmesh.cli import (
        policy as policy_cli,
    )
    from expertmesh.cli import probe as probe_cli
    from expertmesh.cli import (
        profile as profile_cli,
    )
    from expertmesh.cli import (
        stats as stats_cli,
    )
    from expertmesh.cli import store as store_cli
    from expertmesh.cli import up as up_cli
    from expertmesh.cli.orchestrator import add_commands as add_orchestrator_commands
    from expertmesh.verify import check as verify

    parser = Parser(
        prog="expertmesh",
        description="Serve Mixture-of-Experts models with the experts split out as services. "
        "Settings: flags > EXPERTMESH_* > --config FILE.yaml > defaults; exit 2: bad input or unreachable target.",
    )
    parser.add_argument("--version", action="version", version=f"expertmesh {_version()}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at debug level")
    parser.add_argument(
        "-q", "--quiet", action="store_true", help="no progress lines or bars on stderr (errors still show)"
    )
    parser.add_argument(
        "--log-format",
        choices=["json", "text"],
        help="json for the servers (up, orchestrator, group), text otherwise (env EXPERTMESH_LOG_FORMAT)",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    bench = commands.add_parser("bench", help="benchmarks: print a table and write JSON")
    bench_commands = bench.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")

    up_cli.add_command(commands)
    group_cli.add_command(commands)
    generate_cli.add_command(commands)
    verify.add_command(commands)
    stats_cli.add_command(commands)
    store_cli.add_command(commands)
    domain_moe_cli.add_command(commands)
    probe_cli.add_command(commands)
    heatmap_cli.add_command(commands)
    profile_cli.add_command(commands)
    policy_cli.add_command(commands)
    classifier_cli.add_command(commands)
    add_bench_commands(bench_commands)
    add_orchestrator_commands(commands, bench_commands)
    completion = commands.add_parser(
        "completion", help="print the shell completion script (eval it in your shell's rc)"
    )
    completion.add_argument("shell", choices=["bash", "zsh", "fish", "tcsh"], help="the shell to complete in")
    completion.set_defaults(run=_completion)
    return parser


def _completion(args: argparse.Namespace) -> int:
    import argcomplete

    print(argcomplete.shellcode(["expertmesh"], shell=args.shell))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        import argcomplete
    except ImportError:  # completion is a convenience: the CLI works without it
        pass
    else:
        argcomplete.autocomplete(parser)  # returns at once unless the shell is asking for completions
    args = parser.parse_args(argv)
    server = args.command in SERVER_COMMANDS and getattr(args, "group_command", "serve") == "serve"
    log_format = args.log_format or os.environ.get("EXPERTMESH_LOG_FORMAT") or ("json" if server else "text")
    configure_logging(log_format, args.verbose, server)
    set_quiet(args.quiet)
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
