"""Several eval sets: ``val_data={"a": ..., "b": ...}`` (``Trainer``'s dict ``eval_dataset``).

Each set gets its own copies of the estimator's val metrics, named ``val_<set>_<name>``
(``val_a_loss``, ``val_a_accuracy``, ``val_b_loss``...), made once per set name and kept, so a
later fit (or ``fit(..., resume=True)``) continues with the same objects. During a fit over such
sets ``est.val_metrics`` is the list of every set's metrics, in the order of the sets; the
estimator's own val metrics (the templates) stand for the first set's: a monitor given as
``"val_loss"`` or as ``est.val_metrics[0]`` follows ``val_<first>_loss`` (logged), and
``"val_b_loss"`` chooses another.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable, Mapping
from typing import Any, Optional

from ...metrics.base import metric_name

__all__ = ["EvalSets", "eval_sets", "set_metrics", "template_aliases"]

_NAME = re.compile(r"[A-Za-z0-9][\w.-]*")


def eval_sets(val_data: Any, arg: str = "val_data") -> Optional[dict[str, Any]]:
    """``val_data`` as ``{set name: data}`` when it is a dict of named eval sets, else None.

    Raises:
        ValueError: no sets, or a name that is not a word (``[A-Za-z0-9][\\w.-]*``).
    """
    if not isinstance(val_data, Mapping) or _is_dataset(val_data):
        return None
    if not val_data:
        raise ValueError(f"{arg} is an empty dict: give it named eval sets, e.g. {{'valid': loader}}")
    for name in val_data:
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(f"{arg}: the eval set names must be words (letters, digits, _ . -), as the "
                             f"metric names val_<set>_<metric> hold them, got {name!r}")
    return dict(val_data)


def _is_dataset(data: Any) -> bool:
    return type(data).__module__.startswith("datasets.") and hasattr(data, "column_names")


def set_metrics(templates: list[Any], cache: dict[str, list[Any]], names: Iterable[str]) -> dict[str, list[Any]]:
    """Each set's val metrics: copies of ``templates`` named ``val_<set>_<name>`` (made once per set
    and kept in ``cache``), in the order of ``names``."""
    lists = {}
    for name in names:
        if name not in cache:
            metrics = []
            for template in templates:
                metric = copy.deepcopy(template)
                metric.reset()
                base = metric_name(template)
                metric.name = f"val_{name}_{base[len('val_'):] if base.startswith('val_') else base}"
                metrics.append(metric)
            cache[name] = metrics
        lists[name] = cache[name]
    return lists


def template_aliases(templates: list[Any], first: list[Any]) -> dict[Any, Any]:
    """What a monitor of the templates follows: each template's name and the template itself
    (``"val_loss"``, ``est.val_metrics[0]``) stand for the first set's copy."""
    aliases: dict[Any, Any] = {}
    for template, metric in zip(templates, first):
        aliases[metric_name(template)] = metric
        aliases[id(template)] = metric
    return aliases


class EvalSets:
    """The estimator's val metrics (the templates) and each eval set's copies, made once."""

    def __init__(self, templates: list[Any]):
        self.templates = templates
        self.cache: dict[str, list[Any]] = {}

    def groups(self, current: list[Any], val_data: Any) -> tuple[list[tuple[str, Any, list[Any]]], list[Any]]:
        """What an evaluation of ``val_data`` updates: ``([(arg, data, metrics)], val_metrics)``,
        one group per eval set (``val_data['a']`` with its ``val_a_...`` metrics) or the one group
        of ``val_data``, and the list ``est.val_metrics`` holds for it (every set's metrics; for
        one set, ``current`` unless it holds sets' metrics, then the templates)."""
        sets = eval_sets(val_data)
        if sets is None:
            copies = {id(m) for metrics in self.cache.values() for m in metrics}
            metrics = list(self.templates) if any(id(m) in copies for m in current) else current
            return [("val_data", val_data, metrics)], metrics
        lists = set_metrics(self.templates, self.cache, sets)
        groups = [(f"val_data[{name!r}]", data, lists[name]) for name, data in sets.items()]
        return groups, [m for _, _, metrics in groups for m in metrics]

    def aliases(self, groups: list[tuple[str, Any, list[Any]]]) -> Optional[dict[Any, Any]]:
        """For named eval sets, what a monitor of the templates follows (:func:`template_aliases`)."""
        return template_aliases(self.templates, groups[0][2]) if groups[0][0] != "val_data" else None
