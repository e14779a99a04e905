"""CI (``.ci/run``) runs exactly the README's two commands: the set-up and the checks."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_set_up_and_check_commands():
    blocks = re.findall(r"^```bash\n(.*?)^```", (ROOT / "README.md").read_text(), re.MULTILINE | re.DOTALL)
    set_up, check = blocks[0].strip(), blocks[1].strip()
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line and not line.startswith(("#", "set ", "cd "))]
    assert ci == [f"{set_up} || exit 1", check]
    assert check.startswith(".venv/bin/python -m ruff check . && ")  # the lint runs before the tests
