"""The launcher's HTTP flags (`pipespec serve` and `python -m pipespec.cluster.launch`), refused before
anything starts: a flag of the HTTP server without `--http-port`, a media directory that is not one, a
negative `--drain-seconds`.
(Serving over HTTP itself starts Ray: tests/test_cli.py and tests/test_cluster_faults.py.)"""

from __future__ import annotations

import pytest

from pipespec import cli
from pipespec.cluster import launch


@pytest.mark.parametrize("main", [cli.main, launch.main], ids=["pipespec serve", "cluster.launch"])
@pytest.mark.parametrize(
    "flags, why",
    [
        (["--http-host", "0.0.0.0"], "--http-host and --allowed-local-media-path are for the HTTP server: give --http-port too"),
        (
            ["--allowed-local-media-path", "."],
            "--http-host and --allowed-local-media-path are for the HTTP server: give --http-port too",
        ),
        (
            ["--http-port", "0", "--allowed-local-media-path", "no/such/dir"],
            "--allowed-local-media-path 'no/such/dir' is not a directory",
        ),
    ],
)
def test_http_flags_that_cannot_serve_are_refused_at_once(main, flags, why, capsys):
    argv = ["mock3", *flags]
    assert main(["serve", *argv] if main is cli.main else argv) == 2
    assert capsys.readouterr().err == f"pipespec: {why}\n"


@pytest.mark.parametrize("main", [cli.main, launch.main], ids=["pipespec serve", "cluster.launch"])
def test_a_negative_drain_is_refused_at_once(main, capsys):
    argv = ["mock3", "--drain-seconds", "-1"]
    assert main(["serve", *argv] if main is cli.main else argv) == 2
    assert capsys.readouterr().err == "pipespec: --drain-seconds must be >= 0, got -1\n"
