"""lm-eval's Based recall tasks on local documents: ``fda``, ``swde`` and ``squad_completion`` are
Python tasks that read their documents from the Hugging Face hub (``hazyresearch/based-*``)
whatever their yaml says; these subclasses keep every other part of them (prompt, stop
sequence, 48-token budget, ``contains`` metric) and read the documents from the JSON-lines files
that the task yaml names in ``dataset_kwargs.data_files`` (one file per split; the tasks use the
``validation`` split)::

    task: fda_local
    class: !function qedprobe.lmeval.local.LocalFDA
    dataset_kwargs:
      data_files:
        validation: /data/based-fda/validation.jsonl    # rows {"text": ..., "value": ...}

Put such yamls in a folder and pass it to ``--include-path`` (``qedprobe lm-eval``) or
``--include_path`` (``lm_eval``).
"""
from __future__ import annotations

import datasets
from lm_eval.tasks.fda.task import FDA
from lm_eval.tasks.squad_completion.task import SQUADCompletion
from lm_eval.tasks.swde.task import SWDE

__all__ = ["LocalDocuments", "LocalFDA", "LocalSWDE", "LocalSQuADCompletion"]


class LocalDocuments:
    """Mixin placed before an lm-eval task class: its ``download`` reads ``data_files`` of the
    yaml's ``dataset_kwargs`` with ``datasets``' json loader (nothing is downloaded)."""

    def __init__(self, config: dict | None = None):
        files = ((config or {}).get("dataset_kwargs") or {}).get("data_files")
        if not files:
            raise ValueError(f"{type(self).__name__}: the task yaml needs dataset_kwargs.data_files "
                             "(a JSON-lines file per split, e.g. validation: /data/fda.jsonl)")
        self.data_files = files
        super().__init__()

    def download(self, *args, **kwargs) -> None:
        self.dataset = datasets.load_dataset("json", data_files=self.data_files)


class LocalFDA(LocalDocuments, FDA):
    """lm-eval's ``fda`` on local rows ``{"text", "value"}``."""


class LocalSWDE(LocalDocuments, SWDE):
    """lm-eval's ``swde`` on local rows ``{"text", "value"}``."""


class LocalSQuADCompletion(LocalDocuments, SQUADCompletion):
    """lm-eval's ``squad_completion`` on local rows ``{"text", "value"}``."""
