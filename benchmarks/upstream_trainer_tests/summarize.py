"""The harness's counts, from run.sh's junit files: written to counts.json (committed; the README's figures) and
one line per failing test of the swapped runs (schedule, test, first line of the error)."""

import hashlib
import json
import platform
import xml.etree.ElementTree as ET
from importlib.metadata import version
from pathlib import Path

HERE = Path(__file__).resolve().parent


def outcomes(xml: Path) -> dict[str, str]:
    """test id -> passed / failed / skipped."""
    out = {}
    for tc in ET.parse(xml).getroot().iter("testcase"):
        name = f"{tc.get('classname').split('.')[-1]}::{tc.get('name')}"
        bad = tc.findall("failure") + tc.findall("error")
        out[name] = "failed" if bad else "skipped" if tc.findall("skipped") else "passed"
    return out


def main() -> None:
    results = HERE / "results"
    plain = outcomes(results / "plain.xml")
    selection = sorted(n for n, o in plain.items() if o == "passed")
    counts = {
        "command": "cd benchmarks/upstream_trainer_tests && bash run.sh",
        "versions": {p: version(p) for p in ("transformers", "accelerate", "torch")},
        "python": platform.python_version(),
        "test_files": {
            f.name: hashlib.sha256(f.read_bytes()).hexdigest()[:12]
            for f in sorted((HERE / "tests/trainer").glob("*.py"))
        },
        "plain": {o: sum(v == o for v in plain.values()) for o in ("passed", "failed", "skipped")},
    }
    for sched in ("acco", "sync"):
        swapped = outcomes(results / f"{sched}.xml")
        failing = sorted(n for n, o in swapped.items() if o != "passed")
        counts[sched] = {
            "passed": sum(o == "passed" for o in swapped.values()),
            "of": len(selection),
            "failing": failing,
        }
        root = ET.parse(results / f"{sched}.xml").getroot()
        for tc in root.iter("testcase"):
            for f in tc.findall("failure") + tc.findall("error"):
                msg = (f.get("message") or "").strip().splitlines()
                print(
                    f"[{sched}] {tc.get('classname').split('.')[-1]}::{tc.get('name')} | {msg[0][:240] if msg else ''}"
                )
    (HERE / "counts.json").write_text(json.dumps(counts, indent=2) + "\n")
    acco, sync = counts["acco"]["passed"], counts["sync"]["passed"]
    print(f"plain {counts['plain']}; acco {acco} of {len(selection)}; sync {sync} of {len(selection)} -> counts.json")


if __name__ == "__main__":
    main()
