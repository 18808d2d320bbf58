"""What both command lines share: finding their Hydra configs, checking option types at the
config boundary, telling input paths from overrides, and one-line errors instead of tracebacks."""
from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path
from typing import Callable, NoReturn

from ..compiler import CompilerError
from .checkpoint import CheckpointError

Int, OptInt, Float, Str, OptStr, Bool = "int", "int?", "float", "str", "str?", "bool"
_HYDRA_VALUE_FLAGS = {"--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn",
                      "--config-dir", "-cd", "--info", "-i", "--experimental-rerun"}


def config_dir(package: str) -> str:
    """The Hydra config directory of a model package, <package>/configs: a link to the repository's
    top-level configs/<package> (the one copy) that sdists and wheels carry as files."""
    return str(resources.files(package) / "configs")


def _int(name: str, v) -> int:
    if isinstance(v, bool) or (isinstance(v, float) and not v.is_integer()):
        raise ValueError(f"{name} must be an integer, got {v!r}")
    if isinstance(v, (int, float)):
        return int(v)
    try:
        return int(str(v).strip())
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {v!r}") from None


def _float(name: str, v) -> float:
    if isinstance(v, bool):
        raise ValueError(f"{name} must be a number, got {v!r}")
    try:
        return float(v)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {v!r}") from None


def _bool(name: str, v) -> bool:
    if isinstance(v, bool):
        return v
    text = str(v).strip().lower()
    if text in ("true", "1", "yes", "on", "false", "0", "no", "off"):
        return text in ("true", "1", "yes", "on")
    raise ValueError(f"{name} must be true or false, got {v!r}")


def profile_at_exit(enabled: bool) -> None:
    """profile=true: print where the run's wall time went (runtime.profile) as the process exits."""
    if enabled:
        import atexit

        from .profile import report

        atexit.register(report)


def options(cfg, kinds: dict[str, str]) -> dict:
    """The named options of a Hydra config as checked Python values: Int, Float, Str and Bool (a
    '?' kind also takes null). Hydra passes `key=abc` through as a string and `key=2.7` as a float,
    so every integer and number option is checked here, once, with one line saying which."""
    out = {}
    for name, kind in kinds.items():
        v = cfg.get(name)
        if v is None and kind.endswith("?"):
            out[name] = None
        elif v is None:
            raise ValueError(f"{name} must be set")
        elif kind.startswith("int"):
            out[name] = _int(name, v)
        elif kind == Float:
            out[name] = _float(name, v)
        elif kind == Bool:
            out[name] = _bool(name, v)
        else:
            out[name] = str(v)
    return out


def split_args(args: list[str]) -> tuple[list[str], list[str]]:
    """(input paths, Hydra arguments): an existing path is always an input, even with '=' in its
    name or a leading '-', and so is '-' (standard input); everything after '--' is an input; other 'key=value' and '-flag'
    arguments go to Hydra (with the value of a Hydra flag that takes one: --cfg job); anything
    else is an input (a missing file, reported as such)."""
    inputs, rest, i = [], [], 0
    while i < len(args):
        a = args[i]
        if a == "--":
            return inputs + args[i + 1:], rest
        if a == "-" or Path(a).exists() or ("=" not in a and not a.startswith("-")):
            inputs.append(a)
        else:
            rest.append(a)
            if a in _HYDRA_VALUE_FLAGS and i + 1 < len(args):
                rest.append(args[i + 1])
                i += 1
        i += 1
    return inputs, rest


def exit_with_one_line_errors(run: Callable[[], int | None]) -> NoReturn:
    """Run a CLI body: expected failures become one 'error: ...' line and exit 1, never a traceback."""
    try:
        code = run() or 0
    except (CheckpointError, CompilerError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
    sys.exit(code)
