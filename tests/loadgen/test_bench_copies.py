"""make bench's copy part: kvd's page copier moves every byte of a plan (the bench checks the
host tier holds the device tier's bytes after the copies) and reports rates; with a GPU, the
same with the device tier in GPU memory and the host tier page-locked."""

from __future__ import annotations

import pytest

from kvd.memory.cuda import gpu_available
from kvd_loadgen.bench import bench_copies

RATES = ("kvd_copy_gbps", "kvd_copy_scattered_gbps", "numpy_copyto_gbps")


def test_the_copy_bench_moves_every_byte_and_reports_rates():
    out = bench_copies(page_bytes=4096, num_pages=16, repeats=1)
    assert out["copy_bytes"] == 16 * 4096
    assert all(out[rate] > 0 for rate in RATES), out


@pytest.mark.gpu
def test_the_same_with_the_device_tier_in_gpu_memory():
    if not gpu_available():
        pytest.skip("no GPU here")
    out = bench_copies(page_bytes=4096, num_pages=16, repeats=1, gpu=True)
    assert all(out[rate] > 0 for rate in RATES), out
