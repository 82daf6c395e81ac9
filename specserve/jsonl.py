"""JSON-lines files (prompts, training data, benchmark datasets and results, training logs): one reader,
whose errors name the file and the line."""

from __future__ import annotations

import json
from pathlib import Path

from specserve.errors import SpecserveError, check


def read_jsonl(path: str | Path) -> list[dict]:
    """The rows of a JSON-lines file, each a JSON object (blank lines skipped); a file that cannot be read
    or a line that is not an object is the user's mistake, said as such."""
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise SpecserveError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise SpecserveError(f"{path}:{number}: not JSON ({e.msg})") from None
        check(isinstance(row, dict), f"{path}:{number}: each line must be a JSON object")
        rows.append(row)
    return rows
