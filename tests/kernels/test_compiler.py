"""The compiler check: tileiras releases older than 13.5.37 built some kernels wrong."""
import pytest

from tilekernels import compiler

TEXT = ("tileiras: NVIDIA (R) Cuda Tile IR optimizing assembler\nCopyright (c) 2005-2026 NVIDIA Corporation\n"
        "Built on Mon_Oct_12_19:27:40_PDT_2026\nCuda compilation tools, release {r}, V{v}\nBuild local.local.1_\n")


@pytest.mark.parametrize("v", ["13.4.92", "13.5.37", "14.0.1"])
def test_version_is_read_from_the_version_text(v):
    assert compiler.parse_version(TEXT.format(r=v.rsplit(".", 1)[0], v=v)) == tuple(map(int, v.split(".")))
    assert compiler.parse_version("tileiras: unknown build") is None


def test_a_compiler_older_than_13_5_37_is_refused_with_what_to_install():
    with pytest.raises(compiler.CompilerError, match=r"tileiras 13\.4\.92 .*nvidia-cuda-tileiras>=13\.5\.37"):
        compiler.check((13, 4, 92))
    for ok in [(13, 5, 37), (13, 6, 0), (14, 0, 0), None]:
        compiler.check(ok)


def test_the_workspace_installs_a_compiler_new_enough():
    """The lock's nvidia-cuda-tileiras, the one cuda.tile finds first."""
    found = compiler.version()
    assert found is not None and found >= compiler.OLDEST, found
