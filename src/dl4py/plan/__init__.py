"""The cost model behind ``dl4py plan`` (docs/plan.md): which parallelism, on how many devices.

- ``work``: what one training step of a network costs in work, per layer, from its config
  alone (FLOPs, bytes moved, parameters, activations, kernels): ``step_work``.
- ``profile``: a device's speeds, saved as JSON; ``measure``: measuring them here
  (``measure_profile``, ``dl4py plan --profile``); ``builtin_profiles``: published figures of common GPUs, ``calibrate``
  with a measured run, ``cluster_profile`` for links between machines.
- ``model``: each plan's time per step and memory per device: ``predict``.
- ``report``: the table and the recommendation; ``command``: ``dl4py plan`` itself.
"""

from dl4py.plan.builtin_profiles import builtin_profile, calibrate, cluster_profile
from dl4py.plan.model import PLAN_NAMES, Prediction, predict
from dl4py.plan.measure import measure_profile
from dl4py.plan.profile import Curve, DeviceProfile, Link, Source, default_profile_path, load_profile, save_profile
from dl4py.plan.report import recommend
from dl4py.plan.work import KINDS, LayerWork, StepWork, step_work

__all__ = ["KINDS", "PLAN_NAMES", "Curve", "DeviceProfile", "LayerWork", "Link", "Prediction", "Source", "StepWork",
           "builtin_profile", "calibrate", "cluster_profile", "default_profile_path", "load_profile",
           "measure_profile", "predict", "recommend", "save_profile", "step_work"]
