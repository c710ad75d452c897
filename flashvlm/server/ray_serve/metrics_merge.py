"""One Prometheus page from every replica's: each replica's /metrics (the same metrics `flashvlm serve` exports)
with a `replica` label added to every sample, the families of all replicas merged under one header each."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


class _Merged:
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        yield from self._families


def merge_by_replica(pages: Mapping[str, str]) -> bytes:
    """`pages`: replica id -> its Prometheus text. The merged page, in the classic text format."""
    merged: dict[str, Metric] = {}
    for replica, text in pages.items():
        for family in text_string_to_metric_families(text):
            into = merged.get(family.name)
            if into is None:
                into = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            into.samples.extend(Sample(s.name, {**s.labels, "replica": replica}, s.value, s.timestamp, s.exemplar)
                                for s in family.samples)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(list(merged.values())))
    return generate_latest(registry)
