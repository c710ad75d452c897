"""LLaVA-NeXT (LLaVA-1.6) in llava-hf form. Its parts: `models/llava_next.py` (tiling, unpadding and newlines on top
of LLaVA-1.5's model and weight names, plus image_newline), `models/vision/clip.py` (the CLIP tower, shared),
`processing/llava_next_image.py` and `processing/anyres.py` (tiles, the item's `AnyResLayout`, a token count that
depends on the aspect), the load check below, `testing/tiny_llava_next.py`. Its tokens form no single grid, so
visual-token pruning refuses it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from flashvlm.models.registry import ModelFamily

if TYPE_CHECKING:
    import torch

    from flashvlm.models.loader import Checkpoint
    from flashvlm.processing.llava_next_image import LlavaNextImageInputs
    from flashvlm.request import MMItem


class LlavaNextFamily(ModelFamily):
    def image_inputs(self, checkpoint: Checkpoint) -> LlavaNextImageInputs:
        from flashvlm.processing.llava_next_image import LlavaNextImageInputs

        vision = checkpoint.hf_config.vision_config
        return LlavaNextImageInputs(self.image_processor(checkpoint.preprocessor_config or {}),
                                    side=vision.image_size // vision.patch_size)

    def check_checkpoint(self, checkpoint: Checkpoint) -> None:
        """The processor's tiles must be the tower's input size and its pinpoints the model's: the model stitches
        the tiles by the config's pinpoints, the processor cuts and counts by its own."""
        from flashvlm.config import ConfigError

        cfg = checkpoint.hf_config
        size = cfg.vision_config.image_size
        try:
            proc = self.image_processor(checkpoint.preprocessor_config or {})
        except ValueError as e:
            raise ConfigError(f"{checkpoint.path}: image processor config does not fit LLaVA-NeXT: {e}") from e
        if proc.tile_hw() != (size, size) or proc.tile != size:
            raise ConfigError(f"{checkpoint.path}: the image processor makes {proc.tile}-pixel tiles of "
                              f"{proc.tile_hw()[0]}x{proc.tile_hw()[1]} but the vision tower takes {size}x{size} "
                              "(vision_config.image_size); fix crop_size/size in preprocessor_config.json")
        model_pinpoints = tuple(tuple(p) for p in getattr(cfg, "image_grid_pinpoints", None) or ())
        if model_pinpoints != proc.pinpoints:
            raise ConfigError(f"{checkpoint.path}: image_grid_pinpoints differ between config.json "
                              f"({[list(p) for p in model_pinpoints]}) and the image processor "
                              f"({[list(p) for p in proc.pinpoints]})")
        strategy = getattr(cfg, "vision_feature_select_strategy", "default")
        if strategy != "default":
            raise ConfigError(f"{checkpoint.path}: LLaVA-NeXT takes vision_feature_select_strategy 'default', "
                              f"got {strategy!r}")

    def vision_patches(self, item: MMItem) -> int:
        layout = item.layout
        return (1 + layout.num_crops) * (layout.side * layout.side + 1)  # with each tile's CLS token

    def baseline_image_inputs(self, items: list[MMItem], input_ids: torch.Tensor, attention_mask: torch.Tensor,
                              image_token_id: int, device: str) -> dict[str, torch.Tensor]:
        """pixel_values (images, most crops + 1, 3, H, W), zero-padded as HF's processor pads a batch, and
        image_sizes (height, width)."""
        import torch

        pixels = [it.model_pixels(device) for it in items]
        longest = max(p.shape[0] for p in pixels)
        batch = torch.zeros(len(pixels), longest, *pixels[0].shape[1:], dtype=pixels[0].dtype, device=device)
        for i, p in enumerate(pixels):
            batch[i, :p.shape[0]] = p
        sizes = torch.tensor([[it.image_size[1], it.image_size[0]] for it in items], device=device)
        return {"pixel_values": batch, "image_sizes": sizes}


LLAVA_NEXT = LlavaNextFamily("LlavaNextForConditionalGeneration", "llava_next", "<image>\n",
                             model_module="flashvlm.models.llava_next",
                             image_processor="flashvlm.processing.llava_next_image:LlavaNextImageProcessor",
                             tiny_checkpoint="flashvlm.testing.tiny_llava_next:build_llava_next")
