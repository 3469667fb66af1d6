"""DL4J's ParallelWrapper.Builder options that dl4py has no use for.

A program ported from DL4J may keep them: each is accepted as a keyword argument and
noted once on the "dl4py" logger (at INFO: the program is right, it only asks for
something dl4py does another way), with the reason it has no effect. Any other unknown
keyword is a TypeError that names it and the options there are.
"""

from __future__ import annotations

import logging

log = logging.getLogger("dl4py")

WITHOUT_EFFECT = {
    "use_legacy_averaging": "the transport is chosen per job (NCCL between GPUs, gloo through the host otherwise)",
    "use_mq": "each worker already prefetches its own batches onto its own device (prefetch_buffer)",
    "workspace_mode": "PyTorch's caching allocator manages device memory; see the CUDA environment settings",
    "gradients_accumulator": "the shared-gradients plan all-reduces the exact mean gradient every step",
    "threshold_algorithm": "gradients are shared exactly, never threshold-encoded",
    "residual_post_processor": "gradients are shared exactly, so there is no residual to process",
    "trainer_factory": "every worker runs the single-device trainer's step function",
    "trainer_context_args": "every worker runs the single-device trainer's step function",
    "model_params_supplier": "each fit starts every replica from the model's state as it is then",
    "updater_params_supplier": "each fit starts every replica from the model's updater state as it is then",
}


def note_dl4j_options(given: dict, accepted: list[str]) -> None:
    """Log why each of DL4J's options in ``given`` has no effect; raise a TypeError for a
    keyword that is neither one of them nor in ``accepted``."""
    unknown = sorted(set(given) - set(WITHOUT_EFFECT))
    if unknown:
        raise TypeError(f"ParallelWrapper got an unexpected keyword argument {unknown[0]!r}; its options are "
                        f"{', '.join(accepted)} (and DL4J's {', '.join(WITHOUT_EFFECT)}, which have no effect)")
    for name in given:
        log.info("ParallelWrapper: %s has no effect in dl4py: %s", name, WITHOUT_EFFECT[name])
