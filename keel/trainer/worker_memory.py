"""What the workers report of their memory with each call's results."""

from __future__ import annotations


class MemoryReadings:
    """Peak GPU memory per worker method (the fullest GPU) and the largest worker RSS, as the
    ranks' replies carry them."""

    def __init__(self):
        # method -> the fullest GPU's peak during its last call
        self.peak_gb: dict[str, float] = {}
        self.rss_gb = 0.0

    def noted(self, method: str, results) -> list:
        """A call's results, its ranks' memory readings noted."""
        readings = results.memory
        if any("gpu_peak_gb" in m for m in readings):
            self.peak_gb[method] = max(m.get("gpu_peak_gb", 0.0) for m in readings)
        self.rss_gb = max([self.rss_gb, *(m["rss_gb"] for m in readings)])
        return results

    def metrics(self) -> dict[str, float]:
        """Peak GPU memory per phase (the fullest GPU), the step's peak, and the largest worker
        RSS."""
        metrics = {f"perf/peak_memory_gb/{method}": gb for method, gb in self.peak_gb.items()}
        if self.peak_gb:
            metrics["perf/max_memory_allocated_gb"] = max(self.peak_gb.values())
        metrics["perf/max_rss_gb"] = self.rss_gb
        return metrics
