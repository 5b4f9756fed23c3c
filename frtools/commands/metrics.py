"""``frtools metrics``: this host's ranks as a Prometheus exporter (docs/monitoring.md)."""

from __future__ import annotations

import contextlib
import signal
import threading
from pathlib import Path
from typing import Any

import click

from frtools.commands._common import OneLineCommand, fail, recorder_dir_option, run_guarded

PREFIX = "frtools metrics"


@click.command("metrics", cls=OneLineCommand)
@click.argument("job", required=False)
@click.option("--port", type=click.IntRange(0, 65535), help="Serve /metrics on this port.")
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Address to listen on (0.0.0.0: every interface; the metrics name hosts and ops).",
)
@click.option(
    "--textfile",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write node_exporter's textfile format to this file (a *.prom file in its "
    "--collector.textfile.directory) instead of serving.",
)
@click.option(
    "--interval",
    type=click.FloatRange(min=0.1),
    default=15.0,
    show_default=True,
    help="With --textfile: seconds between two writes.",
)
@click.option("--once", is_flag=True, help="With --textfile: write once and exit.")
@recorder_dir_option
def metrics(
    job: str | None,
    port: int | None,
    host: str,
    textfile: Path | None,
    interval: float,
    once: bool,
    root: str | None,
) -> None:
    """Export this host's ranks (all jobs, or JOB) as Prometheus metrics.

    \b
    frtools metrics --port 9464               serve http://127.0.0.1:9464/metrics
    frtools metrics --textfile DIR/frtools.prom   for node_exporter's textfile collector

    Every scrape reads the black boxes afresh; the job is never asked anything.
    """
    if (port is None) == (textfile is None):
        fail(PREFIX, "error: give one of --port P or --textfile PATH")
    from frtools.collect.live import read_jobs
    from frtools.collect.metrics import registry_for

    registry = registry_for(lambda: read_jobs(root, job))
    if textfile is not None:
        run_guarded(PREFIX, lambda: _write_every(registry, textfile, interval, once))
    assert port is not None
    run_guarded(PREFIX, lambda: _serve(registry, port, host))


def _stop_on_sigterm() -> threading.Event:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    return stop


def _write_every(registry: Any, textfile: Path, interval: float, once: bool) -> int:
    from frtools.collect.metrics import write_textfile

    stop = _stop_on_sigterm()
    while True:
        try:
            write_textfile(registry, textfile)
        except OSError as exc:
            fail(PREFIX, f"error: cannot write {textfile}: {exc.strerror or exc}")
        if once or stop.wait(interval):
            return 0


def _serve(registry: Any, port: int, host: str) -> int:
    from prometheus_client import start_http_server

    stop = _stop_on_sigterm()
    try:
        server, _ = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        fail(PREFIX, f"error: cannot listen on {host}:{port}: {exc.strerror or exc}")
    click.echo(f"serving http://{host}:{server.server_port}/metrics", err=True)
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C ends serving: not an error
        stop.wait()
    server.shutdown()
    return 0
