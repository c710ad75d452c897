"""Weight quantization as a pass over a built model: a registry of methods (`registry.py`), each replacing the
linear layers it targets with layers that own their quantized tensors and their loading (`base.py`), so no model
file changes. `plan.py` decides what a model runs (its checkpoint's format or `--quantization`), `apply.py` swaps
the layers. Nothing is imported here, so `config.py` can read the method names without importing torch code."""
