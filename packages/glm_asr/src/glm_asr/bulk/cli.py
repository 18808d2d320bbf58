"""python -m glm_asr.bulk's command line: options checked, the manifest read, the cluster started,
the tasks driven to the end, the summary printed."""
from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import time
import uuid
from pathlib import Path

from tilekernels.runtime.cli import Float, OptInt, OptStr, Str, config_dir, exit_with_one_line_errors, options, \
    run_hydra, split_args

from ..formats import check_output_dir, temporary_stem
from ..pipeline import with_context
from ..transcribe import SHARED_OPTIONS, extensions as parse_extensions, layout_options, loop_guard, vad_options
from .cluster import drive, local_cluster, task_overhead, visible_gpus, worker_plan
from .manifest import kept_names, plan_tasks, probe_duration, read_manifest
from .progress import ERRORS, Item, Progress, Tally, _fmt_seconds
from .worker import output_exists, prepare, transcribe_files


MAX_WORKERS = 1024      # local worker processes at most (each holds a model)
# transcribe's options and where the work runs (gpus and workers: worker_plan checks them against the machine)
BULK_OPTIONS = {**SHARED_OPTIONS, "manifest": OptStr, "glob": Str, "gpus": OptInt(min=0),
                "workers": OptInt(min=1, max=MAX_WORKERS), "scheduler": OptStr, "task_seconds": Float(min=0),
                "dashboard": OptStr}


def check_options(cfg, inputs: list[str]) -> dict:
    """bulk's options (BULK_OPTIONS) checked, with what they must hold together: a manifest (or the
    one argument) and an output_dir that can be a directory; scheduler without gpus or workers."""
    o = options(cfg, BULK_OPTIONS)
    o["prompt"] = with_context(o["prompt"], o["context"])
    if inputs and o["manifest"] is None and len(inputs) == 1:
        o["manifest"] = inputs[0]
    elif inputs:
        raise ValueError(f"unexpected argument{'s' * (len(inputs) > 1)} {' '.join(inputs)}: give manifest=FILE|DIR "
                         f"(a text file of paths or a directory) and key=value options")
    if not o["manifest"]:
        raise ValueError("no manifest given: python -m glm_asr.bulk manifest=FILE|DIR output_dir=DIR")
    if not o["output_dir"]:
        raise ValueError("no output_dir given: bulk writes one transcript per file there (output_dir=DIR)")
    if cfg.get("profile"):
        raise ValueError("profile=true is transcribe's: bulk's work runs in worker processes, which it does not time")
    if o["scheduler"] and (o["gpus"] is not None or o["workers"] is not None):
        raise ValueError("scheduler=ADDRESS uses that cluster's workers: gpus and workers are for a local cluster")
    check_output_dir(o["output_dir"])
    o["extensions"] = parse_extensions(cfg.get("extensions"))
    o["model"] = {k: cfg.model.get(k) for k in cfg.model}
    o.update(loop_guard(cfg, o))
    return o


def _probe_all(items: list[Item], tty: bool) -> list[Item]:
    from concurrent.futures import ThreadPoolExecutor

    from tqdm import tqdm

    with ThreadPoolExecutor(16) as pool:
        durations = list(tqdm(pool.map(probe_duration, [it.path for it in items]), total=len(items),
                              desc="reading headers", unit="file", file=sys.stderr, leave=False,
                              disable=not tty or len(items) < 1000))
    return [Item(it.source, it.path, it.name, d) for it, d in zip(items, durations)]


def _remove_stale_temporaries(out_dir: Path, names: set[str]) -> None:
    """write_atomic's temporaries (.<stem>.<mkstemp's 8 characters>, formats.temporary_stem) of this
    manifest's outputs that a killed worker left behind (the run is over: nothing of it is
    writing); a user's .<name>.swp or .bak stays."""
    stems = {temporary_stem(n) for n in names}
    with os.scandir(out_dir) as it:
        for e in it:
            stem, _, tail = e.name[1:].rpartition(".")
            if e.name.startswith(".") and stem in stems and re.fullmatch(r"[a-z0-9_]{8}", tail) and e.is_file():
                with contextlib.suppress(OSError):
                    os.unlink(e.path)


def _work_list(o: dict, out_dir: Path) -> tuple[list[str], list[str], list[Item]]:
    """(the manifest's sources, their output names, the items still to do: those whose output
    is not in out_dir yet, which is made if need be)."""
    sources = read_manifest(o["manifest"], o["glob"], o["extensions"])
    if not sources:
        what = "lists no files" if not Path(o["manifest"]).is_dir() else \
            f"has no files matching glob={o['glob']!r} with extension {', '.join(o['extensions'])}"
        raise ValueError(f"manifest {o['manifest']}: {what}")
    repeated = len(sources) - len({os.path.abspath(s) for s in sources})
    if repeated:
        print(f"warning: {repeated} path{'s' * (repeated > 1)} appear more than once in the manifest; each is "
              f"transcribed again under its own name", file=sys.stderr)
    out_dir.mkdir(parents=True, exist_ok=True)
    names = kept_names(sources, o["output_format"], out_dir)
    existing = set(os.listdir(out_dir))
    return sources, names, [Item(s, os.path.abspath(s), n) for s, n in zip(sources, names) if n not in existing]


def run(cfg, inputs: list[str] = ()) -> int:
    from distributed import Client, KilledWorker

    start = time.perf_counter()
    o = check_options(cfg, list(inputs))
    out_dir = Path(o["output_dir"]).absolute()
    sources, names, todo = _work_list(o, out_dir)
    tty = sys.stderr.isatty()
    tally = Tally(start, files=len(sources))
    tally.skipped = len(sources) - len(todo)
    errors_path = out_dir / ERRORS
    if not todo:
        errors_path.unlink(missing_ok=True)
        print(tally.summary(out_dir), file=sys.stderr)
        return 0
    job = {"model": o["model"], "output_dir": str(out_dir), "output_format": o["output_format"],
           "prompt": o["prompt"], "max_new_tokens": o["max_new_tokens"], "audio_stream": o["audio_stream"],
           "device": o["device"], "vad": o["vad"], "vad_options": vad_options(cfg.get("vad_options")),
           "max_batch": o["max_batch"], "encoder_batch": o["encoder_batch"], "precision": o["precision"],
           "temperature": o["temperature"], "compression_ratio_threshold": o["compression_ratio_threshold"],
           "logprob_threshold": o["logprob_threshold"], "layout": layout_options(o)}
    if not o["scheduler"]:
        job["device"], envs = worker_plan(o["device"], o["gpus"], o["workers"], visible_gpus())

    cluster = None
    try:
        if o["scheduler"]:
            client = Client(o["scheduler"])
        else:
            cluster = local_cluster(envs, o["dashboard"])
            client = Client(cluster)
            client.wait_for_workers(len(envs), timeout=300)
        with client:
            # every worker there loads the model while the headers are read, before any file is given
            # out: a bad checkpoint or option is one error line, not one per file (a worker joining
            # later loads it at its first task)
            def load_everywhere():
                return [client.submit(prepare, job, pure=False, workers=[w], allow_other_workers=True, priority=1)
                        for w in client.scheduler_info()["workers"]]

            loading = load_everywhere()
            items = _probe_all(todo, tty)
            durations = [it.duration for it in items]
            tasks = plan_tasks(durations, o["task_seconds"])
            if not loading:
                print(f"note: waiting for workers to join {o['scheduler']}", file=sys.stderr)
                client.wait_for_workers(1)
                loading = load_everywhere()
            try:
                devices = client.gather(loading)
            except KilledWorker as e:      # e.g. out of memory: one line, not a traceback
                raise ValueError(f"a worker process died while loading the model ({e})") from None
            gpus = [d for d in devices if d != "cpu"]
            if not o["scheduler"] and len(set(gpus)) < len(gpus):
                raise ValueError(f"the local workers do not each have a GPU of their own: {', '.join(devices)}")
            device = "/".join(sorted({d.split()[0] for d in devices}))
            nworkers = len(loading)
            tally.ready = time.perf_counter()
            unknown = sum(d <= 0 for d in durations)
            print(f"bulk: {len(sources)} files: {tally.skipped} skipped (output exists), {len(items)} to transcribe "
                  f"({_fmt_seconds(sum(durations))} of audio" + (f", {unknown} of unknown length" if unknown else "")
                  + f") in {len(tasks)} tasks on {nworkers} {device} worker{'s' * (nworkers > 1)}"
                  + (f" at {o['scheduler']}" if o["scheduler"] else ""), file=sys.stderr)
            _transcribe_all(client, items, tasks, job, tally, errors_path, KilledWorker)
    except BaseException:
        if cluster is not None:
            cluster.close()                 # its workers write no more: what is on disk is what was done
        if tally.ready is not None:         # what was done survives: the summary, then the error
            with contextlib.suppress(OSError):      # outputs written before their results came back count
                tally.done = max(tally.done, len(set(os.listdir(out_dir)) & {it.name for it in todo}))
            print(tally.summary(out_dir, interrupted=True), file=sys.stderr)
        raise
    finally:
        if cluster is not None:
            cluster.close()
    with contextlib.suppress(OSError):
        _remove_stale_temporaries(out_dir, set(names))
    print(tally.summary(out_dir), file=sys.stderr)
    return 1 if tally.failed else 0


def _transcribe_all(client, items: list[Item], tasks: list[list[int]], job: dict, tally: Tally, errors_path: Path,
                    KilledWorker) -> None:
    run_id = uuid.uuid4().hex[:8]
    count = iter(range(10 ** 12))
    progress = Progress(sum(it.duration for it in items), len(items))
    errors = None           # errors.jsonl: this run's failures (a file that failed before is tried again)

    def fail(item: Item, reason: str) -> None:
        nonlocal errors
        tally.failed += 1
        if errors is None:
            errors = open(errors_path, "w", encoding="utf-8")
        errors.write(json.dumps({"path": item.source, "reason": reason}, ensure_ascii=False) + "\n")
        errors.flush()
        progress.write(f"error: {item.source}: {reason}")

    def submit(task: list[int]):
        files = [(items[i].source, items[i].path, items[i].name) for i in task]
        n = next(count)             # submitted longest first: each task a lower priority than the one before
        return client.submit(transcribe_files, files, job, pure=False, key=f"transcribe-{run_id}-{n}", priority=-n)

    def on_result(task: list[int], future):
        if future.status == "error":
            exc = future.exception()
            if isinstance(exc, KilledWorker):
                if len(task) > 1:           # find the file that kills workers: its group's files one by one
                    return [[i] for i in task]
                it = items[task[0]]
                if output_exists(Path(job["output_dir"]) / it.name):
                    tally.done += 1
                    return None
                fail(it, "the worker died while transcribing it, each of the times Dask tried "
                         "(distributed.scheduler.allowed-failures)")
                progress.update(it.duration, 1)
                return None
            raise exc
        seconds = 0.0
        for i, r in zip(task, future.result()):
            it, s = items[i], r["seconds"] or items[i].duration     # a file written before (exists): its header's
            for w in r["warnings"]:
                progress.write(w)
            if r["error"] is not None:
                fail(it, r["error"])
            else:
                tally.done += 1
                tally.seconds += s
            seconds += s
        progress.update(seconds, len(task))
        return None

    try:
        drive(client, tasks, submit, on_result)
    finally:
        progress.close()
        if errors is not None:
            errors.close()
        if not tally.failed:
            errors_path.unlink(missing_ok=True)


# ------------------------------------------------------------------ the command line
def _overhead_main(argv: list[str]) -> None:
    n = int(argv[0]) if argv else 10_000
    workers = int(argv[1]) if len(argv) > 1 else 2
    r = task_overhead(n, workers)
    print(f"{r['tasks']} no-op tasks on a LocalCluster of {r['workers']} worker processes (1 thread each), "
          f"{os.cpu_count()} cores:\n"
          f"  bulk's submission loop: {r['bulk_loop_s']:.2f} s, {r['bulk_loop_us_per_task']:.0f} us a task, "
          f"{r['tasks'] / r['bulk_loop_s']:.0f} tasks/s\n"
          f"  one client.map:         {r['map_s']:.2f} s, {r['map_us_per_task']:.0f} us a task, "
          f"{r['tasks'] / r['map_s']:.0f} tasks/s")


def main() -> None:
    if sys.argv[1:2] == ["--overhead"]:
        _overhead_main(sys.argv[2:])
        return
    import hydra

    inputs, rest = split_args(sys.argv[1:])
    sys.argv = [sys.argv[0]] + rest

    @hydra.main(version_base=None, config_path=config_dir("glm_asr"), config_name="bulk")
    def _hydra_main(cfg) -> None:
        exit_with_one_line_errors(lambda: run(cfg, inputs))

    run_hydra(_hydra_main)
