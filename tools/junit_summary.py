#!/usr/bin/env python3
"""Counts Catch2 test cases across JUnit reports and prints the closing line
`tests: N passed, N failed, N skipped` that CI reads (a fuzzer smoke run is one
case). A test case that printed a `SKIP:` warning (it needs hardware this
machine lacks) counts as skipped.
Exits non-zero when a case failed or a report is missing or unreadable."""
import os
import sys
import xml.etree.ElementTree as ET

passed = failed = skipped = 0
broken = []
for path in sys.argv[1:]:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as e:
        broken.append(f"{path}: {e}")
        continue
    for case in root.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            failed += 1
            print(f"FAILED: {case.get('classname')} / {case.get('name')}")
        elif "SKIP:" in "".join(case.itertext()):
            skipped += 1
        else:
            passed += 1
if not sys.argv[1:]:
    broken.append("no JUnit reports were written")
# Runs that failed outside any test case (a sanitizer report ends the process;
# a sanitizer or fuzzer build failed).
extra = int(os.environ.get("TANDEM_EXTRA_FAILURES", "0") or 0)
if extra:
    print(f"tandem: {extra} sanitizer run(s) or build(s) failed")
    failed += extra
for b in broken:
    print(f"tandem: unreadable test report: {b}")
    failed += 1
print(f"tests: {passed} passed, {failed} failed, {skipped} skipped")
sys.exit(1 if failed else 0)
