"""`bios keys init|create|list|revoke|worker-token|admin-key`: manage a cluster's keys in the coordinator's state dir.

Run these on the coordinator's host, against its `--state-dir`. Keys created or revoked while the
coordinator runs take effect at once (the store is shared SQLite).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from bios.cli.support import HelpFormatter, add_state_dir
from bios.exceptions import NotFoundError
from bios.security.keys import TINKER_PREFIX, KeyStore


def add_keys_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("keys", help="API keys, the worker token and the admin key of a cluster")
    commands = parser.add_subparsers(dest="keys_command", required=True, metavar="COMMAND")

    def command(name: str, help_text: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help_text, formatter_class=HelpFormatter)
        add_state_dir(sub, "the coordinator's state dir")
        return sub

    command("init", "create the cluster's secrets; from then on the coordinator requires keys").set_defaults(
        func=_init)
    create = command("create", "create an API key and print it (shown once)")
    create.add_argument("name", help="who the key is for, e.g. alice")
    create.set_defaults(func=_create)
    command("list", "the keys: name, id (the owner of their runs), created, revoked").set_defaults(func=_list)
    revoke = command("revoke", "revoke a key: refused from now on, open sessions at their next heartbeat")
    revoke.add_argument("name")
    revoke.set_defaults(func=_revoke)
    command("worker-token", "print the token workers join with (bios-worker --token); for workers only, "
            "never an admin credential").set_defaults(func=_worker_token)
    admin = command("admin-key", "print the admin key (created on first use): the web console's and the HTTP "
                    "API's credential that reads every key's runs, usage and audit log")
    admin.add_argument("--rotate", action="store_true",
                       help="replace it with a new one; the old one is refused from then on")
    admin.set_defaults(func=_admin_key)
    return parser


def _open(state_dir: Path) -> KeyStore:
    store = KeyStore.open(state_dir)
    if store is None:
        raise SystemExit(f"{state_dir} has no keys yet: run `bios keys init --state-dir {state_dir}` first")
    return store


def _init(args: argparse.Namespace) -> int:
    store, created = KeyStore.init(args.state_dir)
    store.close()
    if created:
        print(f"created cluster keys in {store.path}; the coordinator now requires API keys and a worker token "
              f"(restart it if it runs). Next: bios keys create NAME --state-dir {args.state_dir} for each user; "
              f"bios keys admin-key for the console's and the HTTP API's admin", file=sys.stderr)
    else:
        print(f"{store.path} already holds this cluster's keys; nothing changed", file=sys.stderr)
    return 0


def _create(args: argparse.Namespace) -> int:
    store = _open(args.state_dir)
    try:
        key = store.create(args.name)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    finally:
        store.close()
    print(key)
    print(f"API key {args.name!r} (owner id {key.key_id}): shown only now. Use it as "
          f"ServiceClient(address=..., api_key=...) or BIOS_API_KEY; with the Tinker SDK as "
          f"TINKER_API_KEY={TINKER_PREFIX}<key>", file=sys.stderr)
    return 0


def _list(args: argparse.Namespace) -> int:
    store = _open(args.state_dir)
    keys = store.list()
    store.close()
    print(f"{'NAME':24} {'ID':16}  {'CREATED':19}  STATUS")
    for info in keys:
        status = "active" if info.revoked is None else f"revoked {_when(info.revoked)}"
        print(f"{info.name:24} {info.key_id:16}  {_when(info.created)}  {status}")
    return 0


def _revoke(args: argparse.Namespace) -> int:
    store = _open(args.state_dir)
    try:
        info = store.revoke(args.name)
    except NotFoundError as exc:
        raise SystemExit(str(exc)) from None
    finally:
        store.close()
    print(f"revoked {info.name!r} (id {info.key_id})", file=sys.stderr)
    return 0


def _worker_token(args: argparse.Namespace) -> int:
    store = _open(args.state_dir)
    print(store.cluster.worker_token())
    store.close()
    return 0


def _admin_key(args: argparse.Namespace) -> int:
    store = _open(args.state_dir)
    try:
        key = store.admin_key(rotate=args.rotate)
    finally:
        store.close()
    print(key)
    print(f"the admin key{' (new: the previous one is refused from now on)' if args.rotate else ''}: paste it "
          f"into the web console, or send {TINKER_PREFIX}<key> as the Tinker SDK's api_key to read every key's "
          "records. Keep it off worker hosts.", file=sys.stderr)
    return 0


def _when(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seconds))
