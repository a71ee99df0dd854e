"""The builtin reference models (mlp, decoder) and their seeded initialisation on the device."""
