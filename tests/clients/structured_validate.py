"""Validates structured outputs: reads a JSON list of {"name", "schema" | "regex", "text"} on
stdin, checks each text against its JSON schema (jsonschema, the schema's own draft) or its
regex (re.fullmatch), and prints one line per failure, then "ok: N checked" when all pass.
Exits 1 on any failure. Usage: structured_validate.py < answers.json"""

import json
import re
import sys

import jsonschema


def main():
    cases = json.load(sys.stdin)
    failures = []
    for c in cases:
        text = c["text"]
        if "schema" in c:
            try:
                value = json.loads(text)
            except json.JSONDecodeError as e:
                failures.append(f"{c['name']}: not JSON ({e}): {text!r}")
                continue
            cls = jsonschema.validators.validator_for(c["schema"])
            errors = [e.message for e in cls(c["schema"]).iter_errors(value)]
            if errors:
                failures.append(f"{c['name']}: {errors[0]}: {text!r}")
        elif re.fullmatch(c["regex"], text) is None:
            failures.append(f"{c['name']}: does not match {c['regex']!r}: {text!r}")
    for f in failures:
        print(f)
    if failures:
        sys.exit(1)
    print(f"ok: {len(cases)} checked")


if __name__ == "__main__":
    main()
