"""The images' pins agree with pyproject.toml and the chart (no image is built here).

scripts/build_images.sh builds and selftests the images for real; it takes
minutes and root, so the suite only checks what can drift silently.
"""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

import yaml
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]
DEPENDENCIES = {
    r.name: r for r in map(Requirement, PYPROJECT["project"]["dependencies"])
}


def _pins(dockerfile: str) -> dict[str, str]:
    """``name==version`` strings in a Dockerfile's RUN lines: {name: version}."""
    text = (ROOT / "docker" / dockerfile).read_text()
    return {
        Requirement(m).name: str(Requirement(m).specifier).removeprefix("==")
        for m in re.findall(r'"([A-Za-z0-9_.\-\[\],]+==[^"]+)"', text)
    }


def test_cache_image_pins_ray_and_torch_as_pyproject_and_bootstrap():
    pins = _pins("cache.Dockerfile")
    assert f"=={pins['ray']}" == str(DEPENDENCIES["ray"].specifier)
    bootstrap = (ROOT / "scripts" / "bootstrap.sh").read_text()
    torch = re.search(r'"torch==([^"]+)"', bootstrap)
    assert torch and pins["torch"] == f"{torch.group(1)}+cpu"
    assert DEPENDENCIES["torch"].specifier.contains(pins["torch"])
    text = (ROOT / "docker" / "cache.Dockerfile").read_text()
    assert f"ARG BASE_IMAGE=rayproject/ray:{pins['ray']}-py311-cpu" in text


def test_dashboard_image_pins_satisfy_pyproject_ranges():
    pins = _pins("dashboard.Dockerfile")
    assert pins
    for name, version in pins.items():
        assert name in DEPENDENCIES, f"{name} is not a dependency in pyproject.toml"
        assert DEPENDENCIES[name].specifier.contains(version), (
            f"dashboard.Dockerfile pins {name}=={version}, outside pyproject's "
            f"{DEPENDENCIES[name].specifier}"
        )
    assert "ray" not in pins and "torch" not in pins


def test_images_install_the_wheel_of_the_project_version_and_chart_tag():
    chart = yaml.safe_load((ROOT / "helm" / "shardcache" / "Chart.yaml").read_text())
    assert chart["appVersion"] == VERSION
    for name in ("cache.Dockerfile", "dashboard.Dockerfile"):
        wheels = re.findall(
            r"shardcache-([^-]+)-py3-none-any\.whl",
            (ROOT / "docker" / name).read_text(),
        )
        assert wheels and set(wheels) == {VERSION}, name


def test_build_images_script_parses():
    script = ROOT / "scripts" / "build_images.sh"
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert script.stat().st_mode & 0o111, "build_images.sh is not executable"
