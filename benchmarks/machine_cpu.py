"""Busy CPU seconds of the whole machine (Linux `/proc/stat`), for benchmarks whose work runs
in processes they do not reap themselves (sandboxed workers, kernels, torchrun ranks)."""

import os


def busy_cpu_seconds() -> float:
    """user + nice + system + irq + softirq of all CPUs since boot, in seconds."""
    with open("/proc/stat") as f:
        user, nice, system, _, _, irq, softirq = (int(x) for x in f.readline().split()[1:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")
