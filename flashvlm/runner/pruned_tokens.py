"""The runner's side of visual-token pruning: which of a pruned image's embeddings enter the prompt, and the
positions of those that do.

The encoder outputs hold every image's full embeddings by mm_hash, so settings that differ share the vision
tower's work. A pruned item's kept indices are chosen once per (mm_hash, setting) from those full embeddings
(or, for dedup, were decided from the pixels by the input processor and are copied over), when a scheduled chunk
first reaches the item's placeholders, and dropped with the encoder output. A request's
prompt positions are computed at its first step, possibly before its images are encoded (chunked prefill): the
text positions do not depend on the kept tokens, and the image spans are rewritten here once their indices are
known, before the step's inputs are built. Both the splice and the positions read the same indices, so the
eager path and the CUDA-graph paths (which take the spliced embeddings and the positions as inputs) agree.
"""

from __future__ import annotations

import numpy as np
import torch

from flashvlm.engine.sched_output import SchedulerOutput
from flashvlm.models.interfaces import VLModel
from flashvlm.request import MMItem, Request
from flashvlm.runner.inputs import PositionStore


def _to_device(host: np.ndarray, device: torch.device) -> torch.Tensor:
    indices = torch.tensor(host, dtype=torch.int64)
    if device.type != "cuda":
        return indices.to(device)
    # Copies from pinned memory are asynchronous; from pageable memory the driver may wait for the stream.
    return indices.pin_memory().to(device, non_blocking=True)


def log_token_counts(embeddings: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """(K,) float32: log of how many of an image's N tokens each of its K kept tokens stands for. A dropped token
    counts for the kept token most similar to it (cosine of the embeddings, the first on ties), a kept one for
    itself, so the counts sum to N and none is below 1."""
    x = torch.nn.functional.normalize(embeddings.float(), dim=-1)
    nearest = (x @ x.index_select(0, kept).T).argmax(dim=1)
    nearest[kept] = torch.arange(kept.shape[0], device=kept.device)
    return torch.bincount(nearest, minlength=kept.shape[0]).float().log()


class KeptTokens:
    """Kept indices by (mm_hash, setting key), on the device for the splice and on the host for the positions,
    and which indices each request's stored positions were built from."""

    def __init__(self, feature_width: int | None = None, proportional: bool = False, use_kernels: bool = True) -> None:
        self.feature_width = feature_width
        """The leading columns of an embedding row a strategy compares (the language model's hidden size): rows
        may carry more (Qwen3-VL's DeepStack features), which the kept indices select along with them."""
        self.proportional = proportional
        """Proportional attention: each kept token's key carries log(tokens it stands for) (`image_bias`)."""
        self.use_kernels = use_kernels
        """Strategies may run their Triton kernels (the engine's kernel_backend is "triton")."""
        self._kept: dict[str, dict[str, tuple[torch.Tensor, np.ndarray]]] = {}
        self._log_counts: dict[str, dict[str, torch.Tensor]] = {}
        self._positioned: dict[str, dict[int, np.ndarray]] = {}
        """request id -> item index -> the host indices its stored positions hold."""
        self.num_selections = 0
        """Times a strategy chose an image's tokens (tests: once per image and setting)."""

    def indices(self, item: MMItem, embeddings: torch.Tensor) -> tuple[torch.Tensor, np.ndarray]:
        """The item's kept indices (device, host), chosen from its full `embeddings` on first use. The host copy
        is the one sync a pruned image costs, once per image and setting."""
        assert item.pruning is not None
        by_setting = self._kept.setdefault(item.mm_hash, {})
        found = by_setting.get(item.pruning.key)
        if found is None:
            if item.pruning.kept is not None:  # decided from the pixels (dedup): no sync, only a copy over
                host = item.pruning.kept
                chosen = _to_device(host, embeddings.device)
            else:
                chosen = item.pruning.select(embeddings[:, :self.feature_width], self.use_kernels)
                host = chosen.cpu().numpy()
            if host.shape[0] != item.num_tokens:
                raise RuntimeError(f"{item.pruning.strategy} kept {host.shape[0]} tokens of image {item.mm_hash}; "
                                   f"its prompt holds {item.num_tokens} placeholders")
            found = by_setting[item.pruning.key] = (chosen, host)
            self.num_selections += 1
        return found

    def image_bias(self, item: MMItem, embeddings: torch.Tensor, start: int, stop: int) -> torch.Tensor | None:
        """The attention-logit bias of the item's placeholders [start, stop): log of how many of the image's
        tokens each kept one stands for; None for an unpruned image or without proportional attention."""
        if item.pruning is None or not self.proportional:
            return None
        by_setting = self._log_counts.setdefault(item.mm_hash, {})
        found = by_setting.get(item.pruning.key)
        if found is None:
            kept, _ = self.indices(item, embeddings)
            found = by_setting[item.pruning.key] = log_token_counts(embeddings[:, :self.feature_width], kept)
        return found[start:stop]

    def image_rows(self, item: MMItem, embeddings: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """The embeddings of the item's placeholders [start, stop) (indices within the item)."""
        if item.pruning is None:
            return embeddings[start:stop]
        device_indices, _ = self.indices(item, embeddings)
        return embeddings.index_select(0, device_indices[start:stop])

    def place(self, out: SchedulerOutput, model: VLModel, positions: PositionStore,
              encoder_outputs: dict[str, torch.Tensor]) -> None:
        """Rewrite the positions of every scheduled request whose chunk reaches a pruned image whose kept
        indices its positions do not hold yet (or hold from an encoding since freed and redone)."""
        for s in out.scheduled:
            req = s.request
            if all(item.pruning is None for item in req.mm_items):
                continue
            placed = self._positioned.setdefault(req.request_id, {})
            stale = False
            for i, item in enumerate(req.mm_items):
                if item.pruning is None or item.offset >= s.end or item.end <= s.start:
                    continue
                _, host = self.indices(item, encoder_outputs[item.mm_hash])
                if placed.get(i) is not host:
                    placed[i], stale = host, True
            if stale:
                self._store(req, model, positions, placed)

    @staticmethod
    def _store(req: Request, model: VLModel, positions: PositionStore, placed: dict[int, np.ndarray]) -> None:
        pos, delta = model.prompt_positions(req.prompt_token_ids, req.mm_items, placed)
        positions.put(req.request_id, pos, delta)

    def free(self, mm_hash: str) -> None:
        """The encoder output of `mm_hash` is gone: so are the indices chosen from it."""
        self._kept.pop(mm_hash, None)
        self._log_counts.pop(mm_hash, None)

    def forget(self, request_id: str) -> None:
        self._positioned.pop(request_id, None)
