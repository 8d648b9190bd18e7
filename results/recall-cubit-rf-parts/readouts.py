"""The read-out rows of results/recall-cubit-rf-parts (regression/ and linear/): Cubit-RF's dense ablation
(kernelmix.ops.cubit_rf_parts) with readout='reference' or 'linear', registered at run time as a mixer of its
own, then the default `kernelmix recall` grid. Run from this folder:

    python readouts.py regression cubit-rf-krr,cubit-rf-krr-exact
    python readouts.py linear cubit-rf-linear,cubit-rf-linear-exact

The layer is CubitRFMixer with the `readout` option (also a layer option of cubit-rf now), so
`model.mixer_options.cubit-rf.readout=reference` in `kernelmix train` builds the same layer; the mixer's
own name here only keeps these cells apart from cubit-rf's."""
import dataclasses
import sys

from kernelmix.layers import registry
from kernelmix.layers.cubit_rf import CubitRFMixer


class KrrReadout(CubitRFMixer):
    """cubit-rf with the regression's read-out by default (the dense ablation path of CubitRFMixer)."""

    mixer_name = "cubit-rf-krr"

    def __init__(self, *, readout: str = "reference", **rest):
        super().__init__(readout=readout, **rest)


sys.modules.setdefault("krr", sys.modules[__name__])
registry.register(registry.MixerInfo(
    "cubit-rf-krr", "krr:KrrReadout", "random-features", constant_cache=True,
    options=registry.CUBIT_RF_OPTIONS, in_defaults=False,
    variants=(registry.Variant("cubit-rf-krr-exact", {"estimate": "none"}, "exact, regression read-out", op_level=False),
              registry.Variant("cubit-rf-linear", {"estimate": "gram", "readout": "linear"}, "RF Gram, linear read-out", op_level=False),
              registry.Variant("cubit-rf-linear-exact", {"estimate": "none", "readout": "linear"}, "exact Gram, linear read-out", op_level=False))))

if __name__ == "__main__":
    from kernelmix.studies.recall import run_recall
    from kernelmix.studies.settings import RecallConfig
    mixers = sys.argv[2].split(",")
    run_recall(RecallConfig(mixers=mixers, out_dir=sys.argv[1]), progress=False)
