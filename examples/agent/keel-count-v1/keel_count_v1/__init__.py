"""keel's example verifiers v1 environment, as verifiers' ecosystem publishes one: an installable
package exporting its Taskset (and, here, the Harness that plays it) through `__all__`, loaded by
verifiers' own loader as `verifiers:keel-count-v1`."""

from keel_count_v1.harness import ChatHarness
from keel_count_v1.taskset import CountTaskset

__all__ = ["ChatHarness", "CountTaskset"]
