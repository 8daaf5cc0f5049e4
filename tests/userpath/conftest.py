"""The user's path: README snippets run as a user runs them.

Every test here starts a script file the way the README shows it:
``python -m torch.distributed.run --nproc_per_node=2 train.py`` (or plain
``python train.py``) with the default environment: no ``--rdzv-id`` (so
torchrun's run id is ``none`` in the static form), no ``job=``, no
``close()``, embedded defaults (``redis_url=None``, ``ray_address=None``).
The S3 source is the session's moto server, reached through the
``storage_options`` the README shows.

Two fixtures give a test a user's machine (a :class:`UserMachine`):

``user`` (the default; use it unless the test is about the cold start)
    The machine of this test *module*: one HOME per module, in the state a
    user's machine is in after ``scripts/demo.sh`` has run once
    (``~/.ray/auth_token`` exists, nothing of the demo is left running),
    and a working directory of the test's own. The module's first script
    starts the embedded Redis and Ray head, as a user's first script does;
    every later script, in this test or the next, finds them running, as
    every script after a user's first does. ``shardcache local stop``
    under that HOME runs once, after the module's last test, and after any
    test that failed (so one broken head never fails the tests after it).
    What the module's tests share is therefore one cache: give datasets
    names (buckets, folders, ``name=``) of their own per test, and count
    GETs, jobs and samples for what the test itself ran.

``fresh_user``
    A HOME of the test's own, after the demo, stopped at the end of the
    test: for tests of the cold start itself, ``local stop``, tokens and
    auth (``test_embedded_ray.py``), which must start their own head.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from shardcache.embedded import free_port

# Scripts the tests start as a user would; never imported by pytest (the
# suite runs with --doctest-modules, which imports every module it finds).
collect_ignore_glob = ["trainer_scripts/*"]

SCRIPT_TIMEOUT_S = 240  # a script's whole run, Ray head start included
TEST_TIMEOUT_S = 360  # a test runs a few scripts (the longest ~70 s here)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(pytest.mark.slow)
            item.add_marker(pytest.mark.timeout(TEST_TIMEOUT_S))


@dataclass
class UserMachine:
    """A user's machine: a HOME of its own, and a way to run their scripts."""

    home: Path
    workdir: Path

    @property
    def env(self) -> dict[str, str]:
        """The environment a user's shell has: HOME, PATH with the venv, AWS
        test credentials; nothing shardcache- or torchrun-specific."""
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("SHARDCACHE_", "TORCHELASTIC_", "RAY_"))
            and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                          "MASTER_PORT", "PYTEST_CURRENT_TEST")
        }  # fmt: skip
        env["HOME"] = str(self.home)
        env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
        env.update(
            AWS_ACCESS_KEY_ID="testing",
            AWS_SECRET_ACCESS_KEY="testing",
            AWS_DEFAULT_REGION="us-east-1",
        )
        return env

    def write(self, name: str, source: str) -> Path:
        """A script file in the user's working directory."""
        path = self.workdir / name
        path.write_text(textwrap.dedent(source))
        return path

    def python(
        self, *args: str, timeout: int = SCRIPT_TIMEOUT_S, env: dict | None = None
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, *args],
            cwd=self.workdir,
            env={**self.env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def torchrun(
        self, script: Path | str, *args: str, nproc: int = 2, **kw
    ) -> subprocess.CompletedProcess[str]:
        """``python -m torch.distributed.run --nproc_per_node=N script``: the
        static form a multi-node launch uses (run id ``none``), on a free
        master port so consecutive jobs never share a store."""
        return self.python(*_torchrun(script, nproc), *args, **kw)

    def start_torchrun(
        self, script: Path | str, *args: str, log: Path, nproc: int = 2
    ) -> subprocess.Popen[bytes]:
        """:meth:`torchrun` started in the background (jobs that overlap), its
        output going to ``log`` (a pipe nobody reads would fill and block it)."""
        with open(log, "wb") as out:
            return subprocess.Popen(
                [sys.executable, *_torchrun(script, nproc), *args],
                cwd=self.workdir,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def shardcache(self, *args: str, **kw) -> subprocess.CompletedProcess[str]:
        return self.python("-m", "shardcache_server.cli", *args, **kw)


def _torchrun(script: Path | str, nproc: int) -> list[str]:
    return [
        "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
        "--master-addr=127.0.0.1", f"--master-port={free_port()}", str(script),
    ]  # fmt: skip


def after_the_demo(home: Path) -> None:
    """What ``scripts/demo.sh`` leaves behind on a user's machine: Ray's
    token file (its local ``ray.init()`` wrote it) and nothing running."""
    ray_dir = home / ".ray"
    ray_dir.mkdir(parents=True, exist_ok=True)
    token = ray_dir / "auth_token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)


_FAILED = pytest.StashKey[bool]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Iterator[pytest.TestReport]:
    report = yield
    if report.failed:  # in set-up or the run: the head may be why
        item.stash[_FAILED] = True
    return report


def _machine(root: Path) -> UserMachine:
    """A user's machine under ``root`` after the demo ran once."""
    home = root / "home"
    home.mkdir()
    after_the_demo(home)
    workdir = root / "work"
    workdir.mkdir()
    return UserMachine(home, workdir)


def _stop(machine: UserMachine) -> None:
    """``shardcache local stop`` under the machine's HOME."""
    machine.shardcache("local", "stop", timeout=60)


@pytest.fixture(scope="module")
def module_machine(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[UserMachine]:
    """The HOME the ``user`` fixture shares across a test module; its
    embedded Redis and Ray head are stopped after the module's last test."""
    machine = _machine(tmp_path_factory.mktemp("user"))
    yield machine
    _stop(machine)


@pytest.fixture
def user(
    module_machine: UserMachine, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[UserMachine]:
    """A user's machine after the demo ran once, shared by the test module
    (see the module docstring): the module's HOME and a working directory
    of this test's own. After a failed test, what the scripts started is
    stopped, so the next test starts from the demo's state again."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    yield UserMachine(module_machine.home, workdir)
    if request.node.stash.get(_FAILED, False):
        _stop(module_machine)


@pytest.fixture
def fresh_user(tmp_path: Path) -> Iterator[UserMachine]:
    """A user's machine after the demo ran once, of this test alone: its
    first script starts Redis and the Ray head cold; stopped at the end."""
    machine = _machine(tmp_path)
    yield machine
    _stop(machine)
