"""The ``tinsmith`` command: ``up`` runs everything, ``serve`` runs one service, ``models`` lists
and builds the built-in models.

Owns: argument parsing and process lifetime at the top. Does not own: what the services do.
"""

from __future__ import annotations

import argparse
import asyncio
import runpy
import signal
import sys
from pathlib import Path

from tinsmith import models
from tinsmith.embedded import SERVICES, System, default_data_dir


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

    serve = commands.add_parser("serve", help="run one service against TINSMITH_NATS_URL")
    serve.add_argument("service", choices=SERVICES)

    listing = commands.add_parser("models", help="list the advertised models")
    listing.add_argument("--build", metavar="NAME", help="build or convert NAME into the cache")

    args = parser.parse_args(argv)
    if args.command == "up":
        grpc_port = args.grpc_port
        if grpc_port is None:
            grpc_port = 8001 if args.port == 8000 else 0
        return _up(args.host, args.port, grpc_port, args.data_dir or default_data_dir())
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


def _up(host: str, port: int, grpc_port: int, data_dir: Path) -> int:
    system = System(
        host=host,
        port=port,
        data_dir=data_dir.expanduser().resolve(),
        grpc_port=grpc_port,  # 0: a free one, picked at start
    )
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop like Ctrl-C while starting
    try:
        asyncio.run(system.start())
        # Block the stop signals only now, after the children were started (they inherit the
        # mask), and wait for them, or for a child to exit.
        watched = {signal.SIGINT, signal.SIGTERM, signal.SIGCHLD}
        signal.pthread_sigmask(signal.SIG_BLOCK, watched)
        # The ready line comes last; its last word is the HTTP URL.
        print(f"tinsmith gRPC at {system.grpc_target}", flush=True)
        for name in SERVICES:
            print(f"tinsmith {name} metrics at {system.metrics_url(name)}", flush=True)
        print(f"tinsmith ready at {system.url}", flush=True)
        while True:
            info = signal.sigtimedwait(watched, 5.0)
            if info is not None and info.si_signo in (signal.SIGINT, signal.SIGTERM):
                return 0
            exited = system.first_exit()
            if exited:
                print(
                    f"tinsmith: {exited} exited; stopping (logs in {system.log_dir})",
                    file=sys.stderr,
                )
                return 1
    except KeyboardInterrupt:
        return 0
    except (RuntimeError, TimeoutError) as exc:
        print(f"tinsmith: {exc}", file=sys.stderr)
        return 1
    finally:
        system.stop()


if __name__ == "__main__":
    sys.exit(main())
