"""``kvtier keygen DIR --name NAME``: a CURVE key pair for kvtierd or one of its clients.

Writes ``DIR/NAME.key`` (the public key: give it away) and
``DIR/NAME.key_secret`` (both halves: mode 0600, keep it where only its
owner reads it) with ``zmq.auth``. Refuses to overwrite. The daemon's pair
is ``curve_secret_key_file``; a client's ``NAME.key`` goes into the daemon's
``curve_public_keys_dir`` (or into ``[tenants.X] public_key``, whose value
``--print-public`` prints). See docs/operating.md, "Security".
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


def register(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "keygen",
        help="create a CURVE key pair (NAME.key, NAME.key_secret) for kvtierd or a client",
        description="Create a CURVE key pair for tcp:// between kvtierd and its clients: DIR/NAME.key (public) "
                    "and DIR/NAME.key_secret (secret, mode 0600). Existing files are never overwritten.",
    )
    p.add_argument("directory", metavar="DIR", help="where to write the two files (created if missing, mode 0700)")
    p.add_argument("--name", default="kvtier", help="file name stem, e.g. server or engine-0 (default: kvtier)")
    p.add_argument("--print-public", action="store_true",
                   help="also print the public key (40 Z85 characters, for [tenants.X] public_key)")
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace) -> int:
    from pathlib import Path

    from kvtier.client.curve import create_key_pair, read_public_key

    directory = Path(args.directory)
    if not directory.exists():
        directory.mkdir(mode=0o700, parents=True)
    try:
        public_file, secret_file = create_key_pair(directory, args.name)
    except (FileExistsError, ValueError) as exc:
        raise SystemExit(f"kvtier keygen: {exc}") from None
    print(f"public key: {public_file}", file=sys.stderr)
    print(f"secret key: {secret_file} (mode 0600: keep it private)", file=sys.stderr)
    if args.print_public:
        print(read_public_key(public_file).decode())
    return 0
