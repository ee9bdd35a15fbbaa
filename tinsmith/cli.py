"""The ``tinsmith`` command: ``up`` runs everything, ``serve`` runs one service, ``keys`` issues,
lists and revokes API keys, ``models`` lists and builds the built-in models, ``runs`` and ``run``
show how runs go.

Owns: argument parsing and process lifetime at the top. Does not own: what the services do.
"""

from __future__ import annotations

import argparse
import asyncio
import runpy
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tinsmith import keyadmin, models, tenants, watch
from tinsmith.embedded import SERVICES, System, default_data_dir
from tinsmith.failures import TinsmithError

_AUTH_LINES = {
    tenants.OPEN: (
        "tinsmith auth: open (any tml- key is its own tenant; set TINSMITH_AUTH=keys to require "
        "issued keys)"
    ),
    tenants.KEYS: (
        "tinsmith auth: keys (only keys issued with `tinsmith keys create` are accepted)"
    ),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tinsmith", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    up = commands.add_parser("up", help="run the whole system on this machine")
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--port", type=int, default=8000)
    up.add_argument(
        "--grpc-port",
        type=int,
        default=None,
        help="the gRPC API; default: 8001 with the default --port, else a free port (printed)",
    )
    up.add_argument("--data-dir", type=Path, default=None, help=f"default: {default_data_dir()}")
    up.add_argument(
        "--no-standby",
        action="store_true",
        help="keep no standby interpreter (about 370 MiB) for quick restarts of the engines",
    )

    serve = commands.add_parser("serve", help="run one service against TINSMITH_NATS_URL")
    serve.add_argument("service", choices=SERVICES)

    keys = commands.add_parser("keys", help="issue, list and revoke the API keys of a deployment")
    _add_key_commands(keys)

    listing = commands.add_parser("models", help="list the advertised models")
    listing.add_argument("--build", metavar="NAME", help="build or convert NAME into the cache")

    server = argparse.ArgumentParser(add_help=False)
    server.add_argument("--url", help=f"default: TINKER_BASE_URL, else {watch.DEFAULT_URL}")
    server.add_argument("--key", help="an API key; default: TINKER_API_KEY")
    runs = commands.add_parser(
        "runs", parents=[server], help="list your runs: steps, last loss, status, loss curve"
    )
    runs.add_argument("--tag", default="", help="only the runs of sessions with this tag")
    runs.add_argument("--sweep", default="", help="only the runs of this sweep")
    runs.add_argument("--limit", type=int, default=50)
    run = commands.add_parser(
        "run", parents=[server], help="one run: its metrics by step and its latest requests"
    )
    run.add_argument("run_id")
    run.add_argument("--requests", type=int, default=20, help="how many requests to show")

    top = commands.add_parser(
        "top", parents=[server], help="the engines' duty cycle, queues and memory (admin keys)"
    )
    top.add_argument("--watch", action="store_true", help="redraw every two seconds")

    args = parser.parse_args(argv)
    if args.command in ("runs", "run", "top"):
        return _watch(args)
    if args.command == "up":
        grpc_port = args.grpc_port
        if grpc_port is None:
            grpc_port = 8001 if args.port == 8000 else 0
        return _up(
            args.host,
            args.port,
            grpc_port,
            args.data_dir or default_data_dir(),
            standby=not args.no_standby,
        )
    if args.command == "keys":
        return _keys(args)
    if args.command == "serve":
        sys.argv = [f"services.{args.service}"]
        runpy.run_module(f"services.{args.service}", run_name="__main__")
        return 0
    if args.build:
        print(models.materialize(args.build))
        return 0
    for spec in models.registry().values():
        print(
            f"{spec.name}\t{spec.arch}\tvocab {spec.vocab_size}\tcontext {spec.max_context_length}"
        )
    return 0


def _watch(args: argparse.Namespace) -> int:
    try:
        url, key = watch.connection(args.url, args.key)
        if args.command == "top":
            while True:
                text = watch.show_top(url, key)
                print(("\x1b[H\x1b[2J" if args.watch else "") + text, flush=True)
                if not args.watch:
                    break
                time.sleep(2.0)
        elif args.command == "runs":
            print(watch.show_runs(url, key, tag=args.tag, sweep=args.sweep, limit=args.limit))
        else:
            print(watch.show_run(url, key, args.run_id, requests=args.requests))
    except watch.Unanswered as error:
        print(f"tinsmith {args.command}: {error}", file=sys.stderr)
        return 1
    return 0


def _add_key_commands(keys: argparse.ArgumentParser) -> None:
    where = argparse.ArgumentParser(add_help=False)
    where.add_argument(
        "--nats-url",
        help="the deployment's NATS; default: TINSMITH_NATS_URL, else the running `tinsmith up` "
        "of --data-dir",
    )
    where.add_argument("--data-dir", type=Path, default=None, help=f"default: {default_data_dir()}")
    actions = keys.add_subparsers(dest="action", required=True)

    create = actions.add_parser(
        "create", parents=[where], help="issue a key for a tenant; the key is printed this once"
    )
    create.add_argument(
        "--tenant",
        required=True,
        type=_checked(tenants.check_tenant),
        help="who the key's calls are from: the owner of all they create",
    )
    create.add_argument("--admin", action="store_true", help="may see every tenant's usage")
    create.add_argument(
        "--label",
        default="",
        type=_checked(keyadmin.check_text, "label"),
        help="a note on the key (whose laptop, which job), shown by `keys list`",
    )
    for name, (_, bounds) in keyadmin.QUOTA_FLAGS.items():
        create.add_argument(
            f"--{name.replace('_', '-')}",
            dest=name,
            type=int,
            metavar="N",
            help=f"this key's quota of {bounds}; default: the deployment's",
        )

    actions.add_parser("list", parents=[where], help="every key issued, without secrets")

    revoke = actions.add_parser("revoke", parents=[where], help="refuse a key from now on")
    revoke.add_argument("key_id", metavar="KEY_ID", help="as `keys list` shows it, or the key")
    revoke.add_argument(
        "--reason",
        default="",
        type=_checked(keyadmin.check_text, "reason"),
        help="why, kept in the log and shown by `keys list`",
    )


def _checked(check: Callable[..., str], *extra: str) -> Callable[[str], str]:
    """An argparse type from a check that raises ``InvalidRequest``: its detail is the usage
    error."""

    def parse(value: str) -> str:
        try:
            return check(value, *extra)
        except TinsmithError as error:
            raise argparse.ArgumentTypeError(error.detail) from None

    return parse


def _keys(args: argparse.Namespace) -> int:
    data_dir = (args.data_dir or default_data_dir()).expanduser()
    try:
        source = keyadmin.locate(args.nats_url, data_dir)
        if args.action == "create":
            overrides = keyadmin.quotas(
                **{name: getattr(args, name) for name in keyadmin.QUOTA_FLAGS}
            )
            text = asyncio.run(
                keyadmin.create(
                    source, args.tenant, admin=args.admin, overrides=overrides, label=args.label
                )
            )
        elif args.action == "list":
            text = asyncio.run(keyadmin.list_keys(source))
        else:
            text = asyncio.run(keyadmin.revoke(source, args.key_id, args.reason))
    except TinsmithError as error:
        print(f"tinsmith keys {args.action}: {error.detail}", file=sys.stderr)
        return 1
    print(text, end="", flush=True)
    return 0


def _up(host: str, port: int, grpc_port: int, data_dir: Path, *, standby: bool = True) -> int:
    # First, and before anything starts: the mode the gateway will run in (it gets it from here).
    auth_mode = tenants.mode_from_env(host)
    print(_AUTH_LINES[auth_mode], flush=True)
    system = System(
        host=host,
        port=port,
        data_dir=data_dir.expanduser().resolve(),
        grpc_port=grpc_port,  # 0: a free one, picked at start
        auth_mode=auth_mode,
        standby=standby,
    )
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop like Ctrl-C while starting
    try:
        asyncio.run(system.start())
        # The ready line comes last; its last word is the HTTP URL.
        print(f"tinsmith gRPC at {system.grpc_target}", flush=True)
        for name in SERVICES:
            print(f"tinsmith {name} metrics at {system.metrics_url(name)}", flush=True)
        for name in SERVICES:
            device = system.facts.get(name, {}).get("device")
            if device:
                print(f"tinsmith {name} computes on {device}", flush=True)
        print(f"tinsmith console at {system.url}/console/", flush=True)
        print(f"tinsmith ready at {system.url}", flush=True)
        # From here a child that dies is started again (one line on stderr each time), until
        # Ctrl-C, SIGTERM or SIGHUP. The children run in sessions of their own, so a terminal's
        # Ctrl-C reaches only this process, which stops the services before the nats-server.
        system.supervise({signal.SIGINT, signal.SIGTERM, signal.SIGHUP})
        return 0
    except KeyboardInterrupt:
        return 0
    except (RuntimeError, TimeoutError) as exc:
        print(f"tinsmith: {exc}", file=sys.stderr)
        return 1
    finally:
        system.stop()


if __name__ == "__main__":
    sys.exit(main())
