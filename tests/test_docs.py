"""The README stays true where a test can tell: CI installs uv with the README's own lines and runs its test
command."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def quickstart() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Quickstart", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


def test_ci_installs_uv_and_tests_as_the_readme_says():
    lines = quickstart()
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    install = [line for line in lines if not line.startswith("uv ")]
    assert install and all(line in ci for line in install), "CI must install uv with the README's lines"
    assert "uv run pytest" in [line.split("#")[0].strip() for line in lines]
    assert "uv run pytest" in ci
