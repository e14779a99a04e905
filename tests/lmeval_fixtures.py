"""Local lm-eval tasks for the tests (nothing downloaded): documents written here, in the shapes
of lm-eval's ``fda``, ``swde``, ``squad_completion`` (``{"text", "value"}`` rows, read by
lm-eval's own task classes through :mod:`qedprobe.lmeval.local`) and of a RULER NIAH task
(``{"input", "outputs", "max_length"}`` rows scored by lm-eval's RULER ``process_results``).

The NIAH rows are qedprobe's legacy S-NIAH-1 prompts at 1K tokens, the format the shipped
``micro-recall-*`` checkpoints were trained on, so the micro model answers some of them.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

# Before lm-eval / datasets are imported: never reach the hub.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parent.parent
MICRO = str(ROOT / "checkpoints" / "micro-recall-full-s1")
"""A shipped CPU checkpoint with arm ``full`` (lambda != 0) that retrieves needles at 1K."""

NIAH_LENGTH = 1024

FDA_DOCS = [
    {"text": "Registrant: Northwind Traders Inc.\nFiscal year end: June 30\nCity of the registrant:", "value": "Seattle"},
    {"text": "Company: Blue Heron Mills\nState of incorporation: Delaware\nState of incorporation:", "value": "Delaware"},
    {"text": "Employer identification number: 12-3456789\nEmployer identification number:", "value": "12-3456789"},
]
SWDE_DOCS = [
    {"text": "<html><title>The Quiet Orchard (2009)</title><b>Director:</b> Ana Ruiz</html>\nDirector:", "value": "Ana Ruiz"},
    {"text": "<html><h1>Mount Calder University</h1><td>Founded 1871</td></html>\nYear founded:", "value": "1871"},
    {"text": "<html><div class=price>$42.00</div><div>Paper lantern</div></html>\nPrice:", "value": "$42.00"},
]
SQUAD_DOCS = [
    {"text": "The river Vell rises in the northern hills and flows south for 212 kilometres. The Vell is", "value": "212 kilometres"},
    {"text": "Marta Kolb founded the observatory in 1904 after a career as a surveyor. The observatory was founded in", "value": "1904"},
]

LOCAL_CLASSES = {"fda_local": "LocalFDA", "swde_local": "LocalSWDE", "squad_completion_local": "LocalSQuADCompletion"}
TASKS = [*LOCAL_CLASSES, "niah_local"]


def niah_docs(n: int = 3) -> list[dict]:
    """RULER-shaped rows of qedprobe's legacy S-NIAH-1 at :data:`NIAH_LENGTH` tokens."""
    from qedprobe.tasks import make_task
    task = make_task("s-niah-1", "bytes", format="legacy")
    samples = [task.sample(NIAH_LENGTH, i, samples=n, seed=0) for i in range(n)]
    return [{"index": i, "input": s.prompt, "outputs": list(s.answers), "max_length": NIAH_LENGTH,
             "length": len(s.input_ids)} for i, s in enumerate(samples)]


def _jsonl(path: Path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def _based_yaml(name: str, cls: str, data: str) -> str:
    return (f"task: {name}\nclass: !function qedprobe.lmeval.local.{cls}\n"
            f"dataset_kwargs:\n  data_files:\n    validation: {data}\n")


def _niah_yaml(data: str, max_new_tokens: int) -> str:
    ruler = "lm_eval.tasks.ruler.common_utils"
    metrics = "".join(f'  - metric: "{n}"\n    aggregation: !function {ruler}.aggregate_metrics\n'
                      f"    higher_is_better: true\n" for n in (NIAH_LENGTH, 4096))
    return (f"task: niah_local\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
            f"output_type: generate_until\ntest_split: test\ndoc_to_text: \"{{{{input}}}}\"\n"
            f"doc_to_target: \"{{{{outputs}}}}\"\ntarget_delimiter: \" \"\n"
            f"process_results: !function {ruler}.process_results\nmetric_list:\n{metrics}"
            f"generation_kwargs:\n  do_sample: false\n  temperature: 0.0\n  max_gen_toks: {max_new_tokens}\n"
            f"  until: []\nmetadata:\n  version: 1.0\n")


def write_tasks(folder, niah_samples: int = 3, niah_new_tokens: int = 12) -> Path:
    """The four task yamls and their JSON-lines documents in ``folder`` (an ``--include-path``)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for (name, cls), docs in zip(LOCAL_CLASSES.items(), (FDA_DOCS, SWDE_DOCS, SQUAD_DOCS)):
        data = _jsonl(folder / f"{name}.jsonl", docs)
        (folder / f"{name}.yaml").write_text(_based_yaml(name, cls, data), encoding="utf-8")
    data = _jsonl(folder / "niah_local.jsonl", niah_docs(niah_samples))
    (folder / "niah_local.yaml").write_text(_niah_yaml(data, niah_new_tokens), encoding="utf-8")
    return folder
