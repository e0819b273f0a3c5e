"""One declared comparison of the study over paired seeds (``Paired``), built by :func:`paired` from each
run's accuracy; ``verdict.py`` reports it and ``verdict_plot.py`` draws it."""

from __future__ import annotations

from dataclasses import dataclass

from spo_workbench.student_t import PairedInterval, paired_interval


@dataclass(frozen=True, kw_only=True)
class Paired(PairedInterval):
    """One declared comparison: ``algorithm`` minus ``reference`` over the seeds both finished."""
    algorithm: str
    reference: str
    seeds: tuple[int, ...]
    differences: tuple[float, ...]


def paired(at: dict[tuple[str, int], float | None], algorithm: str, reference: str, level: float = 0.975) -> Paired:
    """``at``: (algorithm, seed) -> accuracy at the budget. The difference over the seeds both have."""
    seeds = tuple(sorted(seed for (name, seed), value in at.items()
                         if name == algorithm and value is not None and at.get((reference, seed)) is not None))
    differences = tuple(at[(algorithm, s)] - at[(reference, s)] for s in seeds)
    interval = paired_interval(differences, level, unit="seeds")
    return Paired(**vars(interval), algorithm=algorithm, reference=reference, seeds=seeds, differences=differences)
