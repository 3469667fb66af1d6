"""Deeplearning4j's files in dl4py: ND4J arrays (``read_array``, ``write_array``) and
ModelSerializer zips of MultiLayerNetworks (``import_dl4j``, with ``plan_import`` to see what it
would do, ``param_slots`` for where each parameter goes, ``register_custom_layer`` for a DL4J
user's own layer classes), with their updater state (``StatePlan``: what becomes of it) and
normalizer; ``save_dl4j`` writes a MultiLayerNetwork back as such a zip; ``load_normalizer`` reads a ``normalizer.bin`` saved on its own (``NormalizerSerializer``)."""

from dl4py.dl4j.ndarray import DL4JFileError, read_array, write_array
from dl4py.dl4j.custom_layers import register_custom_layer, unregister_custom_layer
from dl4py.dl4j.importer import ImportPlan, import_dl4j, load_parameters, plan_import, read_dl4j_configuration
from dl4py.dl4j.normalizer_file import load_normalizer
from dl4py.dl4j.optimizer_state import StatePlan
from dl4py.dl4j.param_layout import ParamSlot, param_slots
from dl4py.dl4j.writer import save_dl4j

__all__ = ["DL4JFileError", "read_array", "write_array", "import_dl4j", "plan_import", "ImportPlan",
           "load_parameters", "read_dl4j_configuration", "ParamSlot", "param_slots", "register_custom_layer",
           "unregister_custom_layer", "StatePlan", "load_normalizer", "save_dl4j"]
