"""Test-run environment for every test directory: the checkpoint cache and the CUDA compile cache live under the
system temporary directory (``<tmp>/qwen-mk-test-cache-<uid>``, kept between runs so the tiny checkpoint is
written once), never in the user's ``~/.cache/qwen-mk``. ``QWEN_MK_CACHE`` / ``QMK_COMPILE_CACHE`` set by the
caller win."""
import os
import tempfile
from pathlib import Path

TEST_CACHE = Path(tempfile.gettempdir()) / f"qwen-mk-test-cache-{os.getuid()}"
os.environ.setdefault("QWEN_MK_CACHE", str(TEST_CACHE))
os.environ.setdefault("QMK_COMPILE_CACHE", str(TEST_CACHE / "compile"))
