"""``kvtier keygen DIR --name NAME``: a CURVE key pair for kvtierd or one of its clients; or a remote tier secret.

Writes ``DIR/NAME.key`` (the public key: give it away) and
``DIR/NAME.key_secret`` (both halves: mode 0600, keep it where only its
owner reads it) with ``zmq.auth``. Refuses to overwrite. The daemon's pair
is ``curve_secret_key_file``; a client's ``NAME.key`` goes into the daemon's
``curve_public_keys_dir`` (or into ``[tenants.X] public_key``, whose value
``--print-public`` prints). See docs/operating.md, "Security".

``kvtier keygen DIR --remote-secret [--name NAME]`` writes
``DIR/NAME.remote_secret`` instead (default name ``remote``): 32 random
bytes as hex, mode 0600 (``kvtier.tiers.remote.secret``), for kvtierd's
``remote_secret_key_file``. Every daemon sharing one Redis/Valkey needs the
same file: make it once and copy it. Refuses to overwrite (a new secret
makes every block already stored a miss). See docs/remote-tier.md.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


def register(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "keygen",
        help="create a CURVE key pair (NAME.key, NAME.key_secret), or with --remote-secret a remote tier secret",
        description="Create a CURVE key pair for tcp:// between kvtierd and its clients: DIR/NAME.key (public) "
                    "and DIR/NAME.key_secret (secret, mode 0600). With --remote-secret, create the remote tier's "
                    "secret instead: DIR/NAME.remote_secret (mode 0600), the same file for every daemon sharing "
                    "one Redis. Existing files are never overwritten.",
    )
    p.add_argument("directory", metavar="DIR", help="where to write the files (created if missing, mode 0700)")
    p.add_argument("--name", default=None,
                   help="file name stem, e.g. server or engine-0 (default: kvtier; remote with --remote-secret)")
    p.add_argument("--print-public", action="store_true",
                   help="also print the public key (40 Z85 characters, for [tenants.X] public_key)")
    p.add_argument("--remote-secret", action="store_true",
                   help="write a remote tier secret (for kvtierd's remote_secret_key_file) instead of a CURVE pair")
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace) -> int:
    from pathlib import Path

    directory = Path(args.directory)
    if args.remote_secret and args.print_public:
        raise SystemExit("kvtier keygen: --print-public is for CURVE pairs; a remote secret has no public half")
    name = args.name if args.name is not None else ("remote" if args.remote_secret else "kvtier")
    if not name or "/" in name or name.startswith("."):
        raise SystemExit(f"kvtier keygen: bad name {name!r}: a plain file name, e.g. 'server' or 'engine-0'")
    if not directory.exists():
        directory.mkdir(mode=0o700, parents=True)
    if args.remote_secret:
        from kvtier.tiers.remote.secret import write_secret

        path = directory / f"{name}.remote_secret"
        try:
            write_secret(path)
        except FileExistsError:
            raise SystemExit(f"kvtier keygen: {path} exists; remove it first or choose another --name "
                             "(a new secret makes every block already in the remote tier a miss)") from None
        print(f"remote tier secret: {path} (mode 0600: copy it to every daemon sharing the server, "
              "as remote_secret_key_file)", file=sys.stderr)
        return 0

    from kvtier.client.curve import create_key_pair, read_public_key

    try:
        public_file, secret_file = create_key_pair(directory, name)
    except (FileExistsError, ValueError) as exc:
        raise SystemExit(f"kvtier keygen: {exc}") from None
    print(f"public key: {public_file}", file=sys.stderr)
    print(f"secret key: {secret_file} (mode 0600: keep it private)", file=sys.stderr)
    if args.print_public:
        print(read_public_key(public_file).decode())
    return 0
