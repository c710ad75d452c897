"""Fuyu-8B (adept/fuyu-8b layout). Its parts: `models/fuyu.py` (the model, the patch projection run where a vision
tower runs, weight names of both checkpoint layouts), `models/persimmon.py` (the decoder), `processing/fuyu_image.py`
(canvas fit, padding, patchify, the (rows, cols) grid an item carries as its layout, FuyuProcessor's prompt layout),
the load check below, `testing/tiny_fuyu.py`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from flashvlm.models.registry import ModelFamily

if TYPE_CHECKING:
    import torch

    from flashvlm.models.loader import Checkpoint
    from flashvlm.processing.fuyu_image import FuyuImageInputs
    from flashvlm.request import MMItem


class FuyuFamily(ModelFamily):
    def image_inputs(self, checkpoint: Checkpoint) -> FuyuImageInputs:
        from flashvlm.models.fuyu import NEWLINE_ID_ATTR
        from flashvlm.processing.fuyu_image import FuyuImageInputs

        cfg = checkpoint.hf_config
        return FuyuImageInputs(self.image_processor(checkpoint.preprocessor_config or {}),
                               image_token_id=int(cfg.image_token_id),
                               newline_token_id=int(getattr(cfg, NEWLINE_ID_ATTR)))

    def check_checkpoint(self, checkpoint: Checkpoint) -> None:
        """The tokenizer must hold FuyuProcessor's |SPEAKER| (the config's image_token_id), |NEWLINE| and <s>
        tokens; the newline id, which Fuyu configs do not carry, is recorded on the config for the model. The
        patch size of the processor must be the model's."""
        from flashvlm.config import ConfigError
        from flashvlm.models.fuyu import NEWLINE_ID_ATTR
        from flashvlm.processing.fuyu_image import BOS, IMAGE_TOKEN, NEWLINE_TOKEN

        cfg, vocab = checkpoint.hf_config, checkpoint.tokenizer.get_vocab()
        missing = [t for t in (IMAGE_TOKEN, NEWLINE_TOKEN, BOS) if t not in vocab]
        if missing:
            raise ConfigError(f"{checkpoint.path}: the tokenizer lacks Fuyu's {', '.join(missing)} token(s)")
        if vocab[IMAGE_TOKEN] != cfg.image_token_id:
            raise ConfigError(f"{checkpoint.path}: the tokenizer's {IMAGE_TOKEN} is id {vocab[IMAGE_TOKEN]}, the "
                              f"config's image_token_id is {cfg.image_token_id}")
        try:
            proc = self.image_processor(checkpoint.preprocessor_config)
        except ValueError as e:
            raise ConfigError(f"{checkpoint.path}: image processor config does not fit the Fuyu model: {e}") from e
        if proc.patch_hw != (cfg.patch_size, cfg.patch_size):
            raise ConfigError(f"{checkpoint.path}: the image processor cuts {proc.patch_hw[0]}x{proc.patch_hw[1]} "
                              f"patches but the model projects {cfg.patch_size}x{cfg.patch_size} ones")
        setattr(cfg, NEWLINE_ID_ATTR, vocab[NEWLINE_TOKEN])

    def vision_patches(self, item: MMItem) -> int:
        rows, cols = item.layout
        return rows * cols

    def baseline_image_inputs(self, items: list[MMItem], input_ids: torch.Tensor, attention_mask: torch.Tensor,
                              image_token_id: int, device: str) -> dict[str, torch.Tensor]:
        import torch

        # FuyuModel scatters the projected patches over the |SPEAKER| positions in (batch, position) order.
        return {"image_patches": torch.cat([it.model_pixels(device) for it in items])}


FUYU = FuyuFamily("FuyuForCausalLM", "fuyu", "|SPEAKER|", model_module="flashvlm.models.fuyu",
                  image_processor="flashvlm.processing.fuyu_image:FuyuImageProcessor",
                  tiny_checkpoint="flashvlm.testing.tiny_fuyu:build_fuyu")
