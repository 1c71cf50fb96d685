"""Release hygiene (issue 29, item 11): the LICENSE is the license pyproject names and ships in the
wheel; CHANGELOG.md is in Keep a Changelog form and its newest release is the package's version,
which is written once (remote_ops/__init__.py) and is what `remote-ops --version` prints and what
the wheel's metadata carries.

Pure: reads files, runs this checkout's CLI, and builds the wheel from a copy of the sources
(setuptools' own build, no network, nothing written into the checkout)."""

from __future__ import annotations

import datetime
import hashlib
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import run_cli

import remote_ops

tomllib = pytest.importorskip("tomllib", reason="pyproject is read with Python 3.11's tomllib")

ROOT = Path(__file__).resolve().parent.parent
CHANGELOG = ROOT / "CHANGELOG.md"

#: sha256 of the Apache License 2.0 text as the ASF publishes it
#: (https://www.apache.org/licenses/LICENSE-2.0.txt; Debian's /usr/share/common-licenses/Apache-2.0).
APACHE_2_0_SHA256 = "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"

#: `## [1.2.3] - 2026-12-02` (Keep a Changelog 1.1.0); `## [Unreleased]` above them.
RELEASE = re.compile(r"^## \[(?P<version>\d+\.\d+\.\d+)\] - (?P<date>\d{4}-\d{2}-\d{2})$", re.M)
CHANGE_TYPES = {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def releases() -> list[tuple[str, str]]:
    """(version, date) of every numbered release in CHANGELOG.md, newest first as written."""
    return [(m["version"], m["date"]) for m in RELEASE.finditer(CHANGELOG.read_text())]


def test_the_license_file_is_the_license_pyproject_names():
    project = _pyproject()["project"]
    assert project["license"] == "Apache-2.0"  # an SPDX expression (PEP 639)
    assert project["license-files"] == ["LICENSE"]
    assert hashlib.sha256((ROOT / "LICENSE").read_bytes()).hexdigest() == APACHE_2_0_SHA256


def test_the_changelog_keeps_a_changelog_form():
    text = CHANGELOG.read_text()
    headings = re.findall(r"^## .*$", text, re.M)
    assert text.startswith("# Changelog\n") and "keepachangelog.com" in text
    assert headings[0] == "## [Unreleased]", "the first section is [Unreleased]"
    assert all(RELEASE.fullmatch(h) for h in headings[1:]), f"a release heading is not '## [X.Y.Z] - DATE': {headings}"
    found = releases()
    assert found, "no numbered release"
    versions = [tuple(map(int, v.split("."))) for v, _ in found]
    assert versions == sorted(versions, reverse=True) and len(set(versions)) == len(versions), "newest first, once each"
    dates = [datetime.date.fromisoformat(d) for _, d in found]
    assert dates == sorted(dates, reverse=True), "release dates go back in time down the file"
    types = set(re.findall(r"^### (.*)$", text, re.M))
    assert types <= CHANGE_TYPES, f"change types Keep a Changelog does not have: {types - CHANGE_TYPES}"


def test_the_newest_release_is_the_package_version():
    (newest, _), *_ = releases()
    assert remote_ops.__version__ == newest, (
        f"CHANGELOG.md's newest release is {newest}, remote_ops.__version__ is {remote_ops.__version__}: "
        "move the [Unreleased] entries under a new release and set __version__ to it (or the reverse)"
    )


def test_the_version_is_written_once():
    config = _pyproject()
    assert "version" not in config["project"] and "version" in config["project"]["dynamic"]
    assert config["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "remote_ops.__version__"}


def test_remote_ops_version_prints_it(tmp_path):
    rc, out, _ = run_cli({**os.environ, "REMOTE_OPS_STATE_DIR": str(tmp_path)}, "--version")
    assert rc == 0 and out.splitlines()[0] == f"remote-ops {remote_ops.__version__}"


def test_the_wheel_carries_the_version_and_the_license(tmp_path):
    """A wheel built by setuptools from a copy of the sources: METADATA names the version, the SPDX
    license and the license file, and the file is in the wheel byte for byte."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "LICENSE", "CHANGELOG.md"):
        shutil.copy2(ROOT / name, src / name)
    (src / "docs").mkdir()
    shutil.copy2(ROOT / "docs" / "pypi.md", src / "docs" / "pypi.md")
    for folder in ("remote_ops", "templates", "docker", "inventory"):  # the package-dir resources
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    build = "import sys; from setuptools import build_meta; print(build_meta.build_wheel(sys.argv[1]))"
    done = subprocess.run(
        [sys.executable, "-c", build, str(tmp_path / "dist")], cwd=src, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    wheel = tmp_path / "dist" / done.stdout.strip().splitlines()[-1]
    version = remote_ops.__version__
    with zipfile.ZipFile(wheel) as whl:
        info = f"remote_ops-{version}.dist-info"
        metadata = whl.read(f"{info}/METADATA").decode().partition("\n\n")[0].splitlines()
        shipped = whl.read(f"{info}/licenses/LICENSE")
    assert f"Version: {version}" in metadata
    assert "License-Expression: Apache-2.0" in metadata and "License-File: LICENSE" in metadata
    assert shipped == (ROOT / "LICENSE").read_bytes()
