"""Running the transcribe command line as a user would."""
import subprocess
import sys


def cli(*args, env=None):
    import os

    e = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": "/tmp/empty-hf-home", **(env or {})}
    return subprocess.run([sys.executable, "-m", "glm_asr.transcribe", *map(str, args)], capture_output=True,
                          text=True, env=e, timeout=600)
