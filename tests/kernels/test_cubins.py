"""The on-disk cubin cache and the parallel prebuild (tilekernels.cubins), on the CPU: a kernel
compiles for an architecture named explicitly, which needs tileiras and no GPU."""
from importlib import import_module
from pathlib import Path

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
    manifests = sorted(root.glob("*/src/*/kernels/*.txt"))
    assert len(manifests) >= 2          # gpt's and glm_asr's
    for m in manifests:
        for line in cubins.read_manifest(m):
            k, symbol = cubins._resolve(line)
            assert isinstance(k, cubins.kernel), line
            name, _ = demangle_kernel_name(symbol)
            assert name == k._pyfunc.__name__, line


def _line(module, name, signature):
    from cuda.tile.compilation import mangle_kernel_name

    return f"tilekernels.{module}:{name} {mangle_kernel_name(name, signature)}"


SOFTMAX_LINE = _line("softmax", "softmax_kernel", SOFTMAX)
ACT_LINE = _line("activations", "activation_kernel", ACT)


def test_a_cubin_another_process_is_building_is_waited_for_not_built(cache):
    """A claim held by a live process (here this one, as a worker would be) makes a launch wait
    until the cubin is stored, then load it; workers skip a claimed line."""
    import io
    import threading

    from cuda.tile.compilation import export_kernel

    k = softmax.softmax_kernel
    symbol = SOFTMAX_LINE.split(" ")[1]
    path = k.cache_file(symbol, "sm_90")
    assert cubins.claim(path) and not cubins.claim(path)        # held: a second claim fails
    cubins.prebuild([SOFTMAX_LINE, ACT_LINE], "sm_90", workers=1).join()
    assert not path.exists() and cubins.missing([ACT_LINE], "sm_90") == []  # the worker built only the free one
    before = dict(cubins.STATS)
    got = {}
    waiter = threading.Thread(target=lambda: got.update(r=k._compile(SOFTMAX, default_tile_context, (9, 0))))
    waiter.start()
    waiter.join(0.5)
    assert waiter.is_alive()            # waiting for the holder
    buf = io.BytesIO()
    export_kernel(k, [SOFTMAX], buf, gpu_code="sm_90", output_format="cubin")
    cubins._store(path, buf.getvalue())
    cubins.release(path)
    waiter.join(60)
    assert got["r"][0] == buf.getvalue()
    assert cubins.STATS["built"] == before["built"] and cubins.STATS["loaded"] == before["loaded"] + 1
    assert cubins.STATS["wait_s"] >= before["wait_s"] + 0.4


def test_a_dead_builders_claim_is_taken_over(cache):
    import subprocess
    import sys

    k = softmax.softmax_kernel
    symbol = SOFTMAX_LINE.split(" ")[1]
    path = k.cache_file(symbol, "sm_90")
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    path.parent.mkdir(parents=True)
    path.with_suffix(".building").write_text(gone.stdout.strip())
    before = dict(cubins.STATS)
    cubin, *_ = k._compile(SOFTMAX, default_tile_context, (9, 0))
    assert cubins.STATS["built"] == before["built"] + 1 and path.read_bytes() == cubin
    assert not path.with_suffix(".building").exists()       # released


def test_launched_lists_kernels_in_the_order_of_their_first_launch(cache):
    """The manifest's order is the order a run first launched its kernels (workers build it so)."""
    import subprocess
    import sys

    code = ("import sys; sys.path.insert(0, %r); import test_cubins as t; from tilekernels import cubins\n"
            "for k, sig in ((t.activations.activation_kernel, t.ACT), (t.softmax.softmax_kernel, t.SOFTMAX),\n"
            "               (t.activations.activation_kernel, t.ACT)):\n"
            "    k._compile(sig, t.default_tile_context, (9, 0))\n"
            "print('\\n'.join(cubins.launched()))" % str(Path(__file__).parent))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == [ACT_LINE, SOFTMAX_LINE]


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


def test_the_prebuild_command_builds_a_list_once_without_a_gpu(cache, tmp_path):
    """python -m tilekernels.prebuild LIST --arch sm_90 compiles what is missing (no GPU needed),
    and a second run finds it cached; a bad target, --arch or missing GPU is one line, exit 2."""
    import subprocess
    import sys

    from tilekernels import prebuild

    manifest = tmp_path / "kernels.txt"
    manifest.write_text(f"{SOFTMAX_LINE}\n{ACT_LINE}\n")

    def run(*args):
        return subprocess.run([sys.executable, "-m", "tilekernels.prebuild", *args], capture_output=True, text=True,
                              timeout=600)
    done = run(str(manifest), "--arch", "sm_90", "--workers", "2")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("2 kernels built for sm_90") and "0 were cached" in done.stdout
    assert cubins.missing([SOFTMAX_LINE, ACT_LINE], "sm_90") == []
    again = run(str(manifest), "--arch", "sm_90")
    assert again.returncode == 0 and again.stdout.startswith("0 kernels built") and "2 were cached" in again.stdout
    for args, says in (([str(tmp_path / "none.txt"), "--arch", "sm_90"], "neither a kernel list"),
                       (["json", "--arch", "sm_90"], "ships no kernel list"),
                       ([str(manifest), "--arch", "90"], "expected sm_XY"),
                       ([str(manifest), "--arch", "sm_90x"], "expected sm_XY")):
        bad = run(*args)
        assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and says in bad.stderr, bad.stderr
    assert prebuild.manifests("gpt") == sorted((Path(__file__).resolve().parents[2] / "packages" / "gpt" / "src" /
                                                "gpt" / "kernels").glob("*.txt"))
