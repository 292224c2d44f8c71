"""The README's set-up commands are the ones CI runs."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", text, re.S)][:2]


def test_readme_starts_with_demo_and_test_commands():
    demo, tests = readme_commands()
    assert "geomx launch" in demo and "examples/train_cnn.py" in demo
    assert "pytest" in tests
    assert "torch==2.13.0" in demo and "torch==2.13.0" in tests


def test_ci_runs_exactly_the_readme_test_command():
    _, tests = readme_commands()
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert tests in ci_lines
