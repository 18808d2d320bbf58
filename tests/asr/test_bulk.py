"""python -m glm_asr.bulk on Dask distributed (CPU, the tiny checkpoint): the same transcripts as the
transcribe command line's output_dir, errors.jsonl, resume, a worker killed mid-run, a scheduler
address; and the manifest, task planning and worker pinning as units."""
import contextlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from glm_asr import bulk
from glm_asr.bulk import cli as bulk_cli, manifest, worker as bulk_worker

FILES = ["long.flac", "notaudio.wav", "other/speech16k.wav", "quiet.ogg", "six48k.wav", "talk/speech16k.wav"]
NAMES = ["long.json", "quiet.json", "six48k.json", "speech16k-1.json", "speech16k-2.json"]     # notaudio fails
# the loop guard on, with a threshold low enough that some of the tiny model's segments decode again
COMMON = ["device=cpu", "vad=none", "max_new_tokens=40", "output_format=json", "temperature=[0,0.5,1]",
          "compression_ratio_threshold=2.0"]


def run_module(module, *args, timeout=300):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": "/tmp/empty-hf-home"}
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], capture_output=True, text=True, env=env,
                          timeout=timeout)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, audio_dir):
    """Six files, one corrupt, two with the same stem; and a manifest naming them relative to itself."""
    d = tmp_path_factory.mktemp("corpus")
    for dst, src in zip(FILES, ["long.flac", "notaudio.wav", "low8k.wav", "quiet.ogg", "six48k.wav", "speech16k.wav"]):
        (d / dst).parent.mkdir(exist_ok=True)
        shutil.copy(audio_dir / src, d / dst)
    (d / "manifest.txt").write_text("# the corpus, sorted as a directory listing is\n\n" + "\n".join(
        f"  {f}  " if i == 2 else f for i, f in enumerate(FILES)) + "\n")
    return d


@pytest.fixture(scope="module")
def reference(tiny, corpus, tmp_path_factory):
    """The single-process command line's output_dir for the same files, in the same order."""
    out = tmp_path_factory.mktemp("cli_out")
    r = run_module("glm_asr.transcribe", *[corpus / f for f in FILES], f"model.path={tiny}", *COMMON,
                   f"output_dir={out}")
    assert r.returncode == 1 and "notaudio.wav" in r.stderr, r.stderr
    assert sorted(p.name for p in out.iterdir()) == NAMES
    kept = {s["temperature"] for p in out.iterdir() for s in json.loads(p.read_text())["segments"]}
    assert kept - {0.0}, kept          # some segment was decoded again
    return out


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One LocalCluster of 2 worker processes on 127.0.0.1 for the module (scheduler=ADDRESS), whose
    workers exit once when a marker named after an output is put in crash_dir."""
    from distributed import Client

    from bulk_crash import CrashBeforeWriting

    crash_dir = tmp_path_factory.mktemp("crash")
    path = os.pathsep.join([str(Path(__file__).parent), *filter(None, [os.environ.get("PYTHONPATH")])])
    c = bulk.local_cluster([{"PYTHONPATH": path, "GLM_ASR_TEST_PIN": str(i)} for i in range(2)])
    try:
        with Client(c) as client:
            client.wait_for_workers(2, timeout=120)
            client.register_plugin(CrashBeforeWriting(str(crash_dir)))     # a restarted worker gets it too
        c.crash_dir = crash_dir
        yield c
    finally:
        c.close()


def outputs(d: Path) -> dict:
    """The transcripts in d (not errors.jsonl, nor the names bulk gave: manifest.NAMES)."""
    from glm_asr.bulk.manifest import NAMES

    return {p.name: p.read_bytes() for p in d.iterdir() if p.name not in (bulk.ERRORS, NAMES)}


def mtimes(d: Path) -> dict:
    return {p.name: p.stat().st_mtime_ns for p in d.iterdir()}


def errors(d: Path) -> list:
    return [json.loads(line) for line in (d / bulk.ERRORS).read_text().splitlines()]


def summary(r) -> str:
    lines = [line for line in r.stderr.splitlines() if line.startswith("done: ")]
    assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    return lines[0]


# ------------------------------------------------------------------ end to end
def test_local_cluster_matches_the_cli_and_resumes(tiny, corpus, reference, tmp_path):
    """A LocalCluster of 2 CPU worker processes (short files grouped into tasks): byte-identical
    transcripts under the command line's names, the corrupt file in errors.jsonl, exit 1; a re-run
    writes nothing (every output's mtime kept) and tries only the failed file again."""
    out = tmp_path / "out"
    args = (f"manifest={corpus / 'manifest.txt'}", f"output_dir={out}", f"model.path={tiny}", *COMMON, "workers=2")
    r = run_module("glm_asr.bulk", *args)
    assert r.returncode == 1, r.stderr
    assert outputs(out) == outputs(reference)
    assert errors(out) == [{"path": str(corpus / "notaudio.wav"), "reason": errors(out)[0]["reason"]}]
    assert "on 2 cpu workers" in r.stderr
    line = summary(r)
    assert "5 transcribed, 0 skipped (output exists), 1 failed" in line and "real time" in line, line
    assert f"error: {corpus / 'notaudio.wav'}: " in r.stderr

    before = mtimes(out)
    r = run_module("glm_asr.bulk", *args)
    assert r.returncode == 1, r.stderr
    assert "0 transcribed, 5 skipped (output exists), 1 failed" in summary(r)
    after = mtimes(out)
    assert {k: v for k, v in after.items() if k != bulk.ERRORS} == {k: v for k, v in before.items() if k != bulk.ERRORS}
    assert [e["path"] for e in errors(out)] == [str(corpus / "notaudio.wav")]


def test_scheduler_address_and_a_worker_killed_mid_run(tiny, corpus, reference, cluster, tmp_path):
    """scheduler=ADDRESS, a directory manifest, one file a task. The worker transcribing the longest
    file exits just before writing it (once): Dask runs that task again, and nothing is lost,
    duplicated or left half written. Then a manifest without the bad file: all skipped, exit 0,
    nothing written, no cluster work."""
    (cluster.crash_dir / "long.json").write_text("")
    out = tmp_path / "out"
    r = run_module("glm_asr.bulk", f"manifest={corpus}", f"output_dir={out}", f"model.path={tiny}", *COMMON,
                   f"scheduler={cluster.scheduler_address}", "task_seconds=0")
    assert r.returncode == 1, r.stderr
    assert not (cluster.crash_dir / "long.json").exists(), "no worker died: the test tested nothing"
    assert sorted(p.name for p in out.iterdir()) == sorted(NAMES + [bulk.ERRORS, manifest.NAMES])   # no temporaries
    assert outputs(out) == outputs(reference)
    assert [e["path"] for e in errors(out)] == [str(corpus / "notaudio.wav")]
    assert "5 transcribed, 0 skipped (output exists), 1 failed" in summary(r)
    assert f"at {cluster.scheduler_address}" in r.stderr

    good = tmp_path / "good.txt"
    good.write_text("".join(f"{corpus / f}\n" for f in FILES if f != "notaudio.wav"))
    before = mtimes(out)
    r = run_module("glm_asr.bulk", f"manifest={good}", f"output_dir={out}", f"model.path={tiny}", *COMMON,
                   f"scheduler={cluster.scheduler_address}")
    assert r.returncode == 0, r.stderr
    assert "0 transcribed, 5 skipped (output exists), 0 failed" in summary(r)
    assert not (out / bulk.ERRORS).exists()         # this run's failures: none
    assert {k: v for k, v in mtimes(out).items()} == {k: v for k, v in before.items() if k != bulk.ERRORS}


def test_a_bad_checkpoint_is_one_error_line(cluster, corpus, tmp_path):
    """The model loads on a worker before any file is given out: a bad model.path is one error line."""
    r = run_module("glm_asr.bulk", f"manifest={corpus / 'manifest.txt'}", f"output_dir={tmp_path / 'out'}",
                   f"model.path={tmp_path / 'nothing'}", *COMMON, f"scheduler={cluster.scheduler_address}")
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert lines[-1].startswith("error: ") and "nothing" in lines[-1], r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "out" / bulk.ERRORS).exists()


def test_each_local_worker_has_its_own_environment(cluster):
    """How gpus=N pins a worker to each GPU (CUDA_VISIBLE_DEVICES), seen through another variable:
    it is in the environment each worker process started with (/proc/self/environ), as
    CUDA_VISIBLE_DEVICES must be before anything starts CUDA, not set once it runs. In file order
    one of them is the process the Nanny restarted after the kill above."""
    from distributed import Client

    def seen():
        start = dict(v.split("=", 1) for v in Path("/proc/self/environ").read_text().split("\0") if "=" in v)
        return start.get("GLM_ASR_TEST_PIN"), os.environ.get("OMP_NUM_THREADS")

    with Client(cluster) as client:
        assert sorted(client.run(seen).values()) == [("0", "1"), ("1", "1")]


def test_task_overhead(cluster):
    """The overhead measurement runs bulk's own submission loop (the figure in docs/scaling.md
    comes from `python -m glm_asr.bulk --overhead 10000`)."""
    from distributed import Client

    with Client(cluster) as client:
        r = bulk.task_overhead(200, client=client)
    assert r["tasks"] == 200 and r["workers"] == 2
    assert 0 < r["bulk_loop_us_per_task"] < 1e6 and 0 < r["map_us_per_task"] < 1e6


# ------------------------------------------------------------------ options (in-process)
def compose(*overrides):
    from hydra import compose as hydra_compose, initialize_config_dir
    from tilekernels.runtime.cli import config_dir

    with initialize_config_dir(config_dir=config_dir("glm_asr"), version_base=None):
        return hydra_compose(config_name="bulk", overrides=list(overrides))


def test_every_transcribe_option_is_a_bulk_option():
    from hydra import compose as hydra_compose, initialize_config_dir
    from tilekernels.runtime.cli import config_dir

    with initialize_config_dir(config_dir=config_dir("glm_asr"), version_base=None):
        t = hydra_compose(config_name="transcribe")
    b = compose("model.path=/x")
    assert set(t) < set(b)
    assert {k: b[k] for k in t if k != "model"} == {k: t[k] for k in t if k != "model"}
    assert b.model.path == "/x" and b.model.id == t.model.id


@pytest.mark.parametrize("overrides,message", [
    ([], "no manifest given"),
    (["manifest=MANIFEST"], "no output_dir given"),
    (["manifest=/no/such/list.txt", "output_dir=OUT"], "no such file or directory"),
    (["manifest=EMPTY", "output_dir=OUT"], "lists no files"),
    (["manifest=MANIFEST", "output_dir=OUT", "output_format=doc"], "output_format must be one of"),
    (["manifest=MANIFEST", "output_dir=OUT", "max_new_tokens=0"], "max_new_tokens must be an integer >= 1, got 0"),
    (["manifest=MANIFEST", "output_dir=OUT", "gpus=abc"], "gpus must be an integer"),
    (["manifest=MANIFEST", "output_dir=OUT", "scheduler=tcp://127.0.0.1:1", "workers=2"], "local cluster"),
    (["manifest=MANIFEST", "output_dir=OUT", "task_seconds=-1"], "task_seconds must be a finite number >= 0, got -1.0"),
    (["manifest=MANIFEST", "output_dir=OUT", "audio_stream=-1"], "audio_stream must be an integer >= 0, got -1"),
    (["manifest=MANIFEST", "output_dir=OUT", "extensions=[]"], "extensions must name at least one"),
    (["manifest=MANIFEST", "output_dir=OUT", "temperature=[0,-0.5]"], "temperature must be a number from 0"),
    (["manifest=MANIFEST", "output_dir=OUT", "compression_ratio_threshold=0"], "compression_ratio_threshold must be"),
    (["manifest=MANIFEST", "output_dir=UNDER_A_FILE"], "is not a directory"),
    (["manifest=MANIFEST", "output_dir=OUT", "profile=true"], "profile=true is transcribe's"),
    (["manifest=MANIFEST", "output_dir=OUT", "workers=100000"], "workers must be an integer from 1 to 1024"),
])
def test_bad_options_are_refused_before_any_work(overrides, message, corpus, tmp_path):
    (tmp_path / "empty.txt").write_text("# nothing\n\n")
    subs = {"MANIFEST": str(corpus / "manifest.txt"), "EMPTY": str(tmp_path / "empty.txt"), "OUT": str(tmp_path / "o"),
            "UNDER_A_FILE": str(tmp_path / "empty.txt" / "o")}
    cfg = compose(*[o.split("=")[0] + "=" + subs.get(o.split("=", 1)[1], o.split("=", 1)[1]) for o in overrides])
    with pytest.raises(ValueError, match=message):
        bulk.run(cfg)
    assert not (tmp_path / "o").exists()


def test_a_bad_option_on_the_command_line_is_one_error_line(corpus, tmp_path):
    r = run_module("glm_asr.bulk", f"manifest={corpus / 'manifest.txt'}", "device=cpu", "gpus=2",
                   f"output_dir={tmp_path}", timeout=120)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.strip().splitlines() == ["error: gpus=2 with device=cpu: set device=gpu (or auto), or gpus=0"]


def test_a_checkpoint_the_workers_cannot_load_is_one_error_line(corpus, tmp_path):
    """The workers fail to load it: bulk says so in one line (the workers' own log of the failed
    task, a traceback, stays out of the user's terminal)."""
    r = run_module("glm_asr.bulk", f"manifest={corpus / 'manifest.txt'}", "device=cpu", "workers=1",
                   "model.path=/nonexistent", f"output_dir={tmp_path / 'out'}", timeout=300)
    assert r.returncode == 1 and r.stderr.strip().splitlines() == ["error: /nonexistent: no such directory"], r.stderr


# ------------------------------------------------------------------ units
def test_manifest_text_file(tmp_path):
    (tmp_path / "sub").mkdir()
    m = tmp_path / "sub" / "list.txt"
    m.write_text("# comment\n\n  a.wav  \nrel/b.flac\n/abs/c.ogg\r\n   # indented comment\nd e.wav\n")
    assert bulk.read_manifest(m) == [str(tmp_path / "sub/a.wav"), str(tmp_path / "sub/rel/b.flac"), "/abs/c.ogg",
                                     str(tmp_path / "sub/d e.wav")]
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00junk")
    with pytest.raises(ValueError, match="not a UTF-8 text file"):
        bulk.read_manifest(tmp_path / "bin.txt")


def test_manifest_directory(tmp_path):
    for f in ["b.WAV", "a/x.flac", "a/deep/y.mp3", "notes.txt", ".hidden.wav", "a/._x.flac", "v.mkv"]:
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_text("")
    (tmp_path / "dir.wav").mkdir()
    rel = lambda paths: [str(Path(p).relative_to(tmp_path)) for p in paths]      # noqa: E731
    assert rel(bulk.read_manifest(tmp_path)) == ["a/deep/y.mp3", "a/x.flac", "b.WAV", "v.mkv"]
    assert rel(bulk.read_manifest(tmp_path, "*")) == ["b.WAV", "v.mkv"]
    assert rel(bulk.read_manifest(tmp_path, "a/**/*.flac")) == ["a/x.flac"]
    assert rel(bulk.read_manifest(tmp_path, "*", [])) == ["b.WAV", "notes.txt", "v.mkv"]
    assert rel(bulk.read_manifest(tmp_path, "**/*", ["txt"])) == ["notes.txt"]


def test_plan_tasks_longest_first_short_files_grouped_unknown_last():
    d = [5.0, 0.0, 100.0, 20.0, 10.0, 40.0, 0.0, 20.0]
    assert bulk.plan_tasks(d, 30) == [[2], [5], [3, 7], [4, 0], [1], [6]]
    assert bulk.plan_tasks(d, 0) == [[2], [5], [3], [7], [4], [0], [1], [6]]
    assert bulk.plan_tasks([1.0] * 250, 1000) == [list(range(100)), list(range(100, 200)), list(range(200, 250))]


def test_probe_duration(audio_dir):
    assert bulk.probe_duration(str(audio_dir / "long.flac")) == pytest.approx(65.0)
    assert bulk.probe_duration(str(audio_dir / "notaudio.wav")) == 0.0
    assert bulk.probe_duration(str(audio_dir / "missing.wav")) == 0.0


def test_worker_plan_pins_one_worker_per_gpu():
    assert bulk.worker_plan("auto", None, None, ["0", "1", "2"]) == (
        "auto", [{"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "1"}, {"CUDA_VISIBLE_DEVICES": "2"}])
    assert bulk.worker_plan("gpu", 2, None, ["3", "GPU-ab"]) == (
        "gpu", [{"CUDA_VISIBLE_DEVICES": "3"}, {"CUDA_VISIBLE_DEVICES": "GPU-ab"}])
    assert bulk.worker_plan("auto", 0, 3, ["0"]) == ("cpu", [{"CUDA_VISIBLE_DEVICES": ""}] * 3)
    assert bulk.worker_plan("cpu", None, 2, ["0", "1"]) == ("cpu", [{"CUDA_VISIBLE_DEVICES": ""}] * 2)
    assert bulk.worker_plan("auto", None, 2, []) == ("cpu", [{"CUDA_VISIBLE_DEVICES": ""}] * 2)
    for args, message in [(("gpu", 3, None, ["0", "1"]), "2 GPUs visible"), (("cpu", 1, None, ["0"]), "device=cpu"),
                          (("gpu", None, None, []), "no GPU"), (("gpu", 0, None, ["0"]), "gpus=0 with device=gpu"),
                          (("auto", None, 0, []), "workers must be >= 1"), (("auto", 2, 3, ["0", "1"]), "GPU worker")]:
        with pytest.raises(ValueError, match=message):
            bulk.worker_plan(*args)


def test_visible_gpus_follows_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 3,-1,4")
    assert bulk.visible_gpus() == ["2", "3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert bulk.visible_gpus() == []


def test_a_killed_writers_temporaries_are_removed_at_the_end(tmp_path):
    """write_atomic's .<name>.<random> files of this manifest's outputs (a worker killed mid-write),
    and nothing else."""
    from glm_asr.formats import temporary_stem

    very = "v" * 240 + ".txt"       # a name whose temporary is named by its start and a digest
    for f in [".long.json.k2j3h4_z", "long.json", ".other.json.abc", ".long.json", "x.txt", ".x.txt.swp",
              f".{temporary_stem(very)}.q8w7e6ab"]:
        (tmp_path / f).write_text("")
    bulk_cli._remove_stale_temporaries(tmp_path, {"long.json", "x.txt", very})
    assert sorted(p.name for p in tmp_path.iterdir()) == [".long.json", ".other.json.abc", ".x.txt.swp", "long.json",
                                                          "x.txt"]


@contextlib.contextmanager
def worker_with(recognizer, out_dir: Path):
    """A task's job on this process as a worker whose loaded model is recognizer (a stand-in for
    glm_asr.SpeechRecognizer), its outputs in out_dir; the worker's model and feeds dropped after."""
    job = {"model": {"path": "fake"}, "device": "cpu", "precision": "bf16", "output_dir": str(out_dir),
           "prompt": "p", "max_new_tokens": 2, "audio_stream": None, "vad": "none", "vad_options": None,
           "output_format": "txt", "temperature": [0.0], "compression_ratio_threshold": 2.4,
           "logprob_threshold": -1.0, "layout": {"windows": True, "max_width": 42, "max_lines": 2}}
    bulk_worker._CACHE.clear()
    bulk_worker._CACHE[bulk_worker._model_key(job)] = (recognizer, "cpu")
    try:
        yield job
    finally:
        bulk_worker._CACHE.clear()
        bulk_worker._FEEDS.clear()


def test_a_task_whose_pipeline_fails_goes_on_file_by_file(tmp_path):
    """A task's files go through one batched pipeline; should it fail mid-task (a device error, say),
    the files it had not finished are done one by one, each with its own result: the one already
    written stays, a bad file is an error of its own, the rest are written."""
    from types import SimpleNamespace

    from glm_asr.api import Segment, Transcript

    calls = []

    class Recognizer:
        transcriber = SimpleNamespace(check=lambda *a: None)

        def transcribe_many(self, paths, **kw):      # a live source: None is "nothing new yet"
            taken = [p for _, p in zip(range(3), filter(None, paths))]
            calls.append(("many", taken))
            yield Transcript(taken[0], [Segment(0.0, 1.0, "first")], seconds=1.0)
            raise RuntimeError("the device went away")

        def transcribe(self, path, **kw):
            calls.append(("one", path))
            if path.endswith("bad.wav"):
                print(f"warning: {path}: truncated", file=sys.stderr)
                raise ValueError(f"{path}: not audio")
            return Transcript(path, [Segment(0.0, 2.0, Path(path).stem)], seconds=2.0)

    with worker_with(Recognizer(), tmp_path) as job:
        files = [(f"src/{n}", f"/audio/{n}", n.replace(".wav", ".txt")) for n in ("a.wav", "bad.wav", "c.wav")]
        results = bulk.transcribe_files(files, job)
    assert calls == [("many", ["/audio/a.wav", "/audio/bad.wav", "/audio/c.wav"]), ("one", "/audio/bad.wav"),
                     ("one", "/audio/c.wav")]
    assert [r["error"] for r in results] == [None, "not audio", None]
    assert results[1]["warnings"] == ["warning: src/bad.wav: truncated"]       # named as the manifest names it
    assert [r["seconds"] for r in results] == [1.0, 0.0, 2.0]
    assert (tmp_path / "a.txt").read_text().strip() == "first" and (tmp_path / "c.txt").read_text().strip() == "c"
    assert not (tmp_path / "bad.txt").exists()


def test_tasks_running_at_once_share_one_pipeline(tmp_path):
    """A worker's two tasks feed one pipeline: the second task's files join the first's (the engine
    does not drain between tasks), and each task gets back its own files' transcripts."""
    import threading
    import time
    from types import SimpleNamespace

    from glm_asr.api import Segment, Transcript

    pipelines = []

    class Recognizer:
        transcriber = SimpleNamespace(check=lambda *a: None)

        def transcribe_many(self, paths, **kw):     # holds its results until it has seen 4 files (or 10 s)
            taken, deadline = [], time.monotonic() + 10
            pipelines.append(taken)
            for p in paths:
                if p is None:
                    time.sleep(0.005)
                else:
                    taken.append(p)
                if len(taken) == 4 or time.monotonic() > deadline:
                    break
            for p in taken:
                yield Transcript(p, [Segment(0.0, 1.0, Path(p).stem)], seconds=1.0)

    results = {}
    with worker_with(Recognizer(), tmp_path) as job:
        tasks = {t: [(f"{n}.wav", f"/audio/{n}.wav", f"{n}.txt") for n in names]
                 for t, names in (("A", ["a1", "a2"]), ("B", ["b1", "b2"]))}
        threads = [threading.Thread(target=lambda t=t: results.update({t: bulk.transcribe_files(tasks[t], job)}))
                   for t in tasks]
        for th in threads:
            th.start()
        for th in threads:
            th.join(30)
    assert len(pipelines) == 1 and sorted(pipelines[0]) == ["/audio/a1.wav", "/audio/a2.wav", "/audio/b1.wav",
                                                             "/audio/b2.wav"]
    for t, files in tasks.items():
        assert [r["error"] for r in results[t]] == [None, None]
        for _, _, name in files:
            assert (tmp_path / name).read_text().strip() == Path(name).stem


def test_a_workers_heartbeat_cut_by_its_own_close_is_not_logged():
    """Dropped: the heartbeat error a closing worker's own connection pool, or the closing
    scheduler's closed stream, causes (installed once). Kept: other heartbeat failures and other
    errors."""
    import logging

    from distributed.comm.core import CommClosedError

    log = logging.getLogger("distributed.worker")
    before = list(log.filters)
    log.filters[:] = [f for f in before if not isinstance(f, bulk_worker._PoolClosing)]   # an in-process worker's
    try:
        bulk_worker._quiet_pool_closing()
        bulk_worker._quiet_pool_closing()
        (f,) = [f for f in log.filters if isinstance(f, bulk_worker._PoolClosing)]
        beat = "Failed to communicate with scheduler during heartbeat."
        closing = CommClosedError("ConnectionPool closing.")
        gone = CommClosedError("in <TCP (closed) ConnectionPool.heartbeat_worker local=tcp://127.0.0.1:35996 "
                               "remote=tcp://127.0.0.1:36497>: Stream is closed")
        for msg, exc, kept in ((beat, closing, False), (beat, gone, False), (beat, OSError("Timed out"), True),
                               ("Worker stream died", closing, True)):
            assert f.filter(logging.makeLogRecord({"msg": msg, "exc_info": (type(exc), exc, None)})) == kept
    finally:
        log.filters[:] = before


def test_output_names_are_kept_when_the_manifest_changes(tmp_path):
    """A source keeps the output name an earlier run gave it, so a resumed run with a changed
    manifest never takes another file's transcript for a new file's (x-1 was a's: c gets x-3)."""
    from glm_asr.bulk.manifest import kept_names

    out = tmp_path / "out"
    a, b, c = (str(tmp_path / d / "x.wav") for d in "abc")
    assert kept_names([a, b], "txt", out) == ["x-1.txt", "x-2.txt"]
    assert kept_names([c, a, b], "txt", out) == ["x-3.txt", "x-1.txt", "x-2.txt"]
    assert kept_names([b, c], "txt", out) == ["x-2.txt", "x-3.txt"]                  # removed: nothing moves
    assert kept_names([a, a], "json", out) == ["x-1.json", "x-2.json"]               # per format; a path twice
    assert kept_names([a, b, c], "txt", out) == ["x-1.txt", "x-2.txt", "x-3.txt"]


def test_a_manifest_with_a_byte_order_mark(tmp_path):
    from glm_asr.bulk.manifest import read_manifest

    (tmp_path / "m.txt").write_text("\ufeff/abs/one.wav\nrel/two.wav\n", encoding="utf-8")
    assert read_manifest(tmp_path / "m.txt") == ["/abs/one.wav", str(tmp_path / "rel" / "two.wav")]


def test_a_moved_corpus_keeps_its_output_names(tmp_path):
    """Sources whose recorded names' owners have all left the manifest (the corpus mounted
    elsewhere) get those names back: their outputs count as done."""
    from glm_asr.bulk.manifest import kept_names

    out = tmp_path / "out"
    old = [str(tmp_path / "old" / f) for f in ("a.wav", "b.wav")]
    new = [str(tmp_path / "new" / f) for f in ("a.wav", "b.wav")]
    assert kept_names(old, "txt", out) == ["a.txt", "b.txt"]
    assert kept_names(new, "txt", out) == ["a.txt", "b.txt"]
    assert kept_names(new + old, "txt", out) == ["a.txt", "b.txt", "a-2.txt", "b-2.txt"]   # both listed: apart


def test_an_interrupted_run_counts_what_is_on_disk(tiny, audio_dir, tmp_path):
    """Ctrl-C mid-run: 'stopped: N transcribed' counts the outputs the workers had written, also
    those whose results had not come back yet (a re-run skips exactly N)."""
    import re
    import signal
    import time

    src = tmp_path / "src"
    src.mkdir()
    for i in range(40):
        (src / f"f{i:02d}.wav").write_bytes((audio_dir / "speech16k.wav").read_bytes())
    out = tmp_path / "out"
    args = [f"manifest={src}", f"output_dir={out}", f"model.path={tiny}", "device=cpu", "vad=none",
            "max_new_tokens=8", "workers=1", "task_seconds=0"]
    p = subprocess.Popen([sys.executable, "-m", "glm_asr.bulk", *args], stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    deadline = time.monotonic() + 240
    while p.poll() is None and time.monotonic() < deadline and not list(out.glob("f*.txt")):
        time.sleep(0.05)
    p.send_signal(signal.SIGINT)
    err = p.communicate(timeout=120)[1]
    said = re.search(r"^(stopped|done): (\d+) transcribed", err, re.M)
    assert said and int(said.group(2)) == len(list(out.glob("f*.txt"))), err
