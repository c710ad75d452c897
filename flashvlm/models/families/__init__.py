"""One module per model family: its `models.registry.ModelFamily` entry, naming every part of it."""
