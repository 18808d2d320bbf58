"""The on-disk cubin cache and the parallel prebuild (tilekernels.cubins), on the CPU: a kernel
compiles for an architecture named explicitly, which needs tileiras and no GPU."""
from importlib import import_module

import cuda.tile as ct
import pytest
from cuda.tile._cext import default_tile_context
from cuda.tile.compilation import ArrayConstraint, CallingConvention, KernelSignature

from tilekernels import cubins

softmax = import_module("tilekernels.softmax")
activations = import_module("tilekernels.activations")
linear = import_module("tilekernels.linear")


def arr(ndim):
    return ArrayConstraint(ct.float32, ndim, index_dtype=ct.int32, stride_lower_bound_incl=0, alias_groups=(),
                           may_alias_internally=False, stride_constant=(None,) * (ndim - 1) + (1,))


SOFTMAX = KernelSignature([arr(2), arr(2), softmax.MAX_TILE], CallingConvention.cutile_python_v1())
ACT = KernelSignature([arr(1), arr(1), arr(1), activations.ELEMENTWISE_TILE, activations.RELU, False],
                      CallingConvention.cutile_python_v1())


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TILEKERNELS_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_a_specialization_compiles_once_then_loads_from_disk(cache):
    before = dict(cubins.STATS)
    cubin, symbol, _, providers = softmax.softmax_kernel._compile(SOFTMAX, default_tile_context, (9, 0))
    assert cubins.STATS["built"] == before["built"] + 1 and providers == ()
    files = list(cache.rglob("*.cubin"))
    assert len(files) == 1 and files[0].read_bytes() == cubin and "sm_90" in str(files[0])
    again, symbol2, _, _ = softmax.softmax_kernel._compile(SOFTMAX, default_tile_context, (9, 0))
    assert again == cubin and symbol2 == symbol
    assert cubins.STATS["built"] == before["built"] + 1 and cubins.STATS["loaded"] == before["loaded"] + 1
    assert f"tilekernels.softmax:softmax_kernel {symbol}" in cubins.launched()


def test_the_key_holds_what_decides_the_cubin(cache):
    k = softmax.softmax_kernel
    symbol = "softmax_kernel_Kt1_x"
    base = cubins.cubin_path(*k.reference(), symbol, k.options(), "sm_90")
    assert base.is_relative_to(cache)
    assert cubins.cubin_path(*k.reference(), symbol, k.options(), "sm_100") != base
    assert cubins.cubin_path(*k.reference(), symbol + "1", k.options(), "sm_90") != base
    two = linear.linear_kernel_occupancy2
    assert two.reference() == ("tilekernels.linear", "linear_kernel_occupancy2")
    assert two.options() != linear.linear_kernel.options()
    assert isinstance(linear.skinny_kernel_one_an_sm, cubins.kernel)      # replace_hints keeps the cache


def test_the_cache_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("TILEKERNELS_CACHE_DIR", "off")
    assert cubins.cache_dir() is None
    assert cubins.cubin_path("m", "k", "s", "o", "sm_90") is None
    monkeypatch.delenv("TILEKERNELS_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", "/somewhere")
    assert str(cubins.cache_dir()) == "/somewhere/tilekernels"


def test_prebuild_compiles_a_manifest_in_workers_and_launches_load_it(cache, tmp_path):
    from cuda.tile.compilation import mangle_kernel_name

    lines = [f"tilekernels.softmax:softmax_kernel {mangle_kernel_name('softmax_kernel', SOFTMAX)}",
             f"tilekernels.activations:activation_kernel {mangle_kernel_name('activation_kernel', ACT)}"]
    manifest = tmp_path / "kernels.txt"
    manifest.write_text("# two kernels\n" + "\n".join(lines) + "\n")
    assert cubins.read_manifest(manifest) == lines
    assert len(cubins.missing(lines, "sm_90")) == 2
    before = dict(cubins.STATS)
    cubins.prebuild(lines, "sm_90", workers=2).join()
    assert cubins.missing(lines, "sm_90") == [] and cubins.STATS["prebuilt"] == before["prebuilt"] + 2
    assert cubins.prebuild(lines, "sm_90") is None            # nothing left to build
    activations.activation_kernel._compile(ACT, default_tile_context, (9, 0))
    softmax.softmax_kernel._compile(SOFTMAX, default_tile_context, (9, 0))
    assert cubins.STATS["built"] == before["built"] and cubins.STATS["loaded"] == before["loaded"] + 2


def test_the_shipped_manifests_name_kernels_that_exist():
    """Every line of the models' manifests resolves to a tilekernels kernel and a signature."""
    from pathlib import Path

    from cuda.tile.compilation import demangle_kernel_name

    root = Path(__file__).resolve().parents[2] / "packages"
    manifests = sorted(root.glob("*/src/*/kernels.txt"))
    for m in manifests:
        for line in cubins.read_manifest(m):
            k, symbol = cubins._resolve(line)
            assert isinstance(k, cubins.kernel), line
            name, _ = demangle_kernel_name(symbol)
            assert name == k._pyfunc.__name__, line


def test_a_script_that_prebuilds_at_top_level_runs_once(cache, tmp_path):
    """Workers are fresh interpreters: a script without a main guard is not run again in each
    (multiprocessing's spawn imports the caller's main module in every worker)."""
    import subprocess
    import sys

    from cuda.tile.compilation import mangle_kernel_name

    line = f"tilekernels.softmax:softmax_kernel {mangle_kernel_name('softmax_kernel', SOFTMAX)}"
    runs = tmp_path / "runs.txt"
    script = tmp_path / "script.py"
    script.write_text("from tilekernels import cubins\n"
                      f"open({str(runs)!r}, 'a').write('ran\\n')\n"
                      f"cubins.prebuild([{line!r}], 'sm_90', workers=2).join()\n"
                      f"assert cubins.missing([{line!r}], 'sm_90') == []\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert runs.read_text() == "ran\n"


def test_a_stale_line_is_skipped_and_an_unwritable_cache_still_compiles(tmp_path, monkeypatch):
    """A manifest line naming no kernel (renamed since) is not built; a cache folder that cannot be
    written leaves the kernel compiling as ever."""
    assert cubins.missing(["tilekernels.softmax:no_such_kernel x", "not a line"], "sm_90") == []
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv("TILEKERNELS_CACHE_DIR", str(blocked / "cache"))      # under a file: unwritable
    cubin, *_ = softmax.softmax_kernel._compile(SOFTMAX, default_tile_context, (9, 0))
    assert len(cubin) > 1000 and not (blocked / "cache").exists()
