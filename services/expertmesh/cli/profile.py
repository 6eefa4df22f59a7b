"""``expertmesh profile build`` / ``profile show``: expert capability profiles per query domain.

``build`` sends each labelled query of a JSONL file (``{"text", "domain"}`` lines) to a router with its
domain and the ``exact`` policy, reads how many expert choices each domain's tokens made per (layer,
expert) before and after (the router's ``domain_load``, counted since it started), and stores the
profiles built from the difference (``expertmesh.router.policy.profiles``) in the state store the routers read
(``--state-url``), or writes them to a file (``--out``). An in-process store (``memory://``, the embedded
default) belongs to the router's own process, so there the file is the way: ``expertmesh up --profiles
FILE`` loads it into the router's store at start. ``show`` reads the store, or a file with ``--file``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from expertmesh.contracts.errors import InvalidRequest


def add_command(commands) -> None:
    profile = commands.add_parser("profile", help="expert capability profiles per query domain (for routing policies)")
    sub = profile.add_subparsers(dest="profile_command", required=True, metavar="ACTION")
    build = sub.add_parser("build", help="run labelled queries through a router and store each domain's profile")
    build.add_argument("--queries", type=Path, required=True, help='JSONL file of {"text": ..., "domain": ...} lines')
    build.add_argument(
        "--target", default="127.0.0.1:50051", help="the router's gRPC address (default 127.0.0.1:50051)"
    )
    _state_url_argument(build)
    build.add_argument(
        "--out",
        type=Path,
        metavar="FILE.json",
        help="also write the profiles to this file, which `expertmesh up --profiles` loads (with a memory:// store, "
        "only to it) (default: unset)",
    )
    build.add_argument(
        "--max-tokens", type=int, default=8, help="tokens generated per query besides its prompt (default 8)"
    )
    build.add_argument("--concurrency", type=int, default=4, help="queries in flight at once (default 4)")
    build.add_argument("--timeout", type=float, default=60.0, help="deadline of each call, seconds (default 60)")
    build.set_defaults(run=_build)
    show = sub.add_parser("show", help="print the stored profiles: each domain's strongest experts per layer")
    source = show.add_mutually_exclusive_group()
    _state_url_argument(source)
    source.add_argument(
        "--file",
        type=Path,
        metavar="FILE.json",
        help="read the profiles from this file (`profile build --out`) instead",
    )
    show.add_argument("--domain", help="only this domain")
    show.add_argument("--top", type=int, default=3, help="experts listed per layer (default 3)")
    show.add_argument("--json", action="store_true", help="print the profiles as JSON")
    show.set_defaults(run=_show)


def _state_url_argument(parser) -> None:
    parser.add_argument(
        "--state-url",
        default=None,
        help="the routers' shared state store, redis://host:port/db (default: env EXPERTMESH_STATE_URL)",
    )


def _shared_store_url(args, file_flag: str, file_given: bool) -> str | None:
    """The routers' shared store, named by --state-url or EXPERTMESH_STATE_URL. memory:// is private to
    the router's own process: None when the command has a file (``file_flag``) to use instead, else refused."""
    url = args.state_url or os.environ.get("EXPERTMESH_STATE_URL") or "memory://"
    if not url.startswith("memory://"):
        return url
    if file_given:
        return None
    raise InvalidRequest(
        f"--state-url: memory:// is private to the router's process; use {file_flag} (with the embedded default, "
        "`expertmesh up --profiles FILE.json` loads it) or the routers' shared store, --state-url redis://..."
    )


def _build(args) -> int:
    from expertmesh.classifier.corpus import load_examples
    from expertmesh.client import Client
    from expertmesh.router.policy.profiles import save_profiles, write_profiles_file
    from expertmesh.store import open_store
    from expertmesh.verify.profiles import measure_profiles

    if args.max_tokens < 1 or args.concurrency < 1:
        raise InvalidRequest("--max-tokens and --concurrency must be at least 1")
    if args.out is not None and not args.out.parent.is_dir():
        raise InvalidRequest(f"--out: {args.out.parent} is not a directory")
    examples = load_examples(args.queries)
    url = _shared_store_url(args, "--out FILE.json", args.out is not None)
    with Client(args.target, timeout=args.timeout) as client:
        profiles = measure_profiles(client, args.target, examples, args.max_tokens, args.concurrency)
        moe_layers = next(iter(profiles.values())).moe_layers
    where = []
    if args.out is not None:
        write_profiles_file(args.out, profiles)
        where.append(str(args.out))
    if url is not None:
        store = open_store(url)
        try:
            save_profiles(store, profiles)
        finally:
            store.close()
        where.append("the state store")
    for domain, profile in profiles.items():
        print(f"{domain:>14}: {profile.choices[0]:,.0f} expert choices per layer", file=sys.stderr)
    print(
        f"stored {len(profiles)} profiles ({len(examples)} queries, {len(moe_layers)} MoE layers) "
        f"in {' and '.join(where)}",
        file=sys.stderr,
    )
    return 0


def _show(args) -> int:
    from expertmesh.router.policy.profiles import load_profiles, read_profiles_file
    from expertmesh.store import open_store

    if args.file is not None:
        profiles = read_profiles_file(args.file)
    else:
        store = open_store(_shared_store_url(args, "--file FILE.json", False))
        try:
            profiles = load_profiles(store)
        finally:
            store.close()
    if args.domain is not None:
        profiles = {d: p for d, p in profiles.items() if d == args.domain}
    if not profiles:
        raise InvalidRequest(
            f"no profile{' for ' + repr(args.domain) if args.domain else 's'} in {args.file or 'the store'} yet; "
            "run `expertmesh profile build`"
        )
    if args.json:
        print(json.dumps({d: p.to_dict() for d, p in sorted(profiles.items())}))
        return 0
    for domain, profile in sorted(profiles.items()):
        print(f"{domain}  ({profile.choices[0]:,.0f} expert choices per layer)")
        for row, layer in enumerate(profile.moe_layers):
            order = sorted(range(profile.share.shape[1]), key=lambda e: (-profile.share[row, e], e))[: args.top]
            cells = "  ".join(f"e{e} {profile.share[row, e]:.0%} (x{profile.lift[row, e]:.2f})" for e in order)
            print(f"  layer {layer:>3}: {cells}")
    return 0
