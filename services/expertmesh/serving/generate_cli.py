"""``expertmesh generate``: stream a completion to the terminal."""

from __future__ import annotations

import sys

import grpc

from expertmesh.client import Client


def add_command(commands) -> None:
    parser = commands.add_parser("generate", help="stream a completion from a running `expertmesh up`")
    parser.add_argument("prompt")
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens to generate (server default if unset)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 decodes greedily")
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop sequence (repeatable)")
    parser.add_argument("--target", default="127.0.0.1:50051", help="address of the router")
    parser.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    parser.set_defaults(run=_main)


def _main(args) -> int:
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
            ):
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
            print(f"expertmesh generate: error: {err.code().name}: {err.details()}", file=sys.stderr)
            return 2 if err.code() == grpc.StatusCode.INVALID_ARGUMENT else 1
    return 0
