import os

import pytest
import torch

# Keep each test process (and the ranks it spawns) from oversubscribing the 2-core CI machine.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_collection_modifyitems(config, items):
    if "composition_full" not in (config.option.markexpr or ""):
        full = pytest.mark.skip(reason="the composition matrix's full cross product: select it with -m composition_full")
        for item in items:
            if "composition_full" in item.keywords:
                item.add_marker(full)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marked gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
