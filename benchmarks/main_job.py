"""Run the README's main job and record its result (``recipes/results/main_job/result.json``).

    python benchmarks/main_job.py [--out recipes/results/main_job]

Runs ``accelerate launch --config_file accelerate_configs/cpu_2proc.yaml recipes/alpaca_finetune.py`` exactly as
the README gives it, then writes its ``metrics.json`` with the command and the machine beside it; the README's
figures are rendered from that file (``python -m hf_acco.tools.docs``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMAND = "accelerate launch --config_file accelerate_configs/cpu_2proc.yaml recipes/alpaca_finetune.py"


def processor() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "recipes" / "results" / "main_job"))
    args = parser.parse_args(argv)
    written = ROOT / "outputs" / "alpaca_finetune" / "metrics.json"  # the recipe's default output directory
    written.unlink(missing_ok=True)
    subprocess.run([sys.executable, "-m", "accelerate.commands.launch", *COMMAND.split()[2:]], cwd=ROOT, check=True)
    metrics = json.loads(written.read_text())
    result = {
        "command": COMMAND,
        "machine": f"{processor()}, {os.cpu_count()} cores",
        "python": platform.python_version(),
        "metrics": metrics,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
