"""Command line, cluster configs, workloads and the benchmark contract."""

from gramcoord.launch.bench import BenchRecord, median_ms, run_bench
from gramcoord.launch.config import ClusterConfig, ConfigError, load_config
from gramcoord.launch.workload import WorkloadRecord, read_workload

__all__ = [
    "BenchRecord",
    "ClusterConfig",
    "ConfigError",
    "WorkloadRecord",
    "load_config",
    "median_ms",
    "read_workload",
    "run_bench",
]
