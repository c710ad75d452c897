"""The options of `flashvlm serve --ray`: replicas, autoscaling, resources and routing, each declared once here
(the flags, their help and docs/distributed.md's table come from these fields); validated once in `validate()`.
No ray import: `flashvlm serve --help` lists these flags without the [ray] extra."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from flashvlm.option_spec import EngineOption, collect_options, option


def _non_negative(name: str, value: Any) -> str | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0
    return None if ok else f"{name} must be a number >= 0, got {value!r}"


def _positive(name: str, value: Any) -> str | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
    return None if ok else f"{name} must be a number > 0, got {value!r}"


@dataclass
class RayServeOptions:
    num_replicas: int = option(1, minimum=1, help="engine replicas; with --max-replicas, the number to start with")
    min_replicas: int = option(1, minimum=1, help="with --max-replicas: the fewest replicas autoscaling keeps")
    max_replicas: int | None = option(None, minimum=1, shown_default="no autoscaling",
                                      help="turn autoscaling on: the most replicas it starts")
    target_ongoing_requests: int | None = option(
        None, minimum=1, shown_default="--max-num-seqs",
        help="autoscaling target: requests per replica that are running or waiting (routed to it and not finished); "
             "above it replicas are added, below it removed")
    upscale_delay: float = option(10.0, check=_non_negative,
                                  help="seconds the load must stay above the target before a replica is added")
    downscale_delay: float = option(120.0, check=_non_negative,
                                    help="seconds the load must stay below the target before a replica is removed")
    num_gpus_per_replica: float | None = option(None, check=_non_negative, shown_default="1 with --device cuda "
                                                "(or auto where CUDA is seen), else 0",
                                                help="GPUs Ray reserves for each replica (the engine uses the ones "
                                                     "Ray gives it)")
    num_cpus_per_replica: float = option(1.0, check=_non_negative, help="CPUs Ray reserves for each replica")
    ray_address: str | None = option(None, shown_default="RAY_ADDRESS, else a local Ray started on this machine",
                                     help="the Ray cluster to join (ray://host:10001 or host:6379)")
    affinity_max_imbalance: int = option(
        8, minimum=0,
        help="load bound of cache-aware routing: a request leaves the replica holding its image or prompt prefix "
             "for the least-loaded one when that replica has more than this many requests above it")
    router_max_keys: int = option(65536, minimum=1,
                                  help="routing keys (prefix blocks and image hashes) the router remembers, least "
                                       "recently used forgotten first")
    prefix_block_chars: int = option(128, minimum=1,
                                     help="characters of the prompt text (images as their hashes) per prefix "
                                          "routing key; prompts shorter than this have no prefix key")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RayServeOptions:
        return cls(**{opt.name: getattr(args, opt.name) for opt in ray_options()})

    @property
    def autoscaling(self) -> bool:
        return self.max_replicas is not None

    def validate(self) -> RayServeOptions:
        """Check every option, then the rules between them; raises ValueError naming the flag."""
        for opt in ray_options():
            problem = opt.spec.problem(opt.name, getattr(self, opt.name))
            if problem is not None:
                raise ValueError(problem.replace(opt.name, opt.flag, 1))
        if self.max_replicas is not None:
            if self.min_replicas > self.max_replicas:
                raise ValueError(f"--min-replicas {self.min_replicas} is above --max-replicas {self.max_replicas}")
            if not self.min_replicas <= self.num_replicas <= self.max_replicas:
                raise ValueError(f"--num-replicas {self.num_replicas} must lie between --min-replicas "
                                 f"{self.min_replicas} and --max-replicas {self.max_replicas} with autoscaling")
        return self

    def deployment_options(self, max_num_seqs: int, max_waiting_requests: int, use_gpu: bool) -> dict[str, Any]:
        """The engine deployment's Serve options (`Deployment.options(**...)`): replica count or autoscaling,
        resources, and how many requests Serve lets one replica hold."""
        gpus = self.num_gpus_per_replica if self.num_gpus_per_replica is not None else (1.0 if use_gpu else 0.0)
        out: dict[str, Any] = {
            "ray_actor_options": {"num_cpus": self.num_cpus_per_replica, "num_gpus": gpus},
            # The engine's own admission bound answers 429 beyond max_waiting_requests; Serve must let that many
            # (twice, for the tier rule of docs/server.md) reach the replica, or it would queue them itself.
            "max_ongoing_requests": max_num_seqs + 2 * max_waiting_requests,
        }
        if self.autoscaling:
            out["autoscaling_config"] = self.autoscaling_config(max_num_seqs)
        else:
            out["num_replicas"] = self.num_replicas
        return out

    def autoscaling_config(self, max_num_seqs: int) -> dict[str, Any]:
        """Serve's autoscaling config. Serve counts, per replica, the requests routed to it and not finished: for
        an engine replica that is its running plus waiting requests (and those still being preprocessed)."""
        return {"min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
                "initial_replicas": self.num_replicas,
                "target_ongoing_requests": self.target_ongoing_requests or max_num_seqs,
                "upscale_delay_s": self.upscale_delay, "downscale_delay_s": self.downscale_delay,
                # Serve's defaults (10 s and 30 s) would hide a burst shorter than the delays themselves.
                "metrics_interval_s": min(10.0, max(0.5, self.upscale_delay / 2)),
                "look_back_period_s": min(30.0, max(1.0, self.upscale_delay))}

    def router_kwargs(self) -> dict[str, Any]:
        return {"max_keys": self.router_max_keys, "max_imbalance": self.affinity_max_imbalance}


def ray_options() -> list[EngineOption]:
    return collect_options(RayServeOptions)


def add_ray_args(parser: argparse.ArgumentParser) -> None:
    """`--ray` and the options above, in a "Ray Serve" group of `flashvlm serve`."""
    from flashvlm.options import add_option_args

    group = parser.add_argument_group("Ray Serve (--ray; docs/distributed.md)")
    group.add_argument("--ray", action="store_true",
                       help="serve through Ray Serve: replicas of the engine behind cache-aware routing, on this "
                            "machine or a Ray cluster; needs flashvlm[ray]")
    add_option_args(group, ray_options())
