"""A rank module for the rank starter's tests (`tests/launcher/test_rank_starter.py`):
`python -m tests.support.starter_child ACTION [ARG]` as the starter runs it.

ACTIONS: `report PATH [UNTIL]` writes what the process is (argv, the variables named MPRESS_T_*,
its process group, parent, whether stdin is empty, `__name__`, torch's intra-op threads
when MPRESS_T_TORCH had the starter import torch, whether the module MPRESS_T_PROBE names
was imported when it started) as JSON to PATH, prints a
line on stdout and one on stderr, registers an atexit handler that appends to PATH + ".atexit",
and exits with status 3 (once the file UNTIL exists, if given); `sleep` sleeps for ever; `raise` raises an error.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import time
from pathlib import Path

if os.environ.get("MPRESS_T_TORCH"):
    import torch  # noqa: F401 - imported by the starter, as a rank's is

if os.environ.get("MPRESS_T_THREAD_AT_IMPORT"):
    import threading
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()


def main(argv: list[str]) -> int:
    action = argv[0]
    if action == "report":
        path = Path(argv[1])
        path.write_text(json.dumps({
            "argv": argv, "env": {k: v for k, v in os.environ.items() if k.startswith("MPRESS_T_")},
            "pgid": os.getpgid(0), "pid": os.getpid(), "ppid": os.getppid(), "stdin": sys.stdin.read(),
            "name": __name__,
            "threads": sys.modules["torch"].get_num_threads() if "torch" in sys.modules else None,
            "probe_loaded": os.environ.get("MPRESS_T_PROBE", "") in sys.modules}))
        print("to stdout", flush=True)
        print("to stderr", file=sys.stderr, flush=True)
        atexit.register(lambda: Path(str(path) + ".atexit").write_text("ran"))
        deadline = time.monotonic() + 60
        while len(argv) > 2 and not Path(argv[2]).exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        return 3
    if action == "sleep":
        while True:
            time.sleep(1)
    raise RuntimeError("the child failed as asked")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
