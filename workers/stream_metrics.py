"""Prometheus series of the worker's stream publisher, read from it at scrape time.

Series (label ``model``):

==============================================  ==========  ==============================================
``fleet_worker_stream_events_published_total``  counter     stream events written to Redis
``fleet_worker_stream_entries_total``           counter     stream entries written (events / entries =
                                                            events coalesced per entry)
``fleet_worker_stream_publisher_cpu_seconds_total`` counter CPU time of the publisher thread
``fleet_worker_stream_events_dropped_total``    counter     events never written: over the hold's bounds
                                                            while Redis did not answer, or refused by Redis
``fleet_worker_stream_events_held``             gauge       events waiting to be written (Redis away)
``fleet_worker_stream_bytes_held``              gauge       their bytes
==============================================  ==========  ==============================================

A dropped event leaves a gap in its stream; readers finish such a stream from the stored result.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from workers.stream_publisher import StreamPublisher

__all__ = ["StreamPublisherCollector"]


class StreamPublisherCollector(Collector):
    """Reads ``publisher``'s counts at each scrape (nothing runs on the publisher's thread)."""

    def __init__(self, model: str, publisher: StreamPublisher) -> None:
        self.model = model
        self.publisher = publisher

    def collect(self) -> Iterator[Metric]:
        p = self.publisher
        series: list[tuple[type[CounterMetricFamily] | type[GaugeMetricFamily], str, str, float]] = [
            (CounterMetricFamily, "fleet_worker_stream_events_published", "Stream events written to Redis.",
             p.published),
            (CounterMetricFamily, "fleet_worker_stream_entries", "Stream entries written to Redis.", p.entries),
            (CounterMetricFamily, "fleet_worker_stream_publisher_cpu_seconds",
             "CPU time of the stream publisher thread (s).", p.cpu_s),
            (CounterMetricFamily, "fleet_worker_stream_events_dropped",
             "Stream events never written (over the hold's bounds while Redis did not answer, or refused).",
             p.dropped),
            (GaugeMetricFamily, "fleet_worker_stream_events_held", "Stream events waiting for Redis.",
             len(p.pending)),
            (GaugeMetricFamily, "fleet_worker_stream_bytes_held", "Bytes of the stream events waiting for Redis.",
             p.pending.bytes),
        ]
        for family, name, doc, value in series:
            metric = family(name, doc, labels=["model"])
            metric.add_metric([self.model], float(value))
            yield metric
