"""The command lines' shared parts, without running a model: option checking, telling input
paths from Hydra overrides, output file names, atomic writes, finding the configs."""
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from glm_asr.formats import output_names, render, write_atomic
from tilekernels.runtime.cli import (Bool, Float, Int, OptInt, OptStr, Str, config_dir, hydra_argv, options,
                                     split_args)


# --- options(): checked values at the config boundary ---------------------------------------

@pytest.mark.parametrize("value", ["12", " 12 ", 12, 12.0])
def test_int_option_accepts_integers(value):
    out = options(OmegaConf.create({"max_new_tokens": value}), {"max_new_tokens": Int})
    assert out == {"max_new_tokens": 12} and type(out["max_new_tokens"]) is int


@pytest.mark.parametrize("value", ["abc", 2.7, True, False, "2.7", "", float("nan"), float("inf")])
def test_int_option_refuses_non_integers_naming_the_option(value):
    with pytest.raises(ValueError, match=r"^max_new_tokens must be an integer") as e:
        options({"max_new_tokens": value}, {"max_new_tokens": Int})
    assert "\n" not in str(e.value)


def test_float_str_and_optional_options():
    cfg = OmegaConf.create({"temperature": "0.5", "top_p": 1, "seed": None, "prompt_file": None,
                            "device": "cpu", "num": 3})
    out = options(cfg, {"temperature": Float, "top_p": Float, "seed": OptInt, "prompt_file": OptStr,
                        "device": Str, "num": OptInt})
    assert out == {"temperature": 0.5, "top_p": 1.0, "seed": None, "prompt_file": None, "device": "cpu", "num": 3}
    assert type(out["temperature"]) is float and type(out["top_p"]) is float
    for bad in ("abc", True):
        with pytest.raises(ValueError, match=r"^temperature must be a number"):
            options({"temperature": bad}, {"temperature": Float})
    with pytest.raises(ValueError, match=r"^seed must be an integer"):
        options({"seed": "abc"}, {"seed": OptInt})
    with pytest.raises(ValueError, match=r"^max_batch must be an integer, got null$"):    # a plain Int takes no null
        options({"max_batch": None}, {"max_batch": Int})


@pytest.mark.parametrize("opt,value,message", [
    (Int(min=1), 0, "n must be an integer >= 1, got 0"),
    (Int(min=1, max=128), 129, "n must be an integer from 1 to 128, got 129"),
    (Int(min=1, max=128), "abc", "n must be an integer from 1 to 128, got 'abc'"),
    (OptInt(min=0), -1, "n must be an integer >= 0, got -1"),
    (OptInt(min=0, max=2 ** 63 - 1), 2 ** 63, "n must be an integer from 0 to 2**63 - 1, got 9223372036854775808"),
    (Float(gt=0), 0, "n must be a finite number > 0, got 0.0"),
    (Float(gt=0), "inf", "n must be a finite number > 0, got inf"),
    (Float(min=0), float("nan"), "n must be a finite number >= 0, got nan"),
    (Float(gt=0, max=1), 1.5, "n must be a number > 0 and <= 1, got 1.5"),
    (Float(max=0), float("-inf"), "n must be a finite number <= 0, got -inf"),
    (Float(min=0, max=100), -1, "n must be a number from 0 to 100, got -1.0"),
    (Str(choices=("silero", "none")), "x", "n must be one of silero, none, got 'x'"),
    (Str(choices=("silero", "none")), None, "n must be one of silero, none, got null"),
    (Bool, "maybe", "n must be true or false, got 'maybe'"),
])
def test_declared_range_or_choices_refused_in_one_line(opt, value, message):
    """A value outside an option's declared range or choices: one line naming the option, what it
    takes and what it got."""
    with pytest.raises(ValueError) as e:
        options({"n": value}, {"n": opt})
    assert str(e.value) == message


def test_declared_range_and_choices_accepted():
    table = {"a": Int(min=1, max=128), "b": OptInt(min=0), "c": Float(gt=0, max=1), "d": Str(choices=("x", "y")),
             "e": Float(min=0), "f": Bool, "g": Float}
    cfg = OmegaConf.create({"a": "128", "b": None, "c": 1, "d": "y", "e": 0, "f": "off", "g": "inf"})
    assert options(cfg, table) == {"a": 128, "b": None, "c": 1.0, "d": "y", "e": 0.0, "f": False, "g": float("inf")}


# --- every command line and server: a bad option is one error line before any work -------------

COMMANDS = {"gpt.generate": [], "gpt.serve": [], "glm_asr.transcribe": ["x.wav"],
            "glm_asr.serve": [], "glm_asr.bulk": ["manifest=m.txt", "output_dir=out"], "glm_asr.live": ["x.wav"]}


@pytest.mark.parametrize("module,arg", [
    ("gpt.generate", "max_batch=0"), ("gpt.generate", "top_p=1.5"), ("gpt.generate", "precision=fp8"),
    ("gpt.serve", "max_rows=0"), ("gpt.serve", "timeout_read=0"), ("gpt.serve", "device=tpu"),
    ("glm_asr.transcribe", "encoder_batch=0"), ("glm_asr.transcribe", "vad=webrtc"),   # transcribe has no float option
    ("glm_asr.serve", "port=70000"), ("glm_asr.serve", "max_upload_mb=-1"), ("glm_asr.serve", "output_format=doc"),
    ("glm_asr.bulk", "gpus=-1"), ("glm_asr.bulk", "task_seconds=nan"), ("glm_asr.bulk", "output_format=doc"),
    ("glm_asr.live", "speed=-1"), ("glm_asr.live", "input_sample_rate=0"), ("glm_asr.live", "timestamps=maybe"),
])
def test_bad_option_is_one_line_naming_it(module, arg, tmp_path):
    """An int, a float and a choice option of each command out of range: exit 1, one stderr line
    naming the option and what it takes, no traceback, nothing done (no model is read)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": "/tmp/empty-hf-home"}
    model = [] if module == "glm_asr.live" else ["model.path=/nonexistent"]     # the live client loads none
    r = subprocess.run([sys.executable, "-m", module, *COMMANDS[module], arg, *model],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    name = arg.split("=")[0]
    assert r.returncode == 1 and r.stdout == "" and "Traceback" not in r.stderr, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {name} must be "), r.stderr
    assert ", got " in lines[0] and list(tmp_path.iterdir()) == [], lines[0]


@pytest.mark.parametrize("module", sorted(COMMANDS))
@pytest.mark.parametrize("arg,says", [("no_such_option=1", "error: unknown option 'no_such_option'"),
                                      ("prompt=h\u00e9llo world", "error: cannot read the override"),
                                      ("model=no-such-model", "error: In "),
                                      ("max_new_tokens=[", "error: cannot read the override")])
def test_what_hydra_refuses_is_one_line(module, arg, says, tmp_path):
    """A misspelled option, an override Hydra cannot parse, a config group without that choice:
    one line, exit 1 (Hydra itself prints several), for every command."""
    if module == "glm_asr.live" and arg.startswith("model="):
        return                                      # the live client has no model group
    r = subprocess.run([sys.executable, "-m", module, *COMMANDS[module], arg], capture_output=True, text=True,
                       cwd=tmp_path, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and lines[0].startswith(says), r.stderr


@pytest.mark.parametrize("module", sorted(COMMANDS))
def test_a_flag_before_an_option_and_an_unknown_flag(module, tmp_path):
    """Hydra's parser takes no key=value after one of its flags: `device=cpu --cfg job x=y` works
    as `--cfg job device=cpu x=y` does; a GNU-style --output_dir=out is one line naming the fix."""
    r = subprocess.run([sys.executable, "-m", module, *COMMANDS[module], "--cfg", "job", "+zz=1"], capture_output=True,
                       text=True, cwd=tmp_path, timeout=120)
    assert r.returncode == 0 and r.stderr == "" and "zz: 1" in r.stdout.splitlines(), r.stderr
    r = subprocess.run([sys.executable, "-m", module, *COMMANDS[module], "--output_dir=out"], capture_output=True,
                       text=True, cwd=tmp_path, timeout=120)
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        "error: unknown flag '--output_dir=out': options are key=value (write output_dir=out)"], r.stderr


@pytest.mark.parametrize("module", sorted(COMMANDS))
def test_help_names_the_command_and_how_options_are_given(module, tmp_path):
    r = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, cwd=tmp_path,
                       timeout=120)
    lines = r.stdout.strip().splitlines()
    assert r.returncode == 0 and lines[0].startswith(f"python -m {module} ") and "is powered by Hydra" not in r.stdout
    assert lines[-1].startswith("Options are key=value"), lines[-1]


def test_hydra_argv_puts_flags_first():
    assert hydra_argv(["device=cpu", "--cfg", "job", "prompt=x"]) == ["--cfg", "job", "device=cpu", "prompt=x"]
    assert hydra_argv(["a=1", "--info", "b=2", "--cfg=job"]) == ["--info", "--cfg=job", "a=1", "b=2"]
    assert hydra_argv(["--info", "config", "a=1"]) == ["--info", "config", "a=1"]
    with pytest.raises(ValueError, match="unknown flag '-x'"):
        hydra_argv(["-x"])
    assert hydra_argv(["a=1", "-cjob", "--he"]) == ["-cjob", "--he", "a=1"]
    for sweep in ("-m", "--multirun", "--multi"):
        with pytest.raises(ValueError, match="multirun is not supported"):
            hydra_argv([sweep, "seed=1,2"])


# --- split_args(): input paths beside Hydra's overrides -------------------------------------

def test_a_key_deleted_from_the_config_is_one_line(tmp_path):
    """~prompt leaves gpt.generate's body a config without the key: one line, not Hydra's report
    ("Error executing job ...") before it."""
    r = subprocess.run([sys.executable, "-m", "gpt.generate", "~prompt"], capture_output=True, text=True,
                       cwd=tmp_path, timeout=120)
    assert r.returncode == 1 and r.stderr.strip().splitlines() == ["error: Key 'prompt' is not in struct; "
                                                                   "full_key: prompt; object_type=dict"], r.stderr


def test_split_args_existing_paths_are_inputs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("name=with_equals.wav", "-dash.wav", "plain.wav"):
        (tmp_path / name).write_bytes(b"")
    inputs, rest = split_args(["name=with_equals.wav", "-dash.wav", "./-dash.wav", "key=value", "--cfg=job",
                               "-m", "plain.wav", "missing.wav", "output_format=json"])
    assert inputs == ["name=with_equals.wav", "-dash.wav", "./-dash.wav", "plain.wav", "missing.wav"]
    assert rest == ["key=value", "--cfg=job", "-m", "output_format=json"]


def test_split_args_everything_after_double_dash_is_an_input(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    inputs, rest = split_args(["a.wav", "device=cpu", "--", "x=y.wav", "-z.wav", "--", "b.wav"])
    assert inputs == ["a.wav", "x=y.wav", "-z.wav", "--", "b.wav"]
    assert rest == ["device=cpu"]


def test_split_args_hydra_flag_with_separate_value(tmp_path, monkeypatch):
    """Hydra's `--cfg job` (also `-c job`, `-cn NAME`, `--info config`) is a flag and its value:
    the value must go to Hydra with the flag, not become an input file."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.wav").write_bytes(b"")
    inputs, rest = split_args(["a.wav", "--cfg", "job", "device=cpu"])
    assert inputs == ["a.wav"]
    assert rest == ["--cfg", "job", "device=cpu"]
    # as Hydra's parser reads them (hydra_argv's rule): an abbreviation takes its value, --info only
    # one of its choices
    assert split_args(["--config-d", "/conf", "a.wav"]) == (["a.wav"], ["--config-d", "/conf"])
    assert split_args(["--info", "a.wav", "-i", "config"]) == (["a.wav"], ["--info", "-i", "config"])


# --- output_names(): one output per input, never two the same --------------------------------

def test_output_names_unique_stems_kept():
    assert output_names(["a/one.wav", "two.flac", "/abs/three.ogg"], "srt") == ["one.srt", "two.srt", "three.srt"]


def test_output_names_clashing_stems_numbered_in_order():
    assert output_names(["s1/x.wav", "s2/x.wav"], "txt") == ["x-1.txt", "x-2.txt"]
    assert output_names(["x.wav", "x.flac", "y.wav"], "json") == ["x-1.json", "x-2.json", "y.json"]


def test_output_names_never_take_another_inputs_name():
    names = output_names(["x-1.wav", "a/x.wav", "b/x.wav"], "txt")
    assert names[0] == "x-1.txt" and len(set(names)) == 3
    assert output_names(["a/x.wav", "x-1.wav", "b/x.wav", "x-3.wav"], "txt") == \
        ["x-2.txt", "x-1.txt", "x-4.txt", "x-3.txt"]


def test_output_names_always_distinct():
    """Every small mix of clashing and number-suffixed stems gives distinct names."""
    stems = ["x", "x-1", "x-2", "x-1-1", "y"]
    for n in range(1, 5):
        for combo in itertools.product(stems, repeat=n):
            paths = [f"d{i}/{s}.wav" for i, s in enumerate(combo)]
            names = output_names(paths, "txt")
            assert len(set(names)) == len(names), (combo, names)
            for s, name in zip(combo, names):
                if combo.count(s) == 1:
                    assert name == f"{s}.txt", (combo, names)


# --- render() and write_atomic() ---------------------------------------------------------------

SEGMENTS = [{"start": 0.0, "end": 30.0, "text": "hello\nthere"}, {"start": 30.0, "end": 31.5, "text": "東京"}]


def test_render_json_line_is_one_json_line():
    line = render("json", "a b.wav", SEGMENTS, json_line=True)
    assert line.endswith("\n") and line.count("\n") == 1
    doc = json.loads(line)
    assert doc["file"] == "a b.wav" and doc["segments"] == SEGMENTS and doc["text"] == "hello there 東京"
    pretty = render("json", "a b.wav", SEGMENTS)
    assert pretty.count("\n") > 1 and json.loads(pretty) == doc


def test_render_cues_of_fixed_windows():
    """vad=none's windows as srt/vtt cues: as long as the window when its text fits one cue, a
    long text cut into cues of at most 2 lines of 42 columns over the window; '-->' written '->',
    vtt's <, > and & escaped, no cue for a window without text, a line of txt even for no text;
    the text is the API's (Transcript.text's CJK-aware join)."""
    segments = SEGMENTS + [{"start": 31.5, "end": 40.0, "text": "  "},
                           {"start": 40.0, "end": 41.0, "text": "a --> b\n\nc"}]
    assert render("srt", "x", segments, windows=True) == ("1\n00:00:00,000 --> 00:00:30,000\nhello there\n\n"
                                                          "2\n00:00:30,000 --> 00:00:31,500\n東京\n\n"
                                                          "3\n00:00:40,000 --> 00:00:41,000\na -> b c\n\n")
    assert render("vtt", "x", segments, windows=True).endswith("00:00:40.000 --> 00:00:41.000\na -&gt; b c\n\n")
    assert "Tom &amp; Jerry &lt;b&gt;" in render("vtt", "x", [{"start": 0, "end": 1, "text": "Tom & Jerry <b>"}])
    long = [{"start": 0.0, "end": 30.0, "text": " ".join(["word"] * 90)}]
    srt = render("srt", "x", long, windows=True).split("\n\n")[:-1]
    assert len(srt) >= 5 and srt[-1].split("\n")[1].endswith("--> 00:00:30,000")
    assert all(len(cue.split("\n")) <= 4 and max(len(line) for line in cue.split("\n")[2:]) <= 42 for cue in srt)
    cjk = [{"start": 0, "end": 1, "text": "今天"}, {"start": 1, "end": 2, "text": "很好"}]
    assert render("txt", "x", cjk) == "今天很好\n" and render("txt", "x", []) == "\n"


def _leftovers(d: Path) -> list[str]:
    return [p.name for p in d.iterdir() if p.name.startswith(".")]


def test_write_atomic_writes_and_replaces(tmp_path):
    target = tmp_path / "sub" / "x.txt"
    write_atomic(target, "one\n")
    write_atomic(target, "two\n")
    assert target.read_text() == "two\n" and _leftovers(target.parent) == []


def test_write_atomic_output_dir_is_a_file(tmp_path):
    """output_dir an existing regular file: fails even as root; the error names the output."""
    blocker = tmp_path / "outdir"
    blocker.write_text("not a directory")
    target = blocker / "x.txt"
    with pytest.raises(OSError) as e:
        write_atomic(target, "text")
    msg = str(e.value)
    assert str(target) in msg and ".x.txt." not in msg and "\n" not in msg
    assert blocker.read_text() == "not a directory" and _leftovers(tmp_path) == []


def test_write_atomic_failed_rename_leaves_no_temp_file(tmp_path):
    """The target is an existing directory: the temporary file is written, the rename fails;
    the error names the output and the temporary file is removed."""
    target = tmp_path / "x.txt"
    target.mkdir()
    (target / "keep").write_text("")
    with pytest.raises(OSError) as e:
        write_atomic(target, "text")
    msg = str(e.value)
    assert str(target) in msg and ".x.txt." not in msg
    assert _leftovers(tmp_path) == [] and [p.name for p in target.iterdir()] == ["keep"]


def test_write_atomic_failures_name_the_file_and_leave_nothing(tmp_path):
    """A rename that fails (the name is a directory: root too) and, where the user is not root, a
    read-only directory: one OSError naming the output, no temporary file left."""
    (tmp_path / "x.txt").mkdir()
    with pytest.raises(OSError) as e:
        write_atomic(tmp_path / "x.txt", "text")
    assert str(tmp_path / "x.txt") in str(e.value) and ".x.txt." not in str(e.value)
    assert [p.name for p in tmp_path.iterdir()] == ["x.txt"]
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o555)
    try:
        if not os.access(d, os.W_OK):
            with pytest.raises(OSError) as e:
                write_atomic(d / "x.txt", "text")
            assert str(d / "x.txt") in str(e.value) and ".x.txt." not in str(e.value)
            assert list(d.iterdir()) == []
    finally:
        d.chmod(0o755)


# --- config_dir(): the Hydra configs of each model package ------------------------------------

@pytest.mark.parametrize("package,name", [("gpt", "generate.yaml"), ("glm_asr", "transcribe.yaml")])
def test_config_dir_has_the_app_config(package, name):
    d = Path(config_dir(package))
    assert d.is_absolute() and (d / name).is_file() and (d / "model").is_dir()
    text = (d / name).read_text()
    assert "defaults:" in text and "device:" in text
