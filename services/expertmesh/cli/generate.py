"""``expertmesh generate``: stream a completion to the terminal; ``--trace`` then prints its routing trace
(each new token's experts per MoE layer, their weights and the groups that served them) as a table."""

from __future__ import annotations

import argparse
import sys

#: gRPC codes that mean the input or the target is wrong (exit 2); any other failure exits 1
INPUT_CODES = {"INVALID_ARGUMENT", "OUT_OF_RANGE", "NOT_FOUND", "UNAVAILABLE", "UNAUTHENTICATED", "PERMISSION_DENIED"}


def add_command(commands) -> None:
    parser = commands.add_parser("generate", help="stream a completion from a running `expertmesh up`")
    parser.add_argument("prompt", help="the prompt text")
    parser.add_argument("--max-tokens", type=int, help="tokens to generate (default: the server's)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 decodes greedily (default: %(default)s)")
    parser.add_argument(
        "--top-p", type=float, help="nucleus sampling: keep the smallest set of tokens this likely (default: off)"
    )
    parser.add_argument(
        "--top-k", type=int, default=0, help="sample among the k likeliest tokens, 0: all (default: %(default)s)"
    )
    parser.add_argument("--seed", type=int, help="seed of the sampler (default: random)")
    parser.add_argument("--stop", action="append", default=[], help="stop sequence, repeatable (default: none)")
    parser.add_argument(
        "--trace",
        action="store_true",
        help="after the completion, print each new token's routing per MoE layer as a table (stdout)",
    )
    parser.add_argument("--target", default="127.0.0.1:50051", help="address of the router (default: %(default)s)")
    parser.add_argument("--timeout", type=float, help="deadline in seconds (default: none)")
    parser.set_defaults(run=_main)


def _main(args: argparse.Namespace) -> int:
    import grpc

    from expertmesh.client import Client

    routing = []
    with Client(args.target, timeout=args.timeout) as client:
        try:
            for chunk in client.generate(
                args.prompt,
                max_new_tokens=args.max_tokens,
                temperature=args.temperature,
                top_p=args.top_p,
                top_k=args.top_k,
                seed=args.seed,
                stop=args.stop,
                routing_trace=args.trace,
            ):
                routing += chunk.routing
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                if chunk.finish_reason:
                    sys.stdout.write("\n")
                    print(
                        f"[{chunk.finish_reason}: {chunk.prompt_tokens} prompt + {chunk.completion_tokens} "
                        "completion tokens]",
                        file=sys.stderr,
                    )
        except grpc.RpcError as err:
            code = err.code()
            details = " ".join((err.details() or "").split())  # one line, whatever the transport wrote
            print(f"expertmesh generate: error: {args.target}: {code.name}: {details}", file=sys.stderr)
            return 2 if code.name in INPUT_CODES else 1
    if args.trace:
        print(format_trace(routing))
    return 0


def format_trace(tokens) -> str:
    """A routing trace (``TokenRouting`` messages, in order) as a table: one row per token and MoE layer,
    each expert as ``id weight@group``."""
    rows = [
        (
            str(t.index),
            str(t.token_id),
            str(r.layer),
            "  ".join(f"{e} {w:.3f}@{g or '-'}" for e, w, g in zip(r.experts, r.weights, r.groups)),
        )
        for t in tokens
        for r in t.layers
    ]
    header = ("token", "id", "layer", "experts (id weight@group)")
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(3)]
    lines = ["  ".join([*(f"{c:>{w}}" for c, w in zip(row[:3], widths)), row[3]]) for row in (header, *rows)]
    return "\n".join(lines)
