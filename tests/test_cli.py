import subprocess
import sys
from pathlib import Path


def test_console_script_help():
    exe = Path(sys.executable).parent / "trl-longrm"
    out = subprocess.run([str(exe), "--help"], capture_output=True, text=True, check=True).stdout
    assert "train" in out and "eval" in out
