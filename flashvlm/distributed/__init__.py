"""Tensor parallelism over the GPUs (or CPU processes) of one host: the process group (group.py), the layers that
communicate (layers.py), the pass that shards a built model (shard.py) and the worker processes (workers.py)."""
