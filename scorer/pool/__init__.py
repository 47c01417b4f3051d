"""Workers: where they are, whether they are healthy, how loaded they are."""

from scorer.pool.inflight import InflightTracker, WorkerLoad
from scorer.pool.workers import Pool, Worker

__all__ = ["InflightTracker", "Pool", "Worker", "WorkerLoad"]
