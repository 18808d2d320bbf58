"""python -m glm_asr.dask_worker PARENT_PID [dask spec arguments]

`python -m distributed.cli.dask_spec` (a local bulk worker's Nanny) that exits when the process
PARENT_PID (the bulk command that started it) is gone, however that ended: killed outright it
closes nothing, and the Nanny would go on until it noticed its scheduler gone. Its worker process
follows (distributed's worker processes exit with their Nanny).
"""
import sys


def main() -> None:
    from tilekernels.runtime.parent import watch_parent

    watch_parent(int(sys.argv[1]))
    from distributed.cli.dask_spec import main as dask_spec

    dask_spec(sys.argv[2:], prog_name="dask spec")


if __name__ == "__main__":
    main()
