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


def test_readme_says_what_a_cpu_only_and_a_gpu_user_run():
    readme = (ROOT / "README.md").read_text()
    set_up = re.findall(r"^```bash\n(.*?)^```", readme, re.MULTILINE | re.DOTALL)[0]
    pin = re.search(r"torch==([\d.]+)", set_up).group(1)
    section = readme[:readme.index("```bash")]
    one_line = re.sub(r"\s+", " ", section)
    cpu = re.search(r"\*\*CPU only:\*\*(.*?)\* \*\*GPU", one_line).group(1)
    gpu = re.search(r"\*\*GPU \(CUDA\):\*\*(.*)", one_line).group(1)
    assert f"pip install torch=={pin} --index-url https://download.pytorch.org/whl/cpu" in cpu
    assert "command below as written" in cpu and "command below as written" in gpu
    assert f"leave `torch=={pin}` out" in gpu  # keeping an installed CUDA torch
