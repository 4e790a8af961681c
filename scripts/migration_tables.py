"""Writes the generated parts of docs/migration.md from the code: the table of raytrainer's own fields
(`RayArgumentsMixin`: name, default, help).

    python scripts/migration_tables.py          # rewrite docs/migration.md between its generated markers
    python scripts/migration_tables.py --check  # exit 1 when the page is not what the code generates
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

from raytrainer.args import RayArgumentsMixin

PAGE = Path(__file__).resolve().parents[1] / "docs" / "migration.md"
_BLOCK = re.compile(r"(<!-- generated: (?P<name>[\w-]+) -->\n).*?(<!-- end generated -->)", re.S)


def ray_fields() -> str:
    rows = ["| field | default | meaning |", "|---|---|---|"]
    for f in dataclasses.fields(RayArgumentsMixin):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        shown = "(output_dir)" if f.name == "storage_path" else repr(default)
        rows.append(f"| `{f.name}` | `{shown}` | {f.metadata['help'].replace('|', '/')} |")
    return "\n".join(rows) + "\n"


GENERATORS = {"ray-fields": ray_fields}


def render(text: str) -> str:
    return _BLOCK.sub(lambda m: m.group(1) + GENERATORS[m.group("name")]() + m.group(3), text)


def main(argv: list[str]) -> int:
    text = PAGE.read_text()
    new = render(text)
    if "--check" in argv:
        if new != text:
            print(f"{PAGE} is not what the code generates: run python scripts/migration_tables.py")
            return 1
        return 0
    PAGE.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
