"""What the command lines and servers share: finding their Hydra configs, checking the options each
declares once (Opt: type, range or choices) at the config boundary, telling input paths from
overrides, and one-line errors instead of tracebacks."""
from __future__ import annotations

import math
import os
import re
import sys
import threading
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Callable, NoReturn

from ..compiler import CompilerError
from .checkpoint import CheckpointError
from .precision import PRECISIONS

_HYDRA_VALUE_FLAGS = {"--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn",
                      "--config-dir", "-cd", "--info", "-i", "--experimental-rerun"}
_HYDRA_FLAGS = _HYDRA_VALUE_FLAGS | {"--help", "-h", "--hydra-help", "--version", "--resolve", "--run", "-r",
                                     "--multirun", "-m", "--shell-completion", "-sc"}
_INFO = {"all", "config", "defaults", "defaults-tree", "plugins", "searchpath"}     # --info's optional value


def config_dir(package: str) -> str:
    """The Hydra config directory of a model package, <package>/configs: a link to the repository's
    top-level configs/<package> (the one copy) that sdists and wheels carry as files."""
    return str(resources.files(package) / "configs")


@dataclass(frozen=True)
class Opt:
    """One option's declaration: its type (int, float, str or bool), whether it takes null, and the
    values it allows: min and max (inclusive), gt (exclusive) or choices. Each command declares its
    options once, a table of these (name -> Opt), and options() checks them all the same way."""
    type: type
    optional: bool = False
    min: float | None = None
    max: float | None = None
    gt: float | None = None
    choices: tuple[str, ...] = ()

    def __call__(self, *, min: float | None = None, max: float | None = None, gt: float | None = None,
                 choices: tuple[str, ...] = ()) -> Opt:
        """This kind with a range or choices: Int(min=1), Float(gt=0, max=1), Str(choices=(...))."""
        return replace(self, min=min, max=max, gt=gt, choices=tuple(choices))

    def bounded(self) -> bool:
        """Whether a range is declared (a bounded float takes finite values only)."""
        return (self.min, self.max, self.gt) != (None, None, None)

    def allowed(self) -> str:
        """What the option takes, as its error line says: 'an integer >= 1', 'one of silero, none'."""
        if self.choices:
            return f"one of {', '.join(self.choices)}"
        if self.type is bool:
            return "true or false"
        what = {int: "an integer", float: "a number", str: "a string"}[self.type]
        if self.min is not None and self.max is not None:
            return f"{what} from {_bound(self.min)} to {_bound(self.max)}"
        if self.type is float and self.bounded() and (self.max is None or (self.min, self.gt) == (None, None)):
            what = "a finite number"        # one side open (bounded: inf and nan are refused too)
        parts = [f"{op} {_bound(v)}" for op, v in ((">=", self.min), (">", self.gt), ("<=", self.max)) if v is not None]
        return " ".join([what, " and ".join(parts)]) if parts else what

    def accepts(self, v) -> bool:
        """Whether v (already of this type) is in the declared range or choices."""
        if self.choices:
            return v in self.choices
        if self.type is float and self.bounded() and not math.isfinite(v):
            return False
        return ((self.min is None or v >= self.min) and (self.gt is None or v > self.gt)
                and (self.max is None or v <= self.max))


Int, OptInt, Float, OptFloat, Str, OptStr, Bool = (Opt(int), Opt(int, True), Opt(float), Opt(float, True), Opt(str),
                                                    Opt(str, True), Opt(bool))
Device = Str(choices=("auto", "cpu", "gpu"))
Precision = Str(choices=tuple(PRECISIONS))
_BOOLS = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False, "off": False}


def _bound(v: float) -> str:
    """A range's end as written: 100, 0.5, and a large 2**n - 1 by its formula (2**63 - 1)."""
    if isinstance(v, int) and v > 2 ** 16 and v & (v + 1) == 0:
        return f"2**{v.bit_length()} - 1"
    return f"{v:g}"


def _parse(v, kind: type):
    """v as kind, or None when it is not one: Hydra passes `key=abc` as a string and `key=2.7` as a
    float, so an integer is an int, a whole float or an integer's text; never a bool for a number."""
    if kind is bool:
        return v if isinstance(v, bool) else _BOOLS.get(str(v).strip().lower())
    if kind is str:
        return str(v)
    if isinstance(v, bool):
        return None
    if kind is int and isinstance(v, (int, float)):
        return int(v) if isinstance(v, int) or v.is_integer() else None
    try:
        return kind(str(v).strip()) if kind is int else float(v)
    except (TypeError, ValueError):
        return None


def check(name: str, v, opt: Opt):
    """v as option `name` declares it (opt), or a ValueError of one line naming the option, what it
    allows and what it got: 'max_batch must be an integer >= 1, got 0'."""
    if v is None and opt.optional:
        return None
    value = None if v is None else _parse(v, opt.type)
    if value is None or not opt.accepts(value):
        got = "null" if v is None else repr(v if value is None else value)
        raise ValueError(f"{name} must be {opt.allowed()}, got {got}")
    return value


def profile_at_exit(enabled: bool) -> None:
    """profile=true: print where the run's wall time went (runtime.profile) as the process exits."""
    if enabled:
        import atexit

        from .profile import report

        atexit.register(report)


def options(cfg, table: dict[str, Opt]) -> dict:
    """A command's options (table: each name's Opt, the command's one declaration of them) read from
    its Hydra config and checked, as a dict of typed values: the one place they are checked, so no
    call site repeats a range check. An option absent from cfg is null."""
    return {name: check(name, cfg.get(name), opt) for name, opt in table.items()}


def split_args(args: list[str]) -> tuple[list[str], list[str]]:
    """(input paths, Hydra arguments): an existing path is always an input, even with '=' in its
    name or a leading '-', and so is '-' (standard input); everything after '--' is an input; other
    'key=value' and '-flag' arguments go to Hydra (with the value of a Hydra flag that takes one: --cfg job); anything
    else is an input (a missing file, reported as such)."""
    inputs, rest, i = [], [], 0
    while i < len(args):
        a = args[i]
        if a == "--":
            return inputs + args[i + 1:], rest
        if a == "-" or Path(a).exists() or ("=" not in a and not a.startswith("-")):
            inputs.append(a)
            i += 1
        else:
            n = _hydra_flag(args, i)[1] if a.startswith("-") else 1
            rest += args[i:i + n]
            i += n
    return inputs, rest


def run_hydra(hydra_main: Callable[[], None]) -> None:
    """Call a @hydra.main function with Hydra's own failures (an unknown option, an override it
    cannot parse, no such config in a group) as one 'error: ...' line and exit 1, where Hydra
    itself prints several (HYDRA_FULL_ERROR, Hydra's documented switch, has it raise them)."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        sys.argv[1:] = hydra_argv(sys.argv[1:])
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    before = os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        hydra_main()
    except BrokenPipeError as e:            # --help or --cfg job | head
        _closed_pipe(e)
    except (HydraException, OmegaConfBaseException, ValueError) as e:      # ValueError: Hydra's own flag checks
        print(f"error: {hydra_message(e)}", file=sys.stderr)
        sys.exit(1)
    finally:
        if before is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = before


def hydra_argv(args: list[str]) -> list[str]:
    """Hydra's arguments with its flags (and their values) first: its parser takes no key=value
    after a flag (device=cpu --cfg job prompt=x failed with a usage block). The forms argparse
    takes stay as they are (--cfg=job, -cjob, -c=job, --he for --help, -- and what follows); a flag
    Hydra does not know, and multirun (-m), are a ValueError of one line (--output_dir=out: options
    are key=value)."""
    flags, overrides, i = [], [], 0
    while i < len(args):
        a = args[i]
        if a == "--":
            overrides += args[i:]
            break
        if not a.startswith("-") or a == "-":
            overrides.append(a)
            i += 1
            continue
        known, n = _hydra_flag(args, i)
        if not known:
            hint = f"write {a.lstrip('-')}" if "=" in a else "see --help"
            raise ValueError(f"unknown flag {a!r}: options are key=value ({hint})")
        if known in (["--multirun"], ["-m"]):     # its first run's exit ended the sweep, in a multirun/ folder
            raise ValueError(f"{a}: Hydra's multirun is not supported; run the command once a setting")
        flags += args[i:i + n]
        i += n
    return flags + overrides


def _hydra_flag(args: list[str], i: int) -> tuple[list[str], int]:
    """(the Hydra flags args[i] names: the one it spells, else those it abbreviates (--multi) or
    begins with a value attached (-cjob); [] for none, how many arguments it spans: 2 with its
    value apart (--cfg job), else 1). --info's value is optional: only one of its choices is it."""
    a = args[i]
    name = a.split("=", 1)[0]
    if a.startswith("--"):
        longs = sorted(f for f in _HYDRA_FLAGS if f.startswith("--"))
        known = [f for f in longs if f == name] or [f for f in longs if f.startswith(name)]
    else:
        shorts = [f for f in _HYDRA_FLAGS if not f.startswith("--")]
        known = [f for f in shorts if f == name] or [f for f in shorts if name.startswith(f)]
    whole = a.startswith("--") and "=" not in a or bool(known) and a == known[0]     # no value attached to it
    apart = len(known) == 1 and known[0] in _HYDRA_VALUE_FLAGS and whole and i + 1 < len(args) \
        and (known[0] not in ("--info", "-i") or args[i + 1] in _INFO)
    return known, 2 if apart else 1


def hydra_message(e: Exception) -> str:
    """A Hydra or OmegaConf error in one line: an unknown option or an unreadable override named
    as such, else its message's lines up to the config search path, a list's items joined."""
    text = str(e)
    unknown = re.match(r"Could not override '([^']+)'", text)
    if unknown and "not in struct" in str(e.__cause__ or ""):
        return f"unknown option {unknown.group(1)!r} (see --cfg job for the options)"
    if getattr(e, "override", None) is not None:        # OverrideParseException
        return f"cannot read the override {e.override!r} (quote a value with spaces or other characters)"
    head, items = [], []
    for line in text.splitlines():
        if line.startswith("Config search path"):
            break
        (items if line.startswith("\t") else head).append(" ".join(line.split()))
    return "; ".join(h for h in head if h) + (" " + ", ".join(items) if items else "") or type(e).__name__


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread as Ctrl-C's KeyboardInterrupt is: the same clean-up."""


def _terminate(signum, frame) -> None:
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_DFL)       # a second SIGTERM ends it at once
    raise Terminated()


def _closed_pipe(e: BrokenPipeError) -> NoReturn:
    """The reader of standard output went away (| head): end quietly with 141, as a tool SIGPIPE
    ends; a broken pipe elsewhere (stdout a file or terminal) is an error line."""
    import stat

    try:
        mode = os.fstat(sys.stdout.fileno()).st_mode
    except (OSError, ValueError, AttributeError):
        mode = 0
    if not (stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)):
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())     # no second error at exit's flush
    sys.exit(141)


def exit_with_one_line_errors(run: Callable[[], int | None]) -> NoReturn:
    """Run a CLI body: expected failures become one 'error: ...' line and exit 1, never a traceback
    (a config the body cannot read, say a key deleted with ~key, too: one line, as run_hydra's).
    SIGTERM stops it as Ctrl-C does (temporary files removed; exit 143, Ctrl-C 130; a second
    SIGTERM ends it at once); a reader that closed the output pipe (| head) ends it quietly (exit
    141, as a tool SIGPIPE ends). A server's uvicorn takes SIGTERM itself (run_server)."""
    import signal

    from omegaconf.errors import OmegaConfBaseException

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminate)
    try:
        code = run() or 0
    except BrokenPipeError as e:
        _closed_pipe(e)
    except OmegaConfBaseException as e:        # before ValueError: some are ValueErrors of several lines
        print(f"error: {hydra_message(e)}", file=sys.stderr)
        sys.exit(1)
    except (CheckpointError, CompilerError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt as e:
        sys.exit(143 if isinstance(e, Terminated) else 130)
    sys.exit(code)
