"""Run the README's main job and record its result (``recipes/results/main_job/result.json``).

    python benchmarks/main_job.py [--out recipes/results/main_job]
    python benchmarks/main_job.py --trl      # the same job through TRL's SFTTrainer: recipes/results/main_job_trl/

Runs ``accelerate launch --config_file accelerate_configs/cpu_2proc.yaml recipes/alpaca_finetune.py`` exactly as
the README gives it (``--trl``: with recipes/README.md's TRL flags), then writes its ``metrics.json`` with the command
and the machine beside it; the README's and recipes/README.md's figures are rendered from those files
(``python -m hf_acco.tools.docs``).
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
TRL_FLAGS = "--trl --bf16 false --gradient_checkpointing false"  # (TRL's defaults turn both on)


def processor() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trl", action="store_true", help=f"the job through TRL's SFTTrainer ({TRL_FLAGS})")
    parser.add_argument("--out", default=None, help="default: recipes/results/main_job (with --trl: main_job_trl)")
    args = parser.parse_args(argv)
    command = f"{COMMAND} {TRL_FLAGS}" if args.trl else COMMAND
    out = Path(args.out or ROOT / "recipes" / "results" / ("main_job_trl" if args.trl else "main_job"))
    written = ROOT / "outputs" / "alpaca_finetune" / "metrics.json"  # the recipe's default output directory
    written.unlink(missing_ok=True)
    subprocess.run([sys.executable, "-m", "accelerate.commands.launch", *command.split()[2:]], cwd=ROOT, check=True)
    metrics = json.loads(written.read_text())
    result = {
        "command": command,
        "machine": f"{processor()}, {os.cpu_count()} cores",
        "python": platform.python_version(),
        "metrics": metrics,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
