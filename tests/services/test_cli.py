"""The shardcache command line against the real cluster, Redis and S3 emulator."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from shardcache_server.cli import app
from shardcache_server.index import ClusterIndex

pytestmark = pytest.mark.slow


def test_cli_warm_stats_ls_invalidate_roundtrip(
    ray_cluster, s3, s3fs_client, bucket, redis_url, namespace
):
    s3fs_client.pipe({f"{bucket}/w/{i:02d}.bin": bytes([i]) * 100 for i in range(20)})
    runner = CliRunner()
    common = ["--redis-url", redis_url, "--namespace", namespace]
    s3.reset_counts()
    warm = [
        "warm",
        f"s3://{bucket}/w/",
        "--name",
        "warmed",
        "--chunk-samples",
        "5",
        "--endpoint-url",
        s3.endpoint_url,
        "-o",
        "key=testing",
        "-o",
        "secret=testing",
        *common,
    ]
    res = runner.invoke(app, warm)
    assert res.exit_code == 0, res.output
    assert "20 objects, 20 fetched" in res.output and s3.total_gets == 20
    again = runner.invoke(app, warm)
    assert "20 already cached" in again.output and s3.total_gets == 20
    # Each warm lists the source anew, as a job does: a rewritten object is
    # read again (its chunk rebuilt around it), never the last listing's.
    s3fs_client.pipe({f"{bucket}/w/07.bin": b"new" * 50})
    rewritten = runner.invoke(app, warm)
    assert rewritten.exit_code == 0, rewritten.output
    assert "1 fetched, 19 already cached" in rewritten.output
    assert s3.total_gets == 21
    owners = ClusterIndex.from_url(redis_url, namespace).owners("warmed", 1)
    assert (
        len({o.split("/")[0] for o in owners.values()}) == 2
    )  # spread over both nodes
    stats = runner.invoke(app, ["stats", "warmed", *common])
    assert stats.exit_code == 0 and "warmed" in stats.output
    ls = runner.invoke(app, ["ls", *common])
    assert ls.exit_code == 0 and re.search(r"warmed\s+│\s+1\s+│\s+20", ls.output)
    assert re.search(r"memory\s.*disk", ls.output.split("\n")[1])
    inv = runner.invoke(app, ["invalidate", "warmed", *common])
    assert inv.exit_code == 0 and "now generation 2" in inv.output
    missing = runner.invoke(app, ["invalidate", "nope", *common])
    assert missing.exit_code == 2 and "no dataset named 'nope'" in missing.output


def test_cli_warm_that_read_nothing_says_so_and_fails(
    ray_cluster, s3, s3fs_client, bucket, redis_url, namespace
):
    from shardcache_server.emulator import FaultPlan

    s3fs_client.pipe({f"{bucket}/f/{i:02d}.bin": bytes([i]) * 100 for i in range(6)})
    runner = CliRunner()
    warm = [
        "warm", f"s3://{bucket}/f/", "--name", "failing", "--endpoint-url",
        s3.endpoint_url, "-o", "key=testing", "-o", "secret=testing",
        "--redis-url", redis_url, "--namespace", namespace,
    ]  # fmt: skip
    # Every GET fails (the listing does not): each read is retried, then
    # given up; nothing is cached, and warm must not say "6 fetched".
    s3.set_faults(FaultPlan(error_rate=1.0, error_status=500))
    try:
        res = runner.invoke(app, warm)
    finally:
        s3.set_faults(FaultPlan())
    assert res.exit_code == 2, res.output
    assert (
        "RemoteFetchError" in res.output and "did not cache every sample" in res.output
    )
    assert "fetched" not in res.output
    # Objects that read but do not decode: cached as failed rows, named.
    res = runner.invoke(app, [*warm, "--preprocess", "decode_image", "--force"])
    assert res.exit_code == 2, res.output
    assert "PreprocessError" in res.output and f"{bucket}/f/" in res.output
    said = " ".join(res.output.split())  # rich wraps the line
    assert "6 of 6 samples are cached as failed rows" in said, res.output
    assert "0 of 6" not in said
    # Run again, the chunks are cached (with those rows failed): still exit 2.
    again = runner.invoke(app, [*warm, "--preprocess", "decode_image"])
    assert again.exit_code == 2, again.output
    said = " ".join(again.output.split())  # rich wraps the line
    assert "6 of 6 samples are cached as failed rows" in said, again.output
    assert "PreprocessError" in again.output and f"{bucket}/f/" in again.output
    # The source readable again: the same warm caches all of it.
    res = runner.invoke(app, [*warm, "--force"])
    assert res.exit_code == 0 and "6 objects, 6 fetched" in res.output, res.output


def test_cli_errors_are_one_line_without_traceback(s3, redis_url):
    runner = CliRunner()
    res = runner.invoke(
        app,
        [
            "warm",
            "s3://no-such-bucket-zz/x/",
            "--endpoint-url",
            s3.endpoint_url,
            "-o",  # the stores list the source: they get the credentials
            "key=testing",
            "-o",
            "secret=testing",
            "--redis-url",
            redis_url,
        ],
    )
    assert res.exit_code == 2
    assert "SourceNotFound" in res.output and "Traceback" not in res.output
    bad = runner.invoke(app, ["stats", "--redis-url", "redis://:wrong@127.0.0.1:1/0"])
    assert (
        bad.exit_code == 1  # cannot be reached: as when nothing runs
        and "IndexUnavailable" in bad.output
        and "wrong" not in bad.output
    )


def test_cli_read_only_commands_start_nothing_and_say_so(tmp_path, monkeypatch):
    home = tmp_path / "state"
    monkeypatch.setenv("SHARDCACHE_HOME", str(home))
    monkeypatch.delenv("SHARDCACHE_REDIS_URL", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    runner = CliRunner()
    for args in (["ls"], ["stats"], ["stats", "x"], ["verify", "x"],
                 ["invalidate", "x"], ["dashboard"]):  # fmt: skip
        res = runner.invoke(app, args)
        assert res.exit_code == 1, (args, res.output)
        assert "nothing running" in res.output and "Traceback" not in res.output
    # Nothing was started, so nothing was recorded.
    assert not (home / "redis.json").exists() and not (home / "ray.json").exists()


def test_cli_unknown_dataset_name_exits_2_in_every_command(redis_url, namespace):
    runner = CliRunner()
    common = ["--redis-url", redis_url, "--namespace", namespace]
    for command in ("stats", "verify", "invalidate"):
        res = runner.invoke(app, [command, "no-such-set", *common])
        assert res.exit_code == 2, (command, res.output)
        assert "no dataset named 'no-such-set'" in res.output


def test_cli_selftest_passes_against_running_cache(ray_cluster, redis_url, namespace):
    runner = CliRunner()
    res = runner.invoke(
        app,
        [
            "selftest",
            "--ray-address",
            ray_cluster.address,
            "--redis-url",
            redis_url,
            "--namespace",
            namespace,
        ],
    )
    assert res.exit_code == 0, res.output
    assert "read back as hits" in res.output


def _demo(*extra: str) -> str:
    """Run ``shardcache demo`` on 64 images for 2 epochs; returns its stdout."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "shardcache_server.cli", "demo", *extra,
         "--images", "64", "--epochs", "2", "--batch-size", "16"],
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_demo_main_job_runs_end_to_end(tmp_path):
    out = _demo()
    assert "zero remote reads" in out
    assert "S3 GETs 64" in out and "S3 GETs 0" in out


def test_demo_over_webdataset_tar_shards_reads_each_unit_once_then_never(tmp_path):
    out = _demo("--format", "tar")
    assert "as WebDataset tar shards" in out
    # One shard of one unit, read once in epoch 1 (by the listing at
    # construction, which keeps the unit for its build); the warm epoch
    # reads nothing.
    assert "S3 GETs 1" in out and "S3 GETs 0" in out


def test_ls_names_memory_and_disk_per_node():
    from shardcache_server.cli.datasets import _per_node

    stores = {
        "aaaaaaaa11": {"bytes_by_dataset": {"d": 2**20}},
        "bbbbbbbb22": {"disk_bytes_by_dataset": {"d": 3 * 2**20}},
    }
    assert _per_node(stores, "bytes_by_dataset", "d") == "aaaaaaaa: 1.0"
    assert _per_node(stores, "disk_bytes_by_dataset", "d") == "bbbbbbbb: 3.0"
    assert _per_node(stores, "disk_bytes_by_dataset", "other") == "-"


def test_cli_tables_wider_than_the_terminal_are_printed_whole(monkeypatch):
    """Rich fits a table to 80 columns by cutting cells ("sour…", "2…"); a
    figure cut that way is a figure the user cannot read."""
    import io

    from rich.console import Console
    from rich.table import Table

    from shardcache_server.cli import options

    out = io.StringIO()
    monkeypatch.setattr(options, "console", Console(file=out, width=80))
    cells = ["s3-my-bucket-train-5f2a9c1e", "torchrun-none-1732671234-ab12",
             "2700", "66.7%", "1800", "0", "900", "1800", "0.12", "source-bytes"]  # fmt: skip
    table = Table(*[f"column {i}" for i in range(len(cells))])
    table.add_row(*cells)
    options.print_table(table)
    text = out.getvalue()
    assert "…" not in text and all(cell in text for cell in cells), text
    out.seek(0)
    out.truncate(0)
    narrow = Table("dataset", "samples")
    narrow.add_row("d", "12")
    options.print_table(narrow)
    assert max(map(len, out.getvalue().splitlines())) <= 80


def test_cli_help_lists_each_command_on_one_line_when_there_is_room():
    """The command list shows each docstring's first paragraph as one line;
    the source's line ends used to cut it mid-sentence at any width."""
    wide = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "250"})
    assert wide.exit_code == 0
    lines = wide.output.splitlines()
    for command, tail in (
        ("invalidate", "Exit 1 when nothing runs, 2 for an unknown name."),
        ("ls", "on the disk tier (exit 1 when nothing runs)."),
        ("warm", "on its node."),
    ):
        (line,) = [ln for ln in lines if ln.startswith(f"│ {command} ")]
        assert tail in line, line
