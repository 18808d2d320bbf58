"""Worker processes end with the process that started them, however it ends (kill -9 too):
tilekernels.runtime.parent.watch_parent, the VAD's worker pool (and multiprocessing's resource
tracker with it) and a bulk run's local Dask workers. Real processes, walked through /proc."""
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from processes import alive, cmdline, descendants, gone_within, kill_all, stat  # noqa: E402

GONE_S = 5.0            # how long a watched process may outlive its parent (it polls every 0.5 s)


def assert_killing_ends_them(proc: subprocess.Popen, procs: dict[int, int]) -> None:
    """Kill proc with SIGKILL (it cleans nothing up) and assert that every one of procs is gone
    within GONE_S."""
    proc.kill()
    proc.wait(30)
    left = gone_within(procs, GONE_S)
    assert not left, {p: cmdline(p) for p in left}


def read_line(proc: subprocess.Popen, timeout: float) -> str:
    """The next line of proc's stdout, failing after timeout seconds without one."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"no output from {proc.args} in {timeout} s"
    line = proc.stdout.readline()
    assert line, f"{proc.args} ended: {proc.wait()}"
    return line.strip()


def python(code: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, **kw)


def stop(proc: subprocess.Popen, procs: dict[int, int]) -> None:
    """Kill proc and whatever of procs is left, and reap proc."""
    kill_all(procs)
    if proc.poll() is None:
        proc.kill()
    proc.wait(30)


# ------------------------------------------------------------------ watch_parent
GRANDCHILD = """
import os, time
from tilekernels.runtime.parent import watch_parent
watch_parent()
print(os.getpid(), flush=True)
time.sleep(120)
"""


def test_a_watching_process_ends_with_its_parent():
    """A child starts a grandchild that calls watch_parent(); the child killed with SIGKILL (no
    cleanup), the grandchild is gone within GONE_S."""
    child = python(f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', {GRANDCHILD!r}])\n"
                   "time.sleep(120)")
    procs = {}
    try:
        grandchild = int(read_line(child, 60))
        procs = {grandchild: stat(grandchild)[2]}
        assert_killing_ends_them(child, procs)
    finally:
        stop(child, procs)


# ------------------------------------------------------------------ the VAD's workers
VAD = """
import os, sys, time
import numpy as np
from glm_asr import vad
vad.start_workers()
vad.pooled_probs(np.zeros(16000, np.float32))
print(os.getpid(), flush=True)
if sys.stdin.readline().strip() == "stop":
    vad.stop_workers()
    print("stopped", flush=True)
time.sleep(120)
"""


def vad_server() -> tuple[subprocess.Popen, dict[int, int]]:
    """A process whose VAD workers are up, and its descendants: the workers and the resource tracker."""
    proc = python(VAD, stdin=subprocess.PIPE)
    read_line(proc, 120)
    procs = descendants(proc.pid)
    trackers = [p for p in procs if "resource_tracker" in cmdline(p)]
    assert len(trackers) == 1 and len(procs) >= 2, {p: cmdline(p) for p in procs}
    return proc, procs


def test_vad_workers_and_the_resource_tracker_end_with_a_killed_parent():
    proc, procs = vad_server()
    try:
        assert_killing_ends_them(proc, procs)
    finally:
        stop(proc, procs)


def test_stop_workers_ends_them():
    """stop_workers returns once the workers have exited; the resource tracker, which this process
    holds open too, stays until it exits."""
    proc, procs = vad_server()
    try:
        proc.stdin.write("stop\n")
        proc.stdin.flush()
        assert read_line(proc, 60) == "stopped"
        assert proc.poll() is None
        assert [cmdline(p) for p in alive(procs)] == [cmdline(p) for p in procs if "resource_tracker" in cmdline(p)]
    finally:
        stop(proc, procs)


# ------------------------------------------------------------------ a bulk run's Dask workers
def test_bulk_workers_end_with_a_killed_client(tiny, audio_dir, tmp_path):
    """python -m glm_asr.bulk killed with SIGKILL while its worker transcribes: every process it
    started (the `dask spec` process, its Nanny's worker process, resource trackers) is gone
    within GONE_S (left alone, they notice the scheduler is gone and close 10 s or more later)."""
    manifest = tmp_path / "manifest.txt"
    manifest.write_text(f"{audio_dir / 'long.flac'}\n" * 100)     # ~20 s of work on 2 cores
    log = tmp_path / "stderr.txt"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": "/tmp/empty-hf-home"}
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "glm_asr.bulk", f"manifest={manifest}",
                                 f"output_dir={tmp_path / 'out'}", f"model.path={tiny}", "device=cpu", "workers=1",
                                 "max_new_tokens=8", "output_format=json"], stderr=err, env=env)
    procs = {}
    try:
        deadline = time.monotonic() + 180
        while "\nbulk: " not in "\n" + log.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert proc.poll() is None and "\nbulk: " in "\n" + log.read_text(), log.read_text()
        procs = descendants(proc.pid)
        spec = [p for p in procs if "--spec" in cmdline(p)]
        assert len(spec) == 1 and [p for p in descendants(spec[0]) if "resource_tracker" not in cmdline(p)], \
            {p: cmdline(p) for p in procs}
        assert_killing_ends_them(proc, procs)
    finally:
        stop(proc, procs)


# ------------------------------------------------------------------ Ctrl-C in a terminal
def ctrl_c(command: list[str], ready, tmp_path: Path) -> tuple[int, str, dict[int, int], list[str]]:
    """command run as a terminal's foreground job (a process group of its own, a TMPDIR of its own)
    and Ctrl-C sent to the whole group once ready(pid, stderr so far): its exit status, stderr,
    the processes it had started by then and what it left in TMPDIR."""
    log, scratch = tmp_path / "stderr.txt", tmp_path / "tmp"
    scratch.mkdir()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TMPDIR": str(scratch)}
    with open(log, "w") as err:     # SIGINT as a terminal's job has it (a shell's background job ignores it)
        proc = subprocess.Popen(command, stderr=err, stdout=subprocess.DEVNULL, env=env, start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    procs = {}
    try:
        deadline = time.monotonic() + 180
        while not ready(proc.pid, log.read_text()) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, log.read_text()
        procs = descendants(proc.pid)
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(60)
        left = gone_within(procs, GONE_S)
        assert not left, {p: cmdline(p) for p in left}
        return proc.returncode, log.read_text(), procs, sorted(p.name for p in scratch.iterdir())
    finally:
        stop(proc, procs)


def speech(tmp_path: Path, minutes: float) -> str:
    """A FLAC of the speech fixtures (sentences and pauses) over and over: work that outlasts the test."""
    import numpy as np
    import soundfile as sf

    fixtures = Path(__file__).resolve().parent / "fixtures"
    x = np.concatenate([sf.read(fixtures / f, dtype="float32")[0] for f in ("pause3s.flac", "one.flac",
                                                                            "pause05.flac")])
    path = tmp_path / "speech.flac"
    sf.write(path, np.tile(x, int(minutes * 60 * 16000 / len(x)) + 1), 16000)
    return str(path)


def test_ctrl_c_stops_transcribe_and_its_vad_workers_quietly(tiny, tmp_path):
    """Ctrl-C reaches the VAD's worker processes too, while they start: exit 130, nothing on stderr
    (a worker printed its KeyboardInterrupt's traceback), no process or scratch file left."""
    command = [sys.executable, "-m", "glm_asr.transcribe", *[speech(tmp_path, 5)] * 3, f"model.path={tiny}",
               "device=cpu", f"output_dir={tmp_path / 'out'}"]
    code, err, procs, left = ctrl_c(command, lambda pid, _: len(descendants(pid)) >= 2, tmp_path)
    assert code == 130 and err == "" and left == [] and len(procs) >= 2, (err[-2000:], left)


def test_ctrl_c_stops_a_bulk_run_and_its_workers_cleanly(tiny, tmp_path):
    """Ctrl-C while a bulk run's worker transcribes: the run says what it did and exits 130, its
    workers close as at a run's end (no traceback, no leaked semaphores, no scratch folder but
    Dask's own)."""
    manifest = tmp_path / "manifest.txt"
    manifest.write_text(f"{speech(tmp_path, 5)}\n" * 20)
    command = [sys.executable, "-m", "glm_asr.bulk", f"manifest={manifest}", f"output_dir={tmp_path / 'out'}",
               f"model.path={tiny}", "device=cpu", "workers=1", "max_new_tokens=8", "output_format=json"]
    def working(pid, err):      # the run has begun: `dask spec`, its Nanny's worker process are up
        return "\nbulk: " in "\n" + err and any(d for s in descendants(pid) if "--spec" in cmdline(s)
                                                for d in descendants(s) if "resource_tracker" not in cmdline(d))

    code, err, procs, left = ctrl_c(command, working, tmp_path)
    assert code == 130 and "stopped: " in err and "Traceback" not in err and "leaked" not in err, err[-2000:]
    assert left in ([], ["dask-scratch-space"]), left


# ------------------------------------------------------------------ a user's script
SCRIPT = """
import glm_asr
from glm_asr.vad import workers
print("ran", flush=True)
asr = glm_asr.load({tiny!r}, device="cpu")
print(asr.transcribe({audio!r}, max_new_tokens=4).text is not None, workers._POOL[1] is not None, flush=True)
"""


def test_a_script_without_a_main_guard_runs_once(tiny, tmp_path):
    """The README's Python example as a plain script on the CPU: the VAD's worker processes are
    spawned only when that runs nothing of the user's again (a spawned process imports the main
    module): without `if __name__ == "__main__":` the VAD runs in the script's process, the
    script runs once, no traceback; with the guard the workers start."""
    audio = str(Path(__file__).resolve().parent / "fixtures" / "one.flac")
    body = SCRIPT.format(tiny=str(tiny), audio=audio)
    plain = tmp_path / "plain.py"
    plain.write_text(body)
    guarded = tmp_path / "guarded.py"
    guarded.write_text("import glm_asr\nfrom glm_asr.vad import workers\n\n\ndef main():\n"
                       + "".join(f"    {line}\n" for line in body.splitlines()[3:] if line)
                       + "\n\nif __name__ == '__main__':\n    main()\n")
    for script, pooled in ((plain, "False"), (guarded, "True")):
        r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert r.returncode == 0 and r.stdout.splitlines() == ["ran", f"True {pooled}"], (script.name, r.stdout,
                                                                                        r.stderr)
        assert "Traceback" not in r.stderr and "Error" not in r.stderr, r.stderr
