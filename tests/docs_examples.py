"""The README's and docs/' fenced blocks, as tests read them: a marked example by name, and every shell block with
the comment above it that says which tests run its commands (or what they need that CI does not have)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL = ("bash", "sh", "shell", "console")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.S | re.M)
MARKER = re.compile(r"<!-- docs-commands: (.*?) -->\s*$")


@dataclass(frozen=True)
class ShellBlock:
    page: Path
    line: int
    text: str
    marker: str | None  # the `docs-commands:` comment right above the fence, if there is one

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    def commands(self) -> list[str]:
        """Each command, continuation lines joined, comment lines and blank lines dropped (a trailing comment stays:
        `shlex.split(command, comments=True)` drops it)."""
        joined = re.sub(r"\\\n\s*", " ", self.text)
        return [line.strip() for line in joined.splitlines() if line.strip() and not line.startswith("#")]


def example(name: str) -> str:
    """The fenced block right after `<!-- docs-example: NAME -->`, in whichever page holds it (exactly one)."""
    found = []
    for page in PAGES:
        pattern = rf"<!-- docs-example: {re.escape(name)} -->\n```\w*\n(.*?)^```$"
        found += re.findall(pattern, page.read_text(), re.S | re.M)
    assert len(found) == 1, f"docs-example {name!r}: {len(found)} blocks"
    return found[0]


def shell_blocks() -> list[ShellBlock]:
    blocks = []
    for page in PAGES:
        text = page.read_text()
        for fence in FENCE.finditer(text):
            if fence.group(1) not in SHELL:
                continue
            above = text[: fence.start()].rstrip("\n").rsplit("\n", 1)[-1]
            marker = MARKER.match(above.strip())
            line = text.count("\n", 0, fence.start()) + 1
            blocks.append(ShellBlock(page, line, fence.group(2), marker.group(1) if marker else None))
    return blocks
