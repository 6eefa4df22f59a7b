"""``expertmesh store acl``: the Redis users of a deployment's state store, one per component, with exactly the
rights ``expertmesh.store.access.LAYOUT`` gives it, as a Redis ACL file (``aclfile``). The Helm chart's bundled
Redis writes its ACL file with it at start; an external Redis's operator loads its output (``ACL LOAD``).

With ``--password-dir`` (a mounted Secret: one file per component, named ``router``, ``expert-group`` and
``orchestrator``), each user holds the SHA-256 of its password; the plain text never reaches Redis or a command
line. Without it, the users have no password yet: add ``>PASSWORD`` (or ``#SHA256``) to each line.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from expertmesh.contracts.errors import InputError


def add_command(commands) -> None:
    store = commands.add_parser("store", help="the state store: its Redis users and their rights")
    sub = store.add_subparsers(dest="store_command", required=True, metavar="ACTION")
    acl = sub.add_parser("acl", help="print or write the Redis ACL file: one user per component, default user off")
    acl.add_argument(
        "--deployment",
        help="the deployment whose keys the users may touch (default: $EXPERTMESH_DEPLOYMENT, else default)",
    )
    acl.add_argument(
        "--password-dir",
        type=Path,
        help="folder with one password file per component (router, expert-group, orchestrator): users hold their "
        "SHA-256 (default: users without a password)",
    )
    acl.add_argument("--out", type=Path, help="write the ACL file here, readable by its owner only (default: stdout)")
    acl.set_defaults(run=_acl)


def _passwords(folder: Path) -> dict:
    from expertmesh.store.access import Role

    passwords = {}
    for role in Role:
        path = folder / role.value
        try:
            password = path.read_text().strip()  # whitespace ignored, as EXPERTMESH_REDIS_PASSWORD_FILE reads it
        except OSError as err:
            raise InputError(f"--password-dir: cannot read {path}: {err.strerror}") from None
        if not password:
            raise InputError(f"--password-dir: {path} is empty")
        passwords[role] = password
    return passwords


def _acl(args) -> int:
    from expertmesh.store import namespace_of
    from expertmesh.store.access import acl_file

    try:
        namespace = namespace_of(args.deployment)
    except ValueError as err:
        raise InputError(f"--deployment: {err}") from None
    text = acl_file(namespace, _passwords(args.password_dir) if args.password_dir else None)
    if args.out is None:
        sys.stdout.write(text)
        return 0
    fd = os.open(args.out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    return 0
