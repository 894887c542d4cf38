"""Per-file counts and one line per non-passing test, from a pytest junit XML (harness tool)."""

import collections
import sys
import xml.etree.ElementTree as ET


def main(path: str) -> None:
    root = ET.parse(path).getroot()
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    details = []
    for case in root.iter("testcase"):
        module = case.get("classname", "").split(".")
        # classname is the dotted module (plus a class for methods)
        file = "/".join(p for p in module if not p[:1].isupper()) + ".py"
        name = case.get("name")
        if case.get("classname", "").split(".")[-1][:1].isupper():
            name = case.get("classname").split(".")[-1] + "::" + name
        outcome = "passed"
        message = ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "errors", "skipped": "skipped"}[child.tag]
                message = (child.get("message") or child.text or "").strip().splitlines()
                message = message[0][:220] if message else ""
                break
        counts[file][outcome] += 1
        if outcome != "passed":
            details.append((file, name, outcome, message))
    total = collections.Counter()
    print("| file | passed | failed | skipped | errors |")
    print("|---|---|---|---|---|")
    for file in sorted(counts):
        c = counts[file]
        total.update(c)
        print(f"| {file.removeprefix('tests/')} | {c['passed']} | {c['failed']} | {c['skipped']} | {c['errors']} |")
    print(f"| **total** | **{total['passed']}** | **{total['failed']}** | **{total['skipped']}** | "
          f"**{total['errors']}** |")
    print()
    for file, name, outcome, message in details:
        print(f"- `{file.removeprefix('tests/')}::{name}` [{outcome}] {message}")


if __name__ == "__main__":
    main(sys.argv[1])
