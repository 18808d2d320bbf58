"""The house's rules, read from the source: the kernel modules import nothing from the runtime,
and neither model package imports the other."""
import ast
from pathlib import Path

import pytest

PACKAGES = Path(__file__).resolve().parents[2] / "packages"


def imported(path: Path) -> set[str]:
    """Every module (and module.name) a file imports, relative imports resolved."""
    src = PACKAGES / path.relative_to(PACKAGES).parts[0] / "src"
    pkg = ".".join(path.relative_to(src).parts[:-1])
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = pkg.rsplit(".", node.level - 1)[0] if node.level else ""
            mod = ".".join(p for p in (base, node.module) if p)
            names.add(mod)
            names.update(f"{mod}.{a.name}" for a in node.names)
    return names


def sources(package: str, src: str):
    return sorted((PACKAGES / package / "src" / src).rglob("*.py"))


def test_kernel_modules_import_nothing_from_the_runtime():
    kernels = [p for p in sources("tilekernels", "tilekernels") if "runtime" not in p.parts]
    assert len(kernels) > 10
    for p in kernels:
        bad = {m for m in imported(p) if "runtime" in m.split(".")}
        assert not bad, f"{p.name} imports {bad}"


@pytest.mark.parametrize("package,src,other", [("gpt", "gpt", "glm_asr"), ("glm_asr", "glm_asr", "gpt")])
def test_models_do_not_import_each_other(package, src, other):
    files = sources(package, src)
    assert files
    for p in files:
        bad = {m for m in imported(p) if m.split(".")[0] == other}
        assert not bad, f"{p} imports {bad}"


def test_the_runtime_imports_no_model():
    for p in sources("tilekernels", "tilekernels/runtime"):
        assert not {m for m in imported(p) if m.split(".")[0] in ("gpt", "glm_asr")}, p


ENGINE_INSIDES = {"scheduler", "runner", "flow", "flow_rows", "flow_left", "last"}


def engine_insides(path: Path) -> list[str]:
    """`<engine>.<inside>` in a file: an attribute of ENGINE_INSIDES read off a name `engine` or
    `e`, or off any `.engine`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in ENGINE_INSIDES:
            v = node.value
            if (isinstance(v, ast.Name) and v.id in ("engine", "e")) or (isinstance(v, ast.Attribute)
                                                                       and v.attr == "engine"):
                found.append(f"{path.name}:{node.lineno} .{node.attr}")
    return found


def test_nothing_outside_the_runtime_reaches_into_the_engine(tmp_path):
    """Models, CLIs and servers use the engine's public face (add, cancel, cancel_where, step,
    busy, waiting, running, free, stream), never its scheduler, runner or flow."""
    files = sources("gpt", "gpt") + sources("glm_asr", "glm_asr") + sorted((PACKAGES.parent / "tools").glob("*.py"))
    assert len(files) > 20
    assert [hit for p in files for hit in engine_insides(p)] == []
    probe = tmp_path / "probe.py"
    probe.write_text("n = len(self.engine.scheduler.waiting)\ne = x\ne.runner.prefill\nscheduler.waiting\n")
    assert sorted(engine_insides(probe)) == ["probe.py:1 .scheduler", "probe.py:3 .runner"]
