"""The wheel installs exactly one top-level name, `genrec_spec`, with every subpackage in it."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {
    "genrec_spec": "genrec_spec",
    "kernels": "genrec_spec/kernels",
    "models": "genrec_spec/models",
    "data_pipelines": "genrec_spec/data_pipelines",
}


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory) -> set[str]:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
            str(ROOT),
        ],
        check=True,
    )
    (wheel,) = out.glob("genrec_spec-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        return set(zf.namelist())


def test_wheel_has_one_top_level_name(wheel_names):
    top = {name.split("/")[0] for name in wheel_names if ".dist-info" not in name}
    assert top == {"genrec_spec"}


def test_every_source_package_is_in_the_wheel(wheel_names):
    expected = set()
    for folder, installed in FOLDERS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.relative_to(ROOT / folder)
            expected.add(f"{installed}/{rel.as_posix()}")
    missing = expected - wheel_names
    assert not missing, (
        f"add these packages to pyproject.toml [tool.setuptools] packages: {missing}"
    )


def test_the_kernels_cpp_source_is_in_the_wheel(wheel_names):
    # kernels/q4.py compiles it on first use, from the installed package
    assert "genrec_spec/kernels/q4.cpp" in wheel_names


def _all_commands(table, prefix=()):
    import importlib

    for name, (module_name, _) in table.items():
        module = importlib.import_module(module_name)
        if hasattr(module, "COMMANDS"):
            yield from _all_commands(module.COMMANDS, (*prefix, name))
        else:
            yield (*prefix, name)


def test_every_subcommand_has_help():
    from genrec_spec.cli import COMMANDS, main

    commands = list(_all_commands(COMMANDS))
    assert ("bench", "kernel") in commands
    for command in commands:
        with pytest.raises(SystemExit) as exc:
            main([*command, "--help"])
        assert exc.value.code == 0


def test_installed_console_command_runs():
    script = Path(sys.executable).parent / "genrec-spec"
    result = subprocess.run([str(script), "--help"], capture_output=True, text=True, check=True)
    assert "prepare" in result.stdout
