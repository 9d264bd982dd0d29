"""The layer contract (``[tool.importlinter]`` in pyproject.toml) holds, and breaks
when a module imports a floor above its own.

Each case copies the package's sources into a temporary tree, adds one import and
runs ``lint-imports`` on the copy with the project's own contract: the contract
must report that import by name. import-linter reads the sources (it never imports
them), so the copy needs no native module.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "python" / "ec_frontend"
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _contract() -> str:
    """The project's import-linter settings as a standalone ``.importlinter``-style TOML."""
    settings = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    lines = ["[tool.importlinter]"]
    lines += [f"{k} = {_toml(v)}" for k, v in settings.items() if k != "contracts"]
    for contract in settings["contracts"]:
        lines.append("[[tool.importlinter.contracts]]")
        lines += [f"{k} = {_toml(v)}" for k, v in contract.items()]
    return "\n".join(lines) + "\n"


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def _lint(tree: Path) -> subprocess.CompletedProcess[str]:
    config = tree / "contract.toml"
    config.write_text(_contract())
    return subprocess.run(
        [str(LINT_IMPORTS), "--config", str(config), "--no-cache"],
        cwd=tree,
        env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tree = tmp_path_factory.mktemp("layers")
    shutil.copytree(
        PACKAGE, tree / "ec_frontend", ignore=shutil.ignore_patterns("*.so", "__pycache__")
    )
    return tree


def _copy(pristine: Path, tmp_path: Path) -> Path:
    shutil.copytree(pristine / "ec_frontend", tmp_path / "ec_frontend")
    return tmp_path


def test_the_tree_keeps_the_contract(pristine: Path, tmp_path: Path) -> None:
    result = _lint(_copy(pristine, tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


# (module that gains the import, the import line, the importer -> imported pair reported)
UPWARD = [
    (
        "engine/core.py",
        "from ec_frontend.entrypoints.openai import server",
        "ec_frontend.engine.core -> ec_frontend.entrypoints.openai.server",
    ),
    (
        "connectors/factory.py",
        "from ec_frontend.engine import core",
        "ec_frontend.connectors.factory -> ec_frontend.engine.core",
    ),
    (
        "model/registry.py",
        "from ec_frontend.connectors import base",
        "ec_frontend.model.registry -> ec_frontend.connectors.base",
    ),
    (
        "config.py",
        "from ec_frontend.model import registry",
        "ec_frontend.config -> ec_frontend.model.registry",
    ),
    (
        "entrypoints/http/errors.py",
        "from ec_frontend.entrypoints.openai import jobs",
        "ec_frontend.entrypoints.http.errors -> ec_frontend.entrypoints.openai.jobs",
    ),
    (
        "entrypoints/launcher.py",
        "from ec_frontend.entrypoints import api_servers",
        "ec_frontend.entrypoints.launcher -> ec_frontend.entrypoints.api_servers",
    ),
    # Siblings on one floor are independent: the proxy never imports the OpenAI server.
    (
        "entrypoints/proxy/app.py",
        "from ec_frontend.entrypoints.openai import serving",
        "ec_frontend.entrypoints.proxy.app -> ec_frontend.entrypoints.openai.serving",
    ),
    # A type-only import counts too unless the contract lists it.
    (
        "model/loader.py",
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from ec_frontend.engine import scheduler",
        "ec_frontend.model.loader -> ec_frontend.engine.scheduler",
    ),
]


@pytest.mark.parametrize(("module", "line", "reported"), UPWARD, ids=[u[0] for u in UPWARD])
def test_an_upward_import_breaks_the_contract(
    pristine: Path, tmp_path: Path, module: str, line: str, reported: str
) -> None:
    tree = _copy(pristine, tmp_path)
    path = tree / "ec_frontend" / module
    path.write_text(path.read_text() + "\n" + line + "\n")
    result = _lint(tree)
    assert result.returncode != 0, result.stdout
    assert "1 broken" in result.stdout
    assert reported in result.stdout
