#!/usr/bin/env python3
"""Reads `cargo bench --no-run --message-format=json` on stdin and prints one line per benchmark
executable: its path and its target name (what the GPU and A/B bundles copy as bench-<name>)."""
import json
import sys

for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and "bench" in m["target"]["kind"] and m.get("executable"):
        print(m["executable"], m["target"]["name"])
