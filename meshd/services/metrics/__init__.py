"""The node's figures, the service ``metrics``: snapshots for ``meshctl top``
(control method ``metrics.snapshot``) and an opt-in Prometheus exporter on a local
HTTP port (``[metrics] listen``).  See docs/operations.md for every metric.
"""

from .config import MetricsSection
from .service import Metrics
from .snapshot import Figures

__all__ = ["Figures", "Metrics", "MetricsSection"]
