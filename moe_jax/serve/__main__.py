"""`python -m moe_jax.serve RUN_DIR ...`: load a run (or a Hugging Face directory) as
sample.py does, build the engine, serve it with uvicorn until SIGINT / SIGTERM (uvicorn's
graceful shutdown: no new connections, requests in flight finish within
--shutdown-timeout seconds), then stop as every command does: `error: stopped by SIGTERM`,
exit 143 (130 for SIGINT). `--speculative` (or the override sample.speculative=true, as
sample.py takes it) decodes by speculation with the model's MTP layers (`--draft-depth` or
sample.draft_depth of them drafting).

Before it listens it compiles what a first request runs (a one-row prefill and decode, greedy
and sampled): /health answers once that is done, and the first request does not wait for a
compile. While serving it prints a line per finished request and, every --log-stats-every
seconds that saw work, the throughput, the running and waiting requests and the KV pages
in use (vLLM's periodic line)."""

from __future__ import annotations

import argparse
import signal
import socket
import sys
from pathlib import Path

from moe_jax.run.door import HelpFormatter, command, say
from moe_jax.run.output import stop_exception

# Engine keyword -> its flag, for the engine's own size checks (`size_problem`).
SIZE_FLAGS = {"max_slots": "--max-slots", "page_size": "--page-size", "n_pages": "--pages",
              "chunk": "--chunk", "max_queue": "--max-queue"}  # fmt: skip


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="moe-jax serve",
        description=__doc__,
        formatter_class=HelpFormatter,
    )
    p.add_argument("run", help="a run directory (or a Hugging Face model directory)")
    p.add_argument("overrides", nargs="*", help="config overrides as sample.py takes them")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-slots", type=int, default=8, help="requests decoded at once")
    p.add_argument("--max-queue", type=int, default=256, help="waiting requests before 429")
    p.add_argument("--page-size", type=int, default=16, help="positions per KV page")
    p.add_argument("--pages", type=int, default=None, help="KV pages (default: full contexts)")
    p.add_argument("--chunk", type=int, default=64, help="prefill chunk, in tokens")
    p.add_argument("--speculative", action="store_true", help="draft with the model's MTP layers")
    p.add_argument(
        "--draft-depth", type=int, default=None, help="MTP depths that draft (default: all)"
    )
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    p.add_argument("--model-name", default=None, help="the model's id (default: the dir name)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0)
    p.add_argument(
        "--log-stats-every", type=float, default=10.0, help="seconds between stats lines; 0: none"
    )
    return p.parse_args(argv)


def check_flags(args) -> str | None:
    """The first flag no server can run with, as a message (before the model loads: a page
    size of 0 once failed after the load, a chunk of 0 served and never answered)."""
    from moe_jax.inference.engine.sizes import size_problem

    sizes = {name: getattr(args, flag[2:].replace("-", "_")) for name, flag in SIZE_FLAGS.items()}
    if problem := size_problem(sizes, SIZE_FLAGS.get):
        return problem
    if not 0 <= args.port <= 65535:
        return f"--port must be in 0..65535 (0: any free port), got {args.port}"
    if args.shutdown_timeout < 0:
        return f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}"
    if args.log_stats_every < 0:
        return f"--log-stats-every must be >= 0 (0: no stats lines), got {args.log_stats_every}"
    return None


def listen(host: str, port: int) -> socket.socket | str:
    """A socket bound to (host, port), for uvicorn to serve on, or why none can be: bound
    before the model loads, so a port in use or a host not here fails in a second."""
    where = f"{host}:{port}"
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:  # socket.gaierror: a host that does not resolve
        return f"cannot listen on {where}: {e.strerror or e}; give another --host"
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        sock.bind(address)
    except OSError as e:
        sock.close()
        return f"cannot listen on {where}: {e.strerror or e}; give another --host or --port"
    return sock


def install_hint(extra: str) -> str:
    """The pip command that adds `extra` to moe_jax as it is installed here: in a clone (an
    editable install, or run from the clone) the clone's own, else the package's."""
    clone = Path(__file__).resolve().parents[2]
    if (clone / "pyproject.toml").is_file() and (clone / "moe_jax").is_dir():
        return f"pip install -e '{clone}[{extra}]'"
    return f"pip install 'moe_jax[{extra}]'"


def engine_for(args, cfg, sampler, tokenizer):
    """The engine the flags ask for (an EngineError, one line, if it cannot be built)."""
    from moe_jax.inference.engine import Engine

    return Engine(
        sampler,
        max_slots=args.max_slots,
        page_size=args.page_size,
        n_pages=args.pages,
        chunk=args.chunk,
        max_queue=args.max_queue,
        vocab_size=tokenizer.vocab_size,
        speculative=args.speculative or cfg.sample.speculative,
        draft_depth=args.draft_depth,
    )


@command
def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        import uvicorn

        from moe_jax.serve.app import create_app
    except ImportError as e:
        return say(f"the server needs the serve extra ({install_hint('serve')}): {e}")
    if problem := check_flags(args):
        return say(problem)
    sock = listen(args.host, args.port)
    if isinstance(sock, str):
        return say(sock)
    with sock:
        return serve(args, sock, uvicorn, create_app)


def serve(args, sock: socket.socket, uvicorn, create_app) -> int:
    """Load the run and serve it on `sock` until a signal stops uvicorn."""
    from moe_jax.inference.load import load_sampler

    # Until uvicorn serves, a signal stops the command as any other (moe_jax.run.door).
    cfg, sampler, tokenizer = load_sampler(args.run, args.overrides, args.step)
    engine = engine_for(args, cfg, sampler, tokenizer)
    from moe_jax.serve.worker import warm_up

    print(f"compiled the first request's programs in {warm_up(engine):.1f} s", flush=True)
    name = args.model_name or Path(args.run).resolve().name
    log = lambda line: print(line, flush=True)  # noqa: E731
    app = create_app(engine, tokenizer, name, log, args.log_stats_every)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level="warning",
        timeout_graceful_shutdown=args.shutdown_timeout,
    )
    # uvicorn shuts down gracefully on SIGINT / SIGTERM, then raises the signal again for the
    # handler it found installed: this one notes it, for the stop to end the command after
    # the drain as every command's stop does (docs/errors.md: one line, 128 + the signal's number).
    stopped_by = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: stopped_by.append(signum))
    port = sock.getsockname()[1]  # --port 0: the free one the system gave
    print(f"serving '{name}' on http://{args.host}:{port}/v1", flush=True)
    uvicorn.Server(config).run(sockets=[sock])
    if stopped_by:  # the requests in flight have finished: now the door's stop line
        raise stop_exception(stopped_by[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
