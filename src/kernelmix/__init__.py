"""kernelmix: kernel-regression token mixers (Cubit, DARKFormer) and their baselines."""

__version__ = "0.1.0"
