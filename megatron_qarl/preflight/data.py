"""The prompt files a run reads, checked before it starts: ``qarl preflight`` (its ``data`` finding), ``qarl plan
--config`` (its ``data`` lines) and ``qarl train`` (before it writes or starts anything) ask this module
(docs/data.md)."""

from __future__ import annotations

from megatron_qarl.config import QarlConfig
from megatron_qarl.data.prompts import DatasetError, PromptDataConfig, inspect_source
from megatron_qarl.errors import UserError
from megatron_qarl.preflight.report import Finding


def data_sources(cfg: QarlConfig) -> list[tuple[str, PromptDataConfig]]:
    """(config key, data config) of every prompt source the run reads: training, and held-out evaluation's own."""
    return [("data.source", cfg.data)] + ([("train.eval.data.source", cfg.train.eval.data)]
                                          if cfg.train.eval.data is not None else [])


def check_sources(cfg: QarlConfig) -> list[tuple[str, bool, str]]:
    """(config key, ok, what it holds or the problem) of every data source the run reads: it exists and its first row
    has the keys the loader reads (``inspect_source``; the whole file is read and checked when the run starts)."""
    checked = []
    for key, data in data_sources(cfg):
        try:
            checked.append((key, True, inspect_source(data)))
        except DatasetError as err:
            checked.append((key, False, str(err)))
    return checked


def data_finding(cfg: QarlConfig) -> Finding:
    """``check_sources`` as a finding: a problem names each key and path."""
    checked = check_sources(cfg)
    found = [f"{key} {text}" for key, ok, text in checked if ok]
    bad = [f"{key}: {text}" for key, ok, text in checked if not ok]
    if bad:
        return Finding("data", False, "; ".join(bad), key=", ".join(b.split(":", 1)[0] for b in bad),
                       env="this node's file system",
                       fix="qarl data prepare --from <the downloaded dataset files> --to <the folder the config "
                           "reads> (docs/data.md), or point the key at your files")
    return Finding("data", True, "; ".join(found))


def require_data(cfg: QarlConfig) -> None:
    """``data_finding`` for ``qarl train``, before it writes or starts anything: a UserError naming keys and paths."""
    finding = data_finding(cfg)
    if finding.ok is False:
        raise UserError(f"data: {finding.detail}; fix: {finding.fix}")
