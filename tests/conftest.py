import os

import pytest
import torch

# Keep each test process (and the ranks it spawns) from oversubscribing the 2-core CI machine.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


class TorchState:
    """A tool's ``main()`` run in the test process may set torch's thread count and seed its global RNGs (the
    benchmarks do): ``with TorchState():`` puts them back afterwards (CPU and, where there is one, CUDA)."""

    def __enter__(self):
        self.threads, self.rng = torch.get_num_threads(), torch.get_rng_state()
        # torch.manual_seed reseeds every CUDA device too (on a GPU machine)
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        return self

    def __exit__(self, *exc):
        torch.set_num_threads(self.threads)
        torch.set_rng_state(self.rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        return False


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
