"""Data parallelism: flat parameter/gradient buffers, buckets reduced from backward hooks (overlapped
with backward), and the optimizer state over them (fp32 masters + Adam moments, ZeRO-1/2 sharded or
not). See docs/data_parallel.md. The update rule, schedules and clipping live in engine/optim.py."""
from parallel.data_parallel.buffers import (BucketPlan, ParamAndGradBuffer, bucket_size_elements,
                                            plan_buckets)
from parallel.data_parallel.ddp import DEFAULT_BUCKET_MB, DataParallel, num_microbatches
from parallel.data_parallel.optimizer import DistributedOptimizer, Piece
from parallel.data_parallel.compression import OneBit, PowerSGD, build_grad_compressor  # weak links:
from parallel.data_parallel.outer import OuterOptimizer  # docs/decentralised.md

__all__ = ["BucketPlan", "ParamAndGradBuffer", "bucket_size_elements", "plan_buckets", "DEFAULT_BUCKET_MB",
           "DataParallel", "num_microbatches", "DistributedOptimizer", "Piece", "OneBit", "PowerSGD",
           "build_grad_compressor", "OuterOptimizer"]
