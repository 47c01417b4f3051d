"""Run every micro-benchmark in bench/ one after another (`make bench`).

Each bench/bench_*.py prints its table and writes bench/out/<name>.json. Run them on a
quiet machine: they share its two cores with nothing else.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    failed = []
    for script in sorted(HERE.glob("bench_*.py")):
        print(f"\n=== {script.name} ===", flush=True)
        rc = subprocess.call([sys.executable, str(script)])
        if rc != 0:
            failed.append(script.name)
    if failed:
        print(f"\nfailed: {', '.join(failed)}")
        return 1
    print(f"\nresults in {HERE / 'out'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
