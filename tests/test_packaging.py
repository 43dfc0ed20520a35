"""One import name: everything installs under `livespeech`, and the client (with the wire
API) is also a distribution of its own (clients/pyproject.toml) that needs no torch."""
from __future__ import annotations

import ast
import os
import shutil
import subprocess
import tomllib
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# the repository's top-level folders: never import names of their own
FOLDERS = {"server", "models", "clients", "training", "loadtest", "protos"}


def _python_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    return [ROOT / f for f in out.stdout.split() if not (ROOT / f).is_symlink()]


def test_no_module_imports_a_top_level_folder_by_its_own_name() -> None:
    wrong = []
    for path in _python_files():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            wrong += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names if n.split(".")[0] in FOLDERS]
    assert not wrong, "import these as livespeech.<name>:\n" + "\n".join(wrong)


def test_the_installed_names_import_from_anywhere(tmp_path: Path) -> None:
    # from a folder outside the checkout, with a user's own server.py beside it
    (tmp_path / "server.py").write_text("raise ImportError('the user module was imported')\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = "import livespeech, livespeech.server, livespeech.models, livespeech.client, livespeech.api.protocol; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_the_client_distribution_ships_only_the_client_and_the_api(tmp_path: Path) -> None:
    pytest.importorskip("setuptools")
    # built from a copy: a build leaves build/ and egg-info folders where it runs
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "gen", "build", "*.egg-info")
    for folder in ("clients", "protos"):
        shutil.copytree(ROOT / folder, src / folder, ignore=ignore)
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path),
         str(src / "clients")],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    (wheel,) = tmp_path.glob("livespeech_client-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    packages = {n.split("/")[1] for n in names if n.startswith("livespeech/")}
    assert packages == {"client", "api"}, packages
    assert "livespeech/api/livespeech/v1/livespeech.proto" in names
    assert not any("/gen/" in n for n in names), "generated code is made at import, never shipped"
    requires = [ln.split(":", 1)[1].strip() for ln in meta.splitlines() if ln.startswith("Requires-Dist:")]
    base = [r for r in requires if "extra ==" not in r]
    assert base and not any(r.lower().startswith("torch") for r in requires), requires


def test_the_full_distribution_requires_what_the_client_does() -> None:
    full = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    client = tomllib.loads((ROOT / "clients" / "pyproject.toml").read_text())["project"]
    assert client["version"] == full["version"]
    assert set(client["dependencies"]) <= set(full["dependencies"])
    assert not any(d.startswith("torch") for d in client["dependencies"])
    for extra in ("pipecat", "livekit"):
        assert client["optional-dependencies"][extra] == full["optional-dependencies"][extra]
    assert client["scripts"] == full["scripts"]


def test_the_client_streams_audio_without_torch(server_factory, tmp_path: Path) -> None:
    srv = server_factory(fake=True)
    # a fresh interpreter where torch cannot be imported, as in a client-only install
    block = tmp_path / "block"
    block.mkdir()
    (block / "torch.py").write_text("raise ImportError('torch is not installed')\n")
    code = textwrap.dedent(f"""
        import sys
        from livespeech.client import LiveSpeechClient, Summary
        with LiveSpeechClient({srv.address!r}) as client:
            result = client.synthesize_to_result("Hello there, how are you?", sample_rate=16000)
        assert result.summary is not None and len(result.pcm16()) > 0
        assert "torch" not in sys.modules
        print(len(result.pcm16()))
    """)
    env = {**os.environ, "PYTHONPATH": str(block)}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip()) > 0


def test_the_command_without_the_server_says_so_and_still_speaks_to_one(monkeypatch, capsys) -> None:
    from livespeech.client import cli

    # as in a livespeech-client installation: no livespeech.server package
    for name in [n for n in sys.modules if n == "livespeech.server" or n.startswith("livespeech.server.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "livespeech.server", None)
    assert cli.main(["serve", "--port", "1"]) == 2
    assert "livespeech serve: not in this installation" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.main(["say", "--help"])
    assert e.value.code == 0 and "--voice" in capsys.readouterr().out


def _server_imports() -> dict[str, set[str]]:
    """server module -> the server modules it imports (at run time: not under TYPE_CHECKING)."""
    mods = {p.stem for p in (ROOT / "server").glob("*.py")}
    graph: dict[str, set[str]] = {}
    for name in mods:
        tree = ast.parse((ROOT / "server" / f"{name}.py").read_text())
        hidden = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                  for n in ast.walk(node)}
        deps = set()
        for node in ast.walk(tree):
            if id(node) in hidden or not isinstance(node, ast.ImportFrom):
                continue
            module = node.module or ""
            if node.level == 1:
                target = module.split(".")[0] if module else None
                deps |= {target} if target else {a.name for a in node.names}
            elif module.startswith("livespeech.server."):
                deps.add(module.split(".")[2])
            elif module == "livespeech.server":
                deps |= {a.name for a in node.names}
        graph[name] = deps & mods - {name}
    return graph


def test_no_import_cycle_among_server_modules() -> None:
    graph = _server_imports()
    assert graph["engine"] and graph["service"], "the graph reads the imports"
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            pytest.fail("import cycle: " + " -> ".join(path[path.index(name):] + [name]))
        if name in done:
            return
        for dep in sorted(graph[name]):
            visit(dep, path + [name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])
