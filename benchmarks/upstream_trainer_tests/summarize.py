"""One line per failing test of the swapped runs: schedule, test, first line of the error."""

import xml.etree.ElementTree as ET

for sched in ("acco", "sync"):
    root = ET.parse(f"results/{sched}.xml").getroot()
    for tc in root.iter("testcase"):
        for f in tc.findall("failure") + tc.findall("error"):
            msg = (f.get("message") or "").strip().splitlines()
            print(f"[{sched}] {tc.get('classname').split('.')[-1]}::{tc.get('name')} | {msg[0][:240] if msg else ''}")
