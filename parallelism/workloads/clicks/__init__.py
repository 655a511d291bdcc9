"""Click logs for recommendation models: a synthetic generator with a planted truth, and Criteo.

By concern: `batch` (`ClickBatch`, the samples a DLRM step takes, and `ClickSource`, what
every source shares: batches as a pure function of ``(step, replica, microbatch)``, so a
step re-run after a failure sees exactly the data it saw the first time and the data
cursor is just the step number); `synthetic` (`ClickLogs`: Zipf-distributed ids and a
planted logistic truth, so held-out log loss and AUC mean something, see [Note: planted
click model]); `criteo` (`read_criteo`: the Criteo TSV format, label, 13 integer features,
26 categorical ones); `dataset` (`ClickDataset`: batches drawn from a fixed set of samples,
in memory or, built with `ClickDataset.from_criteo`, from a file of any size); and `cache`
(the file parsed once per machine into a memory-mapped cache, see [Note: shipping click
logs to workers]).
"""

from parallelism.workloads.clicks.batch import ClickBatch, ClickSource, GlobalClicks
from parallelism.workloads.clicks.criteo import (
    CRITEO_DENSE,
    CRITEO_SPARSE,
    Categorical,
    read_criteo,
)
from parallelism.workloads.clicks.dataset import ClickDataset
from parallelism.workloads.clicks.synthetic import ClickLogs

__all__ = [
    "CRITEO_DENSE",
    "CRITEO_SPARSE",
    "Categorical",
    "ClickBatch",
    "ClickDataset",
    "ClickLogs",
    "ClickSource",
    "GlobalClicks",
    "read_criteo",
]
